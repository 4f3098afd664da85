"""The planner: budgets, plans as JSON, errors, and its gap to the exact optimum and the bound."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from offcore import CapacityExceededError, ConfigurationError  # noqa: E402
from offcore.sim import (  # noqa: E402
    Action,
    LayerProfile,
    Plan,
    PrefetchPolicy,
    StepProfile,
    exhaustive_plan,
    instance_lower_bound,
    plan,
    plan_lower_bound,
    simulate,
    uniform_profile,
)

MB = 10**6


def generated_instance(seed: int, n: int) -> StepProfile:
    """A random stack: varied compute, bytes and recompute costs; link from slow to fast."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        forward = rng.uniform(1e-3, 10e-3)
        layers.append(
            LayerProfile(
                f"l{i}",
                forward,
                forward * rng.uniform(1.5, 3.0),
                int(rng.uniform(50, 500) * MB),
                recompute_s=forward * rng.uniform(0.3, 1.2),
                working_bytes=int(rng.uniform(0, 30) * MB),
                input_bytes=int(rng.uniform(5, 40) * MB),
            )
        )
    bandwidth = rng.choice([20e9, 50e9, 150e9])
    return StepProfile(layers, param_bytes=2 * 10**9, d2h_bandwidth=bandwidth, h2d_bandwidth=bandwidth * 0.7)


def budget_at(profile: StepProfile, fraction: float) -> int:
    keep_all = simulate(profile, Plan.keep_all(profile.n_layers))
    return profile.static_bytes + int(fraction * keep_all.activation_peak_bytes)


# --- Plan ---------------------------------------------------------------------------------------------


def test_plan_json_round_trip():
    original = Plan(
        ["keep", "Offload", Action.RECOMPUTE, "recompute"],
        checkpoint_interval=2,
        microbatches=2,
        prefetch=PrefetchPolicy("deadline", margin_s="1ms", budget_bytes="1GiB"),
        layer_names=["a", "b", "c", "d"],
    )
    text = original.to_json()
    assert json.loads(text)["actions"] == ["keep", "offload", "recompute", "recompute"]
    assert Plan.from_json(text) == original
    assert original.segments() == [(2, 3)] and original.strategy == "hybrid+accumulate"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Plan(["keep", "swap"]), "unknown action 'swap'"),
        (lambda: Plan([]), "at least one"),
        (lambda: Plan("keep"), "list"),
        (lambda: Plan(["keep"], checkpoint_interval=0), "checkpoint_interval"),
        (lambda: Plan(["keep"], microbatches=-2), "microbatches"),
        (lambda: Plan(["keep"], layer_names=["a", "b"]), "layer names"),
        (lambda: PrefetchPolicy("eager"), "prefetch mode"),
        (lambda: PrefetchPolicy("lead"), "lead_s"),
        (lambda: PrefetchPolicy(budget_bytes=-1), "budget"),
        (lambda: Plan.from_json('{"actions": ["keep"], "extra": 1}'), "unknown plan fields"),
        (lambda: Plan.from_json("[1, 2]"), "JSON object"),
        (lambda: Plan.from_json("{"), "not valid JSON"),
    ],
)
def test_bad_plans_are_refused(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Plan.from_json(None), "must be JSON text .* got NoneType"),
        (lambda: Plan.from_json({"actions": ["keep"]}), "got dict; for an already parsed object use from_dict"),
        (lambda: Plan.from_json(DEEP), "nested too deeply"),
        (lambda: Plan.from_json('{"actions": ' + DEEP + "}"), "nested too deeply"),
        (lambda: Plan.from_json('{"actions": [' + "[" * 500 + "]" * 500 + "]}"), "unknown action a list"),
        (lambda: Plan.from_json(b"\xff"), "not valid JSON"),
        (lambda: Plan.from_json('{"actions": ["keep"], "microbatches": ' + "9" * 5000 + "}"), "not valid JSON"),
        (lambda: Plan.from_json('{"actions": {"keep": 1}}'), "needs an 'actions' list.*got a dict"),
        (lambda: Plan.from_json('{"actions": "keep"}'), "needs an 'actions' list"),
        (lambda: Plan.from_json('{"layer_names": ["a"]}'), "needs an 'actions' list.*got none"),
        (lambda: Plan.from_json('{"actions": ["keep"], "layer_names": 5}'), "'layer_names' must be a list"),
        (lambda: Plan.from_json('{"actions": ["keep"], "layer_names": [5]}'), "layer_names must be strings, got 5"),
        (lambda: Plan.from_json('{"actions": ["keep"], "checkpoint_interval": [[1]]}'), "got a list"),
        (lambda: Plan.from_json('{"actions": ["keep"], "prefetch": {"mode": {}}}'), "prefetch mode a dict"),
        (lambda: Plan({"keep": 1}), "actions must be a list"),
        (lambda: Plan({"keep", "offload"}), "actions must be a list"),
        (lambda: Plan(["keep"], layer_names=5), "layer_names must be a list"),
        (lambda: Plan(["keep"], layer_names="a"), "layer_names must be a list"),
        (lambda: Plan.from_dict({"actions": ["keep"], 1: 2, "x": 3}), "unknown plan fields 'x', 1; known: 'actions', "),
        (lambda: StepProfile.from_json(None), "step profile must be JSON text"),
        (lambda: StepProfile.from_json(DEEP), "step profile is nested too deeply"),
    ],
)
def test_malformed_plan_json_is_a_configuration_error(make, message):
    with pytest.raises(ConfigurationError, match=message) as caught:
        make()
    assert len(str(caught.value)) < 400


def test_a_plan_for_another_stack_is_refused_on_load():
    profile = uniform_profile(3, forward_s=1.0, backward_s=1.0, saved_bytes=1)
    text = Plan.keep_all(4).to_json()
    with pytest.raises(ConfigurationError, match="4 layer actions but the profile has 3"):
        Plan.from_json(text, profile=profile)
    named = Plan(["keep"] * 3, layer_names=["x", "y", "z"])
    with pytest.raises(ConfigurationError, match="names"):
        named.check(profile)


# --- planning ------------------------------------------------------------------------------------------


def test_when_everything_fits_the_plan_keeps_everything():
    profile = generated_instance(1, 5)
    result = plan(profile, budget_at(profile, 1.0), method="greedy")
    assert result.plan.actions == (Action.KEEP,) * 5 and result.plan.microbatches == 1
    assert result.predicted.step_time_s == pytest.approx(result.keep_all.step_time_s)
    assert result.lower_bound_s == pytest.approx(result.predicted.step_time_s, rel=1e-6)


@pytest.mark.parametrize("fraction", [0.75, 0.5, 0.35, 0.25])
@pytest.mark.parametrize("seed", [2, pytest.param(3, marks=pytest.mark.slow)])  # ~2 s each
def test_the_plan_respects_the_budget_and_round_trips(seed, fraction):
    profile = generated_instance(seed, 12)
    budget = budget_at(profile, fraction)
    result = plan(profile, budget, method="greedy")
    assert result.predicted.peak_bytes <= budget
    assert result.plan.layer_names == profile.layer_names
    again = Plan.from_json(result.plan.to_json(), profile=profile)
    assert again == result.plan
    replay = simulate(profile, again)
    assert replay.step_time_s == result.predicted.step_time_s and replay.peak_bytes == result.predicted.peak_bytes
    assert result.lower_bound_s is not None
    assert result.predicted.step_time_s >= result.lower_bound_s * (1 - 1e-6)


def test_greedy_is_within_10_percent_of_the_exact_optimum_on_small_instances():
    ratios = []
    for seed in range(5):
        profile = generated_instance(100 + seed, 5)
        for fraction in (0.75, 0.55, 0.4):
            budget = budget_at(profile, fraction)
            try:
                exact = exhaustive_plan(profile, budget, microbatches=(1,), lower_bound=False)
            except CapacityExceededError:
                with pytest.raises(CapacityExceededError):  # nothing fits: greedy cannot find anything either
                    plan(profile, budget, method="greedy", microbatches=(1,), lower_bound=False)
                continue
            greedy = plan(profile, budget, method="greedy", microbatches=(1,), lower_bound=False)
            assert exact.predicted.peak_bytes <= budget and greedy.predicted.peak_bytes <= budget
            assert exact.predicted.step_time_s <= greedy.predicted.step_time_s * (1 + 1e-9)
            ratios.append(greedy.predicted.step_time_s / exact.predicted.step_time_s)
    assert len(ratios) >= 8  # most of these budgets are feasible
    assert max(ratios) <= 1.10


def test_the_instance_bound_never_exceeds_the_exact_optimum():
    for seed in range(3):
        profile = generated_instance(200 + seed, 5)
        for fraction in (0.8, 0.4, 0.25):
            budget = budget_at(profile, fraction)
            try:
                exact = exhaustive_plan(profile, budget, microbatches=(1,), lower_bound=False)
            except CapacityExceededError:
                continue
            bound = instance_lower_bound(profile, budget, checkpoint_intervals=(1, 2, 4))
            assert bound <= exact.predicted.step_time_s * (1 + 1e-6)
            assert plan_lower_bound(profile, exact.plan) <= exact.predicted.step_time_s * (1 + 1e-9)


def test_allowed_actions_restrict_the_search():
    profile = generated_instance(10, 6)  # an instance where offloading alone can fit 60 %
    budget = budget_at(profile, 0.6)
    checkpoint_only = plan(profile, budget, method="greedy", allowed_actions=("keep", "recompute"))
    assert Action.OFFLOAD not in checkpoint_only.plan.actions
    offload_only = plan(profile, budget, method="greedy", allowed_actions=("keep", "offload"))
    assert Action.RECOMPUTE not in offload_only.plan.actions
    hybrid = plan(profile, budget, method="greedy")
    assert hybrid.predicted.step_time_s <= min(
        checkpoint_only.predicted.step_time_s, offload_only.predicted.step_time_s
    ) * (1 + 1e-9)


def test_accumulation_is_chosen_when_it_is_cheapest_and_not_when_it_costs_more():
    profile = uniform_profile(
        4, forward_s=1e-3, backward_s=2e-3, saved_bytes=100 * MB, d2h_bandwidth=1e9, h2d_bandwidth=1e9, batch_size=4
    )
    budget = 200 * MB
    free = plan(profile, budget, method="greedy", microbatches=(1, 2, 4))
    assert free.plan.microbatches == 2 and free.plan.strategy == "keep+accumulate"
    assert free.predicted.peak_bytes <= budget
    costly = plan(profile, budget, method="greedy", microbatches=(1, 2, 4), microbatch_overhead_s=1.0)
    assert costly.plan.microbatches == 1


def test_impossible_budgets_say_what_the_smallest_peak_is():
    profile = uniform_profile(3, forward_s=1.0, backward_s=1.0, saved_bytes=100, param_bytes=1000)
    with pytest.raises(CapacityExceededError, match=r"smallest peak the planner found is .*\(1100 bytes\)"):
        plan(profile, 1050)
    assert instance_lower_bound(profile, 1050) == float("inf")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_bytes": -1}, "budget_bytes"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"budget_bytes": "lots"}, "budget_bytes"),
        ({"budget_bytes": 10**9, "method": "anneal"}, "method"),
        ({"budget_bytes": 10**9, "allowed_actions": ()}, "allowed_actions"),
        ({"budget_bytes": 10**9, "allowed_actions": ("keep", "swap")}, "unknown action"),
        ({"budget_bytes": 10**9, "checkpoint_intervals": (0,)}, "checkpoint_intervals"),
        ({"budget_bytes": 10**9, "microbatches": (3,)}, "micro-batches"),
        ({"budget_bytes": 10**9, "prefetch_mode": "lead"}, "prefetch mode"),
        ({"budget_bytes": None}, "budget_bytes"),
    ],
)
def test_bad_planner_arguments_are_refused(kwargs, message):
    profile = uniform_profile(3, forward_s=1.0, backward_s=1.0, saved_bytes=1)
    with pytest.raises(ConfigurationError, match=message):
        plan(profile, **kwargs)


def test_exhaustive_search_is_limited_to_small_stacks():
    profile = uniform_profile(12, forward_s=1.0, backward_s=1.0, saved_bytes=1)
    with pytest.raises(ConfigurationError, match="3\\^12"):
        plan(profile, 10, method="exhaustive")


def test_the_result_serialises():
    profile = generated_instance(9, 4)
    result = plan(profile, budget_at(profile, 0.5))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["method"] == "exhaustive" and data["predicted"]["peak_bytes"] <= data["budget_bytes"]
    assert data["gap_to_lower_bound"] >= 1 - 1e-6


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(2, 6),
    fraction=st.floats(0.2, 1.0),
    codes=st.lists(st.sampled_from(["keep", "offload", "recompute"]), min_size=6, max_size=6),
    interval=st.sampled_from([1, 2, 4]),
    prefetch=st.sampled_from([None, 1, 2]),
    mode=st.sampled_from(["deadline", "on_demand"]),
)
def test_every_plan_that_fits_takes_at_least_the_instance_bound(seed, n, fraction, codes, interval, prefetch, mode):
    profile = generated_instance(seed, n)
    largest = max(layer.saved_bytes for layer in profile.layers)
    policy = PrefetchPolicy(mode, budget_bytes=None if prefetch is None or mode == "on_demand" else prefetch * largest)
    candidate = Plan(codes[:n], checkpoint_interval=interval, prefetch=policy)
    result = simulate(profile, candidate)
    # the candidate fits this budget (its own peak when that is above the drawn share)
    budget = max(budget_at(profile, fraction), result.peak_bytes)
    bound = instance_lower_bound(profile, budget, checkpoint_intervals=(1, 2, 4))
    assert bound <= result.step_time_s * (1 + 1e-6)
