"""Measure a backend's link: copy bandwidth per direction, alone and both at once, and its latency.

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

:func:`measure_link` fits ``seconds = latency + bytes / bandwidth`` per direction (what
the simulator and the planner take, :class:`LinkMeasurement`):

    >>> from offcore.bandwidth import measure_link
    >>> link = measure_link(dev, max_bytes="4MiB")                       # doctest: +SKIP
    >>> link.h2d_bandwidth, link.latency_s                               # doctest: +SKIP

# Note [One link estimator]
# The link is measured in one way: copies timed by :class:`_Timer` (the backend's timing
# events, else the host clock around the copy and its synchronisation), fitted by
# :class:`offcore.scheduler.BandwidthEstimator` (least squares of ``latency + bytes /
# bandwidth``). :func:`measure_link` feeds it the medians of the two largest probe sizes
# (with two points least squares is the line through them), offcore_torch's profiler
# re-exports it, and the runtime's online estimate of each direction is the same
# estimator fed by the copies it times (offcore_torch.runtime). So the planner, the
# simulator and the runtime's deadlines read one model of the link.
# The NVMe tier's two links (NVMe → host, host → NVMe) are measured the same way:
# :func:`measure_nvme_link` times reads and writes of growing sizes through the tier itself
# (each handle's first-request start to last-request end) and fits them with the same
# estimator; the tier's ``read_link`` / ``write_link`` are that estimator fed by every
# completed transfer (the probe's included), so the ResidencyScheduler's stage deadlines
# (Note [Two hops from NVMe] in offcore/residency.py) follow the disk online.

NVMe (torch-free): :func:`measure_nvme_link` probes an :class:`~offcore.nvme.NvmeTier`:

    >>> import tempfile
    >>> from offcore.nvme import NvmeTier
    >>> from offcore.bandwidth import measure_nvme_link
    >>> with NvmeTier(tempfile.mkdtemp(), budget="8MiB") as tier:
    ...     link = measure_nvme_link(tier, max_bytes="1MiB")
    ...     link.read_duration(1 << 20) > 0, tier.read_link.samples > 0
    (True, True)
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.kinds import Direction, Tier
from offcore.protocols import Capability
from offcore.scheduler import BandwidthEstimator
from offcore.units import format_bytes, parse_size

__all__ = [
    "LinkProbe",
    "LinkMeasurement",
    "NvmeLinkMeasurement",
    "measure_copy_bandwidth",
    "measure_link",
    "measure_nvme_link",
    "fit_link",
    "DEFAULT_PROBE_SIZES",
]

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


@dataclass(frozen=True)
class LinkMeasurement:
    """Measured copy speed between device and pinned host memory.

    ``*_bandwidth`` in bytes per second (``inf`` when a copy takes no measurable
    time beyond its latency), ``latency_s`` the fixed cost per copy (fit of
    ``seconds = latency + bytes / bandwidth`` over two sizes, mean of both directions),
    ``duplex`` whether the backend copies both directions at once.

    >>> LinkMeasurement(1e9, 2e9, 1e-5, True).as_profile_fields()["h2d_bandwidth"]
    2000000000.0
    """

    d2h_bandwidth: float
    h2d_bandwidth: float
    latency_s: float
    duplex: bool
    sizes: tuple[int, ...] = ()

    def as_profile_fields(self) -> dict[str, Any]:
        """The :class:`~offcore.sim.StepProfile` keyword arguments this measurement gives."""
        return {
            "d2h_bandwidth": self.d2h_bandwidth,
            "h2d_bandwidth": self.h2d_bandwidth,
            "latency_s": self.latency_s,
            "duplex": self.duplex,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``inf`` written as ``"inf"``)."""
        return {
            "d2h_bandwidth": "inf" if math.isinf(self.d2h_bandwidth) else self.d2h_bandwidth,
            "h2d_bandwidth": "inf" if math.isinf(self.h2d_bandwidth) else self.h2d_bandwidth,
            "latency_s": self.latency_s,
            "duplex": self.duplex,
            "sizes": list(self.sizes),
        }


class _Timer:
    """Times one copy on one stream with events, or with the host clock (the one timed-copy helper)."""

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
            return max(0.0, float(self.start_event.elapsed_time(self.end_event)) / 1e3)
        return self.host_end - self.host_start

    def time(self, dst: Any, src: Any) -> float:
        """Seconds one copy of ``src`` into ``dst`` occupies the stream (waits for it)."""
        self.enqueue(dst, src)
        self.wait()
        return self.seconds()


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
            timer.time(dst, src)
        alone: dict[str, list[float]] = {"h2d": [], "d2h": []}
        both: dict[str, list[float]] = {"h2d": [], "d2h": []}
        for _ in range(repeat):
            for name, timer, dst, src in (("h2d", h2d, device_dst, host_src), ("d2h", d2h, host_dst, device_src)):
                alone[name].append(timer.time(dst, src))
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


def fit_link(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(bandwidth, latency)`` from ``(bytes, seconds)`` points, by :class:`BandwidthEstimator`'s least squares.

    Copies that took no measurable time say the link is faster than the clock: ``inf``
    bandwidth. A fit with a negative latency or a non-increasing time falls back to the
    ratio of totals with no latency (what the estimator does).

        >>> bandwidth, latency = fit_link([(1 << 20, 1e-5 + (1 << 20) / 1e9), (4 << 20, 1e-5 + (4 << 20) / 1e9)])
        >>> round(bandwidth / 1e9, 6), round(latency * 1e6, 3)
        (1.0, 10.0)
    """
    estimator = BandwidthEstimator(decay=1.0)
    for nbytes, seconds in points:
        estimator.observe(nbytes, seconds)
    bandwidth = estimator.bandwidth
    if bandwidth is None:
        return math.inf, 0.0
    return bandwidth, estimator.latency


def measure_link(
    backend: Any,
    *,
    min_bytes: int | str = "64KiB",
    max_bytes: int | str = "64MiB",
    target_s: float = 0.01,
    repeats: int = 3,
) -> LinkMeasurement:
    """Measure D2H and H2D bandwidth and the per-copy latency with timed copies on a copy stream.

    The copy size starts at ``min_bytes`` and grows ×4 until one copy takes at least
    ``target_s`` or reaches ``max_bytes`` (and never more than a quarter of the
    device's free memory). Each size is copied ``repeats`` times; the median counts.
    Bandwidth and latency are fitted over the two largest sizes (Note [One link estimator]).

        >>> import offcore                                                  # doctest: +SKIP
        >>> dev = offcore.device("cpu", h2d_bandwidth="128MiB/s", d2h_bandwidth="256MiB/s", latency=0)  # doctest: +SKIP
        >>> 0.5 < measure_link(dev, max_bytes="4MiB").d2h_bandwidth / 2**28 < 1.5  # doctest: +SKIP
        True
    """
    low = parse_size(min_bytes, what="min_bytes")
    high = parse_size(max_bytes, what="max_bytes")
    if high < low:
        raise ConfigurationError(f"max_bytes ({high}) must be at least min_bytes ({low})")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ConfigurationError(f"repeats must be a positive integer, got {repeats!r}")
    stats = backend.memory_stats()
    free = int(stats.get("capacity_bytes", 0) or 0) - int(stats.get("allocated_bytes", 0) or 0)
    if free > 0:
        high = max(low, min(high, free // 4))
    use_events = Capability.EVENT_TIMING in frozenset(getattr(backend, "capabilities", ()))
    stream = backend.new_stream()
    stream.wait_stream(backend.current_stream())  # after what the caller's compute stream has queued
    timer = _Timer(backend, stream, use_events)
    device_buffer = backend.allocate(high, Tier.DEVICE)
    host_buffer = backend.allocate(high, Tier.PINNED)
    samples: dict[str, list[tuple[int, float]]] = {"d2h": [], "h2d": []}
    try:
        for direction in ("d2h", "h2d"):
            size = low
            while True:
                dev_view, host_view = device_buffer[:size], host_buffer[:size]
                dst, src = (host_view, dev_view) if direction == "d2h" else (dev_view, host_view)
                median = statistics.median(timer.time(dst, src) for _ in range(repeats))
                samples[direction].append((size, median))
                if median >= target_s or size >= high:
                    break
                size = min(high, size * 4)
    finally:
        stream.synchronize()
        del device_buffer, host_buffer
    d2h, d2h_latency = fit_link(samples["d2h"][-2:])
    h2d, h2d_latency = fit_link(samples["h2d"][-2:])
    duplex = Capability.DUPLEX_COPY in frozenset(getattr(backend, "capabilities", ()))
    sizes = tuple(sorted({s for points in samples.values() for s, _ in points}))
    return LinkMeasurement(d2h, h2d, (d2h_latency + h2d_latency) / 2, duplex, sizes)


@dataclass(frozen=True)
class NvmeLinkMeasurement:
    """Measured speed of an NVMe tier's two links, each ``seconds = latency + bytes / bandwidth``.

    ``read_*``: NVMe → host (``n2h``, the first hop of a reload to the device); ``write_*``:
    host → NVMe (``h2n``). ``direct``: whether the tier used ``O_DIRECT``.

        >>> link = NvmeLinkMeasurement(2e9, 1e9, 1e-4, 2e-4, True)
        >>> round(link.read_duration(2_000_000_000), 4), link.duration(Direction.H2N, 0)
        (1.0001, 0.0002)
    """

    read_bandwidth: float
    write_bandwidth: float
    read_latency_s: float
    write_latency_s: float
    direct: bool
    sizes: tuple[int, ...] = ()

    def read_duration(self, nbytes: int) -> float:
        """Predicted seconds to read ``nbytes`` from NVMe into host memory (a stage)."""
        return self.read_latency_s + nbytes / self.read_bandwidth

    def write_duration(self, nbytes: int) -> float:
        """Predicted seconds to write ``nbytes`` from host memory to NVMe."""
        return self.write_latency_s + nbytes / self.write_bandwidth

    def duration(self, direction: Direction, nbytes: int) -> float:
        """Predicted seconds in ``direction`` (``Direction.N2H`` or ``Direction.H2N``)."""
        if direction is Direction.N2H:
            return self.read_duration(nbytes)
        if direction is Direction.H2N:
            return self.write_duration(nbytes)
        raise ConfigurationError(f"an NVMe link moves n2h or h2n, not {Direction(direction).value}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``inf`` written as ``"inf"``)."""
        out: dict[str, Any] = asdict(self)
        for name in ("read_bandwidth", "write_bandwidth"):
            if math.isinf(out[name]):
                out[name] = "inf"
        out["sizes"] = list(self.sizes)
        return out


def _drop_cached_pages(path: str) -> None:
    """Drop a file's pages from the page cache (a buffered tier's probe reads the disk, not memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def measure_nvme_link(
    tier: Any,
    *,
    min_bytes: int | str = "1MiB",
    max_bytes: int | str = "64MiB",
    target_s: float = 0.02,
    repeats: int = 3,
) -> NvmeLinkMeasurement:
    """Measure an :class:`~offcore.nvme.NvmeTier`'s read and write links with transfers through the tier.

    The size starts at ``min_bytes`` and grows ×4 until one transfer takes ``target_s`` or
    reaches ``max_bytes`` (never more than the tier's free budget). Each size is written
    then read ``repeats`` times from a page-aligned buffer; the medians of the two largest
    sizes are fitted (Note [One link estimator]). A buffered tier's pages are dropped before
    each read. The probe's object is deleted afterwards; its transfers also feed the tier's
    online ``read_link`` / ``write_link`` (and its ledger and trace, if any).
    """
    from offcore.nvme.files import ALIGNMENT, aligned_empty  # imported here: bandwidth stays light to import

    low = parse_size(min_bytes, what="min_bytes")
    high = parse_size(max_bytes, what="max_bytes")
    if high < low:
        raise ConfigurationError(f"max_bytes ({high}) must be at least min_bytes ({low})")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ConfigurationError(f"repeats must be a positive integer, got {repeats!r}")
    room = tier.free_bytes // ALIGNMENT * ALIGNMENT
    if room < low:
        raise CapacityExceededError(
            f"probing the NVMe tier needs {format_bytes(low)} of its budget, {format_bytes(tier.free_bytes)} is free"
        )
    high = min(high, room)
    key = ("offcore.bandwidth probe", id(tier))
    buffer = aligned_empty(high)
    buffer[:] = 0x5A
    samples: dict[str, list[tuple[int, float]]] = {"read": [], "write": []}
    try:
        size = low
        while True:
            view = buffer[:size]
            writes, reads = [], []
            for _ in range(repeats):
                handle = tier.write(key, view)
                handle.synchronize()
                writes.append(handle.seconds)
                if not tier.direct:
                    _drop_cached_pages(handle.path)
                handle = tier.read(key, view)
                handle.synchronize()
                reads.append(handle.seconds)
            samples["write"].append((size, statistics.median(writes)))
            samples["read"].append((size, statistics.median(reads)))
            if max(samples["write"][-1][1], samples["read"][-1][1]) >= target_s or size >= high:
                break
            size = min(high, size * 4)
    finally:
        if key in tier:
            tier.delete(key)
    read_bw, read_latency = fit_link(samples["read"][-2:])
    write_bw, write_latency = fit_link(samples["write"][-2:])
    return NvmeLinkMeasurement(
        read_bw, write_bw, read_latency, write_latency, bool(tier.direct), tuple(s for s, _ in samples["read"])
    )
