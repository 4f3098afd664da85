"""A budgeted, reusable, exact-size host buffer pool.

Pinned allocation is slow (milliseconds per ``cudaHostAlloc``) and PyTorch's host
caching allocator rounds requests up to powers of two. This pool instead asks the
backend for a few large blocks (up to ``budget`` bytes in all) and sub-allocates
exact-size slices from them (first fit, neighbours merged on release), so buffers
are reused from step to step and never rounded beyond ``alignment``. Idle blocks go
back to the backend with :meth:`HostBufferPool.trim`, and a request that fits no
block and not the rest of the budget first gives the idle blocks back (they were too
small for it) before it is refused.

# Note [Free lists by size]
# A training step acquires and releases the same few sizes over and over (one buffer per
# saved tensor, once per step). A released buffer is therefore parked on a free list keyed
# by its exact size, and the next request of that size takes it back as it is: no first-fit
# scan, no re-slicing of the block, no merging, O(1) under the lock. Parked buffers count as
# free in ``used_bytes``; they go back into their blocks' free lists (merged with their
# neighbours) whenever a request finds no parked buffer of its size and no block room, and
# before any block is judged idle (``trim``, a request reclaiming idle blocks), so the
# budget, the merging and the no-leak guarantees are those of the plain pool. A buffer
# released twice is refused whether it is parked or merged (a parked buffer carries ``parked``:
# one attribute, set and cleared under the lock, instead of a set of parked ids to keep).

    >>> from offcore.pool import HostBufferPool
    >>> import numpy as np
    >>> pool = HostBufferPool(lambda n: np.zeros(n, np.uint8), budget=1 << 20, block_size=1 << 20)
    >>> a = pool.acquire(1000)
    >>> a.nbytes, pool.used_bytes
    (1000, 1024)
    >>> pool.release(a); pool.used_bytes
    0
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offcore.errors import CapacityExceededError, ConfigurationError, IllegalTransitionError
from offcore.units import format_bytes, parse_size

__all__ = ["HostBufferPool", "HostBuffer"]


@dataclass(eq=False)
class HostBuffer:
    """A slice of a pool block: ``view`` is a raw uint8 buffer of exactly ``nbytes``.

    ``block`` identifies the block (stable while the buffer is out, whatever is trimmed).
    """

    view: Any
    nbytes: int
    block: int
    offset: int
    size: int  # reserved bytes (nbytes rounded up to the pool's alignment)
    parked: bool = field(default=False, repr=False)  # released, on its pool's free list (Note [Free lists by size])


class _Block:
    def __init__(self, buffer: Any, size: int) -> None:
        self.buffer = buffer
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)

    def take(self, size: int) -> int | None:
        for i, (off, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, length - size)
                return off
        return None

    def give(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (offset, 0))
        overlaps_left = i > 0 and self.free[i - 1][0] + self.free[i - 1][1] > offset
        overlaps_right = i < len(self.free) and self.free[i][0] < offset + size
        if overlaps_left or overlaps_right:
            # a double release: accepting it would hand the same bytes out twice later
            raise IllegalTransitionError(
                f"host buffer at offset {offset} ({size} bytes) is already free in its pool block; "
                "release each buffer exactly once"
            )
        self.free.insert(i, (offset, size))
        # merge with the right neighbour, then the left one
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:
            self.free[i] = (offset, size + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]

    @property
    def idle(self) -> bool:
        return self.free == [(0, self.size)]


class HostBufferPool:
    """Exact-size host buffers carved out of at most ``budget`` bytes of large blocks.

    ``allocate_block(nbytes)`` returns a raw uint8 buffer (a pinned tensor, a numpy
    array, ...). ``acquire`` raises :class:`~offcore.CapacityExceededError` when the
    budget is exhausted; callers decide the fallback (pageable, keep on device).
    """

    def __init__(
        self,
        allocate_block: Callable[[int], Any],
        *,
        budget: int | str,
        block_size: int | str = "64MiB",
        alignment: int = 512,
        on_block: Callable[[int], None] | None = None,
    ) -> None:
        self._allocate_block = allocate_block
        self.budget = parse_size(budget, what="host pool budget")
        self.block_size = parse_size(block_size, what="host pool block size")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigurationError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self._blocks: dict[int, _Block] = {}  # by block id, oldest first (first fit in that order)
        self._next_block = 0
        # released buffers by exact size, taken back as they are (Note [Free lists by size])
        self._parked: dict[int, list[HostBuffer]] = {}
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self._on_block = on_block

    @property
    def reserved_bytes(self) -> int:
        """Bytes of blocks held from the backend (what the pool costs the host)."""
        return sum(b.size for b in self._blocks.values())

    def _round(self, nbytes: int) -> int:
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def acquire(self, nbytes: int) -> HostBuffer:
        """An exact-size buffer of ``nbytes``; contents are undefined.

        When no block has room and the rest of the budget is too small, idle blocks (all
        too small for this request, or it would have fit one) go back to the backend
        first; :class:`~offcore.CapacityExceededError` only when even that is not enough.
        """
        with self._lock:
            parked = self._parked.get(nbytes)  # only sizes > 0 are ever parked
            if parked:  # the common case: a buffer of this very size came back (Note [Free lists by size])
                buffer = parked.pop()
                buffer.parked = False
                used = self.used_bytes = self.used_bytes + buffer.size
                if used > self.peak_used_bytes:
                    self.peak_used_bytes = used
                return buffer
            if nbytes <= 0:
                raise ConfigurationError(f"cannot acquire a host buffer of {nbytes} bytes")
            size = self._round(nbytes)
            for block_id, block in self._blocks.items():
                offset = block.take(size)
                if offset is not None:
                    return self._hand_out(block_id, offset, size, nbytes)
            if any(self._parked.values()) and self._unpark():  # parked buffers of other sizes merge back first
                for block_id, block in self._blocks.items():
                    offset = block.take(size)
                    if offset is not None:
                        return self._hand_out(block_id, offset, size, nbytes)
            new_size = self._new_block_size(size)
            if new_size is None and self._free_idle_blocks():
                new_size = self._new_block_size(size)
            if new_size is None:
                raise CapacityExceededError(
                    f"host pool budget exhausted: {format_bytes(nbytes)} requested, "
                    f"{format_bytes(self.used_bytes)} of {format_bytes(self.budget)} in use. "
                    "Raise the host budget or let the policy fall back to pageable memory / keeping on device."
                )
            block = _Block(self._allocate_block(new_size), new_size)
            if self._on_block is not None:
                self._on_block(new_size)
            block_id = self._next_block
            self._next_block += 1
            self._blocks[block_id] = block
            offset = block.take(size)
            assert offset is not None
            return self._hand_out(block_id, offset, size, nbytes)

    def _new_block_size(self, size: int) -> int | None:
        """Bytes of a new block for a request of ``size``; None if the budget has no room for it."""
        new_size = max(size, self.block_size)
        room = self.budget - self.reserved_bytes
        if new_size > room:
            # the rest of the budget as one block (not one exact block per request, which
            # would cost a pinned allocation per tensor); it may still be too small
            new_size = max(size, room // self.alignment * self.alignment)
        return None if new_size > room else new_size

    def _unpark(self) -> int:
        """Give every parked buffer back to its block, merged (lock held); returns how many."""
        count = 0
        blocks = self._blocks
        for parked in self._parked.values():
            count += len(parked)
            for buffer in parked:
                blocks[buffer.block].give(buffer.offset, buffer.size)
        for parked in self._parked.values():  # all given back (a refused give leaves every one parked)
            for buffer in parked:
                buffer.parked = False
        self._parked.clear()
        return count

    def _free_idle_blocks(self) -> int:
        """Drop every block with no buffer out (lock held); returns the bytes given back."""
        self._unpark()
        idle = [block_id for block_id, block in self._blocks.items() if block.idle]
        freed = sum(self._blocks.pop(block_id).size for block_id in idle)
        if self._on_block is not None and freed:
            self._on_block(-freed)
        return freed

    def _hand_out(self, block_id: int, offset: int, size: int, nbytes: int) -> HostBuffer:
        self.used_bytes += size
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        view = self._blocks[block_id].buffer[offset : offset + nbytes]
        return HostBuffer(view=view, nbytes=nbytes, block=block_id, offset=offset, size=size)

    def release(self, buffer: HostBuffer) -> None:
        """Return a buffer; the caller guarantees no copy still reads or writes it."""
        with self._lock:
            if buffer.block not in self._blocks:  # its block went back to the backend: released already
                raise IllegalTransitionError(
                    f"host buffer at offset {buffer.offset} ({buffer.size} bytes) belongs to a block this pool "
                    "no longer holds; release each buffer exactly once"
                )
            if buffer.parked:
                raise IllegalTransitionError(
                    f"host buffer at offset {buffer.offset} ({buffer.size} bytes) is already free in its pool block; "
                    "release each buffer exactly once"
                )
            parked = self._parked.get(buffer.nbytes)
            if parked is None:
                parked = self._parked[buffer.nbytes] = []
            parked.append(buffer)  # Note [Free lists by size]
            buffer.parked = True
            self.used_bytes -= buffer.size

    def trim(self) -> int:
        """Give every idle block (no buffer out) back to the backend; returns the bytes freed.

        Blocks with buffers out stay, wherever they are. A freed block's memory is released
        when the last view of it dies (a caller may still hold a released buffer's ``view``).
        """
        with self._lock:
            return self._free_idle_blocks()
