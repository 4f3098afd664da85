"""The fake device's copies: ``copy_`` and ``copy_many``, injected faults, and the copy log.

:class:`Copies` is a part of :class:`~offcore_cpu.device.FakeDevice` (its base class): the
device's memory, streams and sanitizer live in ``device.py``, what a copy does with them here.
A copy is checked (both sides plain tensors or arrays of the same size: Note [Raw pointers see
checked tensors only]), numbered (Note [Injected copy faults]), and then runs on the calling
thread (the compute stream; an idle copy stream: Note [Inline copies on an idle stream], Note
[The small copy's fast path]) or as one work item on its stream's worker, which books the link
(bandwidth and latency), moves the bytes and completes the copy's event.

    >>> import numpy as np, offcore
    >>> dev = offcore.device("cpu", buffers="numpy")
    >>> host, on_device = dev.allocate(64, "pinned"), dev.allocate(64, "device")
    >>> dev.copy_(host, on_device, stream=dev.new_stream()).synchronize()
    >>> dev.copy_log()[-1]["direction"]
    'd2h'
    >>> dev.close()
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from time import perf_counter as _now
from typing import Any, NoReturn

from offcore.errors import ConfigurationError
from offcore.kinds import Direction, Tier
from offcore.ledger import Ledger
from offcore_cpu.arena import MemoryArena
from offcore_cpu.buffers import NUMPY_OPS, BufferOps, describe, ops_for
from offcore_cpu.errors import InjectedFault
from offcore_cpu.gates import GateSet
from offcore_cpu.link import Link
from offcore_cpu.options import FaultMode, parse_fail_copy, parse_fault_mode
from offcore_cpu.sanitizer import Flight, Sanitizer
from offcore_cpu.streams import ComputeStream, FakeEvent, WorkerStream, landed_event

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_DEVICE, _PINNED = Tier.DEVICE, Tier.PINNED

__all__ = ["Copies"]

_NOTHING = contextlib.nullcontext()

# Copies up to this size run on the calling thread when their stream is idle and the
# sanitizer is off (Note [Inline copies on an idle stream]); larger ones keep overlapping
# with compute on a worker thread.
_INLINE_COPY_LIMIT = 1 << 20
# a copy's direction by (source on the device, destination on the device)
_DIRECTIONS = {
    (True, False): Direction.D2H,
    (False, True): Direction.H2D,
    (True, True): Direction.D2D,
    (False, False): Direction.H2H,
}
# Note [The copy log holds no tracked objects]
# The copy log is a ring of the last copy_log_limit (4096) copies, one tuple per copy. A tuple holding
# a Direction (an enum member: an object the garbage collector tracks) stays tracked, survives the young
# collections into the oldest generation, and each one counted there brings the next full collection
# (of every object of the program, ~100 ms) closer. The ring holds each direction's value (a str), so
# its tuples hold only strings and numbers: the collector untracks them at their first collection.
_BY_VALUE = {direction.value: direction for direction in Direction}
# a fast-path copy's direction by its checker's known bits, when it knows both sides (torch_buffers.SmallPair:
# 1, 2 the destination, the source on the device; 4, 8 in host memory), indexed by those four bits (None: a side
# the device looks up)
_BY_KNOWN: tuple[Direction | None, ...] = tuple(
    {1 | 2: Direction.D2D, 1 | 8: Direction.H2D, 4 | 2: Direction.D2H, 4 | 8: Direction.H2H}.get(bits)
    for bits in range(16)
)


class Copies:
    """:class:`~offcore_cpu.device.FakeDevice`'s copy methods (a base class of it; see the module docstring)."""

    # the device's parts these methods use, made by FakeDevice.__init__
    ledger: Ledger
    _label: str
    _closed: bool
    _ops: BufferOps
    _arena: MemoryArena
    _link: Link
    _sanitizer: Sanitizer
    _compute: ComputeStream
    _streams: weakref.WeakSet[WorkerStream]
    _gates: GateSet
    _copy_log: collections.deque[tuple[Any, ...]]
    _fault_lock: threading.Lock
    _copies: int
    _fault: tuple[int, FaultMode, str] | None
    _fault_at: int
    _small_pair: Callable[[Any, Any], tuple[int, int, int, int] | None] | None
    _memmove: Callable[[int, int, int], Any]
    _reserve: dict[Direction, Callable[[int, float], tuple[float, float] | None]]

    # the device's methods they call (device.py)
    def _check_open(self, what: str) -> None:
        raise NotImplementedError

    def _untracked(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _on_device(self, ops: BufferOps | None, buffer: Any) -> bool:
        raise NotImplementedError

    def holds(self, buffer: Any) -> bool:
        raise NotImplementedError

    # -- copies --------------------------------------------------------------------------
    def direction(self, dst: Any, src: Any) -> Direction:
        """The direction of a copy from ``src`` to ``dst`` (by :meth:`holds`)."""
        return Direction.between(_DEVICE if self.holds(src) else _PINNED, _DEVICE if self.holds(dst) else _PINNED)

    # Note [The small copy's fast path]
    # Most copies a binding makes are small plain tensors between device and host memory on an idle
    # copy stream, with the sanitizer off: they run inline (Note [Inline copies on an idle stream]).
    # copy_'s general path asks each question of them through a helper per concern (the family's
    # ops, the plain and liveness checks twice per side, the arena per side, the gates, the link),
    # about 12 us of Python per copy for a memmove of 16 KiB. A device made without the sanitizer
    # and with torch buffers first asks its ``_small_pair`` checker (torch_buffers.small_pair_checker),
    # which answers every check the general path makes of two exact ``torch.Tensor`` sides in one
    # pass, and which side is device memory (or declines: then the general path runs, checks again
    # and reports what is wrong). With the allocator hook that pass is one call into the hook
    # (``small_pair`` in _alloc_hook.cpp: the questions asked of the TensorImpls, and the hook's own
    # table for the device's side; a Python call per question cost ~1.5 us a copy), and the bytes
    # move with the hook's ``move_bytes``; with the dispatch accounting it is TorchBuffers.small_pair
    # and the arena. copy_ then numbers the copy (the armed fault is due when the number is
    # ``_fault_at``), books the link (the direction's reserver: Note [A direction's route is built
    # once] in link.py) and moves the bytes under the stream's lock exactly as the inline path does,
    # in one flat block (it runs twice per offloaded activation), falling back to the general path's
    # fault handling and queueing where that would (``_copy_held``, ``_enqueue_copy``). What it skips
    # is only what cannot apply without the sanitizer: no jitter, no flight, no ordering check. A
    # closed copy gate (tests) queues the copy; a closed device has no checker (``close`` drops it),
    # so its copies go down the general path, which refuses them.
    def copy_(self, dst: Any, src: Any, *, stream: Any, start_event: Any = None) -> FakeEvent:
        """Enqueue ``dst[...] = src`` on ``stream``; the returned event completes when the data landed.

        ``start_event`` (optional) is recorded on ``stream`` right before the copy, after the
        checks, so it times the copy alone: a queued copy completes it itself when its stream
        reaches it (no separate work item, so no worker hand-off between the two is timed).

        Buffers are both numpy arrays or both torch tensors with the same number of bytes;
        either may be a typed or non-contiguous view if the other is contiguous. On a copy
        stream the copy occupies the link for ``latency + nbytes / bandwidth``; on the compute
        stream it runs on the calling thread before returning. An injected fault makes one
        call fail (Note [Injected copy faults]).
        """
        small = self._small_pair  # None once the device is closed, or with the sanitizer
        if small is None or start_event is not None or type(stream) is not WorkerStream:
            return self._copy_checked(dst, src, stream, start_event)
        pair = small(dst, src) if stream._compute is self._compute else None  # a copy stream of this device
        if pair is None:
            return self._copy_checked(dst, src, stream, start_event)
        # the pair checked in one pass: Note [The small copy's fast path]
        nbytes, dst_at, src_at, known = pair
        direction = _BY_KNOWN[known] or self._direction_of(dst, src, known)
        with self._fault_lock:  # _count_copy, inlined (Note [Injected copy faults])
            number = self._copies = self._copies + 1
            armed = number == self._fault_at and self._disarm()
        state = stream._state
        if armed or (self._gates._copy_gates and self._gates.any_closed_for(state, direction)):
            return self._copy_held(dst, src, direction, nbytes, stream, number, armed)
        with state.lock:  # the inline copy (Note [Inline copies on an idle stream]): book, move, log
            if not (state.pending or state.error is not None or state.closed):
                enqueued = _now()
                span = self._reserve[direction](nbytes, state.busy_until)
                if span is not None:  # None: a queued copy holds the link
                    start, end = span
                    self._memmove(dst_at, src_at, nbytes)
                    state.busy_until = end  # never earlier: a booking starts at busy_until or later
                    # the log's tuple holds the direction's value: Note [The copy log holds no tracked objects]
                    self._copy_log.append(
                        (stream.name, direction._value_, nbytes, enqueued, start, end, 0.0, number, src_at, dst_at)
                    )
                    self.ledger.record_copy(direction, nbytes, seconds=end - start)
                    return landed_event(self._compute, stream.name, end)
        return self._enqueue_copy(self._ops, dst, src, direction, nbytes, 0.0, stream, number)  # a busy stream or link

    def _copy_checked(self, dst: Any, src: Any, stream: Any, start_event: Any) -> FakeEvent:
        """:meth:`copy_` of a pair the fast path did not take: every check, each concern's own helper."""
        self._check_open("copy_")
        ops = ops_for(dst)
        if ops is None or ops is not ops_for(src):
            raise ConfigurationError(
                f"copy_ needs two numpy arrays or two torch tensors, got {describe(dst)} <- {describe(src)}; "
                "convert one side (torch.from_numpy / tensor.numpy())"
            )
        nbytes = ops.nbytes(dst)
        if nbytes != ops.nbytes(src):
            raise ConfigurationError(
                f"copy_ between buffers of different sizes: {describe(dst)} holds {nbytes} bytes, "
                f"{describe(src)} holds {ops.nbytes(src)}"
            )
        if ops is NUMPY_OPS and not dst.flags.writeable:
            raise ConfigurationError(f"copy_ destination {describe(dst)} is read-only")
        src_on_device, dst_on_device = self._on_device(ops, src), self._on_device(ops, dst)
        direction = Direction.between(_DEVICE if src_on_device else _PINNED, _DEVICE if dst_on_device else _PINNED)
        compute = self._compute
        if stream is not compute and (not isinstance(stream, WorkerStream) or stream not in self._streams):
            raise ConfigurationError(
                f"copy_ needs a stream of this device (dev.new_stream() or dev.current_stream()), got {stream!r}"
            )
        number, fault = self._count_copy()
        if fault is not None:
            if fault.mode == "submit":
                raise fault  # before anything is drawn, booked or enqueued
            return self._enqueue_fault(ops, dst, nbytes, stream, fault)
        sanitizer = self._sanitizer
        jitter = sanitizer.draw_jitter() if sanitizer.enabled and self._link.crosses_link(direction) else 0.0
        state = None if stream is compute else stream._state
        inline = (
            state is not None
            and nbytes <= _INLINE_COPY_LIMIT
            and not sanitizer.enabled
            and not self._gates.any_closed_for(state, direction)
        )
        started: Any = None  # completes start_event when a queued copy begins
        if start_event is not None:  # stamped before the copy's own tick (Note [Copies ordered by the program])
            if stream is compute or inline:
                stream.record_event(start_event)
            else:
                started = stream.record_start(start_event)
        if sanitizer.enabled:  # Note [Copies ordered by the program]
            self._check_order(ops, dst, src, direction, stream, number)
        if stream is compute:
            # Note [Plain copies need no suspension]: only the sanitizer's poisoning runs operators here
            with self._untracked() if sanitizer.enabled else _NOTHING:
                self._run_copy(ops, dst, src, direction, nbytes, jitter, compute.name, time.perf_counter(), number)
            return compute.record_event(FakeEvent(compute, enable_timing=True))
        if sanitizer.enabled:
            # Note [Use after free]: the queued copy holds device memory through aliases of its own
            with self._untracked():
                flight = Flight(
                    number, stream.name, direction, nbytes, ops, dst, src, {"src": src_on_device, "dst": dst_on_device}
                )
            sanitizer.start(flight)
            del dst, src  # the work item must not keep the caller's buffers alive
            run = functools.partial(self._run_flight, flight, jitter, state, time.perf_counter(), started)
            try:
                return stream.run_and_record(run, FakeEvent(compute, enable_timing=True))
            except BaseException:  # not enqueued (a closed stream): no flight to wait for
                sanitizer.finish(flight)
                raise
        if inline:
            # Note [Inline copies on an idle stream]
            event = stream.try_inline(
                functools.partial(self._inline_copy, ops, dst, src, direction, nbytes, stream.name, number)
            )
            if event is not None:
                return event
        return self._enqueue_copy(ops, dst, src, direction, nbytes, jitter, stream, number, started)

    def _enqueue_copy(
        self,
        ops: BufferOps,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        jitter: float,
        stream: WorkerStream,
        number: int,
        started: Any = None,
    ) -> FakeEvent:
        """Queue a copy on ``stream``'s worker: one work item runs it and completes the event (one hand-off)."""
        run = functools.partial(
            self._run_copy,
            ops,
            dst,
            src,
            direction,
            nbytes,
            jitter,
            stream.name,
            time.perf_counter(),
            number,
            stream._state,
            started,
        )
        return stream.run_and_record(run, FakeEvent(self._compute, enable_timing=True))

    def _copy_held(
        self,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        stream: WorkerStream,
        number: int,
        armed: tuple[int, FaultMode, str] | bool,
    ) -> FakeEvent:
        """A fast-path copy that does not run inline: its armed fault fires, or a closed copy gate queues it."""
        if armed:
            assert isinstance(armed, tuple)
            fault = self._injected(armed)
            if fault.mode == "submit":
                raise fault
            return self._enqueue_fault(self._ops, dst, nbytes, stream, fault)
        return self._enqueue_copy(self._ops, dst, src, direction, nbytes, 0.0, stream, number)

    def _inline_run(
        self,
        state: Any,
        name: str,
        checked: list[tuple[BufferOps, Any, Any, Direction, int]],
        addresses: list[tuple[int, int] | None],
        first: int,
    ) -> tuple[int, float | None]:
        """The leading copies of a batch that small_pair took, on the calling thread under one hold of the
        stream's lock: the link booked once per run of one direction (``Link.reserve_run``), then the bytes
        moved and logged per copy, the ledger once per direction. Returns how many ran and when the last one
        lands (0, None: none could)."""
        done = 0
        end: float | None = None
        counted: dict[Direction, list[float]] = {}
        total = len(addresses)
        log, memmove, reserve_run = self._copy_log.append, self._memmove, self._link.reserve_run
        with state.lock:
            if state.pending or state.error is not None or state.closed:
                return 0, None
            while done < total and addresses[done] is not None:
                direction = checked[done][3]
                stop = done + 1  # the run of small copies in this direction
                while stop < total and addresses[stop] is not None and checked[stop][3] is direction:
                    stop += 1
                sizes = [item[4] for item in checked[done:stop]]
                enqueued = time.perf_counter()
                spans = reserve_run(direction, sizes, state.busy_until)
                if spans is None:  # a queued copy holds the link: the rest is queued
                    break
                number = first + done
                code = direction._value_  # Note [The copy log holds no tracked objects]
                for nbytes, (start, end), (dst_address, src_address) in zip(
                    sizes, spans, addresses[done:stop], strict=True
                ):
                    memmove(dst_address, src_address, nbytes)
                    log((name, code, nbytes, enqueued, start, end, 0.0, number, src_address, dst_address))
                    number += 1
                assert end is not None
                if end > state.busy_until:
                    state.busy_until = end
                totals = counted.get(direction)
                if totals is None:
                    totals = counted[direction] = [0, 0.0, 0]
                totals[0] += sum(sizes)
                totals[1] += sum(e - s for s, e in spans)
                totals[2] += stop - done
                done = stop
        for direction, (nbytes, seconds, copies) in counted.items():
            self.ledger.record_copy(direction, int(nbytes), seconds=seconds, copies=int(copies))
        return done, end

    def _direction_of(self, dst: Any, src: Any, known: int) -> Direction:
        """The direction of a fast-path pair whose checker did not know a side (a storage neither the hook
        counts nor knows as a host buffer): that side from the arena."""
        src_on_device = True if known & 2 else False if known & 8 else self._on_device_storage(src.untyped_storage())
        dst_on_device = True if known & 1 else False if known & 4 else self._on_device_storage(dst.untyped_storage())
        return _DIRECTIONS[src_on_device, dst_on_device]

    def _on_device_storage(self, storage: Any, base: int | None = None) -> bool:
        """Whether a storage small_pair took is device memory: the arena's registered owners (host buffers)
        first, then, given ``base`` (its data pointer), the allocator hook's answer by address, then the
        arena's ``tier_of``."""
        arena = self._arena
        known = arena._allocations.get(id(storage))
        if known is not None and known.ref() is storage:
            return known.tier is _DEVICE
        owns = arena._owns
        if base is not None and owns is not None and owns(base):
            return True
        return arena.tier_of(storage) is _DEVICE

    # Note [A batch of copies is one work item]
    # A binding that streams a module's parameters copies its weight and bias (two storages)
    # back to back on one copy stream. Each queued copy_ is a work item of its own: a
    # hand-off to the stream's worker, which must win the interpreter back from the compute
    # thread at least twice per item (after taking it off the queue, after its memcpy). So
    # copy_many queues a run of copies as *one* work item: each copy still pays its own
    # latency on the link, is numbered, ledgered and logged as copy_ would, in order; only
    # the event is shared (it completes when the last copy landed). Leading copies that
    # would run inline on an idle stream still do (Note [Inline copies on an idle stream]).
    # Whatever copy_ treats specially (the sanitizer, an armed fault, a closed gate, the
    # compute stream) makes copy_many call copy_ for each pair instead: nothing is lost.
    def copy_many(self, pairs: Sequence[tuple[Any, Any]], *, stream: Any) -> FakeEvent:
        """Enqueue ``dst[...] = src`` for each ``(dst, src)`` of ``pairs``, in order, on ``stream``; the
        returned event completes when the last one landed. Each copy is checked, timed on the link and
        logged as :meth:`copy_` would; a copy stream gets them as one work item (Note [A batch of copies
        is one work item]). An optional member of the backend protocol.

            >>> done = dev.copy_many([(weight, host_w), (bias, host_b)], stream=h2d)   # doctest: +SKIP
        """
        self._check_open("copy_many")
        if not pairs:
            raise ConfigurationError("copy_many needs at least one (dst, src) pair")
        compute = self._compute
        state = None if stream is compute or not isinstance(stream, WorkerStream) else stream._state
        special = state is None or len(pairs) == 1 or self._sanitizer.enabled or stream not in self._streams
        checked: list[tuple[BufferOps, Any, Any, Direction, int]] = []
        addresses: list[tuple[int, int] | None] = []  # per checked pair: (dst, src) when small_pair took it
        if not special:
            small = self._small_pair
            gates = self._gates.any_copy_gates  # asked once: with no copy gate, no copy of the batch is held
            for dst, src in pairs:
                pair = None if small is None else small(dst, src)
                if pair is not None:  # the checks in one pass (Note [The small copy's fast path])
                    nbytes, dst_address, src_address, known = pair
                    direction = _BY_KNOWN[known] or self._direction_of(dst, src, known)
                    if gates and self._gates.any_closed_for(state, direction):
                        special = True
                        break
                    checked.append((self._ops, dst, src, direction, nbytes))
                    addresses.append((dst_address, src_address))
                    continue
                ops = ops_for(dst)
                if ops is None or ops is not ops_for(src) or ops is NUMPY_OPS:
                    special = True  # copy_ checks and reports it (numpy: its read-only check)
                    break
                nbytes = ops.nbytes(dst)
                if nbytes != ops.nbytes(src):
                    special = True
                    break
                direction = Direction.between(
                    _DEVICE if self._on_device(ops, src) else _PINNED,
                    _DEVICE if self._on_device(ops, dst) else _PINNED,
                )
                if self._gates.any_closed_for(state, direction):
                    special = True
                    break
                checked.append((ops, dst, src, direction, nbytes))
                addresses.append(None)
        if not special:
            with self._fault_lock:  # numbered together, unless a fault is armed (copy_ counts to it)
                if self._fault is None:
                    first = self._copies + 1
                    self._copies += len(checked)
                else:
                    special = True
        if special:
            event: Any = None
            for dst, src in pairs:
                event = self.copy_(dst, src, stream=stream)
            return event
        name = stream.name
        # the leading copies small_pair took: inline, under one hold of the stream's lock (Note [The small
        # copy's fast path]); then any further leading copies on the still idle stream, the general way
        at, landed = self._inline_run(state, name, checked, addresses, first)
        inline: FakeEvent | None = None
        for ops, dst, src, direction, nbytes in checked[at:]:
            if nbytes > _INLINE_COPY_LIMIT:
                break
            inline = stream.try_inline(
                functools.partial(self._inline_copy, ops, dst, src, direction, nbytes, name, first + at)
            )
            if inline is None:
                break
            at += 1
        if at == len(checked):
            if inline is not None:
                return inline
            assert landed is not None  # every copy ran in _inline_run (a batch has at least two)
            event = FakeEvent(compute, enable_timing=True)
            event._land_at(name, landed)
            return event
        enqueued = time.perf_counter()
        items = [
            (ops, dst, src, direction, nbytes, 0.0, name, enqueued, first + i, state)
            for i, (ops, dst, src, direction, nbytes) in enumerate(checked[at:], start=at)
        ]
        del checked, pairs  # the work item alone holds the buffers

        def run() -> float:
            landed = 0.0
            for item in items:
                landed = self._run_copy(*item)
            items.clear()  # the buffers go with the item, before its event completes
            return landed

        return stream.run_and_record(run, FakeEvent(compute, enable_timing=True))

    def _check_order(self, ops: BufferOps, dst: Any, src: Any, direction: Direction, stream: Any, number: int) -> None:
        """Record a sanitized copy's accesses; report the earlier copies it races with (Note [Copies ordered by the program])."""
        order = self._compute.order
        sid = order.COMPUTE if stream is self._compute else stream._sid
        ranges = {"src": ops.byte_range(src), "dst": ops.byte_range(dst)}
        for earlier, side in order.copy(sid, ranges, number, stream.name, direction):
            this = f"copy #{number} ({direction.value}, stream {stream.name!r})"
            other = f"copy #{earlier.number} ({earlier.direction.value}, stream {earlier.stream_name!r})"
            if side == "src":
                what = f"reads bytes that {other} writes"
            elif _overlaps(ranges["dst"], earlier.ranges["dst"]):
                what = f"writes bytes that {other} also writes"
            else:
                what = f"writes bytes that {other} reads"
            self._sanitizer.report(
                "unordered",
                number,
                stream.name,
                direction,
                side,
                f"{this} {what}, and nothing orders it after that copy: a missing wait_event / wait_stream "
                "between the streams (or a synchronize before enqueueing it). On a GPU it may run first.",
            )

    # -- fault injection -----------------------------------------------------------------
    # Note [Injected copy faults]
    # Tests of code that must survive a failed copy (an offload binding that frees, retries
    # or reports) need a copy that fails on demand. The device numbers its copy_ calls from
    # 1 (those that passed their argument checks); the armed fault makes one of them fail,
    # once, and is then disarmed:
    # - mode "submit": copy_ raises InjectedFault at once, before anything happens: nothing
    #   is enqueued, no link time is booked, no jitter drawn, nothing ledgered or logged.
    # - mode "stream": the copy is enqueued and its *work* raises InjectedFault when its
    #   stream reaches it, exactly as a real failure of queued work does (Note [Failures
    #   on a worker stream]): the copy's event raises StreamWorkError (InjectedFault is its
    #   __cause__), so do events recorded later on that stream, and stream.synchronize()
    #   raises it once and clears it. A small copy on an idle stream fails inline (the
    #   failure lands on its event at once, as try_inline's does). With the sanitizer the
    #   destination is poisoned when the stream reaches the copy, and stays so. No bytes
    #   move, and the failed copy is not ledgered or logged. On the compute stream a copy
    #   runs on the calling thread, so its failure is raised by copy_ itself in both modes.
    # ``fail_copy=N`` arms copy number N at creation; ``inject_copy_fault(n)`` arms the
    # n-th copy from now, replacing any fault still armed.

    def inject_copy_fault(self, nth: int | None = 1, *, mode: str = "submit") -> None:
        """Make the ``nth`` ``copy_`` call from now fail once (1: the next one; None or 0: disarm).

        ``mode="submit"``: that ``copy_`` raises :class:`~offcore_cpu.errors.InjectedFault`
        and enqueues nothing. ``mode="stream"``: the copy is enqueued and fails on its stream;
        its event raises :class:`~offcore_cpu.errors.StreamWorkError`. Replaces a fault still
        armed (``fail_copy=N`` at creation arms one the same way). Note [Injected copy faults].

            >>> dev.inject_copy_fault(2, mode="stream")       # doctest: +SKIP
        """
        n = parse_fail_copy(nth, "nth")
        fault_mode = parse_fault_mode(mode, "mode")
        source = f"dev.inject_copy_fault({n}, mode={fault_mode!r})"
        with self._fault_lock:
            self._arm(None if n is None else (self._copies + n, fault_mode, source))

    @property
    def copy_fault_armed(self) -> bool:
        """True while a fault armed by ``fail_copy`` or :meth:`inject_copy_fault` has not fired yet."""
        with self._fault_lock:
            return self._fault is not None

    def _arm(self, fault: tuple[int, FaultMode, str] | None) -> None:
        """Arm ``fault`` (None: disarm), replacing any fault still armed; with ``_fault_lock`` held."""
        self._fault = fault
        self._fault_at = 0 if fault is None else fault[0]  # copy numbers start at 1: 0 is never due

    def _disarm(self) -> tuple[int, FaultMode, str]:
        """The armed fault, disarmed: its copy (number ``_fault_at``) was just numbered; ``_fault_lock`` held."""
        fault = self._fault
        assert fault is not None
        self._arm(None)
        return fault

    def _count_copy(self) -> tuple[int, InjectedFault | None]:
        """Number this copy_ call; the error to fail it with when the armed fault is due."""
        with self._fault_lock:
            count = self._copies = self._copies + 1
            armed = count == self._fault_at and self._disarm()
        return count, self._injected(armed) if armed else None

    def _injected(self, fault: tuple[int, FaultMode, str]) -> InjectedFault:
        """The error an armed fault fails its copy with."""
        number, mode, source = fault
        return InjectedFault(
            f"copy #{number} on fake device {self._label} failed: fault injected by {source} (mode {mode!r})",
            copy_number=number,
            mode=mode,
        )

    def _enqueue_fault(self, ops: BufferOps, dst: Any, nbytes: int, stream: Any, fault: InjectedFault) -> FakeEvent:
        """A copy whose work fails on ``stream`` (mode "stream" of Note [Injected copy faults])."""
        fail = functools.partial(self._fail_copy, ops, dst, fault)
        compute = self._compute
        if stream is compute:
            with self._untracked():
                fail()  # raises: compute-stream copies run (and fail) inside copy_
        if nbytes <= _INLINE_COPY_LIMIT and not self._sanitizer.enabled:
            event = stream.try_inline(fail)  # fails inline: the event carries the failure
            if event is not None:
                return event
        return stream.run_and_record(fail, FakeEvent(compute, enable_timing=True))

    def _fail_copy(self, ops: BufferOps, dst: Any, fault: InjectedFault, *_not_before: float) -> NoReturn:
        if self._sanitizer.enabled:  # the stream reached the copy: its destination holds garbage
            ops.poison(dst)
        raise fault

    # Note [Plain copies need no suspension]
    # A copy's bytes move with ``ops.copy``; for a torch buffer that is a ``Tensor.copy_`` (an
    # operator: the accounting must not count it, so it runs inside ``_untracked()``), except
    # for small plain copies, which are one ``memmove`` (Note [Small copies keep the GIL]) that
    # no dispatch mode or allocator hook sees. ``_copy_bytes`` tries that first and suspends
    # the accounting only for the operator path; the suspension (a thread-local count, the
    # dispatch guard and the hook's ledger swapped out and back) cost about as much as the
    # memmove of 16 KiB. On the compute stream only the sanitizer's poisoning runs operators
    # around the copy, so only then is the whole copy suspended.
    def _copy_bytes(self, ops: BufferOps, dst: Any, src: Any) -> None:
        """Move the bytes of a copy, suspending the device's accounting only where an operator runs."""
        if not ops.copy_plain(dst, src):
            with self._untracked():
                ops.copy(dst, src)

    def _inline_copy(
        self,
        ops: BufferOps,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        stream_name: str,
        number: int,
        not_before: float,
    ) -> float | None:
        """Copy now on the calling thread and book the link; returns when the copy lands (None: queue it)."""
        enqueued = time.perf_counter()
        span = self._link.reserve(direction, nbytes, not_before)
        if span is None:  # a queued copy holds the link right now
            return None
        start, end = span
        self._copy_bytes(ops, dst, src)
        self._record_copy(
            stream_name, direction, nbytes, enqueued, start, end, 0.0, number, ops.address(src), ops.address(dst)
        )
        return end

    def _run_copy(
        self,
        ops: BufferOps,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        jitter: float,
        stream_name: str,
        enqueued: float,
        number: int,
        state: Any = None,
        started: Any = None,
    ) -> float:
        """A copy without the sanitizer (or on the compute stream, run by ``copy_`` itself); returns when it landed."""
        if started is not None:
            started()  # the copy's start_event: its stream reached it
        sanitize = self._sanitizer.enabled
        if sanitize:  # Note [What the sanitizer poisons, and when], point 1
            ops.poison(dst)
        if state is not None and self._gates.any_closed_for(state, direction):  # Note [Gates]
            self._gates.pass_copy(state, direction, _held(number, stream_name, direction, nbytes))
        start, end = self._link.transfer(
            direction,
            nbytes,
            functools.partial(self._copy_bytes, ops, dst, src),
            extra_delay=jitter,
            data_first=not sanitize,
        )
        self._record_copy(
            stream_name, direction, nbytes, enqueued, start, end, jitter, number, ops.address(src), ops.address(dst)
        )
        return end

    def _run_flight(self, flight: Flight, jitter: float, state: Any, enqueued: float, started: Any = None) -> float:
        """A sanitized queued copy (Note [Use after free]): checks for frees when reached, before and after landing."""
        sanitizer, ops = self._sanitizer, flight.ops
        try:
            reached = time.perf_counter()
            if started is not None:
                started()  # the copy's start_event: its stream reached it
            sanitizer.check_freed(flight, "before its stream reached it")
            if ops.live(flight.dst):  # not into a storage freed under it (reported by check_freed)
                ops.poison(flight.dst)  # Note [What the sanitizer poisons, and when], point 1
            if self._gates.any_closed_for(state, flight.direction):  # Note [Gates]
                self._gates.pass_copy(
                    state, flight.direction, _held(flight.number, flight.stream, flight.direction, flight.nbytes)
                )
                reached = time.perf_counter()  # a held copy starts when its gate opens
            start, end = self._link.transfer(
                flight.direction,
                flight.nbytes,
                functools.partial(self._land, flight),
                extra_delay=jitter,
                since=reached,  # the sanitizer's own work (poison, checks) is not link time
            )
        finally:
            sanitizer.finish(flight)
            flight.src = flight.dst = None  # the copy holds no memory once its bytes landed
        src, dst = flight.ranges["src"][0], flight.ranges["dst"][0]
        self._record_copy(
            flight.stream, flight.direction, flight.nbytes, enqueued, start, end, jitter, flight.number, src, dst
        )
        return end

    def _record_copy(
        self,
        stream_name: str,
        direction: Direction,
        nbytes: int,
        enqueued: float,
        start: float,
        end: float,
        jitter: float,
        number: int,
        src: int,
        dst: int,
    ) -> None:
        """A copy that landed, on the ledger and in the copy log (the general paths; the small copy's fast path
        writes both inline). The log's tuple holds plain values (Note [The copy log holds no tracked objects]);
        copy_log() builds the dicts only when asked."""
        self.ledger.record_copy(direction, nbytes, seconds=end - start)
        self._copy_log.append((stream_name, direction._value_, nbytes, enqueued, start, end, jitter, number, src, dst))

    def _land(self, flight: Flight) -> None:
        """Move a sanitized copy's bytes, or poison, when a side was freed or released (Note [Use after free])."""
        ops = flight.ops
        self._sanitizer.check_freed(flight, "while the copy was in flight")
        if flight.lost:  # a freed or released source delivers poison; a released destination gets poison
            if ops.live(flight.dst):
                ops.poison(flight.dst)
            return
        ops.copy(flight.dst, flight.src)
        self._sanitizer.check_freed(flight, "while its bytes were moving")
        if "src" in flight.lost and ops.live(flight.dst):
            ops.poison(flight.dst)

    def copy_log(self) -> list[dict[str, Any]]:
        """The latest completed copies, oldest first, for traces.

        A ring: it keeps the last ``copy_log_limit`` copies (an option, 4096 by default; 0
        keeps none), so it never grows with the length of a run; ``dev.ledger`` keeps the
        totals of every copy. Failed copies are not logged. Each entry: ``stream``, ``direction``
        (``"d2h"``...), ``bytes``, ``enqueued``, ``start``, ``end`` (``time.perf_counter()``
        seconds), ``emulated_seconds``, ``number`` (the copy's 1-based number among the device's
        ``copy_`` calls: the order they were issued in) and ``src`` / ``dst`` (the address of each
        side's first byte, to tell which buffers a copy moved).
        """
        duration = self._link.duration
        return [
            {
                "stream": stream_name,
                "direction": direction,
                "bytes": nbytes,
                "enqueued": enqueued,
                "start": start,
                "end": end,
                "emulated_seconds": duration(_BY_VALUE[direction], nbytes) + jitter,
                "number": number,
                "src": src,
                "dst": dst,
            }
            for stream_name, direction, nbytes, enqueued, start, end, jitter, number, src, dst in list(self._copy_log)
        ]

    def clear_copy_log(self) -> None:
        """Forget the logged copies (the ledger keeps its totals)."""
        self._copy_log.clear()


def _held(number: int, stream_name: str, direction: Direction, nbytes: int) -> dict[str, Any]:
    """What a copy gate reports about a copy it holds."""
    return {"copy": number, "stream": stream_name, "direction": direction.value, "bytes": nbytes}


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
