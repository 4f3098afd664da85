"""The simulator's NVMe tier against a real ``OffloadOptimizer(tier="nvme")`` step on the fake device (issue 13).

The NVMe links are measured by :func:`offcore.bandwidth.measure_nvme_link` on a tier in the same
directory, the rest of the profile as ``offcore compare`` measures it; nothing is written here.
Checked, per step of the steady state:

- the bytes read from and written to the tier: predicted = measured within 0.1 % (the states, once
  each way; the profile's state bytes count AdamW's scalar steps, which stay in memory);
- the optimizer's host bytes (fp32 masters, gradients and the bounce buffers of three groups):
  within 10 % of the pools' measured peak;
- the step time: the disk here is a real one and the host is shared, so each round profiles a
  step and then runs one step of the NVMe tier and one of the host tier (paired, as
  ``benchmarks/sim_vs_measured.py``), each divided by its prediction from that round's profile;
  the median NVMe / host ratio of the two is within 25 % of 1 (what the NVMe part of the model
  adds is right), and the NVMe tier's own median within 35 % of 1 (the whole model, on a loaded
  2-core host). When the host tier itself is more than 30 % off its prediction the machine is too
  loaded for step times and that part is skipped, saying so (the bytes are checked regardless).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from offcore_torch.compare.compare import WorkloadProfiler, measure_kind_overheads
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.link import measure_link
from offcore_torch.compare.settings import CompareSettings, build_workload
from offcore_torch.optimizer.optimizer import OffloadOptimizer

from offcore.bandwidth import measure_nvme_link
from offcore.kinds import Direction
from offcore.nvme import NvmeTier
from offcore.sim import Plan

SETTINGS = CompareSettings(batch=2, seq_len=16, layers=4, d_model=256, heads=4, vocab=128, warmup=1, iters=2)
PLANS = {tier: Plan.keep_all(4, optimizer="offload", optimizer_tier=tier) for tier in ("host", "nvme")}
ROUNDS = 6  # timed steps of each, interleaved; the first two teach the schedulers


@pytest.mark.slow  # docs/testing.md, "Test budget": six timed rounds of real steps (~20 s); the NVMe model: tests/core/test_sim_nvme.py
def test_an_nvme_optimizer_step_is_predicted(make_fake_device: Any, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    work = build_workload(SETTINGS)
    device = make_fake_device(capacity="4GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    profiler = WorkloadProfiler(device, work, SETTINGS)
    first = sorted((profiler.measure() for _ in range(3)), key=lambda m: m.profile.compute_s)[1]
    optimizer_overhead, _ = measure_kind_overheads(device, work, SETTINGS, first, lambda *_: None)
    with NvmeTier(tmp_path, budget="512MiB") as probe:
        nvme_link = measure_nvme_link(probe, max_bytes="32MiB")
    with device:
        link = measure_link(device, repeats=2)
    kinds = {"optimizer_offload_overhead_s": optimizer_overhead}
    profile = first.profile.with_link(**link.as_profile_fields()).with_nvme_link(nvme_link)
    measurement = replace(first, profile=replace(profile, **kinds), link=link)

    torch_device = torch.device(device.torch_device)
    built = {}
    with device:
        for tier in PLANS:
            model = work.build(SETTINGS.seed).to(torch_device)
            extra = {"tier": "nvme", "nvme_path": str(tmp_path)} if tier == "nvme" else {}
            built[tier] = (model, OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=device, **extra))
    ratios: dict[str, list[float]] = {tier: [] for tier in PLANS}
    try:
        with device:
            executors = {tier: PlanExecutor(built[tier][0], PLANS[tier], device).__enter__() for tier in PLANS}
            for step in range(ROUNDS):
                if step == 2:
                    built["nvme"][1].ledger.reset_step()
                # paired: each round predicts from a step profiled right before its steps (the host's load then)
                fresh = profiler.measure(link=link)
                fresh = replace(fresh, profile=replace(fresh.profile.with_nvme_link(nvme_link), **kinds))
                for tier, (_, optimizer) in built.items():
                    batch = work.make_batch(step % 2, torch_device)
                    device.synchronize()
                    start = time.perf_counter()
                    executors[tier].forward_backward(batch, work.loss)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
                    seconds = time.perf_counter() - start
                    if step >= 2:
                        ratios[tier].append(seconds / fresh.predict(PLANS[tier])[1])
            for executor in executors.values():
                executor.__exit__(None, None, None)
        optimizer = built["nvme"][1]
        copies = optimizer.ledger.copies
        read, written = copies[Direction.N2H].bytes, copies[Direction.H2N].bytes
        host_bytes = optimizer._pool.peak_used_bytes + optimizer._state_pool.peak_used_bytes
    finally:
        for _, optimizer in built.values():
            optimizer.close()

    steps = ROUNDS - 2
    results = {tier: measurement.predict(plan) for tier, plan in PLANS.items()}
    result, _ = results["nvme"]
    for moved, predicted in ((read, result.nvme_read_bytes), (written, result.nvme_write_bytes)):
        # the profile's state bytes hold AdamW's scalar steps too (4 bytes a parameter), kept in memory
        assert abs(moved / (steps * predicted) - 1.0) <= 1e-3, (read, written, steps, predicted)
    assert abs(host_bytes / result.optimizer_host_bytes - 1.0) <= 0.10, (host_bytes, result.optimizer_host_bytes)
    median = {tier: statistics.median(values) for tier, values in ratios.items()}
    print(f"measured / predicted step: {median}; host bytes {host_bytes} / {result.optimizer_host_bytes}")
    assert results["nvme"][1] > results["host"][1]  # the disk's reads and writes are on the step's path
    if abs(median["host"] - 1.0) > 0.30:
        # the optimizer runtime's wall-time overhead and the host worker's share of two cores move
        # with the machine's load (load 4-7 from other jobs made the host tier 1.3-2.5 x its
        # prediction): a step-time check then says nothing about the NVMe model
        pytest.skip(f"the host is too loaded for step times: the host tier ran {median['host']:.2f} x its prediction")
    paired = statistics.median(n / h for n, h in zip(ratios["nvme"], ratios["host"], strict=True))
    assert abs(paired - 1.0) <= 0.25, ratios
    assert abs(median["nvme"] - 1.0) <= 0.35, ratios
