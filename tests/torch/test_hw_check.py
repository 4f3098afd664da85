"""The one-call hardware check runs end to end on the fake device (its cuda/npu paths need hardware)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hw_check.py"


@pytest.mark.offcore_backend("cpu")
def test_hw_check_writes_its_reports(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("hw_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--backend", "cpu", "--quick", "--skip-suites", "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "hw_check.json").read_text())
    assert [row["bytes"] for row in report["sweep"]] == [1 << 20, 4 << 20]
    assert all(row["offcore_h2d"] > 0 and row["offcore_d2h"] > 0 for row in report["sweep"])
    for result in report["step_time"]:
        variants = result["variants"]
        assert {"keep-all", "save_on_cpu", "offcore (deadline)"} <= set(variants)
        assert all(v["status"] == "ok" for v in variants.values()), variants
        assert variants["keep-all"]["ratio_to_keep_all"] == 1.0
    assert "## Copy bandwidth" in (tmp_path / "hw_check.md").read_text()
