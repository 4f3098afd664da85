"""Streams and events of the CPU fake device, with ``torch.Stream`` / ``torch.Event`` semantics.

Two kinds of stream:

- :class:`ComputeStream` is the calling host thread. CPU operators are synchronous, so
  when an event is recorded on it all prior compute has already run: the event is
  complete at once. Waiting on it *blocks the calling thread* until the event
  completes; that is how compute waits for a host-to-device copy.
- :class:`WorkerStream` is an in-order work queue served by one daemon thread (started
  on first use). Work items (copies, host functions) run strictly in enqueue order;
  an event recorded on it completes when the worker reaches it; ``wait_event``
  enqueues a wait, so later work on the stream starts only after the event.

    >>> compute = ComputeStream()
    >>> copies = WorkerStream(compute, name="copy")
    >>> out = []
    >>> copies.launch_host_func(lambda: out.append(1))
    >>> done = copies.record_event()
    >>> done.synchronize(); out
    [1]
    >>> copies.close()

# Note [Inline copies on an idle stream]
# Handing a copy to a worker thread costs far more than a small memcpy: the worker must
# win the GIL from the compute thread to start and again to finish. So when a stream has
# nothing queued, the fake device (without its sanitizer) runs a small copy on the
# calling thread at once and emulates only its *time*: the copy's event is a _DueMarker
# that completes when the link would have delivered the bytes (latency + bytes /
# bandwidth after the link and the stream are free), the stream's ``busy_until`` moves
# to that time, and anything queued later on the stream (copies, waits, host functions,
# event recordings) starts only after it. Completion times, stream order, link occupancy
# and ``elapsed_time`` are those of the queued path; the bytes merely arrive early, which
# a correct reader cannot observe (it waits for the event). The sanitizer turns this
# off, so that missing waits still read poisoned memory.

# Note [Event times are the stream's, not the scheduler's]
# A worker thread that finished a copy may get the interpreter back only milliseconds later
# when other threads run Python; an event completed then would time the wait for the
# interpreter, not the copy. So a queued event's timestamp is when its stream *reached* it:
# when the work before it finished (a copy: when it landed on the emulated link), or when
# it was recorded if the stream was idle then. ``elapsed_time`` between events around a
# copy is then the copy's emulated time whatever the scheduling; only ``synchronize`` and
# ``query`` still see the host's real delays.

# Note [Failures on a worker stream]
# An exception inside queued work must not vanish with the worker thread. The worker
# keeps the first failure as the stream's pending error and carries on (later markers
# still complete, so no waiter hangs). Every event recorded after the failure carries
# it: ``Event.synchronize()`` / ``Event.query()`` raise StreamWorkError, and a stream
# that waits on such an event inherits the failure. ``Stream.synchronize()`` raises it
# once and clears it. This is how an asynchronous CUDA error surfaces at the next
# synchronisation instead of where it happened.

# With the sanitizer the compute stream carries an ``order`` (offcore_cpu.sanitizer.Ordering):
# events are stamped with their stream's vector clock when recorded, waits join clocks, and
# the host observing completion joins into the compute stream's clock (Note [Copies ordered
# by the program] in sanitizer.py). Without it ``order`` is None and none of this runs.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from queue import Empty
from typing import Any

from offcore.errors import ConfigurationError
from offcore_cpu.errors import EventNotReadyError, StreamWorkError
from offcore_cpu.link import reduce_timer_slack, sleep_until

__all__ = ["FakeEvent", "ComputeStream", "WorkerStream"]


_new = object.__new__
_now = time.perf_counter


class _Marker:
    """One recording of an event; completes when its stream reaches it.

    A latch on a plain lock (held from creation until ``complete``): creating one costs
    a lock, not the condition variable of a ``threading.Event``, and waiting blocks in
    the lock (GIL released), never polls. Several waiters pass one after another.
    """

    __slots__ = ("_latch", "is_set", "timestamp", "error", "stream_name")

    def __init__(self, stream_name: str, *, completed: bool = False) -> None:
        self.stream_name = stream_name
        self.error: BaseException | None = None
        if completed:
            self._latch: threading.Lock | None = None
            self.timestamp: float | None = time.perf_counter()
            self.is_set = True
        else:
            self._latch = threading.Lock()
            self._latch.acquire()
            self.timestamp = None
            self.is_set = False

    @staticmethod
    def landing_at(stream_name: str, due: float) -> _Marker:
        """The recording of work that already ran on the calling thread and lands at ``due``: complete now if
        ``due`` has passed (a :class:`_Landed`), else a :class:`_DueMarker`."""
        now = _now()
        if due > now:
            return _DueMarker(stream_name, due)
        marker = _new(_Landed)
        marker.timestamp = now
        return marker

    def complete(self, error: BaseException | None, at: float | None = None) -> None:
        """Complete now; ``at``: when the work really finished, if earlier (a copy's emulated landing)."""
        now = time.perf_counter()
        self.timestamp = now if at is None else min(at, now)
        self.error = error
        self.is_set = True
        if self._latch is not None:
            self._latch.release()

    def wait(self) -> None:
        """Block (GIL released) until :meth:`complete` ran."""
        latch = self._latch
        if not self.is_set and latch is not None:
            latch.acquire()
            latch.release()

    def raise_error(self) -> None:
        if self.error is not None:
            raise StreamWorkError(
                f"work queued on stream {self.stream_name!r} before this point failed: "
                f"{type(self.error).__name__}: {str(self.error).rstrip('.')}. The data that work should have produced is not valid."
            ) from self.error


class _DueMarker(_Marker):
    """A recording whose work already ran on the calling thread and *lands* at ``due``.

    Work run inline on an idle stream (Note [Inline copies on an idle stream]) has moved
    its bytes already; what remains is the emulated time. The marker counts as complete
    once ``time.perf_counter()`` reaches ``due``; waiting sleeps until then (GIL released).
    """

    __slots__ = ("due",)

    def __init__(self, stream_name: str, due: float) -> None:  # no super().__init__: no latch needed
        self.stream_name = stream_name
        self.error = None
        self._latch = None
        self.due = due

    @property  # type: ignore[override]
    def is_set(self) -> bool:
        return time.perf_counter() >= self.due

    @property  # type: ignore[override]
    def timestamp(self) -> float | None:
        return self.due if time.perf_counter() >= self.due else None

    def complete(self, error: BaseException | None, at: float | None = None) -> None:  # pragma: no cover
        raise AssertionError("an inline recording completes by itself at its due time")

    def wait(self) -> None:
        sleep_until(self.due)


class _Landed(_Marker):
    """A recording whose work ran on the calling thread and had landed when it was recorded.

    Made once per inline copy (Note [Inline copies on an idle stream]) without ``__init__``: only its
    ``timestamp`` (when it was recorded) is its own; the rest of a completed, successful recording is
    the class's (its work never fails later, so its stream's name is never reported).
    """

    __slots__ = ()
    is_set = True  # type: ignore[assignment]
    error = None  # type: ignore[assignment]
    _latch = None  # type: ignore[assignment]
    stream_name = ""  # type: ignore[assignment]


class FakeEvent:
    """A marker in a fake-device stream (``torch.Event`` semantics).

    An event that was never recorded counts as complete. Re-recording replaces the
    marker; a wait already enqueued keeps waiting for the marker it saw.

        >>> compute = ComputeStream()
        >>> start, end = FakeEvent(compute, enable_timing=True), FakeEvent(compute, enable_timing=True)
        >>> start.record(); end.record()
        >>> start.elapsed_time(end) >= 0.0
        True
    """

    # an event is made per copy: slots make it (and landed_event) cheaper than an instance dict
    __slots__ = ("_compute", "enable_timing", "_marker", "_clock", "__weakref__")

    def __init__(self, compute: ComputeStream, *, enable_timing: bool = False) -> None:
        self._compute = compute
        self.enable_timing = enable_timing
        self._marker: _Marker | None = None
        self._clock: dict[int, int] | None = None  # the sanitizer's stamp of the last recording

    def _new_marker(self, stream_name: str, *, completed: bool = False) -> _Marker:
        marker = _Marker(stream_name, completed=completed)
        self._marker = marker
        return marker

    def _land_at(self, stream_name: str, due: float) -> None:
        """Record as complete at ``due`` (now, if that has passed): Note [Inline copies on an idle stream]."""
        self._marker = _Marker.landing_at(stream_name, due)

    def record(self, stream: Any = None) -> None:
        """Capture the work enqueued so far on ``stream`` (default: the compute stream)."""
        (stream if stream is not None else self._compute).record_event(self)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream``'s later work wait for this event (the compute stream: block now)."""
        (stream if stream is not None else self._compute).wait_event(self)

    def query(self) -> bool:
        """True once the recorded work has completed; raises StreamWorkError if it failed."""
        marker = self._marker
        if type(marker) is _Landed and self._compute.order is None:  # an inline copy's: complete, never failed
            return True
        if marker is None:
            return True
        if not marker.is_set:
            return False
        order = self._compute.order  # _observed, inlined (a few queries per copy)
        if order is not None:
            order.observe(self._clock)
        if marker.error is not None:
            marker.raise_error()
        return True

    def synchronize(self) -> None:
        """Block the calling thread until the recorded work has completed."""
        marker = self._marker
        if marker is None:
            return
        marker.wait()
        self._observed()
        marker.raise_error()

    def _observed(self) -> None:
        """The host saw this recording complete (the sanitizer's ordering)."""
        order = self._compute.order
        if order is not None:
            order.observe(self._clock)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """Milliseconds from this event to ``end_event`` (host clock when each was reached)."""
        for name, event in (("start", self), ("end", end_event)):
            if not isinstance(event, FakeEvent):
                raise ConfigurationError(f"elapsed_time needs fake-device events, got {type(event).__name__}")
            if not event.enable_timing:
                raise ConfigurationError(
                    f"the {name} event was created without timing; create both with dev.new_event(enable_timing=True)"
                )
            if event._marker is None:
                raise ConfigurationError(f"the {name} event was never recorded; record it on a stream first")
            if event._marker.timestamp is None:
                raise EventNotReadyError(
                    f"the {name} event has not completed yet; call synchronize() on it before elapsed_time()"
                )
        assert self._marker is not None and end_event._marker is not None
        assert self._marker.timestamp is not None and end_event._marker.timestamp is not None
        return (end_event._marker.timestamp - self._marker.timestamp) * 1000.0

    def __repr__(self) -> str:
        state = "unrecorded" if self._marker is None else ("complete" if self._marker.is_set else "pending")
        return f"<FakeEvent {state}{' timing' if self.enable_timing else ''}>"


def landed_event(compute: ComputeStream, stream_name: str, due: float) -> FakeEvent:
    """``FakeEvent(compute, enable_timing=True)`` recorded with ``_land_at(stream_name, due)``, in one step.

    The event of a copy that ran inline (Note [Inline copies on an idle stream]), made once per small
    copy (Note [The small copy's fast path] in copying.py): the same attributes, without ``__init__``.
    """
    event = _new(FakeEvent)
    event._compute = compute
    event.enable_timing = True
    event._clock = None
    event._marker = _Marker.landing_at(stream_name, due)
    return event


def _marker_of(event: Any) -> _Marker | None:
    if not isinstance(event, FakeEvent):
        raise ConfigurationError(
            f"fake-device streams wait only on fake-device events, got {type(event).__name__}; "
            "create events with dev.new_event()"
        )
    return event._marker


_COMPUTE_DONE = _Marker("compute", completed=True)  # Note [Untimed compute recordings share one marker]


class ComputeStream:
    """The calling host thread as a stream: everything enqueued on it has already run.

    >>> compute = ComputeStream()
    >>> compute.record_event().query()
    True
    """

    name = "compute"
    order: Any = None  # the sanitizer's Ordering (set by a sanitized device), or None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for: CPU compute is synchronous."""

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        """Record ``event`` (or a new one); it is complete at once."""
        if type(event) is FakeEvent and not event.enable_timing and self.order is None:
            event._marker = _COMPUTE_DONE  # the binding's ordering events: Note [Untimed compute recordings ...]
            return event
        event = event if event is not None else FakeEvent(self)
        if type(event) is not FakeEvent:  # _marker_of's check, asked only of what is not plainly an event
            _marker_of(event)
        if event.enable_timing:
            event._new_marker(self.name, completed=True)  # its own timestamp: elapsed_time reads it
        else:
            # Note [Untimed compute recordings share one marker]: a recording on the compute
            # stream is complete at once, and an event without timing never reads its marker's
            # timestamp (elapsed_time refuses it; a wait on a completed marker returns at once),
            # so every untimed one shares one immutable completed marker: no lock or clock read
            # per recording (the binding records an ordering event per device-to-host copy).
            event._marker = _COMPUTE_DONE
        if self.order is not None:
            event._clock = self.order.record(self.order.COMPUTE)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        """Block the calling thread until ``event`` completes (raises if its work failed)."""
        marker = _marker_of(event)
        if marker is not None:
            marker.wait()
            if self.order is not None:
                self.order.observe(event._clock)
            marker.raise_error()

    def wait_stream(self, stream: Any) -> None:
        """Block until all work enqueued so far on ``stream`` has completed."""
        self.wait_event(stream.record_event())

    def __repr__(self) -> str:
        return "<ComputeStream (calling thread)>"


_STOP = object()
_stream_numbers = itertools.count(1)


class _WorkerState:
    """Everything the worker thread needs; holds no reference to the stream object,
    so an unreferenced stream is collected and its finalizer stops the thread."""

    def __init__(self, thread_name: str) -> None:
        self.thread_name = thread_name
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pending = 0
        self.error: BaseException | None = None
        self.closed = False
        # when the inline work run so far lands (Note [Inline copies on an idle stream])
        self.busy_until = 0.0
        # when the work run so far finished, on the stream's clock (Note [Event times are the stream's...])
        self.last_done = 0.0

    def submit(self, item: Callable[[_WorkerState], None]) -> None:
        with self.lock:
            if self.closed:
                raise ConfigurationError(
                    f"stream {self.thread_name!r} is closed; create a new one with dev.new_stream()"
                )
            self.pending += 1
            if self.thread is None:
                self.thread = threading.Thread(target=_serve, args=(self,), name=self.thread_name, daemon=True)
                self.thread.start()
            self.queue.put(item)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the worker thread."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            thread = self.thread
        if thread is not None:
            self.queue.put(_STOP)
            if thread is not threading.current_thread():
                thread.join(timeout)


def _serve(state: _WorkerState) -> None:
    reduce_timer_slack()  # the link's sleeps wake on time (no spinning: Note in link.py)
    queue = state.queue
    while True:
        try:
            # what is queued already is taken without blocking: a blocking get releases the
            # GIL and must win it back from the compute thread, once per item otherwise
            item = queue.get_nowait()
        except Empty:
            item = queue.get()
        if item is _STOP:
            return
        if state.busy_until > time.perf_counter():
            sleep_until(state.busy_until)  # inline work enqueued before this item lands first
        if state.busy_until > state.last_done:
            state.last_done = state.busy_until  # the inline work landed then
        try:
            item(state)
        except BaseException as exc:  # kept for the next synchronize(): Note [Failures on a worker stream]
            state.fail(exc)
        finally:
            # drop the item before blocking on the queue again: a copy's closure holds its
            # buffers, and an idle worker must not keep device memory alive
            del item
            with state.lock:
                state.pending -= 1


class WorkerStream:
    """An in-order work queue served by a daemon thread (a copy stream of the fake device).

    ``close()`` finishes the queued work and stops the thread; an unreferenced stream
    is closed by its finalizer.
    """

    def __init__(self, compute: ComputeStream, *, name: str | None = None, priority: int = 0) -> None:
        self.name = name or f"stream-{next(_stream_numbers)}"
        self.priority = priority  # accepted for torch compatibility; the fake device has one queue per stream
        self._compute = compute
        self._order = compute.order
        self._sid = self._order.new_stream_id() if self._order is not None else 0
        self._state = _WorkerState(f"offcore-cpu {self.name}")
        self._finalizer = weakref.finalize(self, self._state.close, 5.0)

    # -- enqueueing -----------------------------------------------------------------------
    def launch_host_func(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the worker after everything enqueued before it (``cudaLaunchHostFunc``)."""

        def run(state: _WorkerState) -> None:
            fn()
            state.last_done = time.perf_counter()

        self._state.submit(run)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        """Record ``event`` (or a new one) at the current end of the queue and return it."""
        event = event if event is not None else FakeEvent(self._compute)
        _marker_of(event)
        if self._order is not None:
            event._clock = self._order.record(self._sid)
        state = self._state
        with state.lock:
            if not state.pending and state.error is None and not state.closed:
                event._land_at(self.name, state.busy_until)  # nothing queued: with the inline work, or now
                return event
        marker = event._new_marker(self.name)
        recorded = time.perf_counter()

        def reached(state: _WorkerState) -> None:  # Note [Event times are the stream's, not the scheduler's]
            marker.complete(state.error, at=max(state.last_done, recorded))
            state.last_done = marker.timestamp or state.last_done

        state.submit(reached)
        return event

    def record_start(self, event: FakeEvent) -> Callable[[], None]:
        """Record ``event`` here, completed by the work item enqueued next when it begins; returns the completer.

        What ``record_event(event)`` right before that item does, without a work item of its
        own: the event's time is the item's start, not a worker hand-off earlier (copy timing).
        """
        _marker_of(event)
        marker = event._new_marker(self.name)
        if self._order is not None:
            event._clock = self._order.record(self._sid)
        state = self._state
        return lambda: marker.complete(state.error)

    def try_inline(self, work: Callable[[float], float | None]) -> FakeEvent | None:
        """Run ``work`` on the calling thread now if nothing is queued on this stream.

        ``work(not_before)`` does the work and returns when its result *lands* (emulated
        time, never before ``not_before``, when the stream's earlier inline work lands), or
        None to decline. Returns an event completing at that time, or None when the stream
        is busy (queue the work instead). Note [Inline copies on an idle stream].
        """
        state = self._state
        with state.lock:
            if state.pending or state.error is not None or state.closed:
                return None
            try:
                due = work(state.busy_until)
            except BaseException as exc:  # as if it had failed on the worker: Note [Failures on a worker stream]
                state.error = exc
                failed = FakeEvent(self._compute, enable_timing=True)
                failed._new_marker(self.name, completed=True).error = exc
                return failed
            if due is None:
                return None
            if due > state.busy_until:
                state.busy_until = due
        event = FakeEvent(self._compute, enable_timing=True)
        event._land_at(self.name, due)
        return event

    def run_and_record(self, fn: Callable[[], object], event: FakeEvent) -> FakeEvent:
        """Enqueue ``fn()`` and record ``event`` right after it, as one work item (one hand-off).

        When ``fn`` returns a ``perf_counter`` time (a copy: when it landed), the event's
        timestamp is that time rather than the moment the worker completes it.

        Same as ``launch_host_func(fn); record_event(event)``, at half the queueing cost:
        the fake device issues every copy this way.
        """
        _marker_of(event)
        marker = event._new_marker(self.name)
        if self._order is not None:
            event._clock = self._order.record(self._sid)

        def item(state: _WorkerState) -> None:
            nonlocal fn
            landed = None
            try:
                landed = fn()
            except BaseException as exc:  # Note [Failures on a worker stream]
                state.fail(exc)
            # the work (a copy and its buffers) is dropped *before* its event completes: a
            # program that frees its last reference after waiting then really frees the memory
            fn = None  # type: ignore[assignment]
            # a copy returns when it landed on the emulated link: the event's time is that, not
            # when this thread got the interpreter back (scheduling is no part of a copy's time)
            marker.complete(state.error, at=landed if isinstance(landed, float) else None)
            state.last_done = marker.timestamp or state.last_done

        self._state.submit(item)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        """Later work on this stream starts only after ``event`` completes (the host does not block)."""
        marker = event._marker if type(event) is FakeEvent else _marker_of(event)
        if self._order is not None:  # ordered after the event whether or not it has completed yet
            self._order.wait(self._sid, event._clock)
        if marker is None or (marker.is_set and marker.error is None):
            return
        if isinstance(marker, _DueMarker):
            state = self._state
            with state.lock:
                if not state.pending:  # nothing queued: later work starts when the event lands
                    if marker.due > state.busy_until:
                        state.busy_until = marker.due
                    return

        def wait(state: _WorkerState) -> None:
            marker.wait()
            state.last_done = max(state.last_done, marker.timestamp or time.perf_counter())
            if marker.error is not None:
                state.fail(marker.error)

        self._state.submit(wait)

    def wait_stream(self, stream: Any) -> None:
        """Later work on this stream waits for all work enqueued so far on ``stream``."""
        self.wait_event(stream.record_event())

    # -- completion -----------------------------------------------------------------------
    def query(self) -> bool:
        """True when all work enqueued so far has completed."""
        with self._state.lock:
            done = self._state.pending == 0 and time.perf_counter() >= self._state.busy_until
        if done and self._order is not None:
            self._order.observe_stream(self._sid)
        return done

    def synchronize(self) -> None:
        """Block until all enqueued work has completed; raise (once) if any of it failed."""
        if not self._state.closed:
            done = self.record_event(FakeEvent(self._compute))
            assert done._marker is not None
            done._marker.wait()
            done._observed()
        elif self._order is not None:
            self._order.observe_stream(self._sid)
        sleep_until(self._state.busy_until)
        with self._state.lock:
            error, self._state.error = self._state.error, None
        if error is not None:
            raise StreamWorkError(
                f"work queued on stream {self.name!r} failed: {type(error).__name__}: {str(error).rstrip('.')}. "
                "The data that work should have produced is not valid."
            ) from error

    def close(self) -> None:
        """Finish the queued work and stop the worker thread; the stream takes no more work."""
        self._finalizer.detach()
        self._state.close()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        return f"<WorkerStream {self.name!r} pending={self._state.pending}{' closed' if self.closed else ''}>"
