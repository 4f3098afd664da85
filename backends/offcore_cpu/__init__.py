"""offcore_cpu: the CPU fake device, an emulated accelerator for testing every schedule without hardware.

This module is the pluggy plugin offcore finds through the ``offcore.backends`` entry
point. It registers the backend lazily: nothing below (and neither torch nor numpy)
is imported until the backend is used.

    >>> import offcore
    >>> dev = offcore.device("cpu", capacity="2GiB", h2d_bandwidth="32GiB/s")   # doctest: +SKIP
    >>> with dev:                                                               # doctest: +SKIP
    ...     x = torch.randn(1024)        # counted: dev.memory_stats().allocated_bytes == 4096

See ``docs/cpu-device.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import offcore

__all__ = [
    "offcore_register_backends",
    "FakeDevice",
    "FakeDeviceOutOfMemoryError",
    "StreamWorkError",
    "FreedStorageError",
    "EventNotReadyError",
    "InjectedFault",
    "GateTimeoutError",
    "SanitizerViolation",
]

if TYPE_CHECKING:
    from offcore_cpu.device import FakeDevice
    from offcore_cpu.errors import (
        EventNotReadyError,
        FakeDeviceOutOfMemoryError,
        FreedStorageError,
        GateTimeoutError,
        InjectedFault,
        SanitizerViolation,
        StreamWorkError,
    )


@offcore.hookimpl
def offcore_register_backends(register: Callable[..., None]) -> None:
    """Register ``cpu`` (imported on first use)."""
    register(
        "cpu",
        "offcore_cpu.device:FakeDevice",
        description="CPU fake device: emulated accelerator (capacity, copy streams, link bandwidth, sanitizer)",
    )


def __getattr__(name: str) -> Any:
    if name == "FakeDevice":
        from offcore_cpu.device import FakeDevice

        return FakeDevice
    if name in (
        "FakeDeviceOutOfMemoryError",
        "StreamWorkError",
        "EventNotReadyError",
        "InjectedFault",
        "GateTimeoutError",
        "SanitizerViolation",
    ):  # no torch
        from offcore_cpu import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
