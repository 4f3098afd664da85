"""The simulator runs the runtime's ResidencyScheduler (Note [The simulator drives the runtime's scheduler]).

A simulated offload step feeds a ResidencyScheduler the events a binding would and
executes its actions; its log replays to the same actions, events at one instant free
before they allocate, and saved tensors one by one (``LayerProfile.saved_tensors``) are
copied out when they are saved.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from offcore import ConfigurationError  # noqa: E402
from offcore.residency import ResidencyScheduler  # noqa: E402
from offcore.sim import LayerProfile, Plan, PrefetchPolicy, StepProfile, plan_lower_bound, simulate  # noqa: E402
from offcore.sim.replay import replay  # noqa: E402

# the events offcore_torch's OffloadHandle feeds its scheduler in a step that offloads, prefetches and reuses
BINDING_EVENTS = {
    "forward_began",
    "produced",
    "register",
    "offload_started",
    "landed",
    "forward_ended",
    "plan_inputs",
    "next",
    "started",
    "backward_began",
    "used",
    "awaited",
    "consumed",
    "released",
    "backward_ended",
}


def layered(n: int = 4, *, saved: int = 8, d2h: float = 4.0, h2d: float = 4.0, **step: object) -> StepProfile:
    layers = [
        LayerProfile(f"l{i}", 1.0, 2.0, saved, saved_tensors=[(0.25, saved // 4), (0.5, saved // 4), (1.0, saved // 2)])
        for i in range(n)
    ]
    return StepProfile(layers, d2h_bandwidth=d2h, h2d_bandwidth=h2d, **step)  # type: ignore[arg-type]


def test_a_simulated_offload_step_runs_a_residency_scheduler_and_replays_to_its_actions():
    result = simulate(layered(), Plan(["offload", "offload", "keep", "keep"]), record_schedule=True)
    names = [name for name, _, _ in result.schedule_log]
    assert BINDING_EVENTS <= set(names)
    assert all(callable(getattr(ResidencyScheduler, name, None)) for name in set(names) - {"next", "plan_inputs"})
    # every offloaded save is registered and copied out when forward saves it, in save order
    registered = [args[0] for name, args, _ in result.schedule_log if name == "register"]
    assert registered == [0, 1, 2, 3, 4, 5]
    kinds = [a.kind.value for a in result.schedule_actions]
    assert "prefetch" in kinds and kinds.count("free") >= 1
    # a new scheduler fed the same log decides the same: the simulation is the scheduler's decision
    assert replay(list(result.schedule_log), prefetch="deadline", budget=1 << 62, margin=0.0) == list(
        result.schedule_actions
    )
    assert simulate(layered(), Plan.keep_all(4), record_schedule=True).schedule_actions == ()


def test_each_save_is_copied_out_when_it_is_saved():
    # l0 saves 2 B at 0.25, 2 B at 0.5 and 4 B at its end (1 s forward), at 4 B/s
    result = simulate(layered(), Plan(["offload", "keep", "keep", "keep"]))
    d2h = sorted((e.start, e.end) for e in result.events if e.stream == "d2h")
    assert d2h == [(0.25, 0.75), (0.75, 1.25), (1.25, 2.25)]
    # each is allocated from the previous save on and freed when its copy landed
    assert result.memory_at(0.1) == 2 and result.memory_at(0.3) == 4 and result.memory_at(0.8) == 6
    # at 2.1: l0's last save (in flight), l1's 8 B (kept), l2's first save; l0's last lands at 2.25
    assert result.memory_at(2.1) == 4 + 8 + 2 and result.memory_at(2.25) == 8 + 2 + 2


def test_backward_uses_a_layers_saves_one_by_one_and_frees_them_at_its_end():
    # l0's saves (2 B at a quarter of its forward, 2 B at a half, 4 B at its end) are used 1.5, 1 and
    # 0 s into its 2 s backward (reverse save order): each use is a trigger, so the reload of the
    # first save starts later than the others. Note [A layer's saves are freed when its backward
    # ends]: working_bytes is measured net of what autograd frees during the backward.
    result = simulate(layered(), Plan(["offload", "keep", "keep", "keep"]))
    uses = [
        args[1]
        for name, args, _ in simulate(layered(), Plan.keep_all(4), record_schedule=True).schedule_log
        if name == "used"
    ]
    assert uses[-3:] == [10.0, 11.0, 11.5]
    backward = [e for e in result.events if e.name == "backward:l0"]
    assert [(e.start, e.end) for e in backward] == [(10.0, 11.0), (11.0, 11.5), (11.5, 12.0)]
    reloads = sorted((e.start, e.name) for e in result.events if e.stream == "h2d")
    assert reloads == [(8.0, "h2d:l0[2]"), (10.0, "h2d:l0[1]"), (10.5, "h2d:l0[0]")]  # at triggers, in time
    assert result.exposed_wait_s == 0.0
    assert result.memory_at(11.9) == 8 and result.memory_at(12.0) == 0


def test_events_at_one_instant_free_before_they_allocate():
    # l0's reload is issued at l1's use, the instant l2's backward ends and frees its 10 bytes:
    # the reload's buffer replaces them, it does not stack on them
    layers = [LayerProfile("l0", 1.0, 1.0, 10), LayerProfile("l1", 1.0, 1.0, 10), LayerProfile("l2", 1.0, 1.0, 10)]
    profile = StepProfile(layers, d2h_bandwidth=100.0, h2d_bandwidth=1000.0)
    result = simulate(profile, Plan(["offload", "keep", "keep"]))
    (h2d,) = [e for e in result.events if e.stream == "h2d"]
    l2_backward_end = next(e.end for e in result.events if e.name == "backward:l2")
    assert h2d.start == pytest.approx(l2_backward_end)
    assert result.peak_bytes == 20
    assert max(result.memory_bytes) == 20


def test_a_copy_landing_with_a_free_at_the_same_instant_counts_once():
    # infinite D2H: each save lands the instant it is saved; the next layer's allocation comes after
    layers = [LayerProfile(f"l{i}", 1.0, 1.0, 10) for i in range(3)]
    result = simulate(StepProfile(layers, d2h_bandwidth="inf", h2d_bandwidth="inf"), Plan.uniform(3, "offload"))
    assert max(b for t, b in zip(result.memory_times, result.memory_bytes, strict=True) if t < 3.0) == 10


def test_saved_tensors_are_checked_and_survive_json():
    with pytest.raises(ConfigurationError, match="sum to"):
        LayerProfile("l", 1.0, 1.0, 10, saved_tensors=[(0.5, 4)])
    with pytest.raises(ConfigurationError, match=r"\[0, 1\]"):
        LayerProfile("l", 1.0, 1.0, 4, saved_tensors=[(1.5, 4)])
    with pytest.raises(ConfigurationError, match="save order"):
        LayerProfile("l", 1.0, 1.0, 8, saved_tensors=[(0.5, 4), (0.25, 4)])
    with pytest.raises(ConfigurationError, match="head_bytes"):
        StepProfile([LayerProfile("l", 1.0, 1.0, 8)], other_bytes=1, head_bytes=2)
    profile = layered(head_bytes=3, other_bytes=5)
    assert StepProfile.from_json(profile.to_json()) == profile
    half = profile.split_microbatches(1)
    assert half == profile


def test_head_bytes_live_only_around_the_turn():
    profile = StepProfile([LayerProfile("l0", 1.0, 1.0, 4)], other_bytes=10, head_bytes=6)
    result = simulate(profile, Plan.keep_all(1))
    assert result.static_bytes == 4 == profile.resident_bytes
    assert result.peak_bytes == 4 + 4 + 6 and result.memory_at(0.5) == 8 and result.memory_at(1.5) == 8


def test_gradients_appear_with_each_backward():
    layers = [LayerProfile(f"l{i}", 1.0, 1.0, 0, grad_bytes=5) for i in range(2)]
    result = simulate(StepProfile(layers), Plan.keep_all(2))
    assert result.memory_at(2.5) == 5 and result.memory_at(3.5) == 10 and result.memory_bytes[-1] == 0
    accumulating = simulate(StepProfile(layers, grad_bytes=10), Plan.keep_all(2))  # already resident: not twice
    assert accumulating.peak_bytes == 10


fractions = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4).map(sorted)


@st.composite
def detailed_profiles(draw):
    n = draw(st.integers(1, 5))
    layers = []
    for i in range(n):
        shares = draw(fractions)
        sizes = draw(st.lists(st.integers(0, 10**8), min_size=len(shares), max_size=len(shares)))
        layers.append(
            LayerProfile(
                f"l{i}",
                draw(st.floats(0.0, 1e-2)),
                draw(st.floats(0.0, 1e-2)),
                sum(sizes),
                recompute_s=draw(st.floats(0.0, 1e-2)),
                working_bytes=draw(st.integers(0, 10**7)),
                input_bytes=draw(st.integers(0, 10**7)),
                saved_tensors=list(zip(shares, sizes, strict=True)),
            )
        )
    return StepProfile(
        layers,
        d2h_bandwidth=draw(st.floats(1e9, 1e11)),
        h2d_bandwidth=draw(st.floats(1e9, 1e11)),
        duplex=draw(st.booleans()),
        reuse_in_flight=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_per_tensor_steps_keep_the_bound_and_the_keep_all_peak(data):
    profile = data.draw(detailed_profiles())
    n = profile.n_layers
    actions = data.draw(st.lists(st.sampled_from(["keep", "offload", "recompute"]), min_size=n, max_size=n))
    mode = data.draw(st.sampled_from(["deadline", "on_demand"]))
    plan = Plan(actions, prefetch=PrefetchPolicy(mode))
    result = simulate(profile, plan)
    assert result.step_time_s >= plan_lower_bound(profile, plan) * (1 - 1e-9) - 1e-15
    assert result.step_time_s == pytest.approx(result.compute_s + result.exposed_wait_s, rel=1e-9, abs=1e-15)
    assert result.memory_bytes[-1] == profile.resident_bytes
    if "recompute" not in actions and not profile.reuse_in_flight:  # a copy in flight outlives its backward
        assert result.peak_bytes <= simulate(profile, Plan.keep_all(n)).peak_bytes
