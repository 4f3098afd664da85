"""``benchmarks/sim_vs_measured.py`` runs end to end on a tiny workload and measures each max batch by real steps.

Issue 14: the benchmark's measured max batch comes from ``offcore compare``'s probes (Note [The
max batch is probed by real steps]), printed beside the simulator's figure with the ratio and
the 10 % check. The check's outcome is not asserted (it is the benchmark's finding); that the
figure is a measurement (the probes bracket it) and that the column is reported, are.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_vs_measured.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("sim_vs_measured_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # docs/testing.md, "Test budget": the benchmark end to end; predicted vs measured max batch: test_sim_memory_default_compare.py
@pytest.mark.offcore_backend("cpu")
def test_the_max_batch_is_probed_and_compared_with_the_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load()
    out = tmp_path / "sim.json"
    argv = ["--rounds", "1", "--warmup", "1", "--layers", "2", "--d-model", "32", "--seq-len", "32"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pred/meas" in printed and "within 10%" in printed
    assert "strategies' predicted max batch within 10% of the measured one" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {row["strategy"] for row in rows} >= {"baseline", "checkpoint", "offload", "param-stream"}
    for row in rows:
        name, batch, probes = row["strategy"], row["max_batch"], row["max_batch_probes"]
        assert row["max_batch_source"] == "measured", (name, probes)
        fits = [size for size, ok in probes if ok]
        fails = [size for size, ok in probes if not ok]
        multiple = 2 if "m=2" in row["plan"] else 1
        # the probes bracket the figure: it ran (or is 0), the next multiple ran out of memory
        assert batch == max(fits, default=0) and batch % multiple == 0, (name, probes)
        assert min(fails) == batch + multiple, (name, probes)
        predicted = row["predicted_max_batch_alone"]
        assert row["max_batch_ratio"] == pytest.approx(predicted / batch), name
        assert row["max_batch_within_target"] == (abs(predicted / batch - 1) <= bench.MAX_BATCH_TARGET), name
        assert f"{name:<28} {predicted:>9} {batch:>8} " in printed, name
