"""Saved activations on the NVMe tier: host copies spilled to disk after their device-to-host copy landed.

``offload_activations(dev, nvme=PATH)`` (a path or an :class:`offcore.nvme.NvmeSpec`: a tier of
the region's own, closed with it) or ``offload_activations(dev, tier="nvme")`` (the device's
tier, set once with :func:`offcore_torch.nvme_tier`) adds a third hop to every offloaded
storage whose host copy is in the region's pinned pool::

    device --D2H--> pinned host --write--> NVMe      (forward: after the D2H landed)
    NVMe --read--> pinned host --H2D--> device       (backward: reads start ahead, by need)

What it does, per offloaded storage (an :class:`offcore_torch.activations.records.Entry`; its ``nvme``
field is the spill state below):

- **spill** (``writing``): once the D2H copy landed and the device copy was let go, the host
  buffer is written to the tier. When the write completed, the pinned buffer goes back to the
  pool (``disk``) — or stays (``both``) when a host-to-device copy reads it or its storage is
  restored on the device. Note [Spilled host buffers go back after their write].
- **stage** (``reading``): a storage whose host buffer went back is ``spilled`` to the
  region's ResidencyScheduler, which plans its read on the tier's measured read link before
  its host-to-device copy (Note [Two hops from NVMe] in offcore/residency.py): its STAGE
  actions start the reads (refused while ``nvme_read_ahead`` bytes are read back and not used
  yet, or the pool is full: offered again), and each landed read is a trigger (``staged``)
  whose prefetches may start. Without a plan (``prefetch="on_demand"``) reads start in reverse
  save order within the same window. A read lands in a fresh buffer of the same pool (``both``).
- **reload**: a host-to-device copy (prefetch or on-demand reload) first makes sure the host
  copy is there (:meth:`ActivationSpill.ensure_host`: it waits for the read, starting it if
  needed — an NVMe stall, counted in ``OffloadStats.nvme_stalls``).
- **consumed**: once backward used the restored storage (the object is only offloaded
  again), a host copy read back from disk goes back to the pool again and the object is
  spilled again (the file stays: a retained graph reads it again).
- **release**: when autograd drops the records, the file is deleted (after any transfer of
  it in flight); a tier of the region's own is closed once the region exited and nothing of
  it is left, and in any case when the region is garbage collected (its directory removed).

A failed or refused write (budget full) keeps the host copy, which stays the data (counted in
``OffloadStats.nvme_failures``, warned once per region for failures); a failed read raises
:class:`offcore.CopyFailedError` naming the storage at its use.

    >>> import offcore, offcore_torch, tempfile, torch
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> with dev:
    ...     w = torch.randn(256, 256, requires_grad=True)
    ...     with offcore_torch.offload_activations(dev, min_bytes=0, nvme=tempfile.mkdtemp()) as h:
    ...         loss = torch.tanh(torch.randn(512, 256) @ w).sum()
    ...     loss.backward()
    >>> h.stats().offloaded_bytes > 0        # spilled_bytes, nvme_read_bytes: what went through the disk
    True
"""

from __future__ import annotations

import itertools
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from offcore.errors import CapacityExceededError, CopyFailedError, OffcoreError, OffcoreWarning
from offcore.kinds import Kind, Tier
from offcore.objects import State
from offcore.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from offcore.nvme.tier import IOHandle, NvmeTier
    from offcore_torch.activations.records import Entry, Region

__all__ = ["ActivationSpill", "WRITING", "DISK", "BOTH", "READING"]

WRITING = "writing"
"""The host copy is being written to the tier (the host buffer is the data, and stays)."""
DISK = "disk"
"""Only the tier holds the data (the pinned buffer went back to the pool)."""
BOTH = "both"
"""The tier and a host buffer hold the data (read back, or kept because a copy read the buffer)."""
READING = "reading"
"""The data is being read back from the tier into a host buffer (not usable yet)."""

_REGIONS = itertools.count()

# Note [Spilled host buffers go back after their write]
# A spilled storage's pinned host buffer is the data until the tier says its write completed:
# it goes back to the pool only then (the pool may hand it out, and under the fake device's
# sanitizer poisons it, at once), never when the write is merely submitted — a failed write
# keeps the host copy as the data. Even after a completed write the buffer stays while a
# host-to-device copy may read it (the object is PREFETCHING, or the region still refers to a
# restored device copy whose copy read it): it is released at the next chance (consumed) or
# with the entry. A read-back buffer is handed to the entry (``entry.host``) only once its read
# completed; before that, ensure_host waits for it. At disposal every transfer of the entry in
# flight is waited for before its buffers go back and its file is deleted, so no I/O thread
# ever writes into, or reads from, a buffer the pool handed out again.


class ActivationSpill:
    """The NVMe hop of one activation-offload region (see the module docstring)."""

    def __init__(self, region: Region, tier: NvmeTier, *, owned: bool, read_ahead: int) -> None:
        self.tier = tier
        self.owned = owned
        self.read_ahead_bytes = read_ahead
        self._region_ref = weakref.ref(region)
        self._prefix = ("activations", next(_REGIONS))
        self.writes: dict[int, tuple[Entry, IOHandle]] = {}
        self.reads: dict[int, tuple[Entry, IOHandle, Any, Any, Tier]] = {}
        self.on_disk: dict[int, Entry] = {}
        self.ahead_bytes = 0  # bytes read back (or being read) and not used yet
        self._ahead: set[int] = set()  # their keys
        # entries on disk whose host buffer a host-to-device copy reads: returned once it landed
        self._kept: dict[int, Entry] = {}
        self._notify: list[int] = []  # reads landed that the scheduler was not told of yet (staged)
        # the host tier each spilled entry's buffer came from (the scheduler marks a spilled object's host_tier
        # NVME, and PINNED once staged): what the region's ledger counts its read-back buffer on
        self._tiers: dict[int, Tier] = {}
        self.disk_bytes = 0
        self.peak_disk_bytes = 0
        self.written_bytes = 0
        self.read_bytes = 0
        self.stalls = 0
        self.stall_s = 0.0
        self.failures = 0
        self.full = 0
        self._warned = False
        self._closed = False
        # the owned tier goes with the region at the latest (its directory removed)
        self._finalizer = weakref.finalize(region, tier.close) if owned else None

    def _key(self, entry: Entry) -> tuple[Any, ...]:
        return (*self._prefix, entry.key)

    @property
    def pending(self) -> bool:
        """Transfers in flight, or host buffers waiting for a copy (the region polls them)."""
        return bool(self.writes or self.reads or self._kept or self._notify)

    # -- forward: spill --------------------------------------------------------------------
    def landed(self, entry: Entry) -> None:
        """The D2H copy of ``entry`` landed and its device copy was let go: write the host copy to disk."""
        if self._closed or entry.nvme is not None or entry.host is None:  # pageable fallbacks stay in host memory
            return
        view = entry.host_view
        assert view is not None
        try:
            handle = self.tier.write(self._key(entry), view.numpy(), kind=Kind.ACTIVATION)
        except CapacityExceededError:
            self.full += 1  # the budget on disk is used up: the host copy stays the data
            return
        except OffcoreError as exc:
            self._failed(entry, exc, "could not be started")
            return
        entry.nvme = WRITING
        self.writes[entry.key] = (entry, handle)

    def poll(self) -> None:
        """Settle the writes and reads that completed."""
        if self.writes:
            for key, (entry, handle) in list(self.writes.items()):
                if handle.done:
                    del self.writes[key]
                    self._write_done(entry, handle)
        if self.reads:
            for entry, handle, *_rest in list(self.reads.values()):
                if handle.done and handle.exception() is None:  # a failed one raises at its use (ensure_host)
                    self._read_done(entry)
        if self._kept:
            for entry in list(self._kept.values()):
                self._drop_host(entry)
        if self._notify:  # each landed read is a trigger of the scheduler (Note [Two hops from NVMe])
            region = self._region_ref()
            keys, self._notify = self._notify, []
            if region is not None:
                sched = region._sched
                for key in keys:
                    if key in sched.objects and region._by_key.get(key) is not None:
                        actions = sched.staged(key, time.perf_counter())
                        sched.objects[key].host_tier = self._tiers.get(key, Tier.PINNED)
                        region._execute(actions)

    def _write_done(self, entry: Entry, handle: IOHandle) -> None:
        error = handle.exception()
        if error is not None:
            entry.nvme = None  # the host copy stays the data (Note [Spilled host buffers go back after their write])
            self._failed(entry, error, "failed")
            return
        self.written_bytes += entry.nbytes
        self.disk_bytes += entry.nbytes
        self.peak_disk_bytes = max(self.peak_disk_bytes, self.disk_bytes)
        entry.nvme = BOTH
        self._drop_host(entry)

    def _failed(self, entry: Entry, exc: BaseException, what: str) -> None:
        self.failures += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"offcore: writing saved tensor {entry.name} to the NVMe tier {what} ({type(exc).__name__}: {exc}); "
                "its host copy stays the data (see OffloadStats.nvme_failures)",
                OffcoreWarning,
                stacklevel=4,
            )

    def _drop_host(self, entry: Entry) -> bool:
        """Return the host buffer of an entry whose data is on disk, when no copy reads it (True: returned)."""
        if entry.nvme is not BOTH or entry.host is None:
            return False
        obj = entry.obj
        if obj.state is not State.OFFLOADED:
            # a host-to-device copy reads it, or its device copy is in use: once it is only offloaded again (poll,
            # consumed), so that the scheduler can be told it lives on disk (spilled)
            self._kept[entry.key] = entry
            return False
        self._kept.pop(entry.key, None)
        region = self._region_ref()
        if region is None:  # pragma: no cover - the region owns the entry
            return False
        host = entry.host
        entry.host = entry.host_view = None
        entry.nvme = DISK
        self.on_disk[entry.key] = entry
        region._pool().release(host)  # the pool poisons it under the sanitizer
        tier = self._tiers[entry.key] = obj.host_tier or Tier.PINNED
        region._ledger.remove(tier, Kind.ACTIVATION, entry.nbytes)
        self._used(entry)
        region._sched.spilled(entry.key)  # its reload is two hops, planned on the tier's read link
        return True

    def _used(self, entry: Entry) -> None:
        if entry.key in self._ahead:
            self._ahead.discard(entry.key)
            self.ahead_bytes -= entry.nbytes

    def consumed(self, entry: Entry) -> None:
        """Backward used the restored storage: a host copy that is also on disk goes back to the pool."""
        if entry.nvme is BOTH:
            self._drop_host(entry)

    # -- backward: read back ---------------------------------------------------------------
    def stage(self, entry: Entry) -> bool:
        """The scheduler's STAGE of ``entry`` (Note [Two hops from NVMe]): start its read (False: refused, no room
        in the pool or ``read_ahead`` bytes already read back and unused; offered again at the next trigger)."""
        state = entry.nvme
        if state is not DISK:
            return state is READING or state is BOTH  # already on its way, or back
        if self.ahead_bytes and self.ahead_bytes + entry.nbytes > self.read_ahead_bytes:
            return False
        return self._start_read(entry, required=False)

    def read_ahead(self, plan: Any) -> None:
        """Without a scheduler plan to stage by (``prefetch="on_demand"``): start reads of storages on disk in
        reverse save order, up to ``read_ahead`` bytes read back and unused."""
        if plan is not None or not self.on_disk or self.ahead_bytes >= self.read_ahead_bytes:
            return
        for entry in sorted(self.on_disk.values(), key=lambda e: -e.key):  # backward needs the last saved first
            if self.ahead_bytes + entry.nbytes > self.read_ahead_bytes and self.ahead_bytes:
                return
            if not self._start_read(entry, required=False):
                return

    def _start_read(self, entry: Entry, *, required: bool) -> bool:
        region = self._region_ref()
        assert region is not None
        nbytes = entry.nbytes
        pool = region._pool()
        tier = region._host_tier
        try:
            buffer = pool.acquire(nbytes)
            view = buffer.view
        except CapacityExceededError:
            if not required:
                return False  # the pool is full now: read at the use
            buffer, view, tier = None, region.device.allocate(nbytes, Tier.PAGEABLE), Tier.PAGEABLE
        try:
            handle = self.tier.read(self._key(entry), view.numpy())
        except BaseException:
            if buffer is not None:
                pool.release(buffer)
            raise
        del self.on_disk[entry.key]
        entry.nvme = READING
        self.reads[entry.key] = (entry, handle, buffer, view, tier)
        self._ahead.add(entry.key)
        self.ahead_bytes += nbytes
        return True

    def _read_done(self, entry: Entry) -> None:
        """Hand a completed read's buffer to the entry (a failed read's buffer goes back; the file stays)."""
        _, handle, buffer, view, _tier = self.reads.pop(entry.key)
        region = self._region_ref()
        assert region is not None
        error = handle.exception()
        if error is not None:
            if buffer is not None:
                region._pool().release(buffer)
            entry.nvme = DISK
            self.on_disk[entry.key] = entry
            self._used(entry)
            raise CopyFailedError(
                f"could not read saved tensor {entry.name} ({format_bytes(entry.nbytes)}) back from the NVMe tier "
                f"({type(error).__name__}: {error}); its file is kept, but this backward cannot go on. Drop the graph "
                "(the step) and run it again."
            ) from error
        self.read_bytes += entry.nbytes
        entry.host, entry.host_view = buffer, view
        entry.nvme = BOTH
        self._notify.append(entry.key)
        tier = entry.obj.host_tier = self._tiers.get(entry.key, Tier.PINNED)  # what the entry's release removes
        region._ledger.add(tier, Kind.ACTIVATION, entry.nbytes)

    def ensure_host(self, entry: Entry) -> None:
        """Make the host copy of ``entry`` usable (read it back, waiting for it): before any host-to-device copy."""
        state = entry.nvme
        if state is BOTH:
            self._kept[entry.key] = entry  # the caller's copy reads it next: the buffer goes once that landed
            return
        if state is None or state is WRITING:
            return
        if state is DISK:
            self._start_read(entry, required=True)
        _, handle, *_ = self.reads[entry.key]
        if not handle.done:
            self.stalls += 1
            start = time.perf_counter()
            try:
                handle.synchronize()
            except Exception:  # reported by _read_done
                pass
            self.stall_s += time.perf_counter() - start
        self._read_done(entry)
        self._kept[entry.key] = entry

    # -- release ---------------------------------------------------------------------------
    def dispose(self, entry: Entry) -> None:
        """No record uses ``entry`` any more: wait for its transfers, return a read buffer, delete its file."""
        state = entry.nvme
        if state is None:
            return
        key = entry.key
        if state is WRITING:  # the host buffer is the data until its write completed: wait for it
            _, handle = self.writes.pop(key)
            try:
                handle.synchronize()
            except Exception:  # a failed write: nothing on disk to count
                pass
        else:
            self.disk_bytes -= entry.nbytes  # counted when its write completed
        if state is READING:  # the I/O thread writes into the buffer until the read completed
            _, handle, buffer, _view, _tier = self.reads.pop(key)
            try:
                handle.synchronize()
            except Exception:
                pass
            region = self._region_ref()
            if buffer is not None and region is not None:
                region._pool().release(buffer)
        self._used(entry)
        self.on_disk.pop(key, None)
        self._kept.pop(key, None)
        self._tiers.pop(key, None)
        entry.nvme = None
        if not self.tier.closed and self._key(entry) in self.tier:
            self.tier.delete(self._key(entry))

    def close_if_idle(self, region_active: bool, live_entries: int) -> None:
        """Close a tier of the region's own once the region exited and no entry is left (its directory goes)."""
        if self.owned and not region_active and not live_entries and not self.pending and not self.on_disk:
            self.close()

    def close(self) -> None:
        """Close an owned tier now (its files and directory removed); a shared tier stays open."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
