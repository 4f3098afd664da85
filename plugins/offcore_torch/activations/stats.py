"""Per-step figures of an activation-offload region.

>>> from offcore_torch.activations.stats import OffloadStats
>>> s = OffloadStats(offloaded_bytes=4096, reloaded_bytes=4096)
>>> s.as_dict()["offloaded_bytes"]
4096
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from offcore.units import format_bandwidth, format_bytes

__all__ = ["OffloadStats"]


@dataclass
class OffloadStats:
    """What one ``offload_activations`` region (one graph) did.

    Bytes are storage bytes (a tensor and its views count once). Times are seconds.

    - ``offloaded_bytes`` / ``reloaded_bytes``: copied device→host / host→device.
    - ``freed_device_bytes``: offloaded storages that really died on the device after
      their copy landed (the memory offloading saved); ``held_elsewhere_bytes``:
      offloaded storages still alive because something else references them (the
      input batch, a tensor the caller kept) — copied, but nothing was freed.
    - ``peak_device_bytes``: device peak during the region's forward and backward;
      ``peak_pinned_bytes`` / ``peak_pageable_bytes``: host bytes this region held.
    - ``exposed_wait_s``: compute time lost waiting for copies (reloads, and saves held back by
      ``max_inflight``); ``waits`` the same
      per object (name → seconds); ``stalls``: reloads that were not prefetched and ran
      synchronously (misses); ``stalled_objects``: their names.
    - ``inflight_waits`` / ``inflight_wait_s``: saves that first waited for earlier
      device-to-host copies to land (``max_inflight``), and the seconds they waited (part of
      ``exposed_wait_s``, charged in ``waits`` to "device-to-host copies in flight (max_inflight)").
    - ``d2h_bandwidth`` / ``h2d_bandwidth``: achieved bytes/s of this region's copies
      (0 when none was timed).
    - ``fallbacks``: storages that did not fit the pinned host budget (kept on the
      device or copied to pageable memory, per policy).
    - ``prefetched_bytes`` / ``prefetch_hits``: reloads started ahead of use, and uses
      that found their reload already started; ``peak_prefetched_bytes``: the most
      bytes reloaded (or kept) ahead of use at once — at most ``prefetch_budget``
      unless a single storage is larger; ``reused_live_bytes``: storages still
      alive at use, returned without any copy.
    - ``offloaded_storages``, ``offloaded_tensors`` (saved tensors served by them: a
      storage saved with its views counts once and several times),
      ``saved_tensors`` (packed by the hooks), ``kept``
      (tensors not offloaded, by reason: ``parameter`` (a parameter or
      buffer of a module that ran, or a view of one), ``leaf`` (another tensor that
      requires grad), ``small``, ``not_on_device``, ``marked``, ``no_offload``,
      ``excluded``, ``outside_modules``, ``watermark``, ``host_budget``, ``copy_failed``, ...).
    - ``copy_failures``: copies that failed and were recovered from (a failed
      device-to-host copy keeps the device copy; a failed prefetch is reloaded
      synchronously); each also raises an :class:`offcore.OffcoreWarning`.
    - NVMe tier (``nvme=`` / ``tier="nvme"``; zero otherwise): ``spilled_bytes`` written
      host→NVMe, ``nvme_read_bytes`` read back, ``peak_nvme_bytes`` this region's bytes on
      disk at once, ``nvme_stalls`` / ``nvme_wait_s`` host-to-device copies that waited for
      their read, ``nvme_failures`` writes that failed (the host copy stayed the data),
      ``nvme_full`` storages kept in host memory because the tier's budget was used up.
    """

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    freed_device_bytes: int = 0
    held_elsewhere_bytes: int = 0
    peak_device_bytes: int = 0
    peak_pinned_bytes: int = 0
    peak_pageable_bytes: int = 0
    exposed_wait_s: float = 0.0
    inflight_waits: int = 0
    inflight_wait_s: float = 0.0
    waits: dict[str, float] = field(default_factory=dict)
    stalls: int = 0
    stalled_objects: list[str] = field(default_factory=list)
    d2h_bandwidth: float = 0.0
    h2d_bandwidth: float = 0.0
    fallbacks: int = 0
    prefetched_bytes: int = 0
    prefetch_hits: int = 0
    peak_prefetched_bytes: int = 0
    reused_live_bytes: int = 0
    offloaded_storages: int = 0
    offloaded_tensors: int = 0
    saved_tensors: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    copy_failures: int = 0
    spilled_bytes: int = 0
    nvme_read_bytes: int = 0
    peak_nvme_bytes: int = 0
    nvme_stalls: int = 0
    nvme_wait_s: float = 0.0
    nvme_failures: int = 0
    nvme_full: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One human-readable line."""
        return (
            f"offloaded {format_bytes(self.offloaded_bytes)} ({self.offloaded_storages} storages, "
            f"{format_bytes(self.freed_device_bytes)} freed, {format_bytes(self.held_elsewhere_bytes)} held elsewhere), "
            f"reloaded {format_bytes(self.reloaded_bytes)} (prefetched {format_bytes(self.prefetched_bytes)}, "
            f"{self.stalls} stalls), exposed wait {self.exposed_wait_s * 1e3:.3f} ms, "
            f"peak device {format_bytes(self.peak_device_bytes)}, pinned {format_bytes(self.peak_pinned_bytes)}, "
            f"d2h {format_bandwidth(self.d2h_bandwidth) if self.d2h_bandwidth else '-'}, "
            f"h2d {format_bandwidth(self.h2d_bandwidth) if self.h2d_bandwidth else '-'}, "
            f"fallbacks {self.fallbacks}"
        )

    def __str__(self) -> str:
        return self.summary()
