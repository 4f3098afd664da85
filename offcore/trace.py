"""Chrome-trace / Perfetto JSON of compute, copies and waits (framework-neutral, no torch).

Times are seconds on any monotonic clock (``time.perf_counter``); the trace starts at
the earliest time recorded. Each track is one row ("thread") in the viewer.

    >>> from offcore.trace import TraceRecorder
    >>> trace = TraceRecorder()
    >>> trace.span("compute", "forward", 10.0, 0.004)
    >>> trace.span("d2h", "layer0", 10.001, 0.002, nbytes=4096)
    >>> [e["name"] for e in trace.to_dict()["traceEvents"] if e["ph"] == "X"]
    ['forward', 'layer0']

Open the written file in https://ui.perfetto.dev or ``chrome://tracing``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

__all__ = ["TraceRecorder", "TRACKS"]

TRACKS: tuple[str, ...] = ("compute", "d2h", "h2d", "wait")
"""The standard tracks, in display order; others may be added freely."""


class TraceRecorder:
    """Collects complete spans, instants and counters; writes Chrome-trace JSON."""

    def __init__(self, *, process_name: str = "offcore") -> None:
        self.process_name = process_name
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {name: i + 1 for i, name in enumerate(TRACKS)}
        self._lock = threading.Lock()

    def _tid(self, track: str) -> int:
        tid = self._tracks.get(track)
        if tid is None:
            tid = self._tracks[track] = len(self._tracks) + 1
        return tid

    def span(self, track: str, name: str, start: float, duration: float, **args: Any) -> None:
        """A complete event on ``track`` from ``start`` lasting ``duration`` seconds."""
        with self._lock:
            self._events.append(
                {"ph": "X", "name": name, "tid": self._tid(track), "t": start, "d": max(duration, 0.0), "args": args}
            )

    def instant(self, track: str, name: str, at: float, **args: Any) -> None:
        """A point event on ``track``."""
        with self._lock:
            self._events.append({"ph": "i", "name": name, "tid": self._tid(track), "t": at, "args": args})

    def counter(self, name: str, at: float, **values: float) -> None:
        """A counter sample (drawn as a graph), e.g. device bytes over time."""
        with self._lock:
            self._events.append({"ph": "C", "name": name, "tid": 0, "t": at, "args": values})

    def __len__(self) -> int:
        return len(self._events)

    def to_dict(self) -> dict[str, Any]:
        """The trace as Chrome's JSON object format (``traceEvents``, times in microseconds)."""
        with self._lock:
            events = list(self._events)
            tracks = dict(self._tracks)
        origin = min((e["t"] for e in events), default=0.0)
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": self.process_name}}
        ]
        for track, tid in tracks.items():
            out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        for e in events:
            item: dict[str, Any] = {
                "ph": e["ph"],
                "name": e["name"],
                "pid": 1,
                "tid": e["tid"],
                "ts": (e["t"] - origin) * 1e6,
                "args": e["args"],
            }
            if e["ph"] == "X":
                item["dur"] = e["d"] * 1e6
                item["cat"] = next((t for t, i in tracks.items() if i == e["tid"]), "")
            elif e["ph"] == "i":
                item["s"] = "t"
            out.append(item)
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON file (overwrites ``path``)."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh)
