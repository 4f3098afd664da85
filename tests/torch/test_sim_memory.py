"""The simulator's memory model against the fake device: each strategy's predicted peak within 10 %.

Memory on the fake device is the backend's own accounting. A device copy of a saved
tensor is freed when its device-to-host copy landed, so an offloaded step's peak depends
on how long copies take while the step runs: on the fake device a copy issued during
forward lands about a millisecond later even on an unlimited link (the runtime's own
link estimate shows it as latency), which the idle link measurement of the profile does
not see. The prediction is therefore made on the link the runtime measured during these
steps (one link estimate for the runtime and the simulator, issue 10). Step times are
not compared here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from offcore_torch.compare import CompareSettings, WorkloadProfiler, build_workload, predicted_step_series
from offcore_torch.executor import PlanExecutor
from offcore_torch.runtime import runtime_for

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
    measured: dict[str, int] = {}
    for name, plan in PLANS.items():
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
    runtime = runtime_for(device)
    link = {
        "d2h_bandwidth": runtime.d2h_link.bandwidth,
        "h2d_bandwidth": runtime.h2d_link.bandwidth,
        "latency_s": (runtime.d2h_link.latency + runtime.h2d_link.latency) / 2,
    }
    measurement = replace(measurement, profile=measurement.profile.with_link(**link))
    ratios = {}
    for name, plan in PLANS.items():
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
    for plan in (Plan(["offload", "keep", "recompute", "keep"]), Plan.keep_all(4, microbatches=2)):
        result, predicted_s = measurement.predict(plan)
        timeline, memory = predicted_step_series(result, measurement)
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

    Each strategy runs on its own fake device, and is predicted on the link its runtime measured
    during its steps (as above)."""
    from offcore_torch.compare import DTYPES, _optimizer_for

    work = build_workload(SETTINGS)
    profiler_device = make_fake_device(capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    base = WorkloadProfiler(profiler_device, work, SETTINGS).measure(calibrate=False)
    ratios = {}
    for name, plan in KIND_PLANS.items():
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
        measurement = replace(base, profile=base.profile.with_link(**_runtime_link(device)))
        result, _ = measurement.predict(plan)
        ratios[name] = round(measurement.predicted_peak(result) / measured, 3)
    # param-stream: its measured peak moves with when the fake device's copy threads get the CPU
    # (1.1 to 2.2 MiB over runs on a loaded 2-core host; the run with its activations' D2H landing
    # late peaks highest): the prediction is checked to be conservative, never more than 10 % under
    stream = ratios.pop("param-stream")
    assert stream >= 0.9, (stream, ratios)
    assert all(abs(ratio - 1.0) <= 0.10 for ratio in ratios.values()), ratios


def _runtime_link(device: Any) -> dict[str, float]:
    """The runtime's link estimate; the fake device's unlimited link where it has none (no activation copies)."""
    runtime = runtime_for(device)
    d2h, h2d = runtime.d2h_link, runtime.h2d_link
    return {
        "d2h_bandwidth": d2h.bandwidth or float("inf"),
        "h2d_bandwidth": h2d.bandwidth or float("inf"),
        "latency_s": ((d2h.latency or 0.0) + (h2d.latency or 0.0)) / 2,
    }


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
