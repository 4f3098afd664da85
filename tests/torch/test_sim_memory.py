"""The simulator's memory model against the fake device: each strategy's predicted peak within 10 %.

Memory on the fake device is the backend's own accounting. An offloaded step's peak is set
in backward by how many reloads are outstanding, which the runtime decides from its own
online link estimate (it moves with load): the offloaded plans here carry the finite
prefetch budget ``offcore compare`` gives them (Note [A finite prefetch budget makes the
peak hold] in offcore/sim/planner.py), which the runtime enforces, so the peak holds in
every run. Predictions are made as ``offcore compare`` makes them, on the profile's link
(the runtime's estimate carries its copy threads' wake-up delays under load, which the
budget makes irrelevant to the peak). Step times are not compared here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from offcore_torch.compare.compare import WorkloadProfiler
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.settings import CompareSettings, build_workload
from offcore_torch.compare.strategies import bounded_offload_plan, predicted_step_series

from offcore.sim import Action, Plan, PrefetchPolicy, simulate

SETTINGS = CompareSettings(batch=8, seq_len=32, layers=4, d_model=32, heads=2, warmup=1, iters=1)
PLANS = {
    "keep": Plan.keep_all(4),
    "accumulate": Plan.keep_all(4, microbatches=2),
    "checkpoint": Plan.uniform(4, "recompute"),
    "offload": Plan.uniform(4, "offload"),
    "hybrid": Plan(["offload", "offload", "recompute", "recompute"]),
    "on demand": Plan(["keep", "offload", "recompute", "offload"], prefetch=PrefetchPolicy("on_demand")),
}


def test_predicted_peaks_are_within_10_percent_of_the_measured_ones(make_fake_device: Any) -> None:
    device = make_fake_device(capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    work = build_workload(SETTINGS)
    profiler = WorkloadProfiler(device, work, SETTINGS)
    measurement = profiler.measure(calibrate=False)
    model, optimizer = profiler.model, profiler.optimizer
    torch_device = torch.device(device.torch_device)
    # Note [A finite prefetch budget makes the peak hold]: the offloaded plans as offcore compare runs them
    plans = {name: bounded_offload_plan(measurement.profile, plan) for name, plan in PLANS.items()}
    assert plans["offload"].prefetch.budget_bytes is not None
    measured: dict[str, int] = {}
    for name, plan in plans.items():
        with device, PlanExecutor(model, plan, device) as executor:
            for step in range(2):  # the second step runs on what the first taught the scheduler
                batch = work.make_batch(step, torch_device)
                device.synchronize()
                device.reset_peak_memory_stats()
                executor.forward_backward(batch, work.loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                device.synchronize()
            measured[name] = int(device.memory_stats().peak_allocated_bytes)
    ratios = {}
    for name, plan in plans.items():
        result, _ = measurement.predict(plan)
        ratios[name] = round(measurement.predicted_peak(result) / measured[name], 3)
        if Action.OFFLOAD in plan.actions:
            # Note [The worst peak within the prefetch budget]: whatever the copies' timing, not above it
            # (within the 3 % the layers' model misses by when nothing moves: checkpoint's 0.974)
            bound = max(measurement.predicted_peak(result), result.worst_peak_bytes)
            assert measured[name] <= 1.03 * bound, (name, measured[name], bound)
    assert all(abs(ratio - 1.0) <= 0.10 for ratio in ratios.values()), ratios


def test_the_predicted_timeline_holds_every_term_of_the_predicted_step(make_fake_device: Any) -> None:
    device = make_fake_device(capacity="1GiB", h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s")
    work = build_workload(SETTINGS)
    measurement = WorkloadProfiler(device, work, SETTINGS).measure(calibrate=False)
    plans = (
        Plan(["offload", "keep", "recompute", "keep"]),
        Plan.keep_all(4, microbatches=2),
        # one copy at a time: forwards wait for their copies, and a wait splits a forward's span (Note
        # [The simulator caps forward's copies in flight]); the head still runs once per micro-batch
        Plan.uniform(4, "offload", microbatches=2, max_inflight=0),
    )
    # a link far slower than forward makes saves, whatever the measured times (1 MiB/s)
    slow_link = replace(measurement.profile, d2h_bandwidth=2**20, h2d_bandwidth=2**20)
    for plan in plans:
        if plan.max_inflight == 0:
            measurement = replace(measurement, profile=slow_link)
        result, predicted_s = measurement.predict(plan)
        if plan.max_inflight == 0:
            assert result.exposed_wait_s > 0
            assert len([e for e in result.events if e.kind == "forward"]) > 4 * plan.microbatches  # split by waits
        timeline, memory = predicted_step_series(result, measurement)
        heads = [name for _, name, _, _ in timeline if name.startswith("forward:head+loss")]
        assert len(heads) == plan.microbatches
        assert max(end for _, _, _, end in timeline) == pytest.approx(predicted_s)
        names = {name.split("#")[0] for _, name, _, _ in timeline}
        assert {"forward:head+loss", "backward:head+loss", "optimizer"} <= names
        assert memory[-1][0] == pytest.approx(predicted_s)
        assert max(level for _, level in memory) == measurement.predicted_peak(result)
        compute = sorted((start, end) for stream, _, start, end in timeline if stream == "compute")
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(compute, compute[1:], strict=False))  # one stream
    assert simulate(measurement.profile, Plan.keep_all(4)).peak_bytes >= measurement.peak_bytes


KIND_PLANS = {
    "optimizer-offload": Plan.keep_all(4, optimizer="offload"),
    "optimizer+activation-offload": Plan.uniform(4, "offload", optimizer="offload"),
    "param-stream": Plan.uniform(4, "offload", optimizer="offload", parameters="stream"),
}


def test_predicted_peaks_of_the_optimizer_and_parameter_strategies_are_within_10_percent(make_fake_device: Any) -> None:
    """The real OffloadOptimizer / offload_parameters, as ``offcore compare`` builds them, against the model.

    Each strategy runs on its own fake device, with compare's prefetch budget, and is predicted on
    the profile's link (as above)."""
    from offcore_torch.compare.runs import _optimizer_for
    from offcore_torch.compare.settings import DTYPES

    work = build_workload(SETTINGS)
    profiler_device = make_fake_device(capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    base = WorkloadProfiler(profiler_device, work, SETTINGS).measure(calibrate=False)
    ratios = {}
    for name, kind_plan in KIND_PLANS.items():
        plan = bounded_offload_plan(base.profile, kind_plan)
        device = make_fake_device(capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
        torch_device = torch.device(device.torch_device)
        with device:
            model = work.build(SETTINGS.seed).to(device=torch_device, dtype=DTYPES[SETTINGS.dtype])
            model, optimizer, handle = _optimizer_for(model, plan, device, SETTINGS)
        try:
            with device, PlanExecutor(model, plan, device) as executor:
                for step in range(3):  # later steps run on what the first taught the schedulers
                    batch = work.make_batch(step, torch_device)
                    device.synchronize()
                    device.reset_peak_memory_stats()
                    executor.forward_backward(batch, work.loss)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
                    del batch
                measured = int(device.memory_stats().peak_allocated_bytes)
        finally:
            optimizer.close()
            if handle is not None:
                handle.discard()
            del model, optimizer, handle
        result, _ = base.predict(plan)
        ratios[name] = round(base.predicted_peak(result) / measured, 3)
        if Action.OFFLOAD in plan.actions:  # Note [The worst peak within the prefetch budget]
            assert measured <= 1.03 * max(base.predicted_peak(result), result.worst_peak_bytes), (name, measured)
    # param-stream: its measured peak moves with when the fake device's copy threads get the CPU
    # (1.1 to 2.2 MiB over runs on a loaded 2-core host; the run with its activations' D2H landing
    # late peaks highest): the prediction is checked to be conservative, never more than 10 % under
    stream = ratios.pop("param-stream")
    assert stream >= 0.9, (stream, ratios)
    assert all(abs(ratio - 1.0) <= 0.10 for ratio in ratios.values()), ratios


def test_the_simulated_parameter_round_feeds_the_events_a_real_offload_parameters_step_feeds(
    make_fake_device: Any,
) -> None:
    """Note [Parameter streaming drives a ResidencyScheduler]: the same event names as a real round.

    ``offload_parameters(record=True)`` keeps each step's scheduler log; a steady-state round (the
    third step's) is compared with the simulated round of a four-layer step."""
    import offcore_torch

    from offcore.sim import StepProfile
    from offcore.sim.profile import LayerProfile
    from offcore.sim.replay import replay

    device = make_fake_device(capacity="64MiB")
    with device:
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        handle = offcore_torch.offload_parameters(model, device, record=True)
        try:
            for _ in range(3):
                model(torch.randn(8, 64, device=device.torch_device)).square().mean().backward()
            handle.release()  # ends the third round (the next one would begin at the next forward)
            schedules = handle.schedules
        finally:
            handle.remove()
    real = schedules[2]  # the third round: learnt from the second
    real_names = {name for name, _, _ in real["log"]}
    assert replay(list(real["log"]), **real["settings"]) == list(real["actions"])

    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 0, grad_bytes=64 * 65 * 4) for i in range(4)]
    profile = StepProfile(layers, param_bytes=4 * 64 * 65 * 4, h2d_bandwidth=64 * 65 * 4 / 1.5)
    simulated = simulate(profile, Plan.keep_all(4, parameters="stream"), record_schedule=True)
    sim_names = {name for name, _, _ in simulated.parameter_schedule_log}
    optional = {"reloaded", "awaited", "device_in_use"}  # a use with no prefetch held; a capacity reading
    assert real_names - optional == sim_names - optional, (real_names, sim_names)
    # the round's start registers every use of the step (forward, then backward in reverse) as the runtime's
    registered = [args[2] for name, args, _ in real["log"] if name == "register"]
    assert registered == [args[2] for name, args, _ in simulated.parameter_schedule_log if name == "register"]
