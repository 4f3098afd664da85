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


def test_scale_tables_print_as_markdown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("scale", None)
    import scale

    rows = [
        {"variant": "keep-all", "width": 96, "parameters": 1000, "peak_bytes": 2 << 20, "ratio": 1.0},
        {
            "variant": "all kinds (OffloadOptimizer)",
            "width": 320,
            "parameters": 11900,
            "peak_bytes": 3 << 20,
            "ratio": 11.9,
        },
    ]
    table = scale.scale_table(rows, markdown=True).splitlines()
    assert table[0] == "" and table[1].startswith("| variant | width |") and table[2].startswith("|---|")
    assert table[4] == "| all kinds (OffloadOptimizer) | 320 | 11,900 | 11.9 | 3.00 MiB |"
    assert "|" not in scale.scale_table(rows)  # the default stays fixed-width text
    timed = [
        {"variant": "keep-all", "median_s": 0.01, "ratio": 1.0, "paired_ratio": 1.0, "cpu_s": 0.012},
        {
            "variant": "params",
            "median_s": 0.0112,
            "ratio": 1.12,
            "paired_ratio": 1.115,
            "cpu_s": 0.013,
            "prefetch_hits": 40,
            "stalls": 0,
            "unplanned": 1,
            "exposed_wait_s": 0.0004,
        },
    ]
    lines = scale.time_table(timed, markdown=True).splitlines()
    assert lines[0] == "" and lines[1].startswith("| variant | step (ms) |")
    assert lines[3] == "| keep-all | 10.00 | 1.000 | 1.000 | 12.0 | - | - | - | - |"
    assert lines[4] == "| params | 11.20 | 1.120 | 1.115 | 13.0 | 40 | 0 | 1 | 0.4 |"
    assert "hits 40 stalls 0 unplanned 1 wait 0.4 ms" in scale.time_table(timed)
