"""``benchmarks/inflight_cap.py`` runs end to end on a small model and its bound holds for every cap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "inflight_cap.py"


@pytest.mark.slow  # docs/testing.md, "Test budget": the benchmark end to end (~13 s); the cap and its bound: test_offload_inflight.py
@pytest.mark.offcore_backend("cpu")
def test_the_benchmark_runs_and_every_cap_holds() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--width", "64", "--depth", "6", "--rows", "256", "--steps", "1"]
        + ["--d2h-bandwidth", "16MiB/s", "--caps", "none", "128KiB", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for cap in ("128KiB", "0"):
        assert f"- held: max_inflight={cap}:" in done.stdout
    assert "EXCEEDED" not in done.stdout
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"keep-all", "max_inflight=none", "max_inflight=0"} <= set(rows)
