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
import threading
import time
from collections.abc import Callable, Iterator

from offcore.kinds import Direction

__all__ = ["Link", "sleep_until"]

_SLEEP_OVERSHOOT = 1e-4  # time.sleep() wakes ~50-100 us late (Linux timer slack); spin the rest


def sleep_until(deadline: float) -> None:
    """Wait until ``time.perf_counter() >= deadline``: sleep (GIL released), then spin briefly.

    The final spin (at most ~0.1 ms) keeps the GIL: releasing it there (``sleep(0)``)
    costs the same timer slack the spin avoids.
    """
    remaining = deadline - time.perf_counter()
    if remaining > 2 * _SLEEP_OVERSHOOT:
        time.sleep(remaining - _SLEEP_OVERSHOOT)
    while time.perf_counter() < deadline:
        pass


class Link:
    """Channels of the emulated link and the time each copy occupies them."""

    def __init__(self, *, h2d_bandwidth: float, d2h_bandwidth: float, latency: float, duplex: bool) -> None:
        self.bandwidth = {Direction.H2D: h2d_bandwidth, Direction.D2H: d2h_bandwidth}
        self.latency = latency
        self.duplex = duplex
        h2d_channel = threading.Lock()
        self._channels = {Direction.H2D: h2d_channel, Direction.D2H: threading.Lock() if duplex else h2d_channel}

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
        self, direction: Direction, nbytes: int, memcpy: Callable[[], None], *, extra_delay: float = 0.0
    ) -> tuple[float, float]:
        """Run ``memcpy`` as a transfer on the link; returns its (start, end) ``perf_counter`` times.

        ``extra_delay`` (the sanitizer's jitter) postpones the landing of the data.
        """
        with self.channel(direction):
            start = time.perf_counter()
            if self.crosses_link(direction):
                sleep_until(start + self.latency + extra_delay)
                memcpy()
                sleep_until(start + extra_delay + self.duration(direction, nbytes))
            else:
                sleep_until(start + extra_delay)
                memcpy()
            return start, time.perf_counter()
