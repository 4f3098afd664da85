"""offcore_layout: the one rule for copies between different dtypes or shapes, for every backend."""

from __future__ import annotations

import doctest

import numpy as np
import offcore_layout
import pytest
from offcore_layout import NUMPY, match_layout

import offcore


def test_docstring_examples() -> None:
    result = doctest.testmod(offcore_layout, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


def test_numpy_reinterprets_the_contiguous_side_only() -> None:
    raw = np.zeros(24, np.uint8)
    typed = np.arange(6, dtype=np.float32).reshape(2, 3).T  # non-contiguous
    d, s = match_layout(raw, typed, NUMPY)
    assert d.dtype == np.float32 and d.shape == (3, 2) and s is typed and np.shares_memory(d, raw)
    d, s = match_layout(typed, raw, NUMPY)
    assert d is typed and s.dtype == np.float32 and s.shape == (3, 2)
    same = np.zeros((3, 2), np.float32)[:, ::1]
    assert match_layout(same, typed, NUMPY) == (same, typed)  # same layout: both as they are, any strides


def test_errors_name_both_sides() -> None:
    with pytest.raises(offcore.ConfigurationError, match=r"equal byte counts: dst numpy uint8\[8\] has 8 bytes"):
        match_layout(np.zeros(8, np.uint8), np.zeros(1, np.float32), NUMPY)
    a = np.zeros((4, 6), np.float32)[:, ::2]
    b = np.zeros((6, 2), np.float64).T
    with pytest.raises(offcore.ConfigurationError, match="neither side is contiguous"):
        match_layout(a, b[:, :3], NUMPY)


def test_torch_one_rule_for_the_fake_device_and_the_accelerator_base() -> None:
    torch = pytest.importorskip("torch")
    import offcore_accelerator
    from offcore_cpu.torch_buffers import TORCH_OPS

    # a one-element view keeps its stride (2): reinterpreting it needs a stride-1 flat view
    single = torch.zeros(2)[::2]
    assert single.is_contiguous() and single.stride() == (2,)
    d, s = offcore_accelerator.match_layout(single, torch.tensor([7], dtype=torch.int32))
    assert d.dtype == torch.int32 and d.data_ptr() == single.data_ptr()

    raw = torch.zeros(24, dtype=torch.uint8)
    typed = torch.arange(6, dtype=torch.float32).view(2, 3).t()
    TORCH_OPS.copy(raw, typed)
    assert raw.view(torch.float32).tolist() == typed.reshape(-1).tolist()

    a = torch.zeros(4, 4, dtype=torch.int32).t()
    b = torch.zeros(4, 4).t()
    messages = []
    for copy in (offcore_accelerator.match_layout, TORCH_OPS.copy):
        with pytest.raises(offcore.ConfigurationError, match="neither side is contiguous") as caught:
            copy(a, b)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_typed_prefix_views_the_first_bytes() -> None:
    torch = pytest.importorskip("torch")
    raw = torch.arange(32, dtype=torch.uint8)
    view = offcore_layout.typed_prefix(raw, torch.int16, (2, 3))
    assert view.shape == (2, 3) and view.data_ptr() == raw.data_ptr()
    assert view.reshape(-1).view(torch.uint8).tolist() == list(range(12))
