"""offcore: train models larger than device memory by moving training state by next use.

The core is framework-neutral: ``import offcore`` imports neither torch nor any
backend. Backends (``cpu`` fake device, ``cuda``, ``npu``) load lazily through the
``offcore.backends`` entry-point group.

    >>> import offcore
    >>> offcore.parse_size("64MiB")
    67108864
    >>> dev = offcore.device("cpu", capacity="2GiB", h2d_bandwidth="32GiB/s")   # doctest: +SKIP
"""

from __future__ import annotations

from offcore.errors import (
    BackendUnavailableError,
    CapacityExceededError,
    ChecksumMismatchError,
    ConfigurationError,
    CopyFailedError,
    IllegalTransitionError,
    OffcoreError,
    OffcoreWarning,
    SavedTensorHooksDisabledError,
    SavedTensorModifiedError,
    ShortTransferError,
    StorageError,
    StorageFileMissingError,
    StorageFileTruncatedError,
    StorageFullError,
    UnsafeStoragePathError,
)
from offcore.hookspecs import hookimpl
from offcore.kinds import Direction, Kind, Tier, TierSpec
from offcore.ledger import Ledger
from offcore.objects import ManagedObject, State
from offcore.pool import HostBuffer, HostBufferPool
from offcore.protocols import Availability, Backend, Capability, Event, MemoryStats, Stream
from offcore.registry import BackendInfo, backends, device, get_backend_class, register_plugin
from offcore.units import format_bandwidth, format_bytes, parse_bandwidth, parse_duration, parse_size

__version__ = "0.1.0"

__all__ = [
    "Availability",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "Capability",
    "CapacityExceededError",
    "ChecksumMismatchError",
    "ConfigurationError",
    "CopyFailedError",
    "Direction",
    "Event",
    "HostBuffer",
    "HostBufferPool",
    "IllegalTransitionError",
    "Kind",
    "Ledger",
    "ManagedObject",
    "MemoryStats",
    "OffcoreError",
    "OffcoreWarning",
    "SavedTensorHooksDisabledError",
    "SavedTensorModifiedError",
    "ShortTransferError",
    "State",
    "StorageError",
    "StorageFileMissingError",
    "StorageFileTruncatedError",
    "StorageFullError",
    "Stream",
    "Tier",
    "TierSpec",
    "UnsafeStoragePathError",
    "backends",
    "device",
    "format_bandwidth",
    "format_bytes",
    "get_backend_class",
    "hookimpl",
    "parse_bandwidth",
    "parse_duration",
    "parse_size",
    "register_plugin",
]
