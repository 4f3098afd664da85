"""What offcore_torch keeps per device across steps.

One :class:`DeviceRuntime` per backend device holds the two copy streams (D2H and
H2D, created once, not per step), the budgeted host pools, the measured link
(:class:`offcore.scheduler.BandwidthEstimator` per direction), the default
:class:`offcore.scheduler.Scheduler`, and the releases that wait for a copy to land
(Note [When may a device copy be freed?] in :mod:`offcore.objects`: a host buffer goes
back to its pool, and a device buffer is dropped, only after the copy touching it has
completed). It uses only the :class:`offcore.protocols.Backend` protocol, so it runs
unchanged on the fake device, CUDA and NPU.

    >>> import offcore                                             # doctest: +SKIP
    >>> rt = runtime_for(offcore.device("cpu"))                    # doctest: +SKIP
    >>> rt.d2h_link.bandwidth is None                              # doctest: +SKIP
    True

# Note [Deferred releases in stream order]
# A release (a host buffer back to its pool, a device buffer dropped) waits for the event
# of the copy touching it. Work on one stream completes in order, so the releases
# deferred on one stream are kept in a FIFO and each poll checks only from the oldest
# until the first that is still pending: a poll at every pack and unpack costs O(ready),
# not O(deferred). A release deferred after a younger one on the same stream (an older
# copy's event) runs no earlier than that younger copy lands: later, never too early.

# Note [Copy timings start at the copy]
# A copy's timing bracket must start when the transfer starts, not when offcore asks for
# it: on an idle copy stream a start event recorded before ``copy_`` fires at once, and
# the backend's host-side work (checks, layout matching, a pageable staging memcpy,
# torch's dispatch) would be timed as transfer, biasing every bandwidth estimate low for
# small copies. So offcore hands the start event to ``copy_(..., start_event=...)``, and
# the backend records it right before the transfer itself.

# Note [Landings are returned, not called back]
# The runtime tracks every device-to-host copy in flight on its D2H stream (they complete
# in submission order) with an opaque token from its owner. A poll moves the copies that
# completed (or failed) into the runtime's landed queue; it never calls back into the
# region that started them. The binding takes them with :meth:`DeviceRuntime.take_landed`
# and hands each to its owner (offcore_torch.activations.copies.poll). So a finished region a caller
# keeps for its stats costs nothing per poll, and anyone may poll (a test, synchronize)
# without losing a landing: it waits in the queue until the binding takes it.

# Note [Timings are read in batches]
# A timed copy's bracket (two events) is read once its end event completed. Reading means
# querying the oldest bracket of each stream, so a poll at every pack and unpack would pay
# an event query per stream for a sample of a few copies in a hundred. Polls read them only
# once _TIMING_BATCH brackets are pending; the binding reads the rest at its step
# boundaries (region entry and exit, end of backward, stats: resolve_timings), before the
# link estimate is used to plan backward's reloads. Backends where reading a timing is a
# barrier read them only between steps (Capability.TIMING_READ_SYNCHRONIZES).

# Note [A failed copy is a completed copy]
# A copy can fail on its stream (the backend's event then raises on query/synchronize,
# as an asynchronous CUDA error does, and the fake device's stream failures and injected
# faults do). For releases a failed copy counts as completed: nothing reads or writes
# its buffers any more, so they go back, once. The copy's owner decides what the failure
# means for its data (activation offload keeps the device copy, or reloads from the
# intact host copy), and :meth:`DeviceRuntime.recover` clears the stream's sticky error
# so that later copies on it run. An event that raises is never queried again.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from offcore.errors import ConfigurationError, OffcoreWarning
from offcore.kinds import Direction
from offcore.ledger import Ledger
from offcore.pool import HostBufferPool
from offcore.protocols import Capability
from offcore.scheduler import BandwidthEstimator, Scheduler
from offcore.trace import TraceRecorder

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_D2H = Direction.D2H

__all__ = ["DeviceRuntime", "runtime_for", "runtime_of", "check_device", "check_bool"]

_RUNTIME_ATTRIBUTE = "_offcore_torch_runtime"
_TIMING_BATCH = 32  # pending timing brackets a poll lets accumulate (Note [Timings are read in batches])
_SAMPLE_FIRST = 16  # the first copies of a direction, all timed (DeviceRuntime.sample)
_SAMPLE_EVERY = 64  # after the first 16 copies of a direction, one in this many is timed (a power of two)
_fallback_runtimes: weakref.WeakKeyDictionary[Any, DeviceRuntime] = weakref.WeakKeyDictionary()
_fallback_by_id: dict[int, DeviceRuntime] = {}
_registry_lock = threading.Lock()


class _Timed:
    """A copy or wait bracketed by timing events, resolved once ``end`` completes."""

    __slots__ = ("start", "end", "nbytes", "direction", "issued", "label", "ledger", "trace")

    def __init__(
        self,
        start: Any,
        end: Any,
        nbytes: int,
        direction: Direction | None,
        issued: float,
        label: str,
        ledger: Ledger,
        trace: TraceRecorder | None,
    ) -> None:
        self.start, self.end, self.nbytes, self.direction = start, end, nbytes, direction
        self.issued, self.label, self.ledger, self.trace = issued, label, ledger, trace


def _stream_key(stream: Any) -> Any:
    """A stable identity for a stream (``torch.cuda.current_stream()`` returns a new wrapper per call)."""
    stream_id = getattr(stream, "stream_id", None)
    return (
        (type(stream).__name__, getattr(stream, "device_index", None), stream_id)
        if stream_id is not None
        else id(stream)
    )


class DeviceRuntime:
    """Per-device state shared by every offload region on that device (see the module doc)."""

    def __init__(self, device: Any) -> None:
        self.d2h_stream = device.new_stream()
        self.h2d_stream = device.new_stream()
        self.d2h_link = BandwidthEstimator()
        self.h2d_link = BandwidthEstimator()
        self.scheduler = Scheduler()
        capabilities = frozenset(getattr(device, "capabilities", ()))
        self.timing = Capability.EVENT_TIMING in capabilities
        # reading a timing is a barrier on this backend: only between steps (resolve_timings)
        self.timings_between_steps = Capability.TIMING_READ_SYNCHRONIZES in capabilities
        self.lock = threading.RLock()
        self.warned_elsewhere = False  # Note [A region whose tensors live elsewhere says so] (activations/pack.py)
        self._pools: dict[tuple[int, bool], HostBufferPool] = {}
        # releases waiting for an event, one FIFO per stream (Note [Deferred releases in stream order])
        self._deferred: dict[Any, collections.deque[tuple[Any, Callable[[], None]]]] = {}
        self._deferred_total = 0
        self._timed: dict[Any, collections.deque[_Timed]] = {}  # per stream: brackets end in order
        self._timed_pending = 0  # brackets in ``_timed`` (Note [Timings are read in batches])
        self._track_end: dict[str, float] = collections.defaultdict(float)
        self._d2h_in_flight: collections.deque[tuple[Any, Any]] = collections.deque()  # (event, token)
        self._d2h_bytes = 0  # the bytes of the copies in _d2h_in_flight (Note [Activation copies in flight are capped])
        # (token, failure) of the D2H copies that landed, until the binding takes them
        self._landed: collections.deque[tuple[Any, Exception | None]] = collections.deque()
        self._sampled_d2h = self._sampled_h2d = 0  # copies asked about per direction (sample)
        # the regions whose group of small storages is still open, weakly, by the thread that entered them
        # (Note [Small storages are offloaded in groups] in activations/records.py; synchronize copies them)
        self.open_groups: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    # -- host pools --------------------------------------------------------------------
    def pool(self, device: Any, budget: int, pinned: bool) -> HostBufferPool:
        """The device's host pool for ``(budget, pinned)``, created once and reused every step."""
        key = (budget, pinned)
        with self.lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = device.host_pool(budget, pinned=pinned)
            return pool

    @property
    def pools(self) -> list[HostBufferPool]:
        with self.lock:
            return list(self._pools.values())

    # -- releases waiting for copies ---------------------------------------------------
    def defer(self, event: Any, release: Callable[[], None], *, stream: Any = None) -> None:
        """Run ``release()`` once ``event`` has completed (now, if it has).

        ``stream``: the stream ``event`` was recorded on, when known. Releases deferred on
        one stream are checked oldest first and the check stops at the first pending one
        (Note [Deferred releases in stream order]); without a stream every poll checks it.
        """
        if event is None:
            release()
            return
        done, failed = _landed(event)
        if done:
            if failed:
                self._failed_unneeded()
            release()
            return
        key = None if stream is None else _stream_key(stream)
        with self.lock:
            queue = self._deferred.get(key)
            if queue is None:
                queue = self._deferred[key] = collections.deque()
            queue.append((event, release))
            self._deferred_total += 1

    @property
    def deferred_count(self) -> int:
        return self._deferred_total

    def _ready_releases(self) -> list[Callable[[], None]]:
        ready: list[Callable[[], None]] = []
        failed = False
        with self.lock:
            for key, queue in self._deferred.items():
                if key is None:  # no stream order known: check each
                    for _ in range(len(queue)):
                        item = queue.popleft()
                        done, bad = _landed(item[0])
                        failed |= bad
                        if done:
                            ready.append(item[1])
                        else:
                            queue.append(item)
                    continue
                while queue:
                    done, bad = _landed(queue[0][0])
                    failed |= bad
                    if not done:
                        break
                    ready.append(queue.popleft()[1])
            self._deferred_total -= len(ready)
        if failed:
            self._failed_unneeded()
        return ready

    def _failed_unneeded(self) -> None:
        self.recover()
        warnings.warn(
            "offcore: a copy whose data was no longer needed failed on its stream; its buffers were released and "
            "the copy streams recovered (Note [A failed copy is a completed copy])",
            OffcoreWarning,
            stacklevel=4,
        )

    def poll(self) -> None:
        """Run the releases whose copies landed, and see which device-to-host copies landed. Cheap when idle.

        Copy timings are read in batches (Note [Timings are read in batches]).
        """
        if self._deferred_total:
            for release in self._ready_releases():
                release()
        if self._timed_pending >= _TIMING_BATCH and not self.timings_between_steps:
            self._resolve_timed()
        if self._d2h_in_flight:
            self._poll_d2h()

    # -- device-to-host copies in flight (Note [Landings are returned, not called back]) --
    def track_d2h(self, event: Any, token: Any, nbytes: int = 0) -> None:
        """Watch the device-to-host copy of ``nbytes`` that completes with ``event``; ``token`` comes back
        when it landed (its ``nbytes`` attribute, if any, is what leaves :attr:`d2h_bytes_in_flight` then)."""
        with self.lock:
            self._d2h_in_flight.append((event, token))
            self._d2h_bytes += nbytes

    def _poll_d2h(self) -> None:
        with self.lock:
            queue = self._d2h_in_flight
            while queue:
                event, token = queue[0]
                failure: Exception | None = None
                try:
                    if not event.query():
                        return
                except Exception as exc:  # the copy failed on its stream
                    # kept without its traceback: the traceback's frames (this one included)
                    # would form a cycle holding the caller's tensors until a collection
                    failure = exc.with_traceback(None)
                queue.popleft()
                self._d2h_bytes -= getattr(token, "nbytes", 0)
                self._landed.append((token, failure))

    def take_landed(self) -> list[tuple[Any, Exception | None]]:
        """The tokens of device-to-host copies that landed since the last call, in landing order,
        each with the exception its copy failed with (None when it succeeded)."""
        if not self._landed:
            return []
        with self.lock:
            out = list(self._landed)
            self._landed.clear()
        return out

    @property
    def d2h_in_flight(self) -> int:
        """Device-to-host copies started and not seen landing yet."""
        return len(self._d2h_in_flight)

    @property
    def d2h_bytes_in_flight(self) -> int:
        """The bytes of those copies (the device memory their sources hold for offcore)."""
        return self._d2h_bytes

    def recover(self, stream: Any = None) -> None:
        """Clear a copy stream's sticky failure (both copy streams by default), so later copies on it run.

        Note [A failed copy is a completed copy]. Waits for the work queued on the stream.
        """
        for each in (self.d2h_stream, self.h2d_stream) if stream is None else (stream,):
            try:
                each.synchronize()
            except Exception:  # the failure being cleared (the backend raises it once)
                pass

    def synchronize(self, *, wait: bool = True) -> None:
        """Wait for every copy offcore has in flight on this device, then run every pending release."""
        while True:
            with self.lock:
                pending = [item for queue in self._deferred.values() for item in queue]
                pending += list(self._d2h_in_flight)
            if wait:
                for event, _ in pending:
                    _wait(event)
                for queue in list(self._timed.values()):
                    for item in list(queue):
                        _wait(item.end)
            self.poll()
            if wait:
                self._resolve_timed()  # a barrier already: read what timings completed
            if not wait or not (self._deferred_total or self._d2h_in_flight):
                return

    # -- timing ------------------------------------------------------------------------
    def sample(self, direction: Direction, *, always: bool = False) -> bool:
        """Whether to time the next copy in ``direction``: the first 16, then one in 64 (or ``always``).

        Timing costs two events per copy and their reading (a timed copy costs about twice a
        plain one in the binding's CPU time on the fake device); the link estimate and the
        per-region bandwidth figures need a sample, not every copy.
        """
        if direction is _D2H:
            count = self._sampled_d2h
            self._sampled_d2h = count + 1
        else:
            count = self._sampled_h2d
            self._sampled_h2d = count + 1
        return always or count < _SAMPLE_FIRST or not count & (_SAMPLE_EVERY - 1)

    def begin_timing(self, device: Any, stream: Any, *, record: bool = True) -> tuple[Any, float]:
        """A timing start event (None without event timing) and the host time.

        ``record=False`` leaves recording the event to the backend's ``copy_(...,
        start_event=...)`` (Note [Copy timings start at the copy]).
        """
        start = None
        if self.timing:
            start = device.new_event(enable_timing=True)
            if record:
                stream.record_event(start)
        return start, time.perf_counter()

    def end_timing(
        self,
        device: Any,
        stream: Any,
        start: Any,
        issued: float,
        *,
        nbytes: int,
        direction: Direction | None,
        label: str,
        ledger: Ledger,
        trace: TraceRecorder | None = None,
    ) -> None:
        """Close a bracket opened by :meth:`begin_timing`; it is resolved when the end event completes.

        A copy's time goes to the link estimate of its direction and to ``ledger``'s copy
        totals (the copy itself was counted with :meth:`offcore.ledger.Ledger.record_copy`
        when it was submitted); a wait (``direction=None``) to ``ledger``'s waits under
        ``label``; both to ``trace`` when given. Without event timing the host time since
        ``issued`` is used (exact on backends whose compute stream is the host thread; an
        upper bound for copies otherwise).
        """
        if start is None:
            seconds = time.perf_counter() - issued
            self._account(_Timed(None, None, nbytes, direction, issued, label, ledger, trace), seconds)
            return
        end = device.new_event(enable_timing=True)
        stream.record_event(end)
        with self.lock:
            key = _stream_key(stream)
            queue = self._timed.get(key)
            if queue is None:
                queue = self._timed[key] = collections.deque()
            queue.append(_Timed(start, end, nbytes, direction, issued, label, ledger, trace))
            self._timed_pending += 1

    def resolve_timings(self) -> None:
        """Read the copy timings whose copies completed (between steps where reading one is a barrier)."""
        self._resolve_timed()

    def _resolve_timed(self) -> None:
        done: list[_Timed] = []
        with self.lock:
            for queue in self._timed.values():
                while queue and _landed(queue[0].end)[0]:
                    done.append(queue.popleft())
            self._timed_pending -= len(done)
        for item in done:
            try:
                seconds = item.start.elapsed_time(item.end) / 1e3
            except Exception:  # a bracket around a failed copy: no sample (Note [A failed copy is a completed copy])
                continue
            self._account(item, max(seconds, 0.0))

    def _account(self, item: _Timed, seconds: float) -> None:
        direction = item.direction
        if direction is None:
            item.ledger.record_wait(seconds, what=item.label)
            track = "wait"
        else:
            (self.d2h_link if direction is _D2H else self.h2d_link).observe(item.nbytes, seconds)
            item.ledger.record_timing(direction, item.nbytes, seconds)
            track = direction.value
        if item.trace is not None:
            with self.lock:
                start = max(item.issued, self._track_end[track]) if track != "wait" else item.issued
                self._track_end[track] = start + seconds
            item.trace.span(track, item.label, start, seconds, bytes=item.nbytes)

    def pending_timings(self, ledger: Ledger) -> list[Any]:
        """End events of the timings recorded into ``ledger`` not resolved yet."""
        with self.lock:
            return [item.end for queue in self._timed.values() for item in queue if item.ledger is ledger]

    def h2d_duration(self, nbytes: int) -> float:
        """Predicted seconds of a host-to-device copy (measured H2D, else measured D2H, else unknown: inf)."""
        if self.h2d_link.samples:
            return self.h2d_link.duration(nbytes)
        return self.d2h_link.duration(nbytes)


def _landed(event: Any) -> tuple[bool, bool]:
    """``(done, failed)`` for an event: a copy that failed counts as done (Note [A failed copy is a completed copy])."""
    try:
        return bool(event.query()), False
    except Exception:
        return True, True


def _wait(event: Any) -> None:
    """Block until ``event`` completes, failed or not (the failure is its owner's to handle)."""
    try:
        event.synchronize()
    except Exception:
        pass


def runtime_for(device: Any) -> DeviceRuntime:
    """The :class:`DeviceRuntime` of ``device`` (created on first use, lives as long as the device)."""
    runtime = getattr(device, _RUNTIME_ATTRIBUTE, None)
    if runtime is not None:
        return runtime
    with _registry_lock:
        runtime = runtime_of(device)
        if runtime is not None:
            return runtime
        runtime = DeviceRuntime(device)
        try:
            setattr(device, _RUNTIME_ATTRIBUTE, runtime)
        except (AttributeError, TypeError):
            try:
                _fallback_runtimes[device] = runtime
            except TypeError:
                _fallback_by_id[id(device)] = runtime  # not weak-referenceable: lives for the process
        return runtime


def runtime_of(device: Any) -> DeviceRuntime | None:
    """The :class:`DeviceRuntime` of ``device`` if one was created (never creates one)."""
    runtime = getattr(device, _RUNTIME_ATTRIBUTE, None)
    if runtime is None:
        try:
            runtime = _fallback_runtimes.get(device) or _fallback_by_id.get(id(device))
        except TypeError:
            runtime = _fallback_by_id.get(id(device))
    return runtime


_DEVICE_METHODS = (
    "current_stream",
    "new_stream",
    "new_event",
    "allocate",
    "holds",
    "copy_",
    "memory_stats",
    "host_pool",
)


def check_device(device: Any, who: str, *, methods: bool = True) -> None:
    """Refuse what is not an offcore backend device before anything uses it (a name such as ``"cpu"``,
    None, a ``torch.device``): a ConfigurationError saying how to make one. ``methods=False`` refuses
    only names and None (for settings keyed by the device object, whatever it is)."""
    if isinstance(device, str) or device is None or type(device).__name__ == "device":
        shown = f"the string {device!r}" if isinstance(device, str) else repr(device)
        name = device if isinstance(device, str) else "cpu' | 'cuda' | 'npu"
        raise ConfigurationError(
            f"{who} needs an offcore device object, not {shown}: create it with offcore.device('{name}', ...) "
            "and pass that"
        )
    if not methods:
        return
    missing = [name for name in _DEVICE_METHODS if not callable(getattr(device, name, None))]
    if missing:
        raise ConfigurationError(
            f"{who}: {type(device).__name__} is not an offcore backend device (missing {', '.join(missing)}); "
            "create one with offcore.device('cpu' | 'cuda' | 'npu', ...)"
        )


def check_bool(value: Any, name: str, who: str) -> bool:
    """``value`` when it is a bool; a ConfigurationError otherwise (``"no"`` is truthy: accepting it would
    silently do the opposite of what was meant)."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{who}: {name} must be True or False, got {value!r}")
    return value
