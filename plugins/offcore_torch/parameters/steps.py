"""ParameterOffloadHandle's steps: per-step schedulers and uses (mixin ``_Steps``; moved from parameters.py)."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from offcore.errors import OffcoreWarning
from offcore.kinds import Kind
from offcore.objects import State
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore_torch.parameters.state import (
    _DONE,
    _SEARCH,
    _UNIT_SECONDS,
    _History,
    _is_oom,
    _ParameterScheduler,
    _Slot,
    _Step,
    _Unit,
)


class _Steps:
    """ParameterOffloadHandle's step methods (see parameters.py)."""

    # -- steps -------------------------------------------------------------------------
    def _mode(self) -> tuple[bool, bool]:
        return (torch.is_grad_enabled(), self.model.training)

    def _default_sequence(self, grad: bool) -> list[tuple[int, str]]:
        forward = [(u.id, "f") for u in self._units if not u.name.startswith("<outside")]
        backward = [(uid, "b") for uid, _ in reversed(forward)] if grad else []
        return forward + backward

    def _begin_step(self, t: float, mode: tuple[bool, bool] | None = None) -> _Step:
        self._end_step()
        if self._foreign_step:  # an optimizer stepped since: what it fetched is written back and freed
            self._release_outside()
        mode = self._mode() if mode is None else mode
        history = self._histories.get(mode)
        if history is None:
            history = self._histories[mode] = _History(Scheduler(margin=self._margin))
        sequence = history.sequence if history.sequence is not None else self._default_sequence(mode[0])
        rt = self.runtime
        rt.poll()
        rs = _ParameterScheduler(
            history.predictor,
            duration=rt.h2d_duration,
            prefetch=self.prefetch,
            budget=self.budget,
            device_capacity=self._capacity,
            device_in_use=self._device_in_use if self._capacity else None,
            shared_budget=self._shared,
            record=self.record,
            stage_duration=self._tier.read_link.duration if self._tier is not None else None,
        )
        rs.handle = self
        ratio = history.predictor.backward_ratio
        rs.forward_began(t)
        for key, (uid, _) in enumerate(sequence):
            # a synthetic save time whose reverse-order default puts use ``key`` at key x 1 ms
            rs.produced(key, t - key * _UNIT_SECONDS / ratio)
            rs.register(key, Kind.PARAMETER, self._units[uid].nbytes, name=self._units[uid].name)
            rs.offload_started(key, _DONE)
            rs.landed(key, needed=False)
            if self._tier is not None and any(s.host is None and not s.resident for s in self._units[uid].slots):
                rs.spilled(key)  # Note [Parameters on NVMe]: two hops, the stage planned on the NVMe link
        actions = rs.forward_ended(t)
        rs.backward_began(t)  # one round on one clock from the step's start: forward and backward uses alike
        step = self._step = _Step(rs, history, list(sequence), t_last=t, mode=mode)
        self._early = self._first_forward_slots(sequence) if mode[0] else frozenset()
        # not under a shared device budget: a kept copy is not reserved there (the budget's bound holds)
        self._turn = self._first_backward_slots(sequence) if mode[0] and self._shared is None else frozenset()
        self._counters["steps"] += 1
        self._execute(step, actions)
        return step

    def _first_forward_slots(self, sequence: list[tuple[int, str]]) -> frozenset[int]:
        """The storages the next forward uses first, up to the budget: backward's last uses keep them."""
        return self._first_slots(sequence, "f")

    def _first_backward_slots(self, sequence: list[tuple[int, str]]) -> frozenset[int]:
        """The storages backward uses first, up to the budget: not freed after their forward use."""
        return self._first_slots(sequence, "b")

    def _first_slots(self, sequence: list[tuple[int, str]], pass_tag: str) -> frozenset[int]:
        """The storages of the first units of one pass (``"f"`` / ``"b"``) in ``sequence``, up to the budget."""
        out: set[int] = set()
        total = 0
        for uid, tag in sequence:
            if tag != pass_tag:
                continue
            unit = self._units[uid]
            total += unit.nbytes
            if total > self.budget:
                break
            out.update(slot.index for slot in unit.slots)
        return frozenset(out)

    # Note [Backward's first parameters stay after forward]
    # The last modules of forward are the first of backward, a loss computation apart. Freed after
    # their forward use, they would be copied in again at once, and that copy is exposed at the start
    # of backward (the plan issues it at the last forward trigger, too late to hide it). So in a
    # grad-enabled step the storages backward uses first (up to the budget, as for Note [The next step
    # starts early]) stay on the device after their forward use; the plan's prefetch for their
    # backward use finds them there (no copy) and holds them, and their backward use frees them after
    # their gradients are accumulated. A step that ends without a backward frees them (``_end_step``).
    # Not under a shared device budget (offcore_torch.device_budget): a copy kept this way is not
    # reserved there, and the budget's bound on the device peak must hold.

    def _device_in_use(self) -> int:
        device = self.device
        fast = getattr(device, "allocated_bytes", None)  # optional member (offcore.protocols.OPTIONAL_MEMBERS)
        if fast is not None:
            return int(fast())
        stats = device.memory_stats()
        return int(getattr(stats, "allocated_bytes", None) or stats.get("allocated_bytes", 0))

    def _end_step(self) -> None:
        """Close the running step: teach its history, drop prefetches nobody used, free what is left."""
        step, self._step = self._step, None
        if step is None:
            return
        rs = step.rs
        rs.backward_ended(step.t_last)  # teaches the predictor; nothing is held on landing here
        for key, slots in list(step.held.items()):
            self._drop_hold(step, key, slots)
        for index in self._turn - self._early:  # kept for a backward that did not come (or has passed)
            self._maybe_free(self._slots[index])
        if self._tier is not None:  # stages nobody used: their buffers go back (the data stays on NVMe)
            step.staging.clear()
            self._reclaim_host()
        rs.detach_budget()
        if self.record:
            self._recorded.append({"log": list(rs.log), "settings": rs.settings(), "actions": list(rs.actions)})
        step.history.sequence = step.actual
        self._last_mode = step.mode
        self.runtime.resolve_timings()

    def _evicted_now(self, rs: ResidencyScheduler, key: int) -> None:
        """The shared budget evicted ``key`` for another request: free its held copy now (Note [A parameter
        copy evicted for another owner is freed at once])."""
        step = self._step
        if step is None or step.rs is not rs or threading.current_thread() is not self._thread:
            return
        slots = step.held.get(key)
        if slots is not None:
            self._drop_hold(step, key, slots)

    def _drop_hold(self, step: _Step, key: int, slots: list[_Slot]) -> None:
        del step.held[key]
        obj = step.rs.objects[key]
        if obj.state is State.PREFETCHING:
            obj.finish_prefetch(stream_waited=True)
        if obj.state is State.RESTORED:
            obj.drop_restored_copy()
        for slot in slots:
            slot.holds -= 1
            self._maybe_free(slot)

    def _execute(self, step: _Step, actions: Iterator[Any]) -> None:
        rs = step.rs
        for action in actions:
            key = action.key
            if action.kind is ActionKind.PREFETCH:
                unit = self._units[step.sequence[key][0]]
                try:
                    event = self._copy_in(unit.slots)
                except Exception as exc:
                    if _is_oom(exc):
                        self._counters["refused"] += 1
                        rs.refused(key, "oom")
                        continue
                    # Note [A prefetch refused at submission is not an error of the caller's]
                    self._counters["copy_failures"] += 1
                    warnings.warn(
                        f"offcore: the prefetch of {unit.name}'s parameters failed at submission ({exc}); they are "
                        "copied in when used (Note [A prefetch refused at submission is not an error of the "
                        "caller's])",
                        OffcoreWarning,
                        stacklevel=2,
                    )
                    rs.refused(key, "failed")
                    continue
                for slot in unit.slots:
                    slot.holds += 1
                step.held[key] = unit.slots
                rs.started(key, event)
            elif action.kind is ActionKind.STAGE:
                if self._stage(step, key):
                    rs.stage_started(key)
                else:
                    rs.stage_refused(key, "no_room")
            elif action.kind is ActionKind.EVICT:
                slots = step.held.get(key)
                self._counters["evicted"] += 1
                if slots is not None:
                    self._drop_hold(step, key, slots)

    def _match(self, step: _Step, uid: int, tag: str) -> int | None:
        sequence = step.sequence
        end = min(len(sequence), step.cursor + _SEARCH)
        for key in range(step.cursor, end):
            if sequence[key] == (uid, tag):
                step.cursor = key + 1
                return key
        return None

    def _use(self, unit: _Unit, tag: str) -> None:
        """A use of ``unit`` now: its storages on the device and the compute stream ordered after their copies.

        The storages are pinned while the scheduler's actions run (an eviction must not free a
        storage this use shares with the evicted one); the caller pins them for the use itself.
        """
        t = time.perf_counter()
        step = self._step
        if step is None:
            step = self._begin_step(t)
        self.runtime.poll()
        if step.staging:
            self._poll_stages(step, t)
        step.actual.append((unit.id, tag))
        step.t_last = t
        key = self._match(step, unit.id, tag)
        rs = step.rs
        for slot in unit.slots:
            slot.pins += 1
        try:
            if key is None:
                missing = any(not s.resident for s in unit.slots)
                self._copy_in(unit.slots)
                self._counters["unplanned" if missing else "hits"] += 1
                self._ready(unit.slots, unit.name)
                return
            if key in step.held:
                actions = rs.used(key, t, managed_key=key)
                self._ready(unit.slots, unit.name)
                rs.awaited(key)
                rs.consumed(key)
                self._counters["hits"] += 1
                for slot in step.held.pop(key):
                    slot.holds -= 1
            else:
                missing = any(not s.resident for s in unit.slots)
                event = self._copy_in(unit.slots)
                rs.reloaded(key, event)
                self._counters["stalls" if missing else "hits"] += 1
                actions = rs.used(key, t, managed_key=key)
                rs.consumed(key)
                self._ready(unit.slots, unit.name)
            self._execute(step, actions)
        finally:
            for slot in unit.slots:
                slot.pins -= 1
