"""Two hops from NVMe (Note [Two hops from NVMe]): the residency scheduler stages an NVMe-resident object
(NVMe → host) on its own link early enough for its host → device copy; host-resident objects are
planned as before. A simulated clock: two serial links, triggers at backward's uses, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from offcore.errors import IllegalTransitionError
from offcore.kinds import Kind, Tier
from offcore.residency import Action, ActionKind, ResidencyScheduler
from offcore.scheduler import PrefetchPlan, Scheduler

MiB = 1 << 20


class Landed:
    def query(self) -> bool:
        return True


DONE = Landed()


@dataclass
class Step:
    """One simulated step: ``n`` objects saved 1 ms apart, backward's uses at the predictor's default
    prediction (2 × forward speed, reverse order), two serial links (h2d, n2h) of fixed durations."""

    n: int = 8
    h2d: float = 0.0015
    n2h: float = 0.0025
    gap: float = 0.002  # forward's end to backward's start
    spill: frozenset[int] = frozenset()
    stage_duration: Any = "n2h"  # what the scheduler is told about the NVMe link
    refuse_stage_once: frozenset[int] = frozenset()
    actions: list[tuple[float, str, int]] = field(default_factory=list)
    stage_end: dict[int, float] = field(default_factory=dict)
    h2d_start: dict[int, float] = field(default_factory=dict)
    h2d_end: dict[int, float] = field(default_factory=dict)
    use_at: dict[int, float] = field(default_factory=dict)
    stalls: dict[int, float] = field(default_factory=dict)

    def run(self, *, record: bool = False) -> ResidencyScheduler:
        told = {"n2h": lambda nbytes: self.n2h, "none": None}.get(self.stage_duration, self.stage_duration)
        rs = ResidencyScheduler(
            Scheduler(margin=0.0), duration=lambda nbytes: self.h2d, budget=64 * MiB, record=record, stage_duration=told
        )
        h2d_free = n2h_free = -math.inf
        staging: dict[int, float] = {}  # key -> landing time
        refused: set[int] = set()

        def carry_out(offer: Any, now: float) -> None:
            nonlocal h2d_free, n2h_free
            for action in offer:
                self.actions.append((now, action.kind.value, action.key))
                if action.kind is ActionKind.STAGE:
                    if action.key in self.refuse_stage_once and action.key not in refused:
                        refused.add(action.key)
                        rs.stage_refused(action.key, "no_room")
                        continue
                    start = max(now, n2h_free)
                    n2h_free = staging[action.key] = start + self.n2h
                    self.stage_end[action.key] = n2h_free
                    rs.stage_started(action.key)
                elif action.kind is ActionKind.PREFETCH:
                    assert not rs.on_nvme(action.key), "a prefetch of an object still on NVMe"
                    start = max(now, h2d_free)
                    self.h2d_start[action.key] = start
                    h2d_free = self.h2d_end[action.key] = start + self.h2d
                    rs.started(action.key, DONE)

        def trigger(now: float) -> None:
            for key, at in sorted(staging.items(), key=lambda kv: kv[1]):  # landings seen at a trigger
                if at <= now:
                    del staging[key]
                    carry_out(rs.staged(key, now), now)

        rs.forward_began(0.0)
        for key in range(self.n):
            rs.produced(key, 0.001 * key)
            rs.register(key, Kind.ACTIVATION, MiB)
            rs.offload_started(key, DONE)
        for key in range(self.n):
            assert rs.landed(key).kind is ActionKind.FREE
            if key in self.spill:
                rs.spilled(key)
        t_end = 0.001 * self.n
        carry_out(rs.forward_ended(t_end), t_end)
        t_back = t_end + self.gap
        trigger(t_back)
        rs.backward_began(t_back)
        last = 0.001 * (self.n - 1)
        for key in reversed(range(self.n)):
            now = t_back + 2 * (last - 0.001 * key)
            trigger(now)
            carry_out(rs.used(key, now, managed_key=key), now)
            self.use_at[key] = now
            if key not in self.h2d_end:  # never prefetched: an on-demand reload (both hops) at its use
                self.stalls[key] = math.inf
            elif self.h2d_end[key] > now + 1e-12:
                self.stalls[key] = self.h2d_end[key] - now
            rs.consumed(key)
        rs.backward_ended(t_back + 2 * last + 0.001)
        return rs


def test_plan_chains_stages_on_their_own_link_to_land_by_the_copys_trigger() -> None:
    # uses at 0, 2, 4, ... 14 ms (triggers); every copy 1.5 ms on h2d, every stage 2.5 ms on n2h
    use = {k: 0.002 * (7 - k) for k in range(8)}
    plan = PrefetchPlan(
        use,
        {k: MiB for k in range(8)},
        lambda n: 0.0015,
        margin=0.0,
        stage={1: MiB, 2: MiB, 3: MiB},
        stage_duration=lambda n: 0.0025,
    )
    # the host → device chain is the one without stages
    assert plan.latest_start == PrefetchPlan(use, {k: MiB for k in range(8)}, lambda n: 0.0015, margin=0.0).latest_start
    # key 1 is needed at 12 ms, its copy starts by 10.5 ms, i.e. at the trigger at 10 ms: its stage lands by
    # 10 ms and starts by 7.5 ms. Key 2's copy starts by 8.5 ms (trigger 8), but the NVMe link is busy with
    # key 1's stage from 7.5 ms: key 2's stage lands by 7.5, starts by 5.0; key 3's (copy trigger 6) by 2.5
    assert plan.stage_latest == pytest.approx({1: 0.0075, 2: 0.005, 3: 0.0025})
    assert plan.stage_order == [3, 2, 1]
    assert plan.due_stages(plan.virtual_time(7, 0.0)) == []  # next trigger at 2 ms: nothing would be late
    assert plan.due_stages(plan.virtual_time(6, 0.002)) == [3]
    assert plan.due_stages(plan.virtual_time(5, 0.004)) == [3, 2]
    plan.stage_issued(3)
    assert plan.due_stages(plan.virtual_time(5, 0.004)) == [2]


def test_stages_on_a_slow_link_chain_back_from_the_last() -> None:
    use = {0: 0.0, 1: 0.001, 2: 0.002}
    plan = PrefetchPlan(
        use, {1: 10, 2: 10}, lambda n: 0.0, margin=0.0, stage={1: 10, 2: 10}, stage_duration=lambda n: 0.005
    )
    # copies take no time: key 2's copy starts by 2 ms (trigger 1 ms), key 1's by 1 ms (trigger 0); key 2's
    # stage lands by 1 ms (starts by -4 ms), key 1's must land by 0 ms and before key 2's starts: by -4, from -9
    assert plan.stage_latest == pytest.approx({1: -0.009, 2: -0.004})
    assert plan.stage_order == [1, 2]


def test_every_object_lands_in_time_when_both_hops_are_planned() -> None:
    step = Step(spill=frozenset({1, 3, 5}))
    rs = step.run()
    assert step.stalls == {}
    for key in (1, 3, 5):
        assert step.h2d_start[key] >= step.stage_end[key] - 1e-12, "the copy started before its stage landed"
        assert step.h2d_end[key] <= step.use_at[key] + 1e-12
    assert rs.counters["staged"] == 3 and not any(rs.on_nvme(k) for k in range(8))
    assert all(rs.objects[k].host_tier is Tier.PINNED for k in (1, 3, 5))


def test_a_plan_that_ignores_the_first_hop_is_late() -> None:
    # the same step, the scheduler told the NVMe read takes no time: the stages start too late
    step = Step(spill=frozenset({1, 3, 5}), stage_duration=lambda nbytes: 0.0)
    step.run()
    assert 5 in step.stalls  # the first object needed from NVMe is late (and the serial h2d link delays later copies)
    assert step.h2d_start[5] >= step.stage_end[5] - 1e-12


def test_an_unknown_nvme_link_stages_everything_at_once() -> None:
    step = Step(spill=frozenset({1, 3, 5}), stage_duration="none")
    step.run()
    first = [(kind, key) for t, kind, key in step.actions if t == 0.008]
    assert [a for a in first if a[0] == "stage"] == [("stage", 5), ("stage", 3), ("stage", 1)]
    assert step.stalls == {}


def test_host_resident_objects_are_planned_as_before() -> None:
    # nothing on NVMe: the same actions, and the same event log, with or without an NVMe link
    without, with_link = Step(), Step(stage_duration=lambda nbytes: 0.01)
    a, b = without.run(record=True), with_link.run(record=True)
    assert without.actions == with_link.actions and a.log == b.log
    assert all(kind == "prefetch" for _, kind, _ in without.actions)
    # and with some objects on NVMe, staged in time, every copy starts at the trigger it started at before
    spilled = Step(spill=frozenset({1, 3, 5}))
    spilled.run()
    prefetches = [(t, key) for t, kind, key in spilled.actions if kind == "prefetch"]
    assert prefetches == [(t, key) for t, kind, key in without.actions]
    assert spilled.h2d_start == without.h2d_start


def test_a_refused_stage_is_offered_again_at_the_next_trigger() -> None:
    step = Step(n2h=0.001, spill=frozenset({1}), refuse_stage_once=frozenset({1}))
    step.run()
    stages = [(t, key) for t, kind, key in step.actions if kind == "stage"]
    assert len(stages) == 2 and stages[0][1] == stages[1][1] == 1 and stages[1][0] > stages[0][0]


def test_only_an_offloaded_object_can_be_spilled() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.001)
    rs.register(0, Kind.PARAMETER, 100)
    with pytest.raises(IllegalTransitionError, match="only an offloaded object"):
        rs.spilled(0)


def test_on_demand_mode_offers_no_stage() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.001, prefetch="on_demand")
    rs.forward_began(0.0)
    rs.produced(0, 0.0)
    rs.register(0, Kind.ACTIVATION, 100)
    rs.offload_started(0, DONE)
    rs.landed(0)
    rs.spilled(0)
    assert list(rs.forward_ended(0.001)) == []
    assert list(rs.staged(0)) == [] and not rs.on_nvme(0)


def test_the_log_records_the_nvme_events() -> None:
    step = Step(spill=frozenset({3}))
    rs = step.run(record=True)
    names = [entry[0] for entry in rs.log]
    assert "spilled" in names and "stage_started" in names and "staged" in names
    assert [a for a in rs.actions if a.kind is ActionKind.STAGE] == [Action(ActionKind.STAGE, 3, MiB)]
    plan_inputs = [entry[1] for entry in rs.log if entry[0] == "plan_inputs"]
    assert len(plan_inputs[0]) == 3 and plan_inputs[0][2] == {MiB: step.n2h}  # the stage durations it planned with


def test_a_failed_stage_leaves_the_object_on_nvme_and_is_offered_again() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.001, stage_duration=lambda n: 1.0)
    rs.forward_began(0.0)
    for key in range(2):
        rs.produced(key, 0.001 * key)
        rs.register(key, Kind.ACTIVATION, MiB)
        rs.offload_started(key, DONE)
        rs.landed(key)
    rs.spilled(0)
    first = list(rs.forward_ended(0.002))
    assert [(a.kind, a.key) for a in first][0] == (ActionKind.STAGE, 0)  # a slow link: due at once
    rs.stage_started(0)
    rs.stage_failed(0)
    assert rs.on_nvme(0)
    rs.backward_began(0.003)
    again = list(rs.used(1, 0.003, managed_key=1))
    assert (ActionKind.STAGE, 0) in [(a.kind, a.key) for a in again]
