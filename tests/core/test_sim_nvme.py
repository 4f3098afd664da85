"""The NVMe tier in the simulator: the optimizer's states and offloaded activations, two hops (no torch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from offcore.bandwidth import NvmeLinkMeasurement
from offcore.errors import ConfigurationError
from offcore.sim import Plan, StepProfile, simulate
from offcore.sim.profile import uniform_profile

MIB = 1024**2


def _optimizer_profile(layer_params: int, *, read: float, write: float) -> StepProfile:
    profile = uniform_profile(4, forward_s=1.0, backward_s=2.0, saved_bytes=10)
    layers = [replace(layer, param_bytes=layer_params, grad_bytes=layer_params) for layer in profile.layers]
    return replace(
        profile,
        layers=layers,
        param_bytes=4 * layer_params,
        other_bytes=8 * layer_params,
        optimizer_state_bytes=8 * layer_params,  # AdamW: two fp32 states a parameter
        host_step_s_per_byte=1.0 / MIB,
    ).with_nvme_link(NvmeLinkMeasurement(read, write, 0.0, 0.0, True))


def test_the_optimizer_states_are_read_stepped_and_written_pipelined_after_backward() -> None:
    profile = _optimizer_profile(3 * MIB, read=6 * MIB, write=6 * MIB)  # 1 s per layer's states each way
    host = simulate(profile, Plan.keep_all(4, optimizer="offload"))
    nvme = simulate(profile, Plan.keep_all(4, optimizer="offload", optimizer_tier="nvme"))
    assert nvme.nvme_read_bytes == nvme.nvme_write_bytes == profile.optimizer_state_bytes
    assert host.nvme_read_bytes == 0
    events = {(e.stream, e.name): e for e in nvme.events}
    reads = sorted((e for e in nvme.events if e.stream == "n2h"), key=lambda e: e.start)
    steps = sorted((e for e in nvme.events if e.stream == "host"), key=lambda e: e.start)
    writes = sorted((e for e in nvme.events if e.stream == "h2n"), key=lambda e: e.start)
    assert len(reads) == len(steps) == len(writes) == 4  # 3 MiB layers: one group each (4 MiB groups)
    compute_end = max(e.end for e in nvme.events if e.stream == "compute" and e.kind == "backward")
    assert reads[0].start >= compute_end  # nothing steps before step(): after backward
    for k in range(4):
        assert steps[k].start >= reads[k].end and writes[k].start >= steps[k].end
    assert reads[1].start < steps[0].end  # read i+1 while group i steps
    assert steps[2].start >= writes[0].end  # group i waits for the write of i-2
    assert nvme.step_time_s >= writes[-1].end  # the step ends when the last state is on disk
    assert nvme.step_time_s > host.step_time_s
    assert reads[2].start < steps[0].end  # read two ahead, as the optimizer does (pipelined lookahead=2)
    # host bytes: masters + gradients + at most lookahead + 2 = four groups' states in the bounce buffers
    assert nvme.optimizer_host_bytes == 2 * profile.param_bytes + 4 * 6 * MIB
    assert host.optimizer_host_bytes == 2 * profile.param_bytes + profile.optimizer_state_bytes
    assert ("h2d", "h2d:param:layer0") in events  # parameters uploaded after their group's step


def test_small_layers_share_one_group_and_a_faster_disk_is_a_shorter_step() -> None:
    slow = _optimizer_profile(MIB // 4, read=MIB, write=MIB)
    fast = slow.with_link(nvme_read_bandwidth=100 * MIB, nvme_write_bandwidth=100 * MIB)
    plan = Plan.keep_all(4, optimizer="offload", optimizer_tier="nvme")
    result = simulate(slow, plan)
    assert [e.stream for e in result.events].count("n2h") == 1  # 1 MiB of parameters: one group
    assert simulate(fast, plan).step_time_s < result.step_time_s


def test_offloaded_activations_on_nvme_come_back_in_two_hops() -> None:
    profile = uniform_profile(4, forward_s=1.0, backward_s=2.0, saved_bytes=100).with_link(
        d2h_bandwidth=200, h2d_bandwidth=200, nvme_read_bandwidth=50, nvme_write_bandwidth=50
    )
    plan = Plan.uniform(4, "offload", activation_tier="nvme")
    result = simulate(profile, plan, record_schedule=True)
    names = {name for name, *_ in result.schedule_log}
    assert {"spilled", "stage_started", "staged"} <= names
    reads = {e.name.split(":", 1)[1]: e for e in result.events if e.stream == "n2h"}
    copies = {e.name.split(":", 1)[1]: e for e in result.events if e.stream == "h2d"}
    assert reads and set(reads) <= set(copies)
    for label, read in reads.items():
        assert copies[label].start >= read.end  # NVMe -> host first, then host -> device
    assert 0 < result.nvme_read_bytes <= result.nvme_write_bytes
    host = simulate(profile, Plan.uniform(4, "offload"))
    slower = simulate(profile.with_link(nvme_read_bandwidth=20), plan)
    assert host.step_time_s <= result.step_time_s <= slower.step_time_s
    assert host.nvme_write_bytes == 0


def test_plans_and_profiles_carry_the_tiers() -> None:
    plan = Plan.keep_all(2, optimizer="offload", optimizer_tier="nvme", activation_tier="nvme")
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "optimizer=offload/nvme" in plan.describe() and "activations=nvme" in plan.describe()
    assert "optimizer_tier" not in Plan.keep_all(2).to_dict()
    with pytest.raises(ConfigurationError, match="optimizer_tier='nvme' needs optimizer='offload'"):
        Plan.keep_all(2, optimizer_tier="nvme")
    with pytest.raises(ConfigurationError, match="activation_tier"):
        Plan.keep_all(2, activation_tier="disk")  # type: ignore[arg-type]
    profile = _optimizer_profile(MIB, read=2e9, write=1e9)
    assert StepProfile.from_dict(profile.to_dict()) == profile
    assert profile.nvme_write_bandwidth == 1e9
