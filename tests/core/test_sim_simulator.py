"""The timeline simulator: lifetimes, streams, prefetch policies, and properties over random plans."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from offcore import ConfigurationError  # noqa: E402
from offcore.inflight import DEFAULT_MAX_INFLIGHT
from offcore.sim import (  # noqa: E402
    LayerProfile,
    Plan,
    PrefetchPolicy,
    StepProfile,
    plan_lower_bound,
    simulate,
    uniform_profile,
)

MB = 10**6


def events_of(result, kind, layer=None):
    return [e for e in result.events if e.kind == kind and (layer is None or e.layer == layer)]


def only(events):
    (event,) = events
    return event


# --- lifetimes ----------------------------------------------------------------------------------


def test_keep_all_runs_forward_then_backward_in_reverse_with_no_wait():
    profile = StepProfile(
        [LayerProfile(f"l{i}", 1.0 + i, 2.0 + i, 10 * (i + 1), working_bytes=3) for i in range(3)], param_bytes=100
    )
    result = simulate(profile, Plan.keep_all(3))
    compute = [e for e in result.events if e.stream == "compute"]
    assert [e.name for e in compute] == [
        "forward:l0",
        "forward:l1",
        "forward:l2",
        "backward:l2",
        "backward:l1",
        "backward:l0",
    ]
    assert result.step_time_s == result.compute_s == 6.0 + 9.0
    assert result.exposed_wait_s == 0.0 and result.utilization == 1.0
    # all activations plus the last layer's working set at the turn from forward to backward
    assert result.peak_bytes == 100 + 10 + 20 + 30 + 3
    assert result.memory_bytes[-1] == 100  # everything freed at the end


def test_offloaded_bytes_are_freed_only_when_their_d2h_completes():
    # 100 MB at 100 MB/s: a 1 s D2H starting when layer0's 0.5 s forward ends
    profile = StepProfile(
        [LayerProfile("l0", 0.5, 1.0, 100 * MB), LayerProfile("l1", 2.0, 1.0, 0)],
        d2h_bandwidth=100 * MB,
        h2d_bandwidth=100 * MB,
    )
    result = simulate(profile, Plan(["offload", "keep"]))
    d2h = only(events_of(result, "d2h"))
    assert (d2h.start, d2h.end) == (0.5, 1.5)
    assert result.memory_at(1.4999) == 100 * MB
    assert result.memory_at(1.5) == 0
    h2d = only(events_of(result, "h2d"))
    backward = only(events_of(result, "backward", "l0"))
    assert h2d.start >= d2h.end and backward.start >= h2d.end
    # the H2D lands exactly when layer0's backward would start (deadline prefetch, no margin)
    assert h2d.end == pytest.approx(backward.start) and result.exposed_wait_s == 0.0
    assert result.memory_at(h2d.start) == 100 * MB


def test_backward_uses_a_device_copy_whose_d2h_has_not_landed_in_place():
    """Note [Reuse of device copies still in flight] (mirrors Note [When may a device copy be freed?]).

    l0's D2H takes 10 s, far beyond the rest of the step. Its device copy cannot be freed
    before that copy lands, so when backward reaches l0 at t = 1 the bytes are still on
    the device: the runtime (``reuse_in_flight=True``, as offcore_torch) reads them in
    place, with no reload and no wait for a reload. The step still ends only when the
    D2H has landed (the device is synchronised), so the rest of the copy is charged to l0
    as a wait, and the device bytes, the copy's source, are freed then. A runtime that always reloads (the default model) waits for the D2H, then
    for the H2D.
    """
    layers = [LayerProfile("l0", 0.0, 1.0, 10), LayerProfile("l1", 0.0, 1.0, 0)]
    strict = StepProfile(layers, d2h_bandwidth=1.0, h2d_bandwidth=10.0)
    result = simulate(strict, Plan(["offload", "keep"]))
    assert only(events_of(result, "h2d")).start == only(events_of(result, "d2h")).end == 10.0
    assert result.step_time_s == 12.0
    assert result.wait_by_layer == {"l0": pytest.approx(10.0)}
    assert result.reused_bytes == 0 and result.h2d_bytes == 10

    reusing = simulate(strict.with_link(reuse_in_flight=True), Plan(["offload", "keep"]))
    assert events_of(reusing, "h2d") == []
    assert reusing.h2d_bytes == 0 and reusing.reused_bytes == 10 and reusing.d2h_bytes == 10
    backward = only(events_of(reusing, "backward", "l0"))
    assert (backward.start, backward.end) == (1.0, 2.0)  # no wait before it: the device copy is used
    assert reusing.memory_at(5.0) == 10  # backward ended, but the copy's source lives until it lands
    assert reusing.memory_at(10.0) == 0
    assert reusing.step_time_s == 10.0 and reusing.wait_by_layer == {"l0": pytest.approx(8.0)}  # the D2H drains


def test_a_d2h_landing_before_forward_ends_is_reloaded_even_with_reuse():
    # l0's 1 s D2H lands at 1.5, before forward ends at 2.5: it is released and reloaded by deadline
    profile = StepProfile(
        [LayerProfile("l0", 0.5, 1.0, 100 * MB), LayerProfile("l1", 2.0, 1.0, 0)],
        d2h_bandwidth=100 * MB,
        h2d_bandwidth=100 * MB,
        reuse_in_flight=True,
    )
    result = simulate(profile, Plan(["offload", "keep"]))
    assert result.reused_bytes == 0
    assert only(events_of(result, "h2d")).start == pytest.approx(2.5)
    assert result.memory_at(2.0) == 0


def test_a_d2h_landing_after_forward_when_its_reload_is_due_keeps_the_device_copy():
    # the last layer's D2H (2 s) lands at 4 during l2's 3 s backward; deadline wants l1 back at 5 - 2 = 3 < 4
    profile = StepProfile(
        [LayerProfile("l0", 1.0, 1.0, 0), LayerProfile("l1", 1.0, 1.0, 2), LayerProfile("l2", 0.0, 3.0, 0)],
        d2h_bandwidth=1.0,
        h2d_bandwidth=1.0,
        reuse_in_flight=True,
    )
    result = simulate(profile, Plan(["keep", "offload", "keep"]))
    assert only(events_of(result, "d2h")).end == 4.0
    assert events_of(result, "h2d") == [] and result.reused_bytes == 2
    assert result.exposed_wait_s == 0.0 and result.step_time_s == 7.0
    # the scheduler's rule (offcore.residency: landed): hold only when the plan would start the
    # reload before the next trigger. With another layer's use in between (l3 runs first, l2's
    # use at 5 is the next trigger), the copy landing at 4 is freed and reloaded at that trigger.
    layers = [*profile.layers, LayerProfile("l3", 0.0, 3.0, 0)]
    relaxed = simulate(
        StepProfile(layers, d2h_bandwidth=1.0, h2d_bandwidth=1.0, reuse_in_flight=True),
        Plan(["keep", "offload", "keep", "keep"]),
    )
    assert relaxed.reused_bytes == 0 and only(events_of(relaxed, "h2d")).start == pytest.approx(5.0)
    assert relaxed.memory_at(4.5) == 0 and relaxed.exposed_wait_s == 0.0


def test_a_held_copy_taken_over_at_its_use_leaves_the_budget_for_the_next_reload():
    """Note [A reused copy leaves the budget at its use] (offcore/residency.py).

    A draw of test_reusing_copies_in_flight_never_slows_a_step_nor_breaks_its_bound: l2's D2H lands
    during l3's backward and, with reuse, is held (1 byte, the whole budget); strict, it is freed and
    reloaded on demand at its use (1 ns). At l2's use backward takes the reused copy over, so the offer
    of that trigger starts l1's reload (2 bytes, alone in the budget) under l2's backward. It used to see
    the reused copy still in the budget: l1 was reloaded on demand (2 ns), and reusing made the step
    slower than reloading.
    """
    backward = 0.0078125
    layers = [
        LayerProfile("l0", 0.0, 0.0, 0),
        LayerProfile("l1", 0.0, 0.0, 2),
        LayerProfile("l2", 0.0, backward, 1),
        LayerProfile("l3", 0.0, backward, 0),
    ]
    strict = StepProfile(layers, d2h_bandwidth=1e9, h2d_bandwidth=1e9, duplex=False)
    plan = Plan(["keep", "offload", "offload", "keep"], prefetch=PrefetchPolicy("deadline", budget_bytes=1))
    reloading = simulate(strict, plan)
    reusing = simulate(strict.with_link(reuse_in_flight=True), plan)
    assert reusing.reused_bytes == 1 and reloading.reused_bytes == 0
    l2_backward = only(events_of(reusing, "backward", "l2"))
    l1_reload = only(events_of(reusing, "h2d", "l1"))
    assert l1_reload.start == l2_backward.start and l1_reload.end <= l2_backward.end  # hidden under l2
    assert reusing.wait_by_layer == {}
    assert reusing.step_time_s == 2 * backward
    assert reusing.step_time_s <= reloading.step_time_s


def _started_at_use(log, key):
    """The prefetches the offer of backward's use of ``key`` started (up to the next use or on-demand reload)."""
    names = [(entry[0], entry[1][0]) for entry in log if entry[0] in ("used", "started", "reloaded")]
    after = names[names.index(("used", key)) + 1 :]
    end = next((n for n, (name, _) in enumerate(after) if name != "started"), len(after))
    return [started for _, started in after[:end]]


def _reloaded_on_demand(log):
    return [entry[1][0] for entry in log if entry[0] == "reloaded"]


@pytest.mark.parametrize("unit", [1, 10**6], ids=["the-draw", "in-megabytes"])
def test_under_a_binding_budget_a_prefetched_copy_holds_its_room_at_its_use_where_a_reload_does_not(unit):
    """Note [Reuse under a binding prefetch budget] (offcore/sim/simulator.py).

    A draw of test_reusing_copies_in_flight_never_slows_a_step_nor_breaks_its_bound (``unit=1``; 1 byte
    is 1 ns on the link), and the same draw in megabytes: the difference is not rounding, it is l0's
    reload. The budget is one l1. Reloading, l2 is prefetched at l3's use (the trigger before its own)
    and is outstanding at its use, so l1 is reloaded on demand at its own use -- outside the budget, so
    that use's offer starts l0 (3 units, the first copy while nothing is outstanding) under l1's
    backward: l2 and l1 wait 1 unit each. Reusing, l2 is held and leaves the budget at its use (Note [A
    reused copy leaves the budget at its use]): that offer prefetches l1 under l2's backward, l1 is then
    outstanding at its use until backward takes it over, no trigger follows before l0's use, and l0 is
    reloaded on demand: 3 units. Without a budget, reusing is the faster one; and a larger budget slows
    the reloading run the same way.
    """
    backward = 0.0078125
    layers = [
        LayerProfile("l0", 0.0, 0.0, 3 * unit),
        LayerProfile("l1", 0.0, backward, unit),
        LayerProfile("l2", 0.0, backward, unit),
        LayerProfile("l3", 0.0, 0.0, 0, recompute_s=backward),
    ]
    strict = StepProfile(layers, d2h_bandwidth=1e9, h2d_bandwidth=1e9, duplex=False)
    copy_s = unit / 1e9

    def run(profile, budget):
        plan = Plan(
            ["offload", "offload", "offload", "recompute"], prefetch=PrefetchPolicy("deadline", budget_bytes=budget)
        )
        return simulate(profile, plan, record_schedule=True)

    reloading = run(strict, unit)
    reusing = run(strict.with_link(reuse_in_flight=True), unit)
    assert reloading.reused_bytes == 0 and reusing.reused_bytes == unit
    # reloading: l1 on demand at its use, l0 prefetched by that use's offer and hidden under l1's backward
    assert _started_at_use(reloading.schedule_log, 2) == [] and _reloaded_on_demand(reloading.schedule_log) == [1]
    assert _started_at_use(reloading.schedule_log, 1) == [0]
    l1_backward = only(events_of(reloading, "backward", "l1"))
    assert only(events_of(reloading, "h2d", "l0")).end <= l1_backward.end
    assert reloading.wait_by_layer == pytest.approx({"l2": copy_s, "l1": copy_s}, abs=1e-15)
    # reusing: l1 prefetched at l2's use, hidden under l2's backward; at l1's use it is outstanding, l0 does
    # not fit beside it, and l0 is reloaded on demand at its own use
    assert _started_at_use(reusing.schedule_log, 2) == [1]
    assert only(events_of(reusing, "h2d", "l1")).end <= only(events_of(reusing, "backward", "l2")).end
    assert _started_at_use(reusing.schedule_log, 1) == [] and _reloaded_on_demand(reusing.schedule_log) == [0]
    assert reusing.wait_by_layer == pytest.approx({"l0": 3 * copy_s}, abs=1e-15)
    assert reusing.step_time_s == pytest.approx(reloading.step_time_s + copy_s, rel=1e-12)
    # the same two runs without a budget: reusing never slows a step (the property's bound)
    assert run(strict.with_link(reuse_in_flight=True), None).step_time_s < run(strict, None).step_time_s
    # nor is it reuse's doing: a budget of two l1 lets the reloading run prefetch l1 too, and l0 waits there
    assert run(strict, 2 * unit).wait_by_layer["l0"] == pytest.approx(3 * copy_s, abs=1e-15)
    assert run(strict, 2 * unit).step_time_s > reloading.step_time_s


def replace_layer(profile, index, layer):
    layers = list(profile.layers)
    layers[index] = layer
    return StepProfile(
        layers,
        d2h_bandwidth=profile.d2h_bandwidth,
        h2d_bandwidth=profile.h2d_bandwidth,
        reuse_in_flight=profile.reuse_in_flight,
    )


def test_offload_overhead_is_charged_to_the_compute_stream_of_offloaded_layers():
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 8, offload_overhead_s=0.5) for i in range(2)]
    profile = StepProfile(layers)  # an unlimited link: only the overhead costs time
    assert simulate(profile, Plan.keep_all(2)).step_time_s == 6.0
    result = simulate(profile, Plan(["offload", "keep"]))
    assert result.step_time_s == 6.5 and result.overhead_s == 0.5 and result.compute_s == 6.5
    forward = only(events_of(result, "forward", "l0"))
    backward = only(events_of(result, "backward", "l0"))
    assert forward.duration == 1.25 and backward.duration == 2.25


def test_on_demand_starts_the_copy_when_backward_reaches_the_layer():
    profile = uniform_profile(3, forward_s=1.0, backward_s=2.0, saved_bytes=4, d2h_bandwidth=4.0, h2d_bandwidth=2.0)
    result = simulate(profile, Plan(["offload", "keep", "keep"], prefetch=PrefetchPolicy("on_demand")))
    h2d = only(events_of(result, "h2d"))
    assert h2d.start == 3.0 + 2 * 2.0  # after the backward of l2 and l1
    assert result.exposed_wait_s == 2.0
    deadline = simulate(profile, Plan(["offload", "keep", "keep"]))
    assert deadline.exposed_wait_s == 0.0
    # latest start 7 - 2 = 5 is l1's use: the scheduler starts it at the trigger before (l2's use at 3)
    assert only(events_of(deadline, "h2d")).start == pytest.approx(3.0)


def test_prefetch_margin_moves_the_copy_earlier():
    # l0's 2 s reload is needed at 13; uses (triggers) at 5, 7, 9, 11: without a margin its latest
    # start 11 is due at the trigger at 9, with 2.5 s of margin (latest start 8.5) at the one at 7
    profile = uniform_profile(5, forward_s=1.0, backward_s=2.0, saved_bytes=4, d2h_bandwidth=4.0, h2d_bandwidth=2.0)
    actions = ["offload", "keep", "keep", "keep", "keep"]
    assert only(events_of(simulate(profile, Plan(actions)), "h2d")).start == pytest.approx(9.0)
    result = simulate(profile, Plan(actions, prefetch=PrefetchPolicy(margin_s=2.5)))
    assert only(events_of(result, "h2d")).start == pytest.approx(7.0)


def test_latency_is_added_to_every_copy():
    profile = uniform_profile(2, forward_s=1.0, backward_s=1.0, saved_bytes=8, d2h_bandwidth=8.0, latency_s="250ms")
    result = simulate(profile, Plan(["offload", "keep"]))
    assert only(events_of(result, "d2h")).duration == pytest.approx(1.25)
    assert only(events_of(result, "h2d")).duration == pytest.approx(0.25)  # infinite H2D bandwidth


def test_prefetch_budget_limits_bytes_reloaded_but_not_yet_consumed():
    # a large margin asks every reload to start as soon as its D2H is done; the budget holds them back
    # (the last layer's D2H is still in flight at the end of forward: backward uses that copy in place)
    profile = uniform_profile(
        6, forward_s=1.0, backward_s=1.0, saved_bytes=10, d2h_bandwidth=100.0, h2d_bandwidth=100.0, reuse_in_flight=True
    )
    unbounded = simulate(profile, Plan.uniform(6, "offload", prefetch=PrefetchPolicy(margin_s=10.0)))
    bounded = simulate(profile, Plan.uniform(6, "offload", prefetch=PrefetchPolicy(margin_s=10.0, budget_bytes=20)))

    def held_peak(result):
        starts = {e.layer: e.start for e in events_of(result, "h2d")}
        ends = {e.layer: e.end for e in events_of(result, "backward")}
        return max(sum(10 for layer in starts if starts[layer] <= t < ends[layer]) for t in starts.values())

    assert held_peak(unbounded) > 20
    assert held_peak(bounded) <= 20
    assert bounded.peak_bytes < unbounded.peak_bytes
    assert bounded.step_time_s == pytest.approx(unbounded.step_time_s)  # here the budget costs no time


def test_a_layer_larger_than_the_prefetch_budget_is_reloaded_alone():
    profile = uniform_profile(
        3, forward_s=1.0, backward_s=1.0, saved_bytes=50, d2h_bandwidth=1e3, h2d_bandwidth=1e3, reuse_in_flight=True
    )
    result = simulate(profile, Plan.uniform(3, "offload", prefetch=PrefetchPolicy(budget_bytes=10)))
    starts = sorted((e.start, e.layer) for e in events_of(result, "h2d"))
    ends = {e.layer: e.end for e in events_of(result, "backward")}
    for (_, layer), (next_start, _) in zip(starts, starts[1:], strict=False):
        assert next_start >= ends[layer]  # the previous one was consumed first


def test_a_shared_link_serialises_the_two_directions():
    layers = [LayerProfile(f"l{i}", 1.0, 1.0, 10) for i in range(4)]
    shared = StepProfile(layers, d2h_bandwidth=5.0, h2d_bandwidth=5.0, duplex=False)
    result = simulate(shared, Plan(["offload", "offload", "offload", "keep"]))
    copies = sorted(events_of(result, "d2h") + events_of(result, "h2d"), key=lambda e: e.start)
    assert len(copies) == 6
    assert all(a.end <= b.start for a, b in zip(copies, copies[1:], strict=False))


def test_recompute_runs_the_segment_before_the_backward_of_its_last_layer():
    profile = StepProfile(
        [LayerProfile(f"l{i}", 1.0, 2.0, 100, recompute_s=0.5, input_bytes=7) for i in range(4)],
        param_bytes=1000,
    )
    result = simulate(profile, Plan(["keep", "recompute", "recompute", "keep"], checkpoint_interval=2))
    names = [e.name for e in result.events if e.stream == "compute"]
    assert names[4:] == [
        "backward:l3",
        "recompute:l1",
        "recompute:l2",
        "backward:l2",
        "backward:l1",
        "backward:l0",
    ]
    assert result.recompute_s == 1.0 and result.step_time_s == 4.0 + 8.0 + 1.0
    assert result.utilization == 1.0
    # forward keeps l0, l3 and the segment's checkpoint; the rerun brings l1 and l2 back
    assert max(b for t, b in zip(result.memory_times, result.memory_bytes, strict=True) if t < 4.0) == 1000 + 200 + 7
    assert result.peak_bytes == 1000 + 100 + 7 + 200


def test_microbatches_repeat_a_smaller_step():
    profile = uniform_profile(2, forward_s=4.0, backward_s=8.0, saved_bytes=400, batch_size=4)
    whole = simulate(profile, Plan.keep_all(2))
    split = simulate(profile, Plan.keep_all(2, microbatches=4), microbatch_overhead_s=0.5)
    assert split.step_time_s == pytest.approx(whole.step_time_s + 3 * 0.5)
    assert split.peak_bytes == whole.peak_bytes // 4
    assert len(events_of(split, "forward")) == 4 * 2
    assert split.compute_s == pytest.approx(split.step_time_s)


def test_oom_is_reported_against_the_profile_capacity():
    profile = uniform_profile(4, forward_s=1.0, backward_s=1.0, saved_bytes=100, capacity_bytes=250)
    assert simulate(profile, Plan.keep_all(4)).oom
    assert not simulate(profile, Plan.uniform(4, "recompute")).oom


def test_results_serialise_and_make_a_chrome_trace():
    profile = uniform_profile(3, forward_s=1e-3, backward_s=2e-3, saved_bytes=10 * MB, d2h_bandwidth="10GB/s")
    result = simulate(profile, Plan(["offload", "recompute", "keep"]))
    trace = json.loads(json.dumps(result.to_chrome_trace()))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in complete} >= {"forward", "backward", "recompute", "d2h", "h2d"}
    assert all(e["dur"] >= 0 for e in complete)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["step_time_s"] == result.step_time_s
    assert Plan.from_dict(data["plan"]) == result.plan


def test_bad_input_is_refused_clearly():
    profile = uniform_profile(3, forward_s=1.0, backward_s=1.0, saved_bytes=1)
    with pytest.raises(ConfigurationError, match="3 layers"):
        simulate(profile, Plan.keep_all(2))
    with pytest.raises(ConfigurationError, match="StepProfile"):
        simulate("profile", Plan.keep_all(3))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not divisible"):
        simulate(profile, Plan.keep_all(3, microbatches=2))


# --- properties over random profiles and plans --------------------------------------------------

times = st.floats(min_value=0.0, max_value=1e-2, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=2 * 10**9)


@st.composite
def profiles(draw, duplex=None):
    n = draw(st.integers(min_value=1, max_value=6))
    layers = [
        LayerProfile(
            f"l{i}",
            draw(times),
            draw(times),
            draw(sizes),
            recompute_s=draw(times),
            working_bytes=draw(st.integers(0, 10**8)),
            input_bytes=draw(st.integers(0, 10**8)),
        )
        for i in range(n)
    ]
    return StepProfile(
        layers,
        param_bytes=draw(st.integers(0, 10**9)),
        d2h_bandwidth=draw(st.floats(1e9, 1e11)),
        h2d_bandwidth=draw(st.floats(1e9, 1e11)),
        latency_s=draw(st.sampled_from([0.0, 1e-5, 1e-4])),
        duplex=draw(st.booleans()) if duplex is None else duplex,
    )


@st.composite
def plans(draw, n, actions=("keep", "offload", "recompute")):
    mode = draw(st.sampled_from(["deadline", "lead", "on_demand"]))
    policy = PrefetchPolicy(
        mode,
        margin_s=draw(st.sampled_from([0.0, 1e-3])) if mode == "deadline" else 0.0,
        lead_s=draw(times) if mode == "lead" else None,
        budget_bytes=draw(st.one_of(st.none(), st.integers(1, 4 * 10**9))),
    )
    return Plan(
        draw(st.lists(st.sampled_from(actions), min_size=n, max_size=n)),
        checkpoint_interval=draw(st.integers(1, 3)),
        prefetch=policy,
        # Note [The simulator caps forward's copies in flight]: the default, none, one at a time, or any cap
        max_inflight=draw(st.one_of(st.just(DEFAULT_MAX_INFLIGHT), st.none(), st.just(0), st.integers(1, 4 * 10**9))),
    )


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(st.data())
def test_step_time_is_never_below_the_lower_bound(data):
    profile = data.draw(profiles())
    plan = data.draw(plans(profile.n_layers))
    result = simulate(profile, plan)
    bound = plan_lower_bound(profile, plan)
    assert result.step_time_s >= bound * (1 - 1e-9) - 1e-15
    assert result.step_time_s == pytest.approx(result.compute_s + result.exposed_wait_s, rel=1e-9, abs=1e-15)
    assert result.memory_bytes[-1] == profile.static_bytes


@PROPERTY
@given(st.data())
def test_every_reload_follows_its_d2h_and_precedes_its_backward(data):
    profile = data.draw(profiles())
    result = simulate(profile, data.draw(plans(profile.n_layers)))
    d2h = {e.layer: e for e in events_of(result, "d2h")}
    for h2d in events_of(result, "h2d"):
        assert h2d.start >= d2h[h2d.layer].end
        assert only(events_of(result, "backward", h2d.layer)).start >= h2d.end
    compute = [e for e in result.events if e.stream == "compute"]
    for earlier, later in zip(compute, compute[1:], strict=False):
        assert later.start >= earlier.end - 1e-15  # one compute stream, in order


@PROPERTY
@given(st.data())
def test_offloading_never_raises_the_peak_above_keep_all(data):
    profile = data.draw(profiles())
    plan = data.draw(plans(profile.n_layers, actions=("keep", "offload")))
    keep_all = simulate(profile, Plan.keep_all(profile.n_layers))
    assert simulate(profile, plan).peak_bytes <= keep_all.peak_bytes


@PROPERTY
@given(st.data())
def test_each_link_runs_one_copy_at_a_time(data):
    # a duplex link: one queue per direction; a shared link: one queue for both. A reload may
    # start while an earlier D2H of the step is in flight (the scheduler skips copies in flight).
    profile = data.draw(profiles())
    result = simulate(profile, data.draw(plans(profile.n_layers)))
    queues = [["d2h"], ["h2d"]] if profile.duplex else [["d2h", "h2d"]]
    for streams in queues:
        copies = sorted((e for e in result.events if e.stream in streams), key=lambda e: (e.start, e.end))
        assert all(a.end <= b.start * (1 + 1e-12) + 1e-15 for a, b in zip(copies, copies[1:], strict=False))


@PROPERTY
@given(st.data())
def test_reusing_copies_in_flight_never_slows_a_step_nor_breaks_its_bound(data):
    profile = data.draw(profiles())
    plan = data.draw(plans(profile.n_layers))
    reusing_profile = profile.with_link(reuse_in_flight=True)
    # Note [Reuse under a binding prefetch budget] (offcore/sim/simulator.py): reusing never slows a step
    # where no budget limits the offers (these profiles set no device capacity); under a budget that binds
    # it may (test_under_a_binding_budget_a_prefetched_copy_holds_its_room_at_its_use_where_a_reload_does_not)
    unbudgeted = dataclasses.replace(plan, prefetch=dataclasses.replace(plan.prefetch, budget_bytes=None))
    slowest = simulate(profile, unbudgeted).step_time_s * (1 + 1e-9) + 1e-15
    assert simulate(reusing_profile, unbudgeted).step_time_s <= slowest
    reusing = simulate(reusing_profile, plan)
    assert reusing.step_time_s >= plan_lower_bound(reusing_profile, plan) * (1 - 1e-9) - 1e-15
    assert reusing.step_time_s == pytest.approx(reusing.compute_s + reusing.exposed_wait_s, rel=1e-9, abs=1e-15)
    assert reusing.memory_bytes[-1] == profile.static_bytes
    assert reusing.h2d_bytes + reusing.reused_bytes == reusing.d2h_bytes
    d2h = {e.layer: e for e in events_of(reusing, "d2h")}
    for h2d in events_of(reusing, "h2d"):
        assert h2d.start >= d2h[h2d.layer].end
        assert only(events_of(reusing, "backward", h2d.layer)).start >= h2d.end


@PROPERTY
@given(st.data())
def test_more_bandwidth_never_increases_the_step_time(data):
    # every queue's order is fixed by the plan, so start times are monotone in copy durations
    profile = data.draw(profiles())
    plan = data.draw(plans(profile.n_layers))
    d2h_factor = data.draw(st.floats(1.0, 8.0))
    h2d_factor = data.draw(st.floats(1.0, 8.0))
    faster = profile.with_link(
        d2h_bandwidth=profile.d2h_bandwidth * d2h_factor, h2d_bandwidth=profile.h2d_bandwidth * h2d_factor
    )
    assume(math.isfinite(faster.d2h_bandwidth) and math.isfinite(faster.h2d_bandwidth))
    assert simulate(faster, plan).step_time_s <= simulate(profile, plan).step_time_s * (1 + 1e-9) + 1e-15


# --- saves made at one instant under the in-flight cap ---------------------------------------------
# Note [Saves at a forward's end that wait behind each other] (offcore/sim/simulator.py)


def test_two_storages_saved_at_a_forwards_end_over_the_cap_stall_that_forward():
    # a 400 MB layer output in two storages under the default 256 MiB cap: the second waits for the first's copy
    mb200 = 200 * 2**20
    layers = [
        LayerProfile("a", 1e-3, 2e-3, 4 * MB),
        LayerProfile("b", 1e-3, 2e-3, 2 * mb200, saved_tensors=((1.0, mb200), (1.0, mb200))),
        LayerProfile("c", 1e-3, 2e-3, 4 * MB),
    ]
    profile = StepProfile(layers, param_bytes=0, d2h_bandwidth=1e9, h2d_bandwidth=1e9)
    result = simulate(profile, Plan(["keep", "offload", "keep"]))  # raised KeyError in backward before
    first, second = sorted(events_of(result, "d2h", "b"), key=lambda e: e.start)
    assert second.start >= first.end  # the cap held: one 200 MiB copy in flight at a time
    # b's forward waited for the first copy to land: a wait from its end to that landing
    assert any(w.start == first.start and w.end == first.end for w in events_of(result, "wait", "b"))
    # the forward's end (and the next layer) came after the second save was made
    assert only(events_of(result, "forward", "c")).start >= second.start
    assert result.memory_bytes[-1] == profile.static_bytes


fractions = st.sampled_from([0.0, 0.25, 0.5, 1.0])


@st.composite
def profiles_with_saves(draw):
    """Layers saving several storages, several at one instant (a layer's end above all)."""
    layers = []
    for i in range(draw(st.integers(1, 4))):
        saves = tuple(sorted(draw(st.lists(st.tuples(fractions, st.integers(1, 10**9)), min_size=1, max_size=4))))
        layers.append(LayerProfile(f"l{i}", draw(times), draw(times), sum(b for _, b in saves), saved_tensors=saves))
    return StepProfile(
        layers,
        param_bytes=draw(st.integers(0, 10**9)),
        d2h_bandwidth=draw(st.floats(1e9, 1e11)),
        h2d_bandwidth=draw(st.floats(1e9, 1e11)),
        duplex=draw(st.booleans()),
    )


@PROPERTY
@given(st.data())
def test_every_save_is_made_before_its_use_whatever_the_cap(data):
    profile = data.draw(profiles_with_saves())
    plan = data.draw(plans(profile.n_layers))
    result = simulate(profile, plan)  # 86 of 1,500 such random steps raised KeyError in backward before
    n_saves = sum(
        len(layer.saved_tensors)
        for layer, action in zip(profile.layers, plan.actions, strict=True)
        if action.value == "offload"
    )
    assert len(events_of(result, "d2h")) == n_saves  # each managed save's copy, once
    assert result.step_time_s >= plan_lower_bound(profile, plan) * (1 - 1e-9) - 1e-15
    assert result.memory_bytes[-1] == profile.static_bytes
