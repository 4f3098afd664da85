"""The activation-offload benchmark runs end to end on a tiny workload and reports every target."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_offload.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("activation_offload_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_workload_defaults_and_the_small_preset() -> None:
    bench = _load()
    default = bench.parse_args([])
    assert (default.d_model, default.seq_len, default.heads) == (512, 256, 8)
    small = bench.parse_args(["--small"])
    assert (small.d_model, small.seq_len, small.heads, small.layers) == (128, 64, 4, 4)
    assert bench.parse_args(["--small", "--layers", "2"]).layers == 2  # explicit flags win over the preset
    with pytest.raises(SystemExit):
        bench.parse_args(["--d-model", "0"])


@pytest.mark.offcore_backend("cpu")
def test_benchmark_runs_both_scenarios_and_checks_every_target(tmp_path: Path) -> None:
    bench = _load()
    out = tmp_path / "offload.json"
    argv = ["--small", "--layers", "1", "--steps", "3", "--warmup", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["offloaded_bytes_per_step"] > 0
    window, unlimited = report["scenarios"]["a_window"], report["scenarios"]["b_unlimited"]
    names = [row["variant"] for row in window["rows"]]
    assert names == [
        "keep-all",
        "save_on_cpu",
        "save_on_cpu (emulated link)",
        "offcore (on demand)",
        "offcore (deadline)",
    ]
    assert all(row["offloaded_bytes"] > 0 for row in window["rows"] if row["variant"].startswith("offcore"))
    assert window["targets"][0]["target"].startswith("precondition")
    assert {t["target"] for t in window["targets"]} >= {
        "offcore (deadline): exposed wait <= 3 % of step",
        "offcore (deadline): step <= 1.05 x keep-all",
    }
    assert {t["target"] for t in unlimited["targets"]} == {
        "offcore (on demand): overhead <= 10 % of keep-all",
        "offcore (deadline): overhead <= 10 % of keep-all",
    }
    assert all(isinstance(t["met"], bool) for t in window["targets"] + unlimited["targets"])
