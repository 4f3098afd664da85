"""The emulated host-device link: per-direction bandwidth, latency, duplex or shared.

A copy of ``n`` bytes in direction ``d`` occupies its channel for
``latency + n / bandwidth(d)`` seconds of real wall time: the worker waits out the
latency (the first byte lands only then), does the real memcpy, and waits for the rest
of the transfer time. With ``duplex=True`` H2D and D2H have a channel each and run at
the same time; with ``duplex=False`` they share one. H2H and D2D copies do not cross
the link and take only their memcpy time.

    >>> from offcore.kinds import Direction
    >>> link = Link(h2d_bandwidth=32 * 2**30, d2h_bandwidth=32 * 2**30, latency=0.0, duplex=True)
    >>> round(link.duration(Direction.D2H, 256 * 2**20) * 1e3, 4)     # milliseconds
    7.8125

Fidelity: the emulation cannot be faster than the host's own memcpy, so a copy
takes ``max(latency + memcpy, latency + n / bandwidth)``. Emulated bandwidths above
the host's copy bandwidth (about 13 GiB/s on a 2-core VM) are memcpy-bound for
large copies; ``benchmarks/copy_bandwidth.py`` prints the host floor next to each figure.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from offcore.kinds import Direction

__all__ = ["Link", "sleep_until", "reduce_timer_slack"]

_PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)
_prctl: Any = None  # libc prctl, False where unavailable


def sleep_until(deadline: float) -> None:
    """Wait until ``time.perf_counter() >= deadline`` without holding the GIL.

    Only ``time.sleep`` is used (it releases the GIL), never a spin: a spinning copy
    worker steals the compute thread's interpreter time. A sleep wakes up to a timer
    slack late (about 50-100 us by default on Linux; the fake device's worker threads
    lower their slack to 1 ns with :func:`reduce_timer_slack`, leaving the kernel's
    wake-up latency, tens of microseconds). The loop only repeats if a sleep returned
    early, so a copy never lands before its emulated time.
    """
    remaining = deadline - time.perf_counter()
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.perf_counter()


def reduce_timer_slack() -> bool:
    """Ask Linux to wake the calling thread's sleeps on time (timer slack 1 ns); False elsewhere.

    The slack is per thread (``prctl(PR_SET_TIMERSLACK)``) and inherited by threads the
    caller starts later; the fake device calls this on its copy workers only.
    """
    global _prctl
    if _prctl is None:
        _prctl = False
        if sys.platform.startswith("linux"):
            try:
                _prctl = ctypes.CDLL(None, use_errno=True).prctl
            except (OSError, AttributeError):
                _prctl = False
    if _prctl is False:
        return False
    try:
        return bool(_prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0)
    except Exception:  # pragma: no cover - a libc without prctl
        return False


# Note [A direction's route is built once]
# Every inline copy books its direction's channel (Link.reserve), twice per offloaded activation. What a
# booking needs of the link is fixed when the device is made: the channel (its lock and when the transfers
# booked on it end), the latency and the direction's bandwidth. So each direction gets a _Route with those,
# and the device keeps ``Link.reserver`` (direction -> the route's booking method) instead of looking each
# up per copy. A route of an unlimited link (infinite bandwidth, no latency) books with ``_reserve_instant``:
# its copies last ``0.0 + n / inf == 0.0`` seconds, so the timed method's duration, its end and its rounding
# guard reduce to ``end = start`` -- the same (start, end) to the bit, computed once, not per copy.


class _Channel:
    """One channel of the link: held by a worker's :meth:`Link.transfer`; when the transfers booked on it end."""

    __slots__ = ("lock", "free_at")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_at = 0.0  # inline copies reserve ahead


class _Route:
    """A direction across the link: its channel and what a copy costs there (Note [A direction's route is built
    once])."""

    __slots__ = ("channel", "lock", "latency", "bandwidth")

    def __init__(self, channel: _Channel, latency: float, bandwidth: float) -> None:
        self.channel, self.lock, self.latency, self.bandwidth = channel, channel.lock, latency, bandwidth

    @property
    def instant(self) -> bool:
        """Whether every copy on this route lasts 0 seconds (unlimited bandwidth, no latency)."""
        return self.latency == 0 and self.bandwidth == math.inf

    def reserve(self, nbytes: int, not_before: float) -> tuple[float, float] | None:
        """:meth:`Link.reserve` for this route's direction."""
        lock = self.lock
        if not lock.acquire(False):  # without waiting
            return None
        try:  # once per inline copy: comparisons rather than max()
            channel = self.channel
            start = time.perf_counter()
            if not_before > start:
                start = not_before
            if channel.free_at > start:
                start = channel.free_at
            duration = self.latency + nbytes / self.bandwidth
            end = start + duration
            if end - start < duration:  # rounding: never report less than the emulated time
                end = math.nextafter(end, math.inf)
            channel.free_at = end
            return start, end
        finally:
            lock.release()

    def _reserve_instant(self, nbytes: int, not_before: float) -> tuple[float, float] | None:
        """:meth:`reserve` on an instant route: the copy ends when it starts."""
        lock = self.lock
        if not lock.acquire(False):  # without waiting
            return None
        try:
            channel = self.channel
            start = time.perf_counter()
            if not_before > start:
                start = not_before
            if channel.free_at > start:
                start = channel.free_at
            channel.free_at = start
            return start, start
        finally:
            lock.release()


def _reserve_off_link(nbytes: int, not_before: float) -> tuple[float, float]:
    """A booking of a copy that does not cross the link (H2H, D2D): no link time."""
    start = time.perf_counter()
    return (not_before, not_before) if not_before > start else (start, start)


class Link:
    """Channels of the emulated link and the time each copy occupies them."""

    def __init__(self, *, h2d_bandwidth: float, d2h_bandwidth: float, latency: float, duplex: bool) -> None:
        self.bandwidth = {Direction.H2D: h2d_bandwidth, Direction.D2H: d2h_bandwidth}
        self.latency = latency
        self.duplex = duplex
        h2d_channel = _Channel()
        d2h_channel = _Channel() if duplex else h2d_channel
        self._routes = {
            Direction.H2D: _Route(h2d_channel, latency, h2d_bandwidth),
            Direction.D2H: _Route(d2h_channel, latency, d2h_bandwidth),
        }
        # direction -> how a copy in it books the link now: Note [A direction's route is built once]
        self.reserver: dict[Direction, Callable[[int, float], tuple[float, float] | None]] = {
            Direction.H2H: _reserve_off_link,
            Direction.D2D: _reserve_off_link,
        }
        for direction, route in self._routes.items():
            self.reserver[direction] = route._reserve_instant if route.instant else route.reserve

    def booked_until(self) -> list[float]:
        """When the transfers booked so far end, per channel (one for a shared link)."""
        return [channel.free_at for channel in {id(r.channel): r.channel for r in self._routes.values()}.values()]

    def reserve(self, direction: Direction, nbytes: int, not_before: float = 0.0) -> tuple[float, float] | None:
        """Book the next free slot of ``direction``'s channel for ``nbytes`` without waiting.

        Returns the transfer's (start, end) ``perf_counter`` times: it starts when the channel
        is free, not before ``not_before`` nor now, and lasts :meth:`duration`. None while a
        worker's :meth:`transfer` holds the channel (the caller queues its copy instead).
        Used by inline copies (Note [Inline copies on an idle stream]).
        """
        return self.reserver[direction](nbytes, not_before)

    def reserve_run(
        self, direction: Direction, sizes: Sequence[int], not_before: float = 0.0
    ) -> list[tuple[float, float]] | None:
        """:meth:`reserve` for copies of ``sizes`` bytes in ``direction``, back to back, with one hold of the
        channel and one clock read (a batch of small copies: Note [A batch of copies is one work item]).

        The first starts as :meth:`reserve`'s would, each later one when the one before it ends; each lasts
        :meth:`duration`. None while a worker's :meth:`transfer` holds the channel.
        """
        now = time.perf_counter()
        start = not_before if not_before > now else now
        spans: list[tuple[float, float]] = []
        route = self._routes.get(direction)
        if route is None:  # H2H, D2D: no link time
            return [(start, start)] * len(sizes)
        channel = route.channel
        if not channel.lock.acquire(blocking=False):
            return None
        try:
            if channel.free_at > start:
                start = channel.free_at
            latency, bandwidth = route.latency, route.bandwidth
            if latency == 0 and bandwidth == math.inf:  # an instant route (_Route.instant): each ends as it starts
                channel.free_at = start
                return [(start, start)] * len(sizes)
            nextafter, inf = math.nextafter, math.inf
            for nbytes in sizes:
                duration = latency + nbytes / bandwidth
                end = start + duration
                if end - start < duration:  # rounding: never report less than the emulated time
                    end = nextafter(end, inf)
                spans.append((start, end))
                start = end
            channel.free_at = start
            return spans
        finally:
            channel.lock.release()

    def crosses_link(self, direction: Direction) -> bool:
        return direction in self._routes

    def duration(self, direction: Direction, nbytes: int) -> float:
        """Emulated seconds for ``nbytes`` in ``direction`` (0 for H2H and D2D)."""
        if not self.crosses_link(direction):
            return 0.0
        return self.latency + nbytes / self.bandwidth[direction]  # nbytes / inf == 0.0

    @contextlib.contextmanager
    def channel(self, direction: Direction) -> Iterator[None]:
        """Hold the channel ``direction`` uses (nothing for H2H and D2D) for the duration of a transfer."""
        route = self._routes.get(direction)
        if route is None:
            yield
        else:
            with route.lock:
                yield

    def transfer(
        self,
        direction: Direction,
        nbytes: int,
        memcpy: Callable[[], None],
        *,
        extra_delay: float = 0.0,
        data_first: bool = False,
        since: float | None = None,
    ) -> tuple[float, float]:
        """Run ``memcpy`` as a transfer on the link; returns its (start, end) ``perf_counter`` times.

        ``since``: when the copy reached its stream, if that was earlier than now (the
        sanitizer poisons the destination first): the transfer counts from then, or from
        when the channel became free, so the emulation's own work is not added to the link time.

        ``extra_delay`` (the sanitizer's jitter) postpones the landing of the data.
        Waiting is :func:`sleep_until` (GIL released), never a spin. The bytes are moved
        after the latency (and jitter) by default, so a reader that does not wait for the
        copy's event sees the destination's old contents for as long as possible; with
        ``data_first`` (the fake device without its sanitizer) they are moved at once and
        the transfer then sleeps once until its end: the same completion time, one wake-up
        (and one GIL hand-off) fewer per copy.
        """
        route = self._routes.get(direction)
        if route is None:  # H2H, D2D: only the memcpy
            start = time.perf_counter()
            if extra_delay > 0:
                sleep_until(start + extra_delay)
            memcpy()
            return start, time.perf_counter()
        channel = route.channel
        with channel.lock:
            start = time.perf_counter()
            free_at = channel.free_at
            if free_at > start:  # inline copies booked the channel until then
                sleep_until(free_at)
                start = max(time.perf_counter(), free_at)
            elif since is not None:  # the channel was free: the transfer began when the copy was reached
                start = max(min(since, start), free_at)
            try:
                return self._occupy(direction, nbytes, memcpy, start, extra_delay, data_first)
            finally:
                channel.free_at = max(channel.free_at, time.perf_counter())

    def _occupy(
        self,
        direction: Direction,
        nbytes: int,
        memcpy: Callable[[], None],
        start: float,
        extra_delay: float,
        data_first: bool,
    ) -> tuple[float, float]:
        """The body of :meth:`transfer` once the channel is held and free (from ``start``)."""
        first_byte = self.latency + extra_delay
        if data_first:
            memcpy()
            sleep_until(start + first_byte + nbytes / self.bandwidth[direction])
            return start, time.perf_counter()
        if first_byte > 0:
            sleep_until(start + first_byte)
        memcpy()
        sleep_until(start + first_byte + nbytes / self.bandwidth[direction])  # nbytes / inf == 0.0
        return start, time.perf_counter()
