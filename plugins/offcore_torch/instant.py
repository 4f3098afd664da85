"""A test-only backend whose copies and events complete at once: :class:`InstantDevice`.

Every copy is a plain ``Tensor.copy_`` on the calling thread, every event is complete
when it is recorded, streams never wait. Nothing is emulated (no link, no copy workers,
no sanitizer), so a workload run on it costs exactly the binding's and the core's own
work plus the bytes moved: ``benchmarks/hook_overhead.py`` measures offcore's own cost
per object on it, apart from the fake device's emulation. "Device" memory is ordinary
CPU memory; a buffer is host memory when it was allocated as a host tier (``allocate``
with a host tier, or a block of a ``host_pool``), device memory otherwise.

Not registered by default (it would show in every ``offcore.device`` listing); a test or
benchmark registers it once, as a third-party plugin would::

    >>> import offcore
    >>> from offcore_torch.instant import register_instant
    >>> register_instant()
    >>> dev = offcore.device("instant", capacity="1GiB")
    >>> dev.holds(dev.allocate(16, offcore.Tier.DEVICE))
    True
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, ClassVar

import torch

import offcore
from offcore import Availability, Capability, CapacityExceededError, HostBufferPool, MemoryStats, Tier
from offcore.immediate import ImmediateEvent, ImmediateStream
from offcore.registry import backends

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_DEVICE = Tier.DEVICE

__all__ = ["InstantDevice", "InstantEvent", "InstantStream", "register_instant"]


# the protocol's event and stream for a backend whose work is done when enqueued (offcore.immediate)
InstantEvent = ImmediateEvent
InstantStream = ImmediateStream


def _storage_key(buffer: Any) -> int:
    return buffer.untyped_storage()._cdata


class InstantDevice:
    """Torch CPU tensors, synchronous copies, a byte-accounted device of ``capacity`` bytes (tests only)."""

    name: ClassVar[str] = "instant"
    capabilities = frozenset({Capability.TORCH, Capability.EVENT_TIMING, Capability.PINNED_MEMORY})

    def __init__(self, index: int = 0, capacity: int | str = "16GiB") -> None:
        if index != 0:
            raise offcore.ConfigurationError(f"the instant backend has one device (index 0), got {index}")
        self.index = index
        self.capacity = offcore.parse_size(capacity, what="capacity")
        self.torch_device = torch.device("cpu")
        self._allocated = 0
        self._peak = 0
        # reentrant: a storage's death callback (_device_freed, _host_freed) runs on whichever thread
        # drops its last reference or runs the garbage collector, which may be this one inside the lock
        # (allocate makes objects there: a collection it triggers frees a buffer kept by a cycle). A
        # plain Lock deadlocked there (seen in benchmarks/hook_overhead.py's batched floor)
        self._lock = threading.RLock()
        self._host: set[int] = set()  # the storages of host buffers (everything else is device memory)
        self._host_refs: dict[weakref.ref[Any], int] = {}
        self._device_bytes: dict[weakref.ref[Any], int] = {}  # the live device buffers' storages, and their bytes
        self._stream = InstantStream()

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "", 1)

    def __repr__(self) -> str:
        return f"InstantDevice(capacity={self.capacity})"

    def current_stream(self) -> InstantStream:
        return self._stream

    def new_stream(self, *, priority: int = 0) -> InstantStream:
        return InstantStream()

    def new_event(self, *, enable_timing: bool = False) -> InstantEvent:
        return InstantEvent(enable_timing)

    # Each buffer's storage is watched by one weak reference (torch keeps one Python object per
    # storage while any tensor uses it): its callback returns the bytes (device) or forgets the
    # storage (host). A plain weakref, not weakref.finalize (four objects for the garbage collector).
    def _device_freed(self, ref: weakref.ref[Any]) -> None:
        with self._lock:
            self._allocated -= self._device_bytes.pop(ref, 0)

    def _host_freed(self, ref: weakref.ref[Any]) -> None:
        with self._lock:
            key = self._host_refs.pop(ref, None)
            if key is not None:
                self._host.discard(key)

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        storage = buffer.untyped_storage()
        key = storage._cdata
        with self._lock:
            self._host.add(key)
            self._host_refs[weakref.ref(storage, self._host_freed)] = key
        return buffer

    def allocate(self, nbytes: int, tier: Tier) -> torch.Tensor:
        """A 1-D uint8 buffer of ``nbytes`` in ``tier`` (device buffers count against ``capacity``)."""
        if tier is not _DEVICE:
            return self._host_buffer(nbytes)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            if self._allocated + nbytes > self.capacity:
                raise CapacityExceededError(
                    f"instant device out of memory: {nbytes} bytes requested, "
                    f"{self.capacity - self._allocated} of {self.capacity} bytes free"
                )
            self._allocated += nbytes
            if self._allocated > self._peak:
                self._peak = self._allocated
            self._device_bytes[weakref.ref(buffer.untyped_storage(), self._device_freed)] = nbytes
        return buffer

    def holds(self, buffer: Any) -> bool:
        """True for a CPU tensor that is not one of this device's host buffers."""
        return (
            isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and _storage_key(buffer) not in self._host
        )

    def copy_(self, dst: Any, src: Any, *, stream: Any, start_event: Any = None) -> InstantEvent:
        """``dst.copy_(src)`` now; the returned event is complete."""
        if start_event is not None:
            start_event.record(stream)
        if dst.dtype is src.dtype and dst.shape == src.shape:
            dst.copy_(src)
        else:  # raw bytes on one side, a typed view on the other (either may be non-contiguous)
            if not dst.is_contiguous():
                dst.copy_(src.contiguous().view(torch.uint8).view(-1).view(dst.dtype).view(dst.shape))
            else:
                dst.view(torch.uint8).view(-1).copy_(src.contiguous().view(torch.uint8).view(-1))
        return stream.record_event(InstantEvent(enable_timing=True))

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            allocated_bytes=self._allocated, peak_allocated_bytes=self._peak, capacity_bytes=self.capacity
        )

    def allocated_bytes(self) -> int:
        return self._allocated

    def reset_peak_memory_stats(self) -> None:
        self._peak = self._allocated

    def synchronize(self) -> None:
        pass

    def host_pool(self, budget: int | str, *, pinned: bool = True) -> HostBufferPool:
        return HostBufferPool(self._host_buffer, budget=budget, block_size="1MiB")

    def __enter__(self) -> InstantDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Plugin:
    @offcore.hookimpl
    def offcore_register_backends(self, register: Any) -> None:
        register("instant", InstantDevice, description="copies and events complete at once (tests and benchmarks)")


def register_instant() -> None:
    """Register the ``"instant"`` backend with offcore (once per process; later calls do nothing)."""
    # asks the registry, not a flag of this module: offcore.registry.reset_registry() (tests) forgets it
    if "instant" not in {info.name for info in backends()}:
        offcore.register_plugin(_Plugin(), name="offcore_torch-instant")
