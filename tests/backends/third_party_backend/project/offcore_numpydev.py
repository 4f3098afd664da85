"""A third-party offcore backend: a synchronous "device" whose memory is numpy arrays.

Device memory is host memory counted against ``capacity``. A copy has landed when ``copy_``
returns, so one class serves as stream and event, and neither has anything to wait for.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

import offcore
from offcore import Availability, Capability, CapacityExceededError, HostBufferPool, MemoryStats, Tier


class Marker:  # an offcore.Stream and an offcore.Event
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing, self.time = enable_timing, time.perf_counter()

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def record_event(self, event: Marker | None = None) -> Marker:
        event = event or Marker()
        event.record(self)
        return event

    def elapsed_time(self, end_event: Marker) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True")
        return (end_event.time - self.time) * 1e3

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...


class NumpyDevice:
    name = "numpydev"
    capabilities = frozenset({Capability.NUMPY, Capability.EVENT_TIMING})

    def __init__(self, index: int = 0, capacity: int | str = "256MiB") -> None:
        self.capacity, self.allocated, self.peak = offcore.parse_size(capacity), 0, 0
        self.arrays: set[int] = set()  # ids of the live arrays allocated on the device

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, device_count=1)

    def current_stream(self) -> Marker:
        return Marker()

    def new_stream(self, *, priority: int = 0) -> Marker:
        return Marker()

    def new_event(self, *, enable_timing: bool = False) -> Marker:
        return Marker(enable_timing)

    def allocate(self, nbytes: int, tier: Tier) -> np.ndarray:
        buffer = np.empty(nbytes, np.uint8)
        if tier is Tier.DEVICE:
            if self.allocated + nbytes > self.capacity:
                raise CapacityExceededError(f"numpydev out of memory: asked {nbytes} bytes, capacity {self.capacity}")
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
            self.arrays.add(id(buffer))
            weakref.finalize(buffer, self._free, id(buffer), nbytes)
        return buffer

    def _free(self, ident: int, nbytes: int) -> None:
        self.arrays.discard(ident)
        self.allocated -= nbytes

    def holds(self, buffer: Any) -> bool:  # a view's base is the array that owns its memory
        return id(buffer if getattr(buffer, "base", None) is None else buffer.base) in self.arrays

    def copy_(self, dst: Any, src: Any, *, stream: Marker, start_event: Marker | None = None) -> Marker:
        if start_event is not None:
            start_event.record(stream)
        if (dst.dtype, dst.shape) != (src.dtype, src.shape):  # the same bytes in another layout
            if dst.flags.c_contiguous:
                dst = dst.reshape(-1).view(src.dtype).reshape(src.shape)
            else:  # flattening a strided source copies it, which is fine for a source
                src = src.reshape(-1).view(dst.dtype).reshape(dst.shape)
        np.copyto(dst, src, casting="no")
        return stream.record_event()

    def host_pool(self, budget: int | str, *, pinned: bool = True) -> HostBufferPool:
        return HostBufferPool(lambda nbytes: np.empty(nbytes, np.uint8), budget=budget, block_size="1MiB")

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(allocated_bytes=self.allocated, peak_allocated_bytes=self.peak, capacity_bytes=self.capacity)

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated

    def __enter__(self) -> NumpyDevice:
        return self

    def __exit__(self, *exc: object) -> None: ...
    def synchronize(self) -> None: ...


@offcore.hookimpl
def offcore_register_backends(register: Any) -> None:
    register("numpydev", NumpyDevice, description="synchronous numpy device (third-party example)")
