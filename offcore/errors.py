"""The offcore error hierarchy.

Every error offcore raises on purpose derives from :class:`OffcoreError`, and every
message says what was wrong and how to fix it::

    >>> import offcore
    >>> try:
    ...     offcore.parse_size("-1")
    ... except offcore.OffcoreError as exc:
    ...     print(type(exc).__name__)
    ConfigurationError
"""

from __future__ import annotations

__all__ = [
    "OffcoreError",
    "ConfigurationError",
    "SavedTensorHooksDisabledError",
    "BackendUnavailableError",
    "CapacityExceededError",
    "IllegalTransitionError",
    "SavedTensorModifiedError",
    "CopyFailedError",
    "StorageError",
    "StorageFullError",
    "ShortTransferError",
    "StorageFileMissingError",
    "StorageFileTruncatedError",
    "ChecksumMismatchError",
    "UnsafeStoragePathError",
    "OffcoreWarning",
]


class OffcoreError(Exception):
    """Base class of every error offcore raises deliberately."""


class ConfigurationError(OffcoreError, ValueError):
    """An argument or setting is malformed or out of range (a size of ``-1``, an unknown policy)."""


class SavedTensorHooksDisabledError(ConfigurationError, RuntimeError):
    """An activation-offloading region was entered where saved-tensor hooks are disabled
    (``torch.autograd.graph.disable_saved_tensors_hooks(msg)`` is in force).

    It is a :class:`RuntimeError` whose message starts with the framework's own message, as
    the framework raises for its own ``save_on_cpu``, so code written for that keeps working;
    and a :class:`ConfigurationError`, the offcore class for "it cannot run here".
    """


class BackendUnavailableError(OffcoreError, RuntimeError):
    """The requested backend is not installed, or is installed but cannot run here.

    The message carries the backend's own reason (no CUDA device, CANN missing, ...).
    """


class CapacityExceededError(OffcoreError, MemoryError):
    """A tier (device, pinned host, pageable host, NVMe) has no room for a request within its budget."""


class IllegalTransitionError(OffcoreError, RuntimeError):
    """A managed object was asked to move to a state it cannot reach from where it is.

    The most important case: freeing an object's device copy before its
    device-to-host copy has completed.
    """


class SavedTensorModifiedError(OffcoreError, RuntimeError):
    """A tensor saved for backward was modified in place between forward and backward.

    Autograd's own check is disabled under saved-tensor hooks, so offcore checks the
    version counter itself when backward unpacks the tensor.
    """


class CopyFailedError(OffcoreError, RuntimeError):
    """A copy between tiers failed and offcore could not recover the data another way.

    offcore recovers where it can without changing a number: a failed device-to-host
    copy keeps the device copy, a failed prefetch is reloaded synchronously. This is
    raised only when the one remaining copy of the data cannot be brought back.
    """


class StorageError(OffcoreError, OSError):
    """A read or write of the NVMe storage tier (:mod:`offcore.nvme`) failed.

    Every message names the file and the bytes. A failed *write* never loses data: the
    tier above (the host buffer written from) keeps the only valid copy, and the object
    is no longer readable from the tier until it is written again. The subclasses say
    what went wrong; this class itself is an I/O error the kernel reported (``EIO``, ...),
    with ``errno`` set.
    """


class StorageFullError(StorageError):
    """The storage tier's filesystem is full (``ENOSPC``, ``EDQUOT``, or a file-size limit: ``EFBIG``)."""


class ShortTransferError(StorageError):
    """A read or write moved fewer bytes than asked and then made no progress at all."""


class StorageFileMissingError(StorageError):
    """A file of the storage tier was removed behind offcore's back (by another process or a cleaner)."""


class StorageFileTruncatedError(StorageError):
    """A file of the storage tier is shorter than what was written to it."""


class ChecksumMismatchError(StorageError):
    """A block read back from the storage tier differs from what was written (``verify=True``)."""


class UnsafeStoragePathError(StorageError):
    """The directory named for the storage tier is unsafe: a symlink, someone else's, or writable by others."""


class OffcoreWarning(UserWarning):
    """Something went wrong that offcore recovered from (a failed copy); results are unchanged."""
