"""The example of docs/parameter-offload.md runs as written, and benchmarks/scale.py runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_docs_example_runs() -> None:
    doc = (ROOT / "docs" / "parameter-offload.md").read_text()
    example = re.search(r"```python\n(.*?)```", doc, re.S)
    assert example is not None
    exec(compile(example.group(1), "docs/parameter-offload.md", "exec"), {})


def test_scale_benchmark_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("scale", None)
    import scale

    out = tmp_path / "scale.json"
    argv = ["--capacity", "4MiB", "--quantum", "64", "--max-width", "256", "--depth", "2", "--json", str(out)]
    argv += [
        "--variants",
        "keep-all",
        "all kinds (OffloadOptimizer)",
        "--time-width",
        "64",
        "--rounds",
        "1",
        "--block",
        "1",
    ]
    assert scale.main(argv) == 0
    import json

    result = json.loads(out.read_text())
    rows = result["scale"]["rows"]
    assert rows[0]["variant"] == "keep-all" and rows[0]["width"] > 0
    assert rows[1]["parameters"] > rows[0]["parameters"]
    assert [r["variant"] for r in result["time"]["rows"]] == [
        "keep-all",
        "params",
        "params, persist_below=64KiB",
        "params, unlimited link",
        "params, prefetch=asap",
    ]
