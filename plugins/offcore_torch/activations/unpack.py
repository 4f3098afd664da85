"""OffloadHandle's unpack side: saved tensors restored for backward (mixin ``_Unpack``; moved from offload.py)."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from offcore.errors import (
    ConfigurationError,
    CopyFailedError,
    SavedTensorModifiedError,
)
from offcore.kinds import Direction, Tier
from offcore.objects import State
from offcore.residency import NO_ACTIONS, ResidencyScheduler
from offcore_torch.activations.copies import (
    _GRAPH_TASK_ID,
    _current_autograd_node,
    _current_op,
    _graph_task_id,
    _range,
    poll,
)
from offcore_torch.activations.records import Entry, EntryState, GroupedOffloaded, GroupEntry, Kept, Offloaded
from offcore_torch.activations.storage import (
    TensorMeta,
    internal_ops,
)
from offcore_torch.runtime import (
    _TIMING_BATCH,
)

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_H2D = Direction.H2D
_DISPOSED, _LANDED = EntryState.DISPOSED, EntryState.LANDED
_PREFETCHING, _RESTORED = State.PREFETCHING, State.RESTORED
_DEVICE = Tier.DEVICE


class _Unpack:
    """OffloadHandle's unpack methods (see offload.py, Note [Saved-tensor version checks])."""

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
        return {e.key: list(e.keys) for e in self._by_key.values() if len(e.keys) > 1 and e.state is not _DISPOSED}

    def _end_backward(self) -> None:
        """Called by autograd when the backward pass that used this region ends."""
        try:
            now = time.perf_counter()
            if self._trace is not None:
                self._trace.span("compute", f"backward {self._round}", self._t_backward, now - self._t_backward)
            for action in self._sched.backward_ended(now):  # frees what was held
                entry = self._by_key.get(action.key)
                if entry is not None and entry.state is not _DISPOSED:
                    self._release_device(entry)
            for entry in list(self._by_key.values()):
                if entry.restored is not None and entry.state is not _DISPOSED:
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
        if type(entry) is GroupEntry:  # Note [Small storages are offloaded in groups] (records.py)
            if entry is self._open_group:  # read before forward ended (backward inside the region, by hand)
                self._flush_group()
            entry.note_unpack(packed, round_)
            if entry.src is not None or entry.state is not _LANDED:  # copying, held, or not copied: the keepers
                # still hold the members' storages (as an entry's live storage is read)
                return self._restore_from_keeper(packed, key, now)
        if entry.restored is not None:  # prefetched (the common case): _device_storage's first branch, inlined
            if entry.used_round != round_ and sched.is_outstanding(entry.key):
                self._stats.prefetch_hits += 1
            actions = sched.used(key, now, managed_key=entry.key)
            if actions is not NO_ACTIONS:
                self._execute(actions)
            storage = self._await_prefetch(entry)
        else:
            storage = self._device_storage(entry, key, now, entry.used_round != round_)
        if type(packed) is GroupedOffloaded:
            storage = storage[packed.member]  # the group's RestoredMembers
        out = packed.meta.restore(packed.keeper, storage)
        if packed.fmt is not None:
            out = self.device.restore_format(out, packed.fmt)
        entry.used = True
        entry.used_round = round_
        packed.unpacked_round = round_
        # ``packed`` is alive (autograd passed it in): with one live record it is the only one
        if entry.live == 1 or entry.all_unpacked(round_):
            self._consumed(entry)
        return out

    def _restore_from_keeper(self, packed: Offloaded, key: int, now: float) -> torch.Tensor:
        """A record of a group whose copy has not landed (or was not made): its tensor again, from its
        version keeper, which holds the storage until the group lands (as an entry's live storage is read)."""
        group, sched = packed.entry, self._sched
        if group.obj is None:  # never copied: a save read from the device, like a Kept one
            actions = sched.used(key, now)
        else:
            if group.used_round != sched.round:
                self._stats.reused_live_bytes += group.data_bytes
            sched.reused(group.key)
            actions = sched.used(key, now, managed_key=group.key)
        if actions is not NO_ACTIONS:
            self._execute(actions)
        with internal_ops():
            out = packed.keeper.detach()
        round_ = sched.round
        group.used = True
        group.used_round = packed.unpacked_round = round_
        if group.obj is not None and (group.live == 1 or group.all_unpacked(round_)):
            self._consumed(group)
        return out

    def _device_storage(self, entry: Entry, key: int, now: float, first_use: bool) -> torch.UntypedStorage:
        """The storage backward should read, on the device and ordered for the compute stream."""
        sched = self._sched
        if entry.restored is not None:
            if first_use and sched.is_outstanding(entry.key):
                self._stats.prefetch_hits += 1
            actions = sched.used(key, now, managed_key=entry.key)
            if actions is not NO_ACTIONS:
                self._execute(actions)
            return self._await_prefetch(entry)
        live = entry()  # the storage, if it still lives
        in_flight = False
        if live is None and entry.restored_ref is not None:
            live = entry.restored_ref()  # a retained graph: autograd still holds the last restore
            # Note [An evicted prefetch still in flight]: or the buffer a dropped prefetch still writes
            in_flight = live is not None and entry.obj.state is _PREFETCHING
        if live is not None:
            sched.reused(entry.key)
            self._execute(sched.used(key, now, managed_key=entry.key))
            if first_use:
                self._stats.reused_live_bytes += entry.data_bytes
            entry.restored = live
            return self._await_prefetch(entry) if in_flight else live
        # a miss: reload now; the whole copy is exposed and charged to this object
        storage = self._reload_now(entry)
        self._execute(sched.used(key, now, managed_key=entry.key))
        return storage

    def _reload_now(self, entry: Entry) -> torch.UntypedStorage:
        if entry.nvme is not None:
            self._host_from_nvme(entry)
        device, runtime = self.device, self.runtime
        compute = device.current_stream()
        pairs = None
        if type(entry) is GroupEntry:  # each member's own storage (Note [Small storages are offloaded in groups])
            restored, pairs = self._members_on_device(entry)
        else:
            dst = self._allocate_device(entry.nbytes)
        with _range("offcore::h2d"), _range("offcore::wait"):
            start, issued = runtime.begin_timing(device, compute)
            try:
                if pairs is None:
                    done = device.copy_(dst, entry.host_view, stream=compute)
                else:
                    done = self._copy_pairs(pairs, compute)
                self._h2d_copies += 1 if pairs is None else len(pairs)
                self._h2d_bytes += entry.data_bytes
                compute.wait_event(done)
            except Exception as exc:
                raise CopyFailedError(
                    f"could not reload saved tensor {entry.name} from host memory for backward "
                    f"({type(exc).__name__}: {exc}); its host copy is intact, but this backward cannot go on. "
                    "Drop the graph (the step) and run it again."
                ) from exc
            for nbytes, direction in ((entry.data_bytes, _H2D), (0, None)):  # a copy, and a wait
                self._end_timing(compute, start, issued, nbytes=nbytes, direction=direction, label=entry.name)
        self._sched.reloaded(entry.key, done)
        self._stats.stalls += 1
        self._stats.stalled_objects.append(entry.name)
        self._stats.reloaded_bytes += entry.data_bytes
        storage = dst.untyped_storage() if pairs is None else restored
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
        dst = self.device.allocate(nbytes, _DEVICE)
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
        if obj.state is not _PREFETCHING:
            return restored
        event = obj.h2d_event
        try:
            if not event.query():
                device, runtime = self.device, self.runtime
                compute = device.current_stream()
                with _range("offcore::wait"):
                    start, issued = runtime.begin_timing(device, compute)
                    compute.wait_event(event)
                    self._end_timing(compute, start, issued, nbytes=0, direction=None, label=entry.name)
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
        self._stats.reloaded_bytes -= entry.data_bytes
        self._stats.prefetched_bytes -= entry.data_bytes
        self._copy_failed(entry, exc, "host-to-device prefetch failed")
        return self._reload_now(entry)

    def _consumed(self, entry: Entry) -> None:
        """Every live record of ``entry`` was unpacked this round: autograd owns the storage now."""
        if entry.restored is not None and entry.obj.state is _RESTORED:
            # the common case (a copy restored and awaited): consumed and dropped in one call
            if self._sched.consumed(entry.key, dropped=True):  # it was held on landing
                self._release_device(entry)
            # the keepers never held it (Note [Restore through the version keeper]): autograd's aliases own it now
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
        storage = entry.restored  # (the keepers never held it: Note [Restore through the version keeper])
        if storage is None:
            self._sched.dropped(entry.key)  # no copy held: only the budget count goes
            return
        entry.restored = None
        obj, sched = entry.obj, self._sched
        sched.dropped(entry.key)  # a restored copy is dropped now; one in flight once it landed
        if obj.state is _PREFETCHING:
            event = obj.h2d_event

            def finish(sched: ResidencyScheduler = sched, key: int = entry.key, keep: Any = storage) -> None:
                if obj.h2d_event is event:  # not a later prefetch of it (Note [An evicted prefetch still in flight])
                    sched.drop_landed(key)

            self.runtime.defer(event, finish, stream=self.runtime.h2d_stream)
