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
import threading
import time
from typing import Any

import torch

from offcore.errors import (
    ConfigurationError,
    SavedTensorHooksDisabledError,
)
from offcore.kinds import Direction, Tier
from offcore.ledger import Ledger
from offcore.protocols import Capability
from offcore.residency import Action, ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore.trace import TraceRecorder
from offcore.units import format_bytes
from offcore_torch.activations.copies import _AllocatedBytes, _inside_checkpoint, poll, synchronize
from offcore_torch.activations.landings import _Residency
from offcore_torch.activations.nvme import ActivationSpill
from offcore_torch.activations.pack import _Pack
from offcore_torch.activations.policy import OffloadPolicy, PackRules, no_offload
from offcore_torch.activations.records import GROUP_BUDGET_SHARE, GROUP_MAX_BYTES, Entry, GroupEntry
from offcore_torch.activations.stats import OffloadStats
from offcore_torch.activations.storage import (
    MARK_ATTRIBUTE,
)
from offcore_torch.activations.unpack import _Unpack
from offcore_torch.budget import shared_budget_for
from offcore_torch.nvme import open_nvme
from offcore_torch.runtime import (
    DeviceRuntime,
    check_device,
    runtime_for,
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


# ------------------------------------------------------------------------------- region
class OffloadHandle(_Pack, _Unpack, _Residency):
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
        # an empty uint8 tensor per device: ``.new()`` of it starts each copy's whole-storage byte view (pack.py)
        self._no_bytes: dict[torch.device, torch.Tensor] = {}
        # Note [Small storages are offloaded in groups] (records.py): the group new small storages join, and how
        # many bytes a group holds at most (a quarter of what may be prefetched at once, so a group fits it)
        shared = shared_budget_for(device)
        ahead = policy.prefetch_budget if shared is None else min(policy.prefetch_budget, shared.capacity_bytes)
        self._group_max = min(GROUP_MAX_BYTES, ahead // GROUP_BUDGET_SHARE)
        self._group_below = min(policy.group_below, self._group_max)
        self._open_group: GroupEntry | None = None
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
            if self._open_group is not None:  # forward ended: the open group is copied now
                self._flush_group()
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
        out.saved_tensors = self._next_key  # one key per pack (_pack)
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
        """Copy the open group of small storages, if any (Note [Small storages are offloaded in groups] in
        records.py); then wait for this device's copies in flight and run every release that waited on one."""
        if self._open_group is not None:
            self._flush_group()
        synchronize(self.device)

    def __repr__(self) -> str:
        return (
            f"<OffloadHandle {'active' if self.active else 'closed'} offloaded "
            f"{format_bytes(self._stats.offloaded_bytes)} in {self._stats.offloaded_storages} storages>"
        )


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
    - ``group_below`` (0: off; at most ``"1MiB"``): storages smaller than this are offloaded in
      groups (up to 1 MiB or 256 storages each): one host buffer, one copy each way, one
      scheduled object per group instead of per storage, which cuts offcore's host work per
      small saved tensor (Note [Small storages are offloaded in groups] in
      :mod:`offcore_torch.activations.records`).

        >>> with offcore_torch.offload_activations(dev, min_bytes="1MiB") as handle:   # doctest: +SKIP
        ...     loss = model(x)
        >>> loss.backward(); print(handle.stats())                                    # doctest: +SKIP
    """
    return OffloadHandle(device, OffloadPolicy.parse(**policy))
