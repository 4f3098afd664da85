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
measured peak must not exceed, and the predicted max batch against the measured one (real steps).
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


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_predicted_max_batch_is_within_10_percent_of_the_measured_one(
    default_compare: dict[str, Any], name: str
) -> None:
    """``predicted_max_batch`` against compare's measured ``max_batch``: the largest batch whose real training
    steps ran on the compared device, one more running out of memory (Note [The max batch is probed by real
    steps]; tests/torch/test_compare_max_batch.py checks that figure against independent steps). The
    two-point extrapolation it replaced overstated under a prefetch budget fixed in bytes: 40 for
    param-stream, whose plan runs out of memory at 33."""
    row = next(row for row in default_compare["strategies"] if row["name"] == name)
    predicted, measured = row["predicted_max_batch"], row["max_batch"]
    assert row["max_batch_source"] == "measured", (name, default_compare["notes"])
    assert [measured, True] in row["max_batch_probes"] and [measured + 1, False] in row["max_batch_probes"]
    assert measured > 8
    assert abs(predicted / measured - 1.0) <= 0.10, (name, predicted, measured, row["max_batch_probes"])
