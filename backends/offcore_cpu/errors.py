"""Errors of the CPU fake device.

``FakeDeviceOutOfMemoryError`` is what a real accelerator's allocator raises when the
device is full: an :class:`offcore.CapacityExceededError`. A device with torch buffers
raises its torch flavour, which is also a ``torch.OutOfMemoryError``, so code written
for CUDA (``except torch.OutOfMemoryError:``) handles the fake device unchanged::

    >>> import offcore
    >>> error = out_of_memory("cpu:0", requested=2048, allocated=0, capacity=1024)
    >>> isinstance(error, FakeDeviceOutOfMemoryError), isinstance(error, offcore.CapacityExceededError)
    (True, True)

# Note [Two flavours of FakeDeviceOutOfMemoryError]
# ``torch.OutOfMemoryError`` is a C-defined RuntimeError with the plain BaseException
# layout, so it combines with CapacityExceededError (OffcoreError + MemoryError, same
# layout) in one class without a layout conflict (checked on torch 2.13: the MRO is
# TorchFakeDeviceOutOfMemoryError, OutOfMemoryError, RuntimeError,
# FakeDeviceOutOfMemoryError, CapacityExceededError, OffcoreError, MemoryError).
# But ``offcore_cpu`` must work, and must not import torch, where only numpy is used.
# So the base class here knows nothing of torch, and
# ``offcore_cpu.torch_errors.TorchFakeDeviceOutOfMemoryError`` derives from it and from
# ``torch.OutOfMemoryError``; devices with ``buffers="torch"`` raise that one. Catch
# ``FakeDeviceOutOfMemoryError`` (or ``offcore.CapacityExceededError``) for both, or
# ``torch.OutOfMemoryError`` as for CUDA.
"""

from __future__ import annotations

from offcore.errors import CapacityExceededError, OffcoreError
from offcore.units import format_bytes

__all__ = [
    "FakeDeviceOutOfMemoryError",
    "StreamWorkError",
    "FreedStorageError",
    "EventNotReadyError",
    "InjectedFault",
    "GateTimeoutError",
    "SanitizerViolation",
    "out_of_memory",
]


class FakeDeviceOutOfMemoryError(CapacityExceededError):
    """The fake device is full; ``requested_bytes``, ``allocated_bytes`` and ``capacity_bytes`` hold the figures."""

    def __init__(
        self, message: str, *, requested_bytes: int = 0, allocated_bytes: int = 0, capacity_bytes: int = 0
    ) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.allocated_bytes = allocated_bytes
        self.capacity_bytes = capacity_bytes

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only figures survive pickling
        return (_rebuild, (type(self), str(self), self.requested_bytes, self.allocated_bytes, self.capacity_bytes))


def _rebuild(
    cls: type[FakeDeviceOutOfMemoryError], message: str, requested: int, allocated: int, capacity: int
) -> FakeDeviceOutOfMemoryError:
    return cls(message, requested_bytes=requested, allocated_bytes=allocated, capacity_bytes=capacity)


class StreamWorkError(OffcoreError, RuntimeError):
    """Work queued on a fake-device stream (a copy) raised; the original is ``__cause__``.

    Raised by the next ``Stream.synchronize()`` of that stream and by
    ``Event.synchronize()`` / ``Event.query()`` of events recorded after the failure,
    as an asynchronous CUDA error surfaces at the next synchronisation.
    """


class FreedStorageError(OffcoreError, RuntimeError):
    """A copy reached a buffer whose storage no longer holds the bytes it needs: freed or shrunk
    (``untyped_storage().resize_(0)``) after the copy was enqueued, before its stream ran it. On a GPU
    the copy would write into memory given to someone else; the fake device refuses it instead.
    Keep a copy's buffers alive until its event completed (or record the stream on them)."""


class EventNotReadyError(OffcoreError, RuntimeError):
    """``elapsed_time`` was asked of an event whose recorded work has not completed yet."""


class InjectedFault(OffcoreError, RuntimeError):
    """A copy failed on purpose: the fake device's fault injection (``fail_copy=N``, ``dev.inject_copy_fault``).

    ``copy_number`` is the failing copy's 1-based number among the device's ``copy_`` calls
    and ``mode`` is ``"submit"`` (raised by ``copy_`` itself) or ``"stream"`` (raised by the
    copy's work on its stream, so it reaches the caller as the ``__cause__`` of a
    :class:`StreamWorkError`).
    """

    def __init__(self, message: str, *, copy_number: int = 0, mode: str = "submit") -> None:
        super().__init__(message)
        self.copy_number = copy_number
        self.mode = mode

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only figures survive pickling
        return (_rebuild_fault, (type(self), str(self), self.copy_number, self.mode))


def _rebuild_fault(cls: type[InjectedFault], message: str, copy_number: int, mode: str) -> InjectedFault:
    return cls(message, copy_number=copy_number, mode=mode)


def out_of_memory(
    device_name: str,
    requested: int,
    allocated: int,
    capacity: int,
    *,
    error_class: type[FakeDeviceOutOfMemoryError] = FakeDeviceOutOfMemoryError,
) -> FakeDeviceOutOfMemoryError:
    """The error to raise when ``requested`` more bytes do not fit (message modelled on torch's)."""
    free = max(capacity - allocated, 0)
    message = (
        f"Fake device {device_name} out of memory. Tried to allocate {format_bytes(requested)}; "
        f"{format_bytes(allocated)} already allocated; capacity {format_bytes(capacity)} "
        f"({format_bytes(free)} free). Lower the batch size or sequence length, offload activations "
        "or parameters with offcore, or create the device with a larger capacity "
        "(offcore.device('cpu', capacity=...))."
    )
    return error_class(message, requested_bytes=requested, allocated_bytes=allocated, capacity_bytes=capacity)


class GateTimeoutError(OffcoreError, AssertionError):
    """A test's gate (``dev.gate`` / ``dev.hold``) did not see what it waited for, or was left closed.

    An ``AssertionError`` too: it always means the test (not the program under test) went wrong.
    """


class SanitizerViolation(OffcoreError, AssertionError):
    """The sanitizer saw a race (``dev.check_sanitizer()``): memory freed or released while a copy still used
    it, copies of two streams not ordered, or a torch operator touching bytes of a copy still in flight.

    ``violations`` holds the records of ``dev.sanitizer_violations()``.
    """

    def __init__(self, message: str, violations: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.violations = list(violations or [])
