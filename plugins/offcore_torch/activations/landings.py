"""OffloadHandle's landings, prefetches and releases (mixin ``_Residency``; moved from offload.py)."""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

from offcore.errors import (
    CopyFailedError,
    OffcoreWarning,
)
from offcore.kinds import Direction, Kind, Tier
from offcore.ledger import Ledger
from offcore.objects import ManagedObject, State
from offcore.residency import ActionKind
from offcore_torch.activations.copies import _is_oom
from offcore_torch.activations.records import DeviceFate, Entry, EntryState, GroupEntry, Offloaded, RestoredMembers
from offcore_torch.activations.storage import internal_ops

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_EVICT, _PREFETCH, _STAGE = ActionKind.EVICT, ActionKind.PREFETCH, ActionKind.STAGE
_FREED, _HELD_ELSEWHERE, _UNKNOWN = DeviceFate.FREED, DeviceFate.HELD_ELSEWHERE, DeviceFate.UNKNOWN
_H2D = Direction.H2D
_COPYING, _DISPOSED, _FAILED, _LANDED = EntryState.COPYING, EntryState.DISPOSED, EntryState.FAILED, EntryState.LANDED
_ACTIVATION = Kind.ACTIVATION
_OFFLOADING, _PREFETCHING, _RELEASED = State.OFFLOADING, State.PREFETCHING, State.RELEASED
_DEVICE, _PINNED = Tier.DEVICE, Tier.PINNED


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
        ledger.remove(obj.host_tier or _PINNED, _ACTIVATION, obj.nbytes)
    if obj.state is not _RELEASED:
        obj.release()


class _Residency:
    """OffloadHandle's landing, prefetch and release methods (see offload.py)."""

    # -- landing -------------------------------------------------------------------------
    def _on_landed(self, entry: Entry, failure: Exception | None) -> None:
        """The device-to-host copy of ``entry`` landed (or failed): see :func:`poll`."""
        if entry.state is not _COPYING:  # disposed meanwhile
            return
        if failure is not None:
            self._d2h_failed(entry, failure)
            return
        entry.state = _LANDED
        first = entry.items
        if entry.more_items is None and first is not None:  # entry.live_items(), inlined: one record per storage
            item = first()
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
        entry.state = _FAILED
        tier = entry.obj.host_tier or _PINNED
        self._sched.offload_failed(entry.key)
        host, host_view = entry.host, entry.host_view
        entry.host = entry.host_view = None
        if host is not None:
            self._pool().release(host)
        if host_view is not None:
            self._ledger.remove(tier, _ACTIVATION, entry.nbytes)
        if type(entry) is GroupEntry:  # its members' bytes; the version keepers still hold their storages
            self._uncount_group(entry)
        else:
            self._stats.offloaded_bytes -= entry.nbytes
            self._stats.offloaded_storages -= 1
        self._kept["copy_failed"] += entry.live
        self._copy_failed(entry, exc, "device-to-host copy failed")

    def _release_device(self, entry: Entry, items: list[Offloaded] | None = None) -> None:
        """Drop offcore's device references of a landed entry; count what that really freed."""
        if entry.obj.state is _OFFLOADING:
            entry.obj.release_device_copy()  # refuses unless the D2H event completed
        letting_go = entry.src is not None  # the first release since the copy (a group counts its members then)
        empties = self._empty
        for item in entry.live_items() if items is None else items:
            empty = empties.get(item.meta.dtype)
            if empty is None:
                self._release_keeper(item)
            else:  # _release_keeper, inlined (once per offloaded storage)
                item.keeper.data = empty
        entry.src = None
        if type(entry) is GroupEntry:
            if letting_go and not entry.used:
                self._members_released(entry)
        elif entry() is not None:  # its storage lives on
            entry.alive_elsewhere = True
            self._sched.device_copy_alive(entry.key)  # no reload needed while it lives on
            if entry.fate is _UNKNOWN and not entry.used:
                # still alive although backward has not used it: something else references it
                entry.fate = _HELD_ELSEWHERE
                self._stats.held_elsewhere_bytes += entry.nbytes

    def _members_released(self, group: GroupEntry) -> None:
        """A landed group let go of its members' storages (their sources and keepers): what that freed is
        counted now, what lives on is held elsewhere until it dies (:meth:`_member_died`)."""
        stats = self._stats
        held: dict[int, Any] = {}
        for member, ref in enumerate(group.refs):
            storage = ref()
            if storage is None:
                stats.freed_device_bytes += group.sizes[member]
            else:
                held[member] = weakref.ref(storage, functools.partial(self._member_died, group, member))
                stats.held_elsewhere_bytes += group.sizes[member]
        group.held = held or None

    def _storage_died(self, entry: Entry) -> None:
        with self._lock:
            if self._by_storage.get(entry.skey) is entry:
                del self._by_storage[entry.skey]
        if entry.alive_elsewhere:  # only a copy the scheduler was told lives on can die for it
            entry.alive_elsewhere = False
            self._sched.device_copy_died(entry.key)
        if entry.state is _LANDED and entry.fate is not _FREED and not entry.used:
            if entry.fate is _HELD_ELSEWHERE:
                self._stats.held_elsewhere_bytes -= entry.nbytes
            entry.fate = _FREED
            self._stats.freed_device_bytes += entry.nbytes

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
                if action.kind is _PREFETCH:
                    assert entry is not None  # the scheduler offers only registered, unreleased objects
                    self._start_prefetch(entry)
                elif action.kind is _EVICT and entry is not None:
                    self._evict(entry)
                elif action.kind is _STAGE and entry is not None:  # NVMe -> host (activations/nvme.py)
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
        if entry.obj.state is _OFFLOADING:  # held on landing
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
        group = type(entry) is GroupEntry
        try:
            if group:  # each member's own storage (Note [Small storages are offloaded in groups] in records.py)
                restored, pairs = self._members_on_device(entry)  # type: ignore[arg-type]
            elif self._checked_allocation:  # _allocate_device, inlined (once per prefetch)
                dst = self.device.allocate(entry.nbytes, _DEVICE)
            else:
                dst = self._allocate_device(entry.nbytes)
        except Exception as exc:
            if _is_oom(exc):
                sched.refused(entry.key, "oom")
                return False
            raise
        self._in_use.allocated(entry.nbytes)
        try:
            if group:
                done = self._copy_group(_H2D, pairs, entry)  # type: ignore[arg-type]
            else:
                done = self._copy_h2d(dst, entry.host_view, entry.nbytes, entry)
        except Exception as exc:  # not submitted: backward reloads it when it needs it
            if group:  # some of its copies may be enqueued: their storages live until the stream passed them
                self._release_after_stream(self.runtime.h2d_stream, None, (restored, pairs))
            self._copy_failed(entry, exc, "host-to-device prefetch could not be submitted")
            sched.refused(entry.key, "failed")
            return False
        sched.started(entry.key, done)
        storage = restored if group else dst.untyped_storage()
        entry.restored = storage
        entry.restored_ref = weakref.ref(storage)
        self._stats.prefetched_bytes += entry.data_bytes
        self._stats.reloaded_bytes += entry.data_bytes
        return True

    def _members_on_device(self, group: GroupEntry) -> tuple[RestoredMembers, list[tuple[Any, Any]]]:
        """Each member's storage allocated on the device (exactly its size), paired with its bytes on the host."""
        restored = RestoredMembers()
        pairs: list[tuple[Any, Any]] = []
        allocate = self.device.allocate
        host_view = group.host_view
        with internal_ops():  # slices of the host buffer (Note [Metadata ops bypass dispatch modes])
            for offset, size in zip(group.offsets, group.sizes, strict=True):
                # _allocate_device checks the backend's first buffer; a backend's buffers are all alike
                dst = allocate(size, _DEVICE) if self._checked_allocation else self._allocate_device(size)
                restored.append(dst.untyped_storage())
                pairs.append((dst, host_view[offset : offset + size]))
        return restored, pairs

    # -- release -------------------------------------------------------------------------
    def _item_died(self, entry: Entry) -> None:
        entry.live -= 1
        if entry.state is _DISPOSED or entry is self._open_group:  # (an open group: its flush looks at live)
            return
        if entry.live <= 0:
            self._dispose(entry)
        elif entry.restored is not None and entry.used and entry.all_unpacked(self._sched.round):
            self._consumed(entry)

    def _dispose(self, entry: Entry) -> None:
        """No record uses ``entry`` any more: return its host buffer and device references once copies landed."""
        entry.state = _DISPOSED
        if self._by_storage.get(entry.skey) is entry:  # usually gone already: the storage died after its copy
            with self._lock:
                if self._by_storage.get(entry.skey) is entry:
                    del self._by_storage[entry.skey]
        self._by_key.pop(entry.key, None)  # keys are never reused: no check needed (pop is atomic)
        if type(entry) is GroupEntry:
            self._forget_members(entry)
            entry.held = None  # (the weak references of members held elsewhere, and their callbacks, go)
            if entry.obj is None:  # never registered: it could not be copied (_group_not_offloaded)
                return
        self._sched.released(entry.key)
        spill = self._spill
        if spill is not None:
            if entry.nvme is not None:  # its transfers waited for and its file deleted, before its buffers go
                spill.dispose(entry)
            spill.close_if_idle(self.active, len(self._by_key))
        obj = entry.obj
        state = obj.state
        host, host_view = entry.host, entry.host_view
        if state is not _PREFETCHING and state is not _OFFLOADING:
            # nothing in flight touches its buffers (the common case, after backward): _release_buffers, inlined
            entry.host = entry.host_view = entry.src = entry.restored = None
            if host is not None:
                (self._host_pool or self._pool()).release(host)  # the pool poisons it under the sanitizer
            elif self._sanitize and host_view is not None:
                self.device.poison(host_view)
            if host_view is not None:  # a failed offload returned its host buffer already
                self._ledger.remove(obj.host_tier or _PINNED, _ACTIVATION, obj.nbytes)
            if state is not _RELEASED:
                obj.release()
            return
        pool = (self._host_pool or self._pool()) if host is not None else None
        poison = self.device if self._sanitize else None
        runtime = self.runtime
        if state is _PREFETCHING:
            pending, stream = obj.h2d_event, runtime.h2d_stream
        else:
            pending, stream = obj.d2h_event, runtime.d2h_stream
        src, restored = entry.src, entry.restored
        entry.host = entry.host_view = entry.src = entry.restored = None
        # the copy in flight reads ``src`` / writes ``restored``: both live until it landed
        release = functools.partial(_release_buffers, pool, host, host_view, poison, self._ledger, obj, src, restored)
        runtime.defer(pending, release, stream=stream)
