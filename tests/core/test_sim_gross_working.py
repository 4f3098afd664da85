"""Note [An offloaded layer's saves go as backward uses them] and Note [The turn sees the head's saved bytes].

The simulator's model of an offloaded layer's backward with the gross working sets the profiler
measures (``LayerProfile.gross_working_bytes``), its forward working set
(``forward_working_bytes``), the head's bytes at the end of forward (``head_forward_bytes``),
and the memory lower bounds the planner prunes with, which must stay below every simulated peak.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from offcore.errors import ConfigurationError
from offcore.sim import Action, Plan, PrefetchPolicy, StepProfile, simulate
from offcore.sim.bounds import batch_memory_floor
from offcore.sim.profile import LayerProfile

KiB = 1024


def _layer(name: str, gross: tuple[int, ...] = (), forward_work: int = 0) -> LayerProfile:
    # two saves: 4 KiB at the forward's middle, 6 KiB at its end; backward uses the 6 KiB first
    return LayerProfile(
        name,
        1.0,
        2.0,
        10 * KiB,
        working_bytes=3 * KiB,
        saved_tensors=[(0.5, 4 * KiB), (1.0, 6 * KiB)],
        gross_working_bytes=gross,
        forward_working_bytes=forward_work,
    )


def test_an_offloaded_layer_frees_each_save_after_its_use_and_holds_the_gross_working_set() -> None:
    # unlimited link: reloads are instant. Backward of the layer: the 6 KiB save with 5 KiB of gross
    # working set, then (1 s later) the 4 KiB save with 2 KiB; the 6 KiB save goes at the second use
    profile = StepProfile([_layer("l0", gross=(2 * KiB, 5 * KiB))])
    gross = simulate(profile, Plan(["offload"], prefetch=PrefetchPolicy("on_demand")))
    assert gross.memory_at(1.5) == 6 * KiB + 5 * KiB  # the first use (backward runs from t = 1 to 3)
    assert gross.memory_at(2.5) == 4 * KiB + 2 * KiB  # the second use: the 6 KiB save went
    assert gross.memory_at(3.0) == 0
    # without the gross working sets: every save stays to the backward's end, with the net working set
    net = simulate(StepProfile([_layer("l0")]), Plan(["offload"], prefetch=PrefetchPolicy("on_demand")))
    assert net.memory_at(2.5) == 10 * KiB + 3 * KiB
    # a kept layer is unchanged by them: its saves are all there, the net working set applies
    kept = simulate(profile, Plan(["keep"]))
    assert kept.peak_bytes == 10 * KiB + 3 * KiB


def test_the_forward_holds_the_forward_working_set() -> None:
    profile = StepProfile([_layer("l0", forward_work=1 * KiB)])
    result = simulate(profile, Plan(["keep"]))
    assert result.memory_at(0.99) == 10 * KiB + 1 * KiB  # forward: both saves and its own working set
    assert result.peak_bytes == 10 * KiB + 3 * KiB  # backward: the (larger) working_bytes


def test_the_turn_plans_with_the_heads_saved_bytes_only() -> None:
    """The first reload is planned at the end of forward; with the head's backward transients counted
    there, a capacity-aware scheduler deferred reloads the runtime issues."""
    layers = [_layer("l0")]
    plan = Plan(["offload"], prefetch=PrefetchPolicy("deadline", budget_bytes=6 * KiB))
    common = dict(other_bytes=20 * KiB, head_bytes=20 * KiB, capacity_bytes=24 * KiB, h2d_bandwidth=1e9)
    late = simulate(StepProfile(layers, **common), plan)
    early = simulate(StepProfile(layers, head_forward_bytes=5 * KiB, **common), plan)
    assert late.peak_bytes == 20 * KiB and not late.oom  # 4 KiB of room at the turn: the 6 KiB reload waited
    assert early.peak_bytes == 20 * KiB + 6 * KiB and early.oom  # 19 KiB of room when the plan is made


def test_the_new_fields_are_checked_scaled_and_serialised() -> None:
    layer = _layer("l0", gross=(2 * KiB, 5 * KiB), forward_work=KiB)
    assert layer.scaled(0.5).gross_working_bytes == (KiB, 2560)
    assert layer.offloaded_backward_work == 2 * KiB
    profile = StepProfile([layer], other_bytes=8, head_bytes=8, head_forward_bytes=3)
    assert StepProfile.from_json(profile.to_json()) == profile
    with pytest.raises(ConfigurationError, match="one per saved tensor"):
        _layer("l0", gross=(1,))
    with pytest.raises(ConfigurationError, match="head_forward_bytes"):
        StepProfile([layer], other_bytes=8, head_bytes=8, head_forward_bytes=9)


@pytest.mark.parametrize("seed", range(6))
def test_the_memory_floor_stays_below_every_simulated_peak(seed: int) -> None:
    """offcore.sim.bounds.batch_memory_floor prunes plans in the planner: it must never exceed a plan's
    simulated peak, whatever the gross and forward working sets."""
    rng = random.Random(seed)
    layers = []
    for i in range(3):
        sizes = [rng.randint(1, 64) * KiB for _ in range(rng.randint(1, 4))]
        fractions = sorted(rng.random() for _ in sizes)
        layers.append(
            LayerProfile(
                f"l{i}",
                rng.uniform(0.5, 2.0),
                rng.uniform(0.5, 4.0),
                sum(sizes),
                working_bytes=rng.randint(0, 64) * KiB,
                forward_working_bytes=rng.randint(0, 64) * KiB,
                input_bytes=rng.randint(1, 16) * KiB,
                saved_tensors=list(zip(fractions, sizes, strict=True)),
                gross_working_bytes=[rng.randint(0, 96) * KiB for _ in sizes],
                grad_bytes=rng.randint(0, 8) * KiB,
            )
        )
    profile = StepProfile(
        layers,
        param_bytes=32 * KiB,
        other_bytes=16 * KiB,
        head_bytes=8 * KiB,
        head_forward_bytes=rng.randint(0, 8) * KiB,
        d2h_bandwidth=rng.choice([1e6, 1e7, float("inf")]),
        h2d_bandwidth=rng.choice([1e6, 1e7, float("inf")]),
        reuse_in_flight=True,
    )
    codes_of = {Action.KEEP: 0, Action.OFFLOAD: 1, Action.RECOMPUTE: 2}
    plans = [Plan(list(actions)) for actions in itertools.product(list(Action), repeat=3)]
    codes = np.array([[codes_of[a] for a in plan.actions] for plan in plans], dtype=np.int8)
    floors = batch_memory_floor(profile, codes)
    for plan, floor in zip(plans, floors, strict=True):
        assert floor <= simulate(profile, plan, record_events=False).peak_bytes, plan.describe()
