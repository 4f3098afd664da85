"""One simulated step (``_Step``): the event loop behind :func:`~offcore.sim.simulator.simulate`, with its objects and links.

The Notes in offcore/sim/simulator.py say what it models and why.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import Any

from offcore.inflight import copies_to_land
from offcore.kinds import Kind
from offcore.objects import State
from offcore.residency import Action as ScheduleAction
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler, StepObservation
from offcore.sim.formulas import transfer_time
from offcore.sim.plan import Action, Plan
from offcore.sim.profile import StepProfile
from offcore.sim.replay import _LANDED  # a copy that has landed (the parameters' host copies are the data)
from offcore.sim.result import SimResult, TimelineEvent


def _nvme_groups(parts: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """Consecutive parts merged up to ``_NVME_GROUP_BYTES`` of parameters, a bigger part split in equal
    groups below it: OffloadOptimizer's groups (Note [The optimizer's NVMe tier in the simulator])."""
    groups: list[tuple[int, str, int]] = []
    size = _NVME_GROUP_BYTES
    for nbytes, label, layer in parts:
        if nbytes > _NVME_GROUP_BYTES:
            pieces = -(-nbytes // _NVME_GROUP_BYTES)
            groups.extend((nbytes // pieces, f"{label}/{j}", layer) for j in range(pieces))
            size = _NVME_GROUP_BYTES
            continue
        if size + nbytes > _NVME_GROUP_BYTES:
            groups.append((0, label, layer))
            size = 0
        merged, first, _ = groups[-1]
        groups[-1] = (merged + nbytes, first if merged else label, layer)
        size += nbytes
    return groups


class _SimEvent:
    """A copy's completion event on the simulated clock: it has landed once the clock reached its end."""

    __slots__ = ("_step", "end")

    def __init__(self, step: _Step, end: float) -> None:
        self._step = step
        self.end = end

    def query(self) -> bool:
        return self._step.now >= self.end

    def synchronize(self) -> None:
        return None


class _Link:
    """One serial copy queue (a direction of a duplex link, or one shared link): copies run in the order issued."""

    __slots__ = ("free_at", "busy")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy = 0.0

    def run(self, now: float, seconds: float) -> tuple[float, float]:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy += seconds
        return start, self.free_at


_UNBOUNDED = 1 << 62  # no prefetch byte budget

# parameter streaming (Note [Parameter streaming drives a ResidencyScheduler]): offload_parameters'
# defaults: its margin (0.5 ms), its budget (twice the largest module's parameters), and the spacing
# of the synthetic save times its rounds register their uses with
_PARAMETER_MARGIN_S = 0.5e-3
_PARAMETER_BUDGET_MODULES = 2
_PARAMETER_UNIT_S = 1e-3

# OffloadOptimizer(tier="nvme")'s group size (_NVME_GROUP_BYTES in plugins/offcore_torch/optimizer/optimizer.py):
# a group is one parameter or consecutive small ones up to this many master bytes
_NVME_GROUP_BYTES = 4 * 1024**2
_NVME_LOOKAHEAD = 2  # OffloadOptimizer's pipelined(lookahead=): groups read ahead of the one stepped

# event priorities at one instant (Note [Simulated lifetimes]: frees before allocations)
_END, _LAND, _COPY_DONE, _START = 0, 1, 2, 3


class _Object:
    """One saved tensor of a layer (managed by the scheduler when the layer is offloaded)."""

    __slots__ = (
        "key",
        "layer",
        "nbytes",
        "fraction",
        "d2h_end",
        "h2d_end",
        "in_place",
        "held",
        "reloaded",
        "resident",
        "backward_done",
        "managed",
        "used",
        "on_nvme",
    )

    def __init__(self, key: int, layer: int, nbytes: int, fraction: float, managed: bool) -> None:
        self.managed = managed  # offloaded: the scheduler manages it
        self.key = key
        self.layer = layer
        self.nbytes = nbytes
        self.fraction = fraction
        self.d2h_end = math.inf
        self.h2d_end = -math.inf  # when the device copy backward reads is usable (prefetch or reload)
        self.in_place = False  # backward read the device copy its D2H was taken from (no reload)
        self.held = False  # the scheduler held the device copy when its D2H landed
        self.reloaded = False  # copied back at least once
        self.resident = False  # device bytes are allocated for it now
        self.backward_done = False
        self.used = False  # backward consumed it
        self.on_nvme = False  # its host copy was written to the NVMe tier and released


class _Step:
    """One simulated step: the compute stream, the copy links and a ResidencyScheduler on one clock."""

    def __init__(self, profile: StepProfile, plan: Plan, record_events: bool, record_schedule: bool) -> None:
        self.profile = profile
        self.plan = plan
        self.record_events = record_events
        layers = profile.layers
        actions = plan.actions
        self.n = len(layers)
        self.names = profile.layer_names
        self.actions = actions
        # offload overhead (host work of the runtime) runs on the compute stream: half in forward, half in backward
        self.half_overhead = [
            layer.offload_overhead_s / 2 if actions[i] is Action.OFFLOAD else 0.0 for i, layer in enumerate(layers)
        ]
        self.fwd = [layer.forward_s + extra for layer, extra in zip(layers, self.half_overhead, strict=True)]
        self.bwd = [layer.backward_s + extra for layer, extra in zip(layers, self.half_overhead, strict=True)]
        # the runtime's own work under optimizer offload / parameter streaming (measured per step),
        # spread over the layers by parameter bytes (Note [Optimizer offload and parameter streaming
        # in the simulator])
        self.kinds_overhead = 0.0
        layer_params = [layer.param_bytes or layer.grad_bytes for layer in layers]
        total = sum(layer_params)
        shares = [b / total if total else 1.0 / len(layers) for b in layer_params]
        if plan.optimizer == "offload" and profile.optimizer_offload_overhead_s:
            self.kinds_overhead += profile.optimizer_offload_overhead_s
            self.bwd = [b + profile.optimizer_offload_overhead_s * f for b, f in zip(self.bwd, shares, strict=True)]
        if plan.parameters == "stream" and profile.parameter_stream_overhead_s:
            half = profile.parameter_stream_overhead_s / 2
            self.kinds_overhead += profile.parameter_stream_overhead_s
            self.fwd = [t + half * f for t, f in zip(self.fwd, shares, strict=True)]
            self.bwd = [t + half * f for t, f in zip(self.bwd, shares, strict=True)]
        self.rec = [layer.recompute_time for layer in layers]
        self.saved = [layer.saved_bytes for layer in layers]
        self.work = [layer.working_bytes for layer in layers]  # backward (kept, recomputed or not measured)
        self.fwork = [layer.forward_work for layer in layers]  # forward and recompute
        self.inputs = [layer.input_bytes for layer in layers]
        self.segment_of: dict[int, tuple[int, int]] = {}
        for first, last in plan.segments():
            for index in range(first, last + 1):
                self.segment_of[index] = (first, last)
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = 0
        self.memory: list[tuple[float, int]] = []
        self.events: list[TimelineEvent] = []
        self.waits: dict[str, float] = {}
        self.recompute_total = 0.0
        if profile.duplex:
            self.d2h_link, self.h2d_link = _Link(), _Link()
        else:
            self.d2h_link = self.h2d_link = _Link()
        self.h2d_bytes = 0
        self.last_copy_end = 0.0
        self.d2h_in_flight: list[_Object] = []  # saves whose D2H has not landed, oldest first (Plan.max_inflight)
        # the step's saves, numbered in save order as the runtime numbers them: every layer's saved
        # tensors are keys (each use in backward is a trigger); only offloaded layers' are managed
        self.keys_of: list[list[int]] = []
        self.saves: list[list[_Object]] = []
        self.objects: dict[int, _Object] = {}
        # backward uses each layer's saves in reverse save order: the last at its start, a save made
        # a share f of the forward before the last one that share of the backward later (Note
        # [Simulated lifetimes]); saves used at one instant form one group
        self.groups: list[list[tuple[float, list[_Object]]]] = []
        key = 0
        for i, layer in enumerate(layers):
            parts = layer.saved_tensors or ((1.0, layer.saved_bytes),)
            saves = []
            for fraction, nbytes in parts:
                obj = _Object(key, i, nbytes, fraction, actions[i] is Action.OFFLOAD)
                if obj.managed:
                    self.objects[key] = obj
                saves.append(obj)
                key += 1
            self.saves.append(saves)
            self.keys_of.append([obj.key for obj in saves])
            groups: list[tuple[float, list[_Object]]] = []
            last = saves[-1].fraction  # the last save is used first, when the layer's backward starts
            for obj in reversed(saves):
                offset = (last - obj.fraction) * self.bwd[i]
                if groups and groups[-1][0] == offset:
                    groups[-1][1].append(obj)
                else:
                    groups.append((offset, [obj]))
            self.groups.append(groups)
        # Note [An offloaded layer's saves go as backward uses them]: per layer, the transient bytes its
        # backward holds from each group's use (None: the saves stay to its end, with working_bytes)
        self.group_work: list[list[int] | None] = []
        for i, layer in enumerate(layers):
            gross = layer.gross_working_bytes
            if actions[i] is Action.OFFLOAD and gross:
                first = self.keys_of[i][0]
                self.group_work.append([max(gross[obj.key - first] for obj in group) for _, group in self.groups[i]])
            else:
                self.group_work.append(None)
        # Note [Reads of kept tensors are triggers]: per layer and group, whether backward reads a kept
        # tensor after the group's saves (a trigger once they were consumed)
        self.reads_after: list[list[bool]] = []
        for i, layer in enumerate(layers):
            reads = layer.reads_after
            first = self.keys_of[i][0]
            self.reads_after.append(
                [bool(reads) and any(reads[obj.key - first] for obj in group) for _, group in self.groups[i]]
            )
        self.read_key = key  # keys of the kept reads: after every save's (the runtime numbers them apart too)
        self.grads = [0 if profile.grad_bytes else layer.grad_bytes for layer in layers]
        # Note [Optimizer offload and parameter streaming in the simulator]
        self.offload_optimizer = plan.optimizer == "offload"
        self.stream = plan.parameters == "stream"
        self.params = [layer.param_bytes or layer.grad_bytes for layer in layers]
        self.rest_params = max(0, profile.param_bytes - sum(self.params))
        self.param_copies = [max(1, layer.param_copies) for layer in layers]
        self.static = profile.resident_bytes
        if self.offload_optimizer:
            self.static -= profile.optimizer_state_bytes
        if self.stream:
            self.static -= min(sum(self.params), profile.param_bytes)
        self.level = self.static
        self.grads_left = list(self.grads)  # gradients still on the device
        self.host_free = 0.0  # when the host worker is free
        self.host_busy = 0.0
        self.host_end = 0.0
        # Note [The optimizer's NVMe tier in the simulator]: gradients still to land, their groups
        self.nvme = plan.optimizer_tier == "nvme"
        self.grads_in_flight = 0
        self.compute_done = False
        self.nvme_groups: list[tuple[int, str, int]] = []  # (parameter bytes, label, layer) per landed gradient
        self.host_state_window = 0  # the most state bytes in host buffers at once (lookahead + 2 groups)
        self.nvme_read_total = self.nvme_write_total = 0  # bytes read from / written to the NVMe tier
        self.nvme_read_free = self.nvme_write_free = 0.0  # when the tier's read / write link is free
        self.staging: dict[int, Callable[[], None] | None] = {}  # stages under way, and what waits for each
        self.tasks = self._tasks()
        self.sched = self._make_scheduler(record_schedule)
        # parameter streaming (Note [Parameter streaming drives a ResidencyScheduler]): per layer, whether
        # its parameters are on the device, the uses and prefetches holding them, and when the last copy
        # into them lands; per use (a key of the round), the layer and the phase
        self.psched: ResidencyScheduler | None = None
        self.p_uses: list[tuple[int, str]] = []
        self.p_resident = [False] * self.n
        self.p_pins = [0] * self.n
        self.p_holds = [0] * self.n
        self.p_backward_pin = [False] * self.n  # recomputed in backward: kept until its backward ends
        self.p_ready = [0.0] * self.n
        self.p_held: dict[int, int] = {}
        self.p_cursor = 0
        self.p_last_use = 0.0
        self.p_copies = 0  # SimResult.parameter_h2d_copies
        self.p_first_layers: list[int] = []  # what the round's start copied in (the next round copies them again)
        # Note [Backward's first parameters stay after forward in the simulator]
        self.p_turn = [False] * self.n  # backward's first layers (up to the budget): kept after their forward use
        self.p_turn_kept = [False] * self.n
        if self.stream:
            self.psched = self._make_parameter_scheduler(record_schedule)
            self._mark_turn_layers()
        self.turned = False
        # Note [The worst peak within the prefetch budget]
        self.bounded = any(a is Action.OFFLOAD for a in actions)
        self.reload_budget = _UNBOUNDED if plan.prefetch.budget_bytes is None else plan.prefetch.budget_bytes
        self.room = 0
        self.worst = 0

    # -- the scheduler ----------------------------------------------------------------------
    def _make_scheduler(self, record: bool) -> ResidencyScheduler:
        """A ResidencyScheduler whose predictor learned this step's ideal timeline (steady state).

        Note [The simulator drives the runtime's scheduler]: the predictor has observed one
        step with no waits (forward, then backward in reverse with recompute), as a runtime
        in steady state has; the link's copy time is the profile's (``transfer_s``).
        """
        profile, plan = self.profile, self.plan
        prefetch = plan.prefetch
        pack_times: dict[int, float] = {}
        clock = 0.0
        for i in range(self.n):
            for obj in self.saves[i]:
                pack_times[obj.key] = clock + obj.fraction * self.fwd[i]
            clock += self.fwd[i]
        forward_s = clock
        first_use: dict[int, float] = {}
        clock = 0.0
        for i in range(self.n - 1, -1, -1):
            if self.actions[i] is Action.RECOMPUTE and self.segment_of[i][1] == i:
                first, last = self.segment_of[i]
                clock += math.fsum(self.rec[first : last + 1])
            for offset, group in self.groups[i]:
                for obj in group:
                    first_use[obj.key] = clock + offset
            clock += self.bwd[i]
        predictor = Scheduler(margin=prefetch.margin_s)
        predictor.observe(StepObservation(pack_times, forward_s, first_use, clock))
        if prefetch.mode == "lead":
            # Note [Lead mode on the deadline plan]: a fixed lead is a deadline plan whose copies
            # take ``lead_s`` each and no margin (chained like the link's copies)
            lead = float(prefetch.lead_s or 0.0)
            duration: Callable[[int], float] = lambda nbytes: lead  # noqa: E731
            mode, margin = "deadline", 0.0
        else:
            duration = lambda nbytes: self.copy_s(nbytes, "h2d")  # noqa: E731
            mode, margin = prefetch.mode, prefetch.margin_s
        return ResidencyScheduler(
            predictor,
            duration=duration,
            prefetch=mode,
            budget=_UNBOUNDED if prefetch.budget_bytes is None else prefetch.budget_bytes,
            margin=margin,
            device_capacity=profile.capacity_bytes or 0,
            device_in_use=lambda: self.level,
            record=record,
            stage_duration=self.nvme_read_s if self.plan.activation_tier == "nvme" else None,
        )

    # -- activations on NVMe (Note [Activations on NVMe in the simulator]) ---------------------
    def nvme_read_s(self, nbytes: int) -> float:
        """One NVMe → host read (a stage) on the tier's read link."""
        profile = self.profile
        return transfer_time(nbytes, profile.nvme_read_bandwidth, profile.nvme_read_latency_s)

    def spill(self, obj: _Object) -> None:
        """Its D2H landed and its device copy went: the host copy is written to the NVMe tier (h2n), then
        released (``spilled``) unless a reload took it meanwhile."""
        profile = self.profile
        seconds = transfer_time(obj.nbytes, profile.nvme_write_bandwidth, profile.nvme_write_latency_s)
        begin = max(self.now, self.nvme_write_free)
        self.nvme_write_free = end = begin + seconds
        self.nvme_write_total += obj.nbytes
        self.event("h2n", f"h2n:{self._label(obj)}", begin, end, "h2n", obj.layer)

        def written() -> None:
            if self.sched.objects[obj.key].state is State.OFFLOADED and not obj.used:
                obj.on_nvme = True
                self.sched.spilled(obj.key)

        self.at(end, _LAND, written)

    def stage(self, obj: _Object, then: Callable[[], None] | None = None) -> None:
        """Read ``obj``'s host copy back from NVMe (the first hop); at its landing ``staged`` (a trigger),
        then ``then``."""
        begin = max(self.now, self.nvme_read_free)
        self.nvme_read_free = end = begin + self.nvme_read_s(obj.nbytes)
        self.event("n2h", f"n2h:{self._label(obj)}", begin, end, "n2h", obj.layer)
        self.nvme_read_total += obj.nbytes
        self.sched.stage_started(obj.key)
        self.staging[obj.key] = then

        def landed() -> None:
            obj.on_nvme = False
            after = self.staging.pop(obj.key, None)
            self.execute(self.sched.staged(obj.key, self.now))
            if after is not None:
                after()

        self.at(end, _COPY_DONE, landed)

    # -- the clock ------------------------------------------------------------------------
    def at(self, time: float, priority: int, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, priority, self._seq, callback))
        self._seq += 1

    def change(self, delta: int) -> None:
        if delta:
            self.level += delta
            self.memory.append((self.now, self.level))
            if self.level + self.room > self.worst:
                self.worst = self.level + self.room

    def refresh_room(self) -> None:
        """Note [The worst peak within the prefetch budget]: the reload bytes the budget still lets the
        runtime have outstanding beyond what this simulation has (0 outside backward)."""
        if not self.bounded:
            return
        outstanding = missing = 0
        for obj in self.objects.values():
            if obj.used:
                continue
            if obj.resident and obj.reloaded:
                outstanding += obj.nbytes
            elif not obj.resident:
                missing += obj.nbytes
        self.room = max(0, min(self.reload_budget, outstanding + missing) - outstanding)
        if self.level + self.room > self.worst:
            self.worst = self.level + self.room

    def event(self, stream: str, name: str, start: float, end: float, kind: str, layer: int) -> None:
        if self.record_events:
            self.events.append(TimelineEvent(stream, name, start, end, kind, self.names[layer]))

    def wait(self, layer: int, start: float, end: float) -> None:
        if end > start:
            name = self.names[layer]
            self.waits[name] = self.waits.get(name, 0.0) + (end - start)
            self.event("compute", f"wait:{name}", start, end, "wait", layer)

    # -- copies ---------------------------------------------------------------------------
    def _label(self, obj: _Object) -> str:
        name = self.names[obj.layer]
        return name if len(self.keys_of[obj.layer]) == 1 else f"{name}[{self.keys_of[obj.layer].index(obj.key)}]"

    def d2h_room_at(self, nbytes: int) -> float:
        """When a save of ``nbytes`` may start its D2H under ``Plan.max_inflight`` (Note [The simulator
        caps forward's copies in flight]): now, or when the copies that must land first have landed."""
        flying = self.d2h_in_flight
        wait_for = copies_to_land(self.plan.max_inflight, nbytes, (obj.nbytes for obj in flying))
        return max(self.now, flying[wait_for - 1].d2h_end) if wait_for else self.now

    def _a_later_save_waits(self, pending: list[_Object]) -> bool:
        """Whether a save in ``pending`` after the first must wait for a copy in flight once those before it
        started theirs now (Note [Saves at a forward's end that wait behind each other]); a copy started now
        counts as landing later."""
        cap = self.plan.max_inflight
        flying = [(obj.nbytes, obj.d2h_end) for obj in self.d2h_in_flight]
        for obj in pending:
            if not obj.managed:
                continue
            wait_for = copies_to_land(cap, obj.nbytes, (nbytes for nbytes, _ in flying))
            if wait_for and flying[wait_for - 1][1] > self.now:  # they land in link order
                return True
            flying = [*flying[wait_for:], (obj.nbytes, math.inf)]
        return False

    def pack(self, obj: _Object) -> None:
        """Forward saved ``obj``: its D2H is enqueued now (Note [Simulated lifetimes])."""
        sched = self.sched
        sched.produced(obj.key, self.now)
        sched.register(obj.key, Kind.ACTIVATION, obj.nbytes)
        start, end = self.d2h_link.run(self.now, self.copy_s(obj.nbytes, "d2h"))
        obj.d2h_end = end
        self.d2h_in_flight.append(obj)  # in link order: they land in this order
        self.last_copy_end = max(self.last_copy_end, end)
        sched.offload_started(obj.key, _SimEvent(self, end))
        self.event("d2h", f"d2h:{self._label(obj)}", start, end, "d2h", obj.layer)
        self.at(end, _LAND, lambda: self.landed(obj))

    def landed(self, obj: _Object) -> None:
        """The D2H of ``obj`` landed: the scheduler frees or holds its device copy."""
        self.d2h_in_flight.remove(obj)
        needed = self.profile.reuse_in_flight and not obj.in_place and not obj.backward_done
        action = self.sched.landed(obj.key, needed=needed)
        if obj.in_place:  # backward read this device copy: it goes when both its D2H and its backward are done
            if obj.backward_done:
                self.free(obj)
            return
        if action.kind is ActionKind.HOLD:
            obj.held = True  # the device copy stays: backward reads it in place
            return
        self.free(obj)
        waiter = self._waiting_for.pop(obj.key, None)
        if waiter is not None:  # backward waits for this copy: it is reloaded now
            waiter()
        elif self.plan.activation_tier == "nvme":
            self.spill(obj)

    def free(self, obj: _Object) -> None:
        if obj.resident:
            obj.resident = False
            self.change(-obj.nbytes)

    def allocate(self, obj: _Object) -> None:
        if not obj.resident:
            obj.resident = True
            self.change(obj.nbytes)

    def execute(self, actions: Iterable[ScheduleAction]) -> None:
        """Carry out the scheduler's actions as the binding does, reporting each outcome before the next."""
        for action in actions:
            obj = self.objects[action.key]
            if action.kind is ActionKind.PREFETCH:
                self.allocate(obj)  # the destination buffer, allocated when the copy is issued
                end = self.copy_back(obj)
                self.sched.started(obj.key, _SimEvent(self, end))
            elif action.kind is ActionKind.EVICT:
                self.evict(obj)
            elif action.kind is ActionKind.STAGE:
                self.stage(obj)

    def evict(self, obj: _Object) -> None:
        """Drop a held or prefetched copy: freed now, or once its H2D landed."""
        state = self.sched.objects[obj.key].state
        if state is State.OFFLOADING:  # held on landing
            self.free(obj)
            return
        self.sched.dropped(obj.key)
        if state is State.PREFETCHING:
            end = obj.h2d_end

            def finish() -> None:
                self.sched.drop_landed(obj.key)
                self.free(obj)
                waiter = self._waiting_for.pop(obj.key, None)
                if waiter is not None:
                    waiter()

            self.at(end, _COPY_DONE, finish)
        else:
            self.free(obj)
        obj.h2d_end = -math.inf

    def reload(self, obj: _Object) -> float:
        """An on-demand reload at its use: copied now, the compute stream waits for it."""
        self.allocate(obj)
        end = self.copy_back(obj)
        self.sched.reloaded(obj.key, _SimEvent(self, end))
        return end

    def copy_back(self, obj: _Object) -> float:
        """One H2D of ``obj`` on its link (in the order issued); returns when it lands."""
        start, end = self.h2d_link.run(self.now, self.copy_s(obj.nbytes, "h2d"))
        self.h2d_bytes += obj.nbytes
        obj.h2d_end = end
        obj.reloaded = True
        self.last_copy_end = max(self.last_copy_end, end)
        self.event("h2d", f"h2d:{self._label(obj)}", start, end, "h2d", obj.layer)
        return end

    def copy_s(self, nbytes: int, direction: str) -> float:
        """``latency + bytes / bandwidth`` (:func:`offcore.sim.formulas.transfer_time`)."""
        profile = self.profile
        bandwidth = profile.d2h_bandwidth if direction == "d2h" else profile.h2d_bandwidth
        return transfer_time(nbytes, bandwidth, profile.latency_s)

    # -- optimizer offload and parameter streaming ------------------------------------------
    # Note [Optimizer offload and parameter streaming in the simulator]
    def optimizer_after_backward(self, i: int | None) -> None:
        """Layer ``i``'s backward ended (``None``: the parameters outside the layers): its
        gradients go D2H, then the host step, then (parameters resident) the H2D."""
        if i is None:
            nbytes, label, layer = self.rest_params, "rest", self.n - 1
            device_grads = 0
        else:
            nbytes, label, layer = self.profile.layers[i].grad_bytes, self.names[i], i
            device_grads = self.grads_left[i]
        params = self.rest_params if i is None else self.params[i]
        if nbytes <= 0 and params <= 0:
            return
        start, end = self.d2h_link.run(self.now, self.copy_s(nbytes, "d2h"))
        self.last_copy_end = max(self.last_copy_end, end)
        self.event("d2h", f"d2h:grad:{label}", start, end, "d2h", layer)
        self.grads_in_flight += 1

        def landed() -> None:
            if i is not None and self.grads_left[i]:
                self.grads_left[i] = 0
                self.change(-device_grads)  # freed as its D2H lands
            self.grads_in_flight -= 1
            if self.nvme:  # stepped at step(), pipelined over the states on disk
                self.nvme_groups.append((params, label, layer))
                if self.compute_done and self.grads_in_flight == 0:
                    self.at(self.now, _START, self.nvme_step)
                return
            seconds = params * self.profile.host_step_s_per_byte
            begin = max(self.now, self.host_free)
            self.host_free = begin + seconds
            self.host_busy += seconds
            self.host_end = max(self.host_end, self.host_free)
            self.event("host", f"host-step:{label}", begin, self.host_free, "host", layer)
            if not self.stream:
                self.at(self.host_free, _START, upload)

        def upload() -> None:
            begin, land = self.h2d_link.run(self.now, self.copy_s(params, "h2d"))
            self.h2d_bytes += params
            self.last_copy_end = max(self.last_copy_end, land)
            self.event("h2d", f"h2d:param:{label}", begin, land, "h2d", layer)

        self.at(end, _LAND, landed)

    # Note [The optimizer's NVMe tier in the simulator]
    def nvme_step(self) -> None:
        """``step()`` with the states on NVMe: once every gradient landed, the host worker steps the groups
        pipelined (read i+1 ... i+_NVME_LOOKAHEAD on the NVMe read link, step i, write i on the write link;
        group i waits for the write of i-2), and uploads each group's parameters after its step (parameters resident)."""
        if self.grads_in_flight or self.host_end > 0 or not self.nvme_groups:
            return
        profile = self.profile
        ratio = profile.optimizer_state_bytes / profile.param_bytes if profile.param_bytes else 0.0
        groups = _nvme_groups(sorted(self.nvme_groups, key=lambda g: g[2]))
        states = [int(nbytes * ratio) for nbytes, _, _ in groups]
        self.nvme_read_total += sum(states)
        self.nvme_write_total += sum(states)
        ahead = _NVME_LOOKAHEAD
        self.host_state_window = max(
            (sum(states[max(0, k - 1) : k + ahead + 1]) for k in range(len(states))), default=0
        )  # groups i-1 (writing), i (stepping) and i+1 ... i+ahead (read ahead)

        def read_s(k: int) -> float:
            return transfer_time(states[k], profile.nvme_read_bandwidth, profile.nvme_read_latency_s)

        def write_s(k: int) -> float:
            return transfer_time(states[k], profile.nvme_write_bandwidth, profile.nvme_write_latency_s)

        read_free = write_free = worker = max(self.now, self.host_free)
        read_end: list[float] = []
        write_end: list[float] = []

        def read(k: int, at: float) -> None:
            nonlocal read_free
            begin = max(at, read_free)
            read_free = begin + read_s(k)
            read_end.append(read_free)
            self.event("n2h", f"n2h:state:{groups[k][1]}", begin, read_free, "n2h", groups[k][2])

        for k in range(min(ahead, len(groups))):
            read(k, worker)
        for k, (nbytes, label, layer) in enumerate(groups):
            if k >= 2:
                worker = max(worker, write_end[k - 2])
            if k + ahead < len(groups):
                read(k + ahead, worker)
            begin = max(worker, read_end[k])
            worker = begin + nbytes * profile.host_step_s_per_byte
            self.host_busy += worker - begin
            self.event("host", f"host-step:{label}", begin, worker, "host", layer)
            start = max(worker, write_free)
            write_free = start + write_s(k)
            write_end.append(write_free)
            self.event("h2n", f"h2n:state:{label}", start, write_free, "h2n", layer)
            if not self.stream and nbytes > 0:
                up, land = self.h2d_link.run(worker, self.copy_s(nbytes, "h2d"))
                self.h2d_bytes += nbytes
                self.last_copy_end = max(self.last_copy_end, land)
                self.event("h2d", f"h2d:param:{label}", up, land, "h2d", layer)
        self.host_free = self.host_end = max([worker, *write_end])

    # -- parameter streaming ----------------------------------------------------------------------
    # Note [Parameter streaming drives a ResidencyScheduler]
    def _make_parameter_scheduler(self, record: bool) -> ResidencyScheduler:
        """The round's scheduler, as ``offload_parameters`` makes one, whose predictor learned this step's
        ideal timeline of uses (a runtime in steady state)."""
        clock = 0.0
        first_use: dict[int, float] = {}
        for kind, i in self.tasks:
            if self.params[i] > 0:
                first_use[len(self.p_uses)] = clock
                self.p_uses.append((i, kind))
            clock += self.fwd[i] if kind == "forward" else self.rec[i] if kind == "recompute" else self.bwd[i]
        predictor = Scheduler(margin=_PARAMETER_MARGIN_S)
        predictor.observe(StepObservation(first_use=first_use, backward_seconds=clock))
        capacity = self.profile.capacity_bytes or 0
        return ResidencyScheduler(
            predictor,
            duration=lambda nbytes: self.copy_s(nbytes, "h2d"),
            prefetch="deadline",
            budget=self.profile.parameter_budget_bytes or _PARAMETER_BUDGET_MODULES * max(self.params, default=0),
            device_capacity=capacity,
            device_in_use=(lambda: self.level) if capacity else None,
            record=record,
        )

    def _mark_turn_layers(self) -> None:
        """Backward's first layers, up to the round's budget, stay on the device after their forward use
        (Note [Backward's first parameters stay after forward in the simulator])."""
        rs = self.psched
        assert rs is not None
        budget = rs.budget
        total = 0
        for kind, i in self.tasks:
            if kind != "backward" or self.params[i] <= 0:
                continue
            total += self.params[i]
            if budget is None or total > budget:
                break
            self.p_turn[i] = True

    def begin_parameter_round(self) -> None:
        """The round's start, as ``offload_parameters``' ``_begin_step``: every use registered as an
        object already on the host, the plan made, its first copies offered. They were made at the end of
        the previous step (Note [The next step starts early]: the same plan then offered the same copies),
        so they are on the device when the step starts."""
        rs = self.psched
        assert rs is not None
        t = self.now
        ratio = rs.predictor.backward_ratio
        rs.forward_began(t)
        for key, (i, _) in enumerate(self.p_uses):
            rs.produced(key, t - key * _PARAMETER_UNIT_S / ratio)
            rs.register(key, Kind.PARAMETER, self.params[i], name=self.names[i])
            rs.offload_started(key, _LANDED)
            rs.landed(key, needed=False)
        actions = rs.forward_ended(t)
        rs.backward_began(t)
        self.param_execute(actions, first=True)

    def end_parameter_round(self) -> None:
        """Compute ended: the round is closed (its prefetches nobody used are dropped), as ``_end_step``."""
        rs = self.psched
        assert rs is not None
        rs.backward_ended(self.p_last_use)
        for key in list(self.p_held):
            self.param_drop_hold(key)

    def param_execute(self, actions: Iterable[ScheduleAction], *, first: bool = False) -> None:
        """Carry out the parameter scheduler's actions as ``offload_parameters`` does (``_execute``)."""
        rs = self.psched
        assert rs is not None
        for action in actions:
            key = action.key
            i = self.p_uses[key][0]
            if action.kind is ActionKind.PREFETCH:
                if first and not self.p_resident[i]:
                    self.p_resident[i] = True
                    self.change(self.params[i])
                    self.p_ready[i] = self.now
                    self.p_first_layers.append(i)
                    event: Any = _LANDED
                else:
                    event = self.param_copy_in(i, self.p_uses[key][1])
                self.p_holds[i] += 1
                self.p_held[key] = i
                rs.started(key, event)
            elif action.kind is ActionKind.EVICT and key in self.p_held:
                self.param_drop_hold(key)

    def param_copy_in(self, i: int, phase: str) -> _SimEvent | None:
        """Layer ``i``'s parameters copied in now (its device bytes allocated now), unless they are on the
        device already (``_copy_in``: no copy, no event)."""
        if self.p_resident[i]:
            return None
        nbytes = self.params[i]
        self.p_resident[i] = True
        self.change(nbytes)
        begin, land = self.h2d_link.run(self.now, self.param_copy_s(i))
        self.h2d_bytes += nbytes
        self.p_copies += self.param_copies[i]
        self.last_copy_end = max(self.last_copy_end, land)
        self.p_ready[i] = land
        self.event("h2d", f"h2d:param:{phase}:{self.names[i]}", begin, land, "h2d", i)
        return _SimEvent(self, land)

    def outside_copy(self, label: str, at: float | None = None) -> float:
        """Streaming copies the parameters outside the layers in once (Note [Parameters outside the layers are
        streamed too]); returns when they land (``now`` when nothing is copied)."""
        profile = self.profile
        nbytes = profile.outside_param_bytes
        if not self.stream or nbytes <= 0:
            return self.now
        seconds = self.copy_s(nbytes, "h2d") + (max(1, profile.outside_param_copies) - 1) * profile.latency_s
        begin, land = self.h2d_link.run(self.now if at is None else at, seconds)
        self.h2d_bytes += nbytes
        self.p_copies += max(1, profile.outside_param_copies)
        self.last_copy_end = max(self.last_copy_end, land)
        self.event("h2d", f"h2d:param:{label}:outside", begin, land, "h2d", self.n - 1)
        return land

    def param_copy_s(self, i: int) -> float:
        """Link time of one copy-in of layer ``i``'s parameters: one copy per tensor, each paying the
        latency (Note [Parameter copies pay one latency each])."""
        return self.copy_s(self.params[i], "h2d") + (self.param_copies[i] - 1) * self.profile.latency_s

    def param_drop_hold(self, key: int) -> None:
        """A prefetch nobody used (or an evicted one) lets its copy go (``_drop_hold``)."""
        rs = self.psched
        assert rs is not None
        i = self.p_held.pop(key)
        obj = rs.objects[key]
        if obj.state is State.PREFETCHING:
            obj.finish_prefetch(stream_waited=True)
        if obj.state is State.RESTORED:
            obj.drop_restored_copy()
        self.p_holds[i] -= 1
        self.param_maybe_free(i)

    def param_release(self, i: int) -> None:
        """A use of layer ``i``'s parameters ended."""
        self.p_pins[i] -= 1
        self.param_maybe_free(i)

    def param_maybe_free(self, i: int) -> None:
        """Free layer ``i``'s device copy when nothing uses or holds it (once a copy into it landed)."""
        if not self.p_resident[i] or self.p_pins[i] or self.p_holds[i] or self.p_backward_pin[i] or self.p_turn_kept[i]:
            return
        if self.p_ready[i] > self.now:  # a prefetch nobody used: it lands first
            self.at(self.p_ready[i], _COPY_DONE, lambda: self.param_maybe_free(i))
            return
        self.p_resident[i] = False
        self.change(-self.params[i])

    def when_params_ready(self, i: int, phase: str, then: Callable[[], None]) -> None:
        """A use of layer ``i``'s parameters now (``phase``: forward, recompute or backward), a trigger
        of the round's scheduler (``_use``); run ``then`` once they are on the device (waiting for them)."""
        rs = self.psched
        if rs is None or self.params[i] <= 0:
            then()
            return
        key = self.p_cursor
        self.p_cursor += 1
        t = self.p_last_use = self.now
        self.p_pins[i] += 1
        if phase != "forward":  # a kept copy's backward use takes it over (Note [Backward's first parameters ...])
            self.p_turn_kept[i] = False
        if key in self.p_held:
            actions = rs.used(key, t, managed_key=key)
            rs.awaited(key)
            rs.consumed(key)
            del self.p_held[key]
            self.p_holds[i] -= 1
        else:
            rs.reloaded(key, self.param_copy_in(i, phase))
            actions = rs.used(key, t, managed_key=key)
            rs.consumed(key)
        self.param_execute(actions)
        land = self.p_ready[i]
        if land > self.now:
            self.wait(i, self.now, land)
            self.at(land, _START, then)
        else:
            then()

    # -- the compute stream ---------------------------------------------------------------------
    def _tasks(self) -> list[tuple[str, int]]:
        tasks = [("forward", i) for i in range(self.n)]
        for i in range(self.n - 1, -1, -1):
            if self.actions[i] is Action.RECOMPUTE and self.segment_of[i][1] == i:
                first, last = self.segment_of[i]
                tasks.extend(("recompute", layer) for layer in range(first, last + 1))
            tasks.append(("backward", i))
        return tasks

    def run(self) -> SimResult:
        if self.psched is not None:  # the previous step's end copied the first uses in (the next round starts early)
            self.begin_parameter_round()
        self._waiting_for: dict[int, Callable[[], None]] = {}
        self.compute_end = 0.0
        self.sched.forward_began(0.0)
        self.at(0.0, _START, lambda: self.start_task(0))
        heap = self._heap
        while heap:
            time, _, _, callback = heapq.heappop(heap)
            self.now = time
            callback()
        return self.result()

    def next_task(self, index: int) -> None:
        self.at(self.now, _START, lambda: self.start_task(index))

    def start_task(self, index: int) -> None:
        sched = self.sched
        if index == self.n:
            # the output head and the loss run between the layers' forward and their backward:
            # their bytes (StepProfile.head_bytes) live around the turn; the plan starts at the
            # end of forward (Note [Prefetch from the end of forward] in offcore_torch)
            if not self.turned:
                self.turned = True
                # Note [The turn sees the head's saved bytes]
                head = self.profile.head_bytes
                early = head if self.profile.head_forward_bytes is None else self.profile.head_forward_bytes
                self.change(early)
                self.execute(sched.forward_ended(self.now))
                sched.backward_began(self.now)
                self.change(head - early)
                self.refresh_room()  # the worst peak: the head's bytes and every reload the budget allows
                self.change(-head)
                self.refresh_room()
                # Note [Parameters outside the layers are streamed too]; the head is backward's first use,
                # kept from its forward use with the turn's layers (Note [Backward's first parameters stay
                # after forward in the simulator])
                land = self.now if any(self.p_turn) else self.outside_copy("turn")
                if land > self.now:
                    self.wait(self.n - 1, self.now, land)
                    self.at(land, _START, lambda: self.start_task(index))
                    return
        if index == len(self.tasks):
            self.compute_end = self.now
            self.outside_copy("backward")
            if self.psched is not None:
                self.end_parameter_round()
            self.room = 0
            for action in sched.backward_ended(self.now):  # frees what was held
                self.free(self.objects[action.key])
            self.compute_done = True
            if self.offload_optimizer:
                self.optimizer_after_backward(None)
                if self.nvme:
                    self.at(self.now, _START, self.nvme_step)  # runs once every gradient landed
            else:
                self.change(-sum(self.grads_left))  # the optimizer step takes the gradients over
            return
        kind, i = self.tasks[index]
        if kind == "forward":
            self.when_params_ready(i, "forward", lambda: self.forward(index, i))
        elif kind == "recompute":
            self.when_params_ready(i, "recompute", lambda: self.recompute(index, i))
        else:
            self.when_params_ready(i, "backward", lambda: self.use_group(index, i, 0))

    def recompute(self, index: int, i: int) -> None:
        start, end = self.now, self.now + self.rec[i]
        for obj in self.saves[i]:
            self.allocate(obj)
        self.change(self.fwork[i])
        self.recompute_total += self.rec[i]
        self.event("compute", f"recompute:{self.names[i]}", start, end, "recompute", i)

        def finish() -> None:
            self.change(-self.fwork[i])
            if self.psched is not None and self.params[i] > 0:
                self.p_backward_pin[i] = True  # a use in backward: kept until the layer's backward ends
                self.param_release(i)
            self.next_task(index + 1)

        self.at(end, _END, finish)

    def forward(self, index: int, i: int) -> None:
        start, end = self.now, self.now + self.fwd[i]
        action = self.actions[i]
        saves = self.saves[i]
        self.change(self.fwork[i])
        if action is Action.RECOMPUTE:  # only the segment's input stays (the checkpoint)
            self.change(self.inputs[i] if self.segment_of[i][0] == i else 0)
        else:
            self.allocate(saves[0])
        # Note [The simulator caps forward's copies in flight]: the waits of this forward so far (what is
        # left of it runs that much later), its saves not made yet, in order, and where its current
        # piece of compute began (a wait splits it: one compute stream, in order)
        stalled = [0.0]
        pending = list(saves)
        piece = [start]

        def stall(obj: _Object) -> float:
            """When ``obj``'s D2H may start (now, or later: this forward waits until then)."""
            room = self.d2h_room_at(obj.nbytes) if obj.managed else self.now
            if room > self.now:
                if self.now > piece[0]:
                    self.event("compute", f"forward:{self.names[i]}", piece[0], self.now, "forward", i)
                self.wait(i, self.now, room)
                stalled[0] += room - self.now
                piece[0] = room
            return room

        for j, obj in enumerate(saves):
            after = saves[j + 1] if j + 1 < len(saves) and action is not Action.RECOMPUTE else None
            nominal = start + obj.fraction * self.fwd[i]

            def saved(obj: _Object = obj, after: _Object | None = after, nominal: float = nominal) -> None:
                if self.now < nominal + stalled[0] or stall(obj) > self.now:  # this forward waited, or waits now
                    self.at(nominal + stalled[0], _START, lambda: saved(obj, after, nominal))
                    return
                pending.remove(obj)
                if obj.managed:
                    self.pack(obj)
                else:
                    self.sched.produced(obj.key, self.now)
                if after is not None:  # the next saved tensor is computed from here on
                    self.allocate(after)

            self.at(nominal, _START, saved)

        deferred = [-math.inf]  # the instant finish last let this forward's saves made then go first

        def finish() -> None:
            # a save at this very instant (the layer's output, after the frees) that must wait delays the end too
            if self.now < end + stalled[0] or (pending and stall(pending[0]) > self.now):
                self.at(end + stalled[0], _END, finish)
                return
            if pending and deferred[0] != self.now and self._a_later_save_waits(pending):
                # Note [Saves at a forward's end that wait behind each other]
                deferred[0] = self.now
                self.at(self.now, _START, finish)
                return
            self.event("compute", f"forward:{self.names[i]}", piece[0], self.now, "forward", i)
            if self.plan.drain_offloads and action is Action.OFFLOAD:
                # Note [The worst peak within the prefetch budget]: drained, the forward holds at most this
                # layer's saves, whenever their copies land
                landed = sum(obj.nbytes for obj in saves if not obj.resident)
                self.worst = max(self.worst, self.level + landed)
            self.change(-self.fwork[i])
            if self.psched is not None and self.params[i] > 0:
                # Note [Backward's first parameters stay after forward in the simulator]
                self.p_turn_kept[i] = self.p_turn[i]
                self.param_release(i)
            if self.plan.drain_offloads and action is Action.OFFLOAD:
                # after a save made at the forward's end (its callback comes at this instant, after the frees)
                self.at(self.now, _START, drain)
                return
            self.next_task(index + 1)

        def drain() -> None:
            # Note [Drained offloads bound the forward's copies in flight]
            landed = max((obj.d2h_end for obj in saves if obj.managed), default=self.now)
            if landed > self.now:
                self.wait(i, self.now, landed)
                self.at(landed, _START, lambda: self.next_task(index + 1))
                return
            self.next_task(index + 1)

        self.at(end, _END, finish)

    def use_group(self, index: int, i: int, g: int) -> None:
        """Backward reaches the saves of group ``g`` of layer ``i``: each is used (a trigger); wait for
        what is not back."""
        sched = self.sched
        t0 = self.now
        ready = [t0]
        pending = [0]
        _, group = self.groups[i][g]
        if g and self.group_work[i] is not None:  # Note [An offloaded layer's saves go as backward uses them]
            for obj in self.groups[i][g - 1][1]:
                self.release_save(obj)

        def go() -> None:
            self.at(max(ready[0], self.now), _START, lambda: self.run_group(index, i, g, t0))

        def reload_when_landed(obj: _Object) -> Callable[[], None]:
            """Called once ``obj``'s stage or D2H landed: reload it if still offloaded; the group starts
            when the last such reload is done."""

            def landed() -> None:
                if self.sched.objects[obj.key].state is State.OFFLOADED:
                    self.reload(obj)
                ready[0] = max(ready[0], obj.h2d_end)
                pending[0] -= 1
                if pending[0] == 0:
                    go()

            return landed

        self.refresh_room()

        for obj in group:
            key = obj.key
            if not obj.managed:
                self.execute(sched.used(key, t0))
                continue
            state = sched.objects[key].state
            if state is State.RESTORED or (state is State.PREFETCHING and obj.h2d_end > -math.inf):
                self.execute(sched.used(key, t0, managed_key=key))
                sched.awaited(key)
                ready[0] = max(ready[0], obj.h2d_end)
            elif state is State.OFFLOADING and (obj.held or self.profile.reuse_in_flight):
                # Note [Reuse of device copies still in flight]: the device copy is still there
                obj.in_place = not obj.held
                sched.reused(key)
                self.execute(sched.used(key, t0, managed_key=key))
            elif state is State.OFFLOADED and obj.on_nvme:  # two hops on demand: stage, then reload
                pending[0] += 1
                reload_staged = reload_when_landed(obj)
                if key in self.staging:  # the plan's stage is under way: reloaded once it landed
                    self.staging[key] = reload_staged
                else:
                    self.stage(obj, reload_staged)
                self.execute(sched.used(key, t0, managed_key=key))
            elif state is State.OFFLOADED:
                end = self.reload(obj)
                self.execute(sched.used(key, t0, managed_key=key))
                ready[0] = max(ready[0], end)
            else:  # its D2H (or an evicted prefetch) is in flight: reload once it landed
                pending[0] += 1
                self._waiting_for[key] = reload_when_landed(obj)
                self.execute(sched.used(key, t0, managed_key=key))
        if pending[0] == 0:
            go()

    def run_group(self, index: int, i: int, g: int, t0: float) -> None:
        """Layer ``i``'s backward from the use of group ``g`` to the next use (or its end)."""
        self.wait(i, t0, self.now)
        groups = self.groups[i]
        offset, group = groups[g]
        for obj in group:
            if obj.managed:
                self.sched.consumed(obj.key)
                obj.used = True
        if self.reads_after[i][g]:  # Note [Reads of kept tensors are triggers]
            self.execute(self.sched.used(self.read_key, self.now))
            self.read_key += 1
        self.refresh_room()
        work = self.group_work[i]
        if work is None:
            if g == 0:  # its gradients appear with its backward
                self.change(self.work[i] + self.grads[i])
        else:  # Note [An offloaded layer's saves go as backward uses them]: the gross bytes hold its gradients
            self.change(work[0] if g == 0 else work[g] - work[g - 1])
        following = groups[g + 1][0] if g + 1 < len(groups) else self.bwd[i]
        start, end = self.now, self.now + max(0.0, following - offset)
        self.event("compute", f"backward:{self.names[i]}", start, end, "backward", i)

        def finish() -> None:
            if g + 1 < len(groups):
                self.use_group(index, i, g + 1)
                return
            # Note [A layer's saves are freed when its backward ends]: working_bytes is measured as the
            # peak of the backward above its start, net of the saves autograd frees as it goes
            for obj in self.saves[i]:
                self.release_save(obj)
                if obj.managed:
                    self.sched.released(obj.key)
            freed = self.work[i] if work is None else work[-1] - self.grads[i]  # its gradients stay
            if self.actions[i] is Action.RECOMPUTE and self.segment_of[i][0] == i:
                freed += self.inputs[i]
            self.change(-freed)
            if self.psched is not None and self.params[i] > 0:
                self.p_backward_pin[i] = False
                self.param_release(i)
            if self.offload_optimizer:
                self.optimizer_after_backward(i)
            self.next_task(index + 1)

        self.at(end, _END, finish)

    def release_save(self, obj: _Object) -> None:
        """Backward is done with ``obj``: its device copy goes (a copy in flight keeps its source until it lands)."""
        obj.backward_done = True
        if not (obj.in_place and obj.d2h_end > self.now):
            self.free(obj)

    # -- the result --------------------------------------------------------------------------
    def _busy(self, direction: str) -> float:
        """Seconds of copies in ``direction`` (on a shared link both directions share one queue)."""
        objects = self.objects.values()
        if direction == "d2h":
            return math.fsum(self.copy_s(o.nbytes, "d2h") for o in objects)
        return math.fsum(self.copy_s(o.nbytes, "h2d") for o in objects if o.reloaded)

    def result(self) -> SimResult:
        profile = self.profile
        step_time = self.compute_end
        if self.psched is not None:  # the next step's first copies, after the host step (the device synchronises)
            issue = max(self.compute_end, self.host_end)
            self.outside_copy("next-forward", at=issue)
            for i in self.p_first_layers:
                start, land = self.h2d_link.run(issue, self.param_copy_s(i))
                self.h2d_bytes += self.params[i]
                self.p_copies += self.param_copies[i]
                self.last_copy_end = max(self.last_copy_end, land)
                self.event("h2d", f"h2d:param:next-forward:{self.names[i]}", start, land, "h2d", i)
        end = max(self.last_copy_end, self.host_end)
        if end > step_time:  # the step ends when its last copy landed (the device synchronises)
            objects = self.objects.values()
            last = max(objects, key=lambda o: max(o.d2h_end, o.h2d_end)).layer if objects else 0
            self.now = end
            self.wait(last, step_time, end)
            step_time = end
        static = self.static
        times: list[float] = [0.0]
        levels: list[int] = [static]
        peak, peak_time = static, 0.0
        previous, last_sign = static, 0
        for time, level in self.memory:
            if level > peak:
                peak, peak_time = level, time
            sign = 1 if level > previous else -1
            # one point per run of same-direction changes at one instant: spikes of zero width stay visible
            if time == times[-1] and (sign == last_sign or len(times) == 1):
                levels[-1] = level
            else:
                times.append(time)
                levels.append(level)
            previous, last_sign = level, sign
        if times[-1] < step_time:
            times.append(step_time)
            levels.append(previous)
        events = self.events
        if self.record_events:
            events.sort(key=lambda e: (e.start, e.stream))
        offloaded = sum(o.nbytes for o in self.objects.values())
        reused = sum(o.nbytes for o in self.objects.values() if not o.reloaded)
        layers = profile.layers
        psched = self.psched
        return SimResult(
            plan=self.plan,
            step_time_s=step_time,
            forward_s=math.fsum(layer.forward_s for layer in layers),
            backward_s=math.fsum(layer.backward_s for layer in layers),
            recompute_s=self.recompute_total,
            overhead_s=2 * math.fsum(self.half_overhead) + self.kinds_overhead,
            exposed_wait_s=math.fsum(self.waits.values()),
            wait_by_layer=self.waits,
            static_bytes=static,
            peak_bytes=peak,
            peak_time_s=peak_time,
            memory_times=tuple(times),
            memory_bytes=tuple(levels),
            d2h_busy_s=self.d2h_link.busy if profile.duplex else self._busy("d2h"),
            h2d_busy_s=self.h2d_link.busy if profile.duplex else self._busy("h2d"),
            d2h_bytes=offloaded,
            h2d_bytes=self.h2d_bytes,
            capacity_bytes=profile.capacity_bytes,
            events=tuple(events),
            reused_bytes=reused,
            schedule_log=tuple(self.sched.log),
            schedule_actions=tuple(self.sched.actions),
            host_step_s=self.host_busy,
            parameter_schedule_log=tuple(psched.log) if psched is not None else (),
            parameter_schedule_actions=tuple(psched.actions) if psched is not None else (),
            parameter_schedule_settings=psched.settings() if psched is not None else {},
            parameter_h2d_copies=self.p_copies,
            optimizer_host_bytes=self.optimizer_host_bytes(),
            worst_peak_bytes=max(peak, self.worst),
            nvme_read_bytes=self.nvme_read_total,
            nvme_write_bytes=self.nvme_write_total,
        )

    def optimizer_host_bytes(self) -> int:
        """:attr:`SimResult.optimizer_host_bytes`."""
        if not self.offload_optimizer:
            return 0
        profile = self.profile
        states = self.host_state_window if self.nvme else profile.optimizer_state_bytes
        return 2 * profile.param_bytes + states
