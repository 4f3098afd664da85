"""Note [Copies in flight are capped] (offcore/inflight.py): the one rule both bindings and the
simulator apply, and the simulator applying it (Note [The simulator caps forward's copies in flight])."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offcore.errors import ConfigurationError
from offcore.inflight import DEFAULT_MAX_INFLIGHT, copies_to_land, must_wait
from offcore.sim import Plan, SimResult, StepProfile, simulate
from offcore.sim.profile import LayerProfile

MiB = 1 << 20


# -- the rule ---------------------------------------------------------------------------
def test_a_copy_waits_only_while_something_is_in_flight_and_it_would_exceed_the_cap() -> None:
    assert must_wait(held=3 * MiB, nbytes=2 * MiB, cap=4 * MiB)
    assert not must_wait(held=2 * MiB, nbytes=2 * MiB, cap=4 * MiB)  # exactly at the cap: goes
    assert not must_wait(held=0, nbytes=64 * MiB, cap=4 * MiB)  # larger than the cap, nothing in flight: goes
    assert not must_wait(held=1 << 40, nbytes=1 << 40, cap=None)  # no cap
    assert must_wait(held=1, nbytes=0, cap=0)  # cap 0: one copy at a time
    assert DEFAULT_MAX_INFLIGHT == 256 * MiB


@given(
    cap=st.one_of(st.none(), st.integers(0, 64)),
    nbytes=st.integers(0, 64),
    sizes=st.lists(st.integers(1, 32), max_size=8),
)
def test_copies_to_land_is_the_fewest_oldest_copies_after_which_the_copy_fits(
    cap: int | None, nbytes: int, sizes: list[int]
) -> None:
    k = copies_to_land(cap, nbytes, sizes)
    assert 0 <= k <= len(sizes)
    left = sum(sizes[k:])
    assert not must_wait(left, nbytes, cap)  # after those land, it goes
    if k:  # and not one fewer
        assert must_wait(sum(sizes[k - 1 :]), nbytes, cap)
    if cap is not None:  # the bound the bindings document: held <= max(cap, the largest copy)
        assert left + nbytes <= max(cap, nbytes) or left == 0


# -- the simulator ------------------------------------------------------------------------
def _profile(layers: int = 4) -> StepProfile:
    # each layer: 1 ms of forward making two 2 MiB saves (mid-way and at its end), on a 1 GB/s link:
    # forward makes 4 MiB per ms, the link moves ~1 MiB per ms, so copies pile up without a cap
    return StepProfile(
        [
            LayerProfile(f"l{i}", 1e-3, 2e-3, 4 * MiB, working_bytes=0, saved_tensors=[(0.5, 2 * MiB), (1.0, 2 * MiB)])
            for i in range(layers)
        ],
        d2h_bandwidth=1e9,
        h2d_bandwidth=1e9,
    )


def _forward(result: SimResult) -> tuple[float, int]:
    """(when the last forward ended, the highest device level before then)."""
    end = max(e.end for e in result.events if e.kind == "forward")
    peak = max(b for t, b in zip(result.memory_times, result.memory_bytes, strict=True) if t < end)
    return end, peak


@pytest.mark.parametrize("cap", [0, 2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB])
def test_a_simulated_forward_holds_at_most_the_cap_in_flight_and_waits_for_the_rest(cap: int) -> None:
    profile = _profile()
    free = simulate(profile, Plan(["offload"] * 4, max_inflight=None), record_events=True)
    capped = simulate(profile, Plan(["offload"] * 4, max_inflight=cap), record_events=True)
    free_end, free_peak = _forward(free)
    end, peak = _forward(capped)
    # forward's level: the save being made, plus those in flight (at most max(cap, one save))
    assert peak <= 2 * MiB + max(cap, 2 * MiB)
    assert free_peak > peak  # uncapped, the copies piled up beyond it
    # the forward waited for the copies it could not start: its waits are exposed, it ends later
    waits = [e for e in capped.events if e.kind == "wait" and e.end <= end]
    assert waits and end > free_end
    assert capped.exposed_wait_s > 0
    # a wait splits a forward: one compute stream, in order, and each layer still computes its 1 ms
    compute = [e for e in capped.events if e.stream == "compute"]
    for earlier, later in zip(compute, compute[1:], strict=False):
        assert later.start >= earlier.end - 1e-15
    for name in ("l0", "l1", "l2", "l3"):
        pieces = [e for e in capped.events if e.kind == "forward" and e.layer == name]
        assert sum(e.end - e.start for e in pieces) == pytest.approx(1e-3)
    # every save still went (same bytes), each D2H started no earlier than the rule lets it
    assert capped.d2h_bytes == free.d2h_bytes == 16 * MiB
    copies = sorted((e.start, e.end) for e in capped.events if e.kind == "d2h")
    for start, _ in copies:
        flying = [c for c in copies if c[0] < start < c[1]]
        assert len(flying) * 2 * MiB <= max(cap, 0) or not flying  # in flight when it started: within the cap


def test_a_cap_above_what_forward_holds_changes_nothing() -> None:
    profile = _profile()
    free = simulate(profile, Plan(["offload"] * 4, max_inflight=None))
    default = simulate(profile, Plan(["offload"] * 4))  # 256 MiB: never reached here
    assert Plan(["offload"] * 4).max_inflight == DEFAULT_MAX_INFLIGHT
    assert default.step_time_s == free.step_time_s
    assert default.peak_bytes == free.peak_bytes
    assert default.memory_bytes == free.memory_bytes


def test_a_fast_link_never_waits() -> None:
    profile = StepProfile(_profile().layers, d2h_bandwidth=1e12, h2d_bandwidth=1e12)
    free = simulate(profile, Plan(["offload"] * 4, max_inflight=None))
    capped = simulate(profile, Plan(["offload"] * 4, max_inflight=2 * MiB))
    assert capped.step_time_s == pytest.approx(free.step_time_s, rel=1e-9)
    assert capped.exposed_wait_s == pytest.approx(free.exposed_wait_s, abs=1e-12)


def test_kept_and_recomputed_layers_are_not_capped() -> None:
    profile = _profile()
    for actions in (["keep"] * 4, ["recompute"] * 4):
        free = simulate(profile, Plan(actions, max_inflight=None))
        capped = simulate(profile, Plan(actions, max_inflight=0))
        assert capped.step_time_s == free.step_time_s
        assert capped.peak_bytes == free.peak_bytes


# -- the plan's field ----------------------------------------------------------------------
def test_the_plan_reads_writes_and_checks_max_inflight() -> None:
    plan = Plan(["offload"] * 2, max_inflight="4MiB")
    assert plan.max_inflight == 4 * MiB
    assert "max_inflight=4194304" in plan.describe()
    assert Plan.from_json(plan.to_json()) == plan
    uncapped = Plan(["offload"] * 2, max_inflight=None)
    assert Plan.from_json(uncapped.to_json()).max_inflight is None
    default = Plan(["offload"] * 2)
    assert "max_inflight" not in default.to_dict()  # plans written before the field read the same
    assert "max_inflight" not in default.describe()
    for bad in (True, 1.5, -1, "lots"):
        with pytest.raises(ConfigurationError, match="max_inflight"):
            Plan(["offload"], max_inflight=bad)  # type: ignore[arg-type]
