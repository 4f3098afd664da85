"""OffloadHandle's pack side: saved tensors copied to the host (mixin ``_Pack``; moved from offload.py)."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from offcore.errors import (
    CapacityExceededError,
    OffcoreWarning,
)
from offcore.inflight import must_wait
from offcore.kinds import Direction, Kind, Tier
from offcore.objects import State
from offcore_torch.activations.copies import _INFLIGHT_WAIT, _RANGE_NAMES, _CopyRefused, _profiler, _range, poll
from offcore_torch.activations.records import (
    GROUP_ALIGN,
    GROUP_MAX_MEMBERS,
    Entry,
    EntryState,
    GroupedOffloaded,
    GroupEntry,
    Kept,
    Offloaded,
    new_entry,
    new_group,
)
from offcore_torch.activations.storage import (
    MARK_ATTRIBUTE,
    TensorMeta,
    dispatch_modes,
    internal_ops,
)
from offcore_torch.runtime import (
    _TIMING_BATCH,
)

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_D2H, _H2D = Direction.D2H, Direction.H2D
_DISPOSED, _FAILED, _LANDED = EntryState.DISPOSED, EntryState.FAILED, EntryState.LANDED
_ACTIVATION = Kind.ACTIVATION
_OFFLOADED, _OFFLOADING = State.OFFLOADED, State.OFFLOADING
_PAGEABLE = Tier.PAGEABLE


class _Pack:
    """OffloadHandle's pack methods (see offload.py, Note [Batched bookkeeping])."""

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
        if not (elsewhere or thread) or self._stats.offloaded_tensors or self.runtime.warned_elsewhere:
            return
        self.runtime.warned_elsewhere = True
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
        self._next_key = key + 1  # also the stats' saved_tensors (stats())
        self._sched.produced(key, time.perf_counter())
        runtime = self.runtime
        if (
            runtime._d2h_in_flight
            or runtime._deferred_total
            or runtime._landed
            or runtime._timed_pending >= _TIMING_BATCH  # fewer: poll would leave them (runtime.poll)
        ):
            poll(runtime)  # poll's own checks, inlined: with nothing in flight the call is skipped
        spill = self._spill
        if spill is not None and spill.pending:
            spill.poll()
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
        if entry is not None and entry.state is not _DISPOSED:
            if entry() is storage:
                return self._pack_shared(entry, tensor, key, entry.version_at_copy)
            if type(entry) is GroupEntry:  # a member's storage? (a group's own reference is always dead)
                member = entry.index.get(skey)
                if member is not None and entry.refs[member]() is storage:
                    return self._pack_shared(entry, tensor, key, entry.versions[member], member)

        reason = rules.for_new_storage(nbytes, marked)
        if reason is not None:
            return self._keep(tensor, key, reason)
        if nbytes < self._group_below:  # Note [Small storages are offloaded in groups] (records.py)
            return self._pack_grouped(storage, nbytes, skey, tensor, key)
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
        entry.items = weakref.ref(item)  # entry.add_item(item), inlined: its first record
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

    def _record(self, entry: Entry, tensor: torch.Tensor, key: int, meta: TensorMeta, member: int = -1) -> Offloaded:
        fmt = self.device.format_of(tensor) if self._formats else None
        if member < 0:
            item = Offloaded(entry, tensor, key, fmt, meta)
        else:  # a group's member (Note [Small storages are offloaded in groups] in records.py)
            item = GroupedOffloaded(entry, tensor, key, fmt, meta, member)
        entry.add_item(item)
        self._stats.offloaded_tensors += 1
        entry.live += 1
        if entry.state is _LANDED:
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

    def _pack_shared(self, entry: Entry, tensor: torch.Tensor, key: int, version: int, member: int = -1) -> Any:
        """A further tensor on an already offloaded storage, ``version`` when its copy was taken (for a group's
        ``member``: when the group took it): share its copy (dedupe). The open group's copy is still to come."""
        if entry is not self._open_group:
            obj = entry.obj  # None: a group that could not be copied
            if obj is None or obj.state not in (_OFFLOADING, _OFFLOADED) or self._sched.in_backward:
                return self._keep(tensor, key, "shared_storage_busy")
        if tensor._version != version:
            # modified in place since the copy was taken: the copy is stale for this tensor.
            # (The earlier saves of this storage will fail their own version check.)
            return self._keep(tensor, key, "modified_after_save")
        entry.keys += (key,)  # a tuple, a new one; a group's list, extended
        return self._record(entry, tensor, key, TensorMeta.of(tensor), member)

    def _under_pressure(self) -> bool:
        """The watermark rule on the device's own accounting (PackRules.under_pressure)."""
        return self._rules.under_pressure()

    def _pool(self) -> Any:
        pool = self._host_pool
        if pool is None:
            pool = self._host_pool = self.runtime.pool(self.device, self.policy.host_budget, self.policy.pinned)
        return pool

    def _host_buffer(self, nbytes: int) -> tuple[Any, torch.Tensor, Tier] | None:
        """A host buffer of ``nbytes`` for a device-to-host copy: the pool's, else what the fallback policy
        gives (:meth:`_host_after_refusal`); None: keep on the device."""
        pool = self._host_pool or self._pool()
        try:
            if dispatch_modes():  # may slice a pool block (Note [Metadata ops bypass dispatch modes])
                with internal_ops():
                    buffer = pool.acquire(nbytes)
            else:
                buffer = pool.acquire(nbytes)
        except CapacityExceededError:
            return self._host_after_refusal(nbytes)
        return buffer, buffer.view, self._host_tier

    def _storage_bytes(self, storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
        """A ``uint8`` tensor over every byte of ``storage`` (a copy's source): ``raw_bytes`` without torch.empty's
        argument parsing, from this region's empty byte tensor on ``device``."""
        if dispatch_modes():
            with internal_ops():
                return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        no_bytes = self._no_bytes.get(device)
        if no_bytes is None:
            no_bytes = self._no_bytes[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return no_bytes.new().set_(storage)

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
            view = self.device.allocate(nbytes, _PAGEABLE)
        except (CapacityExceededError, MemoryError, RuntimeError):
            return None
        return None, view, _PAGEABLE

    # Note [One copy method per direction]
    # A saved storage costs two copies: its device-to-host copy at pack (``_copy_d2h``) and its
    # host-to-device prefetch (``_copy_h2d``). Each direction has its own method, so no branch on
    # the direction is taken per copy: both enqueue the copy on their direction's stream, ordered
    # after the compute stream as it is now (for D2H the compute stream produced ``src``; for H2D
    # the new device buffer may reuse memory the compute stream used until now): the copy stream
    # waits for an event recorded on the stream that is current *at this call* (never a cached
    # one; Note [Ordering events are recorded again]). Each returns the copy's completion event.
    # Each region times its first two copies per direction (its bandwidth figure), every copy when
    # tracing, and otherwise the runtime's sample (DeviceRuntime.sample), for the link
    # estimate; a copy that is timed, or seen by a running profiler, goes through ``_copy_timed``.
    def _copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, entry: Entry) -> Any:
        """The device-to-host copy of ``src`` into ``dst`` (Note [One copy method per direction])."""
        runtime = self.runtime
        count = self._d2h_copies
        self._d2h_copies = count + 1
        self._d2h_bytes += nbytes
        timed = runtime.timing and (count < 2 or self._tracing or runtime.sample(_D2H))
        if timed or _profiler._is_profiler_enabled:
            return self._copy_timed(runtime.d2h_stream, _D2H, dst, src, nbytes=nbytes, entry=entry, timed=timed)
        device, stream = self.device, runtime.d2h_stream
        order = self._d2h_order
        if order is None:  # Note [Ordering events are recorded again]
            order = self._d2h_order = device.new_event()
        stream.wait_event(device.current_stream().record_event(order))
        return device.copy_(dst, src, stream=stream)

    def _copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, entry: Entry) -> Any:
        """The host-to-device copy of ``src`` into ``dst`` (Note [One copy method per direction])."""
        runtime = self.runtime
        count = self._h2d_copies
        self._h2d_copies = count + 1
        self._h2d_bytes += nbytes
        timed = runtime.timing and (count < 2 or self._tracing or runtime.sample(_H2D))
        if timed or _profiler._is_profiler_enabled:
            return self._copy_timed(runtime.h2d_stream, _H2D, dst, src, nbytes=nbytes, entry=entry, timed=timed)
        device, stream = self.device, runtime.h2d_stream
        if not self._h2d_ordered:
            order = self._h2d_order
            if order is None:  # Note [Ordering events are recorded again]
                order = self._h2d_order = device.new_event()
            stream.wait_event(device.current_stream().record_event(order))
            # the prefetches of one trigger start back to back: nothing reaches the compute stream
            # in between, so the first one's wait orders them all (Note [Ordering events are recorded again])
            self._h2d_ordered = True
        return device.copy_(dst, src, stream=stream)

    def _copy_timed(
        self, stream: Any, direction: Direction, dst: Any, src: Any, *, nbytes: int, entry: Entry, timed: bool
    ) -> Any:
        """:meth:`_copy_d2h` or :meth:`_copy_h2d` for a copy that is timed, or seen by a running profiler (its own range)."""
        device, runtime = self.device, self.runtime
        with _range(_RANGE_NAMES[direction]):
            stream.wait_event(device.current_stream().record_event())
            if not timed:
                return device.copy_(dst, src, stream=stream)
            # Note [Copy timings start at the copy]
            start, issued = runtime.begin_timing(device, stream, record=False)
            done = device.copy_(dst, src, stream=stream, start_event=start)
            self._end_timing(stream, start, issued, nbytes=nbytes, direction=direction, label=entry.name)
        return done

    def _end_timing(
        self, stream: Any, start: Any, issued: float, *, nbytes: int, direction: Direction | None, label: str
    ) -> None:
        """``runtime.end_timing`` of a copy (or a wait: ``direction`` None) this region timed, into its ledger and
        trace."""
        self.runtime.end_timing(
            self.device,
            stream,
            start,
            issued,
            nbytes=nbytes,
            direction=direction,
            label=label,
            ledger=self._ledger,
            trace=self._trace,
        )

    def _flush_copies(self) -> None:
        """Add the copies issued since the last flush to the ledger (Note [Batched bookkeeping])."""
        now = (self._d2h_copies, self._d2h_bytes, self._h2d_copies, self._h2d_bytes)
        last, self._flushed = self._flushed, now
        if now[0] != last[0]:
            self._ledger.record_copy(_D2H, now[1] - last[1], copies=now[0] - last[0])
        if now[2] != last[2]:
            self._ledger.record_copy(_H2D, now[3] - last[3], copies=now[2] - last[2])

    def _offload(
        self, storage: torch.UntypedStorage, nbytes: int, skey: int, tensor: torch.Tensor, key: int, meta: TensorMeta
    ) -> Entry | None:
        host = self._host_buffer(nbytes)  # once per offloaded storage: the pool first
        if host is None:
            return None
        buffer, host_view, tier = host
        stack = self._rules.module_stack
        where = stack[-1] if stack else "forward"  # PackRules.where(), inlined
        # the weak reference to ``storage``
        entry = new_entry(storage, self, key, where, meta, nbytes, skey, buffer, host_view, tensor._version)
        src = entry.src = self._storage_bytes(storage, meta.device)
        try:
            done = self._copy_d2h(host_view, src, nbytes, entry)
        except BaseException as exc:
            # nothing was enqueued: the host buffer goes back now, and the tensor stays on the device
            if buffer is not None:
                self._pool().release(buffer)
            if isinstance(exc, Exception):
                self._copy_failed(entry, exc, "device-to-host copy could not be submitted")
                raise _CopyRefused from exc
            raise
        entry.obj = self._sched.register_offloading(key, _ACTIVATION, nbytes, done, tier, name=f"#{key} {where}")
        with self._lock:
            self._by_storage[skey] = entry
            self._by_key[key] = entry
        self.runtime.track_d2h(done, entry, nbytes)
        self._ledger.add(tier, _ACTIVATION, nbytes)
        stats = self._stats
        stats.offloaded_bytes += nbytes
        stats.offloaded_storages += 1
        return entry

    # -- groups (Note [Small storages are offloaded in groups] in records.py) --------------------
    def _pack_grouped(
        self, storage: torch.UntypedStorage, nbytes: int, skey: int, tensor: torch.Tensor, key: int
    ) -> Offloaded:
        """Add a new small storage to the open group (the group is copied later, whole) and record ``tensor``."""
        size = -(-nbytes // GROUP_ALIGN) * GROUP_ALIGN
        group = self._open_group
        if group is not None and (group.filled + size > self._group_max or len(group.refs) >= GROUP_MAX_MEMBERS):
            self._flush_group()
            group = None
        meta = TensorMeta.of(tensor)
        if group is None:
            stack = self._rules.module_stack
            group = self._open_group = new_group(self, key, stack[-1] if stack else "forward", meta)
            runtime = self.runtime
            with runtime.lock:  # (offcore_torch.synchronize copies it; it may look from another thread)
                runtime.open_groups[self] = self._thread
        src = self._storage_bytes(storage, meta.device)
        member = len(group.refs)
        group.index[skey] = member
        group.refs.append(weakref.ref(storage))
        group.sizes.append(nbytes)
        group.offsets.append(group.filled)
        group.versions.append(tensor._version)
        group.src.append(src)  # type: ignore[attr-defined]
        group.keys += (key,)  # (a list)
        group.filled += size
        group.data_bytes += nbytes
        with self._lock:
            self._by_storage[skey] = group
        stats = self._stats
        stats.offloaded_bytes += nbytes
        stats.offloaded_storages += 1
        return self._record(group, tensor, key, meta, member)

    def _flush_group(self) -> None:
        """Copy the open group to the host (one buffer, one ``copy_many``) and register it with the scheduler."""
        group = self._open_group
        if group is None:
            return
        self._open_group = None
        runtime = self.runtime
        with runtime.lock:
            runtime.open_groups.pop(self, None)
        if group.live <= 0:  # autograd dropped every record already (a graph freed in forward): nothing to copy
            group.state = _DISPOSED
            self._uncount_group(group)
            return
        nbytes = group.nbytes = group.filled
        group._name = f"#{group.key} {group.where} group of {len(group.refs)} storages"
        cap = self._max_inflight
        if must_wait(runtime._d2h_bytes, nbytes, cap) and runtime._d2h_in_flight:
            self._wait_inflight(nbytes, cap)  # Note [Activation copies in flight are capped]
        host = self._host_buffer(nbytes)
        if host is None:
            self._group_not_offloaded(group, "host_budget")
            return
        buffer, host_view, tier = host
        group.host, group.host_view = buffer, host_view
        with internal_ops():
            pairs = [
                (host_view[offset : offset + size], src)
                for offset, size, src in zip(group.offsets, group.sizes, group.src, strict=True)  # type: ignore[call-overload]
            ]
        try:
            done = self._copy_group(_D2H, pairs, group)
        except BaseException as exc:
            # some of the group's copies may be enqueued already (copy_many checks and submits pair by
            # pair): its host buffer and its members' storages go only once the stream got past them
            del pairs
            self._release_after_stream(runtime.d2h_stream, group.host, group.src)
            group.host = group.src = None
            if isinstance(exc, Exception):
                self._copy_failed(group, exc, "device-to-host copy could not be submitted")
                self._group_not_offloaded(group, "copy_failed")
                return
            raise
        group.obj = self._sched.register_offloading(group.key, _ACTIVATION, nbytes, done, tier, name=group.name)
        with self._lock:
            self._by_key[group.key] = group
        runtime.track_d2h(done, group, nbytes)
        self._ledger.add(tier, _ACTIVATION, nbytes)

    def _copy_group(
        self, direction: Direction, pairs: list[tuple[torch.Tensor, torch.Tensor]], group: GroupEntry
    ) -> Any:
        """A group's copies in ``direction``: one ``copy_many`` where the backend has it, else a ``copy_`` each
        on the direction's stream (the last event completes after all); ordered after the compute stream as it
        is now (Note [One copy method per direction]) and timed as those copies are."""
        runtime, device = self.runtime, self.device
        nbytes = group.data_bytes  # the bytes its copies move
        if direction is _D2H:
            stream, count = runtime.d2h_stream, self._d2h_copies
            self._d2h_copies = count + len(pairs)
            self._d2h_bytes += nbytes
            order = self._d2h_order
            if order is None:  # Note [Ordering events are recorded again]
                order = self._d2h_order = device.new_event()
        else:
            stream, count = runtime.h2d_stream, self._h2d_copies
            self._h2d_copies = count + len(pairs)
            self._h2d_bytes += nbytes
            order = self._h2d_order
            if order is None:
                order = self._h2d_order = device.new_event()
        timed = runtime.timing and (count < 2 or self._tracing or runtime.sample(direction))
        compute = device.current_stream()
        with _range(_RANGE_NAMES[direction]) if timed or _profiler._is_profiler_enabled else contextlib.nullcontext():
            stream.wait_event(compute.record_event(order))
            start, issued = runtime.begin_timing(device, stream) if timed else (None, 0.0)
            done = self._copy_pairs(pairs, stream)
            if timed:
                self._end_timing(stream, start, issued, nbytes=nbytes, direction=direction, label=group.name)
        return done

    def _copy_pairs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> Any:
        """``copy_many(pairs)``, or a ``copy_`` per pair (the last one's event completes after all)."""
        many = getattr(self.device, "copy_many", None)
        if many is not None and len(pairs) > 1:
            return many(pairs, stream=stream)
        done = None
        for dst, src in pairs:
            done = self.device.copy_(dst, src, stream=stream)
        return done

    def _release_after_stream(self, stream: Any, buffer: Any, keep: Any) -> None:
        """Return ``buffer`` to the pool, and drop ``keep``, once ``stream`` completed what it was given so far."""
        pool = self._host_pool or self._pool()

        def release(buffer: Any = buffer, keep: Any = keep) -> None:
            if buffer is not None:
                pool.release(buffer)

        try:
            event = stream.record_event()
        except Exception:  # the stream takes no more work: wait for what it has
            with contextlib.suppress(Exception):
                stream.synchronize()
            release()
            return
        self.runtime.defer(event, release, stream=stream)

    def _group_not_offloaded(self, group: GroupEntry, reason: str) -> None:
        """The open group could not be copied: its members stay on the device, each record reads its keeper."""
        group.state = _FAILED
        if group.host is not None:
            self._pool().release(group.host)
        group.host = group.host_view = None
        self._uncount_group(group)  # the version keepers hold the storages (never released: the group did not land)
        self._kept[reason] += group.live

    def _uncount_group(self, group: GroupEntry) -> None:
        """The group's copy does not hold its members (never made, or failed): it lets go of their sources, they
        are no longer found through ``_by_storage``, and they leave the offloaded figures."""
        group.src = None
        self._forget_members(group)
        stats = self._stats
        stats.offloaded_bytes -= group.data_bytes
        stats.offloaded_storages -= len(group.refs)

    def _forget_members(self, group: GroupEntry) -> None:
        """The members' storages are no longer found through ``_by_storage`` (the group is done with)."""
        by_storage = self._by_storage
        with self._lock:
            for skey in group.index:
                if by_storage.get(skey) is group:
                    del by_storage[skey]

    def _member_died(self, group: GroupEntry, member: int, _ref: Any) -> None:
        """A member held elsewhere when its group let go of it died: its bytes move from held to freed."""
        try:
            held = group.held
            if held is not None and held.pop(member, None) is not None:
                size = group.sizes[member]
                self._stats.held_elsewhere_bytes -= size
                self._stats.freed_device_bytes += size
        except Exception:  # pragma: no cover - weakref callbacks must not raise
            pass
