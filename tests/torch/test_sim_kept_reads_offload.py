"""Note [Reads of kept tensors are triggers] (offcore/sim/simulator.py) against the runtime.

benchmarks/sim_vs_measured.py's offload plan (a 2 MiB prefetch budget, drained offloads) at batch 20
of its TinyGPT (d_model 64, sequence 64, 4 blocks): the simulated peak was 1.09 x the measured one at
batches 20 and 21 and not monotone in the batch (batch 22 below 21), because the simulator offered
reloads only at the uses of the layers' own saves, where the runtime's scheduler also runs at each read
of a kept weight: the block's second 1.25 MiB save was reloaded on demand beside a full budget instead
of prefetched within it. The profiler now measures those reads (``LayerProfile.reads_after``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_torch.compare.compare import profile_workload  # noqa: E402
from offcore_torch.compare.executor import PlanExecutor  # noqa: E402
from offcore_torch.compare.max_batch import _scaled  # noqa: E402
from offcore_torch.compare.runs import _optimizer_for  # noqa: E402
from offcore_torch.compare.settings import CompareSettings, build_workload, pcie_like_bandwidths  # noqa: E402

import offcore  # noqa: E402
from offcore.sim import Action, Plan, PrefetchPolicy, simulate  # noqa: E402

BATCH, BUDGET = 8, 2 << 20


@pytest.fixture(scope="module")
def setup() -> tuple[CompareSettings, Any, dict[str, Any]]:
    settings = CompareSettings(batch=BATCH, seq_len=64, layers=4, d_model=64, heads=4, warmup=2, iters=2, observe=False)
    unlimited = offcore.device("cpu", capacity="1TiB", d2h_bandwidth="inf", h2d_bandwidth="inf", latency=0)
    try:
        measurement = profile_workload(unlimited, build_workload(settings), settings)
    finally:
        unlimited.close()
    layers = measurement.profile.layers
    d2h, h2d, _ = pcie_like_bandwidths(
        sum(layer.saved_bytes for layer in layers) / len(layers), measurement.profile.forward_s / len(layers)
    )
    link = {"d2h_bandwidth": d2h, "h2d_bandwidth": h2d, "latency": settings.latency_s}
    profile = measurement.profile.with_link(d2h_bandwidth=d2h, h2d_bandwidth=h2d, latency_s=settings.latency_s)
    return settings, replace(measurement, profile=profile), link


def _measured_peak(settings: CompareSettings, plan: Plan, batch: int, link: dict[str, float]) -> int:
    """The device peak of the second full training step at ``batch`` (the first one warms up)."""
    device = offcore.device("cpu", capacity="64GiB", **link)
    work = build_workload(replace(settings, batch=batch))
    torch_device = torch.device(device.torch_device)
    try:
        with device:
            model = work.build(settings.seed).to(device=torch_device)
            model, optimizer, _ = _optimizer_for(model, plan, device, settings)
        with PlanExecutor(model, plan, device) as executor:
            for step in range(2):
                torch.manual_seed(settings.seed + step)
                with device:
                    data = work.make_batch(step, torch_device)
                    device.synchronize()
                    device.reset_peak_memory_stats()
                    executor.forward_backward(data, work.loss)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
        return int(device.memory_stats().peak_allocated_bytes)
    finally:
        device.close()


def test_the_profiler_counts_the_weights_read_after_a_save(setup: tuple[Any, ...]) -> None:
    _, measurement, _ = setup
    for layer in measurement.profile.layers:
        assert len(layer.reads_after) == len(layer.saved_tensors)
        # a linear layer reads its weight after its input: most of a block's nodes
        assert sum(layer.reads_after) >= 4, layer.reads_after


@pytest.mark.parametrize("batch", [20, 21, 22])
def test_the_offload_peak_under_a_2_mib_budget_is_predicted_within_3_percent(
    setup: tuple[Any, ...], batch: int
) -> None:
    settings, measurement, link = setup
    plan = Plan(
        [Action.OFFLOAD] * settings.layers,
        prefetch=PrefetchPolicy("deadline", margin_s=3600.0, budget_bytes=BUDGET),
        drain_offloads=True,
    )
    result = simulate(_scaled(measurement.profile, measurement, batch / BATCH), plan, record_events=False)
    measured = _measured_peak(settings, plan, batch, link)
    assert abs(result.peak_bytes / measured - 1.0) <= 0.03, (batch, result.peak_bytes, measured)
    # Note [The worst peak within the prefetch budget]: the bound still holds
    assert measured <= max(result.peak_bytes, result.worst_peak_bytes)
