"""Restore is exact in what the bytes do not say: lazy conj/neg bits and shared version counters.

The values of a saved tensor are its storage's bytes, which offcore copies. Two more
things travel with a tensor: the lazy conjugate and negative bits of ``z.conj()`` /
``torch._neg_view`` views (storage.py Note [Lazy conj and neg bits]) and the version
counter its family shares (Note [Restore through the version keeper]). Lose either
and backward computes a different number without any error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device, settle  # noqa: E402
from torch_test_devices import take_in_place_writes_of_saved_tensors  # noqa: E402

from offcore.errors import SavedTensorModifiedError  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="unlimited")


def grads(dev: Any, loss_fn: Callable[..., Any], *shapes: tuple[int, ...], offload: bool, dtype: Any) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    with dev:
        leaves = [
            torch.randn(*shape, dtype=dtype, generator=gen).to(dev.torch_device).requires_grad_() for shape in shapes
        ]
        if offload:
            with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
                loss = loss_fn(*leaves)
            assert handle.stats().offloaded_storages > 0, "the case must exercise an offloaded restore"
        else:
            loss = loss_fn(*leaves)
        loss.backward()
    settle(dev)
    return [leaf.grad for leaf in leaves]


LAZY_BIT_CASES: dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...]]] = {
    # the reproduction: z * z.conj() saves the lazy view z.conj() for a's gradient
    "z * z.conj()": (lambda a, b: ((z := a * b) * z.conj()).real.sum(), ((64, 64), (64, 64))),
    "neg bit: (a * 1).conj().imag": (lambda a: ((a * 1).conj().imag * (a * 2).real).sum(), ((64, 64),)),
    ".mH": (lambda a, b: ((a * 1).mH @ b).abs().sum(), ((32, 32), (32, 32))),
    ".adjoint()": (lambda a, b: (b @ (a * 1).adjoint()).real.sum(), ((32, 32), (32, 32))),
    "x.conj() @ y": (lambda a, b: ((a * 1).conj() @ (b * 1)).imag.sum(), ((32, 32), (32, 32))),
    "_neg_view": (lambda a: (torch._neg_view(a * 1) * (a * 3)).abs().sum(), ((64, 64),)),
}


@pytest.mark.parametrize("case", sorted(LAZY_BIT_CASES))
def test_lazy_conj_and_neg_bits_survive_the_round_trip(dev: Any, case: str) -> None:
    loss_fn, shapes = LAZY_BIT_CASES[case]
    ref = grads(dev, loss_fn, *shapes, offload=False, dtype=torch.complex64)
    got = grads(dev, loss_fn, *shapes, offload=True, dtype=torch.complex64)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g), f"{case}: gradient differs by up to {(r - g).abs().max().item():.3g}"


class SavesTwoViews(torch.autograd.Function):
    """Saves a tensor and a view of it; backward reads the first back twice and modifies it in between."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        y = x * 1
        ctx.save_for_backward(y, y.view(-1))
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        first, _ = ctx.saved_tensors
        first.mul_(10)  # modifies the storage both saved tensors share
        _, flat = ctx.saved_tensors  # torch without hooks raises here
        return grad * flat.view_as(grad)


def test_restored_views_share_a_version_counter(dev: Any) -> None:
    with dev:
        x = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            SavesTwoViews.apply(x).sum().backward()  # the reference: torch itself refuses
        x.grad = None
        with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            out = SavesTwoViews.apply(x).sum()
        assert handle.stats().offloaded_storages == 1, "both saves share one offloaded storage"
        with pytest.raises(SavedTensorModifiedError, match="modified in place after forward saved it"):
            out.backward()
        assert x.grad is None, "no gradient was computed from modified data"
    settle(dev)


class ReadsTwoViewsOnce(torch.autograd.Function):
    """Saves a tensor and a view of it; backward unpacks both, then modifies one: the other sees it."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        y = x * 1
        ctx.save_for_backward(y, y.t())
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        a, b = ctx.saved_tensors
        versions = (a._version, b._version)
        a.add_(1)
        assert b._version == versions[1] + 1, "the restored views do not share a version counter"
        return grad * b.t()


def test_restored_views_behave_as_the_originals_did(dev: Any) -> None:
    with dev:
        x = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        ReadsTwoViewsOnce.apply(x).sum().backward()  # torch shares the counter (and the data): no error
        ref, x.grad = x.grad, None
        with offcore_torch.offload_activations(dev, min_bytes=0):
            out = ReadsTwoViewsOnce.apply(x).sum()
        out.backward()
        assert torch.equal(ref, x.grad)
    settle(dev)
    # backward's a.add_(1) may run while the D2H copy of y (forward just ended) still reads it: a race the
    # sanitizer reports; offcore reuses the device original and drops that host copy
    take_in_place_writes_of_saved_tensors(dev)


def test_a_retained_graph_never_reads_a_restore_modified_in_backward(dev: Any) -> None:
    class ModifiesItsSave(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            y = x * 1
            ctx.save_for_backward(y)
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (y,) = ctx.saved_tensors
            out = grad * y
            y.mul_(3)
            return out

    with dev:
        x = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        ref = ModifiesItsSave.apply(x).sum()
        ref.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            ref.backward()  # torch refuses the second pass
        x.grad = None
        with offcore_torch.offload_activations(dev, min_bytes=0):
            out = ModifiesItsSave.apply(x).sum()
        out.backward(retain_graph=True)
        first = x.grad.clone()
        try:
            out.backward()  # offcore may refuse too, or read forward's values again from the host copy
        except SavedTensorModifiedError:
            assert torch.equal(first, x.grad)
        else:
            assert torch.equal(first * 2, x.grad), "the second pass read the storage the first one modified"
    settle(dev)
    take_in_place_writes_of_saved_tensors(dev)  # y.mul_(3) in backward: as in the test above
