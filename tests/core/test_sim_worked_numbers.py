"""Worked numbers (docs/planner.md lists them), reproduced exactly by formula and as simulated timelines."""

from __future__ import annotations

import pytest

from offcore.sim import (
    LayerProfile,
    Plan,
    PrefetchPolicy,
    StepProfile,
    activation_bytes,
    adam_state_bytes,
    checkpoint_peak,
    copy_lower_bound,
    copy_window,
    exposed_wait,
    plan_lower_bound,
    prefetch_start,
    simulate,
    transfer_time,
    uniform_profile,
    utilization,
)

MiB = 2**20
GiB = 2**30
REL = 1e-12


def need_at(independent_compute_s: float, copy_bytes: int, h2d_bandwidth: float, prefetch: PrefetchPolicy):
    """Two layers with no forward time: layer1's backward is the independent compute, then
    layer0 (offloaded, D2H free) needs its activation back."""
    profile = StepProfile(
        [
            LayerProfile("needed", 0.0, 0.0, copy_bytes),
            LayerProfile("independent", 0.0, independent_compute_s, 0),
        ],
        d2h_bandwidth="inf",
        h2d_bandwidth=h2d_bandwidth,
    )
    return simulate(profile, Plan(["offload", "keep"], prefetch=prefetch))


def with_triggers(need_s: float, copy_bytes: int, h2d_bandwidth: float, prefetch: PrefetchPolicy, every: float = 1.0):
    """Like :func:`need_at`, but the independent compute is layers of ``every`` seconds, each
    one use (a trigger) of the residency scheduler, the first after half a layer.

    The simulator drives the runtime's scheduler, which starts a copy only at a trigger: the
    last one whose next trigger comes at or after the copy's latest start (offcore.scheduler,
    Note [Prefetch plan: serial link, latest start, horizon]). A real backward uses a saved
    tensor every few kernels; these layers make the triggers as dense as that.
    """
    count = round(need_s / every)
    layers = [LayerProfile("needed", 0.0, 0.0, copy_bytes), LayerProfile("first", 0.0, every / 2, 0)]
    layers += [LayerProfile(f"independent{i}", 0.0, every, 0) for i in range(count - 1)]
    layers.append(LayerProfile("last", 0.0, every / 2, 0))
    profile = StepProfile(layers, d2h_bandwidth="inf", h2d_bandwidth=h2d_bandwidth)
    return simulate(profile, Plan(["offload"] + ["keep"] * (len(layers) - 1), prefetch=prefetch))


def h2d_event(result):
    (event,) = [e for e in result.events if e.stream == "h2d"]
    return event


# --- 256 MiB at 32 GiB/s ----------------------------------------------------------------------


def test_256mib_at_32gibps_takes_7_8125_ms():
    assert transfer_time(256 * MiB, 32 * GiB) == 0.0078125  # exact: 2^28 / 2^35


def test_3ms_of_independent_compute_leaves_4_8125_ms_wait_formula():
    assert exposed_wait(need_at=3e-3, copy_time=transfer_time(256 * MiB, 32 * GiB), lead=3e-3) == pytest.approx(
        4.8125e-3, rel=REL
    )


def test_3ms_of_independent_compute_leaves_4_8125_ms_wait_simulated():
    result = need_at(3e-3, 256 * MiB, 32 * GiB, PrefetchPolicy("deadline"))
    copy = h2d_event(result)
    assert copy.start == 0.0
    assert copy.duration == pytest.approx(7.8125e-3, rel=REL)
    assert result.exposed_wait_s == pytest.approx(4.8125e-3, rel=REL)
    assert result.wait_by_layer == {"needed": pytest.approx(4.8125e-3, rel=REL)}
    assert result.step_time_s == pytest.approx(7.8125e-3, rel=REL)


# --- D = 12, H = 8 ----------------------------------------------------------------------------


@pytest.mark.parametrize(("lead", "start", "done", "wait"), [(3.0, 9.0, 17.0, 5.0), (10.0, 2.0, 10.0, 0.0)])
def test_need_at_12_copy_8_formula(lead, start, done, wait):
    assert copy_window(need_at=12.0, copy_time=8.0, lead=lead) == (start, done, wait)


@pytest.mark.parametrize(("lead", "start"), [(3.0, 8.5), (10.0, 1.5)])
def test_need_at_12_copy_8_simulated(lead, start):
    # 8 bytes at 1 B/s: an 8 s copy; the unit does not matter, the arithmetic does. The copy
    # wanted at 12 - lead starts at the trigger before (triggers at 0.5, 1.5, ...), so the
    # simulated window is the formula's for the lead that trigger gives.
    result = with_triggers(12.0, 8, 1.0, PrefetchPolicy("lead", lead_s=lead))
    copy = h2d_event(result)
    window = copy_window(need_at=12.0, copy_time=8.0, lead=12.0 - start)
    assert 12.0 - lead - 1.0 < start <= 12.0 - lead
    assert (copy.start, copy.end) == (pytest.approx(window.start, rel=REL), pytest.approx(window.done, rel=REL))
    assert result.exposed_wait_s == pytest.approx(window.wait, abs=1e-12)
    assert result.step_time_s == pytest.approx(12.0 + window.wait, rel=REL)


def test_copy_16_with_at_most_12_lead_waits_4():
    assert exposed_wait(need_at=12.0, copy_time=16.0, lead=12.0) == 4.0
    result = need_at(12.0, 16, 1.0, PrefetchPolicy("lead", lead_s=12.0))
    assert h2d_event(result).start == pytest.approx(0.0, abs=1e-12)
    assert result.exposed_wait_s == pytest.approx(4.0, rel=REL)


# --- capacity and bandwidth together ---------------------------------------------------------


def test_1e8_parameters_fp32_adam_two_moments_is_800_mb():
    assert adam_state_bytes(1e8) == 800_000_000
    assert adam_state_bytes(10**8, dtype_bytes=4, moments=2) == 800 * 1000**2


def test_ten_256mib_activations_over_a_shared_32gibps_link_take_at_least_156_25_ms():
    total = 10 * 256 * MiB
    assert total == 2.5 * GiB
    assert 2 * total == 5 * GiB
    assert copy_lower_bound(total, total, 32 * GiB, duplex=False) == pytest.approx(0.15625, rel=REL)
    profile = uniform_profile(
        10,
        forward_s=0.0,
        backward_s=0.0,
        saved_bytes=256 * MiB,
        d2h_bandwidth="32GiB/s",
        h2d_bandwidth="32GiB/s",
        duplex=False,
    )
    offload_all = Plan.uniform(10, "offload")
    assert plan_lower_bound(profile, offload_all) == pytest.approx(0.15625, rel=REL)
    result = simulate(profile, offload_all)
    assert result.step_time_s == pytest.approx(0.15625, rel=REL)  # the bound is met: nothing to overlap with
    assert result.d2h_bytes + result.h2d_bytes == 5 * GiB
    assert result.d2h_busy_s + result.h2d_busy_s == pytest.approx(0.15625, rel=REL)
    # serialised: no D2H overlaps an H2D on the one link
    copies = sorted((e for e in result.events if e.stream in ("d2h", "h2d")), key=lambda e: e.start)
    assert all(a.end <= b.start + 1e-15 for a, b in zip(copies, copies[1:], strict=False))


# --- prefetch start, utilisation --------------------------------------------------------------


def test_t_prefetch_is_10_minus_5_minus_0():
    from offcore.scheduler import PrefetchPlan

    assert prefetch_start(t_need=10.0, nbytes=5.0, bandwidth=1.0, margin=0.0) == 5.0
    # the scheduler's plan (what the runtime and the simulator run) gives one copy that start
    plan = PrefetchPlan({0: 10.0}, {0: 5}, lambda n: transfer_time(n, 1.0), margin=0.0)
    assert plan.latest_start[0] == prefetch_start(t_need=10.0, nbytes=5, bandwidth=1.0, margin=0.0)
    result = with_triggers(10.0, 5, 1.0, PrefetchPolicy("deadline", margin_s=0.0))
    assert h2d_event(result).start == pytest.approx(4.5, rel=REL)  # the last trigger before 5
    assert result.exposed_wait_s == pytest.approx(0.0, abs=1e-12)


def test_utilization_is_60_percent_when_transfer_is_40_percent():
    assert utilization(t_compute=0.6, t_transfer=0.4) == pytest.approx(0.6, rel=REL)
    # 6 s of compute, a 10 s copy that can start at 0: 4 s exposed
    result = need_at(6.0, 10, 1.0, PrefetchPolicy("deadline"))
    assert result.compute_s == 6.0
    assert result.exposed_wait_s == pytest.approx(4.0, rel=REL)
    assert result.utilization == pytest.approx(0.6, rel=REL)


# --- memory formulas --------------------------------------------------------------------------


@pytest.mark.parametrize(("b", "l_", "s", "h"), [(1, 1, 1, 1), (8, 32, 4096, 4096), (2, 3, 5, 7)])
def test_m_act_is_b_l_s_h_times_2(b, l_, s, h):
    assert activation_bytes(b, l_, s, h) == b * l_ * s * h * 2
    assert activation_bytes(b, l_, s, h, dtype_bytes=4) == b * l_ * s * h * 4


@pytest.mark.parametrize("interval", [1, 2, 3, 4, 6])
def test_m_peak_is_m_param_plus_k_a_layer_and_the_simulator_agrees(interval):
    # Per-layer activation A_layer = B·S·H·2 (seed 001); checkpoints neglected (input_bytes = 0).
    a_layer = activation_bytes(2, 1, 128, 64)
    param = 10_000_000
    assert checkpoint_peak(param, interval, a_layer) == param + interval * a_layer
    profile = uniform_profile(12, forward_s=1e-3, backward_s=2e-3, saved_bytes=a_layer, param_bytes=param)
    result = simulate(profile, Plan.uniform(12, "recompute", checkpoint_interval=interval))
    assert result.peak_bytes == checkpoint_peak(param, interval, a_layer)
    # keep-all for comparison: every layer's activations at once
    assert simulate(profile, Plan.keep_all(12)).peak_bytes == param + 12 * a_layer
