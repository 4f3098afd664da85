"""An event-driven timeline simulator of one training step under a plan.

Three in-order streams: **compute** (forward layers in order, then backward in
reverse, with recompute inserted where the plan says), **D2H** and **H2D** (over a
duplex link, or one shared link that serialises both directions in order of
readiness). Copies cost ``latency + bytes / bandwidth`` in their direction.

Semantics (see ``# Note [Simulated lifetimes]`` below): an offloaded layer's D2H is
queued when its forward ends and its device bytes are freed when the D2H completes;
its H2D is issued by the plan's :class:`~offcore.sim.plan.PrefetchPolicy` and must
complete before that layer's backward starts, otherwise the compute stream waits
(exposed wait, charged to that layer). A recomputed layer keeps only its segment's
input; the segment is rerun just before the backward of its last layer and its saved
bytes are back on device from then until each layer's backward. Kept activations stay
until their backward. The compute stream never stalls for memory: a plan that needs
more than the capacity is reported with ``oom=True``.

    >>> from offcore.sim.profile import uniform_profile
    >>> from offcore.sim.plan import Plan
    >>> p = uniform_profile(2, forward_s=0.0, backward_s=0.003, saved_bytes=256 * 2**20,
    ...                     d2h_bandwidth="inf", h2d_bandwidth="32GiB/s")
    >>> r = simulate(p, Plan(["offload", "keep"]))
    >>> round(r.exposed_wait_s * 1e3, 4)           # 7.8125 ms copy, 3 ms to hide it
    4.8125
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from offcore.errors import ConfigurationError
from offcore.sim.formulas import utilization
from offcore.sim.plan import Action, Plan
from offcore.sim.profile import StepProfile

__all__ = ["simulate", "SimResult", "TimelineEvent"]

# Note [Simulated lifetimes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Device bytes in the simulator follow the rules the runtime obeys (offcore/objects.py,
# Note [When may a device copy be freed?]):
#   - keep:      +saved at forward start, -saved at the end of the layer's backward.
#   - offload:   +saved at forward start, -saved when its D2H completes (never earlier);
#                +saved when its H2D starts (the destination buffer), -saved at the end
#                of its backward. The H2D never starts before the D2H has completed.
#   - recompute: +input at forward start of the first layer of a segment (the checkpoint),
#                freed at the end of that layer's backward; +saved of every layer of the
#                segment while the segment is rerun, each freed at the end of its backward.
#   - working bytes live while a layer runs (forward, recompute or backward).
# At equal times frees are applied before allocations. The executor and the activation
# plugin must keep these lifetimes for the prediction to hold.

# Note [Reuse of device copies still in flight]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A device copy may be freed only after its D2H completed (offcore/objects.py, Note [When
# may a device copy be freed?]); until then it is still there, and offcore_torch uses it
# rather than reloading (offload.py, Note [Prefetch from the end of forward]). With
# ``StepProfile.reuse_in_flight`` the simulator does the same for an offloaded layer whose
# D2H lands after the end of forward:
#   - backward reaches the layer before its D2H landed: the device copy is used in place;
#   - its D2H lands when the prefetch policy would already start its reload (deadline or
#     lead; within the prefetch budget): the copy is kept, as the plugin "holds" it.
# Either way its bytes stay on the device from its forward to the end of its backward or
# the landing of its D2H, whichever is later (offcore holds the source of a copy in flight);
# there is no H2D and no wait; its D2H still occupies the link, and
# the step ends when the last copy has landed (a wait charged to that layer when compute
# finishes first). A D2H that lands before forward ends is released and reloaded as usual.
# Without ``reuse_in_flight`` every offloaded layer is reloaded after its D2H.

# Note [Copies of one step never overlap]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# D2H copies run in forward order and H2D copies in backward order, so the first reload
# is of the last layer offloaded, whose D2H is the last in its queue: every H2D of a step
# starts after every D2H of that step has ended (without ``reuse_in_flight``: a copy
# used in place may still be draining while a later reload runs). For saved activations alone a duplex
# link therefore gives the same step as a shared one (both are modelled, for profiles that
# will carry other traffic); bounds.py relies on this to treat both directions as one
# queue.


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one stream, e.g. ``TimelineEvent("h2d", "h2d:layer3", 0.1, 0.2, "h2d", "layer3")``."""

    stream: str
    """``"compute"``, ``"d2h"`` or ``"h2d"``."""
    name: str
    start: float
    end: float
    kind: str
    """``forward``, ``backward``, ``recompute``, ``wait``, ``d2h`` or ``h2d``."""
    layer: str

    @property
    def duration(self) -> float:
        """``end − start`` in seconds."""
        return self.end - self.start


@dataclass(frozen=True)
class SimResult:
    """What one simulated step predicts.

    Times in seconds, sizes in bytes. ``utilization`` is
    ``T_compute / (T_compute + T_exposed_wait)`` with recompute counted as compute.

    >>> from offcore.sim.profile import uniform_profile
    >>> r = simulate(uniform_profile(3, forward_s=1.0, backward_s=2.0, saved_bytes=10), Plan.keep_all(3))
    >>> r.step_time_s, r.peak_bytes, r.utilization, r.oom
    (9.0, 30, 1.0, False)
    """

    plan: Plan
    step_time_s: float
    forward_s: float
    backward_s: float
    recompute_s: float
    overhead_s: float
    exposed_wait_s: float
    wait_by_layer: Mapping[str, float]
    static_bytes: int
    peak_bytes: int
    peak_time_s: float
    memory_times: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    d2h_busy_s: float
    h2d_busy_s: float
    d2h_bytes: int
    h2d_bytes: int
    capacity_bytes: int | None
    events: tuple[TimelineEvent, ...] = field(default=(), repr=False)
    reused_bytes: int = 0
    """Offloaded bytes used in place instead of reloaded (Note [Reuse of device copies still in flight])."""

    @property
    def compute_s(self) -> float:
        """Time the compute stream is busy: forward + backward + recompute (+ offload and micro-step overhead)."""
        return self.forward_s + self.backward_s + self.recompute_s + self.overhead_s

    @property
    def utilization(self) -> float:
        """``U = T_compute / (T_compute + T_exposed_transfer)``."""
        return utilization(self.compute_s, self.exposed_wait_s)

    @property
    def oom(self) -> bool:
        """True when the peak exceeds the profile's device capacity."""
        return self.capacity_bytes is not None and self.peak_bytes > self.capacity_bytes

    @property
    def activation_peak_bytes(self) -> int:
        """Peak minus the resident bytes (parameters, gradients, other)."""
        return self.peak_bytes - self.static_bytes

    def bytes_time_above(self, threshold: float) -> float:
        """Integral over the step of ``max(0, device bytes − threshold)`` (byte-seconds)."""
        total = 0.0
        times, values = self.memory_times, self.memory_bytes
        for index in range(len(times) - 1):
            excess = values[index] - threshold
            if excess > 0:
                total += excess * (times[index + 1] - times[index])
        return total

    def memory_at(self, t: float) -> int:
        """Device bytes at time ``t`` (after the events at ``t``)."""
        value = self.static_bytes
        for time, level in zip(self.memory_times, self.memory_bytes, strict=True):
            if time > t:
                break
            value = level
        return value

    def summary(self) -> dict[str, Any]:
        """Scalar figures as a JSON-ready dict (no events, no series)."""
        return {
            "plan": self.plan.describe(),
            "strategy": self.plan.strategy,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "exposed_wait_s": self.exposed_wait_s,
            "utilization": self.utilization,
            "peak_bytes": self.peak_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "d2h_bytes": self.d2h_bytes,
            "h2d_bytes": self.h2d_bytes,
            "reused_bytes": self.reused_bytes,
            "d2h_busy_s": self.d2h_busy_s,
            "h2d_busy_s": self.h2d_busy_s,
            "oom": self.oom,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready: summary, plan, waits, memory series and events."""
        data = self.summary()
        data.update(
            plan=self.plan.to_dict(),
            wait_by_layer=dict(self.wait_by_layer),
            memory=[[t, b] for t, b in zip(self.memory_times, self.memory_bytes, strict=True)],
            events=[[e.stream, e.name, e.start, e.end, e.kind, e.layer] for e in self.events],
        )
        return data

    def to_chrome_trace(self, *, pid: int = 1, process_name: str = "offcore simulation") -> dict[str, Any]:
        """A Chrome-trace / Perfetto JSON object: one thread per stream and a memory counter.

        >>> from offcore.sim.profile import uniform_profile
        >>> r = simulate(uniform_profile(1, forward_s=1.0, backward_s=1.0, saved_bytes=1), Plan.keep_all(1))
        >>> sorted({e["ph"] for e in r.to_chrome_trace()["traceEvents"]})
        ['C', 'M', 'X']
        """
        tids = {"compute": 1, "d2h": 2, "h2d": 3}
        trace: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process_name}},
        ]
        for stream, tid in tids.items():
            trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": stream}})
        for event in self.events:
            trace.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tids.get(event.stream, 9),
                    "name": event.name,
                    "cat": event.kind,
                    "ts": event.start * 1e6,
                    "dur": max(0.0, event.duration) * 1e6,
                    "args": {"layer": event.layer},
                }
            )
        for time, level in zip(self.memory_times, self.memory_bytes, strict=True):
            trace.append({"ph": "C", "pid": pid, "name": "device bytes", "ts": time * 1e6, "args": {"bytes": level}})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}


def simulate(
    profile: StepProfile,
    plan: Plan,
    *,
    microbatch_overhead_s: float = 0.0,
    record_events: bool = True,
) -> SimResult:
    """Simulate one training step of ``profile`` under ``plan``.

    With ``plan.microbatches = m > 1`` the step runs ``m`` identical micro-steps of
    ``profile.split_microbatches(m)`` back to back, and ``microbatch_overhead_s`` is
    charged to the compute stream for each micro-step after the first.
    ``record_events=False`` skips the event list (faster; the planner uses it).

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(4, forward_s=1.0, backward_s=2.0, saved_bytes=100)
    >>> simulate(p, Plan.uniform(4, "recompute")).step_time_s      # 4 + 8 + 4 recompute
    16.0
    """
    if not isinstance(profile, StepProfile):
        raise ConfigurationError(f"simulate() needs a StepProfile, got {type(profile).__name__}")
    if not isinstance(plan, Plan):
        raise ConfigurationError(f"simulate() needs a Plan, got {type(plan).__name__}")
    plan.check(profile)
    if not (isinstance(microbatch_overhead_s, (int, float)) and microbatch_overhead_s >= 0):
        raise ConfigurationError(f"microbatch_overhead_s must be >= 0, got {microbatch_overhead_s!r}")
    if plan.microbatches == 1:
        return _simulate_once(profile, plan, record_events)
    micro = _simulate_once(profile.split_microbatches(plan.microbatches), plan, record_events)
    return _repeat(micro, plan.microbatches, float(microbatch_overhead_s), profile.capacity_bytes)


def _repeat(micro: SimResult, count: int, overhead_s: float, capacity: int | None) -> SimResult:
    """Chain ``count`` copies of a micro-step with ``overhead_s`` between them."""
    period = micro.step_time_s + overhead_s
    times: list[float] = []
    levels: list[int] = []
    events: list[TimelineEvent] = []
    for k in range(count):
        shift = k * period
        times.extend(t + shift for t in micro.memory_times)
        levels.extend(micro.memory_bytes)
        events.extend(
            TimelineEvent(e.stream, f"{e.name}#{k}", e.start + shift, e.end + shift, e.kind, e.layer)
            for e in micro.events
        )
        if k + 1 < count and overhead_s > 0:
            events.append(
                TimelineEvent(
                    "compute", f"microstep-overhead#{k}", shift + micro.step_time_s, shift + period, "overhead", ""
                )
            )
    return SimResult(
        plan=micro.plan,
        step_time_s=count * micro.step_time_s + (count - 1) * overhead_s,
        forward_s=count * micro.forward_s,
        backward_s=count * micro.backward_s,
        recompute_s=count * micro.recompute_s,
        overhead_s=count * micro.overhead_s + (count - 1) * overhead_s,
        exposed_wait_s=count * micro.exposed_wait_s,
        wait_by_layer={name: count * wait for name, wait in micro.wait_by_layer.items()},
        static_bytes=micro.static_bytes,
        peak_bytes=micro.peak_bytes,
        peak_time_s=micro.peak_time_s,
        memory_times=tuple(times),
        memory_bytes=tuple(levels),
        d2h_busy_s=count * micro.d2h_busy_s,
        h2d_busy_s=count * micro.h2d_busy_s,
        d2h_bytes=count * micro.d2h_bytes,
        h2d_bytes=count * micro.h2d_bytes,
        capacity_bytes=capacity,
        events=tuple(events),
        reused_bytes=count * micro.reused_bytes,
    )


def _simulate_once(profile: StepProfile, plan: Plan, record_events: bool) -> SimResult:
    layers = profile.layers
    n = len(layers)
    names = profile.layer_names
    actions = plan.actions
    # offload overhead (host work of the runtime) runs on the compute stream: half in forward, half in backward
    half_overhead = [
        layer.offload_overhead_s / 2 if actions[i] is Action.OFFLOAD else 0.0 for i, layer in enumerate(layers)
    ]
    fwd = [layer.forward_s + extra for layer, extra in zip(layers, half_overhead, strict=True)]
    bwd = [layer.backward_s + extra for layer, extra in zip(layers, half_overhead, strict=True)]
    rec = [layer.recompute_time for layer in layers]
    saved = [layer.saved_bytes for layer in layers]
    work = [layer.working_bytes for layer in layers]
    inputs = [layer.input_bytes for layer in layers]
    prefetch = plan.prefetch

    # Memory events: (time, rank, delta). Events at equal times are applied in causal order:
    # compute step q allocates at rank 2q and frees at rank 2q + 1; a copy's event is ranked
    # right after the compute step that caused it, or, when it has no cause at that instant,
    # a D2H free goes first and an H2D allocation goes before the next compute step not yet
    # placed. So a layer that takes no time still holds its bytes, and a buffer freed at the
    # instant another is allocated is not counted twice.
    memory: list[tuple[float, float, int]] = []

    def allocate(time: float, nbytes: int, rank: float) -> None:
        if nbytes:
            memory.append((time, rank, nbytes))

    def free(time: float, nbytes: int, rank: float) -> None:
        if nbytes:
            memory.append((time, rank, -nbytes))

    events: list[TimelineEvent] = []
    segment_of: dict[int, tuple[int, int]] = {}
    for first, last in plan.segments():
        for index in range(first, last + 1):
            segment_of[index] = (first, last)

    # ---- forward: the compute stream never waits -------------------------------------
    forward_end = [0.0] * n
    now = 0.0
    for i in range(n):
        start, end = now, now + fwd[i]
        if actions[i] is Action.RECOMPUTE:
            held = inputs[i] if segment_of[i][0] == i else 0
        else:
            held = saved[i]
        allocate(start, held + work[i], 2 * i)
        free(end, work[i], 2 * i + 1)
        if record_events:
            events.append(TimelineEvent("compute", f"forward:{names[i]}", start, end, "forward", names[i]))
        forward_end[i] = end
        now = end
    forward_done = now

    # ---- backward task list and its no-wait (ideal) timing ---------------------------
    # task: (kind, layer index, duration); recompute tasks carry the segment's last index
    tasks: list[tuple[str, int, float]] = []
    backward_task: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        if actions[i] is Action.RECOMPUTE and segment_of[i][1] == i:
            first, last = segment_of[i]
            tasks.append(("recompute", i, math.fsum(rec[first : last + 1])))
        backward_task[i] = len(tasks)
        tasks.append(("backward", i, bwd[i]))
    ideal_start = [0.0] * len(tasks)
    clock = forward_done
    for index, (_, _, duration) in enumerate(tasks):
        ideal_start[index] = clock
        clock += duration

    offloaded = [i for i in range(n) if actions[i] is Action.OFFLOAD]
    reuse = profile.reuse_in_flight
    reused: set[int] = set()  # Note [Reuse of device copies still in flight]
    d2h_time = {i: profile.transfer_s(saved[i], "d2h") for i in offloaded}
    h2d_time = {i: profile.transfer_s(saved[i], "h2d") for i in offloaded}
    reload_order = offloaded[::-1]  # backward consumes the last layer first

    # earliest start wanted by the prefetch policy (absolute, from the ideal timeline)
    wanted_start: dict[int, float] = {}
    if prefetch.mode == "deadline":
        for i in offloaded:
            wanted_start[i] = ideal_start[backward_task[i]] - h2d_time[i] - prefetch.margin_s
    elif prefetch.mode == "lead":
        assert prefetch.lead_s is not None
        for i in offloaded:
            wanted_start[i] = ideal_start[backward_task[i]] - prefetch.lead_s

    # prefetch byte budget: reload k may start only after reload `release[k]` was consumed
    release: list[int | None] = [None] * len(reload_order)
    if prefetch.budget_bytes is not None and prefetch.mode != "on_demand":
        budget = prefetch.budget_bytes
        window_start, window_bytes = 0, 0
        for k, i in enumerate(reload_order):
            window_bytes += saved[i]
            while window_start < k and window_bytes > budget:
                window_bytes -= saved[reload_order[window_start]]
                window_start += 1
            release[k] = window_start - 1 if window_start > 0 else None

    # ---- lazy compute progress over the backward tasks -------------------------------
    backward_end: dict[int, float] = {}
    h2d_end: dict[int, float] = {}
    waits: dict[str, float] = {}
    backward_step: dict[int, int] = {}
    task_next = 0
    compute_clock = forward_done
    recompute_total = 0.0
    step = n  # compute steps 0..n-1 were the forward layers

    def advance_to(limit: int) -> None:
        """Run backward tasks with index < limit (their H2D copies are already scheduled)."""
        nonlocal task_next, compute_clock, recompute_total, step
        clock = compute_clock
        index = task_next
        while index < limit:
            kind, i, duration = tasks[index]
            if kind == "recompute":
                first, last = segment_of[i]
                for layer in range(first, last + 1):
                    start, end = clock, clock + rec[layer]
                    allocate(start, saved[layer] + work[layer], 2 * step)
                    free(end, work[layer], 2 * step + 1)
                    step += 1
                    if record_events:
                        events.append(
                            TimelineEvent("compute", f"recompute:{names[layer]}", start, end, "recompute", names[layer])
                        )
                    clock = end
                recompute_total += duration
            else:
                if actions[i] is Action.OFFLOAD and i not in reused:
                    arrival = h2d_end[i]
                    if arrival > clock:
                        waits[names[i]] = arrival - clock
                        if record_events:
                            events.append(
                                TimelineEvent("compute", f"wait:{names[i]}", clock, arrival, "wait", names[i])
                            )
                        clock = arrival
                start, end = clock, clock + duration
                allocate(start, work[i], 2 * step)
                freed = work[i] + (0 if i in reused else saved[i])  # a reused copy: freed when its D2H lands
                if actions[i] is Action.RECOMPUTE and segment_of[i][0] == i:
                    freed += inputs[i]
                free(end, freed, 2 * step + 1)
                backward_step[i] = step
                step += 1
                if record_events:
                    events.append(TimelineEvent("compute", f"backward:{names[i]}", start, end, "backward", names[i]))
                backward_end[i] = end
                clock = end
            index += 1
        task_next = index
        compute_clock = clock

    reload_rank: dict[int, float] = {}
    reload_ready_at: dict[int, float] = {}

    def reload_ready(k: int, d2h_end: Mapping[int, float]) -> float | None:
        """When reload k may start, or None while its D2H is not scheduled yet."""
        i = reload_order[k]
        if i not in d2h_end:
            return None
        ready = d2h_end[i]
        causes: list[tuple[float, float]] = []  # (time, rank) of compute ends that gate the reload
        if prefetch.mode == "on_demand":
            advance_to(backward_task[i])
            ready = max(ready, compute_clock)
            causes.append((compute_clock, 2 * step - 0.5))
        else:
            ready = max(ready, wanted_start[i])
        released = release[k]
        if released is not None:
            j = reload_order[released]
            advance_to(backward_task[j] + 1)
            ready = max(ready, backward_end[j])
            causes.append((backward_end[j], 2 * backward_step[j] + 1.5))
        ranks = [rank for time, rank in causes if time == ready]
        reload_rank[i] = max(ranks) if ranks else 2 * step - 0.5
        reload_ready_at[i] = ready
        return ready

    d2h_end: dict[int, float] = {}
    d2h_free: dict[int, tuple[float, float]] = {}  # applied at the end, unless the copy was reused
    busy = {"d2h": 0.0, "h2d": 0.0}

    def reused_in_place(k: int, ready: float) -> bool:
        """Note [Reuse of device copies still in flight]: is reload k's device copy kept instead?"""
        i = reload_order[k]
        landed = d2h_end[i]
        if not reuse or landed <= forward_done or ready != landed:
            return False
        if prefetch.mode == "on_demand":
            return landed > compute_clock  # reload_ready ran compute up to this layer's backward
        return True

    def run_d2h(i: int, start: float) -> float:
        end = start + d2h_time[i]
        d2h_end[i] = end
        d2h_free[i] = (end, 2 * i + 1.5 if end == forward_end[i] else -1.0)
        busy["d2h"] += d2h_time[i]
        if record_events:
            events.append(TimelineEvent("d2h", f"d2h:{names[i]}", start, end, "d2h", names[i]))
        return end

    def run_h2d(i: int, start: float) -> float:
        end = start + h2d_time[i]
        h2d_end[i] = end
        allocate(start, saved[i], reload_rank[i] if start == reload_ready_at[i] else 2 * step - 0.5)
        busy["h2d"] += h2d_time[i]
        if record_events:
            events.append(TimelineEvent("h2d", f"h2d:{names[i]}", start, end, "h2d", names[i]))
        return end

    if profile.duplex:
        link_free = 0.0
        for i in offloaded:
            link_free = run_d2h(i, max(forward_end[i], link_free))
        link_free = 0.0
        for k, i in enumerate(reload_order):
            ready = reload_ready(k, d2h_end)
            assert ready is not None
            if reused_in_place(k, ready):
                reused.add(i)
                continue
            link_free = run_h2d(i, max(ready, link_free))
    else:
        # one shared link: serve the head of each queue in order of readiness (D2H on ties)
        link_free = 0.0
        next_d2h, next_h2d = 0, 0
        while next_d2h < len(offloaded) or next_h2d < len(reload_order):
            ready_d2h = forward_end[offloaded[next_d2h]] if next_d2h < len(offloaded) else math.inf
            ready_h2d = math.inf
            if next_h2d < len(reload_order):
                candidate = reload_ready(next_h2d, d2h_end)
                if candidate is not None:
                    if reused_in_place(next_h2d, candidate):
                        reused.add(reload_order[next_h2d])
                        next_h2d += 1
                        continue
                    ready_h2d = candidate
            if ready_d2h <= ready_h2d:
                link_free = run_d2h(offloaded[next_d2h], max(ready_d2h, link_free))
                next_d2h += 1
            else:
                link_free = run_h2d(reload_order[next_h2d], max(ready_h2d, link_free))
                next_h2d += 1

    advance_to(len(tasks))
    for i, (time, rank) in d2h_free.items():
        if i not in reused:
            free(time, saved[i], rank)
        elif time > backward_end[i]:  # the copy outlives its backward: freed when the D2H lands
            free(time, saved[i], -1.0)
        else:
            free(backward_end[i], saved[i], 2 * backward_step[i] + 1)
    step_time = compute_clock
    if d2h_end:
        last = max(d2h_end, key=lambda i: d2h_end[i])
        if d2h_end[last] > step_time:  # only a reused copy's D2H can outlast compute: the step drains it
            waits[names[last]] = waits.get(names[last], 0.0) + d2h_end[last] - step_time
            if record_events:
                events.append(
                    TimelineEvent("compute", f"wait:{names[last]}", step_time, d2h_end[last], "wait", names[last])
                )
            step_time = d2h_end[last]

    # ---- device bytes over time -------------------------------------------------------
    memory.sort(key=lambda item: (item[0], item[1]))
    static = profile.static_bytes
    times: list[float] = [0.0]
    levels: list[int] = [static]
    level = peak = static
    peak_time = 0.0
    last_sign = 0
    for time, _, delta in memory:
        level += delta
        if level > peak:
            peak, peak_time = level, time
        sign = 1 if delta > 0 else -1
        # one point per run of same-direction changes at one instant: spikes of zero width stay visible
        if time == times[-1] and (sign == last_sign or len(times) == 1):
            levels[-1] = level
        else:
            times.append(time)
            levels.append(level)
        last_sign = sign
    if times[-1] < step_time:
        times.append(step_time)
        levels.append(level)

    if record_events:
        events.sort(key=lambda e: (e.start, e.stream))
    offloaded_bytes = sum(saved[i] for i in offloaded)
    reused_bytes = sum(saved[i] for i in reused)
    return SimResult(
        plan=plan,
        step_time_s=step_time,
        forward_s=math.fsum(layer.forward_s for layer in layers),
        backward_s=math.fsum(layer.backward_s for layer in layers),
        recompute_s=recompute_total,
        overhead_s=2 * math.fsum(half_overhead),
        exposed_wait_s=math.fsum(waits.values()),
        wait_by_layer=waits,
        static_bytes=static,
        peak_bytes=peak,
        peak_time_s=peak_time,
        memory_times=tuple(times),
        memory_bytes=tuple(levels),
        d2h_busy_s=busy["d2h"],
        h2d_busy_s=busy["h2d"],
        d2h_bytes=offloaded_bytes,
        h2d_bytes=offloaded_bytes - reused_bytes,
        capacity_bytes=profile.capacity_bytes,
        events=tuple(events),
        reused_bytes=reused_bytes,
    )
