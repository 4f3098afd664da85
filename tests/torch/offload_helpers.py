"""Shared helpers of the activation-offload mechanics tests (``test_offload_*.py``)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from torch_test_devices import device_with_link, is_fake_device  # noqa: E402


def sanitized_device(backend: Any, make_fake_device: Any, *, link: str = "slow", **options: Any) -> Any:
    """On the fake device: a fresh sanitized one (``link``, extra options); elsewhere the backend itself."""
    if is_fake_device(backend):
        return make_fake_device(link=link, **options)
    if options:
        pytest.skip(f"device options {sorted(options)} exist only on the fake device")
    return device_with_link(backend, "unlimited", make_fake_device)


def settle(device: Any, *, collect: bool = False) -> None:
    """Let every copy offcore started land and release what it held.

    offcore's records form no reference cycles, so dropped graphs are freed by reference
    counting alone; ``collect=True`` also runs the cycle collector (slow with torch loaded).
    """
    if collect:
        gc.collect()
    offcore_torch.synchronize(device)


def pool_used_bytes(device: Any) -> int:
    """Bytes handed out by offcore's host pools on ``device`` right now."""
    return sum(pool.used_bytes for pool in runtime_for(device).pools)


def same_storage(a: Any, b: Any) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Probe(torch.autograd.Function):
    """``sum`` of its inputs whose backward records the saved tensors it gets back (in ``Probe.seen``)."""

    seen: list[tuple[Any, ...]] = []

    @staticmethod
    def forward(ctx: Any, *tensors: Any) -> Any:
        ctx.save_for_backward(*tensors)
        return sum(t.sum() for t in tensors)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        saved = ctx.saved_tensors
        Probe.seen.append(tuple(t.detach() for t in saved))
        return tuple(grad.expand_as(t) for t in saved)
