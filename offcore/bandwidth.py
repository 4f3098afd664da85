"""Measure a backend's copy bandwidth per direction: host-to-device, device-to-host, both at once.

Works on any :class:`~offcore.protocols.Backend` through the protocol alone (raw
``uint8`` buffers, streams, events), so it needs no torch. Times come from timing
events where the backend has them (:attr:`Capability.EVENT_TIMING`), otherwise from
the host clock around the copy and its synchronisation.

    >>> import offcore
    >>> from offcore.bandwidth import measure_copy_bandwidth
    >>> dev = offcore.device("cpu", h2d_bandwidth="8GiB/s")             # doctest: +SKIP
    >>> [r.h2d / 2**30 for r in measure_copy_bandwidth(dev, ["64MiB"])]  # doctest: +SKIP
    [7.99...]

PCIe links often slow one direction while the other runs, so "both" measures each
direction while the other is busy: measure, don't assume.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.kinds import Tier
from offcore.protocols import Capability
from offcore.units import format_bytes, parse_size

__all__ = ["LinkProbe", "measure_copy_bandwidth", "DEFAULT_PROBE_SIZES"]

DEFAULT_PROBE_SIZES: tuple[str, ...] = ("1MiB", "16MiB", "64MiB")


@dataclass(frozen=True)
class LinkProbe:
    """Median bandwidths (bytes per second) for copies of ``size_bytes``.

    ``h2d`` and ``d2h`` are measured alone; ``both_h2d`` and ``both_d2h`` while the
    other direction copies at the same time (on its own stream).
    """

    size_bytes: int
    h2d: float
    d2h: float
    both_h2d: float
    both_d2h: float
    timing: str
    """``"events"`` or ``"host clock"``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Timer:
    """Times one copy on one stream with events, or with the host clock."""

    def __init__(self, backend: Any, stream: Any, use_events: bool) -> None:
        self.backend = backend
        self.stream = stream
        self.use_events = use_events
        self.start_event: Any = None
        self.end_event: Any = None
        self.host_start = 0.0
        self.host_end = 0.0

    def enqueue(self, dst: Any, src: Any) -> None:
        if self.use_events:
            self.start_event = self.backend.new_event(enable_timing=True)
            self.end_event = self.backend.new_event(enable_timing=True)
            self.start_event.record(self.stream)
        self.host_start = time.perf_counter()
        self.backend.copy_(dst, src, stream=self.stream)
        if self.use_events:
            self.end_event.record(self.stream)

    def wait(self) -> None:
        if self.use_events:
            self.end_event.synchronize()
        else:
            self.stream.synchronize()
        self.host_end = time.perf_counter()

    def seconds(self) -> float:
        if self.use_events:
            return float(self.start_event.elapsed_time(self.end_event)) / 1e3
        return self.host_end - self.host_start


def _rate(nbytes: int, samples: list[float]) -> float:
    seconds = statistics.median(samples)
    return nbytes / seconds if seconds > 0 else float("inf")


def measure_copy_bandwidth(
    backend: Any,
    sizes: Sequence[int | str] = DEFAULT_PROBE_SIZES,
    *,
    repeat: int = 3,
    host_tier: Tier = Tier.PINNED,
    progress: Callable[[str], None] | None = None,
) -> list[LinkProbe]:
    """Median copy bandwidth for each size, one direction alone and both at once.

    Needs two device buffers of the largest size; raises
    :class:`~offcore.CapacityExceededError` when they do not fit the device's free memory.
    """
    if repeat < 1:
        raise ConfigurationError(f"repeat must be at least 1, got {repeat!r}")
    if host_tier not in (Tier.PINNED, Tier.PAGEABLE):
        raise ConfigurationError(f"host_tier must be pinned or pageable, got {host_tier!r}")
    nbytes_list = [parse_size(size, what="probe size") for size in sizes]
    stats = backend.memory_stats()
    free = stats.capacity_bytes - stats.allocated_bytes
    if nbytes_list and 2 * max(nbytes_list) > free:
        raise CapacityExceededError(
            f"probing {format_bytes(max(nbytes_list))} copies needs {format_bytes(2 * max(nbytes_list))} of device "
            f"memory, {format_bytes(free)} is free: choose smaller sizes"
        )
    use_events = Capability.EVENT_TIMING in backend.capabilities
    h2d_stream, d2h_stream = backend.new_stream(), backend.new_stream()
    results = []
    for nbytes in nbytes_list:
        if progress is not None:
            progress(f"{getattr(backend, 'name', type(backend).__name__)}: {format_bytes(nbytes)} copies")
        host_src = backend.allocate(nbytes, host_tier)
        host_dst = backend.allocate(nbytes, host_tier)
        device_dst = backend.allocate(nbytes, Tier.DEVICE)
        device_src = backend.allocate(nbytes, Tier.DEVICE)
        h2d = _Timer(backend, h2d_stream, use_events)
        d2h = _Timer(backend, d2h_stream, use_events)
        for timer, dst, src in ((h2d, device_dst, host_src), (d2h, host_dst, device_src)):  # warm-up
            timer.enqueue(dst, src)
            timer.wait()
        alone: dict[str, list[float]] = {"h2d": [], "d2h": []}
        both: dict[str, list[float]] = {"h2d": [], "d2h": []}
        for _ in range(repeat):
            for name, timer, dst, src in (("h2d", h2d, device_dst, host_src), ("d2h", d2h, host_dst, device_src)):
                timer.enqueue(dst, src)
                timer.wait()
                alone[name].append(timer.seconds())
            h2d.enqueue(device_dst, host_src)
            d2h.enqueue(host_dst, device_src)
            h2d.wait()
            d2h.wait()
            both["h2d"].append(h2d.seconds())
            both["d2h"].append(d2h.seconds())
        results.append(
            LinkProbe(
                size_bytes=nbytes,
                h2d=_rate(nbytes, alone["h2d"]),
                d2h=_rate(nbytes, alone["d2h"]),
                both_h2d=_rate(nbytes, both["h2d"]),
                both_d2h=_rate(nbytes, both["d2h"]),
                timing="events" if use_events else "host clock",
            )
        )
        del host_src, host_dst, device_dst, device_src
    backend.synchronize()
    return results
