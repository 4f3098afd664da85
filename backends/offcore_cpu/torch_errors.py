"""The torch flavour of the fake device's out-of-memory error (this module imports torch).

See Note [Two flavours of FakeDeviceOutOfMemoryError] in :mod:`offcore_cpu.errors`.

    >>> import torch
    >>> issubclass(TorchFakeDeviceOutOfMemoryError, torch.OutOfMemoryError)
    True
"""

from __future__ import annotations

import torch

from offcore_cpu.errors import FakeDeviceOutOfMemoryError

__all__ = ["TorchFakeDeviceOutOfMemoryError"]


class TorchFakeDeviceOutOfMemoryError(torch.OutOfMemoryError, FakeDeviceOutOfMemoryError):
    """Raised by fake devices with torch buffers: ``except torch.OutOfMemoryError`` catches it, as on CUDA."""

    def __init__(
        self, message: str, *, requested_bytes: int = 0, allocated_bytes: int = 0, capacity_bytes: int = 0
    ) -> None:
        # RuntimeError.__init__ comes first in the MRO and refuses keywords: use ours.
        FakeDeviceOutOfMemoryError.__init__(
            self,
            message,
            requested_bytes=requested_bytes,
            allocated_bytes=allocated_bytes,
            capacity_bytes=capacity_bytes,
        )
