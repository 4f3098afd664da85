"""The simulator's model of optimizer offload and parameter streaming, on worked numbers.

Note [Optimizer offload and parameter streaming in the simulator] in offcore/sim/simulator.py.
Two layers of 1 s forward and 2 s backward saving 100 bytes each, 10 bytes of parameters
(and of gradients) per layer, a device optimizer state of 40 bytes, 10 B/s links both ways
(a layer's parameters or gradients copy in 1 s) and a host step of 0.05 s per byte (0.5 s a layer).
"""

from __future__ import annotations

import pytest

from offcore.errors import ConfigurationError
from offcore.sim import Plan, StepProfile, simulate
from offcore.sim.profile import LayerProfile
from offcore.sim.replay import replay

# the events offcore_torch.offload_parameters feeds its round's ResidencyScheduler (parameters.py:
# _begin_step, _use, _execute, _end_step); tests/torch/test_sim_memory.py compares them with a real step's
PARAMETER_EVENTS = {
    "forward_began",
    "produced",
    "register",
    "offload_started",
    "landed",
    "forward_ended",
    "plan_inputs",
    "next",
    "backward_began",
    "started",
    "used",
    "awaited",
    "consumed",
    "backward_ended",
}


def profile(**changes: object) -> StepProfile:
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 100, grad_bytes=10) for i in range(2)]
    fields: dict[str, object] = {
        "param_bytes": 20,
        "other_bytes": 40,
        "optimizer_state_bytes": 40,
        "d2h_bandwidth": 10,
        "h2d_bandwidth": 10,
        "host_step_s_per_byte": 0.05,
    }
    fields.update(changes)
    return StepProfile(layers, **fields)  # type: ignore[arg-type]


def spans(result: object, stream: str) -> list[tuple[str, float, float]]:
    return [(e.name, e.start, e.end) for e in result.events if e.stream == stream]  # type: ignore[attr-defined]


def test_the_device_optimizer_keeps_its_state_and_the_gradients() -> None:
    r = simulate(profile(), Plan.keep_all(2))
    assert (r.step_time_s, r.static_bytes, r.peak_bytes, r.host_step_s) == (6.0, 60, 270, 0.0)


def test_optimizer_offload_copies_gradients_steps_on_the_host_and_copies_parameters_back() -> None:
    r = simulate(profile(), Plan.keep_all(2, optimizer="offload"))
    # l1's backward ends at 4: gradient D2H 4-5, host step 5-5.5, parameters H2D 5.5-6.5;
    # l0's ends at 6: D2H 6-7, host step 7-7.5, H2D 7.5-8.5, and the step ends when it landed
    assert spans(r, "d2h") == [("d2h:grad:l1", 4.0, 5.0), ("d2h:grad:l0", 6.0, 7.0)]
    assert spans(r, "host") == [("host-step:l1", 5.0, 5.5), ("host-step:l0", 7.0, 7.5)]
    assert spans(r, "h2d") == [("h2d:param:l1", 5.5, 6.5), ("h2d:param:l0", 7.5, 8.5)]
    assert r.step_time_s == 8.5 and r.exposed_wait_s == 2.5 and r.host_step_s == 1.0
    # no optimizer state on the device; at l1's backward: parameters 20 + saves 200 + its gradients 10
    assert (r.static_bytes, r.peak_bytes) == (20, 230)
    assert r.memory_at(5.0) == 20 + 100 + 10  # l1's gradients freed as their D2H landed


def test_the_host_worker_is_serial() -> None:
    r = simulate(profile(d2h_bandwidth="inf", host_step_s_per_byte=0.5), Plan.keep_all(2, optimizer="offload"))
    # 5 s a layer: l0's step waits for l1's on the one worker
    assert spans(r, "host") == [("host-step:l1", 4.0, 9.0), ("host-step:l0", 9.0, 14.0)]


def test_parameters_outside_the_layers_step_after_backward() -> None:
    r = simulate(profile(param_bytes=30), Plan.keep_all(2, optimizer="offload"))
    assert ("d2h:grad:rest", 7.0, 8.0) in spans(r, "d2h")
    assert r.step_time_s == pytest.approx(9.5)  # rest: host step 8-8.5, H2D 8.5-9.5


def test_parameter_streaming_copies_each_layer_in_before_each_use() -> None:
    r = simulate(profile(), Plan.keep_all(2, parameters="stream"))
    # Note [Parameter streaming drives a ResidencyScheduler]: the round's start (the previous step's
    # end) copied l0's and l1's forward uses in (the budget, twice a layer, holds both); at l0's use
    # (t=0) l1's backward use is due, but l1's parameters are on the device (held for its forward):
    # no copy, they stay; backward's first layers up to the budget (both) stay after their forward use
    # (Note [Backward's first parameters stay after forward in the simulator]): no copy in backward
    assert spans(r, "h2d") == [
        ("h2d:param:next-forward:l0", 6.0, 7.0),  # the next step's first copies, at the end of this one
        ("h2d:param:next-forward:l1", 7.0, 8.0),
    ]
    assert r.parameter_h2d_copies == 2  # one tensor a layer
    # no wait in forward or backward; the step ends when the next step's copies landed
    assert r.step_time_s == 8.0 and r.exposed_wait_s == 2.0
    assert r.static_bytes == 40  # the layers' parameters are not resident
    assert r.memory_at(0.0) == 40 + 20 + 100  # both layers' forward copies, l0's first save
    # l1's backward: other 40 + saves 200 + l1's and l0's parameters 20 + l1's gradients 10
    assert r.peak_bytes == 270
    assert r.memory_at(1.5) == 40 + 200 + 20  # in l1's forward: l0's parameters kept for its backward
    assert r.memory_at(6.0) == 40  # every layer's parameters freed after its backward


def test_parameter_copies_are_prefetched_by_deadline_within_the_budget() -> None:
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 0, grad_bytes=10) for i in range(4)]
    p = StepProfile(layers, param_bytes=40, h2d_bandwidth=5)  # 2 s a copy, 1 s a forward
    r = simulate(p, Plan.keep_all(4, parameters="stream"))
    forward = [(name, start, end) for name, start, end in spans(r, "h2d") if ":forward:" in name]
    # the budget (twice a layer's 10 bytes) holds two copies ahead of use: l0's and l1's were made
    # before the step; at l0's use (t=0) l2's copy is due and fits, at l1's l3's
    assert forward == [("h2d:param:forward:l2", 0.0, 2.0), ("h2d:param:forward:l3", 2.0, 4.0)]
    assert [e.start for e in r.events if e.kind == "forward"] == [0.0, 1.0, 2.0, 4.0]
    backward = [(name, start, end) for name, start, end in spans(r, "h2d") if ":backward:" in name]
    # l3's and l2's backward uses find them on the device (backward's first layers up to the budget
    # stay after their forward use); l1's copy is due by 8 (5-7), l0's chains on the link
    assert backward == [
        ("h2d:param:backward:l1", 5.0, 7.0),
        ("h2d:param:backward:l0", 7.0, 9.0),
    ]
    assert r.parameter_schedule_settings["budget"] == 20  # offload_parameters' default: twice the largest module


def test_all_kinds_no_upload_after_the_host_step() -> None:
    r = simulate(profile(), Plan.keep_all(2, optimizer="offload", parameters="stream"))
    assert [name for name, _, _ in spans(r, "h2d")] == [
        "h2d:param:next-forward:l0",  # the next round, once the last host step is done (7.5)
        "h2d:param:next-forward:l1",
    ]
    assert spans(r, "h2d")[0][1] == 7.5  # the next round starts once the host step is done
    assert r.step_time_s == 9.5
    assert r.static_bytes == 0


@pytest.mark.parametrize(
    "plan",
    [
        Plan.keep_all(2, parameters="stream"),
        Plan(["recompute", "offload"], optimizer="offload", parameters="stream"),
        Plan(["offload", "keep"], parameters="stream", microbatches=2),
    ],
    ids=["keep", "recompute+optimizer-offload", "micro-batches"],
)
@pytest.mark.parametrize("capacity", [None, 200])
def test_the_simulated_parameter_round_replays_to_its_actions(plan: Plan, capacity: int | None) -> None:
    # Note [Parameter streaming drives a ResidencyScheduler]: a new scheduler fed the round's log
    # decides the same copies, in the same order, at the same triggers (the device's room included)
    r = simulate(profile(capacity_bytes=capacity, batch_size=2), plan, record_schedule=True)
    log, actions = list(r.parameter_schedule_log), list(r.parameter_schedule_actions)
    assert {name for name, _, _ in log} <= PARAMETER_EVENTS | {"reloaded", "device_in_use"}
    assert [a.kind.value for a in actions].count("prefetch") >= 2
    assert replay(log, **r.parameter_schedule_settings) == actions
    assert r.parameter_schedule_settings["margin"] == 0.5e-3  # offload_parameters' default margin
    # every use is a trigger: forward, recompute and backward uses of each layer, in order
    used = [args[0] for name, args, _ in log if name == "used"]
    assert used == sorted(used) and len(used) == (5 if plan.actions[0].value == "recompute" else 4)
    assert simulate(profile(), Plan.keep_all(2), record_schedule=True).parameter_schedule_log == ()


def test_plan_fields_round_trip_and_are_checked() -> None:
    plan = Plan.uniform(2, "offload", optimizer="offload", parameters="stream")
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.describe().endswith("optimizer=offload parameters=stream")
    assert plan.strategy == "offload+param-stream+optimizer-offload"
    assert "optimizer" not in Plan.keep_all(2).to_dict()  # older readers keep reading activation plans
    with pytest.raises(ConfigurationError, match="optimizer must be"):
        Plan.keep_all(2, optimizer="gpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="parameters must be"):
        Plan.keep_all(2, parameters="host")  # type: ignore[arg-type]


def test_profile_fields_round_trip_and_are_checked() -> None:
    p = profile()
    assert StepProfile.from_json(p.to_json()) == p
    with pytest.raises(ConfigurationError, match="optimizer_state_bytes"):
        profile(optimizer_state_bytes=41)
    with pytest.raises(ConfigurationError, match="host_step_s_per_byte"):
        profile(host_step_s_per_byte=-1.0)


def test_the_runtimes_own_work_is_on_the_compute_stream() -> None:
    plain = simulate(profile(), Plan.keep_all(2, optimizer="offload"))
    r = simulate(profile(optimizer_offload_overhead_s=1.0), Plan.keep_all(2, optimizer="offload"))
    assert r.overhead_s == 1.0
    assert [e.duration for e in r.events if e.kind == "backward"] == [2.5, 2.5]  # by parameter bytes
    assert r.step_time_s == plain.step_time_s + 1.0
    s = simulate(profile(parameter_stream_overhead_s=2.0), Plan.keep_all(2, parameters="stream"))
    assert [e.duration for e in s.events if e.kind in ("forward", "backward")] == [1.5, 1.5, 2.5, 2.5]
    assert simulate(profile(optimizer_offload_overhead_s=1.0), Plan.keep_all(2)).overhead_s == 0.0
