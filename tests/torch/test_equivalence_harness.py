"""The equivalence harness itself: it must see a one-bit difference, and nothing when there is none."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_torch.models import mlp_workload, view_saver_workload  # noqa: E402
from offcore_torch.testing import assert_bit_identical, bit_identical, run_workload  # noqa: E402


@contextlib.contextmanager
def corrupt_one_saved_tensor() -> Iterator[None]:
    """A deliberately broken 'offload': the first large saved tensor comes back one ulp off."""
    state = {"done": False}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        if state["done"] or not tensor.is_floating_point() or tensor.numel() < 64 or tensor.requires_grad:
            return tensor
        state["done"] = True
        bad = tensor.detach().clone()
        flat = bad.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        return bad

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def test_identical_runs_compare_equal(make_fake_device: Callable[..., Any]) -> None:
    work = view_saver_workload(batch_size=8)
    first = run_workload(work, device=make_fake_device())
    second = run_workload(work, device=make_fake_device())
    assert_bit_identical(first, second)
    assert len(first.losses) == 3 and len(first.grads) == 3 and first.params


def test_a_one_ulp_corruption_of_a_saved_tensor_is_reported(make_fake_device: Callable[..., Any]) -> None:
    work = mlp_workload(d_in=16, width=32, depth=2, d_out=4, batch_size=16)
    reference = run_workload(work, device=make_fake_device())
    corrupted = run_workload(work, device=make_fake_device(), offload=corrupt_one_saved_tensor)
    with pytest.raises(AssertionError, match=r"step 0 gradient '.*': \d+ of \d+ elements differ"):
        assert_bit_identical(reference, corrupted)


def test_a_different_seed_is_reported_with_the_loss(make_fake_device: Callable[..., Any]) -> None:
    work = view_saver_workload(batch_size=8)
    with pytest.raises(AssertionError, match="step 0 loss: 1 of 1 elements differ"):
        assert_bit_identical(
            run_workload(work, device=make_fake_device()), run_workload(work, device=make_fake_device(), seed=1)
        )


def test_bit_identical_is_stricter_than_equal() -> None:
    assert not bit_identical(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bit_identical(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not bit_identical(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert bit_identical(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))
    assert bit_identical(torch.tensor([3]), torch.tensor([3]))
