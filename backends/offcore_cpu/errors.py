"""Errors of the CPU fake device.

``FakeDeviceOutOfMemoryError`` is what a real accelerator's allocator raises when the
device is full. It derives from :class:`offcore.CapacityExceededError` always, and
from ``torch.OutOfMemoryError`` when torch is importable, so code written for CUDA
(``except torch.OutOfMemoryError:``) handles the fake device unchanged::

    >>> from offcore_cpu.errors import FakeDeviceOutOfMemoryError
    >>> import offcore
    >>> issubclass(FakeDeviceOutOfMemoryError, offcore.CapacityExceededError)
    True

# Note [Why FakeDeviceOutOfMemoryError is built lazily]
# ``torch.OutOfMemoryError`` is a C-defined subclass of RuntimeError with the plain
# BaseException layout, so it combines with CapacityExceededError (OffcoreError +
# MemoryError, same layout) in one class without a layout conflict (checked on torch
# 2.13: the MRO is OutOfMemoryError, RuntimeError, CapacityExceededError, OffcoreError,
# MemoryError). The class must exist before it is raised (for ``except`` clauses), but
# ``import offcore_cpu`` must not import torch. So the class is created on first
# attribute access (module ``__getattr__``), with the torch base when torch can be
# imported: one class per process, whatever a device's ``buffers`` setting. Pickling
# finds it again through the same ``__getattr__``.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import TYPE_CHECKING, Any

from offcore.errors import CapacityExceededError, OffcoreError
from offcore.units import format_bytes

__all__ = ["FakeDeviceOutOfMemoryError", "StreamWorkError", "EventNotReadyError", "out_of_memory"]


class StreamWorkError(OffcoreError, RuntimeError):
    """Work queued on a fake-device stream (a copy) raised; the original is ``__cause__``.

    Raised by the next ``Stream.synchronize()`` of that stream and by
    ``Event.synchronize()`` / ``Event.query()`` of events recorded after the failure,
    as an asynchronous CUDA error surfaces at the next synchronisation.
    """


class EventNotReadyError(OffcoreError, RuntimeError):
    """``elapsed_time`` was asked of an event whose recorded work has not completed yet."""


_OOM_CLASS: type[CapacityExceededError] | None = None
_OOM_LOCK = threading.Lock()


def _oom_init(
    self: Any, message: str, *, requested_bytes: int = 0, allocated_bytes: int = 0, capacity_bytes: int = 0
) -> None:
    Exception.__init__(self, message)
    self.requested_bytes = requested_bytes
    self.allocated_bytes = allocated_bytes
    self.capacity_bytes = capacity_bytes


def _oom_reduce(self: Any) -> tuple[Any, ...]:
    return (_rebuild_oom, (str(self), self.requested_bytes, self.allocated_bytes, self.capacity_bytes))


def _rebuild_oom(message: str, requested: int, allocated: int, capacity: int) -> CapacityExceededError:
    cls = _oom_class()
    return cls(message, requested_bytes=requested, allocated_bytes=allocated, capacity_bytes=capacity)  # type: ignore[call-arg]


def _oom_class() -> type[CapacityExceededError]:
    global _OOM_CLASS
    with _OOM_LOCK:
        if _OOM_CLASS is None:
            bases: tuple[type, ...] = (CapacityExceededError,)
            if importlib.util.find_spec("torch") is not None:
                try:
                    import torch

                    bases = (torch.OutOfMemoryError, CapacityExceededError)
                except Exception:  # a broken torch install: the fake device still works on numpy
                    pass
            _OOM_CLASS = type(
                "FakeDeviceOutOfMemoryError",
                bases,
                {
                    "__module__": __name__,
                    "__qualname__": "FakeDeviceOutOfMemoryError",
                    "__doc__": "The fake device is full (``torch.OutOfMemoryError`` and "
                    "``offcore.CapacityExceededError``); ``requested_bytes``, ``allocated_bytes`` "
                    "and ``capacity_bytes`` hold the figures.",
                    "__init__": _oom_init,
                    "__reduce__": _oom_reduce,
                },
            )
        return _OOM_CLASS


def out_of_memory(device_name: str, requested: int, allocated: int, capacity: int) -> CapacityExceededError:
    """The error to raise when ``requested`` more bytes do not fit (message modelled on torch's)."""
    free = max(capacity - allocated, 0)
    message = (
        f"Fake device {device_name} out of memory. Tried to allocate {format_bytes(requested)}; "
        f"{format_bytes(allocated)} already allocated; capacity {format_bytes(capacity)} "
        f"({format_bytes(free)} free). Lower the batch size or sequence length, offload activations "
        "or parameters with offcore, or create the device with a larger capacity "
        "(offcore.device('cpu', capacity=...))."
    )
    cls = _oom_class()
    return cls(message, requested_bytes=requested, allocated_bytes=allocated, capacity_bytes=capacity)  # type: ignore[call-arg]


if TYPE_CHECKING:

    class FakeDeviceOutOfMemoryError(CapacityExceededError):
        requested_bytes: int
        allocated_bytes: int
        capacity_bytes: int

else:

    def __getattr__(name: str) -> Any:
        if name == "FakeDeviceOutOfMemoryError":
            return _oom_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
