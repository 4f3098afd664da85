"""torchtune's activation-offloading tests, run with offcore on the test device.

Ported from ``tests/torchtune/training/test_activation_offloading.py`` of pytorch/torchtune
(each test names the one it comes from). torchtune's ``OffloadActivations(use_streams=...)``
becomes ``offload_activations(dev, min_bytes=0, prefetch=...)``: with or without a copy
stream there becomes deadline prefetch (copies overlap compute) or on-demand reloads.
torchtune's tests need a GPU and make a slow kernel with ``torch.cuda._sleep`` so that a
freed buffer would be overwritten before it is read; here the fake device's sanitizer
plays that part (copies land late, with jitter, and freed host buffers are poisoned), so
the tests run everywhere. torchtune's ``ctx.fwd_stash = {}`` (defeating its own
keep-in-forward heuristic) becomes ``settle(dev)`` inside the region: every copy landed
and offcore let go of the device storages, so backward must bring them back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import pool_used_bytes, sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

PREFETCH = ["deadline", "on_demand"]


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def region(dev: Any, offload: bool, prefetch: str = "deadline") -> Any:
    if not offload:
        return contextlib.nullcontext()
    return offcore_torch.offload_activations(dev, min_bytes=0, prefetch=prefetch)


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_offloading_is_same_as_without(dev: Any, prefetch: str) -> None:
    """test_offloading_is_same_as_without[use_streams]."""

    def grads(offload: bool) -> list[Any]:
        with dev:
            torch.manual_seed(2024)
            model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10), nn.ReLU())
            model = model.to(dev.torch_device)
            torch.manual_seed(0)
            inp = torch.randn(2, 10, device=dev.torch_device)
            with region(dev, offload, prefetch) as handle:
                loss = model(inp).sum()
            loss.backward()
        if offload:
            assert handle.stats().offloaded_storages > 0
        return [p.grad for p in model.parameters()]

    for got, expected in zip(grads(True), grads(False), strict=True):
        assert torch.equal(got, expected)


# -- test_offloading_works_with_view_outputs -----------------------------------------------
class BwdReturnsViewOfActivation(torch.autograd.Function):
    """Saves a transposed activation; backward returns a view of the unpacked tensor."""

    @staticmethod
    def forward(ctx: Any, activation: Any) -> Any:
        ctx.save_for_backward(activation.t())
        return torch.rand(2, 4, device=activation.device)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        (unpacked,) = ctx.saved_tensors
        return unpacked.t()


class NoOp(torch.autograd.Function):
    """Passes the view along (saving something of its own), so the unpacked tensor outlives its node."""

    @staticmethod
    def forward(ctx: Any, activation: Any) -> Any:
        ctx.save_for_backward(activation)
        return activation.clone()

    @staticmethod
    def backward(ctx: Any, viewed: Any) -> Any:
        _ = ctx.saved_tensors  # unpacked all the same: the reload is what is tested
        return viewed


class ComputeNode(torch.autograd.Function):
    """Reads the view late (torchtune queues a second of GPU work first): it must still hold ones."""

    @staticmethod
    def forward(ctx: Any, activation: Any) -> Any:
        return activation.clone()

    @staticmethod
    def backward(ctx: Any, viewed: Any) -> Any:
        return viewed == 1


class InspectEarlierActivation(torch.autograd.Function):
    """Saves 5s; backward checks the gradient is all ones (not the 5s a reused buffer would hold)."""

    @staticmethod
    def forward(ctx: Any, activation: Any) -> Any:
        ctx.save_for_backward(torch.ones_like(activation) * 5)
        return activation

    @staticmethod
    def backward(ctx: Any, viewed_all_ones: Any) -> Any:
        (corrupter,) = ctx.saved_tensors
        assert torch.all(viewed_all_ones), "a view of an unpacked tensor was overwritten before it was read"
        return corrupter


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_offloading_works_with_view_outputs(dev: Any, prefetch: str) -> None:
    """test_offloading_works_with_view_outputs: a backward output that is a view of an unpacked tensor.

    offcore must not free (or let the pool reuse) the restored storage while the view is
    still on its way through the backward graph.
    """

    def run(offload: bool) -> Any:
        with dev:
            t = torch.ones(64, 128, device=dev.torch_device, requires_grad=True)
            with region(dev, offload, prefetch) as handle:
                a = InspectEarlierActivation.apply(t)
                b = ComputeNode.apply(a)
                c = NoOp.apply(b)
                loss = BwdReturnsViewOfActivation.apply(c).sum()
                settle(dev)
            del a, b, c
            loss.backward()
            del loss
            settle(dev)
        if offload:
            stats = handle.stats()
            assert stats.saved_tensors == 3 and stats.reloaded_bytes > 0, stats
            assert pool_used_bytes(dev) == 0
        return t.grad

    assert torch.equal(run(True), run(False))


# -- test_offloading_works_with_view_ac_cached_buffers -------------------------------------
class A(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ones: Any) -> Any:
        ctx.save_for_backward(ones * 5)  # a buffer of 5s: what a corrupted read would see
        return ones

    @staticmethod
    def backward(ctx: Any, activation_is_ones: Any) -> Any:
        _ = ctx.saved_tensors  # unpacked all the same: the reload is what is tested
        assert torch.all(activation_is_ones), "checkpoint's cached view of an unpacked tensor was overwritten"
        return activation_is_ones


class B(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ones: Any) -> Any:
        ctx.save_for_backward(ones.clone())
        return ones.clone()  # C saves a view of this

    @staticmethod
    def backward(ctx: Any, activation_is_ones: Any) -> Any:
        _ = ctx.saved_tensors  # unpacked all the same: the reload is what is tested
        return activation_is_ones.clone()


class C(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ones: Any) -> Any:
        ctx.save_for_backward(ones.t().t())  # a view of B's output, recomputed by checkpoint
        return ones.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        (saved,) = ctx.saved_tensors
        return saved == 1


class D(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ones: Any) -> Any:
        ctx.save_for_backward(torch.rand_like(ones))
        return torch.rand_like(ones)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        _ = ctx.saved_tensors  # unpacked all the same: the reload is what is tested
        return torch.rand_like(grad)


class E(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ones: Any) -> Any:
        ctx.save_for_backward(torch.rand_like(ones))  # something to make checkpoint recompute
        return torch.rand_like(ones)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        _ = ctx.saved_tensors  # unpacked all the same: the reload is what is tested
        return torch.rand_like(grad)


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_offloading_works_with_view_ac_cached_buffers(dev: Any, prefetch: str) -> None:
    """test_offloading_works_with_view_ac_cached_buffers: checkpoint caches a view of an unpacked tensor."""

    def checkpointed_region(b: Any) -> Any:
        return E.apply(D.apply(C.apply(b)))

    def run(offload: bool) -> Any:
        with dev:
            torch.manual_seed(0)
            t = torch.ones(64, 128, device=dev.torch_device, requires_grad=True)
            with region(dev, offload, prefetch) as handle:
                b = B.apply(A.apply(t))
                loss = checkpoint(checkpointed_region, b, use_reentrant=False).sum()
                settle(dev)
            del b
            loss.backward()
        if offload:
            assert handle.stats().offloaded_storages >= 2 and handle.stats().reloaded_bytes > 0, handle.stats()
        return t.grad

    assert torch.equal(run(True), run(False))


class SaveTransposed(torch.autograd.Function):
    """Saves a view of its input made in forward, as BwdReturnsViewOfActivation does."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.save_for_backward(x.t())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        (xt,) = ctx.saved_tensors
        return grad * xt.t()


def test_a_view_saved_in_a_custom_functions_forward_is_offloaded(dev: Any) -> None:
    """Found porting test_offloading_works_with_view_outputs: BwdReturnsViewOfActivation's save stays on the device."""
    with dev:
        leaf = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            out = SaveTransposed.apply(leaf * 2).sum()
        out.backward()
    stats = handle.stats()
    assert stats.kept == {} and stats.offloaded_storages == 1, stats
