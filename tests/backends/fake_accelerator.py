"""CPU stand-ins for a torch accelerator module, to test the CUDA and NPU adapters' logic here.

:class:`FakeAcceleratorModule` has the shape of ``torch.cuda`` / ``torch.npu`` (Stream,
Event, stream(), device(), current_stream(), memory statistics, memory fraction) and
records what the adapter asks of it. It is not a device emulation -- the CPU fake
device (``offcore_cpu``) is that. Its streams complete work at once unless *held*:
events recorded on a held stream stay pending until the stream is released or
synchronized, which is how the tests check that the adapter waits on events. Its
allocator (:meth:`FakeAcceleratorModule.empty_device`) counts device memory per
device until each storage dies and refuses what exceeds the per-process memory
fraction with ``torch.OutOfMemoryError``, as the caching allocator does.

:class:`FakeAcceleratorDevice` runs the shared adapter
(:class:`offcore_accelerator.TorchAcceleratorDevice`) on that module, with
"device" tensors that are CPU tensors from that allocator and "pinned" memory that
is the CPU blocks its pool allocated (recognised by the adapter's own block ranges),
rounded up to a power of two as torch's caching host allocator does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from offcore_accelerator import TorchAcceleratorDevice, power_of_two_ceil, tensor_over

from offcore.protocols import Availability

GiB = 1 << 30


class FakeEvent:
    """Event semantics: complete unless recorded on a held stream."""

    def __init__(self, module: FakeAcceleratorModule, enable_timing: bool = False) -> None:
        self.module = module
        self.enable_timing = enable_timing
        self.done = True
        self.stream: FakeStream | None = None
        self.waited_by: list[FakeStream] = []

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.module.current_stream()
        self.stream = stream
        self.done = not stream.held
        if not self.done:
            stream.pending.append(self)

    def wait(self, stream: FakeStream | None = None) -> None:
        self.waited_by.append(stream if stream is not None else self.module.current_stream())

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True  # blocking until the device reached it

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("both events must be created with enable_timing=True")
        return 0.0


class FakeStream:
    """An in-order queue whose recorded events stay pending while it is held."""

    def __init__(self, module: FakeAcceleratorModule, device: Any = None, priority: int = 0) -> None:
        self.module = module
        self.device = device
        self.priority = priority
        self.held = False
        self.pending: list[FakeEvent] = []
        self.waits: list[Any] = []

    def query(self) -> bool:
        return not any(not event.done for event in self.pending)

    def synchronize(self) -> None:
        for event in self.pending:
            event.done = True
        self.pending.clear()

    def wait_event(self, event: FakeEvent) -> None:
        self.waits.append(event)

    def wait_stream(self, stream: FakeStream) -> None:
        self.waits.append(stream)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent(self.module)
        event.record(self)
        return event

    def hold(self) -> None:
        """Later events on this stream stay pending (the device is 'busy')."""
        self.held = True

    def release(self) -> None:
        """The device caught up: every pending event completes."""
        self.held = False
        self.synchronize()


class FakeAcceleratorModule:
    """The ``torch.cuda`` / ``torch.npu`` surface the adapters use, with settable figures."""

    def __init__(self, *, count: int = 2, total: int = 16 * GiB) -> None:
        self.count = count
        self.total = total
        self.available = True
        self.allocated = [0] * count
        self.peak = [0] * count
        self.reserved = [0] * count
        self.peak_reserved = [0] * count
        self.free = [total] * count
        self.fractions = [1.0] * count
        self.mem_get_info_raises = False
        self.calls: collections.Counter[str] = collections.Counter()
        self.live: dict[int, int] = {}  # storage address -> device index, for every live device allocation
        self.oom_as_runtime_error = False
        self._default = FakeStream(self)
        self._current = self._default
        self.stream_log: list[FakeStream] = []
        self.device_stack: list[int] = []
        self.synchronized: list[Any] = []
        self.Stream = self._make_stream
        self.Event = self._make_event

    # streams and events
    def _make_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        return FakeStream(self, device, priority)

    def _make_event(self, enable_timing: bool = False, **_: Any) -> FakeEvent:
        return FakeEvent(self, enable_timing)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current

    def set_current(self, stream: FakeStream) -> None:
        self._current = stream

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        self.stream_log.append(stream)
        try:
            yield
        finally:
            self._current = previous

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        self.device_stack.append(index)
        try:
            yield
        finally:
            self.device_stack.pop()

    def synchronize(self, device: Any = None) -> None:
        self.synchronized.append(device)

    # devices
    def is_available(self) -> bool:
        return self.available and self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(name="Fake Accelerator", total_memory=self.total)

    # memory: torch's four helpers each rebuild the whole statistics dict; the adapter
    # must read it once (memory_stats_as_nested_dict or memory_stats), so calls are counted
    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def memory_stats_as_nested_dict(self, device: int) -> dict[str, Any]:
        self._count("memory_stats_as_nested_dict")
        return {
            "allocated_bytes": {"all": {"current": self.allocated[device], "peak": self.peak[device]}},
            "reserved_bytes": {"all": {"current": self.reserved[device], "peak": self.peak_reserved[device]}},
            "num_ooms": 0,
        }

    def memory_stats(self, device: int) -> dict[str, Any]:
        """Flattened and sorted, as torch.cuda.memory_stats / torch.npu.memory_stats return it."""
        self._count("memory_stats")
        flat = {
            "allocated_bytes.all.current": self.allocated[device],
            "allocated_bytes.all.peak": self.peak[device],
            "reserved_bytes.all.current": self.reserved[device],
            "reserved_bytes.all.peak": self.peak_reserved[device],
            "num_ooms": 0,
        }
        return dict(sorted(flat.items()))

    def memory_allocated(self, device: int) -> int:
        self._count("memory_allocated")
        return self.allocated[device]

    def max_memory_allocated(self, device: int) -> int:
        self._count("max_memory_allocated")
        return self.peak[device]

    def memory_reserved(self, device: int) -> int:
        self._count("memory_reserved")
        return self.reserved[device]

    def max_memory_reserved(self, device: int) -> int:
        self._count("max_memory_reserved")
        return self.peak_reserved[device]

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak[device] = self.allocated[device]
        self.peak_reserved[device] = self.reserved[device]

    def mem_get_info(self, device: int) -> tuple[int, int]:
        if self.mem_get_info_raises:
            raise RuntimeError("mem_get_info is not supported by this runtime")
        return self.free[device], self.total

    # the caching allocator: device memory is counted per device, capped by the memory fraction
    def empty_device(self, nbytes: int, device: int) -> Any:
        """A uint8 "device" tensor of ``nbytes`` (CPU memory), counted until its storage dies.

        As torch's caching allocator: sizes are rounded up to 512 bytes, and a request
        beyond ``fraction * total`` raises ``torch.OutOfMemoryError`` (or, with
        ``oom_as_runtime_error``, a plain RuntimeError saying "out of memory", as some
        runtimes do).
        """
        size = max(512, -(-nbytes // 512) * 512)
        limit = int(self.fractions[device] * self.total)
        if self.reserved[device] + size > limit:
            message = (
                f"Fake accelerator out of memory. Tried to allocate {nbytes} bytes. Device {device} has "
                f"{self.reserved[device]} bytes reserved of the {limit} bytes this process may use "
                f"(memory fraction {self.fractions[device]:g} of {self.total} bytes)"
            )
            raise RuntimeError(message) if self.oom_as_runtime_error else torch.OutOfMemoryError(message)
        backing = torch.empty(size, dtype=torch.uint8)
        address = backing.data_ptr()
        self._count_allocation(device, size)
        self.live[address] = device
        tensor = tensor_over(
            address, size, on_free=functools.partial(self._count_free, device, size, address), keepalive=backing
        )
        return tensor[:nbytes]

    def _count_allocation(self, device: int, size: int) -> None:
        self.allocated[device] += size
        self.reserved[device] += size
        self.free[device] -= size
        self.peak[device] = max(self.peak[device], self.allocated[device])
        self.peak_reserved[device] = max(self.peak_reserved[device], self.reserved[device])

    def _count_free(self, device: int, size: int, address: int) -> None:
        self.live.pop(address, None)
        self.allocated[device] -= size
        self.reserved[device] -= size
        self.free[device] += size

    def device_of(self, tensor: Any) -> int | None:
        """The device whose memory holds ``tensor``'s storage, or None (a host tensor)."""
        return self.live.get(tensor.untyped_storage().data_ptr())

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"invalid fraction {fraction!r}")
        self.fractions[device] = fraction

    def get_per_process_memory_fraction(self, device: int) -> float:
        return self.fractions[device]


class FakeAcceleratorDevice(TorchAcceleratorDevice):
    """The shared adapter over a :class:`FakeAcceleratorModule` (set ``module`` first)."""

    name: ClassVar[str] = "fakeacc"
    device_type: ClassVar[str] = "cpu"
    module: ClassVar[FakeAcceleratorModule]

    @classmethod
    def device_module(cls) -> Any:
        return cls.module

    @classmethod
    def availability(cls) -> Availability:
        mod = cls.module
        if not mod.is_available():
            return Availability(False, "the fake accelerator is switched off", 0)
        return Availability(True, "", mod.device_count())

    def _setup(self) -> None:
        self.pinned_block_sizes: list[int] = []
        self._pinned_held: collections.Counter[str] = collections.Counter()
        super()._setup()

    @property
    def torch_device(self) -> Any:
        return torch.device("cpu")

    def _empty_device(self, nbytes: int) -> Any:
        return self._mod.empty_device(nbytes, self.index)

    def to_device(self, host: Any) -> Any:
        """A 'device' tensor holding a copy of ``host`` (same dtype and shape)."""
        raw = self._allocate_device(max(1, host.numel() * host.element_size()))
        typed = raw[: host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        typed.copy_(host)
        return typed

    def _resident(self, buffer: Any) -> bool:
        return isinstance(buffer, torch.Tensor) and self._mod.device_of(buffer) == self.index

    def _allocate_pinned_block(self, nbytes: int) -> Any:
        """Like torch's caching host allocator: the block reserves a power of two (``pinned_bytes``)."""
        real = power_of_two_ceil(nbytes)
        backing = torch.empty(real, dtype=torch.uint8)
        self.pinned_block_sizes.append(nbytes)
        held = self._pinned_held  # not the device: a finalizer must not keep it alive
        held["bytes"] += real
        unpinned = functools.partial(held.subtract, {"bytes": real})
        return tensor_over(backing.data_ptr(), real, on_free=unpinned, keepalive=backing)[:nbytes]

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the stand-in allocator holds pinned now (blocks rounded to a power of two)."""
        return self._pinned_held["bytes"]
