"""What an offloaded saved tensor keeps alive for the cyclic garbage collector, from forward to backward.

Everything a saved tensor keeps alive until backward is promoted to the collector's oldest
generation and walked by every full collection after; at thousands of saves per step that is a
full collection or two per step, paid on the thread that launches kernels (Note [An entry's
records], Note [Saved tensors share their metadata]). Per offloaded saved tensor the binding and
the core keep five such objects: autograd's record of it (``Offloaded``), the weak reference its
entry holds to that record, the record's version keeper (a tensor), the storage's entry (itself
the weak reference to the storage), and the core's ``ManagedObject``. This counts them, so a
change that adds one per save fails here, not in a benchmark.

It runs on the instant backend (:mod:`offcore_torch.instant`: copies and events complete at
once), so what it counts is offcore's alone: a backend's own records (the fake device's
sanitizer keeps its access records per buffer, for instance) are not offcore's footprint.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.instant import register_instant  # noqa: E402

import offcore  # noqa: E402

pytestmark = pytest.mark.torch

PER_SAVE = 5  # see the module doc
# a few objects either way per step that are not one per save (the copy timings sampled every so many
# copies, a table's resize): well under one more object per save, which is what this catches
SLACK = 0.5


def _kept_objects(dev: Any, x: Any, saves: int) -> int:
    """Objects the collector tracks after a forward of ``saves`` offloaded saves (landed, before backward)."""

    def forward() -> tuple[Any, Any]:
        handle = offcore_torch.offload_activations(dev, min_bytes=0, prefetch="deadline")
        with handle:
            y = x * 1.0
            for _ in range(saves):
                y = torch.sin(y)
            loss = y.sum()
        return handle, loss

    handle, loss = forward()  # warm-up: pools, tables, the scheduler's learned step
    loss.backward()
    del handle, loss
    offcore_torch.synchronize(dev)
    gc.disable()  # no automatic collection while counting (explicit ones still run)
    try:
        gc.collect()
        before = len(gc.get_objects())
        handle, loss = forward()
        offcore_torch.synchronize(dev)  # every copy landed: nothing in flight holds an object
        gc.collect()  # untracks what the collector stops tracking at its first pass (tuples of ints)
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert handle.stats().offloaded_storages == saves, handle.stats()  # every save was offloaded
    loss.backward()
    x.grad = None
    del handle, loss
    offcore_torch.synchronize(dev)
    return grown


def test_an_offloaded_saved_tensor_keeps_five_objects_for_the_collector() -> None:
    register_instant()  # here, not at import: a test of the registry before this one may have reset it
    dev = offcore.device("instant", capacity="1GiB")
    with dev:
        x = torch.randn(1024, device=dev.torch_device, requires_grad=True)
        # the difference of two step lengths: what the region holds once (its hooks, its tables) cancels
        few, many = _kept_objects(dev, x, 100), _kept_objects(dev, x, 400)
    per_save = (many - few) / 300
    assert per_save <= PER_SAVE + SLACK, (
        f"an offloaded saved tensor keeps {per_save:.2f} objects for the cyclic collector until backward "
        f"(bound {PER_SAVE}): each is walked by every full collection (Note [An entry's records])"
    )
