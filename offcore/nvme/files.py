"""The storage tier's private directory: checked, created 0700, one per tier, removed at the end.

>>> import tempfile
>>> from offcore.nvme.files import private_directory, remove_private_directory
>>> root = tempfile.mkdtemp()
>>> sub = private_directory(root)
>>> oct(os.stat(sub).st_mode & 0o777)
'0o700'
>>> remove_private_directory(sub); os.path.exists(sub)
False
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile

import numpy as np

from offcore.errors import ConfigurationError, StorageError, UnsafeStoragePathError

__all__ = ["private_directory", "remove_private_directory", "check_directory", "open_private_file", "aligned_empty"]

ALIGNMENT = 4096
"""Buffer address, file offset and length alignment used for ``O_DIRECT`` (covers 512 B and 4 KiB sectors)."""

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def check_directory(path: str) -> None:
    """Refuse ``path`` unless it is a real directory (not a symlink) owned by us and not writable by others.

    >>> check_directory("/")                                  # doctest: +SKIP
    Traceback (most recent call last):
    offcore.errors.UnsafeStoragePathError: ...
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeStoragePathError(f"storage directory {path!r} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStoragePathError(
            f"storage directory {path!r} is a symlink (to {os.readlink(path)!r}); offcore never follows one "
            "there. Name the real directory instead."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoragePathError(f"storage path {path!r} is not a directory; name a directory for the NVMe tier")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeStoragePathError(
            f"storage directory {path!r} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); another "
            "user could read or replace the files there. Name a directory you own (e.g. create one with mode 0700)."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStoragePathError(
            f"storage directory {path!r} is writable by group or others (mode {oct(st.st_mode & 0o777)}); "
            f"they could plant files or links there. Run `chmod go-w {path}` or name a private directory."
        )


def private_directory(root: str | os.PathLike[str]) -> str:
    """A new directory of this tier under ``root`` (created 0700 if missing, checked if present).

    The subdirectory comes from :func:`tempfile.mkdtemp` (mode 0700, a fresh unguessable
    name made with ``O_EXCL`` semantics), so two tiers on the same ``root``, in one process
    or two, never share or clobber a file.
    """
    root = os.path.abspath(os.fspath(root))
    if not os.path.lexists(root):
        try:
            os.makedirs(root, mode=0o700)
        except FileExistsError:
            pass  # created concurrently: checked below like any existing directory
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot create storage directory {root!r}: {exc.strerror}") from exc
    check_directory(root)
    try:
        return tempfile.mkdtemp(prefix=f"offcore-{os.getpid()}-", dir=root)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot create a directory under {root!r}: {exc.strerror}") from exc


def remove_private_directory(path: str) -> None:
    """Remove a tier's directory and the files in it (symlink-safe; silent if already gone)."""
    shutil.rmtree(path, ignore_errors=True)


def open_private_file(path: str, *, create: bool, direct: bool) -> int:
    """Open a tier file read-write: new ones ``O_CREAT | O_EXCL`` mode 0600, never through a symlink."""
    flags = os.O_RDWR | _O_NOFOLLOW | _O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    if direct:
        flags |= _O_DIRECT
    return os.open(path, flags, 0o600)


def direct_io_supported(directory: str) -> tuple[bool, str]:
    """Whether ``O_DIRECT`` works in ``directory`` (open and an aligned 4 KiB write), and why not if not."""
    if not _O_DIRECT:
        return False, "this platform has no O_DIRECT"
    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = open_private_file(probe, create=True, direct=True)
    except OSError as exc:
        return False, f"open(O_DIRECT) failed: {errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror})"
    try:
        buffer = aligned_empty(ALIGNMENT)
        buffer[:] = 0
        os.pwrite(fd, memoryview(buffer), 0)
        return True, "O_DIRECT"
    except OSError as exc:
        return False, f"an aligned O_DIRECT write failed: {errno.errorcode.get(exc.errno or 0, exc.errno)}"
    finally:
        os.close(fd)
        os.unlink(probe)


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose address is a multiple of ``alignment``.

    Use it as a :class:`~offcore.pool.HostBufferPool` block allocator (with the pool's
    ``alignment`` set to the same value) so the tier reads and writes pool buffers with
    ``O_DIRECT`` in place, without a bounce copy.

    >>> a = aligned_empty(10_000)
    >>> a.nbytes, a.ctypes.data % 4096
    (10000, 0)
    """
    if nbytes < 0:
        raise ConfigurationError(f"cannot allocate {nbytes} bytes")
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]
