"""Note [Reads of kept tensors are triggers]: a read in backward of a tensor the runtime keeps (a
parameter saved beside an activation) is a trigger of its scheduler once that activation was consumed;
``LayerProfile.reads_after`` tells the simulator where, and it feeds the same trigger."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from offcore.errors import ConfigurationError
from offcore.residency import ActionKind
from offcore.sim import Plan, PrefetchPolicy, SimResult, StepProfile, simulate
from offcore.sim.profile import LayerProfile

KiB = 1024


def _layer(name: str, reads: tuple[int, ...] = ()) -> LayerProfile:
    # three saves (4, 5, 5 KiB); backward uses the last first, then the middle one 1.2 s later, then the first
    return LayerProfile(
        name,
        1.0,
        3.0,
        14 * KiB,
        working_bytes=1 * KiB,
        saved_tensors=[(0.2, 4 * KiB), (0.6, 5 * KiB), (1.0, 5 * KiB)],
        gross_working_bytes=(1 * KiB, 1 * KiB, 1 * KiB),
        reads_after=reads,
    )


def _run(reads: tuple[int, ...]) -> tuple[SimResult, list[tuple[Any, ...]], list[Any]]:
    profile = StepProfile([_layer("l0", reads), _layer("l1", reads)], d2h_bandwidth=1e12, h2d_bandwidth=1e12)
    # reloads as early as an 8 KiB budget allows (steady_prefetch's policy), offloads drained
    policy = PrefetchPolicy("deadline", margin_s=3600.0, budget_bytes=8 * KiB)
    result = simulate(profile, Plan(["offload"] * 2, prefetch=policy, drain_offloads=True), record_schedule=True)
    return result, list(result.schedule_log), list(result.schedule_actions)


def test_a_kept_read_after_a_consumed_save_offers_the_next_reloads_within_the_budget() -> None:
    # keys in save order: l0 0..2, l1 3..5; backward uses 5 (at its start), 4, 3, then 2, 1, 0
    result, log, actions = _run((0, 0, 1))  # a weight is read right after the last save's use
    names = [(entry[0], entry[1][0]) for entry in log if entry[0] in ("used", "consumed", "started", "reloaded")]
    # the turn prefetches key 5 (5 KiB; 5 more would exceed 8); once 5 was consumed the kept read (a key
    # outside the saves') is a trigger: 4 is prefetched within the budget, not reloaded on demand at its use
    after = names.index(("consumed", 5))
    assert names[after + 1][0] == "used" and names[after + 1][1] >= 6
    assert names[after + 2] == ("started", 4)
    assert ("reloaded", 4) not in names
    # at the use of 4 it is outstanding until consumed: 3 (4 KiB) does not fit beside it, and no read
    # follows 4, so 3 is reloaded on demand at its own use
    assert ("reloaded", 3) in names
    prefetched = [a.key for a in actions if a.kind is ActionKind.PREFETCH]
    assert prefetched[:2] == [5, 4]
    # the level: during the use of 5, its 5 KiB, 4's 5 KiB and 1 KiB working set
    backward = [e for e in result.events if e.kind == "backward" and e.layer == "l1"]
    first = backward[0]
    assert result.memory_at((first.start + first.end) / 2) == 11 * KiB


def test_without_the_read_the_next_save_is_reloaded_on_demand_and_the_budget_filled_beside_it() -> None:
    result, log, _ = _run(())
    names = [(entry[0], entry[1][0]) for entry in log if entry[0] in ("used", "consumed", "started", "reloaded")]
    assert ("reloaded", 4) in names  # 5 was outstanding at every trigger before 4's use
    # at 4's use the budget is filled beside it: 3 (4 KiB) prefetched, outside 4's on-demand 5 KiB
    second = [e for e in result.events if e.kind == "backward" and e.layer == "l1"][1]
    assert result.memory_at((second.start + second.end) / 2) == 5 * KiB + 4 * KiB + 1 * KiB


def test_reads_after_is_one_count_per_save_and_survives_scaling_and_json() -> None:
    layer = _layer("l0", (0, 2, 1))
    assert layer.scaled(2.0).reads_after == (0, 2, 1)  # reads, not bytes
    profile = StepProfile([layer])
    assert StepProfile.from_json(profile.to_json()).layers[0].reads_after == (0, 2, 1)
    assert _layer("l0").reads_after == ()
    with pytest.raises(ConfigurationError, match="one per saved tensor"):
        replace(layer, reads_after=(1, 2))
    with pytest.raises(ConfigurationError, match="integers >= 0"):
        replace(layer, reads_after=(0, -1, 0))
    with pytest.raises(ConfigurationError, match="list of counts"):
        replace(layer, reads_after="1")


def test_a_drained_layer_that_saves_at_the_end_of_its_forward_ends() -> None:
    # Note [Drained offloads bound the forward's copies in flight]: a save made at the forward's end (the
    # default single save of a layer) is packed at that instant, after the forward's frees; the drain waits
    # for its D2H too (it used to wait for a copy not issued yet: the step never ended)
    profile = StepProfile(
        [LayerProfile(f"l{i}", 1e-3, 2e-3, 4 * KiB) for i in range(2)], d2h_bandwidth=1e9, h2d_bandwidth=1e9
    )
    result = simulate(profile, Plan(["offload"] * 2, drain_offloads=True))
    assert result.step_time_s < 1.0
    forward_l1 = next(e for e in result.events if e.name == "forward:l1")
    d2h_l0 = next(e for e in result.events if e.name == "d2h:l0")
    assert forward_l1.start == d2h_l0.end  # l1 waited for l0's copy, and no longer
