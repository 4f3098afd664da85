"""The NVMe storage tier: objects in private files, read and written asynchronously from host buffers.

    >>> import numpy as np, tempfile
    >>> from offcore.nvme import NvmeTier
    >>> with NvmeTier(tempfile.mkdtemp(), budget="64MiB", verify=True) as tier:
    ...     state = np.arange(1000, dtype=np.float32)
    ...     tier.write("exp_avg.0", state).synchronize()     # only now may ``state`` be freed
    ...     back = np.empty_like(state)
    ...     tier.read("exp_avg.0", back).synchronize()
    ...     bool((back == state).all()), tier.used_bytes
    (True, 4096)

One file per object (Note [one file per object]); ``O_DIRECT`` where the filesystem takes
it, buffered I/O where it refuses (tmpfs); ``os.preadv`` / ``os.pwritev`` on two thread
pools (Note [I/O workers]), one for reads and one for writes, each object split into ``chunk_size`` requests
so one large object keeps several requests in flight (docs/nvme.md has the measurements
behind this choice).
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
import zlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from offcore.errors import (
    CapacityExceededError,
    ChecksumMismatchError,
    ConfigurationError,
    IllegalTransitionError,
    ShortTransferError,
    StorageFileMissingError,
    StorageFileTruncatedError,
)
from offcore.kinds import Direction, Kind, Tier
from offcore.ledger import CopyTotals, Ledger
from offcore.nvme.files import (
    ALIGNMENT,
    aligned_empty,
    direct_io_supported,
    open_private_file,
    private_directory,
    remove_private_directory,
    remove_stale_directories,
)
from offcore.nvme.io import (
    IOHandle,
    _address,
    _as_bytes,
    _Entry,
    _io_error,
    _round_up,
    _shutdown,
    _Transfer,
    _transfer_all,
    _Workers,
)
from offcore.scheduler import BandwidthEstimator
from offcore.trace import TraceRecorder
from offcore.units import format_bytes, parse_size

__all__ = ["NvmeTier", "IOHandle"]

# Note [one file per object]
# Each object written to the tier gets its own file (named by a counter, never by the
# caller's key), rather than slots in one large block-aligned file. Objects are read and
# written whole (an optimizer-state group, a parameter, an activation), so a file per
# object needs no allocator and cannot fragment; deleting or resizing an object gives its
# space back to the filesystem at once (unlink / ftruncate); a truncated or removed file
# is detected per object (fstat before a read, EOF during it); and ZeRO-Infinity's swapper
# does the same (one swap file per tensor). A rewrite of the same key overwrites its file
# in place (no new allocation on the filesystem). With O_DIRECT a file is padded to a
# multiple of ALIGNMENT bytes; the logical size lives in the tier's in-memory index only:
# nothing is ever read back as metadata from the disk (and nothing is unpickled).

# Note [when may the host copy be released]
# The tier never copies a source buffer up front: ``write(key, buffer)`` reads ``buffer``
# from its worker threads until the returned handle completes. So the caller must keep the
# buffer alive and unchanged until ``handle.synchronize()`` returned without raising (or
# ``handle.query()`` returned True). Only then is the disk copy complete, and only then may
# the host copy (the tier above) be released or reused. If the write failed, the handle
# raises a StorageError, the object is removed from the tier (its file too), and the host
# buffer is the only valid copy: keep it, or write it again. ``query()`` and
# ``synchronize()`` raise on failure for exactly this reason: a caller polling for "done"
# must never mistake "failed" for "done". The pipelined optimizer step
# (offcore.nvme.pipeline) follows this rule; the optimizer wiring must too.

# Note [The NVMe tier's copies in the ledger and the trace]
# Every completed transfer is one copy of the ledger (``Direction.H2N`` for a write,
# ``Direction.N2H`` for a read: bytes, seconds from its first request's start to its last
# one's end, count), next to the device's ``d2h`` / ``h2d``, and one span on the trace's
# ``h2n`` / ``n2h`` track, like the copy streams' spans. A failed transfer is counted in
# neither (it moved nothing usable). The same seconds feed ``read_link`` / ``write_link``
# (the links the ResidencyScheduler plans NVMe → host staging with, Note [Two hops from
# NVMe] in offcore/residency.py). ``tier.reads`` / ``tier.writes`` keep the tier's own totals
# (they outlive a ledger's ``reset_step``).


class NvmeTier:
    """Objects of at most ``budget`` bytes in all, in private files under ``path``.

    - ``path``: a directory you own, not writable by others (created 0700 if missing);
      the tier works in a fresh 0700 subdirectory of it, removed by :meth:`close`, when the
      tier is garbage collected, and at interpreter exit; subdirectories left by processes
      that died without cleaning up (SIGKILL) are removed when a tier opens there
      (:attr:`removed_stale`).
    - ``budget``: bytes on disk (``"64GiB"``), files padded to 4 KiB under ``O_DIRECT``;
      a write beyond it raises :class:`~offcore.CapacityExceededError` before any I/O.
    - ``verify`` (default True): keep a CRC-32 per chunk and check it on every read
      (:class:`~offcore.ChecksumMismatchError`), so a block changed on disk behind the tier's
      back is never read back as data (Note [Reads are verified by default]).
    - ``direct``: ``None`` uses ``O_DIRECT`` where the filesystem takes it (probed once),
      ``True`` requires it, ``False`` never uses it.
    - ``chunk_size``, ``threads``: each object moves as ``chunk_size`` requests, with up to
      ``threads`` in flight per direction (reads and writes have separate pools).
    - ``ledger``: bytes on disk are counted there as (``Tier.NVME``, kind).
    - ``max_open_files``: files kept open between transfers (Note [open files]).
    - ``trace``: completed transfers appear there as spans on the ``n2h`` / ``h2n`` tracks
      (Note [The NVMe tier's copies in the ledger and the trace]).

    See the module docstring for an example, and Note [when may the host copy be released].
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        budget: int | str,
        verify: bool = True,
        direct: bool | None = None,
        chunk_size: int | str = "4MiB",
        threads: int = 8,
        ledger: Ledger | None = None,
        max_open_files: int = 256,
        trace: TraceRecorder | None = None,
    ) -> None:
        self.budget = parse_size(budget, what="NVMe tier budget")
        self.chunk_size = parse_size(chunk_size, what="NVMe chunk size")
        if self.chunk_size <= 0 or self.chunk_size % ALIGNMENT:
            raise ConfigurationError(f"NVMe chunk size must be a positive multiple of {ALIGNMENT}, got {chunk_size!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigurationError(f"NVMe threads must be a positive integer, got {threads!r}")
        if isinstance(max_open_files, bool) or not isinstance(max_open_files, int) or max_open_files < 0:
            raise ConfigurationError(f"max_open_files must be a non-negative integer, got {max_open_files!r}")
        self.max_open_files = max_open_files
        if not isinstance(verify, bool):
            raise ConfigurationError(f"NVMe verify must be True or False, got {verify!r}")
        self.verify = verify
        self.ledger = ledger
        self.trace = trace
        """A :class:`~offcore.trace.TraceRecorder` that gets one span per completed transfer (tracks ``n2h`` / ``h2n``)."""
        self.directory = private_directory(path)
        self.removed_stale = remove_stale_directories(path)
        """Directories of dead processes' tiers under ``path`` removed when this one opened (Note [Stale
        directories: an owner lock] in offcore/nvme/files.py)."""
        try:
            supported, reason = direct_io_supported(self.directory)
        except BaseException:
            remove_private_directory(self.directory)
            raise
        if direct and not supported:
            remove_private_directory(self.directory)
            raise ConfigurationError(f"O_DIRECT was required but does not work under {os.fspath(path)!r}: {reason}")
        self.direct = supported if direct is None else bool(direct)
        self.direct_reason = reason
        self._readers = _Workers(threads, "offcore-nvme-read")
        self._writers = _Workers(threads, "offcore-nvme-write")
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._idle_fds: dict[Hashable, _Entry] = {}  # entries with an open, unused fd, least recently used first
        self._finalizer = weakref.finalize(
            self, _shutdown, self.directory, (self._readers, self._writers), self._entries
        )
        self._counter = 0
        self._last_stat: os.stat_result | None = None  # _acquire_fd's fstat, read under the lock
        self._bounce = threading.local()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self.reads = CopyTotals()
        self.writes = CopyTotals()
        self.read_link = BandwidthEstimator()
        """NVMe → host bandwidth, measured on completed reads (the scheduler's link for this direction)."""
        self.write_link = BandwidthEstimator()
        """Host → NVMe bandwidth, measured on completed writes."""

    # -- introspection ------------------------------------------------------------------
    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return (
            f"<NvmeTier {self.directory!r} {format_bytes(self.used_bytes)} of {format_bytes(self.budget)}, "
            f"{len(self._entries)} objects, {mode}>"
        )

    def __contains__(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.written

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[Hashable]:
        """Keys of the objects written so far."""
        return iter([k for k, e in list(self._entries.items()) if e.written])

    def nbytes(self, key: Hashable) -> int:
        """Logical bytes of ``key`` as last written."""
        return self._entry(key, "size of").nbytes

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def free_bytes(self) -> int:
        return self.budget - self.used_bytes

    def _entry(self, key: Hashable, what: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None or not entry.written:
            raise IllegalTransitionError(
                f"cannot {what} {key!r}: it is not on the NVMe tier (never written, deleted, or its last write "
                "failed, in which case its host copy is the valid one)"
            )
        return entry

    def _check_open(self) -> None:
        if self.closed:
            raise IllegalTransitionError(f"the NVMe tier under {self.directory!r} is closed")

    # -- writes -------------------------------------------------------------------------
    def write(self, key: Hashable, buffer: Any, *, kind: Kind | str = Kind.OPTIMIZER_STATE) -> IOHandle:
        """Start writing ``buffer`` as ``key``; keep ``buffer`` unchanged until the handle completes.

        Overwrites a previous version of ``key`` (no read or write of it may be in flight).
        Raises :class:`~offcore.CapacityExceededError` beyond the budget, at once.
        """
        kind = Kind(kind)
        src = _as_bytes(buffer, writable=False, what=f"the buffer written as {key!r}")
        nbytes = src.nbytes
        file_bytes = _round_up(nbytes) if self.direct else nbytes
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is not None and (entry.writing is not None or entry.reads):
                raise IllegalTransitionError(
                    f"cannot write {key!r} while a {'write' if entry.writing else 'read'} of it is in flight; "
                    "synchronize that handle first"
                )
            old = entry.reserved if entry is not None else 0
            if self.used_bytes - old + file_bytes > self.budget:
                raise CapacityExceededError(
                    f"NVMe tier budget exhausted: writing {key!r} needs {format_bytes(file_bytes)} on disk, "
                    f"{format_bytes(self.used_bytes - old)} of {format_bytes(self.budget)} are in use under "
                    f"{self.directory!r}. Raise the NVMe budget, delete objects, or keep this one in host memory."
                )
            create = entry is None
            if entry is None:
                path = os.path.join(self.directory, f"{self._counter:08d}.blk")
                self._counter += 1
                entry = _Entry(key=key, path=path, kind=kind)
            fd = self._acquire_fd(entry, create=create, op="write", nbytes=nbytes)
            try:
                if not create and entry.file_bytes > file_bytes:
                    os.ftruncate(fd, file_bytes)
            except OSError as exc:
                self._release_fd(entry)
                raise _io_error(exc, "write", entry.path, 0, nbytes) from exc
            self._entries[key] = entry
            entry.kind = kind
            entry.reserved = file_bytes
            entry.written = False  # not readable until this write completes
            self.used_bytes += file_bytes - old
            self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
            chunks = list(range(0, nbytes, self.chunk_size))
            handle = IOHandle("write", key, entry.path, nbytes, len(chunks))
            entry.writing = handle
        transfer = _Transfer(entry.path, fd, self.direct)
        crcs: list[int] | None = [0] * len(chunks) if self.verify else None
        handle._on_complete = lambda h: self._write_done(entry, h, transfer, nbytes, file_bytes, crcs)
        if not chunks:
            handle._complete()
        for i, offset in enumerate(chunks):
            piece = src[offset : offset + self.chunk_size]
            self._writers.submit(self._run, handle, self._write_chunk, transfer, piece, offset, i, crcs)
        return handle

    # Note [Reads are verified by default]
    # A block changed on disk after it was written (another process, a cleaner, the disk) used to be
    # read back as data when verify was off, which was the default: training went on with wrong
    # numbers and nothing said so. The CRC-32 per chunk is computed on the I/O threads (zlib releases
    # the GIL, so it overlaps the other chunks' transfers) and costs a pass over bytes that were just
    # read; benchmarks/nvme_checksum.py measures it against the read. Wrong numbers are the worse
    # failure, so verify defaults to True; verify=False is the opt-out where a measured read rate matters
    # more than detecting corruption.
    def _write_chunk(self, t: _Transfer, src: np.ndarray, offset: int, index: int, crcs: list[int] | None) -> None:
        if crcs is not None:
            crcs[index] = zlib.crc32(src)
        buf = src
        if t.direct and (_address(src) % ALIGNMENT or src.nbytes % ALIGNMENT):
            padded = _round_up(src.nbytes)
            bounce = self._bounce_buffer()[:padded]
            bounce[: src.nbytes] = src
            bounce[src.nbytes :] = 0
            buf = bounce
        _transfer_all(
            t,
            "write",
            os.pwritev,
            buf,
            offset,
            lambda done, n: ShortTransferError(
                f"write of {format_bytes(buf.nbytes)} at byte {offset} of {t.path!r} stopped after {done} bytes "
                f"(pwritev returned {n}); check free space and the disk. The data is still in the host buffer."
            ),
        )

    def _write_done(
        self, entry: _Entry, h: IOHandle, t: _Transfer, nbytes: int, file_bytes: int, crcs: list[int] | None
    ) -> None:
        try:
            t.close()
        except OSError as exc:  # close can report a deferred write error (NFS, ...)
            if h._error is None:
                h._error = _io_error(exc, "write", entry.path, 0, nbytes)
        ledger_delta: tuple[int, int] = (entry.ledger_bytes, 0)
        with self._lock:
            entry.writing = None
            self._release_fd(entry)
            if h._error is None:
                entry.nbytes, entry.file_bytes, entry.crcs, entry.written = nbytes, file_bytes, crcs, True
                ledger_delta = (entry.ledger_bytes, nbytes)
                entry.ledger_bytes = nbytes
                self.writes.bytes += nbytes
                self.writes.seconds += h.seconds
                self.writes.copies += 1
            else:  # nothing lost: the caller's buffer is the valid copy; drop the half-written file
                self._entries.pop(entry.key, None)
                self._close_fd(entry)
                self.used_bytes -= entry.reserved
                entry.reserved = entry.ledger_bytes = 0
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
        self._ledger_change(entry.kind, *ledger_delta)
        if h._error is None:
            self.write_link.observe(nbytes, h.seconds)
            self._record_copy(Direction.H2N, h)

    def _ledger_change(self, kind: Kind, old: int, new: int) -> None:
        if self.ledger is None or old == new:
            return
        if old:
            self.ledger.remove(Tier.NVME, kind, old)
        if new:
            self.ledger.add(Tier.NVME, kind, new)

    # -- reads --------------------------------------------------------------------------
    def read(self, key: Hashable, out: Any) -> IOHandle:
        """Start reading ``key`` into ``out`` (a writable contiguous buffer of exactly its size)."""
        dst = _as_bytes(out, writable=True, what=f"the buffer read into for {key!r}")
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is not None and entry.writing is not None:
                raise IllegalTransitionError(
                    f"cannot read {key!r} while its write is in flight; synchronize the write's handle first"
                )
            entry = self._entry(key, "read")
            if dst.nbytes != entry.nbytes:
                raise ConfigurationError(
                    f"cannot read {key!r} ({entry.nbytes} bytes) into a buffer of {dst.nbytes} bytes; "
                    "pass a buffer of exactly the object's size"
                )
            fd = self._acquire_fd(entry, create=False, op="read", nbytes=entry.nbytes)
            try:
                st = self._last_stat
                size = (st if st is not None else os.fstat(fd)).st_size  # one fstat per read
            except OSError as exc:
                self._release_fd(entry)
                raise _io_error(exc, "read", entry.path, 0, entry.nbytes) from exc
            if size < entry.file_bytes:
                self._release_fd(entry)
                raise StorageFileTruncatedError(
                    f"read of {key!r} from {entry.path!r}: the file has {size} bytes, {entry.file_bytes} were "
                    "written; something truncated it. Keep the tier's directory private; the object's data is lost "
                    "unless a copy is kept elsewhere."
                )
            entry.reads += 1
            chunks = list(range(0, entry.nbytes, self.chunk_size))
            handle = IOHandle("read", key, entry.path, entry.nbytes, len(chunks))
            crcs = entry.crcs
        transfer = _Transfer(entry.path, fd, self.direct)
        handle._on_complete = lambda h: self._read_done(entry, h, transfer)
        if not chunks:
            handle._complete()
        for i, offset in enumerate(chunks):
            piece = dst[offset : offset + self.chunk_size]
            crc = crcs[i] if crcs is not None else None
            self._readers.submit(self._run, handle, self._read_chunk, transfer, piece, offset, crc)
        return handle

    def _read_chunk(self, t: _Transfer, dst: np.ndarray, offset: int, crc: int | None) -> None:
        buf = dst
        if t.direct and (_address(dst) % ALIGNMENT or dst.nbytes % ALIGNMENT):
            buf = self._bounce_buffer()[: _round_up(dst.nbytes)]
        _transfer_all(
            t,
            "read",
            os.preadv,
            buf,
            offset,
            lambda done, n: StorageFileTruncatedError(
                f"read of {format_bytes(buf.nbytes)} at byte {offset} of {t.path!r} hit the end of the file after "
                f"{done} bytes: the file was truncated behind offcore's back. Keep the tier's directory private."
            ),
        )
        if buf is not dst:
            dst[:] = buf[: dst.nbytes]
        if crc is not None:
            found = zlib.crc32(dst)
            if found != crc:
                raise ChecksumMismatchError(
                    f"bytes {offset}..{offset + dst.nbytes} of {t.path!r} read back with CRC-32 {found:#010x}, "
                    f"{crc:#010x} was written: the disk or something else corrupted them. The object cannot be "
                    "trusted; restore it from a checkpoint (and check the disk)."
                )

    def _read_done(self, entry: _Entry, h: IOHandle, t: _Transfer) -> None:
        t.close()
        with self._lock:
            entry.reads -= 1
            self._release_fd(entry)
            if h._error is None:
                self.reads.bytes += h.nbytes
                self.reads.seconds += h.seconds
                self.reads.copies += 1
        if h._error is None:
            self.read_link.observe(h.nbytes, h.seconds)
            self._record_copy(Direction.N2H, h)

    def _record_copy(self, direction: Direction, h: IOHandle) -> None:
        """A completed transfer in the ledger's copies and the trace (Note [The NVMe tier's copies in the ledger
        and the trace])."""
        if self.ledger is not None:
            self.ledger.record_copy(direction, h.nbytes, seconds=h.seconds)
        if self.trace is not None and h.started is not None:
            self.trace.span(direction.value, str(h.key), h.started, h.seconds, nbytes=h.nbytes, path=h.path)

    # -- shared -------------------------------------------------------------------------
    def _acquire_fd(self, entry: _Entry, *, create: bool, op: str, nbytes: int) -> int:
        """The entry's open fd for one more transfer (lock held); checks the file is still there.

        A kept-open fd's ``fstat`` is left in ``self._last_stat`` (a read checks the size with it)."""
        self._last_stat = None
        if entry.fd is None:
            try:
                entry.fd = open_private_file(entry.path, create=create, direct=self.direct)
            except OSError as exc:
                raise _io_error(exc, op, entry.path, 0, nbytes) from exc
        else:
            self._idle_fds.pop(entry.key, None)
            try:
                st = self._last_stat = os.fstat(entry.fd)
            except OSError as exc:
                self._close_fd(entry)
                raise _io_error(exc, op, entry.path, 0, nbytes) from exc
            if st.st_nlink == 0:
                self._close_fd(entry)
                raise StorageFileMissingError(
                    errno.ENOENT,
                    f"{op} of {format_bytes(nbytes)} of {entry.path!r} refused: the file was removed or replaced "
                    "behind offcore's back (by another process?). Keep the tier's directory private.",
                )
        entry.fd_users += 1
        return entry.fd

    def _release_fd(self, entry: _Entry) -> None:
        """One transfer less on the entry's fd (lock held); idle fds beyond ``max_open_files`` are closed."""
        entry.fd_users -= 1
        if entry.fd_users or entry.fd is None:
            return
        if self._entries.get(entry.key) is not entry:
            self._close_fd(entry)
            return
        self._idle_fds[entry.key] = entry
        while len(self._idle_fds) > self.max_open_files:
            oldest = next(iter(self._idle_fds))
            self._close_fd(self._idle_fds[oldest])

    def _close_fd(self, entry: _Entry) -> None:
        """Close the entry's fd (lock held, no transfer using it)."""
        if self._idle_fds.get(entry.key) is entry:
            del self._idle_fds[entry.key]
        if entry.fd is not None:
            fd, entry.fd = entry.fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def _run(self, handle: IOHandle, work: Callable[..., None], *args: Any) -> None:
        error: BaseException | None = None
        if handle._begin():
            try:
                work(*args)
            except BaseException as exc:
                error = exc
        handle._end(error)

    def _bounce_buffer(self) -> np.ndarray:
        """This worker thread's aligned bounce buffer of ``chunk_size`` bytes (for unaligned O_DIRECT transfers)."""
        buf = getattr(self._bounce, "buffer", None)
        if buf is None:
            buf = self._bounce.buffer = aligned_empty(self.chunk_size)
        return buf

    def delete(self, key: Hashable) -> None:
        """Remove ``key`` and its file (nothing of it may be in flight)."""
        with self._lock:
            self._check_open()
            entry = self._entry(key, "delete")
            if entry.writing is not None or entry.reads:
                raise IllegalTransitionError(f"cannot delete {key!r} while a transfer of it is in flight")
            del self._entries[key]
            self._close_fd(entry)
            self.used_bytes -= entry.reserved
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
        self._ledger_change(entry.kind, entry.ledger_bytes, 0)

    def close(self) -> None:
        """Wait for transfers in flight, remove every file and the tier's directory (idempotent)."""
        if self.closed:
            return
        self._finalizer()  # drains both pools, so every handle has completed
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._idle_fds.clear()
            self.used_bytes = 0
        for entry in entries:
            self._ledger_change(entry.kind, entry.ledger_bytes, 0)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
