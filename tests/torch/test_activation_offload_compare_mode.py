"""benchmarks/activation_offload.py --compare: offcore compare's workload, offloaded as its offload strategy does."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_offload.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("activation_offload_benchmark_compare", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_compare_preset_is_offcore_compares_default_workload() -> None:
    bench = _load()
    args = bench.parse_args(["--compare"])
    assert (args.batch, args.seq_len, args.d_model, args.layers, args.heads, args.vocab) == (8, 64, 64, 4, 4, 256)
    with pytest.raises(SystemExit):
        bench.parse_args(["--compare", "--small"])


@pytest.mark.offcore_backend("cpu")
def test_the_floor_copies_the_same_storages_as_scoped_offcore(tmp_path: Path) -> None:
    bench = _load()
    out = tmp_path / "compare.json"
    assert bench.main(["--compare", "--layers", "2", "--steps", "3", "--warmup", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for scenario in report["scenarios"].values():
        rows = {row["variant"]: row for row in scenario["rows"]}
        floor = rows["copies only (cost floor)"]["offloaded_bytes"]
        assert floor > 0
        assert rows["offcore (deadline)"]["offloaded_bytes"] == floor  # the same storages, each once
        assert rows["offcore (on demand)"]["offloaded_bytes"] == floor
        assert all(row["forward_ms"] > 0 and row["forward_cpu_ms"] > 0 for row in scenario["rows"])
        assert "offcore (deadline): forward <= 1.15 x keep-all's" in {t["target"] for t in scenario["targets"]}
