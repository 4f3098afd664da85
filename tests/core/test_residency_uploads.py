"""ResidencyScheduler: objects produced on the host and needed on the device (an optimizer's
updated parameters), Note [Objects produced on the host] in offcore/residency.py."""

from __future__ import annotations

import pytest

from offcore.errors import ConfigurationError
from offcore.kinds import Kind
from offcore.objects import State
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler


def _round(predictor: Scheduler, sizes: dict[int, int], *, budget: int, mode: str = "asap") -> ResidencyScheduler:
    rs = ResidencyScheduler(predictor, duration=lambda n: 1e-6 * n, prefetch=mode, budget=budget)
    rs.forward_began(0.0)
    for key, nbytes in sizes.items():
        rs.register(key, Kind.PARAMETER, nbytes)
        rs.awaiting_host(key)
    return rs


def _run(rs: ResidencyScheduler, actions: object) -> list[int]:
    started = []
    for action in actions:  # type: ignore[attr-defined]
        assert action.kind is ActionKind.PREFETCH
        rs.started(action.key, event=None)
        started.append(action.key)
    return started


def test_uploads_follow_the_learned_need_order_within_the_budget() -> None:
    predictor = Scheduler(margin=0.0)
    sizes = {0: 100, 1: 100, 2: 100}
    # round 0: gradients arrived 2, 1, 0 (backward): the default need order is the reverse, 0, 1, 2
    rs = _round(predictor, sizes, budget=1000)
    for t, key in enumerate((2, 1, 0)):
        rs.produced(key, float(t))
    assert rs.upload_order([2, 0, 1]) == [0, 1, 2]
    rs.make_plan()
    assert _run(rs, rs.host_updated(1)) == [1]  # eager: uploaded as soon as its host copy is the data
    assert _run(rs, rs.host_updated(0)) == [0]
    assert rs.objects[2].state is State.RESIDENT  # not produced yet: kept, not retired
    assert _run(rs, rs.host_updated(2)) == [2]
    # the next forward uses 2 first, then 0, then 1: the predictor learns it
    rs.backward_began(10.0)
    for t, key in ((10.0, 2), (10.1, 0), (10.2, 1)):
        rs.awaited(key)
        rs.consumed(key)
        assert list(rs.used(key, t, managed_key=key)) == []
    rs.backward_ended(10.3)
    rs = _round(predictor, sizes, budget=100)
    assert rs.upload_order([0, 1, 2]) == [2, 0, 1]
    rs.make_plan()
    assert _run(rs, rs.host_updated(2)) == [2]  # the budget holds one upload ahead of use
    assert _run(rs, rs.host_updated(0)) == []
    assert _run(rs, rs.host_updated(1)) == []
    rs.backward_began(20.0)
    rs.awaited(2)
    rs.consumed(2)
    assert _run(rs, rs.used(2, 20.0, managed_key=2)) == [0]  # a trigger: the next in need order
    rs.awaited(0)
    rs.consumed(0)
    assert _run(rs, rs.used(0, 20.1, managed_key=0)) == [1]


def test_an_upload_needed_sooner_evicts_one_needed_later() -> None:
    predictor = Scheduler(margin=0.0)
    predictor.observe(_learned({0: 0.2, 1: 0.0}))
    rs = _round(predictor, {0: 100, 1: 100}, budget=100)
    rs.make_plan()
    assert _run(rs, rs.host_updated(0)) == [0]
    actions = list(rs.host_updated(1))  # Belady: 0 is needed after 1
    assert [(a.kind, a.key) for a in actions] == [(ActionKind.EVICT, 0), (ActionKind.PREFETCH, 1)]


def _learned(first_use: dict[int, float]) -> object:
    from offcore.scheduler import StepObservation

    return StepObservation({k: 0.0 for k in first_use}, 1.0, first_use, 1.0)


def test_deadline_mode_and_existing_modes_unchanged() -> None:
    rs = _round(Scheduler(margin=0.0), {0: 10}, budget=100, mode="deadline")
    rs.make_plan()
    assert rs.host_updated(0) is not None
    with pytest.raises(ConfigurationError, match="prefetch must be one of"):
        ResidencyScheduler(Scheduler(), duration=lambda n: 0.0, prefetch="sometimes")


@pytest.mark.parametrize("budget", [1000, 250, 100])
def test_host_updated_all_offers_what_the_calls_one_by_one_offer(budget: int) -> None:
    """One offer for many host steps: the same uploads, in need order, within the same budget."""
    predictor = Scheduler(margin=0.0)
    predictor.observe(_learned({0: 0.3, 1: 0.0, 2: 0.1, 3: 0.2}))
    sizes = {0: 100, 1: 100, 2: 100, 3: 100}
    one = _round(predictor, sizes, budget=budget)
    one.make_plan()
    singly = [key for k in (1, 2, 3, 0) for key in _run(one, one.host_updated(k))]
    together = _round(predictor, sizes, budget=budget)
    together.make_plan()
    at_once = _run(together, together.host_updated_all([1, 2, 3, 0]))
    assert at_once == singly == [1, 2, 3, 0][: max(1, budget // 100)]
    for key in sizes:
        assert together.objects[key].state is one.objects[key].state
    assert list(together.host_updated_all([])) == []


def test_host_updated_all_before_a_plan_offers_nothing() -> None:
    rs = _round(Scheduler(margin=0.0), {0: 10, 1: 10}, budget=100)
    assert rs.objects[0].state is State.RESIDENT
    assert list(rs.host_updated_all([0, 1])) == []
    assert (
        rs.objects[0].state is State.OFFLOADED and rs.objects[1].state is State.OFFLOADED
    )  # the host copy is the data


def _pair(
    predictor: Scheduler, sizes: dict[int, int], budget: int, landing: bool
) -> tuple[ResidencyScheduler, ResidencyScheduler]:
    """Two schedulers in the same state: the ones of ``sizes`` registered, 0 already started (counted),
    1 released (no use reads it), 2 still landing (``landing``: an object offloaded by a device copy)."""
    pair = []
    for _ in range(2):
        rs = _round(predictor, sizes, budget=budget)
        for key in sizes:
            rs.produced(key, 0.0)  # its gradient arrived: the learned need order applies
        rs.make_plan()
        for action in rs.host_updated_all([0]):
            rs.started(action.key, event=None)
        rs.released(1)
        if landing:
            rs._awaiting_host.discard(2)
            rs.objects[2].start_offload(event=None)
        rs.make_plan()
        pair.append(rs)
    return pair[0], pair[1]


@pytest.mark.parametrize("landing", [True, False])
@pytest.mark.parametrize("budget", [10_000, 450, 300, 150, 0])
def test_host_updated_prefetches_is_the_offer_taken_whole(budget: int, landing: bool) -> None:
    """Note [An offer taken whole, answered after]: the keys (and the scheduler's state) of taking
    host_updated_all's whole offer before answering, then answering each; under a tight budget the rest of the
    offer evicts as host_updated_all's does."""
    predictor = Scheduler(margin=0.0)
    predictor.observe(_learned({0: 0.6, 1: 0.0, 2: 0.1, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.5}))
    sizes = dict.fromkeys(range(7), 100)
    one, whole = _pair(predictor, sizes, budget, landing)
    keys = [3, 1, 6, 5, 4] if landing else [3, 2, 1, 6, 5, 4]
    actions = list(one.host_updated_all(keys))
    expected = [a.key for a in actions if a.kind is ActionKind.PREFETCH]
    for key in expected:
        one.started(key, event=None)
    got = whole.host_updated_prefetches(keys)
    whole.started_all(got, [None] * len(got))
    assert got == expected
    if budget == 10_000:  # need order; 1 released, 0 started already, 2 landing (or uploaded first)
        assert got == ([3, 4, 5, 6] if landing else [2, 3, 4, 5, 6])
    assert whole.outstanding == one.outstanding and whole.peak_outstanding == one.peak_outstanding
    assert whole._counted == one._counted and whole.counters == one.counters
    assert whole.plan._done == one.plan._done  # type: ignore[union-attr]
    for key in sizes:
        a, b = whole.objects[key], one.objects[key]
        assert (a.state, a.tier, a.host_tier, a.d2h_event) == (b.state, b.tier, b.host_tier, b.d2h_event), key
    assert whole.host_updated_prefetches([]) == []


def test_host_updated_prefetches_recorded_is_host_updated_all() -> None:
    """Recording, the offer is host_updated_all's, logged as it is (a replay makes the same calls)."""
    predictor = Scheduler(margin=0.0)
    rs = ResidencyScheduler(predictor, duration=lambda n: 1e-6 * n, prefetch="asap", budget=1000, record=True)
    rs.forward_began(0.0)
    for key in range(3):
        rs.register(key, Kind.PARAMETER, 100)
        rs.awaiting_host(key)
    rs.make_plan()
    keys = rs.host_updated_prefetches([2, 0, 1])
    rs.started_all(keys, [None] * len(keys))
    assert sorted(keys) == [0, 1, 2]
    names = [entry[0] for entry in rs.log]
    assert (
        names[names.index("host_updated_all") :]
        == ["host_updated_all", "next", "next", "next", "next"] + ["started"] * 3
    )
