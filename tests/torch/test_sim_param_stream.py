"""The simulator's parameter-streaming step time against the real offload_parameters (issue 12: within 15 %).

A step is made link-bound on the fake device (a slow H2D link and 1 ms per copy: 70-90 % of
the step is the emulated link, whose copies take ``latency + bytes / bandwidth`` of real time,
never less), so the ratio compared is set by the model's copies — how many, how large, when —
and not by the host's speed. Every constant comes from measurements (the profiled step, the
profiler's link and per-copy latency, the runtimes' overheads), none is written here.

The runtime is given the budget the simulator models (twice a layer's parameters): its own
objects are modules, the simulator's layers (Note [Parameter streaming drives a
ResidencyScheduler]), and a budget of two modules leaves its link idle between module copies
in a way the layer model does not see (``benchmarks/sim_vs_measured.py`` shows the default).
The model with one latency per layer (before Note [Parameter copies pay one latency each])
predicts more than the tolerance apart from this one, so the tolerance can fail (it measured
1.2-1.6 × under it; with the parameters outside the layers not copied, 1.12-1.21 ×).

Under load: the optimizer's overhead is a wall-time difference of medians (12-84 ms between runs
on a loaded host with 5 rounds), so it is measured over more rounds here (``OVERHEAD_ROUNDS``);
the measured side is the fastest step after the warm-up: a busy host only adds time to a step
bound by the emulated link (its copies never take less than ``latency + bytes / bandwidth``), so
the fastest of several steps is a fair estimator of the unloaded step, and the median is not.
The link's H2D bandwidth, a two-point fit, moved 15-20 MB/s between runs (a 75 ms swing in the
prediction): the median of ``LINK_FITS`` fits is taken.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from offcore_torch import offload_parameters
from offcore_torch.compare.compare import WorkloadProfiler, measure_kind_overheads
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.link import measure_link
from offcore_torch.compare.runs import _release_optimizer
from offcore_torch.compare.settings import CompareSettings, build_workload
from offcore_torch.optimizer.optimizer import OffloadOptimizer

from offcore.sim import Plan

TOLERANCE = 0.15
SETTINGS = CompareSettings(batch=2, seq_len=16, layers=4, d_model=128, heads=4, vocab=128, warmup=1, iters=2)
PLAN = Plan.keep_all(4, optimizer="offload", parameters="stream")
OVERHEAD_ROUNDS = 15  # timed rounds of measure_kind_overheads (its default 5 moves with the host's load)
LINK_FITS = 5  # link measurements; the one with the median H2D bandwidth is taken
STEPS, WARMUP = 7, 2  # the first steps teach the schedulers


@pytest.mark.slow  # docs/testing.md, "Test budget": timed link-bound steps (~18 s); param-stream's peak: test_sim_memory.py, its model: tests/core/test_sim_kinds.py
def test_parameter_streaming_step_is_predicted_within_15_percent(make_fake_device: Any) -> None:
    torch.set_num_threads(1)
    work = build_workload(SETTINGS)
    unlimited = make_fake_device(capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    profiler = WorkloadProfiler(unlimited, work, SETTINGS)
    # the median of three profiled steps: one step that a busy host stalls would set every layer's time
    first = sorted((profiler.measure() for _ in range(3)), key=lambda m: m.profile.compute_s)[1]
    optimizer_overhead, stream_overhead = measure_kind_overheads(
        unlimited, work, SETTINGS, first, lambda *_: None, rounds=OVERHEAD_ROUNDS
    )
    layer_params = max(layer.param_bytes for layer in first.profile.layers)
    budget = 2 * layer_params
    device = make_fake_device(capacity="1GiB", h2d_bandwidth="16MiB/s", d2h_bandwidth="64MiB/s", latency="1ms")
    with device:  # the link fit's slope between two sizes moves 15-20 MB/s run to run: the median of several
        links = sorted((measure_link(device, repeats=3) for _ in range(LINK_FITS)), key=lambda m: m.h2d_bandwidth)
    link = links[len(links) // 2]
    assert 0.5e-3 < link.latency_s < 5e-3  # the small copies see the emulated 1 ms (the fit need not)
    profile = first.profile.with_link(**link.as_profile_fields())
    profile = replace(
        profile,
        optimizer_offload_overhead_s=optimizer_overhead,
        parameter_stream_overhead_s=stream_overhead,
        parameter_budget_bytes=budget,
    )
    measurement = replace(first, profile=profile, link=link)

    torch_device = torch.device(device.torch_device)
    with device:
        model = work.build(SETTINGS.seed).to(torch_device)
        handle = offload_parameters(model, device, budget=budget)
        optimizer = OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=device, lr=SETTINGS.lr)
    times = []
    copied: list[int] = []  # H2D bytes per step after the warm-up
    copies: list[int] = []  # H2D copies per step after the warm-up
    try:
        with device, PlanExecutor(model, PLAN, device) as executor:
            for step in range(STEPS):
                before = handle.stats()
                batch = work.make_batch(step % 2, torch_device)
                device.synchronize()
                start = time.perf_counter()
                executor.forward_backward(batch, work.loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                device.synchronize()
                times.append(time.perf_counter() - start)
                if step >= WARMUP:
                    after = handle.stats()
                    copied.append(after.h2d_bytes - before.h2d_bytes)
                    copies.append(after.h2d_copies - before.h2d_copies)
        stats = handle.stats()
    finally:
        _release_optimizer(optimizer, handle)
    measured = min(times[WARMUP:])  # a busy host only adds time to a link-bound step (the docstring)
    result, predicted = measurement.predict(PLAN)
    print(
        f"overheads: optimizer {optimizer_overhead * 1e3:.1f} ms, streaming {stream_overhead * 1e3:.1f} ms; link {link}"
    )
    assert result.h2d_busy_s > 0.6 * predicted, ("the check needs a link-bound step", result.summary())
    assert stats.h2d_copies > 0 and stats.unplanned == 0
    # the simulated copies are the runtime's (Note [Backward's first parameters stay after forward in
    # the simulator]); which step the next round's first copies are counted in depends on timing, so
    # the median step's bytes are compared, within one small module's (the layer/module granularity)
    runtime_bytes = statistics.median(copied)
    print(
        f"H2D per step: runtime {copied} B {copies} copies, simulated {result.h2d_bytes} B {result.parameter_h2d_copies} copies"
    )
    assert abs(result.h2d_bytes - runtime_bytes) <= 0.02 * runtime_bytes, (copied, result.h2d_bytes)
    assert abs(result.parameter_h2d_copies - statistics.median(copies)) <= 2, (copies, result.parameter_h2d_copies)
    ratio = measured / predicted
    print(f"measured {measured * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms, ratio {ratio:.3f}")
    assert abs(ratio - 1.0) <= TOLERANCE, (measured, predicted, times)
    one_latency_per_layer = replace(
        measurement,
        profile=replace(profile, layers=[replace(layer, param_copies=1) for layer in profile.layers]),
    )
    naive = one_latency_per_layer.predict(PLAN)[1]
    print(f"one latency per layer: predicted {naive * 1e3:.1f} ms, ratio {measured / naive:.3f}")
    assert predicted / naive - 1.0 > TOLERANCE, (predicted, naive)  # the tolerance can fail


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "--offcore-backend=cpu"])
