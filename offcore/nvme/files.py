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
import fcntl
import os
import re
import shutil
import stat
import tempfile
import threading

import numpy as np

from offcore.errors import ConfigurationError, StorageError, UnsafeStoragePathError

__all__ = [
    "private_directory",
    "remove_private_directory",
    "remove_stale_directories",
    "check_directory",
    "open_private_file",
    "aligned_empty",
    "OWNER_FILE",
]

ALIGNMENT = 4096
"""Buffer address, file offset and length alignment used for ``O_DIRECT`` (covers 512 B and 4 KiB sectors)."""

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)

# Note [Stale directories: an owner lock]
# A tier's directory ``offcore-<pid>-<random>`` is removed by its process (close, garbage
# collection, interpreter exit), but a process killed with SIGKILL (or by the OOM killer)
# runs none of that. So each directory records its owner: a marker file ``OWNER_FILE``
# (0600, "offcore NVMe tier" + pid + the process's start time, for people) on which the
# process holds an exclusive ``fcntl.flock`` for the directory's lifetime. The kernel drops
# a flock when the last descriptor of it closes, i.e. when the owner dies, however it dies.
# A new tier under the same root (``remove_stale_directories``) removes only entries that
# (1) match the name pattern, (2) are real directories owned by this uid (``lstat``: a
# symlink is never followed, nor removed), (3) hold a regular marker file (opened with
# ``O_NOFOLLOW``) beginning with the marker text, and (4) whose marker's flock it can take
# without waiting: nobody holds it, so the owner is dead. It holds that lock while removing
# (``shutil.rmtree``, which does not follow symlinks inside). The marker is created under a
# temporary name, locked, filled and only then renamed into place, so no one can see an
# unlocked marker of a live tier. A directory without a marker (an older offcore's, or one
# being set up this instant) is left alone. flocks conflict between open file descriptions
# even in one process, so a live tier of this process is never taken for dead; the lock's
# descriptor is close-on-exec (a child that execs does not keep it), a forked child that
# does not exec shares it (its parent's directory then lives until both are gone).
OWNER_FILE = ".offcore-owner"
_OWNER_TEXT = "offcore NVMe tier"
_NAME = re.compile(r"offcore-[0-9]+-[A-Za-z0-9_]+")
_owner_locks: dict[str, int] = {}  # directory -> descriptor holding its owner lock
_owner_locks_lock = threading.Lock()


def _process_start_time() -> str:
    """This process's start time in clock ticks since boot (``/proc/self/stat`` field 22), or ``?``."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _claim(directory: str) -> None:
    """Write ``directory``'s owner marker and hold its lock (Note [Stale directories: an owner lock])."""
    temporary = os.path.join(directory, OWNER_FILE + ".new")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{_OWNER_TEXT}\npid {os.getpid()}\nstart {_process_start_time()}\n".encode("ascii"))
        os.rename(temporary, os.path.join(directory, OWNER_FILE))
    except BaseException:
        os.close(fd)
        raise
    with _owner_locks_lock:
        _owner_locks[directory] = fd


def _release(directory: str) -> None:
    with _owner_locks_lock:
        fd = _owner_locks.pop(directory, None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _stale(root_fd: int, name: str) -> int | None:
    """The locked marker descriptor of ``root/name`` when it is a dead tier's directory, else None."""
    if not _NAME.fullmatch(name):
        return None
    try:
        st = os.lstat(name, dir_fd=root_fd)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return None  # a symlink, a file, or someone else's: never touched
    try:
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return None
    try:
        fd = os.open(OWNER_FILE, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None  # no marker: an older offcore's directory, or one being set up now
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not os.pread(fd, 64, 0).startswith(_OWNER_TEXT.encode()):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EWOULDBLOCK: its owner lives
        os.close(fd)
        return None
    return fd


def remove_stale_directories(root: str | os.PathLike[str]) -> list[str]:
    """Remove the tier directories under ``root`` whose owning process is dead; returns their paths.

    Only directories offcore made (name pattern, marker file, owner lock free) are removed,
    never through a symlink (Note [Stale directories: an owner lock]). ``NvmeTier`` calls it
    when it opens.

    >>> import tempfile
    >>> remove_stale_directories(tempfile.mkdtemp())
    []
    """
    root = os.path.abspath(os.fspath(root))
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError:
        return []
    removed: list[str] = []
    try:
        for name in sorted(os.listdir(root_fd)):
            fd = _stale(root_fd, name)
            if fd is None:
                continue
            try:
                shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
                removed.append(os.path.join(root, name))
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return removed


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
    or two, never share or clobber a file. It holds the owner marker, locked while this
    process lives (Note [Stale directories: an owner lock]).
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
        directory = tempfile.mkdtemp(prefix=f"offcore-{os.getpid()}-", dir=root)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot create a directory under {root!r}: {exc.strerror}") from exc
    try:
        _claim(directory)  # Note [Stale directories: an owner lock]
    except OSError as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise StorageError(exc.errno, f"cannot mark {directory!r} as this process's: {exc.strerror}") from exc
    return directory


def remove_private_directory(path: str) -> None:
    """Remove a tier's directory and the files in it (symlink-safe; silent if already gone), then drop its owner lock."""
    shutil.rmtree(path, ignore_errors=True)
    _release(path)


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
