"""A minimal, synchronous numpy backend used to test the conformance suite and the pytest plugin.

Every copy runs at once on the calling thread, so streams and events are trivially
ordered; that is enough to show the suite passes on a correct backend and fails on a
broken one (``BrokenStridesBackend`` copies raw bytes and ignores strides) without
depending on the CPU fake device. Registered by hand, as a third-party plugin would be::

    import offcore, reference_backend
    offcore.register_plugin(reference_backend.Plugin(), name="reference")
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, ClassVar

import numpy as np

import offcore
from offcore import Availability, Capability, CapacityExceededError, HostBufferPool, MemoryStats, Tier
from offcore.immediate import ImmediateEvent, ImmediateStream

ReferenceEvent = ImmediateEvent  # work is complete when enqueued (offcore.immediate)
ReferenceStream = ImmediateStream


class ReferenceBackend:
    """Numpy buffers, synchronous copies, a byte-accounted device of ``capacity`` bytes."""

    name: ClassVar[str] = "reference"
    capabilities = frozenset({Capability.NUMPY, Capability.EVENT_TIMING, Capability.PINNED_MEMORY})

    def __init__(self, index: int = 0, capacity: int | str = "64MiB") -> None:
        self.index = index
        self.capacity = offcore.parse_size(capacity, what="capacity")
        self._allocated = 0
        self._peak = 0
        self._lock = threading.Lock()
        self._device_ids: set[int] = set()
        self._stream = ReferenceStream()

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "", 1)

    def current_stream(self) -> ReferenceStream:
        return self._stream

    def new_stream(self, *, priority: int = 0) -> ReferenceStream:
        return ReferenceStream()

    def new_event(self, *, enable_timing: bool = False) -> ReferenceEvent:
        return ReferenceEvent(enable_timing)

    def _freed(self, nbytes: int, ident: int) -> None:
        with self._lock:
            self._allocated -= nbytes
            self._device_ids.discard(ident)

    def allocate(self, nbytes: int, tier: Tier) -> np.ndarray:
        if tier is not Tier.DEVICE:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            if self._allocated + nbytes > self.capacity:
                raise CapacityExceededError(
                    f"reference device out of memory: {nbytes} bytes requested, "
                    f"{self.capacity - self._allocated} of {self.capacity} bytes free"
                )
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)
        buffer = np.empty(nbytes, np.uint8)
        self._device_ids.add(id(buffer))
        weakref.finalize(buffer, self._freed, nbytes, id(buffer))
        return buffer

    def holds(self, buffer: Any) -> bool:
        while isinstance(buffer, np.ndarray):
            if id(buffer) in self._device_ids:
                return True
            buffer = buffer.base
        return False

    def copy_(self, dst: Any, src: Any, *, stream: Any, start_event: Any = None) -> ReferenceEvent:
        if start_event is not None:
            start_event.record(stream)
        dst[...] = src
        return stream.record_event()

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            allocated_bytes=self._allocated, peak_allocated_bytes=self._peak, capacity_bytes=self.capacity
        )

    def reset_peak_memory_stats(self) -> None:
        self._peak = self._allocated

    def synchronize(self) -> None:
        pass

    def host_pool(self, budget: int | str, *, pinned: bool = True) -> HostBufferPool:
        return HostBufferPool(lambda n: np.empty(n, np.uint8), budget=budget, block_size="1MiB")

    def __enter__(self) -> ReferenceBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class BrokenStridesBackend(ReferenceBackend):
    """Copies the source's memory byte for byte, ignoring its strides: wrong for non-contiguous views."""

    name: ClassVar[str] = "broken_strides"

    def copy_(self, dst: Any, src: Any, *, stream: Any, start_event: Any = None) -> ReferenceEvent:
        flat = np.lib.stride_tricks.as_strided(src, shape=(src.size,), strides=(src.itemsize,))
        dst[...] = flat.reshape(dst.shape)
        return stream.record_event()


class Plugin:
    """Registers both backends, as a third-party adapter's entry point would."""

    @offcore.hookimpl
    def offcore_register_backends(self, register: Any) -> None:
        register("reference", ReferenceBackend, description="synchronous numpy reference (tests only)")
        register("broken_strides", BrokenStridesBackend, description="ignores strides (tests only)")
