"""The link a profile plans on: its bandwidth per direction (offcore's estimator) and the latency of one copy."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace
from typing import Any

from offcore.bandwidth import LinkMeasurement
from offcore.bandwidth import measure_link as _core_measure_link
from offcore.errors import ConfigurationError
from offcore.kinds import Tier

# ----------------------------------------------------------------------------- the link
# Note [One link estimator] (offcore.bandwidth): the link is measured once, torch-free, in
# the core (``LinkMeasurement`` is re-exported from there unchanged); the profiler's
# ``measure_link`` takes its bandwidths and measures the latency apart (Note [The latency
# is measured with small copies]).
#
#     >>> import offcore
#     >>> dev = offcore.device("cpu", h2d_bandwidth="128MiB/s", d2h_bandwidth="256MiB/s", latency=0)
#     >>> link = measure_link(dev, max_bytes="4MiB")
#     >>> 0.5 < link.d2h_bandwidth / 2**28 < 1.5
#     True
#
# Note [The latency is measured with small copies]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The core fits ``latency + bytes / bandwidth`` through its two largest probes (1 and 4 MiB
# on the fake device's PCIe-like link: copies of 7 and 28 ms), so its latency is the
# difference of two long copies' noise: on the loaded 2-core VM it read 0 to 1.3 ms, six
# runs in a row, for a link whose copies cost 10-20 us each. The simulator charges the
# latency to every copy: to each parameter tensor streamed (about 100 per TinyGPT step,
# Note [Parameter copies pay one latency each] in offcore/sim/simulator.py) and each saved
# tensor offloaded, so that noise alone moved predicted steps by 10-30 %. The latency that
# matters is what a copy costs beyond its bytes when copies queue back to back, as the
# runtimes issue them: :func:`measure_copy_latency` times ``copies`` small copies issued
# together on a copy stream (median of ``repeats``), per copy, minus their bytes'
# bandwidth time. ``measure_link`` returns the core's bandwidths with that latency.


def measure_copy_latency(
    backend: Any,
    bandwidth: float = math.inf,
    *,
    nbytes: int = 4096,
    copies: int = 32,
    repeats: int = 5,
) -> float:
    """Seconds one host-to-device copy costs beyond ``nbytes / bandwidth`` when ``copies`` small copies
    are issued back to back on one copy stream (Note [The latency is measured with small copies]).

        >>> import offcore
        >>> dev = offcore.device("cpu", h2d_bandwidth="1GiB/s", latency="200us")
        >>> 150e-6 < measure_copy_latency(dev, 2**30) < 2e-3
        True
        >>> dev.close()
    """
    if not (isinstance(copies, int) and not isinstance(copies, bool) and copies >= 1):
        raise ConfigurationError(f"copies must be a positive integer, got {copies!r}")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ConfigurationError(f"repeats must be a positive integer, got {repeats!r}")
    stream = backend.new_stream()
    stream.wait_stream(backend.current_stream())
    host = [backend.allocate(nbytes, Tier.PINNED) for _ in range(copies)]
    device_buffers = [backend.allocate(nbytes, Tier.DEVICE) for _ in range(copies)]
    samples = []
    try:
        for _ in range(repeats + 1):  # the first round warms the copy thread up
            start = time.perf_counter()
            for dst, src in zip(device_buffers, host, strict=True):
                backend.copy_(dst, src, stream=stream)
            stream.synchronize()
            samples.append(time.perf_counter() - start)
    finally:
        stream.synchronize()
        del host, device_buffers
    per_copy = statistics.median(samples[1:]) / copies
    return max(0.0, per_copy - (0.0 if math.isinf(bandwidth) else nbytes / bandwidth))


def measure_link(backend: Any, **options: Any) -> LinkMeasurement:
    """The link as the simulator takes it: :func:`offcore.bandwidth.measure_link`'s bandwidths (``options``
    pass through) and :func:`measure_copy_latency`'s latency (Note [The latency is measured with small copies])."""
    link = _core_measure_link(backend, **options)
    return replace(link, latency_s=measure_copy_latency(backend, link.h2d_bandwidth))
