"""OffloadOptimizer's host steps and its rounds through the core scheduler (mixin ``_HostRounds``).

Moved from optimizer.py, whose module doc holds the Notes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from offcore.errors import (
    CopyFailedError,
    OffcoreWarning,
)
from offcore.kinds import Kind
from offcore.objects import State
from offcore.residency import ActionKind, ResidencyScheduler
from offcore_torch.optimizer.slots import (
    _COLLECT,
    _NO_TORCH_FUNCTION,
    _STEPPED,
    _UNBOUNDED,
    _UPLOAD_BATCH_BYTES,
    _USES,
    _WORKER_THREAD,
    _Slot,
    _storage_id,
    _unhooked_step,
)


# Note [An upload's destination is made once per storage]
# An upload writes ``param.detach()`` (the in-place copy into a leaf that requires grad is refused), kept
# alive as ``h2d_dst`` until the next upload (Note [Writes to parameters after step()]). A new detached
# tensor per upload and step lived a whole step, so the collector's young collections promoted one per
# parameter per step into the oldest generation (Note [Objects renewed across rounds] in
# offcore/residency.py says what that costs). The last destination is used again while it is what
# ``param.detach()`` would give now: the same memory (data pointer, not null), dtype, shape and strides, on a plain
# tensor or Parameter (no ``__torch_function__`` of a subclass to run). A detached tensor shares its
# parameter's version counter, and ``p.data = ...`` keeps the parameter's (Note [Masters are refreshed
# when the device parameter changed]), so the version checks read the same numbers either way; after
# ``p.data = ...`` or a storage moved by offload_parameters the pointer differs and a new one is made.
# Likewise a batch's ``(destination, source)`` tuple for ``copy_many`` (Note [Uploads are issued in
# batches]) is the slot's last one (``h2d_pair``) while both are the same tensors: thousands of new
# tuples per batch, alive for the whole call, were promoted by the young collections the call itself
# brought about. ``close()`` drops them with the destinations (they hold views of the pool's blocks).
def _upload_dst(slot: _Slot) -> torch.Tensor:
    """The tensor ``slot``'s upload writes: its parameter detached (Note [An upload's destination is made once
    per storage])."""
    param = slot.param
    dst = slot.h2d_dst
    if (
        dst is not None
        and type(param) in _NO_TORCH_FUNCTION
        and 0 != dst.data_ptr() == param.data_ptr()  # not 0: a storage freed (resized to nothing) holds no memory
        and dst.dtype == param.dtype
        and dst.shape == param.shape
        and dst.stride() == param.stride()
    ):
        return dst
    slot.h2d_pair = None  # it holds the last destination: kept alive by ``h2d_dst`` alone until the next upload
    return param.detach()


class _HostRounds:
    """OffloadOptimizer's host-step and round methods (see optimizer.py)."""

    # -- host steps -----------------------------------------------------------------------
    def _step_slots(self, slots: list[_Slot], rs: ResidencyScheduler | None = None) -> None:
        """Worker: one host optimizer step over ``slots`` only, the casts for their H2D copies, and
        (``rs``) the core's uploads due once they are updated."""
        assert self._host is not None
        synced: set[int] = set()  # a batch's uploads share one event (Note [Uploads are issued in batches])
        chosen: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        stages: list[torch.Tensor] = []
        masters: list[torch.Tensor] = []  # of the stages
        for slot in slots:
            event = slot.h2d
            if event is not None and id(event) not in synced:  # the previous H2D still reads the master (or stage)
                synced.add(id(event))
                try:
                    event.synchronize()
                except Exception:  # a failed copy reads nothing any more; its use re-issues it
                    pass
            chosen[id(slot.group)].append(slot.master)
            if slot.stage is not None:
                stages.append(slot.stage)
                masters.append(slot.master)
        saved = [(group, group["params"]) for group in self._host.param_groups]
        began = time.perf_counter()
        with self._host_work():  # on step()'s caller inside `with dev:` too: its temporaries are host memory
            try:
                for group, _ in saved:
                    group["params"] = chosen.get(id(group), [])
                _unhooked_step(self._host)
            finally:
                for group, params in saved:
                    group["params"] = params
            if self.trace is not None:
                self.trace.span("host", "step", began, time.perf_counter() - began, params=len(slots))
            if stages:  # the casts for the uploads: each stage.copy_(master), one call
                torch._foreach_copy_(stages, masters)
        if rs is not None:
            self._host_updated(rs, slots)

    def _step_lead_and_rest(self, lead: list[_Slot], rest: list[_Slot], rs: ResidencyScheduler) -> None:
        """For ``step()``, on its caller or the worker (Note [One host step at step()]): step ``lead``
        and issue its uploads, then step ``rest`` in one optimizer call; their uploads are due
        (Note [Who issues step()'s uploads])."""
        if lead:
            self._step_slots(lead, rs)
        if rest:
            self._step_slots(rest)
            self._mark_due(rest)

    def _mark_due(self, slots: list[_Slot]) -> None:
        """``slots`` (in need order) were stepped by ``step()``: their uploads are due (Note [Who issues step()'s
        uploads])."""
        with self._sched_lock:
            for slot in slots:
                slot.upload_due = slot.host_param is None
            # added to those still due (streamed parameters stepped under backward: Note [Streamed parameters
            # are written by the caller]); _issue_due skips a slot issued meanwhile (upload_due False)
            self._due = [*self._due, *slots] if self._due else slots

    def _issue_due(self, rs: ResidencyScheduler) -> None:
        """Issue every upload ``step()`` left due, in need order, on this thread (Note [Who issues step()'s
        uploads]; sched lock held)."""
        slots, self._due = self._due, []
        keys = []
        for slot in slots:
            if slot.upload_due:
                slot.upload_due = False
                keys.append(slot.index)
        # one offer for all of them (host_updated_all), not one scan of the plan per parameter; a failed
        # copy ends the offer (refused): what it did not issue stays offloaded and its use issues it
        with contextlib.suppress(Exception):
            self._offer_uploads(rs, keys)

    def _h2d_after_compute(self) -> None:
        """Order the H2D stream after the work queued so far on this thread's compute stream.

        H2D copies issued from the main thread (``step()``, ``load_state_dict``) overwrite
        parameters that compute already queued may still read; the worker's copies are ordered by
        the gradient's D2H event instead (its parameter's last use in backward precedes it).
        """
        done = self._device.new_event()
        self._device.current_stream().record_event(done)
        self._runtime.h2d_stream.wait_event(done)

    def _copy_retrying(self, dst: Any, src: Any, stream: Any, what: str, *, recover: bool = False) -> Any:
        """``copy_`` on ``stream``; a copy refused at submission is tried once more after clearing the
        stream (Note [Failed copies in the optimizer]); a second refusal raises CopyFailedError."""
        if recover:
            self._runtime.recover(stream)
        try:
            return self._device.copy_(dst, src, stream=stream)
        except Exception as first:
            self._runtime.recover(stream)
            try:
                event = self._device.copy_(dst, src, stream=stream)
                self._recovered(f"the copy of {what or 'a tensor'} (refused at submission)", first)
                return event
            except Exception as exc:
                raise CopyFailedError(
                    f"OffloadOptimizer: the copy of {what or 'a tensor'} failed twice ({first}; {exc})"
                ) from exc

    def _recovered(self, what: str, exc: BaseException) -> None:
        """A failed copy was made again and landed (Note [Failed copies in the optimizer]): counted in
        ``copy_failures`` and said, as the other bindings say theirs; the numbers are unchanged."""
        with self._lock:
            self.copy_failures += 1
        warnings.warn(
            f"offcore: {what} failed ({exc}); copied again, recovered without changing a number "
            "(see OffloadOptimizer.copy_failures)",
            OffcoreWarning,
            stacklevel=3,
        )

    def _upload_batch(self, rs: ResidencyScheduler, slots: list[_Slot]) -> None:
        """Issue the uploads the core offered for ``slots`` together and answer the core (Note [Uploads are
        issued in batches]; sched lock held). An upload of a parameter written by someone else since it
        matched its master is cancelled, as in ``_copy_up``."""
        todo: list[_Slot] = []
        cancelled: list[_Slot] = []
        fresh = self._fresh
        with self._lock:
            pending = self._pending_h2d
            for slot in slots:  # _written, inlined
                if fresh is not None and slot.fresh is fresh:  # Note [Checked fresh in this step()]
                    todo.append(slot)
                    continue
                param = slot.param
                if id(param) not in pending and (
                    param._version != slot.synced_version or _storage_id(param) != slot.synced_storage
                ):
                    cancelled.append(slot)
                else:
                    todo.append(slot)
        if cancelled:
            nothing = self._device.new_event()
            self._runtime.h2d_stream.record_event(nothing)
            rs.started_all([slot.index for slot in cancelled], [nothing] * len(cancelled))
        if not todo:
            return
        done: list[_Slot] = []
        try:
            self._copy_uploads(todo, done)
        except BaseException:
            rs.started_all([slot.index for slot in done], [slot.h2d for slot in done])
            if len(done) < len(todo):
                rs.refused(todo[len(done)].index, "failed")  # the rest stay offloaded: their use issues them
            raise
        rs.started_all([slot.index for slot in todo], [slot.h2d for slot in todo])

    def _copy_uploads(self, slots: list[_Slot], done: list[_Slot] | None = None) -> None:
        """Issue the H2D of each of ``slots``' masters (its cast stage) into its device parameter, in order:
        where the backend has ``copy_many``, consecutive uploads of up to _UPLOAD_BATCH_BYTES together are one
        call (Note [Uploads are issued in batches]), else one ``copy_`` each; each slot's ``h2d`` is its copy's
        event. Every upload goes through here, once. ``done`` gets the slots issued so far, so that a
        CopyFailedError (a copy refused twice at submission: Note [Failed copies in the optimizer]) says
        which were."""
        done = [] if done is None else done
        stream = self._runtime.h2d_stream
        if self._copy_many is None or len(slots) < 2:
            for slot in slots:
                self._copy_one(slot, stream)
                done.append(slot)
            return
        batch: list[_Slot] = []
        size = 0
        for slot in slots:
            nbytes = (slot.master if slot.stage is None else slot.stage).nbytes  # the upload's source: host tensors
            if batch and size + nbytes > _UPLOAD_BATCH_BYTES:
                self._copy_batch(batch, stream, done)
                batch, size = [], 0
            batch.append(slot)
            size += nbytes
        self._copy_batch(batch, stream, done)

    def _copy_batch(self, slots: list[_Slot], stream: Any, done: list[_Slot]) -> None:
        """``_copy_uploads``' one ``copy_many`` (one ``copy_`` for a single slot); a batch refused at submission
        is issued again one by one once what it issued landed (Note [Uploads are issued in batches])."""
        if len(slots) == 1:
            self._copy_one(slots[0], stream)
            done.append(slots[0])
            return
        params = [slot.param for slot in slots]
        before = [param._version for param in params]
        dsts = [_upload_dst(slot) for slot in slots]
        pairs = []
        for dst, slot in zip(dsts, slots, strict=True):
            src = slot.master if slot.stage is None else slot.stage
            pair = slot.h2d_pair
            if pair is None or pair[0] is not dst or pair[1] is not src:  # Note [An upload's destination is ...]
                pair = slot.h2d_pair = (dst, src)
            pairs.append(pair)
        try:
            event = self._copy_many(pairs, stream=stream)
        except Exception as first:
            del pairs
            self._runtime.recover(stream)  # the copies issued before the refused one land first
            for slot in slots:  # then one by one (the versions read after those landed)
                self._copy_one(slot, stream)
                done.append(slot)
            self._recovered(f"the copy of {len(slots)} parameters to the device (refused at submission)", first)
            return
        del pairs
        with self._lock:
            pending = self._pending_h2d
            for slot, param, dst, was in zip(slots, params, dsts, before, strict=True):
                now = param._version  # a copy bumps it when issued (CUDA) or when it lands (the fake device)
                slot.h2d, slot.h2d_dst = event, dst
                slot.h2d_versions = (now,) if now != was else (was, was + 1)
                pending[id(param)] = slot
        done.extend(slots)

    def _copy_one(self, slot: _Slot, stream: Any) -> None:
        """One upload (``_copy_uploads``), retried once if refused at submission."""
        src = slot.stage if slot.stage is not None else slot.master
        before = slot.param._version
        dst = _upload_dst(slot)
        event = self._copy_retrying(
            dst,
            src,
            stream,
            f"parameter {slot.index} to the device (its host master holds the stepped value: opt.synchronize() "
            "uploads it again)",
        )
        after = slot.param._version  # a copy bumps the version when issued (CUDA) or when it lands (the fake device)
        with self._lock:
            slot.h2d, slot.h2d_dst = event, dst
            slot.h2d_versions = (after,) if after != before else (before, before + 1)
            self._pending_h2d[id(slot.param)] = slot

    def _copy_up(self, slot: _Slot, *, force: bool = False) -> Any:
        """Issue the H2D of ``slot``'s master (its cast stage) into the device parameter; its event.

        Unless ``force``, an upload of a parameter written by someone else since it matched the master
        is cancelled (Note [Writes to parameters after step()]): the event returned copies nothing."""
        if not force and self._written(slot):
            cancelled = self._device.new_event()
            self._runtime.h2d_stream.record_event(cancelled)
            return cancelled
        self._copy_uploads([slot])
        return slot.h2d

    # -- the core scheduler (Note [The optimizer's moves go through the core]) ---------------
    def _round(self) -> ResidencyScheduler:
        """The current round's scheduler; gradients after ``step()`` begin a new round (sched lock held)."""
        rs = self._rs
        if rs is None or self._phase != _COLLECT:
            rs = self._begin_round()
        return rs

    def _begin_round(self) -> ResidencyScheduler:
        finished = self._rs
        self._close_round()
        rs = ResidencyScheduler(
            self._predictor,
            duration=self._runtime.h2d_duration,
            prefetch="asap",
            budget=self._upload_budget,
            margin=0.0,
        )
        # Note [Objects renewed across rounds] (offcore/residency.py): the finished round's objects are renewed
        # for the same keys, unless an event may still come for one: a gradient whose copy has not been seen to
        # land (``_in_flight``), or a worker task (it holds its round's scheduler: ``_land``, a host step)
        if finished is not None:
            with self._lock:
                quiet = not self._in_flight and not self._futures
            if quiet:
                rs.recycle(finished)
        self._grad_keys = itertools.count(-1, -1)  # gradient objects: negative keys, the same ones each round
        rs.forward_began(time.perf_counter())
        for slot in self._slots:
            if slot.host_param is not None:
                continue  # streamed in by offload_parameters, never uploaded here
            rs.register(slot.index, Kind.PARAMETER, slot.param.numel() * slot.param.element_size())
            rs.awaiting_host(slot.index)
        rs.make_plan()
        self._rs, self._phase = rs, _COLLECT
        self._used.clear()
        self._unissued.clear()
        return rs

    def _close_round(self) -> None:
        """Upload what the budget still held back; the uses seen teach the predictor (sched lock held)."""
        rs = self._rs
        if rs is None:
            return
        self._upload_rest(rs)
        if self._phase == _USES:
            rs.backward_ended(time.perf_counter())
        self._rs = None

    def _upload_rest(self, rs: ResidencyScheduler) -> None:
        """Upload every parameter whose host copy is the data and whose upload is not issued yet (due, or held
        back by the core: ``_unissued`` holds every parameter the core may have left offloaded this round)."""
        self._issue_due(rs)
        unissued = self._unissued
        if not unissued:
            return
        objects = rs.objects
        rest = [k for k in unissued if objects[k].state is State.OFFLOADED]
        if rest:
            self._h2d_after_compute()
            for key in rs.upload_order(rest):
                rs.reloaded(key, self._copy_up(self._slots[key]))
        unissued.clear()  # not before: a failed upload leaves the rest offloaded, and in the set

    # Note [Uploads are issued in batches]
    # ``step()`` leaves every parameter's upload due at once and the core offers them in one trigger
    # (``host_updated_all``); they are issued together (``_upload_batch``: one pass for the checks, then
    # ``_copy_uploads``). Where the backend has the optional ``copy_many`` (offcore.protocols.OPTIONAL_MEMBERS)
    # they are one call: one event for all of them, which completes when the last landed (one copy stream,
    # in order) and carries the failure of any (a stream's failure is sticky: Note [A failed copy is a
    # completed copy] in runtime.py). Each parameter's ``h2d`` is that event, so the compute stream waits
    # once per batch (``_wait_all``) and the next step's "the previous upload still reads the master" once
    # per batch too; without ``copy_many`` each upload is one ``copy_`` with its own event, as before. A
    # batch holds consecutive uploads (need order) of up to _UPLOAD_BATCH_BYTES, and a larger one is a
    # ``copy_`` of its own: a parameter's use (``overlap_uploads=True``: the forward's pre-hook) waits for
    # the uploads of its batch, never for all of the step's, so the later layers' copies still fly while the
    # first layers compute (Note [Who issues step()'s uploads]); batching saves the per-copy overhead of
    # small parameters, where it dominates.
    # The core is answered (``started``) after the batch is issued, so only while the upload budget
    # cannot refuse anything (unbounded: the offer does not depend on the answers); under
    # ``upload_budget`` each offered upload is answered before the next is offered, one ``copy_`` each. A
    # batch refused at submission may have issued the copies before the refused one: they land first
    # (``recover`` waits for the stream), then every upload of the batch is issued again on its own (each
    # master is intact; the versions are read after the first copies landed, so Note [Writes to parameters
    # after step()] sees no foreign write), and it counts as one recovered failure.
    def _offer_uploads(self, rs: ResidencyScheduler, keys: list[int]) -> None:
        """The host copies of ``keys`` are the data now: carry out the core's one offer of their uploads (sched
        lock held). Without a budget, the whole offer is one batch (Note [Uploads are issued in batches]) taken
        as keys (Note [An offer taken whole, answered after] in offcore/residency.py)."""
        unissued = self._unissued
        if self._upload_budget >= _UNBOUNDED:
            offered = rs.host_updated_prefetches(keys)
            held = set(keys).difference(offered)  # the core held them back (it may offer others held before)
            if held:
                unissued.update(held)
            if offered:
                slots = self._slots
                try:
                    self._upload_batch(rs, [slots[key] for key in offered])
                except BaseException:
                    unissued.update(offered)  # what the failure left offloaded is among them
                    raise
            return
        unissued.update(keys)
        self._execute(rs, rs.host_updated_all(keys))

    def _execute(self, rs: ResidencyScheduler, actions: Iterable[Any]) -> None:
        """Carry out the core's actions (sched lock held)."""
        if self._upload_budget >= _UNBOUNDED:  # Note [Uploads are issued in batches]
            slots = self._slots
            batch = [slots[action.key] for action in actions if action.kind is ActionKind.PREFETCH]
            if batch:
                self._upload_batch(rs, batch)
            return
        for action in actions:
            if action.kind is ActionKind.PREFETCH:
                try:
                    event = self._copy_up(self._slots[action.key])
                except BaseException:
                    rs.refused(action.key, "failed")
                    raise
                rs.started(action.key, event)
            # EVICT: the upload writes the parameter's own storage; nothing to free, the copy stays

    # Note [Streamed parameters are written by the caller]
    # A parameter that offload_parameters streams (params_on_host=False: this optimizer keeps masters of its
    # own) has a device storage only while the handle holds it, and touching it outside a module's use makes
    # the handle bring it in and track it -- state the handle changes from the thread that runs the model.
    # Host steps under backward (accumulation_steps, last_micro_step) run on the worker: had the worker
    # issued their uploads, the handle would have been driven from two threads at once (seen: a copy into a
    # storage the handle had just freed, a prefetch started twice, a use-after-free). So the worker marks
    # such uploads due (Note [Who issues step()'s uploads]) and the caller's thread issues them, at
    # step(), zero_grad(), the parameter's next use or synchronize(), as it does for step()'s own.
    def _host_updated(self, rs: ResidencyScheduler, slots: list[_Slot]) -> None:
        """The host steps of ``slots`` finished: the core returns the uploads due now (one offer for all)."""
        if getattr(_WORKER_THREAD, "marked", False):
            streamed = [slot for slot in slots if getattr(slot.param, "_offcore_slot", None) is not None]
            if streamed:
                self._mark_due(streamed)
                slots = [slot for slot in slots if getattr(slot.param, "_offcore_slot", None) is None]
        keys = [slot.index for slot in slots if slot.host_param is None]
        if keys:
            with self._sched_lock:
                self._offer_uploads(rs, keys)

    def _make_current(self, slot: _Slot) -> None:
        """The device parameter of ``slot`` is about to be read: its upload is issued (on demand, if
        the budget held it back) and the compute stream waits for it (sched lock held)."""
        rs = self._rs
        if rs is not None:
            if slot.upload_due:  # stepped by step(), not issued yet: all of them now (Note [Who issues ...])
                began = time.perf_counter()
                self._issue_due(rs)
                if self.trace is not None:  # the use pays it: a wait of the forward
                    self.trace.span(
                        "wait",
                        f"param {slot.index} (step()'s uploads issued by its use)",
                        began,
                        time.perf_counter() - began,
                    )
            obj = rs.objects.get(slot.index)
            if obj is not None:
                if obj.state is State.OFFLOADED:
                    rs.reloaded(slot.index, self._copy_up(slot))
                elif obj.state is State.PREFETCHING:
                    rs.awaited(slot.index)
        if self._pending_h2d:
            self._wait_parameter(slot)

    def _on_use(self, slot: _Slot) -> None:
        """A module is about to read ``slot``'s parameter (forward pre-hook, main thread)."""
        if slot.stepped and self._futures:
            # Its host step of this round is queued or running (accumulation_steps / last_micro_step)
            # and a forward reads the parameter before step(): the worker issues the upload when the
            # step finishes, which would write the parameter after this forward saved it for
            # backward. Let the queued host work finish first, so the upload is issued and waited for
            # below (rare: step() normally ends the round before the next forward).
            self._drain()
        if self._rs is None:
            if self._pending_h2d:
                self._wait_parameter(slot)
            return
        with self._sched_lock:
            rs = self._rs
            if rs is None or self._phase == _COLLECT:  # a micro-step's forward: no uses phase
                self._make_current(slot)
                return
            key = slot.index
            if key in self._used:
                if self._pending_h2d:
                    self._wait_parameter(slot)
                return
            now = time.perf_counter()
            if self._phase == _STEPPED:
                rs.backward_began(now)  # the uses phase of the round: the next forward
                self._phase = _USES
            self._used.add(key)
            self._make_current(slot)
            rs.consumed(key)
            self._execute(rs, rs.used(key, now, managed_key=key))

    def _wait_parameter(self, slot: _Slot, *, traced: bool = True) -> None:
        """Make the compute stream wait for ``slot``'s H2D (a forward pre-hook); the host observes it."""
        with self._lock:
            if self._pending_h2d.pop(id(slot.param), None) is None:
                return
            event = slot.h2d
        began = time.perf_counter()
        self._order_after(slot, event, self._device.current_stream())
        if self.trace is not None and traced:
            self.trace.span("wait", f"param {slot.index}", began, time.perf_counter() - began)
        # the compute stream is ordered after the upload now: everything it does later (a write of the
        # user's) comes after the copy, so the version the copy left is the synced one. On the fake device
        # the copy landed (its compute is the host); on CUDA the copy bumped the version when issued
        # (h2d_versions), and querying would leave a copy not landed yet unsynced, and its master refreshed
        # from the device (the fp32 master rounded to bf16) before the next step.
        self._mark_synced(slot)

    def _order_after(self, slot: _Slot, event: Any, stream: Any) -> bool:
        """``stream`` (the compute stream) waits for ``event``, ``slot``'s upload (popped from ``_pending_h2d``);
        an upload that failed on its stream is issued again and waited for (False: ``event`` failed)."""
        try:
            stream.wait_event(event)
            return True
        except Exception as exc:  # the upload failed on its stream: the master is intact, upload again
            self._runtime.recover(self._runtime.h2d_stream)
            self._copy_up(slot, force=True)
            with self._lock:
                self._pending_h2d.pop(id(slot.param), None)
                event = slot.h2d
            try:
                stream.wait_event(event)
            except Exception as again:
                raise CopyFailedError(
                    f"OffloadOptimizer: the upload of parameter {slot.index} failed twice ({exc}; {again}); its "
                    "host master holds the stepped value: fix the cause and call opt.synchronize()"
                ) from again
            self._recovered(f"the upload of parameter {slot.index}", exc)
            return False

    def _wait_all(self, *, traced: bool) -> int:
        """``_wait_parameter`` of every parameter with an upload pending, the compute stream waiting once per
        distinct event (a batch's uploads share one: Note [Uploads are issued in batches]); a failed upload goes
        through its recovery. Returns how many were waited for."""
        stream = self._device.current_stream()
        trace = self.trace if traced else None
        with self._lock:  # each taken with its event, as _wait_parameter pops it, under one lock
            pending = self._pending_h2d
            popped = pending.copy()  # the same dict stays (others keep a reference under the lock)
            pending.clear()
        waited: set[int] = set()  # ids of the events waited for (alive: held by the slots)
        last: Any = None  # the last event waited for (consecutive uploads of a batch share it)
        began = 0.0
        fresh = self._fresh
        for slot in popped.values():
            event = slot.h2d
            if trace is not None:
                began = time.perf_counter()
            if event is not last and id(event) not in waited and self._order_after(slot, event, stream):
                waited.add(id(event))
                last = event
            if trace is not None:
                trace.span("wait", f"param {slot.index}", began, time.perf_counter() - began)
            param = slot.param  # _mark_synced, inlined (as _wait_parameter)
            version = param._version
            if version in slot.h2d_versions and (
                (fresh is not None and slot.fresh is fresh)  # its storage is the one checked: Note [Checked fresh ...]
                or _storage_id(param) == slot.synced_storage
            ):
                slot.synced_version = version
        return len(popped)

    def _observe(self, slot: _Slot) -> bool:
        """Whether ``slot`` has no H2D the host has not seen land (records its version if it just landed)."""
        with self._lock:
            if id(slot.param) not in self._pending_h2d:
                return True
            event = slot.h2d
        try:
            landed = event.query()
        except Exception:
            landed = False
        if landed:
            with self._lock:
                self._pending_h2d.pop(id(slot.param), None)
            self._mark_synced(slot)
        return landed

    def _mark_synced(self, slot: _Slot) -> None:
        """``slot``'s last H2D landed and the host saw it: the device parameter matches the master again,
        unless someone else wrote it meanwhile (Note [Writes to parameters after step()])."""
        version = slot.param._version
        if version in slot.h2d_versions and _storage_id(slot.param) == slot.synced_storage:
            slot.synced_version = version
        # else: written while the upload was in flight; synced_version stays, so the master is refreshed

    def _changed(self, slot: _Slot) -> bool:
        """Whether the device parameter was written by someone else since it last matched the master."""
        return slot.param._version != slot.synced_version or _storage_id(slot.param) != slot.synced_storage

    def _written(self, slot: _Slot) -> bool:
        """Note [Writes to parameters after step()]: no upload of ours in flight, and the parameter changed."""
        with self._lock:
            if id(slot.param) in self._pending_h2d:
                return False
        return self._changed(slot)

    # Note [Checked fresh in this step()]
    # step() checks each parameter it steps against its master (``_check_fresh_all``: Note [Masters are refreshed
    # when the device parameter changed]) and from then until it returns runs none of the user's code (step hooks
    # run around it: Note [Step hooks run once per step]; the worker is drained; the host step reads and writes
    # host tensors only): nothing writes those device parameters, nor swaps their storage, before step() has
    # issued their uploads and, without overlap_uploads, waited for them. So two later checks of the same
    # parameters in the same step() have their answer already: the "written since it matched its master"
    # cancellation of ``_upload_batch`` (Note [Writes to parameters after step()]: not written) and the storage
    # half of ``_wait_all``'s synced check (the storage is the one checked). A parameter that passed the check is
    # marked with this step()'s ``_fresh`` object (a new one per step(), None outside step()), and those checks
    # skip what the mark proves. Uploads issued after step() returned (overlap_uploads=True: at zero_grad() or the
    # first use) and the uploads of host steps run under backward (not checked by this step()) check as before.
    def _check_fresh_all(self, slots: list[_Slot], fresh: object | None = None) -> None:
        """``_check_fresh`` of each of ``slots`` (step(): the worker is drained); each that matches its master after
        it is marked ``fresh`` (Note [Checked fresh in this step()])."""
        pending = self._pending_h2d
        for slot in slots:
            if slot.host_param is not None:
                continue
            param = slot.param
            if id(param) in pending and not self._observe(slot):
                continue
            if param._version != slot.synced_version or _storage_id(param) != slot.synced_storage:  # _changed
                self._drain()
                self._load_master(slot)
            slot.fresh = fresh

    def _check_fresh(self, slot: _Slot) -> None:
        """Note [Masters are refreshed when the device parameter changed] (main thread)."""
        if slot.host_param is not None:
            return  # the host copy is the data (Note [Parameters on the host with offload_parameters])
        if self._observe(slot) and self._changed(slot):
            self._drain()
            self._load_master(slot)

    def _settle(self, params: list[torch.Tensor]) -> None:
        """Before ``params`` are written by a module's ``load_state_dict`` (Note [Writes to parameters after
        step()]): their pending uploads are issued, land, and the host observes them."""
        self._drain()
        slots = [self._slot(p) for p in params]
        with self._sched_lock:
            for slot in slots:
                self._make_current(slot)  # issues a due or held-back upload; the compute stream waits for it
        for slot in slots:
            event = slot.h2d
            if event is not None:
                with contextlib.suppress(Exception):  # a failed upload: its use issues it again
                    event.synchronize()
            self._observe(slot)

    def _refresh(self, params: list[torch.Tensor]) -> None:
        """After a module's ``load_state_dict`` wrote ``params``: the masters of those it changed are read
        from the device now (Note [Writes to parameters after step()])."""
        for slot in (self._slot(p) for p in params):
            if self._observe(slot) and self._changed(slot):
                self._drain()  # as _check_fresh: the compute stream's writes are this thread's
                self._load_master(slot)

    def synchronize(self) -> None:
        """Wait for every copy and host step in flight; the device parameters are up to date after it."""
        self._drain()
        self._upload_all_and_wait(traced=True)
        self._release_landed(wait=True)

    def _upload_all_and_wait(self, *, traced: bool) -> int:
        """Issue every upload (due, or held back by ``upload_budget``) and order the compute stream after
        each (Note [Parameters read after step() are the stepped ones]); returns how many were waited for."""
        with self._sched_lock:
            if self._rs is not None:
                self._upload_rest(self._rs)
        return self._wait_all(traced=traced)

    def _publish_uploads(self) -> None:
        """Note [Parameters read after step() are the stepped ones]: issue every upload of this step (due,
        or held back by ``upload_budget``) and make the compute stream wait for all of them: a device-side
        wait on a GPU (the host does not block), a block on the fake device, whose compute is the host."""
        began = time.perf_counter()
        waited = self._upload_all_and_wait(traced=False)
        if self.trace is not None and waited:
            self.trace.span("wait", f"step()'s {waited} uploads", began, time.perf_counter() - began)
