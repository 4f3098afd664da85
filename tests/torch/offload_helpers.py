"""Shared helpers of the activation-offload mechanics tests (``test_offload_*.py``)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from torch_test_devices import device_with_link, is_fake_device  # noqa: E402

from offcore.scheduler import PrefetchPlan, Scheduler, StepObservation  # noqa: E402


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


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep every object alive now out of the cycle collector's walks until the block ends.

    The conftests freeze the heap that imports and collection built; a test that
    collects after every injected fault also freezes what it set up itself (the lazily
    imported parts of torch, the model, the reference results), so each ``gc.collect()``
    walks only what the steps since made. Cycles among new objects are still found. On
    exit the heap is collected once and frozen again, as the session had it.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def pool_used_bytes(device: Any) -> int:
    """Bytes handed out by offcore's host pools on ``device`` right now."""
    return sum(pool.used_bytes for pool in runtime_for(device).pools)


def memory_levels(device: Any) -> dict[str, int]:
    """Device bytes and pageable bytes by the device's accounting, and the bytes offcore's pinned pools have
    handed out (a pool keeps its reservation for the next step, as a caching allocator does:
    tests/torch/test_offload_leaks.py measures the same)."""
    stats = device.memory_stats()
    levels = {key: int(stats.get(key, 0)) for key in ("allocated_bytes", "pageable_bytes")}
    levels["pinned pool in use"] = pool_used_bytes(device)
    return levels


class BadBatch(Exception):
    """What a test's bad batch raises: the user's error, never offcore's."""


@contextlib.contextmanager
def backward_raises_after(module: torch.nn.Module) -> Iterator[None]:
    """Inside, a backward raises :class:`BadBatch` once it reaches ``module``'s output: it fails halfway, after
    the gradients of what the forward ran later. (A tensor hook: not for outputs that ops modify in place.)"""

    def raise_in_backward(grad: torch.Tensor) -> None:
        raise BadBatch("a bad batch: the backward raises")

    def hook(module: Any, args: Any, output: torch.Tensor) -> None:
        output.register_hook(raise_in_backward)

    removable = module.register_forward_hook(hook)
    try:
        yield
    finally:
        removable.remove()


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


def copied_bytes(device: Any) -> dict[str, int]:
    """Bytes the device itself moved so far per direction (``d2h``, ``h2d``), from its ledger, not offcore's counters."""
    copies = device.ledger.snapshot()["copies"]
    return {direction: int(copies.get(direction, {}).get("bytes", 0)) for direction in ("d2h", "h2d")}


def moved_since(device: Any, before: dict[str, int]) -> dict[str, int]:
    """Bytes moved per direction since ``before`` (a :func:`copied_bytes`)."""
    now = copied_bytes(device)
    return {direction: now[direction] - before[direction] for direction in now}


class FixedScheduler(Scheduler):
    """A scheduler whose plans depend on no measured time, so what it decides is the same on every run.

    It predicts that backward uses the saved tensors one ``spacing`` apart, in the order
    the last observed backward first used them (an order, not times: the same on every
    run), or in reverse save order before any backward was observed; every reload is
    predicted to take ``duration`` seconds, so with ``duration < spacing`` a reload is due
    exactly one unpack before its use. With ``eager=True`` every reload is due at the end
    of forward (Note [Prefetch from the end of forward]). Each plan is kept in ``plans``.
    """

    def __init__(self, *, spacing: float = 1.0, duration: float = 0.5, eager: bool = False) -> None:
        super().__init__(margin=0.0)
        self.spacing, self.duration, self.eager = spacing, duration, eager
        self.plans: list[PrefetchPlan] = []
        self.use_order: list[int] = []

    def observe(self, step: StepObservation) -> None:
        super().observe(step)
        if step.first_use:
            self.use_order = sorted(step.first_use, key=lambda key: (step.first_use[key], key))

    def plan(
        self,
        step: StepObservation,
        offloaded: Any,
        duration: Any,
        margin: float | None = None,
        readers: Any = None,
    ) -> PrefetchPlan:
        order = [k for k in self.use_order if k in step.pack_times]
        order += sorted((k for k in step.pack_times if k not in set(order)), reverse=True)
        use_times = {key: rank * self.spacing for rank, key in enumerate(order)}
        fixed = self.spacing * (len(order) + 1) if self.eager else self.duration
        plan = PrefetchPlan(use_times, offloaded, lambda nbytes: fixed, margin=0.0, readers=readers)
        self.plans.append(plan)
        return plan
