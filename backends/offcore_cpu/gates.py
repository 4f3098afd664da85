"""Gates: hold a fake-device stream, or its copies in mid-flight, until a test opens them.

A test of a race must not depend on when threads happen to run. A gate makes "this copy
has not landed yet" a fact instead of a likelihood:

# Note [Gates]
# - ``dev.gate(stream=None, direction=None)`` is a *copy gate*: every copy on a copy
#   stream (that stream only, that direction only, when given) that its stream reaches
#   while the gate is closed stops in mid-flight: its destination already holds poison
#   (with the sanitizer) and its source has not been read. It goes on when the gate
#   opens. ``gate.wait_held(n)`` blocks until ``n`` copies are held, so the test knows
#   the copy is in flight before it does the racy thing. Copies on the compute stream
#   run inside ``copy_`` on the calling thread and are never held (that would deadlock).
#   While a matching gate is closed, small copies are not run inline (they are queued).
# - ``dev.hold(stream)`` is a *stream gate*: the stream stops where it is (everything
#   enqueued later waits) until the gate opens; ``wait_held(1)`` tells that the stream
#   reached it.
# - A gate is a context manager that opens on exit, so a failing test never leaves a
#   stream blocked; ``dev.close()`` opens every gate of the device first. A gate left
#   closed for ``timeout`` seconds (60 by default) opens itself and records it
#   (``gate.timed_out``); leaving the ``with`` block then raises ``GateTimeoutError``:
#   a forgotten gate fails the test instead of hanging the run.

    >>> gate = Gate("example", timeout=1.0)
    >>> gate.closed
    True
    >>> gate.open(); gate.closed
    False
"""

from __future__ import annotations

import threading
import time
from typing import Any

from offcore.kinds import Direction
from offcore_cpu.errors import GateTimeoutError

__all__ = ["Gate", "GateSet"]


class Gate:
    """A latch that holds copies (or a stream) until :meth:`open` (Note [Gates])."""

    def __init__(
        self, label: str, *, timeout: float = 60.0, stream: Any = None, direction: Direction | None = None
    ) -> None:
        if not timeout > 0:
            from offcore.errors import ConfigurationError

            raise ConfigurationError(f"a gate's timeout must be positive seconds, got {timeout!r}")
        self.label = label
        self.timeout = float(timeout)
        self.stream = stream  # a stream's worker state, or None: every copy stream
        self.direction = direction
        self.timed_out = False
        self.passed = 0  # items that went through the gate
        self._opened = threading.Event()
        self._cond = threading.Condition()
        self._held: list[dict[str, Any]] = []
        self._created = time.monotonic()

    # -- the test's side -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._opened.is_set()

    def open(self) -> None:
        """Let everything held (and everything that comes later) through."""
        self._opened.set()
        with self._cond:
            self._cond.notify_all()

    def held(self) -> list[dict[str, Any]]:
        """What waits at the gate now (copies: ``copy``, ``stream``, ``direction``, ``bytes``)."""
        with self._cond:
            return [dict(item) for item in self._held]

    def wait_held(self, count: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Block until at least ``count`` items wait at the gate; returns them. Raises ``GateTimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._held) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.closed:
                    raise GateTimeoutError(
                        f"gate {self.label!r}: {len(self._held)} item(s) held after {timeout:g} s, expected {count}"
                        + ("" if self.closed else " (the gate is open)")
                    )
                self._cond.wait(remaining)
            return [dict(item) for item in self._held]

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.open()
        if self.timed_out and exc_type is None:
            raise GateTimeoutError(
                f"gate {self.label!r} was left closed for {self.timeout:g} s and opened itself; open it in the test"
            )

    def __repr__(self) -> str:
        return f"<Gate {self.label!r} {'closed' if self.closed else 'open'} held={len(self._held)}>"

    # -- the worker's side ---------------------------------------------------------------
    def matches(self, stream: Any, direction: Direction) -> bool:
        return (
            self.closed
            and (self.stream is None or self.stream is stream)
            and (self.direction is None or self.direction is direction)
        )

    def pass_(self, item: dict[str, Any]) -> None:
        """Wait at the gate (on a worker thread) until it opens or times out."""
        with self._cond:
            self._held.append(item)
            self._cond.notify_all()
        try:
            if not self._opened.wait(max(0.0, self._created + self.timeout - time.monotonic())):
                self.timed_out = True
                self.open()
        finally:
            with self._cond:
                self._held.remove(item)
                self.passed += 1
                self._cond.notify_all()


class GateSet:
    """The gates of one device: copy gates consulted by every queued copy, all opened by ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copy_gates: list[Gate] = []
        self._all: list[Gate] = []

    def add(self, gate: Gate, *, copies: bool) -> Gate:
        with self._lock:
            self._all = [g for g in self._all if g.closed] + [gate]
            if copies:
                self._copy_gates = [g for g in self._copy_gates if g.closed] + [gate]
        return gate

    @property
    def any_copy_gates(self) -> bool:
        """Whether any copy gate was added and may still be closed (False: no copy can be held)."""
        return bool(self._copy_gates)

    def any_closed_for(self, stream: Any, direction: Direction) -> bool:
        """Whether a copy on ``stream`` in ``direction`` would be held now (cheap when no gate exists)."""
        gates = self._copy_gates
        return bool(gates) and any(g.matches(stream, direction) for g in gates)

    def pass_copy(self, stream: Any, direction: Direction, item: dict[str, Any]) -> None:
        """Called by a copy when its stream reaches it: wait at every closed matching copy gate."""
        gates = self._copy_gates
        if not gates:
            return
        for gate in list(gates):
            if gate.matches(stream, direction):
                gate.pass_(item)

    def open_all(self) -> None:
        with self._lock:
            gates, self._all, self._copy_gates = self._all, [], []
        for gate in gates:
            gate.open()
