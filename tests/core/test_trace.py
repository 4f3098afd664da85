"""offcore.trace: Chrome-trace JSON (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from offcore.trace import TRACKS, TraceRecorder


def test_spans_instants_and_counters_become_chrome_events(tmp_path: Path) -> None:
    trace = TraceRecorder(process_name="unit")
    trace.span("compute", "forward", 100.0, 0.004, step=1)
    trace.span("d2h", "layer0", 100.001, 0.002, bytes=4096)
    trace.instant("compute", "backward starts", 100.005)
    trace.counter("device bytes", 100.002, allocated=1024)
    trace.span("nvme", "spill", 100.003, 0.001)  # a track beyond the standard four
    path = tmp_path / "trace.json"
    trace.write(path)
    data = json.loads(path.read_text())

    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == set(TRACKS) | {"nvme"}
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["forward"]["ts"] == 0.0 and spans["forward"]["dur"] == 4000.0
    assert abs(spans["layer0"]["ts"] - 1000.0) < 1e-6 and spans["layer0"]["args"] == {"bytes": 4096}
    assert spans["layer0"]["cat"] == "d2h"
    assert [e["ph"] for e in events if e["name"] == "backward starts"] == ["i"]
    assert [e["args"] for e in events if e["ph"] == "C"] == [{"allocated": 1024}]
    assert len(trace) == 5


def test_empty_trace_is_valid() -> None:
    data = TraceRecorder().to_dict()
    assert [e for e in data["traceEvents"] if e["ph"] != "M"] == []
    assert data["displayTimeUnit"] == "ms"


def test_negative_durations_are_clamped() -> None:
    trace = TraceRecorder()
    trace.span("wait", "w", 1.0, -0.5)
    (span,) = [e for e in trace.to_dict()["traceEvents"] if e["ph"] == "X"]
    assert span["dur"] == 0.0
