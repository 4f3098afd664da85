"""Replay of a step whose offloaded objects live on NVMe (Note [Two hops from NVMe]).

A recorded two-hop step has ``staged`` events, which are triggers (their offers are taken
by the ``next`` events that follow, as after ``used`` and ``forward_ended``), and
``plan_inputs`` with a third item, the stage durations the plan rested on. The replay
must reach the recorded actions, stages included."""

from __future__ import annotations

import pytest
from test_residency_nvme import Step

from offcore.residency import ActionKind
from offcore.sim.replay import ReplayDiverged, replay


@pytest.mark.parametrize(
    "step",
    [
        Step(spill=frozenset({0, 1, 2, 5})),
        Step(spill=frozenset(range(8)), n2h=0.004),  # a slow NVMe link: stages chain back from the last
        Step(spill=frozenset({1, 3}), refuse_stage_once=frozenset({1})),
        Step(spill=frozenset({2, 6}), stage_duration="none"),  # an unknown link: every stage due at once
    ],
    ids=["some-spilled", "slow-link", "refused-once", "unknown-link"],
)
def test_a_recorded_two_hop_step_replays_to_the_same_actions(step: Step) -> None:
    rs = step.run(record=True)
    names = {name for name, _, _ in rs.log}
    assert "staged" in names
    assert any(name == "plan_inputs" and len(args) == 3 for name, args, _ in rs.log)
    assert any(a.kind is ActionKind.STAGE for a in rs.actions)
    assert replay(rs.log, **rs.settings()) == rs.actions


def test_a_step_without_stages_still_replays() -> None:
    rs = Step().run(record=True)
    assert all(len(args) == 2 for name, args, _ in rs.log if name == "plan_inputs")
    assert replay(rs.log, **rs.settings()) == rs.actions


def test_a_log_cut_short_of_its_stage_durations_diverges_clearly() -> None:
    """Without the recorded stage durations the replayed plan cannot place the stages: a clear error
    or other actions, never a silent match of a different step."""
    rs = Step(spill=frozenset(range(8)), n2h=0.004).run(record=True)
    cut = [(name, args[:2], kw) if name == "plan_inputs" else (name, args, kw) for name, args, kw in rs.log]
    try:
        actions = replay(cut, **rs.settings())
    except ReplayDiverged:
        return
    assert actions != rs.actions
