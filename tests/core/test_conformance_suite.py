"""The conformance suite itself: it passes on a correct backend and fails on a broken one.

Runs ``offcore.testing.BackendConformance`` in a pytest subprocess against the
synchronous numpy reference backend (``reference_backend.py``) and against a copy of
it that ignores strides, so the suite is shown to be able to fail.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import offcore
import reference_backend
from offcore.testing import BackendConformance

offcore.register_plugin(reference_backend.Plugin(), name="reference-plugin")

class TestReference(BackendConformance):
    backend_spec = "reference"
    buffer_kind = "numpy"
    hypothesis_examples = 15
    max_fill_bytes = 64 << 20

class TestBrokenStrides(BackendConformance):
    backend_spec = "broken_strides"
    hypothesis_examples = 20
    hypothesis_derandomize = True
"""


def test_suite_passes_on_a_correct_backend_and_catches_a_broken_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = str(Path(__file__).parent)
    monkeypatch.setenv("OFFCORE_BACKEND_AUTOLOAD", "0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "-q")
    out = result.stdout.str()
    outcomes = dict(
        (nodeid.split("::", 1)[1], status)
        # (a skipped test's summary line names its file and line, not its node id: it is left out)
        for status, nodeid in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+)", out, re.M)
    )
    reference = {k: v for k, v in outcomes.items() if k.startswith("TestReference::")}
    broken = {k: v for k, v in outcomes.items() if k.startswith("TestBrokenStrides::")}
    assert len(reference) >= 30, out
    assert set(reference.values()) == {"PASSED"}, {k: v for k, v in reference.items() if v != "PASSED"}

    def status(test: str) -> str:
        return broken[f"TestBrokenStrides::{test}"]

    # ignoring strides is invisible to contiguous copies and to 'offset' views ...
    assert status("test_copy_is_exact_for_every_dtype[broken_strides-pinned-to-device]") == "PASSED"
    assert status("test_copy_is_exact_for_non_contiguous_views[broken_strides-offset-h2d]") == "PASSED"
    # ... and caught for every transposed or strided source, in every direction
    for layout in ("transposed", "strided"):
        for direction in ("h2d", "d2h", "d2d", "h2h"):
            assert (
                status(f"test_copy_is_exact_for_non_contiguous_views[broken_strides-{layout}-{direction}]") == "FAILED"
            )
    assert status("test_copy_is_exact_for_random_shapes_and_layouts[broken_strides]") == "FAILED"
    assert result.ret == 1


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "offset"])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (2, 3), (1, 4, 1)])
def test_buffer_kits_read_every_layout_in_logical_order(kind: str, layout: str, shape: tuple[int, ...]) -> None:
    import numpy as np

    from offcore.testing import buffer_kit
    from offcore.testing.conformance import _apply_layout, _base_shape, _layout_fits

    if kind == "torch":
        pytest.importorskip("torch")
    if not _layout_fits(layout, shape):
        pytest.skip(f"{layout} needs more dimensions than {shape}")
    kit = buffer_kit(kind)
    base_shape = _base_shape(layout, shape)
    raw_bytes = np.arange(4 * int(np.prod(base_shape)), dtype=np.uint32).astype(np.uint8)
    raw = np.zeros(raw_bytes.size, np.uint8)
    if kind == "torch":
        import torch

        raw = torch.from_numpy(raw)
    base = kit.typed(raw, "float32", base_shape)
    kit.write(base, raw_bytes)
    view = _apply_layout(layout, base, kit.swap_last_axes)
    reference = _apply_layout(layout, raw_bytes.view(np.float32).reshape(base_shape), lambda a: np.swapaxes(a, -1, -2))
    np.testing.assert_array_equal(kit.read(view), np.ascontiguousarray(reference).reshape(-1).view(np.uint8))
