"""Issue 14: the simulator's memory model within 10 % at ``offcore compare``'s default workload.

The small workload of tests/torch/test_sim_memory.py (d_model 32, sequence 32) hid it: at the
default one (d_model 64, sequence 64, batch 8, 4 blocks of 2 MiB of saves each) the predicted
peak of ``offload`` was 1.11-1.14 x the measured one and ``param-stream``'s 1.28 x, because the
simulator kept each offloaded block's reloaded saves on the device to the end of its backward
with the backward's net working set, where autograd frees each after its node and the runtime
holds at most its prefetch budget of them (Note [An offloaded layer's saves go as backward uses
them] in offcore/sim/simulator.py). This runs the default ``offcore compare`` for the offloading
strategies and reads its own predicted and measured figures: the peaks, and the worst peak the
plan's prefetch budget allows (Note [The worst peak within the prefetch budget]), which the
measured peak must not exceed.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from offcore.cli import main  # noqa: E402
from offcore.sim import Plan, StepProfile, simulate  # noqa: E402

STRATEGIES = ("offload", "optimizer+activation-offload", "param-stream")


@pytest.fixture(scope="module")
def default_compare(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default workload, capacity and link of ``offcore compare``; only the offloading strategies run."""
    out = tmp_path_factory.mktemp("compare") / "report"
    with contextlib.redirect_stdout(io.StringIO()):
        status = main(["compare", "--strategies", ",".join(STRATEGIES), "--no-plots", "--quiet", "--out", str(out)])
    assert status == 0
    return json.loads((Path(out) / "compare.json").read_text())


def test_offloading_strategies_peaks_are_predicted_within_10_percent(default_compare: dict[str, Any]) -> None:
    rows = {row["name"]: row for row in default_compare["strategies"]}
    profile = StepProfile.from_dict(default_compare["profile"]["profile"])  # every plan was predicted on it
    assert any(layer.gross_working_bytes for layer in profile.layers), "the profiler measures the gross working sets"
    ratios = {}
    for name in STRATEGIES:
        row = rows[name]
        assert row["status"] == "ok", (name, row["status"], row["error"])
        predicted, measured = row["predicted_peak_bytes"], row["peak_device_bytes"]
        ratios[name] = round(predicted / measured, 3)
        # Note [The worst peak within the prefetch budget]: no run of the plan peaks above it (within the
        # 3 % tests/torch/test_sim_memory.py allows the layers' model)
        result = simulate(profile, Plan.from_dict(row["plan_dict"]), record_events=False)
        bound = max(predicted, result.worst_peak_bytes)
        assert measured <= 1.03 * bound, (name, row["plan"], measured, predicted, result.worst_peak_bytes)
    assert all(abs(ratio - 1.0) <= 0.10 for ratio in ratios.values()), (ratios, default_compare["notes"])


def _peak_at(report: dict[str, Any], name: str, batch: int, make_fake_device: Any) -> int | None:
    """The device peak of ``name``'s plan at ``batch`` on the compared device (capacity and link as the
    report's), after two steps that teach its schedulers; ``None`` when it runs out of memory."""
    import torch
    from offcore_torch.compare import DTYPES, CompareSettings, _is_oom, _optimizer_for, _release_optimizer
    from offcore_torch.compare import build_workload as build
    from offcore_torch.executor import PlanExecutor

    plan = Plan.from_dict(next(row for row in report["strategies"] if row["name"] == name)["plan_dict"])
    link = report["device"]
    settings = CompareSettings(batch=batch)
    work = build(settings)
    device = make_fake_device(
        capacity=link["capacity_bytes"],
        d2h_bandwidth=link["d2h_bandwidth"],
        h2d_bandwidth=link["h2d_bandwidth"],
        latency=link["latency_s"],
    )
    torch_device = torch.device(device.torch_device)
    optimizer = handle = None
    try:
        with device:
            model = work.build(settings.seed).to(device=torch_device, dtype=DTYPES[settings.dtype])
            model, optimizer, handle = _optimizer_for(model, plan, device, settings)
        with device, PlanExecutor(model, plan, device) as executor:
            for step in range(3):
                batch_tensors = work.make_batch(step, torch_device)
                device.synchronize()
                device.reset_peak_memory_stats()
                executor.forward_backward(batch_tensors, work.loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                device.synchronize()
                del batch_tensors
        return int(device.memory_stats().peak_allocated_bytes)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        return None
    finally:
        _release_optimizer(optimizer, handle)


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_predicted_max_batch_is_within_10_percent_of_the_batch_that_runs(
    default_compare: dict[str, Any], name: str, make_fake_device: Any
) -> None:
    """``predicted_max_batch`` against real steps on the compared device: 10 % below it runs, 10 % above it
    runs out of memory. (Compare's own ``max_batch`` extrapolates two measured batch sizes linearly, Note
    [The measured max batch has two points]; under a fixed prefetch budget the peak does not grow
    linearly, and that figure overstates: 40 for param-stream, whose plan runs out of memory at 33.)"""
    predicted = next(row for row in default_compare["strategies"] if row["name"] == name)["predicted_max_batch"]
    assert predicted > 8
    below, above = int(predicted * 0.9), -(-predicted * 11 // 10)
    assert _peak_at(default_compare, name, below, make_fake_device) is not None, (name, predicted, below)
    assert _peak_at(default_compare, name, above, make_fake_device) is None, (name, predicted, above)
