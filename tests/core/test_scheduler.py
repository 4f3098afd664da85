"""offcore.scheduler: measured link, next-use prediction and the deadline prefetch plan (no torch)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from offcore.errors import ConfigurationError  # noqa: E402
from offcore.scheduler import BandwidthEstimator, PrefetchPlan, Scheduler, StepObservation  # noqa: E402

# ------------------------------------------------------------------ BandwidthEstimator


def test_estimator_is_unknown_until_something_was_measured() -> None:
    est = BandwidthEstimator()
    assert est.bandwidth is None
    assert est.duration(1 << 20) == math.inf


def test_estimator_recovers_latency_and_bandwidth() -> None:
    est = BandwidthEstimator(decay=1.0)
    for size in (1 << 16, 1 << 20, 1 << 24):
        est.observe(size, 5e-6 + size / 32e9)
    assert est.bandwidth == pytest.approx(32e9, rel=1e-6)
    assert est.latency == pytest.approx(5e-6, rel=1e-6)
    assert est.duration(256 * 2**20) == pytest.approx(5e-6 + 256 * 2**20 / 32e9, rel=1e-6)


def test_estimator_follows_a_link_that_slows_down() -> None:
    est = BandwidthEstimator(decay=0.5)
    for _ in range(10):
        est.observe(1 << 20, (1 << 20) / 10e9)
    for _ in range(20):
        est.observe(1 << 20, (1 << 20) / 5e9)
    assert est.bandwidth == pytest.approx(5e9, rel=1e-3)


def test_estimator_ignores_nonsense_samples_and_rejects_bad_decay() -> None:
    est = BandwidthEstimator()
    est.observe(0, 1.0)
    est.observe(100, 0.0)
    est.observe(100, math.nan)
    assert est.samples == 0
    with pytest.raises(ConfigurationError):
        BandwidthEstimator(decay=0.0)


# ------------------------------------------------------------------------ PrefetchPlan


def test_worked_example_lead_time() -> None:
    """Seed numbers: need at 12 ms, copy 8 ms, no margin: start by 4 ms at the latest."""
    plan = PrefetchPlan({0: 0.0, 1: 0.012}, {1: 8}, lambda n: n / 1000, margin=0.0)
    assert plan.latest_start[1] == pytest.approx(0.004)
    # t_prefetch = t_need - V/BW - margin = 10 - 5 - 0 = 5 (seconds)
    plan = PrefetchPlan({0: 0.0, 1: 10.0}, {1: 5}, lambda n: float(n), margin=0.0)
    assert plan.latest_start[1] == pytest.approx(5.0)


def test_serial_link_pushes_earlier_copies_earlier() -> None:
    # two copies of 3 s on one link, needed at 10 and 11: the second must start by 8,
    # so the first must be done by 8 (not 10) and start by 5
    plan = PrefetchPlan({0: 0.0, 1: 10.0, 2: 11.0}, {1: 3, 2: 3}, lambda n: float(n), margin=0.0)
    assert plan.latest_start == {2: 8.0, 1: 5.0}
    assert plan.order == [1, 2]


def test_due_starts_what_would_be_late_at_the_next_trigger() -> None:
    uses = {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 9.0}
    plan = PrefetchPlan(uses, {3: 1, 4: 1}, lambda n: 1.5, margin=0.25)
    # latest starts: key 3 at 3 - 0.25 - 1.5 = 1.25; key 4 at 9 - 0.25 - 1.5 = 7.25
    assert plan.due(plan.virtual_time(0, 0.0)) == []  # next trigger at 1.0 < 1.25
    assert plan.due(plan.virtual_time(1, 1.0)) == [3]  # next trigger at 2.0 > 1.25
    plan.issued(3)
    assert plan.due(plan.virtual_time(2, 2.0)) == []
    assert plan.due(plan.virtual_time(3, 3.0)) == [4]  # no trigger before 9.0 other than key 4 itself
    plan.issued(4)
    assert len(plan) == 0


def test_unknown_bandwidth_means_start_everything_now() -> None:
    plan = PrefetchPlan({0: 0.0, 1: 5.0, 2: 9.0}, {1: 10, 2: 10}, lambda n: math.inf, margin=0.0)
    assert plan.due(-math.inf) == [1, 2]


def test_readers_make_an_object_needed_at_its_first_reader() -> None:
    # key 2's storage is also read by key 5, which backward uses first
    plan = PrefetchPlan({2: 8.0, 5: 1.0, 0: 0.0}, {2: 1}, lambda n: 0.5, margin=0.0, readers={2: [2, 5]})
    assert plan.need[2] == 1.0
    assert plan.latest_start[2] == 0.5


def test_virtual_time_follows_the_step_when_it_runs_late() -> None:
    plan = PrefetchPlan({0: 0.0, 1: 1.0, 2: 2.0}, {2: 1}, lambda n: 0.1, margin=0.0)
    assert plan.virtual_time(1, 1.7) == 1.0  # key 1 ran 0.7 late: the plan's clock says 1.0
    assert plan.virtual_time(None, 1.8) == pytest.approx(1.1)  # drift of 0.7 applied
    assert plan.horizon(1.0) == 2.0
    assert plan.horizon(5.0) == math.inf


@given(
    needs=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=20),
    durations=st.lists(st.floats(0, 10, allow_nan=False), min_size=20, max_size=20),
    margin=st.floats(0, 1),
)
def test_latest_starts_respect_deadlines_and_never_overlap(
    needs: list[float], durations: list[float], margin: float
) -> None:
    uses = dict(enumerate(needs))
    size = {k: k for k in uses}
    plan = PrefetchPlan(uses, size, lambda n: durations[n], margin=margin)
    for key in plan.order:
        assert plan.latest_start[key] + durations[key] <= uses[key] - margin + 1e-9  # lands by its deadline
    # copies in deadline order never overlap on the serial link
    ends = [plan.latest_start[k] + durations[k] for k in plan.order]
    for nxt, end in zip(plan.order[1:], ends[:-1], strict=False):
        assert plan.latest_start[nxt] >= end - 1e-9


# ---------------------------------------------------------------------------- Scheduler


def test_first_step_predicts_reverse_order_at_twice_forward_speed() -> None:
    sched = Scheduler()
    step = StepObservation(pack_times={0: 0.0, 1: 0.002, 2: 0.005})
    assert sched.predict(step) == pytest.approx({0: 0.010, 1: 0.006, 2: 0.0})


def test_learns_first_use_times_and_the_backward_ratio() -> None:
    sched = Scheduler(smoothing=1.0)
    sched.observe(StepObservation({0: 0.0, 1: 0.004}, 0.005, {1: 0.001, 0: 0.003}, 0.015))
    assert sched.steps_observed == 1
    assert sched.backward_ratio == pytest.approx(3.0)
    predicted = sched.predict(StepObservation({0: 0.0, 1: 0.004, 2: 0.0045}, 0.005))
    assert predicted[0] == 0.003 and predicted[1] == 0.001
    assert predicted[2] == pytest.approx(0.0)  # unseen key: ratio rule from the last save


def test_smoothing_blends_steps_and_steps_without_backward_teach_nothing() -> None:
    sched = Scheduler(smoothing=0.5)
    sched.observe(StepObservation({0: 0.0}, 0.01, {0: 0.004}, 0.02))
    sched.observe(StepObservation({0: 0.0}, 0.01, {0: 0.008}, 0.02))
    sched.observe(StepObservation({0: 0.0}, 0.01, {}, 0.0))
    assert sched.steps_observed == 2
    assert sched.predict(StepObservation({0: 0.0}))[0] == pytest.approx(0.006)


def test_plan_uses_the_learned_times() -> None:
    sched = Scheduler(margin=0.0, smoothing=1.0)
    sched.observe(StepObservation({0: 0.0, 1: 0.01}, 0.02, {0: 0.030, 1: 0.002}, 0.04))
    plan = sched.plan(StepObservation({0: 0.0, 1: 0.01}, 0.02), {0: 1000}, lambda n: 0.005)
    assert plan.latest_start == {0: pytest.approx(0.025)}


@pytest.mark.parametrize(
    "kwargs", [{"smoothing": 0}, {"smoothing": 1.5}, {"backward_ratio": 0}, {"margin": "-1ms"}, {"margin": "x"}]
)
def test_bad_settings_are_configuration_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Scheduler(**kwargs)  # type: ignore[arg-type]
