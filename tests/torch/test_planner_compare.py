"""Issue 17 in ``offcore compare``: "planned" is chosen and predicted on the profile every strategy is judged on.

No training here: a :class:`StepMeasurement` shaped like the compare default's profile
(four 2 MiB layers, a PCIe-like link that lags the forward, reuse of copies in flight,
the offload runtime's host cost) goes through the same planning code ``offcore compare``
runs, over a grid of budgets.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from offcore_torch.compare.measurement import StepMeasurement  # noqa: E402
from offcore_torch.compare.settings import CompareSettings  # noqa: E402
from offcore_torch.compare.strategies import plan_strategies, strategy_plans  # noqa: E402

from offcore.sim import Action, LayerProfile, Plan, StepProfile, simulate  # noqa: E402

MiB = 2**20
NAMED = ("baseline", "accumulate", "checkpoint", "offload", "hybrid")


def measurement(*, other_compute_s: float = 6e-3, recompute_factor: float = 1.4) -> StepMeasurement:
    """A measured-like step: 4 layers of ~2 MiB saved, ~1.2 ms forward, 2.2 ms offload host cost per layer."""
    layers = [
        LayerProfile(
            f"blocks.{i}",
            forward,
            2 * forward,
            2_113_536,
            recompute_s=recompute_factor * forward,
            working_bytes=590_080 if i == 0 else 131_072,
            input_bytes=131_072,
            offload_overhead_s=2.2e-3,
        )
        for i, forward in enumerate((1.22e-3, 1.12e-3, 1.09e-3, 1.26e-3))
    ]
    profile = StepProfile(
        layers,
        param_bytes=882_176,
        other_bytes=3_481_304,
        d2h_bandwidth=730e6,
        h2d_bandwidth=516e6,
        batch_size=8,
        reuse_in_flight=True,
    )
    keep_all = simulate(profile, Plan.keep_all(4), record_events=False).peak_bytes
    third = other_compute_s / 3
    return StepMeasurement(
        profile=profile,
        forward_s=5.7e-3,
        backward_s=9.6e-3,
        optimizer_s=third,
        other_forward_s=third,
        other_backward_s=third,
        param_bytes=882_176,
        resident_bytes=2_654_928,
        other_saved_bytes=799_236,
        peak_bytes=keep_all,
        optimizer_peak_bytes=3_669_200,
        calibration_bytes=909_316,
    )


SETTINGS = CompareSettings()
OVERHEAD = 4e-3


def budgets(m: StepMeasurement) -> list[int]:
    """Six shares of the keep-all peak, and each named strategy's own predicted peak (the tightest fit)."""
    grid = [int(f * m.peak_bytes) for f in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)]
    n = m.profile.n_layers
    named = [Plan.keep_all(n, microbatches=k) for k in (2, 4, 8)] + [
        Plan.uniform(n, Action.RECOMPUTE),
        Plan.uniform(n, Action.OFFLOAD),
        Plan([Action.OFFLOAD] * 2 + [Action.RECOMPUTE] * 2),
    ]
    return grid + [m.predicted_peak(m.predict(p, microbatch_overhead_s=OVERHEAD)[0]) for p in named]


@pytest.mark.parametrize(  # ~7 s each: one fast, all in the slow env
    "recompute_factor", [pytest.param(1.0, marks=pytest.mark.slow), 1.4, pytest.param(2.5, marks=pytest.mark.slow)]
)
def test_planned_is_never_predicted_slower_than_a_named_strategy_that_fits(recompute_factor: float) -> None:
    m = measurement(recompute_factor=recompute_factor)
    for budget in budgets(m):
        plans = strategy_plans(SETTINGS, m.profile, m, budget, OVERHEAD)
        planned = plans["planned"][0]
        fitting = {}
        for name in NAMED:
            named = plans[name][0]
            if named is None:
                continue
            result, seconds = m.predict(named, microbatch_overhead_s=OVERHEAD)
            if m.predicted_peak(result) <= budget:
                fitting[name] = seconds
        if planned is None:
            assert not fitting, (budget, fitting)
            continue
        planned_s = m.predict(planned, microbatch_overhead_s=OVERHEAD)[1]
        for name, seconds in fitting.items():
            assert planned_s <= seconds * (1 + 1e-9), (
                budget / MiB,
                name,
                plans[name][0].describe(),
                planned.describe(),
            )


def test_the_figure_shown_for_planned_is_the_planners_own() -> None:
    m = measurement()
    for budget in budgets(m):
        chosen = plan_strategies(SETTINGS, m.profile, m, budget, OVERHEAD)
        planned = chosen["planned"]
        if planned.plan is None:
            continue
        # the planner's own result object, and the figure a fresh call on the same profile gives
        assert planned.predicted.plan == planned.plan
        assert planned.predicted_s == planned.predicted.step_time_s + m.other_compute_s
        assert planned.predicted_s == m.predict(planned.plan, microbatch_overhead_s=OVERHEAD)[1]
        shown = re.search(r"predicted ([0-9.]+) ms", planned.why)
        assert shown is not None and float(shown.group(1)) == round(planned.predicted_s * 1e3, 1)
        # every strategy's figure comes from the same profile and simulator call
        for name in NAMED:
            named = chosen[name]
            if named.plan is not None:
                assert named.predicted_s == m.predict(named.plan, microbatch_overhead_s=OVERHEAD)[1]


def test_accumulation_says_it_is_not_bit_identical_and_respects_a_zero_loss_delta() -> None:
    m = measurement(recompute_factor=3.0)  # recompute expensive: accumulation is the planner's answer
    budget = int(0.6 * m.peak_bytes)
    allowed = plan_strategies(SETTINGS, m.profile, m, budget, 0.0, max_loss_delta=1e-4)["planned"]
    assert allowed.plan is not None and allowed.plan.microbatches > 1
    assert "not bit-identical" in allowed.why and "--max-loss-delta 0.0001" in allowed.why
    assert "fastest bit-identical plan" in allowed.why or "no plan without accumulation fits" in allowed.why
    strict = plan_strategies(SETTINGS, m.profile, m, budget, 0.0, max_loss_delta=0.0)["planned"]
    assert strict.plan is None or strict.plan.microbatches == 1
    assert "accumulation not searched" in strict.why
    if strict.plan is not None:
        assert strict.predicted_s >= allowed.predicted_s


def test_planned_accumulation_is_planned_on_the_profile_the_accumulate_strategy_is_judged_on() -> None:
    """Accumulation keeps earlier micro-batches' gradients and shrinks the head's saved bytes: both sides see that."""
    m = measurement(recompute_factor=3.0)
    for budget in budgets(m):
        chosen = plan_strategies(SETTINGS, m.profile, m, budget, OVERHEAD)
        planned = chosen["planned"]
        if planned.plan is None or planned.plan.microbatches == 1:
            continue
        k = planned.plan.microbatches
        expected = m.profile_for_microbatches(k)
        again = simulate(expected, planned.plan, microbatch_overhead_s=OVERHEAD)
        assert planned.predicted.peak_bytes == again.peak_bytes
        assert planned.predicted.step_time_s == again.step_time_s


def test_a_headroom_applies_to_accumulate_and_planned_alike() -> None:
    m = measurement()
    settings = replace(SETTINGS, planner_headroom=0.1)
    budget = int(0.7 * m.peak_bytes)
    chosen = plan_strategies(settings, m.profile, m, budget, OVERHEAD)
    target = int(budget * 0.9)
    assert chosen["planned"].predicted_peak_bytes <= target
    accumulate = chosen["accumulate"]
    fits = accumulate.predicted_peak_bytes <= target
    assert fits or accumulate.plan.microbatches == 8
    if fits:
        assert chosen["planned"].predicted_s <= accumulate.predicted_s * (1 + 1e-9)


def test_a_strategy_that_ran_within_the_budget_is_trusted_over_the_models_peak() -> None:
    """Suspect: offload peaks predicted 1.4-2x too high. Once offload has run within the budget, planned may use it."""
    from offcore_torch.compare.strategies import _replan_with_measured_peaks

    from offcore.comparison import Gates, StrategyResult

    m = measurement(recompute_factor=3.0)
    budget = int(0.5 * m.peak_bytes)
    chosen = plan_strategies(SETTINGS, m.profile, m, budget, OVERHEAD)
    offload = chosen["offload"]
    assert offload.predicted_peak_bytes > budget  # the model rules it out
    ran = StrategyResult(
        "offload",
        status="ok",
        plan=offload.plan.describe(),
        plan_dict=offload.plan.to_dict(),
        peak_device_bytes=budget - MiB,
        predicted_peak_bytes=offload.predicted_peak_bytes,
        step_times_s=[0.03],
    )
    notes: list[str] = []
    again = _replan_with_measured_peaks(
        chosen["planned"], [ran], SETTINGS, m.profile, m, budget, OVERHEAD, Gates(), True, notes.append
    )
    before = chosen["planned"].predicted_s if chosen["planned"].plan is not None else float("inf")
    assert again.predicted_s <= min(before, offload.predicted_s) * (1 + 1e-9)
    if offload.predicted_s < before:
        assert again.plan.actions == offload.plan.actions
        assert notes and "offload ran at" in notes[0]
        assert "ran at" in again.why
    # a peak measured above the budget is no evidence: nothing changes
    ran.peak_device_bytes = budget + 1
    same = _replan_with_measured_peaks(
        chosen["planned"], [ran], SETTINGS, m.profile, m, budget, OVERHEAD, Gates(), True, notes.append
    )
    assert same is chosen["planned"]
