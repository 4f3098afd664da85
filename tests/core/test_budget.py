"""DeviceBudget: one budget of bytes copied ahead of use, shared across owners and kinds."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offcore.budget import DeviceBudget
from offcore.errors import ConfigurationError
from offcore.kinds import Kind

KINDS = list(Kind)


class Owner:
    """A scheduler stand-in: remembers what it holds and what the budget evicted."""

    def __init__(self, budget: DeviceBudget) -> None:
        self.held: dict[int, tuple[int, float]] = {}
        self.evicted: list[int] = []
        budget.attach(self, self.evict)

    def evict(self, key: int) -> None:
        self.evicted.append(key)
        del self.held[key]


def test_admit_release_and_stats_per_kind() -> None:
    budget = DeviceBudget(100)
    a = Owner(budget)
    assert budget.admit(a, Kind.PARAMETER, 1, 40, next_use=1.0)
    assert budget.admit(a, Kind.ACTIVATION, 2, 60, next_use=2.0)
    assert budget.admit(a, Kind.ACTIVATION, 2, 60, next_use=2.0)  # already reserved: nothing more
    assert budget.used_bytes == 100 and budget.free_bytes == 0
    stats = budget.stats()
    assert stats.by_kind["parameter"]["bytes"] == 40 and stats.by_kind["activation"]["bytes"] == 60
    budget.release(a, 1)
    assert budget.used_bytes == 60 and budget.peak_bytes == 100
    budget.release_owner(a)
    assert budget.used_bytes == 0
    assert budget.stats().by_kind["activation"]["peak_bytes"] == 60


def test_victims_are_furthest_next_use_across_owners() -> None:
    budget = DeviceBudget(100)
    params, acts = Owner(budget), Owner(budget)
    for key, t in ((1, 5.0), (2, 9.0)):
        assert budget.admit(params, Kind.PARAMETER, key, 30, next_use=t)
        params.held[key] = (30, t)
    assert budget.admit(acts, Kind.ACTIVATION, 1, 30, next_use=7.0)
    acts.held[1] = (30, 7.0)
    # needed at 6.0: the furthest (params' key 2 at 9.0) goes, then the activation at 7.0
    assert budget.admit(acts, Kind.ACTIVATION, 2, 40, next_use=6.0)
    assert params.evicted == [2] and acts.evicted == []
    assert budget.admit(acts, Kind.ACTIVATION, 3, 30, next_use=6.5)
    assert acts.evicted == [1]
    assert budget.stats().by_kind["parameter"]["evicted"] == 1


def test_refused_when_only_earlier_uses_hold_the_room() -> None:
    budget = DeviceBudget(50)
    a = Owner(budget)
    assert budget.admit(a, Kind.PARAMETER, 1, 50, next_use=1.0)
    assert not budget.admit(a, Kind.PARAMETER, 2, 10, next_use=2.0)  # needed later than what is held
    assert a.evicted == [] and budget.used_bytes == 50
    assert budget.stats().by_kind["parameter"]["refused"] == 1


def test_detach_gives_everything_back() -> None:
    budget = DeviceBudget(100)
    a = Owner(budget)
    budget.admit(a, Kind.GRADIENT, 1, 70)
    budget.detach(a)
    assert budget.used_bytes == 0
    b = Owner(budget)
    assert budget.admit(b, Kind.OPTIMIZER_STATE, 1, 100)


def test_error_names_the_smallest_budget_that_can_work() -> None:
    budget = DeviceBudget(1000)
    owner = object()  # owners are held weakly: keep this one alive for the check below
    budget.attach(owner, lambda key: None, minimum=800, what="the largest module's parameters")
    with pytest.raises(ConfigurationError, match=r"smallest budget that can work is .*\(4096 bytes\)"):
        budget.attach(object(), lambda key: None, minimum=4096, what="the largest activation")
    assert budget.smallest_working() == 800  # the owner that could not work was not attached
    with pytest.raises(ConfigurationError, match="non-negative"):
        DeviceBudget(-1)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(0, 200),
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),  # owner
            st.sampled_from(["admit", "release", "release_owner"]),
            st.integers(0, 6),  # key
            st.integers(1, 80),  # bytes
            st.floats(0, 10, allow_nan=False),  # next use
            st.sampled_from(KINDS),
        ),
        max_size=60,
    ),
)
def test_never_over_budget_and_victims_are_furthest(capacity: int, ops: list[tuple]) -> None:
    budget = DeviceBudget(capacity)
    owners = [Owner(budget) for _ in range(3)]
    for o, op, key, nbytes, t, kind in ops:
        owner = owners[o]
        if op == "admit":
            if key in owner.held:
                continue
            before = {(i, k): v for i, ow in enumerate(owners) for k, v in ow.held.items()}
            ok = budget.admit(owner, kind, key, nbytes, next_use=t)
            after = {(i, k) for i, ow in enumerate(owners) for k in ow.held}
            gone = {k: before[k] for k in before if k not in after}
            if ok:
                owner.held[key] = (nbytes, t)
                kept = [v for k, v in before.items() if k not in gone]
                for _, (_, t_gone) in gone.items():
                    assert t_gone > t  # only copies needed after the request
                    # Belady: nothing kept is needed later than a victim
                    assert all(t_kept <= t_gone for _, t_kept in kept if t_kept > t)
            else:
                assert not gone
                assert sum(b for b, _ in before.values()) + nbytes > capacity
        elif op == "release":
            budget.release(owner, key)
            owner.held.pop(key, None)
        else:
            budget.release_owner(owner)
            owner.held.clear()
        assert budget.used_bytes == sum(b for ow in owners for b, _ in ow.held.values())
        assert budget.used_bytes <= capacity
        assert budget.used_bytes == sum(v["bytes"] for v in budget.stats().by_kind.values())
    assert math.isfinite(budget.peak_bytes)


# ------------------------------------------------------------------ wired into ResidencyScheduler
class _Done:
    def query(self) -> bool:
        return True


def _scheduler(budget: DeviceBudget) -> Any:
    from offcore.residency import ResidencyScheduler
    from offcore.scheduler import Scheduler

    return ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 1.0, budget=1 << 40, shared_budget=budget)


def _forward(rs: Any, sizes: list[int], t0: float, kind: Kind) -> list[Any]:
    from offcore.residency import ActionKind

    rs.forward_began(t0)
    for key, nbytes in enumerate(sizes):
        rs.produced(key, t0 + 0.001 * key)
        rs.register(key, kind, nbytes)
        rs.offload_started(key, _Done())
        assert rs.landed(key).kind is ActionKind.FREE
    out = []
    for action in rs.forward_ended(t0 + 0.001 * len(sizes)):
        out.append((action.kind.value, action.key))
        if action.kind is ActionKind.PREFETCH:
            rs.started(action.key, _Done())
    return out


def test_two_schedulers_share_one_budget() -> None:
    """Each scheduler's own budget is unbounded; the shared one (3 objects) bounds both together, and
    the copy needed furthest in the future (the other owner's) is evicted for one needed sooner."""
    budget = DeviceBudget(300)
    params, acts = _scheduler(budget), _scheduler(budget)
    assert _forward(params, [100] * 3, 0.0, Kind.PARAMETER) == [("prefetch", 2), ("prefetch", 1), ("prefetch", 0)]
    assert budget.used_bytes == 300 and budget.stats().by_kind["parameter"]["bytes"] == 300
    # the activations' round comes much sooner than the parameters' later uses: it takes their room
    params._t_backward, params.in_backward = 100.0, True  # the parameters' backward is far away
    got = _forward(acts, [100] * 2, 0.0, Kind.ACTIVATION)
    assert got == [("prefetch", 1), ("prefetch", 0)]
    assert budget.used_bytes == 300
    assert params.counters["evicted_shared"] == 2 and budget.stats().by_kind["parameter"]["evicted"] == 2
    # the parameters' binding gets the EVICTs at its next trigger
    from offcore.residency import ActionKind

    params.backward_began(100.0)
    actions = list(params.used(2, 100.0, managed_key=2))
    assert [a.kind for a in actions[:2]] == [ActionKind.EVICT, ActionKind.EVICT]
    params.detach_budget()
    acts.detach_budget()
    assert budget.used_bytes == 0
