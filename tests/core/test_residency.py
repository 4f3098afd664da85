"""The residency scheduler's rules, one at a time, on hand-made steps (no torch, no device).

Times are arguments, so every decision here is exact: each test builds a step, feeds the
events a binding would, and checks the actions.
"""

from __future__ import annotations

from typing import Any

import pytest

from offcore.errors import ConfigurationError
from offcore.kinds import Kind
from offcore.objects import State
from offcore.residency import Action, ActionKind, ResidencyScheduler, Watermark
from offcore.scheduler import Scheduler
from offcore.sim.replay import replay

MiB = 1 << 20


class Landed:
    def query(self) -> bool:
        return True


DONE = Landed()


def forward(rs: ResidencyScheduler, sizes: list[int], *, land: bool = True) -> None:
    """Forward saves one object per size at 1 ms intervals; each D2H copy is started (and landed)."""
    rs.forward_began(0.0)
    for key, nbytes in enumerate(sizes):
        rs.produced(key, 0.001 * key)
        rs.register(key, Kind.ACTIVATION, nbytes)
        rs.offload_started(key, DONE)
    if land:
        for key in range(len(sizes)):
            assert rs.landed(key).kind is ActionKind.FREE  # nothing planned during forward


def run(offer: Any, rs: ResidencyScheduler, *, refuse: dict[int, str] | None = None) -> list[Action]:
    """Carry out an offer as a binding does: start each prefetch (or refuse it) before taking the next."""
    out = []
    for action in offer:
        out.append(action)
        if action.kind is ActionKind.PREFETCH:
            if refuse and action.key in refuse:
                rs.refused(action.key, refuse[action.key])
            else:
                rs.started(action.key, DONE)
    return out


def kinds(actions: list[Action]) -> list[tuple[str, int]]:
    return [(a.kind.value, a.key) for a in actions]


def test_reloads_start_in_deadline_order_within_the_byte_budget() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=2 * MiB)  # slow: all due at once
    forward(rs, [MiB] * 4)
    # reverse save order; the budget holds two: the first two needed are started
    assert kinds(run(rs.forward_ended(0.004), rs)) == [("prefetch", 3), ("prefetch", 2)]
    assert rs.outstanding == 2 * MiB
    rs.backward_began(1.0)
    assert kinds(run(rs.used(3, 1.0, managed_key=3), rs)) == []  # still full
    rs.consumed(3)  # backward took the first one over: room for one more
    assert kinds(run(rs.used(2, 1.001, managed_key=2), rs)) == [("prefetch", 1)]
    assert rs.peak_outstanding == 2 * MiB


def test_the_first_copy_is_allowed_even_when_the_budget_is_smaller_than_it() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=1024)
    forward(rs, [MiB] * 2)
    assert kinds(run(rs.forward_ended(0.002), rs)) == [("prefetch", 1)]


def test_a_zero_budget_prefetches_nothing() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=0)
    forward(rs, [MiB] * 2)
    assert kinds(run(rs.forward_ended(0.002), rs)) == []


def test_a_just_landed_copy_that_is_due_is_held_instead_of_freed() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.0005, budget=8 * MiB)
    forward(rs, [MiB] * 3, land=False)
    assert kinds(run(rs.forward_ended(0.003), rs)) == []  # every copy is still in flight
    assert rs.landed(0).kind is ActionKind.FREE  # needed last: reloaded later, by deadline
    assert rs.landed(2).kind is ActionKind.HOLD  # needed first, before the next trigger: kept
    assert rs.landed(1, needed=False).kind is ActionKind.FREE  # the binding knows it was used already
    assert rs.outstanding == MiB
    assert rs.consumed(2) is True  # the binding frees offcore's device copy now
    assert rs.outstanding == 0
    held = [a for a in rs.backward_ended(0.01)]
    assert held == []


def test_a_copy_still_landing_keeps_its_place_in_the_budget() -> None:
    """Note [A copy still landing keeps its place in the budget]: the object backward needs first is still
    landing at the end of forward; the offer leaves it its share of the budget, so it is held when it lands
    instead of freed and reloaded synchronously beside later-needed reloads (examples/numpy_mlp.py on a
    loaded host: one object above the peak of the run without offload)."""
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=2 * MiB)  # slow: all due
    forward(rs, [MiB] * 3, land=False)
    for key in (0, 1):  # the earlier saves landed; the last one (needed first) is still in flight
        assert rs.landed(key).kind is ActionKind.FREE
    assert kinds(run(rs.forward_ended(0.003), rs)) == [("prefetch", 1)]  # not 0 as well: 2 keeps its place
    assert rs.counters["prefetch_behind_landing"] == 1
    assert rs.landed(2).kind is ActionKind.HOLD  # within the budget: no synchronous reload at its use
    assert rs.outstanding == 2 * MiB
    rs.backward_began(1.0)
    rs.reused(2)
    rs.consumed(2)
    assert kinds(run(rs.used(2, 1.0, managed_key=2), rs)) == [("prefetch", 0)]  # the rest, as room comes
    assert rs.peak_outstanding == 2 * MiB


def test_held_copies_are_freed_when_backward_ends() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.0005, budget=8 * MiB)
    forward(rs, [MiB] * 2, land=False)
    run(rs.forward_ended(0.002), rs)
    assert rs.landed(1).kind is ActionKind.HOLD
    rs.backward_began(0.003)
    assert kinds(rs.backward_ended(0.004)) == [("free", 1)]
    assert rs.outstanding == 0


def test_no_room_on_the_device_means_not_asked_for_and_asked_again_later() -> None:
    in_use = [900]
    rs = ResidencyScheduler(
        Scheduler(margin=0.0),
        duration=lambda n: 1.0,
        budget=8 * MiB,
        device_capacity=1000,
        device_in_use=lambda: in_use[0],
    )
    forward(rs, [200, 200])
    assert kinds(run(rs.forward_ended(0.002), rs)) == []
    assert rs.counters["prefetch_no_room"] == 1
    in_use[0] = 100
    rs.backward_began(1.0)
    assert kinds(run(rs.used(1, 1.0, managed_key=1), rs)) == [("prefetch", 0)]


def test_one_allocator_refusal_stops_prefetching_for_the_round() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=8 * MiB)
    forward(rs, [MiB] * 3)
    assert kinds(run(rs.forward_ended(0.003), rs, refuse={2: "oom"})) == [("prefetch", 2)]
    rs.backward_began(1.0)
    assert kinds(run(rs.used(2, 1.0), rs)) == []  # the round that follows prefetches no more
    assert rs.counters["prefetch_oom"] == 1
    assert rs.objects[2].state is State.OFFLOADED  # nothing changed: it reloads on demand


def test_a_failed_submission_is_offered_again_at_the_next_trigger() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=8 * MiB)
    forward(rs, [MiB] * 2)
    assert kinds(run(rs.forward_ended(0.002), rs, refuse={1: "failed"})) == [("prefetch", 1)]
    rs.backward_began(1.0)
    assert kinds(run(rs.used(5, 1.0), rs)) == [("prefetch", 1), ("prefetch", 0)]


def _two_held_and_one_freed() -> ResidencyScheduler:
    """Three saves of 1 MiB (0 needed last, 2 first), a 2 MiB budget: 0 and 1 land while 2's copy is in flight and
    are held (due, room for two); 2 lands with no budget left and is freed. Backward has begun."""
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=2 * MiB)
    forward(rs, [MiB] * 3, land=False)
    run(rs.forward_ended(0.003), rs)
    assert rs.landed(0).kind is ActionKind.HOLD
    assert rs.landed(1).kind is ActionKind.HOLD
    assert rs.landed(2).kind is ActionKind.FREE  # no budget left
    rs.backward_began(1.0)
    return rs


def test_belady_evicts_the_held_copy_needed_furthest_away() -> None:
    # 0 is needed last, 2 first. 0 and 1 land while 2's copy is still in flight and are held
    # (due, the budget has room for two); when 2 lands there is no room, and at the next
    # trigger the copy needed furthest away (0) makes room for it.
    rs = _two_held_and_one_freed()
    actions = run(rs.used(9, 1.0), rs)
    assert kinds(actions) == [("evict", 0), ("prefetch", 2)]
    assert rs.counters["evicted"] == 1
    assert rs.outstanding == 2 * MiB


def test_the_copy_being_read_is_never_the_victim() -> None:
    # Note [The copy being read is not a victim]: as above, but the trigger is backward reading 0 itself,
    # which the plan placed last (a step in another order than the one learnt). 0 is still counted (it is
    # taken over after the trigger); making room for 2 must evict 1, not the copy being read.
    rs = _two_held_and_one_freed()
    actions = run(rs.used(0, 1.0, managed_key=0), rs)
    assert kinds(actions) == [("evict", 1), ("prefetch", 2)]
    assert rs.is_outstanding(0)


def test_an_object_still_alive_elsewhere_is_not_reloaded() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=8 * MiB)
    forward(rs, [MiB] * 2)
    rs.device_copy_alive(1)
    assert kinds(run(rs.forward_ended(0.002), rs)) == [("prefetch", 0)]


def test_on_demand_mode_plans_nothing() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, prefetch="on_demand")
    forward(rs, [MiB] * 2)
    assert kinds(run(rs.forward_ended(0.002), rs)) == []
    assert rs.plan is None


def test_the_first_backward_teaches_the_predictor() -> None:
    predictor = Scheduler(margin=0.0)
    rs = ResidencyScheduler(predictor, duration=lambda n: 1.0)
    forward(rs, [MiB] * 2)
    run(rs.forward_ended(0.002), rs)
    rs.backward_began(1.0)
    run(rs.used(1, 1.0, managed_key=1), rs)
    run(rs.used(0, 1.25, managed_key=0), rs)
    rs.backward_ended(1.5)
    assert predictor.steps_observed == 1
    assert predictor.predict(rs.observation) == {0: 0.25, 1: 0.0}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="prefetch must be one of"):
        ResidencyScheduler(Scheduler(), duration=lambda n: 1.0, prefetch="eager")
    with pytest.raises(ConfigurationError, match="budget"):
        ResidencyScheduler(Scheduler(), duration=lambda n: 1.0, budget=-1)
    with pytest.raises(ConfigurationError, match="watermark"):
        Watermark(1.5)


def test_a_replay_decides_again_rather_than_copying_the_recorded_actions() -> None:
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=2 * MiB, record=True)
    forward(rs, [MiB] * 4)
    run(rs.forward_ended(0.004), rs)
    rs.backward_began(1.0)
    for t, key in enumerate((3, 2, 1, 0)):
        run(rs.used(key, 1.0 + 0.001 * t, managed_key=key), rs)
        rs.consumed(key)
    rs.backward_ended(1.01)
    assert replay(rs.log, **rs.settings()) == rs.actions
    smaller = replay(rs.log, **{**rs.settings(), "budget": MiB})
    assert smaller != rs.actions  # a different budget decides differently from the same events


def test_an_evicted_prefetch_in_flight_is_offered_again_once_it_landed() -> None:
    # 1 and 0 are prefetched while 2's D2H copy is still in flight: 2's storage lives on elsewhere (the
    # binding said so), so it keeps no place in the budget (Note [A copy still landing keeps its place in
    # the budget]). Its storage dies and it lands with no budget left: freed; the next trigger evicts 0
    # (needed furthest away) for it. 0's copy is still in flight: it is not offered again until the
    # binding reports it landed, and then it is.
    rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=2 * MiB)
    forward(rs, [MiB] * 3, land=False)
    assert rs.landed(0).kind is ActionKind.FREE and rs.landed(1).kind is ActionKind.FREE  # no plan yet
    rs.device_copy_alive(2)
    assert kinds(run(rs.forward_ended(0.003), rs)) == [("prefetch", 1), ("prefetch", 0)]
    rs.device_copy_died(2)
    assert rs.landed(2).kind is ActionKind.FREE  # the budget is full
    rs.backward_began(1.0)
    assert kinds(run(rs.used(9, 1.0), rs)) == [("evict", 0), ("prefetch", 2)]
    rs.dropped(0)  # the binding drops the evicted copy; it is still in flight
    assert kinds(run(rs.used(10, 1.001), rs)) == []
    rs.drop_landed(0)
    rs.awaited(2)
    rs.consumed(2)  # room again
    assert kinds(run(rs.used(2, 1.002, managed_key=2), rs)) == [("prefetch", 0)]
