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
#    the outputs of ``empty``-family operators run while the device is active (with the
#    allocator accounting, every allocation an operator makes on the device, before the
#    operator writes it: Note [Counting device memory with allocations] in tracking.py).
# 3. Released memory is poisoned: host-pool buffers when they return to the pool
#    (``dev.host_pool``), and any buffer a binding hands to ``dev.poison`` when it is
#    done with it.
# 4. Every copy that crosses the link is delayed by a random extra 0..jitter seconds
#    (seeded by ``seed``; drawn at enqueue on the calling thread, so a run is
#    reproducible), so a read that only works because copies are fast stops working.
# 5. Memory freed while a copy still uses it is poisoned, and the copy delivers poison
#    (Note [Use after free]); each such free is a *violation* the device records.
# 6. Two copies on different streams that touch the same bytes (one of them writing)
#    must be ordered by the program (an event waited on, a synchronize): one that is not
#    is a violation however the copies happened to run (Note [Copies ordered by the program]).
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

# Note [Copies ordered by the program]
# Poison shows a missing wait only when the racing copy has not landed yet; on a fast
# CPU a consumer that forgot to wait for its producer usually reads landed data. So the
# sanitizer also checks *order*, as CUDA's racecheck and torch's CUDA sanitizer do, from
# what the program asked for, never from timing. Every stream has a vector clock (the
# compute stream, i.e. the host, too). Enqueueing a copy ticks its stream's clock;
# ``record_event`` stamps the event with its stream's clock; ``wait_event`` /
# ``wait_stream`` join the event's clock into the waiting stream's; the host *observing*
# completion (``event.synchronize()``, ``event.query()`` returning True,
# ``stream.synchronize()``, a true ``stream.query()``) joins into the compute stream's
# clock, and everything the host enqueues afterwards comes after what it observed. A copy
# B on stream S is ordered after an earlier copy A when S's clock or the host's covers
# A's tick. If B reads bytes A writes, or writes bytes A reads or writes, and B is not
# ordered after A, that is an ``unordered`` violation, found when B is enqueued: a
# missing cross-stream wait is caught on every run, whether or not the copies overlapped
# in time. Copies the host has observed are forgotten (nothing enqueued later can race
# with them). Tensor operators on the compute stream are checked against the copies in
# flight instead (Note [Operators checked against copies in flight]).

# Note [Operators checked against copies in flight]
# Poison makes an operator that reads a copy's destination too early compute NaN, but NaN
# is only a symptom: a test sees a wrong number, or nothing at all (a reader that overwrites
# what it read, a NaN that a max() drops), and nobody is told which copy and which operator
# raced. So, as torch's CUDA sanitizer (``torch.cuda._sanitizer``) does for kernels, a
# dispatch mode (``offcore_cpu.op_check``, torch buffers, ``check_ops=True``: the default
# with ``sanitize=True``) sees every torch operator the host runs and what it accesses: an
# argument the operator's schema marks written (``Tensor(a!)``: in place, ``out=``) is a
# write, any other tensor argument a read, except views (``Tensor(a)``: the result aliases
# it, no byte is read), factory functions reading only metadata (``new_*``, ``*_like``) and
# in-place metadata operators (``set_``, ``resize_``, ``t_`` ...). Such an operator runs
# on the compute stream, i.e. the host, which is ordered after a copy only once it
# observed the copy complete (``event.synchronize()``, ``current_stream().wait_event``, a
# true ``query()``, ``stream.synchronize()``, ``dev.synchronize()``: Note [Copies ordered
# by the program]); a copy still in flight has not completed, so nothing orders the
# operator after it. An operator that writes bytes an in-flight copy reads or writes, or
# reads bytes it writes, is an ``access-in-flight`` violation naming the operator, the
# argument (its dtype, shape and bytes), the copy (number, direction, stream) and both
# streams; reading a copy's source is fine (both read). The operator still runs (and reads
# poison): the record fails the test at ``dev.check_sanitizer()``, not in the middle of
# it. Each copy reports an operator once per argument role. In flight means between
# ``copy_`` and the moment its bytes landed (``Sanitizer.start`` / ``finish``): with gates
# (Note [Gates]) a test makes the race certain; without them it is seen when the copy
# happens to be slow enough (jitter, a slow link). Copies are indexed by the storage of
# each side (``_OPS_INDEX``), so an operator pays a dict look-up per tensor argument while
# any copy is in flight, and nothing but the mode's own call when none is.
# Not seen: operators on other threads than those with a sanitized device created or
# entered (the mode is per thread), operators under ``torch._C._DisableTorchDispatch``
# (the device's and the binding's own bookkeeping), code compiled by ``torch.compile``
# (the mode ignores compile internals, so compiled kernels run unchecked), and a copy
# that landed but was never waited for (that race shows only on a GPU).

    >>> sanitizer = Sanitizer(enabled=True, seed=0, jitter=2e-3)
    >>> 0.0 <= sanitizer.draw_jitter() <= 2e-3
    True
"""

from __future__ import annotations

import random
import threading
from typing import Any

from offcore.kinds import Direction

__all__ = ["Sanitizer", "Flight", "Ordering", "flights_on", "any_in_flight"]


class Flight:
    """One sanitized copy from ``copy_`` until its bytes landed (Note [Use after free]).

    ``dst`` / ``src`` are what the copy moves: the device's own alias for a device side,
    the caller's buffer for a host side. ``on_device`` tells which sides are device
    memory; ``ranges`` the byte ranges of both sides; ``lost`` the sides found freed or
    released (``"src"`` / ``"dst"``), each reported once.
    """

    __slots__ = (
        "number",
        "stream",
        "direction",
        "nbytes",
        "dst",
        "src",
        "on_device",
        "ranges",
        "lost",
        "ops",
        "keys",
        "sanitizer",
        "reported",
        "label",
    )

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
        # the storage of each side, for the operator check (Note [Operators checked against copies in flight])
        self.keys = {"dst": _storage_key(dst), "src": _storage_key(src)} if ops.family == "torch" else None
        self.sanitizer: Sanitizer | None = None
        self.reported: set[tuple[str, str, str]] = set()
        self.label: str | None = None  # host work declared with Sanitizer.host_writes: what it is

    def describe(self) -> str:
        if self.label is not None:
            return f"host work ({self.label}, {self.nbytes} bytes, {self.stream})"
        return f"copy #{self.number} ({self.direction.value}, {self.nbytes} bytes, stream {self.stream!r})"


def _storage_key(buffer: Any) -> int | None:
    """The identity of a torch buffer's storage (its ``StorageImpl``), or None where it has none."""
    try:
        return int(buffer.untyped_storage()._cdata)
    except Exception:  # a tensor without a storage of its own: not indexed
        return None


# Note [Operators checked against copies in flight]: storage key -> (flight, side) of every
# sanitized copy in flight whose device checks operators, across devices (the dispatch mode
# is one per thread, not one per device). Changed under _INDEX_LOCK; read without it.
_OPS_INDEX: dict[int, list[tuple[Flight, str]]] = {}
_INDEX_LOCK = threading.Lock()


def flights_on(key: int) -> list[tuple[Flight, str]]:
    """The (flight, side) pairs in flight on the storage ``key`` (a copy of the list)."""
    hits = _OPS_INDEX.get(key)
    return list(hits) if hits else []


def any_in_flight() -> bool:
    """True while some copy whose device checks operators is in flight."""
    return bool(_OPS_INDEX)


_HOST = {"src": False, "dst": False}


def _nothing() -> None:
    return None


class Sanitizer:
    """Switch, random source and violation record of the sanitizer (Notes above).

    ``check_ops``: index the copies in flight for the operator check (Note [Operators
    checked against copies in flight]).
    """

    def __init__(self, *, enabled: bool, seed: int, jitter: float, check_ops: bool = False) -> None:
        self.enabled = enabled
        self.check_ops = enabled and check_ops
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
        self._index(flight)
        return flight

    def finish(self, flight: Flight) -> None:
        with self._lock:
            self._flights.pop(id(flight), None)
        self._unindex(flight)

    def _index(self, flight: Flight) -> None:
        if self.check_ops and flight.keys is not None:
            flight.sanitizer = self
            with _INDEX_LOCK:
                for side, key in flight.keys.items():
                    if key is not None:
                        _OPS_INDEX.setdefault(key, []).append((flight, side))

    def _unindex(self, flight: Flight) -> None:
        if flight.sanitizer is not None and flight.keys is not None:
            with _INDEX_LOCK:
                for key in flight.keys.values():
                    hits = _OPS_INDEX.get(key) if key is not None else None
                    if hits is None:
                        continue
                    hits = [hit for hit in hits if hit[0] is not flight]  # a new list: readers hold no lock
                    if hits:
                        _OPS_INDEX[key] = hits
                    else:
                        del _OPS_INDEX[key]

    def host_writes(self, ops: Any, buffers: Any, what: str) -> Any:
        """Declare host work another thread will do, writing ``buffers``; returns its finisher (call it once).

        Until then the bytes are in flight for the operator check, as a copy's destination
        (Note [Operators checked against copies in flight]); a no-op without ``check_ops``.
        """
        if not self.check_ops or ops.family != "torch":
            return _nothing
        flights = []
        for buffer in buffers:
            flight = Flight(0, "a host worker thread", Direction.H2H, ops.nbytes(buffer), ops, buffer, buffer, _HOST)
            flight.keys = {"dst": flight.keys["dst"]} if flight.keys else None
            flight.label = what
            flight.src = flight.dst = None  # nothing moves: only the bytes are watched
            self._index(flight)  # not a copy: not in copies_in_flight, never "released" under one
            flights.append(flight)

        def finish() -> None:
            while flights:
                self._unindex(flights.pop())

        return finish

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
            if not flight.ops.live(alias):  # its storage was freed or shrunk under it (resize_): no poison there
                flight.lost.add(side)
                what = "source" if side == "src" else "destination"
                self._report(
                    "use-after-free",
                    flight,
                    side,
                    f"device {what} of {flight.describe()} had its storage freed or shrunk (resize_) {when}; the "
                    "copy would have read or written memory given back. Keep the storage until the copy's event "
                    "has completed.",
                )
                continue
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
        self.report(kind, flight.number, flight.stream, flight.direction, side, message)

    def report(
        self, kind: str, number: int, stream: str, direction: Direction, side: str, message: str, **extra: Any
    ) -> None:
        with self._lock:
            self._violations.append(
                {
                    "kind": kind,
                    "copy": number,
                    "stream": stream,
                    "direction": direction.value,
                    "side": "source" if side == "src" else "destination",
                    "message": message,
                    **extra,
                }
            )

    def report_access(
        self, flight: Flight, side: str, op: str, argument: str, tensor: str, write: bool, op_stream: str
    ) -> None:
        """An operator on the host touched bytes of ``flight`` (Note [Operators checked against copies in flight])."""
        access = "write" if write else "read"
        with self._lock:
            if (op, side, access) in flight.reported:
                return
            flight.reported.add((op, side, access))
        copy_does = "reads" if side == "src" else "writes"
        verb = "writes" if write else "reads"
        effect = (
            "it reads bytes that have not landed (poison here; stale or half-copied data on a GPU)"
            if not write
            else (
                "the copy may deliver the new bytes, the old ones or a mix"
                if side == "src"
                else "what the other side writes lands over what the operator wrote"
            )
        )
        wait = (
            "Wait until that work is done first (the binding's own synchronisation)."
            if flight.label is not None
            else "Wait for the copy's event on the compute stream first (event.synchronize() or "
            "current_stream().wait_event(event))."
        )
        work = "that work" if flight.label is not None else "the copy"
        self.report(
            "access-in-flight",
            flight.number,
            flight.stream,
            flight.direction,
            side,
            f"operator {op} on {op_stream} {verb} {argument} ({tensor}) while {flight.describe()} still "
            f"{copy_does} those bytes, and nothing orders the operator after {work}: {effect}. {wait}",
            op=op,
            argument=argument,
            tensor=tensor,
            access=access,
            op_stream=op_stream,
        )

    def violations(self, *, clear: bool = False) -> list[dict[str, Any]]:
        with self._lock:
            found = list(self._violations)
            if clear:
                self._violations.clear()
        return found


Clock = dict[int, int]


class _Access:
    __slots__ = ("stream", "tick", "ranges", "number", "stream_name", "direction")

    def __init__(
        self, stream: int, tick: int, ranges: dict[str, tuple[int, int]], number: int, name: str, direction: Direction
    ) -> None:
        self.stream, self.tick, self.ranges = stream, tick, ranges
        self.number, self.stream_name, self.direction = number, name, direction


def _join(into: Clock, other: Clock | None) -> None:
    if other:
        for key, value in other.items():
            if into.get(key, 0) < value:
                into[key] = value


class Ordering:
    """Vector clocks of one sanitized device's streams (Note [Copies ordered by the program]).

    Stream ids: 0 is the compute stream (the host); copy streams get theirs from
    :meth:`new_stream_id`. Streams and events call the ``record`` / ``wait`` /
    ``observe`` methods; the device calls :meth:`copy` for every copy it enqueues.

        >>> order = Ordering()
        >>> a, b = order.new_stream_id(), order.new_stream_id()
        >>> order.copy(a, {"src": (0, 8), "dst": (100, 108)}, 1, "a", Direction.H2D)
        []
        >>> [c.number for c, side in order.copy(b, {"src": (100, 108), "dst": (200, 208)}, 2, "b", Direction.D2D)]
        [1]
    """

    COMPUTE = 0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._clocks: dict[int, Clock] = {self.COMPUTE: {}}
        self._accesses: list[_Access] = []

    def new_stream_id(self) -> int:
        with self._lock:
            sid = self._next
            self._next += 1
            self._clocks[sid] = {}
            return sid

    def record(self, stream: int) -> Clock:
        """The clock an event recorded on ``stream`` now carries."""
        with self._lock:
            return dict(self._clocks[stream])

    def wait(self, stream: int, clock: Clock | None) -> None:
        """``stream`` waits on an event stamped ``clock`` (compute: the host blocks on it)."""
        if clock:
            with self._lock:
                _join(self._clocks[stream], clock)

    def observe(self, clock: Clock | None) -> None:
        """The host saw work stamped ``clock`` complete: everything it enqueues later comes after it."""
        if clock:
            with self._lock:
                _join(self._clocks[self.COMPUTE], clock)

    def observe_stream(self, stream: int) -> None:
        """The host saw everything enqueued so far on ``stream`` complete."""
        with self._lock:
            _join(self._clocks[self.COMPUTE], self._clocks[stream])

    def copy(
        self, stream: int, ranges: dict[str, tuple[int, int]], number: int, name: str, direction: Direction
    ) -> list[tuple[_Access, str]]:
        """Tick ``stream`` for a copy touching ``ranges`` (``src`` read, ``dst`` written).

        Returns the earlier copies it conflicts with and is not ordered after, with the
        side of *this* copy that conflicts.
        """
        with self._lock:
            clock = self._clocks[stream]
            tick = clock.get(stream, 0) + 1
            clock[stream] = tick
            host = self._clocks[self.COMPUTE]
            conflicts: list[tuple[_Access, str]] = []
            kept: list[_Access] = []
            for earlier in self._accesses:
                if host.get(earlier.stream, 0) >= earlier.tick:
                    continue  # observed by the host: nothing enqueued from now on can race with it
                kept.append(earlier)
                if clock.get(earlier.stream, 0) >= earlier.tick:
                    continue  # ordered by the program
                side = _conflict(ranges, earlier.ranges)
                if side is not None:
                    conflicts.append((earlier, side))
            kept.append(_Access(stream, tick, ranges, number, name, direction))
            self._accesses = kept
            return conflicts


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _conflict(new: dict[str, tuple[int, int]], old: dict[str, tuple[int, int]]) -> str | None:
    """The side of ``new`` that conflicts with ``old`` (read-write, write-read, write-write), or None."""
    if _overlap(new["src"], old["dst"]):
        return "src"
    if _overlap(new["dst"], old["dst"]) or _overlap(new["dst"], old["src"]):
        return "dst"
    return None
