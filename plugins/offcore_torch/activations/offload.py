"""Activation offload: saved-tensor hooks that move what autograd saves to the host and back.

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="1GiB", sanitize=True)
    >>> with dev:
    ...     model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    ...     x = torch.randn(512, 256)
    ...     with offcore_torch.offload_activations(dev, min_bytes="64KiB") as handle:
    ...         loss = model(x).square().mean()
    ...     loss.backward()
    >>> handle.stats().offloaded_bytes > 0
    True

How a saved tensor travels (every step uses the Backend protocol only):

1. **pack** (forward, per saved tensor): the policy decides (size, parameter, device,
   marks, scope, watermark); the tensor's whole *storage* is copied once into an
   exact-size buffer of the device's budgeted host pool on the D2H stream, after an
   event recorded on the compute stream that is current *now*. Later views of the same
   storage share that copy (dedupe). autograd gets a small record back.
2. **landing** (polled at every pack/unpack): once the D2H event completed, offcore
   drops its device reference (Note [When may a device copy be freed?]); the memory is
   really freed when nothing else holds the storage (a weak reference tells).
3. **prefetch** (backward): every unpack is a trigger; a :class:`~offcore.scheduler.PrefetchPlan`
   says which reloads must start now to land before their predicted need, within the
   prefetch byte budget; they run on the H2D stream into fresh device buffers.
4. **unpack**: version check; then the storage comes back (prefetched: the compute
   stream waits on its event; still alive: no copy at all; otherwise a synchronous
   reload, a *stall*), and the saved tensor is rebuilt as a view of it with its
   original shape, stride, storage offset and dtype.
5. **release**: host buffers return to the pool when the records autograd holds die
   (after backward, or when the graph is dropped) and every copy reading them landed.

# Note [Saved-tensor version checks]
# Under saved-tensor hooks autograd does not compare version counters, so an in-place
# change of a saved tensor (or ``optimizer.step()`` before backward, which changes the
# parameters forward used) would silently give wrong gradients. offcore records
# ``tensor._version`` at pack for *every* saved tensor, offloaded or passed through,
# and compares at unpack through a version keeper (see storage.py Note [Version
# keepers]); a mismatch raises SavedTensorModifiedError naming the tensor and the
# backward op. For offloaded tensors the version is also checked when the D2H copy is
# seen to land, to say whether the copy may have read modified data.

# Note [Prefetch from the end of forward]
# Backward first needs what forward saved last, and those copies are often still in
# flight (or just landed) when forward ends. With deadline prefetch the plan is made
# at the end of the region, not at backward's first unpack: copies that landed and are
# due before backward's first use start reloading at once, and copies that land later
# keep their device memory if the plan would reload them right away ("held", counted
# against the prefetch budget like a reload). Everything else is released on landing
# and reloaded by deadline. Without this, backward's first unpack would always stall.

# Note [Batched bookkeeping]
# pack and unpack run once per saved tensor on the thread that launches kernels, so they do
# per tensor only what cannot wait: decide (offcore_torch.activations.policy.PackRules), submit the
# copy, and tell the scheduler. Figures are batched: copies are counted in plain integers
# and added to the region's Ledger at the region's exit, at the end of backward and in
# stats(); copy timings are a sample read in batches (runtime.py Note [Timings are read in
# batches]); host bytes go to the ledger per buffer (O(1)). Nothing grows with history:
# an entry lives as long as autograd's records of its storage, a landing or a deferred
# release as long as its copy is in flight. What autograd holds per saved tensor is one
# small record (offcore_torch.activations.records), one entry per offloaded storage, and the
# scheduler's ManagedObject; the entry's lifecycle is an EntryState, not flags.

# Note [Ordering events are recorded again]
# Every copy is ordered after the compute stream as it is at that call: an event recorded
# on the current compute stream, waited on by the copy stream. The region records one event
# per direction again for every copy instead of creating one per copy: ``Stream.record_event
# (event)`` re-records it (the protocol's, torch's ``Stream.record_event``), and a wait takes
# the recording current when it is issued (torch's ``cudaStreamWaitEvent``; the fake device
# keeps the marker it saw), so re-recording later never changes a wait issued before. The
# D2H event is used by pack (the region's thread), the H2D one by prefetches (its end of
# forward and its backward, which never run at once). The prefetches one trigger starts run
# back to back with no compute work enqueued in between (only offcore's own allocations), so
# the H2D stream waits once per trigger (``_execute``), before its first copy.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from offcore.errors import (
    CapacityExceededError,
    ConfigurationError,
    CopyFailedError,
    OffcoreWarning,
    SavedTensorHooksDisabledError,
    SavedTensorModifiedError,
)
from offcore.inflight import must_wait
from offcore.kinds import Direction, Kind, Tier
from offcore.ledger import Ledger
from offcore.objects import ManagedObject, State
from offcore.protocols import Capability
from offcore.residency import NO_ACTIONS, Action, ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore.trace import TraceRecorder
from offcore.units import format_bytes
from offcore_torch.activations.nvme import ActivationSpill
from offcore_torch.activations.policy import OffloadPolicy, PackRules, no_offload
from offcore_torch.activations.records import DeviceFate, Entry, EntryState, Kept, Offloaded, StorageRef, storage_died
from offcore_torch.activations.stats import OffloadStats
from offcore_torch.activations.storage import (
    MARK_ATTRIBUTE,
    TensorMeta,
    dispatch_modes,
    internal_ops,
)
from offcore_torch.budget import shared_budget_for
from offcore_torch.nvme import open_nvme
from offcore_torch.runtime import (
    _SAMPLE_EVERY,
    _SAMPLE_FIRST,
    _TIMING_BATCH,
    DeviceRuntime,
    check_device,
    runtime_for,
    runtime_of,
)

__all__ = ["offload_activations", "OffloadHandle", "no_offload", "mark", "synchronize", "poll"]


def mark(tensor: torch.Tensor, offload: bool = True) -> torch.Tensor:
    """Decide explicitly whether ``tensor`` is offloaded when autograd saves it; returns ``tensor``.

    The mark belongs to the tensor's *storage* (it covers the tensor and all its
    views), lives as long as the storage, and applies to saves made after it: an op
    that saves its own output (``exp``, ``tanh``) has already saved it when ``mark``
    runs. ``offload=True`` overrides ``min_bytes``,
    the watermark and module scoping; it never makes offcore offload a parameter, a
    buffer or a tensor that is not on the device.

        >>> h = offcore_torch.mark(torch.relu(x), offload=False)       # doctest: +SKIP
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigurationError(f"mark() takes a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(offload, bool):
        raise ConfigurationError(f"mark(tensor, offload=...) takes True or False, got {offload!r}")
    setattr(tensor.untyped_storage(), MARK_ATTRIBUTE, offload)
    return tensor


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
    (useful before measuring memory, and in tests).

        >>> offcore_torch.synchronize(dev)                       # doctest: +SKIP
    """
    runtime = runtime_of(device)
    if runtime is None:
        return
    while True:  # handing out landings may defer releases on copies still in flight
        runtime.synchronize()
        poll(runtime)
        if not (runtime.deferred_count or runtime.d2h_in_flight):
            return


# ------------------------------------------------------------------------------- region
class OffloadHandle:
    """One offload region: a context manager around forward whose saved tensors it manages.

    Returned by :func:`offload_activations`. Its state is per region (per graph), so
    several graphs may be in flight at once (micro-batches). ``stats()`` and
    ``write_trace()`` may be called any time; they are final once backward ended.
    """

    def __init__(self, device: Any, policy: OffloadPolicy) -> None:
        _check_device(device)
        self.device = device
        self.policy = policy
        self.runtime: DeviceRuntime = runtime_for(device)
        self.scheduler: Scheduler = policy.schedule or self.runtime.scheduler
        self.active = False
        self.bypassed = False  # inside a checkpointed function: torch.utils.checkpoint owns the saves
        self._entered = False
        self._closed = False
        self._thread = 0  # the thread that entered: saved-tensor hooks are per thread
        self._lock = threading.RLock()
        self._hooks: Any = None
        self._rules = PackRules(policy, device)  # the pack decisions (policy.py)
        self._by_storage: dict[int, Entry] = {}
        self._by_key: dict[int, Entry] = {}
        self._next_key = 0
        self._t_enter = 0.0
        self._t_exit = 0.0
        self._t_backward = 0.0
        self._in_use = _AllocatedBytes(device)  # Note [One read of the device per trigger]
        # every decision about when and where (Note [One scheduler, thin bindings] in offcore.residency)
        self._sched = ResidencyScheduler(
            self.scheduler,
            duration=self.runtime.h2d_duration,
            prefetch=policy.prefetch,
            budget=policy.prefetch_budget,
            margin=policy.margin,
            device_in_use=self._in_use,
            record=policy.record,
            shared_budget=shared_budget_for(device),  # Note [One device budget across kinds] (offcore/budget.py)
        )
        self._graph_task = -1  # the autograd graph task of the current backward round
        # host bytes per tier, copies per direction, waits (the one byte ledger, offcore.ledger)
        self._ledger = Ledger()
        self._trace = TraceRecorder(process_name="offcore_torch") if policy.trace else None
        self._stats = OffloadStats()
        self._kept: collections.Counter[str] = collections.Counter()
        self._elsewhere: str | None = None  # a saved tensor not in the device's memory (Note [A region whose ...])
        self._peak_samples = 0
        self._peak_baseline = 0
        self._peak_final: int | None = None
        self._capacity = 0
        capabilities = frozenset(getattr(device, "capabilities", ()))
        self._formats = Capability.PRIVATE_FORMATS in capabilities
        self._sanitize = Capability.SANITIZER in capabilities
        self._host_pool: Any = None  # the runtime's pool for this policy, looked up once
        self._host_tier = Tier.PINNED if policy.pinned else Tier.PAGEABLE
        self._max_inflight = policy.max_inflight
        self._tracing = policy.trace
        self._record_schedule = policy.record
        # the events ordering each copy after the compute stream, recorded again for every copy
        # (Note [Ordering events are recorded again])
        self._d2h_order: Any = None
        self._h2d_order: Any = None
        self._empty: dict[torch.dtype, torch.Tensor] = {}  # what released version keepers point at, per dtype
        self._checked_allocation = False  # the backend's device buffers own exactly their storage (checked once)
        self._h2d_ordered = False  # the H2D stream waits on the compute stream as it is now (one trigger's copies)
        # copies issued per direction and their bytes, added to the ledger in batches (Note [Batched bookkeeping])
        self._d2h_copies = self._d2h_bytes = self._h2d_copies = self._h2d_bytes = 0
        self._flushed = (0, 0, 0, 0)
        # the NVMe hop (tier="nvme" / nvme=...): host copies spilled to disk and read back (activations/nvme.py)
        self._spill: ActivationSpill | None = None
        if policy.tier == "nvme":
            tier, owned = open_nvme(device, policy.nvme)
            if tier is None:
                raise ConfigurationError(
                    "offload_activations(tier='nvme') needs an NVMe tier: pass nvme=PATH (or an offcore.nvme.NvmeSpec) "
                    "or set one for the device first with offcore_torch.nvme_tier(device, PATH, budget=...)"
                )
            self._spill = ActivationSpill(self, tier, owned=owned, read_ahead=policy.nvme_read_ahead)
            self._sched.stage_duration = tier.read_link.duration  # Note [Two hops from NVMe] (offcore/residency.py)

    @property
    def _round(self) -> int:
        """The backward round over this region's graph (-1 before the first)."""
        return self._sched.round

    @property
    def _in_backward(self) -> bool:
        return self._sched.in_backward

    @property
    def schedule_log(self) -> list[tuple[Any, ...]]:
        """The events this region fed its scheduler, with times (needs ``record=True``): replayable
        through :func:`offcore.sim.replay.replay` to the same actions (:attr:`schedule_actions`)."""
        self._require_record()
        return list(self._sched.log)

    @property
    def schedule_settings(self) -> dict[str, Any]:
        """The scheduler's settings, as :func:`offcore.sim.replay.replay` takes them."""
        return self._sched.settings()

    @property
    def schedule_actions(self) -> list[Action]:
        """The actions the scheduler returned, in order (needs ``record=True``)."""
        self._require_record()
        return list(self._sched.actions)

    def _require_record(self) -> None:
        if not self.policy.record:
            raise ConfigurationError("this region records no schedule: pass record=True to offload_activations")

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> OffloadHandle:
        if self._entered:
            raise ConfigurationError(
                "an OffloadHandle is entered once: call offload_activations(...) again for the next step"
            )
        self._entered = True
        if getattr(self.device, "closed", False) is True:  # Note [A closed device says so] (offcore_cpu)
            raise ConfigurationError(
                f"offload_activations on {self.device!r}, which is closed (dev.close() ran): make a new device and "
                "enter the region on it"
            )
        poll(self.runtime)
        self.runtime.resolve_timings()  # the last step's copy timings, before this one runs
        if _inside_checkpoint():
            # torch.utils.checkpoint discards and recomputes what is saved in here; offloading
            # in forward but not in its recomputation would desynchronise it, so step aside.
            self.bypassed = True
            return self
        stats = self.device.memory_stats()
        self._capacity = self._rules.capacity = int(stats.get("capacity_bytes", 0) or 0)
        self._sched.device_capacity = self._capacity
        self._peak_baseline = int(stats.get("peak_allocated_bytes", 0) or 0)
        self._sample_peak(stats)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            hooks.__enter__()
        except RuntimeError as exc:  # torch.autograd.graph.disable_saved_tensors_hooks is in force
            # torch's own message first: code written for save_on_cpu matches it (a RuntimeError too)
            raise SavedTensorHooksDisabledError(
                f"{str(exc).strip()}\n(offload_activations cannot run here: saved-tensor hooks are disabled on this "
                "thread. Enter it outside torch.autograd.graph.disable_saved_tensors_hooks.)"
            ) from exc
        try:
            self._rules.install()
        except BaseException:
            hooks.__exit__(None, None, None)
            raise
        self._hooks = hooks
        self._thread = threading.get_ident()
        self._t_enter = time.perf_counter()
        self._sched.forward_began(self._t_enter)
        self.active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.bypassed or not self.active:
            return
        if threading.get_ident() != self._thread:
            raise ConfigurationError(
                "an offload_activations region must be exited on the thread that entered it (saved-tensor hooks "
                "belong to one thread); the region is still active on its own thread: exit it there"
            )
        self.active = False
        try:
            self._hooks.__exit__(exc_type, exc, tb)
        finally:
            self._hooks = None
            self._rules.remove()
            self._t_exit = time.perf_counter()
            if self._trace is not None:
                self._trace.span("compute", "forward", self._t_enter, self._t_exit - self._t_enter)
            self._sample_peak()
            poll(self.runtime)
            if not self.runtime.timings_between_steps:  # the link estimate the plan uses next
                self.runtime.resolve_timings()  # Note [Timings are read in batches] (runtime.py)
            self._flush_copies()
        if exc_type is None:
            self._warn_if_all_elsewhere()  # Note [A region whose tensors live elsewhere says so]
            # Note [Prefetch from the end of forward]: what backward needs first was saved
            # last; starting the plan now keeps (or starts reloading) it before backward's
            # first use instead of stalling on it.
            self._execute(self._sched.forward_ended(self._t_exit, readers=self._readers()))
        spill = self._spill
        if spill is not None:
            spill.poll()
            if exc_type is None:
                spill.read_ahead(self._sched.plan)  # the reads from disk lead the host-to-device prefetches
            spill.close_if_idle(False, len(self._by_key))

    # -- pack ----------------------------------------------------------------------------
    def _keep(self, tensor: torch.Tensor, key: int, reason: str) -> Kept:
        self._kept[reason] += 1
        if reason == "not_on_device" and self._elsewhere is None:
            self._elsewhere = f"{tensor.device} ({tuple(tensor.shape)} {tensor.dtype})"
        return Kept(tensor, key)

    # Note [A region whose tensors live elsewhere says so]
    # The region offloads what is in its device's memory (``device.holds``). A forward whose tensors are
    # made elsewhere -- outside ``with dev:`` on the fake device, while another device is active, on a
    # model not moved to the device -- saves them all as "not_on_device": nothing is offloaded, the
    # stats say 0 bytes, and nothing else told the user the region did nothing. At the end of a forward
    # that offloaded nothing while some of its saved tensors were elsewhere, the region warns, once per
    # device, with the fix. A forward on another thread never reaches the (thread-local) pack hook; the
    # rules' global module hooks see its modules (PackRules.foreign_thread), and the region says that.
    def _warn_if_all_elsewhere(self) -> None:
        elsewhere = self._kept.get("not_on_device", 0)
        thread = self._rules.foreign_thread
        if (
            not (elsewhere or thread)
            or self._stats.offloaded_tensors
            or getattr(self.runtime, "warned_elsewhere", False)
        ):
            return
        self.runtime.warned_elsewhere = True  # type: ignore[attr-defined]
        if not elsewhere:  # a module ran on another thread while the region was active, nothing was saved here
            warnings.warn(
                f"offcore: offload_activations on {self.device!r} offloaded nothing: the forward ran on thread "
                f"{thread!r}, but the region was entered on {threading.current_thread().name!r} and saved-tensor "
                "hooks belong to one thread. Enter the region on the thread that runs the forward",
                OffcoreWarning,
                stacklevel=3,
            )
            return
        warnings.warn(
            f"offcore: offload_activations on {self.device!r} offloaded nothing: {elsewhere} saved tensor(s) were "
            f"not in that device's memory (e.g. on {self._elsewhere}). Run the forward with its tensors on the "
            f"region's device: inside `with dev:` for the fake device (the model adopted or built there, the "
            f"inputs made there), or moved to {getattr(self.device, 'torch_device', 'the device')}; on the thread "
            "that entered the region",
            OffcoreWarning,
            stacklevel=3,
        )

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Once per saved tensor: the decisions are PackRules' (policy.py), asked in their order.
        key = self._next_key
        self._next_key = key + 1
        self._sched.produced(key, time.perf_counter())
        self._stats.saved_tensors += 1
        runtime = self.runtime
        if (
            runtime._d2h_in_flight
            or runtime._deferred_total
            or runtime._landed
            or runtime._timed_pending >= _TIMING_BATCH  # fewer: poll would leave them (runtime.poll)
        ):
            poll(runtime)  # poll's own checks, inlined: with nothing in flight the call is skipped
        if self._spill is not None and self._spill.pending:
            self._spill.poll()
        rules = self._rules
        reason = rules.before_storage(tensor)
        if reason is not None:
            return self._keep(tensor, key, reason)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        skey = storage._cdata  # storage_key(storage), inlined
        marked = getattr(storage, MARK_ATTRIBUTE, None)
        reason = rules.for_storage(tensor, nbytes, skey, marked)
        if reason is not None:
            return self._keep(tensor, key, reason)

        entry = self._by_storage.get(skey)
        if entry is not None and entry.storage_ref() is storage and entry.state is not EntryState.DISPOSED:
            return self._pack_shared(entry, tensor, key)

        reason = rules.for_new_storage(nbytes, marked)
        if reason is not None:
            return self._keep(tensor, key, reason)
        cap = self._max_inflight
        if must_wait(runtime._d2h_bytes, nbytes, cap) and runtime._d2h_in_flight:
            self._wait_inflight(nbytes, cap)  # Note [Activation copies in flight are capped]
        meta = TensorMeta.of(tensor)
        try:
            entry = self._offload(storage, nbytes, skey, tensor, key, meta)
        except _CopyRefused:
            return self._keep(tensor, key, "copy_failed")
        if entry is None:
            return self._keep(tensor, key, "host_budget")
        # _record, inlined (once per offloaded storage): a new entry has no record yet and has not landed
        item = Offloaded(entry, tensor, key, self.device.format_of(tensor) if self._formats else None, meta)
        entry.items.append(weakref.ref(item))
        self._stats.offloaded_tensors += 1
        entry.live = 1
        return item

    def _wait_inflight(self, nbytes: int, cap: int) -> None:
        """Wait, oldest first, for device-to-host copies in flight until ``nbytes`` more fit ``cap``
        (Note [Activation copies in flight are capped]); the landed copies' device references go."""
        runtime = self.runtime
        began = time.perf_counter()
        while must_wait(runtime._d2h_bytes, nbytes, cap):  # Note [Copies in flight are capped] (offcore/inflight.py)
            with runtime.lock:
                if not runtime._d2h_in_flight:
                    break  # nothing in flight: a storage is always let through
                oldest = runtime._d2h_in_flight[0][0]
            with contextlib.suppress(Exception):  # a failed copy completes its event: poll hands its failure on
                oldest.synchronize()
            poll(runtime)
        waited = time.perf_counter() - began
        self._ledger.record_wait(waited, what=_INFLIGHT_WAIT)
        self._stats.inflight_waits += 1
        self._stats.inflight_wait_s += waited

    def _record(self, entry: Entry, tensor: torch.Tensor, key: int, meta: TensorMeta) -> Offloaded:
        item = Offloaded(entry, tensor, key, self.device.format_of(tensor) if self._formats else None, meta)
        entry.items.append(weakref.ref(item))
        self._stats.offloaded_tensors += 1
        entry.live += 1
        if entry.state is EntryState.LANDED:
            self._release_keeper(item)
        return item

    def _release_keeper(self, item: Offloaded) -> None:
        """:func:`release_storage` of ``item``'s keeper, with this region's empty tensor per dtype (no torch lookups)."""
        dtype = item.meta.dtype
        empty = self._empty.get(dtype)
        if empty is None:
            keeper = item.keeper
            with internal_ops():
                empty = self._empty[dtype] = torch.empty(0, dtype=keeper.dtype, device=keeper.device)
        item.keeper.data = empty  # no op: no dispatch mode sees it (Note [Metadata ops bypass dispatch modes])

    def _pack_shared(self, entry: Entry, tensor: torch.Tensor, key: int) -> Any:
        """A further tensor on an already offloaded storage: share its copy (dedupe)."""
        if entry.obj.state not in (State.OFFLOADING, State.OFFLOADED) or self._sched.in_backward:
            return self._keep(tensor, key, "shared_storage_busy")
        if tensor._version != entry.version_at_copy:
            # modified in place since the copy was taken: the copy is stale for this tensor.
            # (The earlier saves of this storage will fail their own version check.)
            return self._keep(tensor, key, "modified_after_save")
        entry.keys = (*entry.keys, key)
        return self._record(entry, tensor, key, TensorMeta.of(tensor))

    def _under_pressure(self) -> bool:
        """The watermark rule on the device's own accounting (PackRules.under_pressure)."""
        return self._rules.under_pressure()

    def _pool(self) -> Any:
        pool = self._host_pool
        if pool is None:
            pool = self._host_pool = self.runtime.pool(self.device, self.policy.host_budget, self.policy.pinned)
        return pool

    def _host_after_refusal(self, nbytes: int) -> tuple[Any, torch.Tensor, Tier] | None:
        """The pool refused ``nbytes`` (``_offload`` asks it first): ask again once the copies that
        landed returned their buffers, else follow the fallback policy (None: keep on the device)."""
        poll(self.runtime)  # buffers whose copies just landed may come back
        try:
            with internal_ops():
                buffer = (self._host_pool or self._pool()).acquire(nbytes)
            return buffer, buffer.view, self._host_tier
        except CapacityExceededError:
            pass
        self._stats.fallbacks += 1
        if self.policy.fallback == "keep":
            return None
        try:
            view = self.device.allocate(nbytes, Tier.PAGEABLE)
        except (CapacityExceededError, MemoryError, RuntimeError):
            return None
        return None, view, Tier.PAGEABLE

    def _copy(self, direction: Direction, dst: torch.Tensor, src: torch.Tensor, *, nbytes: int, entry: Entry) -> Any:
        """Enqueue one copy on its direction's stream, ordered after the compute stream as it is now.

        For D2H the current compute stream produced ``src``; for H2D the new device buffer may
        reuse memory the compute stream used until now. Either way the copy stream waits for an
        event recorded on the stream that is current *at this call* (never a cached one).
        Returns the copy's completion event. Each region times its first two copies per
        direction (its bandwidth figure), every copy when tracing, and otherwise the runtime's
        sample (:meth:`DeviceRuntime.sample`), for the link estimate.
        """
        device, runtime = self.device, self.runtime
        if direction is Direction.D2H:
            stream, count = runtime.d2h_stream, self._d2h_copies
            self._d2h_copies = count + 1
            self._d2h_bytes += nbytes
            order = self._d2h_order
        else:
            stream, count = runtime.h2d_stream, self._h2d_copies
            self._h2d_copies = count + 1
            self._h2d_bytes += nbytes
            order = self._h2d_order
        timed = False
        if runtime.timing:
            if self._tracing or count < 2:
                timed = True
            elif direction is Direction.D2H:  # runtime.sample(direction), inlined (once per copy)
                asked = runtime._sampled_d2h
                runtime._sampled_d2h = asked + 1
                timed = asked < _SAMPLE_FIRST or not asked & (_SAMPLE_EVERY - 1)
            else:
                asked = runtime._sampled_h2d
                runtime._sampled_h2d = asked + 1
                timed = asked < _SAMPLE_FIRST or not asked & (_SAMPLE_EVERY - 1)
        if timed or _profiler._is_profiler_enabled:
            return self._copy_timed(stream, direction, dst, src, nbytes=nbytes, entry=entry, timed=timed)
        if order is None:  # Note [Ordering events are recorded again]
            order = device.new_event()
            if direction is Direction.D2H:
                self._d2h_order = order
            else:
                self._h2d_order = order
        if direction is Direction.D2H or not self._h2d_ordered:
            stream.wait_event(device.current_stream().record_event(order))
            # the prefetches of one trigger start back to back: nothing reaches the compute stream
            # in between, so the first one's wait orders them all (Note [Ordering events are recorded again])
            self._h2d_ordered = direction is not Direction.D2H
        return device.copy_(dst, src, stream=stream)

    def _copy_timed(
        self, stream: Any, direction: Direction, dst: Any, src: Any, *, nbytes: int, entry: Entry, timed: bool
    ) -> Any:
        """:meth:`_copy` for a copy that is timed, or seen by a running profiler (its own range)."""
        device, runtime = self.device, self.runtime
        with _range(_RANGE_NAMES[direction]):
            stream.wait_event(device.current_stream().record_event())
            if not timed:
                return device.copy_(dst, src, stream=stream)
            # Note [Copy timings start at the copy]
            start, issued = runtime.begin_timing(device, stream, record=False)
            done = device.copy_(dst, src, stream=stream, start_event=start)
            runtime.end_timing(
                device,
                stream,
                start,
                issued,
                nbytes=nbytes,
                direction=direction,
                label=entry.name,
                ledger=self._ledger,
                trace=self._trace,
            )
        return done

    def _flush_copies(self) -> None:
        """Add the copies issued since the last flush to the ledger (Note [Batched bookkeeping])."""
        now = (self._d2h_copies, self._d2h_bytes, self._h2d_copies, self._h2d_bytes)
        last, self._flushed = self._flushed, now
        if now[0] != last[0]:
            self._ledger.record_copy(Direction.D2H, now[1] - last[1], copies=now[0] - last[0])
        if now[2] != last[2]:
            self._ledger.record_copy(Direction.H2D, now[3] - last[3], copies=now[2] - last[2])

    def _offload(
        self, storage: torch.UntypedStorage, nbytes: int, skey: int, tensor: torch.Tensor, key: int, meta: TensorMeta
    ) -> Entry | None:
        pool = self._host_pool or self._pool()
        modes = dispatch_modes()
        try:  # once per offloaded storage: the pool first
            if modes:  # may slice a pool block (Note [Metadata ops bypass dispatch modes])
                with internal_ops():
                    buffer = pool.acquire(nbytes)
            else:
                buffer = pool.acquire(nbytes)
            host_view, tier = buffer.view, self._host_tier
        except CapacityExceededError:
            host = self._host_after_refusal(nbytes)
            if host is None:
                return None
            buffer, host_view, tier = host
        stack = self._rules.module_stack
        where = stack[-1] if stack else "forward"  # PackRules.where(), inlined
        entry = Entry(self, key, where, meta, nbytes, skey)
        ref = entry.storage_ref = StorageRef(storage, storage_died)  # records.storage_ref, inlined
        ref.entry_ref = weakref.ref(entry)
        entry.host, entry.host_view = buffer, host_view
        entry.version_at_copy = tensor._version
        if modes:  # raw_bytes(storage, meta.device), inlined
            with internal_ops():
                entry.src = torch.empty(0, dtype=torch.uint8, device=meta.device).set_(storage)
        else:
            entry.src = torch.empty(0, dtype=torch.uint8, device=meta.device).set_(storage)
        try:
            done = self._copy(Direction.D2H, host_view, entry.src, nbytes=nbytes, entry=entry)
        except BaseException as exc:
            # nothing was enqueued: the host buffer goes back now, and the tensor stays on the device
            if buffer is not None:
                self._pool().release(buffer)
            if isinstance(exc, Exception):
                self._copy_failed(entry, exc, "device-to-host copy could not be submitted")
                raise _CopyRefused from exc
            raise
        entry.obj = self._sched.register_offloading(key, Kind.ACTIVATION, nbytes, done, tier, name=f"#{key} {where}")
        with self._lock:
            self._by_storage[skey] = entry
            self._by_key[key] = entry
        self.runtime.track_d2h(done, entry, nbytes)
        self._ledger.add(tier, Kind.ACTIVATION, nbytes)
        stats = self._stats
        stats.offloaded_bytes += nbytes
        stats.offloaded_storages += 1
        return entry

    # -- landing -------------------------------------------------------------------------
    def _on_landed(self, entry: Entry, failure: Exception | None) -> None:
        """The device-to-host copy of ``entry`` landed (or failed): see :func:`poll`."""
        if entry.state is not EntryState.COPYING:  # disposed meanwhile
            return
        if failure is not None:
            self._d2h_failed(entry, failure)
            return
        entry.state = EntryState.LANDED
        refs = entry.items
        if len(refs) == 1:  # entry.live_items(), inlined for the common case: one record per storage
            item = refs[0]()
            items = [] if item is None else [item]
        else:
            items = entry.live_items()
        sched = self._sched
        upcoming = sched.round if sched.in_backward else sched.round + 1  # sched.upcoming_round
        needed = False  # does backward still read it this round (some record not unpacked yet)?
        for item in items:
            if item.keeper._version != item.version:
                entry.modified_in_flight = True
            if item.unpacked_round != upcoming:
                needed = True
        if sched.landed_held(entry.key, needed=needed):
            return  # kept as a prefetch: backward needs it before the next trigger
        self._release_device(entry, items)
        if self._spill is not None and not sched.in_backward:  # on to the NVMe tier, in forward only
            self._spill.landed(entry)  # (Note [Spilled host buffers go back after their write])

    def _copy_failed(self, entry: Entry, exc: Exception, what: str) -> None:
        self._stats.copy_failures += 1
        warnings.warn(
            f"offcore: the {what} for saved tensor {entry.name} ({type(exc).__name__}: {exc}); "
            "recovered without changing a number (see OffloadStats.copy_failures)",
            OffcoreWarning,
            stacklevel=3,
        )

    def _d2h_failed(self, entry: Entry, exc: Exception) -> None:
        """The D2H copy failed on its stream: the device copy stays the data, the host buffer goes back."""
        self.runtime.recover(self.runtime.d2h_stream)
        entry.state = EntryState.FAILED
        tier = entry.obj.host_tier or Tier.PINNED
        self._sched.offload_failed(entry.key)
        host, host_view = entry.host, entry.host_view
        entry.host = entry.host_view = None
        if host is not None:
            self._pool().release(host)
        if host_view is not None:
            self._ledger.remove(tier, Kind.ACTIVATION, entry.nbytes)
        self._stats.offloaded_bytes -= entry.nbytes
        self._stats.offloaded_storages -= 1
        self._kept["copy_failed"] += entry.live
        self._copy_failed(entry, exc, "device-to-host copy failed")

    def _release_device(self, entry: Entry, items: list[Offloaded] | None = None) -> None:
        """Drop offcore's device references of a landed entry; count what that really freed."""
        if entry.obj.state is State.OFFLOADING:
            entry.obj.release_device_copy()  # refuses unless the D2H event completed
        empties = self._empty
        for item in entry.live_items() if items is None else items:
            empty = empties.get(item.meta.dtype)
            if empty is None:
                self._release_keeper(item)
            else:  # _release_keeper, inlined (once per offloaded storage)
                item.keeper.data = empty
        entry.src = None
        if entry.storage_ref() is not None:
            entry.alive_elsewhere = True
            self._sched.device_copy_alive(entry.key)  # no reload needed while it lives on
            if entry.fate is DeviceFate.UNKNOWN and not entry.used:
                # still alive although backward has not used it: something else references it
                entry.fate = DeviceFate.HELD_ELSEWHERE
                self._stats.held_elsewhere_bytes += entry.nbytes

    def _storage_died(self, entry: Entry) -> None:
        with self._lock:
            if self._by_storage.get(entry.skey) is entry:
                del self._by_storage[entry.skey]
        if entry.alive_elsewhere:  # only a copy the scheduler was told lives on can die for it
            entry.alive_elsewhere = False
            self._sched.device_copy_died(entry.key)
        if entry.state is EntryState.LANDED and entry.fate is not DeviceFate.FREED and not entry.used:
            if entry.fate is DeviceFate.HELD_ELSEWHERE:
                self._stats.held_elsewhere_bytes -= entry.nbytes
            entry.fate = DeviceFate.FREED
            self._stats.freed_device_bytes += entry.nbytes

    # -- unpack --------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        self._graph_task = _graph_task_id()
        self._t_backward = time.perf_counter()
        self._sched.backward_began(self._t_backward)
        self._sample_peak()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        except RuntimeError:  # not inside a backward pass (a saved tensor read by hand)
            self._sched.backward_aborted()
            return
        if self._sched.plan is None:
            self._sched.make_plan(self._readers())

    def _readers(self) -> dict[int, list[int]]:
        """Every save key reading each offloaded storage (an object is needed at the first of their uses)."""
        # a storage read by its own save only is the plan's default: only shared storages are listed
        return {
            e.key: list(e.keys) for e in self._by_key.values() if len(e.keys) > 1 and e.state is not EntryState.DISPOSED
        }

    def _end_backward(self) -> None:
        """Called by autograd when the backward pass that used this region ends."""
        try:
            now = time.perf_counter()
            if self._trace is not None:
                self._trace.span("compute", f"backward {self._round}", self._t_backward, now - self._t_backward)
            for action in self._sched.backward_ended(now):  # frees what was held
                entry = self._by_key.get(action.key)
                if entry is not None and entry.state is not EntryState.DISPOSED:
                    self._release_device(entry)
            for entry in list(self._by_key.values()):
                if entry.restored is not None and entry.state is not EntryState.DISPOSED:
                    self._drop_restored(entry)
            if self._sched.shared_budget is not None:  # the round is over: its reservations go back
                self._sched.shared_budget.release_owner(self._sched)
            self._sample_peak()
            self._peak_final = self._peak_now()
            poll(self.runtime)
            if not self.runtime.timings_between_steps:
                self.runtime.resolve_timings()
            self._flush_copies()
        except Exception:  # pragma: no cover - must not break the caller's backward
            pass

    def _unpack(self, packed: Any) -> torch.Tensor:
        runtime = self.runtime
        if (
            runtime._d2h_in_flight
            or runtime._deferred_total
            or runtime._landed
            or runtime._timed_pending >= _TIMING_BATCH  # fewer: poll would leave them (runtime.poll)
        ):
            poll(runtime)  # (in backward usually nothing is in flight: the call is skipped)
        spill = self._spill
        if spill is not None:
            spill.poll()
            spill.read_ahead(self._sched.plan)
        if _current_autograd_node() is not None:
            if not self._sched.in_backward:
                self._begin_backward()
            elif (_GRAPH_TASK_ID() if _GRAPH_TASK_ID is not None else -1) != self._graph_task:
                # the backward pass that began the round raised, so its end callback never ran
                self._end_backward()
                self._begin_backward()
        now = time.perf_counter()
        key = packed.key
        if type(packed) is Kept:
            if packed.tensor._version != packed.version:
                raise self._modified_error(packed.tensor, packed.version, packed.tensor._version, offloaded=False)
            actions = self._sched.used(key, now)
            if actions is not NO_ACTIONS:
                self._execute(actions)
            return packed.tensor
        return self._restore(packed, key, now)

    def _modified_error(
        self,
        tensor_or_meta: Any,
        saved: int,
        now: int,
        *,
        offloaded: bool,
        in_flight: bool = False,
    ) -> SavedTensorModifiedError:
        meta = tensor_or_meta if isinstance(tensor_or_meta, TensorMeta) else TensorMeta.of(tensor_or_meta)
        what = "an offloaded saved tensor" if offloaded else "a saved tensor"
        detail = (
            " It changed before offcore saw its device-to-host copy complete, so the host copy may hold "
            "modified data too."
            if in_flight
            else ""
        )
        return SavedTensorModifiedError(
            f"{what} of shape {tuple(meta.shape)} and dtype {meta.dtype}, needed by {_current_op()}, was modified "
            f"in place after forward saved it (version {saved} at save, {now} now).{detail} Backward must use the "
            "values forward used: do not modify it in place before backward (e.g. call optimizer.step() only after "
            "backward, use an out-of-place op, or .clone() it before modifying); in backward too, a custom "
            "autograd.Function must not modify an unpacked saved tensor in place while another saved tensor "
            "shares its memory."
        )

    def _restore(self, packed: Offloaded, key: int, now: float) -> torch.Tensor:
        entry = packed.entry
        current = packed.keeper._version
        if current != packed.version:
            raise self._modified_error(
                packed.meta, packed.version, current, offloaded=True, in_flight=entry.modified_in_flight
            )
        sched = self._sched
        round_ = sched.round
        if entry.restored is not None:  # prefetched (the common case): _device_storage's first branch, inlined
            if entry.used_round != round_ and sched.is_outstanding(entry.key):
                self._stats.prefetch_hits += 1
            actions = sched.used(key, now, managed_key=entry.key)
            storage = self._await_prefetch(entry)
        else:
            storage, actions = self._device_storage(entry, key, now, entry.used_round != round_)
        out = packed.meta.restore(packed.keeper, storage)
        entry.keepers_pointed = True
        if packed.fmt is not None:
            out = self.device.restore_format(out, packed.fmt)
        entry.used = True
        entry.used_round = round_
        packed.unpacked_round = round_
        # ``packed`` is alive (autograd passed it in): with one live record it is the only one
        if entry.live == 1 or entry.all_unpacked(round_):
            self._consumed(entry)
        # the offer of this trigger runs once a copy taken over here left the budget
        # (Note [A copy taken over at its use leaves the budget first] in offcore/residency.py)
        if actions is not NO_ACTIONS:
            self._execute(actions)
        return out

    def _device_storage(
        self, entry: Entry, key: int, now: float, first_use: bool
    ) -> tuple[torch.UntypedStorage, Iterator[Action]]:
        """The storage backward should read, on the device and ordered for the compute stream, and the
        actions of this use's trigger, for the caller to run after the take-over (Note [A copy taken
        over at its use leaves the budget first] in offcore/residency.py)."""
        sched = self._sched
        if entry.restored is not None:
            if first_use and sched.is_outstanding(entry.key):
                self._stats.prefetch_hits += 1
            actions = sched.used(key, now, managed_key=entry.key)
            return self._await_prefetch(entry), actions
        live = entry.storage_ref()
        in_flight = False
        if live is None and entry.restored_ref is not None:
            live = entry.restored_ref()  # a retained graph: autograd still holds the last restore
            # Note [An evicted prefetch still in flight]: or the buffer a dropped prefetch still writes
            in_flight = live is not None and entry.obj.state is State.PREFETCHING
        if live is not None:
            sched.reused(entry.key)
            actions = sched.used(key, now, managed_key=entry.key)
            if first_use:
                self._stats.reused_live_bytes += entry.nbytes
            entry.restored = live
            return (self._await_prefetch(entry) if in_flight else live), actions
        # a miss: reload now; the whole copy is exposed and charged to this object
        storage = self._reload_now(entry)
        return storage, sched.used(key, now, managed_key=entry.key)

    def _reload_now(self, entry: Entry) -> torch.UntypedStorage:
        if entry.nvme is not None:
            self._host_from_nvme(entry)
        device, runtime = self.device, self.runtime
        compute = device.current_stream()
        dst = self._allocate_device(entry.nbytes)
        with _range("offcore::h2d"), _range("offcore::wait"):
            start, issued = runtime.begin_timing(device, compute)
            try:
                done = device.copy_(dst, entry.host_view, stream=compute)
                self._h2d_copies += 1
                self._h2d_bytes += entry.nbytes
                compute.wait_event(done)
            except Exception as exc:
                raise CopyFailedError(
                    f"could not reload saved tensor {entry.name} from host memory for backward "
                    f"({type(exc).__name__}: {exc}); its host copy is intact, but this backward cannot go on. "
                    "Drop the graph (the step) and run it again."
                ) from exc
            for nbytes, direction in ((entry.nbytes, Direction.H2D), (0, None)):  # a copy, and a wait
                runtime.end_timing(
                    device,
                    compute,
                    start,
                    issued,
                    nbytes=nbytes,
                    direction=direction,
                    label=entry.name,
                    ledger=self._ledger,
                    trace=self._trace,
                )
        self._sched.reloaded(entry.key, done)
        self._stats.stalls += 1
        self._stats.stalled_objects.append(entry.name)
        self._stats.reloaded_bytes += entry.nbytes
        storage = dst.untyped_storage()
        entry.restored = storage
        entry.restored_ref = weakref.ref(storage)
        return storage

    def _host_from_nvme(self, entry: Entry) -> None:
        """The host copy of a spilled ``entry`` read back (waited for) before a host-to-device copy reads it."""
        spill = self._spill
        assert spill is not None
        with _range("offcore::wait"):
            spill.ensure_host(entry)

    def _allocate_device(self, nbytes: int) -> torch.Tensor:
        dst = self.device.allocate(nbytes, Tier.DEVICE)
        if self._checked_allocation:  # a backend's buffers are all alike: checked on the first one
            return dst
        if dst.storage_offset() == 0 and dst.untyped_storage().nbytes() == nbytes:
            self._checked_allocation = True
        else:
            raise ConfigurationError(
                f"the backend's allocate({nbytes}, DEVICE) returned a view into a larger storage; offcore restores "
                "saved tensors storage-exactly and needs a buffer that owns exactly its storage"
            )
        return dst

    # Note [A landed copy needs no wait]
    # A prefetch whose event the host has seen complete (``query()`` returned True) is done on the
    # device: work enqueued afterwards on any stream runs after it, so the compute stream waits on
    # its event only while it is in flight. On CUDA and NPU a wait on a completed event is a no-op;
    # the fake device's sanitizer counts the query itself as the host observing the recording
    # (FakeEvent._observed), exactly as a wait would. One wait_event less per prefetch that landed
    # before its use (the common case with deadline prefetch).
    def _await_prefetch(self, entry: Entry) -> torch.UntypedStorage:
        """The prefetched storage of ``entry``, with the compute stream ordered after its copy."""
        restored = entry.restored
        assert restored is not None
        obj = entry.obj
        if obj.state is not State.PREFETCHING:
            return restored
        event = obj.h2d_event
        try:
            if not event.query():
                device, runtime = self.device, self.runtime
                compute = device.current_stream()
                with _range("offcore::wait"):
                    start, issued = runtime.begin_timing(device, compute)
                    compute.wait_event(event)
                    runtime.end_timing(
                        device,
                        compute,
                        start,
                        issued,
                        nbytes=0,
                        direction=None,
                        label=entry.name,
                        ledger=self._ledger,
                        trace=self._trace,
                    )
            # else it has landed, and the host saw it complete: every later use, on any stream, is
            # ordered after the copy without a wait (Note [A landed copy needs no wait])
        except Exception as exc:  # the prefetch failed on its stream: its buffer is garbage
            return self._prefetch_failed(entry, exc)
        self._sched.awaited(entry.key)
        return restored

    def _prefetch_failed(self, entry: Entry, exc: Exception) -> torch.UntypedStorage:
        """A failed prefetch: drop its device buffer and reload synchronously from the intact host copy."""
        self.runtime.recover(self.runtime.h2d_stream)
        self._sched.prefetch_failed(entry.key)
        entry.restored = entry.restored_ref = None
        self._stats.reloaded_bytes -= entry.nbytes
        self._stats.prefetched_bytes -= entry.nbytes
        self._copy_failed(entry, exc, "host-to-device prefetch failed")
        return self._reload_now(entry)

    def _consumed(self, entry: Entry) -> None:
        """Every live record of ``entry`` was unpacked this round: autograd owns the storage now."""
        if entry.restored is not None and entry.obj.state is State.RESTORED:
            # the common case (a copy restored and awaited): consumed and dropped in one call
            if self._sched.consumed(entry.key, dropped=True):  # it was held on landing
                self._release_device(entry)
            if entry.keepers_pointed:  # the keepers let go of it (Note [Restore through the version keeper])
                entry.keepers_pointed = False
                items = entry.items
                if len(items) == 1:  # the common case: one record per storage
                    item = items[0]()
                    if item is not None:
                        empty = self._empty.get(item.meta.dtype)
                        if empty is None:
                            self._release_keeper(item)
                        else:  # _release_keeper, inlined (once per offloaded storage)
                            item.keeper.data = empty
                else:
                    for item in entry.live_items():
                        self._release_keeper(item)
            entry.restored = None
            if entry.nvme is not None:
                self._spill.consumed(entry)  # type: ignore[union-attr]
            return
        if self._sched.consumed(entry.key):  # it was held on landing: offcore's device copy goes
            self._release_device(entry)
        self._drop_restored(entry)
        if entry.nvme is not None:
            self._spill.consumed(entry)  # type: ignore[union-attr]

    def _drop_restored(self, entry: Entry) -> None:
        """Stop referencing the restored storage (after its H2D landed); the host copy stays."""
        storage = entry.restored
        if entry.keepers_pointed:  # the keepers let go of it (Note [Restore through the version keeper])
            entry.keepers_pointed = False
            for item in entry.live_items():
                self._release_keeper(item)
        if storage is None:
            self._sched.dropped(entry.key)  # no copy held: only the budget count goes
            return
        entry.restored = None
        obj, sched = entry.obj, self._sched
        sched.dropped(entry.key)  # a restored copy is dropped now; one in flight once it landed
        if obj.state is State.PREFETCHING:
            event = obj.h2d_event

            def finish(sched: ResidencyScheduler = sched, key: int = entry.key, keep: Any = storage) -> None:
                if obj.h2d_event is event:  # not a later prefetch of it (Note [An evicted prefetch still in flight])
                    sched.drop_landed(key)

            self.runtime.defer(event, finish, stream=self.runtime.h2d_stream)

    # -- prefetch ------------------------------------------------------------------------
    def _execute(self, actions: Any) -> None:
        """Carry out the scheduler's actions (offered lazily: each outcome is reported before the next)."""
        by_key = self._by_key
        in_use = self._in_use
        outer = in_use.batch  # a trigger inside a trigger (never seen) keeps the outer one's batch
        in_use.batch = True  # Note [One read of the device per trigger]
        try:
            for action in actions:
                entry = by_key.get(action.key)
                if action.kind is ActionKind.PREFETCH:
                    assert entry is not None  # the scheduler offers only registered, unreleased objects
                    self._start_prefetch(entry)
                elif action.kind is ActionKind.EVICT and entry is not None:
                    self._evict(entry)
                elif action.kind is ActionKind.STAGE and entry is not None:  # NVMe -> host (activations/nvme.py)
                    if self._spill is not None and self._spill.stage(entry):
                        self._sched.stage_started(action.key)
                    else:
                        self._sched.stage_refused(action.key, "no_room")
        finally:
            if not outer:
                self._h2d_ordered = False  # the next trigger's copies order after compute again
                in_use.end()

    # Note [An evicted prefetch still in flight]
    # An EVICT (the prefetch budget's, or the shared device budget's for another owner: Note [One
    # device budget across kinds] in offcore/budget.py) may drop a prefetch whose H2D is still in
    # flight: its buffer stays alive until the copy lands (the deferred drop_landed keeps it), so
    # ``entry.restored_ref`` still finds it. A use of the saved tensor before then reuses that
    # buffer, and must wait for its copy like any prefetch (``_await_prefetch``): read as it is,
    # it holds whatever the copy has not written yet (poison under the fake device's sanitizer,
    # a wrong gradient on a GPU). tests/torch/test_device_budget.py forces this interleaving.
    # Waited for, the object is restored before the deferred drop_landed of the dropped copy
    # runs; that callback then acts only while the object's copy is still that one, never on a
    # later prefetch of the same object.
    def _evict(self, entry: Entry) -> None:
        """Drop a held or prefetched device copy the scheduler evicted (the host copy stays the data)."""
        if entry.obj.state is State.OFFLOADING:  # held on landing
            self._release_device(entry)
        else:
            self._drop_restored(entry)

    def _start_prefetch(self, entry: Entry) -> bool:
        """Start the reload the scheduler offered and report the outcome to it (returned too).

        Note [No speculative allocation after a refusal]: a prefetch is speculative. Asking a
        caching allocator for memory that is not there makes it free its whole cache, with a
        device-wide synchronize, before it raises. So the scheduler offers a prefetch only when
        it fits the device capacity next to what is allocated now (it asks again at the next
        trigger), and after one refusal by the allocator the round prefetches no more (what is
        left reloads on demand).
        """
        sched = self._sched
        if entry.nvme is not None:
            try:
                self._host_from_nvme(entry)
            except CopyFailedError:  # raised again at its use (the on-demand reload reads it again)
                sched.refused(entry.key, "failed")
                return False
        try:
            if self._checked_allocation:  # _allocate_device, inlined (once per prefetch)
                dst = self.device.allocate(entry.nbytes, Tier.DEVICE)
            else:
                dst = self._allocate_device(entry.nbytes)
        except Exception as exc:
            if _is_oom(exc):
                sched.refused(entry.key, "oom")
                return False
            raise
        self._in_use.allocated(entry.nbytes)
        try:
            done = self._copy(Direction.H2D, dst, entry.host_view, nbytes=entry.nbytes, entry=entry)
        except Exception as exc:  # not submitted: backward reloads it when it needs it
            del dst
            self._copy_failed(entry, exc, "host-to-device prefetch could not be submitted")
            sched.refused(entry.key, "failed")
            return False
        sched.started(entry.key, done)
        storage = dst.untyped_storage()
        entry.restored = storage
        entry.restored_ref = weakref.ref(storage)
        self._stats.prefetched_bytes += entry.nbytes
        self._stats.reloaded_bytes += entry.nbytes
        return True

    # -- release -------------------------------------------------------------------------
    def _item_died(self, entry: Entry) -> None:
        entry.live -= 1
        if entry.state is EntryState.DISPOSED:
            return
        if entry.live <= 0:
            self._dispose(entry)
        elif entry.restored is not None and entry.used and entry.all_unpacked(self._sched.round):
            self._consumed(entry)

    def _dispose(self, entry: Entry) -> None:
        """No record uses ``entry`` any more: return its host buffer and device references once copies landed."""
        entry.state = EntryState.DISPOSED
        if self._by_storage.get(entry.skey) is entry:  # usually gone already: the storage died after its copy
            with self._lock:
                if self._by_storage.get(entry.skey) is entry:
                    del self._by_storage[entry.skey]
        self._by_key.pop(entry.key, None)  # keys are never reused: no check needed (pop is atomic)
        self._sched.released(entry.key)
        spill = self._spill
        if spill is not None:
            if entry.nvme is not None:  # its transfers waited for and its file deleted, before its buffers go
                spill.dispose(entry)
            spill.close_if_idle(self.active, len(self._by_key))
        obj = entry.obj
        state = obj.state
        host, host_view = entry.host, entry.host_view
        pool = (self._host_pool or self._pool()) if host is not None else None
        poison = self.device if self._sanitize else None
        if state is not State.PREFETCHING and state is not State.OFFLOADING:
            # nothing in flight touches its buffers (the common case, after backward): _release_buffers, inlined
            entry.host = entry.host_view = entry.src = entry.restored = None
            if pool is not None:
                pool.release(host)  # the pool poisons it under the sanitizer
            elif poison is not None and host_view is not None:
                poison.poison(host_view)
            if host_view is not None:  # a failed offload returned its host buffer already
                self._ledger.remove(obj.host_tier or Tier.PINNED, Kind.ACTIVATION, obj.nbytes)
            if state is not State.RELEASED:
                obj.release()
            return
        runtime = self.runtime
        if state is State.PREFETCHING:
            pending, stream = obj.h2d_event, runtime.h2d_stream
        else:
            pending, stream = obj.d2h_event, runtime.d2h_stream
        src, restored = entry.src, entry.restored
        entry.host = entry.host_view = entry.src = entry.restored = None
        # the copy in flight reads ``src`` / writes ``restored``: both live until it landed
        release = functools.partial(_release_buffers, pool, host, host_view, poison, self._ledger, obj, src, restored)
        runtime.defer(pending, release, stream=stream)

    # -- figures -------------------------------------------------------------------------
    def _peak_now(self) -> int:
        stats = self.device.memory_stats()
        return int(stats.get("peak_allocated_bytes", 0) or 0)

    def _sample_peak(self, stats: Any = None) -> None:
        stats = stats if stats is not None else self.device.memory_stats()
        self._peak_samples = max(self._peak_samples, int(stats.get("allocated_bytes", 0) or 0))

    def stats(self) -> OffloadStats:
        """The region's figures so far (final once backward ended); see :class:`OffloadStats`."""
        poll(self.runtime)
        for event in self.runtime.pending_timings(self._ledger):
            try:
                event.synchronize()
            except Exception:  # a bracket around a failed copy: resolved without a sample
                pass
        poll(self.runtime)
        self.runtime.resolve_timings()
        self._flush_copies()
        s = self._stats
        ledger = self._ledger
        peak = self._peak_final if self._peak_final is not None else self._peak_now()
        out = OffloadStats(**{k: v for k, v in s.as_dict().items()})
        out.peak_device_bytes = peak if peak > self._peak_baseline else self._peak_samples
        out.peak_pinned_bytes = ledger.peak(Tier.PINNED)
        out.peak_pageable_bytes = ledger.peak(Tier.PAGEABLE)
        out.exposed_wait_s = ledger.wait_seconds
        out.waits = dict(ledger.waits)
        copies = ledger.copies
        out.d2h_bandwidth = copies[Direction.D2H].bandwidth if Direction.D2H in copies else 0.0
        out.h2d_bandwidth = copies[Direction.H2D].bandwidth if Direction.H2D in copies else 0.0
        out.peak_prefetched_bytes = self._sched.peak_outstanding
        kept = collections.Counter(self._kept)
        for reason in ("prefetch_no_room", "prefetch_oom"):
            if self._sched.counters[reason]:
                kept[reason] += self._sched.counters[reason]
        out.kept = dict(kept)
        spill = self._spill
        if spill is not None:
            out.spilled_bytes = spill.written_bytes
            out.nvme_read_bytes = spill.read_bytes
            out.peak_nvme_bytes = spill.peak_disk_bytes
            out.nvme_stalls = spill.stalls
            out.nvme_wait_s = spill.stall_s
            out.nvme_failures = spill.failures
            out.nvme_full = spill.full
        return out

    def write_trace(self, path: Any) -> None:
        """Write a Chrome-trace / Perfetto JSON of compute, D2H, H2D and waits (needs ``trace=True``)."""
        if self._trace is None:
            raise ConfigurationError("this region records no trace: pass trace=True to offload_activations")
        self.stats()  # resolves pending copy timings
        self._trace.write(path)

    def trace_dict(self) -> dict[str, Any]:
        """The trace as a dict (Chrome's JSON object format); needs ``trace=True``."""
        if self._trace is None:
            raise ConfigurationError("this region records no trace: pass trace=True to offload_activations")
        self.stats()
        return self._trace.to_dict()

    def synchronize(self) -> None:
        """Wait for this device's copies in flight and run every release that waited on one."""
        synchronize(self.device)

    def __repr__(self) -> str:
        return (
            f"<OffloadHandle {'active' if self.active else 'closed'} offloaded "
            f"{format_bytes(self._stats.offloaded_bytes)} in {self._stats.offloaded_storages} storages>"
        )


def _release_buffers(
    pool: Any, host: Any, host_view: Any, poison: Any, ledger: Ledger, obj: ManagedObject, *_keep: Any
) -> None:
    """Return a disposed entry's host buffer (to its pool, or poisoned under the sanitizer) and release its object.

    ``_keep``: device buffers a copy in flight used, held until this runs (after it landed).
    """
    if pool is not None:
        pool.release(host)  # the pool poisons it under the sanitizer
    elif poison is not None and host_view is not None:
        poison.poison(host_view)
    if host_view is not None:  # a failed offload returned its host buffer already
        ledger.remove(obj.host_tier or Tier.PINNED, Kind.ACTIVATION, obj.nbytes)
    if obj.state is not State.RELEASED:
        obj.release()


def _check_device(device: Any) -> None:
    check_device(device, "offload_activations")
    capabilities = frozenset(getattr(device, "capabilities", ()))
    if capabilities and Capability.TORCH not in capabilities:
        raise ConfigurationError(
            f"{device!r} does not move torch tensors (its buffers are numpy arrays); create it with torch buffers, "
            "e.g. offcore.device('cpu', buffers='torch')"
        )


def offload_activations(device: Any, **policy: Any) -> OffloadHandle:
    """Offload the tensors autograd saves in the block to host memory; reload them for backward.

    ``device`` is an offcore backend device (``offcore.device("cpu" | "cuda" | "npu", ...)``).
    Backward may run after the block. Policy knobs (all optional):

    - ``min_bytes`` (``"64KiB"``): smaller storages stay on the device.
    - ``prefetch``: ``"deadline"`` (start each reload by its predicted need time, learnt
      across steps) or ``"on_demand"`` (reload when backward asks: every reload stalls).
    - ``prefetch_budget`` (``"256MiB"``): device bytes of reloads allowed ahead of use.
    - ``max_inflight`` (``"256MiB"``; None: no cap): device bytes held by device-to-host copies
      in flight (the device's regions together); a save that would exceed it first waits for
      the oldest copies to land, so the device peak does not grow when the link lags forward.
    - ``margin`` (``"0.5ms"``): slack before each predicted need.
    - ``host_budget`` (``"4GiB"``), ``pinned`` (True): the host pool; ``fallback``
      (``"pageable"`` or ``"keep"``) when it is exhausted.
    - ``watermark`` (None or α in (0, 1)), ``hysteresis`` (0.05): offload only while free
      device memory is below α × capacity.
    - ``modules`` / ``exclude``: offload only inside these submodules' forward / never
      inside these.
    - ``schedule``: an :class:`offcore.scheduler.Scheduler` reused across steps
      (default: one per device).
    - ``trace`` (False): record a Chrome trace (``handle.write_trace(path)``).
    - ``record`` (False): keep the scheduler's events and actions (``handle.schedule_log``,
      ``handle.schedule_actions``) for replay through :func:`offcore.sim.replay.replay`.
    - ``nvme`` (None): a directory (or an :class:`offcore.nvme.NvmeSpec`: a path and a byte
      budget) for a tier of this region's own: host copies go on to disk once their
      device-to-host copy landed and come back (NVMe -> host -> device) before backward
      needs them (:mod:`offcore_torch.activations.nvme`); ``tier="nvme"`` without ``nvme=``
      uses the device's tier (:func:`offcore_torch.nvme_tier`). ``nvme_read_ahead``
      (``"256MiB"``): bytes read back from disk ahead of use at once.

        >>> with offcore_torch.offload_activations(dev, min_bytes="1MiB") as handle:   # doctest: +SKIP
        ...     loss = model(x)
        >>> loss.backward(); print(handle.stats())                                    # doctest: +SKIP
    """
    return OffloadHandle(device, OffloadPolicy.parse(**policy))
