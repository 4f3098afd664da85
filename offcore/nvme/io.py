"""The NVMe tier's I/O machinery: handles of transfers in flight, positional reads and writes in chunks, worker threads.

:class:`~offcore.nvme.tier.NvmeTier` runs every read and write through it (Note [I/O workers]).
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from offcore.errors import (
    ConfigurationError,
    StorageError,
    StorageFileMissingError,
    StorageFullError,
)
from offcore.kinds import Kind
from offcore.nvme.files import (
    ALIGNMENT,
    open_private_file,
    remove_private_directory,
)
from offcore.units import format_bytes

_FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG) if e is not None)


def _round_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _as_bytes(buffer: Any, *, writable: bool, what: str) -> np.ndarray:
    """``buffer`` (a numpy array of any dtype, a memoryview, bytes...) as a flat uint8 view of the same memory."""
    if isinstance(buffer, np.ndarray):
        array = buffer
    else:
        try:
            array = np.frombuffer(buffer, np.uint8)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"{what} must be a numpy array or a contiguous buffer (memoryview, bytearray), "
                f"got {type(buffer).__name__}: {exc}"
            ) from None
    if array.dtype.hasobject:
        raise ConfigurationError(f"{what} holds Python objects (dtype {array.dtype}); only plain numbers go to disk")
    if not array.flags.c_contiguous:
        raise ConfigurationError(
            f"{what} is not contiguous (strides {array.strides}); pass a contiguous copy (np.ascontiguousarray)"
        )
    if writable and not array.flags.writeable:
        raise ConfigurationError(f"{what} is read-only; reads need a writable destination buffer")
    return array.reshape(-1).view(np.uint8)


def _errname(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


def _io_error(exc: OSError, op: str, path: str, offset: int, length: int) -> StorageError:
    """The specific StorageError for an OSError of ``op`` ("write"/"read") of ``length`` bytes at ``offset``."""
    where = f"{op} of {format_bytes(length)} at byte {offset} of {path!r}"
    keep = " The data is still in the host buffer written from: keep it." if op == "write" else ""
    code = exc.errno
    if code in _FULL_ERRNOS:
        return StorageFullError(
            code,
            f"{where} failed: the filesystem is full or a size limit was hit ({_errname(code)}: {exc.strerror}). "
            "Free space there, raise the quota / file-size limit, or give the NVMe tier a larger disk or a smaller "
            f"budget.{keep}",
        )
    if code == errno.ENOENT:
        return StorageFileMissingError(
            code, f"{where} failed: the file is gone (removed by another process?). Keep the tier's directory private."
        )
    return StorageError(
        code, f"{where} failed: {_errname(code)} ({exc.strerror}); check the disk and its kernel log (dmesg).{keep}"
    )


class _Latch:
    """A one-shot event: ``set()`` once, ``wait()`` by any number of threads (a held lock released at ``set``).

    What ``threading.Event`` does, for one ``set``, at a fraction of its cost per transfer (no
    Condition, no waiter list): one C lock, taken at creation and released when set.
    """

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._flag = False

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._flag

    def wait(self) -> None:
        if not self._flag:
            with self._lock:  # blocks until set() released it; hands it straight back for the next waiter
                pass


class IOHandle:
    """An asynchronous read or write of one object; ``query()`` / ``synchronize()`` as a backend event's.

    Both raise the :class:`~offcore.StorageError` of a failed transfer (so "failed" is never
    taken for "done"); ``exception()`` returns it without raising.

        >>> import numpy as np, tempfile
        >>> from offcore.nvme import NvmeTier
        >>> tier = NvmeTier(tempfile.mkdtemp(), budget="1MiB")
        >>> handle = tier.write("x", np.ones(10))
        >>> handle.synchronize(); handle.query(), handle.nbytes
        (True, 80)
        >>> tier.close()
    """

    def __init__(self, op: str, key: Hashable, path: str, nbytes: int, chunks: int) -> None:
        self.op = op
        self.key = key
        self.path = path
        self.nbytes = nbytes
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.finished: float | None = None
        self._remaining = chunks
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = _Latch()
        self._on_complete: Callable[[IOHandle], None] | None = None

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done.is_set() else "in flight")
        return f"<IOHandle {self.op} {self.key!r} {format_bytes(self.nbytes)} {state}>"

    def query(self) -> bool:
        """True once the transfer completed; raises its error if it failed; False while in flight."""
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        """Block until the transfer completed; raises its error if it failed."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def exception(self) -> BaseException | None:
        """Block until done; the error of a failed transfer, or None."""
        self._done.wait()
        return self._error

    @property
    def done(self) -> bool:
        """True once finished, successfully or not (never raises)."""
        return self._done.is_set()

    @property
    def seconds(self) -> float:
        """Seconds from the first request's start to the last one's end (0 until done)."""
        if self.finished is None or self.started is None:
            return 0.0
        return self.finished - self.started

    # -- called by the tier's workers ---------------------------------------------------
    def _begin(self) -> bool:
        """Mark a request as started; False if an earlier request already failed (skip the work)."""
        with self._lock:
            if self.started is None:
                self.started = time.perf_counter()
            return self._error is None

    def _end(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        self.finished = time.perf_counter()
        if self.started is None:
            self.started = self.finished
        try:
            if self._on_complete is not None:
                self._on_complete(self)
        except BaseException as exc:  # bookkeeping failed: report it through the handle, never lose it
            if self._error is None:
                self._error = exc
        finally:
            self._done.set()


@dataclass(eq=False)
class _Entry:
    key: Hashable
    path: str
    kind: Kind
    nbytes: int = 0  # logical bytes of the last completed write
    file_bytes: int = 0  # bytes the file has after the last completed write (padded with O_DIRECT)
    reserved: int = 0  # bytes counted against the budget
    crcs: list[int] | None = None
    written: bool = False  # a write completed (the object is readable)
    writing: IOHandle | None = None
    reads: int = 0
    ledger_bytes: int = 0
    fd: int | None = None  # kept open between transfers (Note [open files])
    fd_users: int = 0


# Note [open files]
# Each object's file stays open between transfers (opening and closing a file per transfer
# cost as much as the transfer itself for 1 MiB blocks), up to ``max_open_files`` idle ones,
# least recently used closed first. An open descriptor would hide a file removed or replaced
# behind offcore's back (it still reaches the old inode), so every transfer first checks
# ``fstat``: a link count of 0 is a missing file, a size below what was written a truncated
# one. The descriptors are closed on delete, on close and by the tier's finalizer.


@dataclass(eq=False)
class _Transfer:
    """One transfer's file: the object's fd, and a buffered fd of its own for unaligned remainders."""

    path: str
    fd: int
    direct: bool
    buffered: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fd_for(self, offset: int, address: int, length: int) -> int:
        if not self.direct or (offset % ALIGNMENT == 0 and address % ALIGNMENT == 0 and length % ALIGNMENT == 0):
            return self.fd
        with self.lock:  # a short O_DIRECT transfer left an unaligned remainder: finish it buffered
            if self.buffered is None:
                self.buffered = open_private_file(self.path, create=False, direct=False)
            return self.buffered

    def close(self) -> None:
        if self.buffered is not None:
            os.close(self.buffered)
            self.buffered = None


def _transfer_all(
    t: _Transfer,
    op: str,
    call: Callable[[int, list[memoryview], int], int],
    buf: np.ndarray,
    offset: int,
    short: Callable[[int, int], StorageError],
) -> None:
    """Move all of ``buf`` at ``offset`` with ``call`` (``os.pwritev`` / ``os.preadv``), resuming partial transfers;
    an OSError becomes the matching StorageError, a transfer that makes no progress raises ``short(done, n)``."""
    view = memoryview(buf)
    done = 0
    while done < buf.nbytes:
        fd = t.fd_for(offset + done, _address(buf) + done, buf.nbytes - done)
        try:
            n = call(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise _io_error(exc, op, t.path, offset + done, buf.nbytes - done) from exc
        if n <= 0:
            raise short(done, n)
        done += n


_STOP = object()


def _work(tasks: queue.SimpleQueue[Any]) -> None:
    """A worker thread's loop: run queued calls until the stop mark (errors are the caller's: ``_run`` keeps them)."""
    while True:
        task = tasks.get()
        if task is _STOP:
            return
        fn, args = task
        fn(*args)
        del task, fn, args  # hold nothing of the tier between requests (its finalizer must be able to run)


class _Workers:
    """``threads`` worker threads on one FIFO queue: ``submit(fn, *args)`` and ``shutdown()`` (drains the queue).

    What the tier needs of ``ThreadPoolExecutor``, without a Future per request (the IOHandle is
    the request's result): Note [I/O workers]. Threads start on demand, up to ``threads``; they are
    daemon threads, stopped (after every queued request ran) by :meth:`shutdown`, which the tier's
    finalizer calls at close, garbage collection or interpreter exit.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._max = threads
        self._name = name
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._closed:
            raise RuntimeError("cannot submit to a stopped NVMe worker pool")
        if len(self._threads) < self._max:
            with self._lock:
                if len(self._threads) < self._max and not self._closed:
                    thread = threading.Thread(
                        target=_work, args=(self._tasks,), name=f"{self._name}_{len(self._threads)}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
        self._tasks.put((fn, args))

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(_STOP)
        if wait:
            current = threading.current_thread()
            for thread in threads:
                if thread is not current:
                    thread.join()


# Note [I/O workers]
# The tier runs its requests on its own small pools (``_Workers``: daemon threads on one
# SimpleQueue each, reads and writes apart) rather than ``ThreadPoolExecutor``: a transfer's
# result is its IOHandle, so the executor's Future (a Condition per request, set running,
# set result, notify) was pure cost, paid per request on the hot path (a few µs each on the
# benchmark machine; docs/nvme.md). Shutdown puts one stop mark per thread after every
# queued request, so close() still waits for every transfer in flight. Daemon threads: at
# interpreter exit the tier's finalizer (an atexit hook) stops and joins them; non-daemon
# threads blocked on the queue would make the interpreter wait for them before atexit runs.


def _shutdown(directory: str, pools: tuple[_Workers, ...], entries: dict[Hashable, _Entry]) -> None:
    """Finalizer of a tier (close, garbage collection, interpreter exit): drain the queues, remove the files."""
    for pool in pools:
        pool.shutdown(wait=True)
    for entry in list(entries.values()):
        if entry.fd is not None:
            try:
                os.close(entry.fd)
            except OSError:
                pass
            entry.fd = None
    remove_private_directory(directory)
