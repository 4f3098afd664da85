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


class Link:
    """Channels of the emulated link and the time each copy occupies them."""

    def __init__(self, *, h2d_bandwidth: float, d2h_bandwidth: float, latency: float, duplex: bool) -> None:
        self.bandwidth = {Direction.H2D: h2d_bandwidth, Direction.D2H: d2h_bandwidth}
        self.latency = latency
        self.duplex = duplex
        h2d_channel = threading.Lock()
        self._channels = {Direction.H2D: h2d_channel, Direction.D2H: threading.Lock() if duplex else h2d_channel}
        # per channel: when the transfers reserved so far end (inline copies reserve ahead)
        self._free_at: dict[int, float] = {id(lock): 0.0 for lock in self._channels.values()}

    def reserve(self, direction: Direction, nbytes: int, not_before: float = 0.0) -> tuple[float, float] | None:
        """Book the next free slot of ``direction``'s channel for ``nbytes`` without waiting.

        Returns the transfer's (start, end) ``perf_counter`` times: it starts when the channel
        is free, not before ``not_before`` nor now, and lasts :meth:`duration`. None while a
        worker's :meth:`transfer` holds the channel (the caller queues its copy instead).
        Used by inline copies (Note [Inline copies on an idle stream]).
        """
        channel = self._channels.get(direction)
        if channel is None:  # H2H, D2D: no link time
            start = max(time.perf_counter(), not_before)
            return start, start
        if not channel.acquire(blocking=False):
            return None
        try:  # once per inline copy: comparisons rather than max(), one lookup of the channel's time
            free_at = self._free_at
            key = id(channel)
            start = time.perf_counter()
            if not_before > start:
                start = not_before
            booked = free_at[key]
            if booked > start:
                start = booked
            duration = self.latency + nbytes / self.bandwidth[direction]
            end = start + duration
            if end - start < duration:  # rounding: never report less than the emulated time
                end = math.nextafter(end, math.inf)
            free_at[key] = end
            return start, end
        finally:
            channel.release()

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
        channel = self._channels.get(direction)
        if channel is None:  # H2H, D2D: no link time
            return [(start, start)] * len(sizes)
        if not channel.acquire(blocking=False):
            return None
        try:
            free_at = self._free_at
            key = id(channel)
            booked = free_at[key]
            if booked > start:
                start = booked
            latency, bandwidth = self.latency, self.bandwidth[direction]
            nextafter, inf = math.nextafter, math.inf
            for nbytes in sizes:
                duration = latency + nbytes / bandwidth
                end = start + duration
                if end - start < duration:  # rounding: never report less than the emulated time
                    end = nextafter(end, inf)
                spans.append((start, end))
                start = end
            free_at[key] = start
            return spans
        finally:
            channel.release()

    def crosses_link(self, direction: Direction) -> bool:
        return direction in self._channels

    def duration(self, direction: Direction, nbytes: int) -> float:
        """Emulated seconds for ``nbytes`` in ``direction`` (0 for H2H and D2D)."""
        if not self.crosses_link(direction):
            return 0.0
        return self.latency + nbytes / self.bandwidth[direction]  # nbytes / inf == 0.0

    @contextlib.contextmanager
    def channel(self, direction: Direction) -> Iterator[None]:
        """Hold the channel ``direction`` uses (nothing for H2H and D2D) for the duration of a transfer."""
        channel = self._channels.get(direction)
        if channel is None:
            yield
        else:
            with channel:
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
        channel = self._channels.get(direction)
        if channel is None:  # H2H, D2D: only the memcpy
            start = time.perf_counter()
            if extra_delay > 0:
                sleep_until(start + extra_delay)
            memcpy()
            return start, time.perf_counter()
        with channel:
            start = time.perf_counter()
            key = id(channel)
            free_at = self._free_at[key]
            if free_at > start:  # inline copies booked the channel until then
                sleep_until(free_at)
                start = max(time.perf_counter(), free_at)
            elif since is not None:  # the channel was free: the transfer began when the copy was reached
                start = max(min(since, start), free_at)
            try:
                return self._occupy(direction, nbytes, memcpy, start, extra_delay, data_first)
            finally:
                self._free_at[key] = max(self._free_at[key], time.perf_counter())

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
