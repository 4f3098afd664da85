"""The activation region's module-level helpers: profiler ranges, autograd probes, the in-flight cap's
allocation reader, and the dispatch of landed copies (``poll``, ``synchronize``).

Moved from offload.py (which re-exports ``poll`` and ``synchronize``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from offcore.errors import (
    CapacityExceededError,
)
from offcore.kinds import Direction
from offcore_torch.runtime import (
    DeviceRuntime,
    runtime_of,
)

_NO_RANGE = contextlib.nullcontext()
_profiler = torch.autograd.profiler  # ``_profiler._is_profiler_enabled`` is read at every copy


_RANGE_NAMES = {Direction.D2H: "offcore::d2h", Direction.H2D: "offcore::h2d"}


def _range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.profiler.record_function`` range, only while a profiler runs (free otherwise)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE


def _current_op() -> str:
    """The backward node being run, if autograd tells (for error messages)."""
    getter = getattr(torch._C, "_current_autograd_node", None)
    node = getter() if getter is not None else None
    if node is None:
        return "an unknown backward op"
    try:
        return str(node.name())
    except Exception:  # pragma: no cover - defensive: a node without a name
        return type(node).__name__


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
_current_autograd_node = torch._C._current_autograd_node


def _graph_task_id() -> int:
    """Autograd's id of the backward pass running now (-1 outside backward or when torch does not tell)."""
    return int(_GRAPH_TASK_ID()) if _GRAPH_TASK_ID is not None else -1


def _inside_checkpoint() -> bool:
    """True when the innermost saved-tensor hooks are torch.utils.checkpoint's (forward or recompute)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        hooks = top(False)
    except Exception:
        return False
    if not hooks:
        return False
    pack = hooks[0]
    return getattr(pack, "__module__", "") == "torch.utils.checkpoint"


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (CapacityExceededError, torch.OutOfMemoryError))


class _CopyRefused(Exception):
    """A copy could not be submitted; the tensor stays on the device (internal to pack)."""


class _AllocatedBytes:
    """A probe of the device bytes allocated now, by the backend's own accounting (the scheduler's device budget).

    Note [One read of the device per trigger]: the prefetches one trigger starts run back to
    back, and between two of them only offcore allocates (their device buffers; an eviction
    only frees). So inside a trigger (``batch``) the backend is read once and each started
    prefetch's bytes are added, rounded up to 512 (a caching allocator's granule: never an
    underestimate); outside one every call reads the backend. The scheduler sees the same
    figures a read per prefetch would give (a freed eviction aside, which only makes it more
    careful), and a recorded step logs each figure it was given, so a replay is unchanged.
    Holds the device only (no region <-> scheduler cycle). Reads the backend's optional
    ``allocated_bytes()`` where it has one (the same figure without building the stats),
    else ``memory_stats()``; both looked up on the device at each read, never cached.
    """

    __slots__ = ("device", "batch", "value", "added")

    def __init__(self, device: Any) -> None:
        self.device = device
        self.batch = False
        self.value: int | None = None
        self.added = 0

    def read(self) -> int:
        """The device's allocated bytes now, by its own accounting."""
        device = self.device
        fast = getattr(device, "allocated_bytes", None)  # optional member (offcore.protocols.OPTIONAL_MEMBERS)
        if fast is not None:
            return int(fast())
        return int(device.memory_stats().get("allocated_bytes", 0) or 0)

    def __call__(self) -> int:
        if not self.batch:
            return self.read()
        value = self.value
        if value is None:
            value = self.value = self.read()
        return value + self.added

    def allocated(self, nbytes: int) -> None:
        if self.batch:
            self.added += -(-nbytes // 512) * 512

    def end(self) -> None:
        self.batch = False
        self.value = None
        self.added = 0


# Note [Activation copies in flight are capped]
# A saved storage's device memory is held by offcore from its device-to-host copy's start until
# the copy landed (Note [When may a device copy be freed?] in offcore.objects); then the region
# drops it. When forward makes saved bytes faster than the link moves them, held storages pile up,
# and the device peak would depend on the link's speed and the machine's load instead of being a
# bound the user can plan for. ``max_inflight`` (policy; default 256 MiB, None: no cap) caps the
# bytes of the device's activation copies in flight (``DeviceRuntime.d2h_bytes_in_flight``, all
# regions of the device together): before starting a storage's copy, while those bytes plus the
# storage's would exceed the cap, forward waits on the OLDEST copy's event (the D2H stream is in
# order, so it lands first), and poll() hands the landed copies to their regions, which free them;
# never a sleep. A storage is always let through when nothing is in flight, so a cap below one
# storage (0 included) is "one copy at a time". The wait is exposed wait (stats: inflight_waits,
# inflight_wait_s, and the waits entry _INFLIGHT_WAIT). The rule is the core's (Note [Copies in
# flight are capped] in offcore/inflight.py, ``must_wait``): the same caps gradients (Note
# [In-flight gradients are capped] in optimizer.py), and the simulator applies it
# (Plan.max_inflight). Offcore's bound, then: the bytes it holds for copies in flight are at most
# max(cap, largest saved storage); whatever else holds a storage (the graph's next op, the
# caller) holds it with or without offload.
_INFLIGHT_WAIT = "device-to-host copies in flight (max_inflight)"


# ------------------------------------------------------------------------ landings
def poll(runtime: DeviceRuntime) -> None:
    """Poll ``runtime`` and hand each device-to-host copy that landed to the region that started it.

    Note [Landings are returned, not called back] (runtime.py): the runtime returns the
    landings; this binding dispatches them, so any region's pack or unpack, or a call to
    :func:`synchronize`, settles every region's copies, active or finished.
    """
    runtime.poll()
    landed = runtime._landed  # the runtime's queue of landings (what take_landed empties), drained in order
    while landed:
        entry, failure = landed.popleft()
        entry.region._on_landed(entry, failure)


def synchronize(device: Any) -> None:
    """Wait for every copy offcore_torch has in flight on ``device`` and run every release waiting on one.

    Afterwards every host buffer and device buffer offcore no longer needs is back
    (useful before measuring memory, and in tests). Called inside an offload region, it first
    copies the region's open group of small storages (as ``handle.synchronize()`` does), so
    that every saved tensor offcore offloads is on the host afterwards; only the regions
    entered on the calling thread (a region's pack hook runs on its own thread).

        >>> offcore_torch.synchronize(dev)                       # doctest: +SKIP
    """
    runtime = runtime_of(device)
    if runtime is None:
        return
    if runtime.open_groups:
        thread = threading.get_ident()
        with runtime.lock:
            mine = [region for region, entered_on in runtime.open_groups.items() if entered_on == thread]
        for region in mine:
            region._flush_group()
    while True:  # handing out landings may defer releases on copies still in flight
        runtime.synchronize()
        poll(runtime)
        if not (runtime.deferred_count or runtime.d2h_in_flight):
            return
