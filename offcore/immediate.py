"""An event and a stream for synchronous backends: work is complete when it is enqueued.

A backend whose copies run on the calling thread (the torch plugin's test-only ``instant``
backend, the numpy reference backend of the core's tests) needs the protocol's
:class:`~offcore.protocols.Event` and :class:`~offcore.protocols.Stream` and nothing they
would wait for: every event is complete (an unrecorded one too), every stream is idle.
Recording stamps the time, so timing events still measure what ran between them.

    >>> from offcore.immediate import ImmediateEvent, ImmediateStream
    >>> start, end = ImmediateEvent(enable_timing=True), ImmediateEvent(enable_timing=True)
    >>> stream = ImmediateStream()
    >>> _ = stream.record_event(start); _ = stream.record_event(end)
    >>> start.query(), start.elapsed_time(end) >= 0.0
    (True, True)
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ImmediateEvent", "ImmediateStream"]


class ImmediateEvent:
    """An event that is complete as soon as it is recorded (and before: an unrecorded event is complete)."""

    __slots__ = ("enable_timing", "time")

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between two recorded timing events."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True")
        if self.time is None or end_event.time is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end_event.time - self.time) * 1000.0


class ImmediateStream:
    """A stream whose work is done when it is enqueued."""

    __slots__ = ("__weakref__",)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event or ImmediateEvent()
        event.record(self)
        return event
