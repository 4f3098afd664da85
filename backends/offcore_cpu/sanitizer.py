"""The fake device's sanitizer: make a missing wait or an early free give wrong numbers, not lucky ones.

On a CPU, a copy that a program forgot to wait for usually lands long before anyone
reads the buffer, so the bug passes every test and corrupts gradients on a GPU. With
``sanitize=True`` the fake device makes such races visible:

# Note [What the sanitizer poisons, and when]
# Poison is 0xFF in every byte: NaN for floating point, -1 for integers.
# 1. A copy's destination is poisoned when its stream *reaches* the copy, and holds
#    poison until the data lands (after the latency and the jitter below). Poisoning at
#    the stream's pace, not at enqueue time, keeps stream-ordered reuse correct: a copy
#    queued behind another that still reads the same buffer does not corrupt it.
# 2. Memory that is new but uninitialised is poisoned, as reused device memory holds
#    stale bytes on a real allocator: ``allocate(..)`` buffers of every tier, and (torch)
#    the outputs of ``empty``-family operators run while the device is active.
# 3. Released memory is poisoned: host-pool buffers when they return to the pool
#    (``dev.host_pool``), and any buffer a binding hands to ``dev.poison`` when it is
#    done with it.
# 4. Every copy that crosses the link is delayed by a random extra 0..jitter seconds
#    (seeded by ``seed``; drawn at enqueue on the calling thread, so a run is
#    reproducible), so a read that only works because copies are fast stops working.
# 5. Memory freed while a copy still uses it is poisoned, and the copy delivers poison
#    (Note [Use after free]); each such free is a *violation* the device records.
# A correct program (every read of a copy's destination ordered after the copy's
# event, every buffer kept until the copies using it landed) gives bit-identical
# results with the sanitizer on or off, and records no violation.

# Note [Use after free]
# On a GPU, ``del tensor`` hands the memory back to the caching allocator at once, even
# while a copy queued on another stream still reads or writes it (unless the program
# calls ``record_stream``, which offcore never does): the next allocation gets the
# same memory, and the copy moves somebody else's bytes. On the CPU a queued copy used
# to hold its buffers itself, so the early free was invisible. With the sanitizer:
# - every copy queued on a copy stream is *in flight* from ``copy_`` until its bytes
#   landed; the device holds its device-memory sides through aliases of its own
#   (``BufferOps.alias``), never the caller's objects;
# - when the copy's stream reaches it, before its bytes move and after they moved, the
#   device asks whether its alias is the last holder of each device side
#   (``BufferOps.sole_owner``; torch: Note [Who holds a storage]). If so, the program
#   freed it: a freed source is poisoned (the allocator handed it out again) and the
#   copy delivers poison; a freed destination is memory the copy would scribble over;
# - a host buffer returned to its pool (or handed to ``dev.poison``) while a copy in
#   flight reads or writes it is poisoned at once (point 3); a copy reading it
#   delivers poison even if the buffer was handed out again and rewritten meanwhile,
#   and a copy writing it writes poison into its new owner's bytes.
# Each case is recorded as a violation (``dev.sanitizer_violations()``, naming the
# copy, its stream, the side and when it was seen); ``dev.check_sanitizer()`` raises
# :class:`~offcore_cpu.errors.SanitizerViolation` listing them. Copies on the compute
# stream run inside ``copy_``, so they are never in flight.

    >>> sanitizer = Sanitizer(enabled=True, seed=0, jitter=2e-3)
    >>> 0.0 <= sanitizer.draw_jitter() <= 2e-3
    True
"""

from __future__ import annotations

import random
import threading
from typing import Any

from offcore.kinds import Direction

__all__ = ["Sanitizer", "Flight"]


class Flight:
    """One sanitized copy from ``copy_`` until its bytes landed (Note [Use after free]).

    ``dst`` / ``src`` are what the copy moves: the device's own alias for a device side,
    the caller's buffer for a host side. ``on_device`` tells which sides are device
    memory; ``ranges`` the byte ranges of both sides; ``lost`` the sides found freed or
    released (``"src"`` / ``"dst"``), each reported once.
    """

    __slots__ = ("number", "stream", "direction", "nbytes", "dst", "src", "on_device", "ranges", "lost", "ops")

    def __init__(
        self,
        number: int,
        stream: str,
        direction: Direction,
        nbytes: int,
        ops: Any,
        dst: Any,
        src: Any,
        on_device: dict[str, bool],
    ) -> None:
        self.number, self.stream, self.direction, self.nbytes, self.ops = number, stream, direction, nbytes, ops
        self.on_device = on_device
        self.dst = ops.alias(dst) if on_device["dst"] else dst
        self.src = ops.alias(src) if on_device["src"] else src
        self.ranges = {"dst": ops.byte_range(dst), "src": ops.byte_range(src)}
        self.lost: set[str] = set()

    def describe(self) -> str:
        return f"copy #{self.number} ({self.direction.value}, {self.nbytes} bytes, stream {self.stream!r})"


class Sanitizer:
    """Switch, random source and violation record of the sanitizer (Notes above)."""

    def __init__(self, *, enabled: bool, seed: int, jitter: float) -> None:
        self.enabled = enabled
        self.jitter = jitter
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._flights: dict[int, Flight] = {}  # by id: copies queued and not landed
        self._violations: list[dict[str, Any]] = []

    def draw_jitter(self) -> float:
        """Extra delay for the next copy in seconds (0 when the sanitizer is off)."""
        if not self.enabled or self.jitter <= 0:
            return 0.0
        with self._lock:
            return self._random.uniform(0.0, self.jitter)

    # -- copies in flight ----------------------------------------------------------------
    def start(self, flight: Flight) -> Flight:
        with self._lock:
            self._flights[id(flight)] = flight
        return flight

    def finish(self, flight: Flight) -> None:
        with self._lock:
            self._flights.pop(id(flight), None)

    def in_flight(self) -> int:
        """Sanitized copies queued or running whose bytes have not landed."""
        with self._lock:
            return len(self._flights)

    def check_freed(self, flight: Flight, when: str) -> None:
        """Record (once per side) a device side of ``flight`` that only the device still holds."""
        for side in ("src", "dst"):
            if not flight.on_device[side] or side in flight.lost:
                continue
            alias = flight.src if side == "src" else flight.dst
            if not flight.ops.sole_owner(alias):
                continue
            flight.lost.add(side)
            flight.ops.poison(alias)  # handed out again: whatever the next owner writes
            what = "source" if side == "src" else "destination"
            effect = (
                "the copy delivers poison"
                if side == "src"
                else "the copy writes into memory the allocator may have handed out again"
            )
            self._report(
                "use-after-free",
                flight,
                side,
                f"device {what} of {flight.describe()} was freed (its last reference died) {when}; {effect}. "
                "Keep the buffer until the copy's event has completed.",
            )

    def released(self, ops: Any, buffer: Any, what: str) -> None:
        """``buffer`` was released (back to its pool, or poisoned as unused): flag the copies in flight on it."""
        first, end = ops.byte_range(buffer)
        if first == end:
            return
        hits: list[tuple[Flight, str]] = []
        with self._lock:
            for flight in self._flights.values():
                if flight.ops is not ops:
                    continue
                for side, (lo, hi) in flight.ranges.items():
                    if side not in flight.lost and lo < end and first < hi:
                        flight.lost.add(side)
                        hits.append((flight, side))
        for flight, side in hits:
            role = "read" if side == "src" else "written"
            effect = "it delivers poison" if side == "src" else "it writes poison into the buffer's next owner"
            self._report(
                "released-in-flight",
                flight,
                side,
                f"{what} while {flight.describe()} still had it to be {role}; {effect}. "
                "Return a buffer only after the copies using it have completed.",
            )

    # -- violations ----------------------------------------------------------------------
    def _report(self, kind: str, flight: Flight, side: str, message: str) -> None:
        with self._lock:
            self._violations.append(
                {
                    "kind": kind,
                    "copy": flight.number,
                    "stream": flight.stream,
                    "direction": flight.direction.value,
                    "side": "source" if side == "src" else "destination",
                    "message": message,
                }
            )

    def violations(self, *, clear: bool = False) -> list[dict[str, Any]]:
        with self._lock:
            found = list(self._violations)
            if clear:
                self._violations.clear()
        return found
