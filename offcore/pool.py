"""A budgeted, reusable, exact-size host buffer pool.

Pinned allocation is slow (milliseconds per ``cudaHostAlloc``) and PyTorch's host
caching allocator rounds requests up to powers of two. This pool instead asks the
backend for a few large blocks (up to ``budget`` bytes in all) and sub-allocates
exact-size slices from them (first fit, neighbours merged on release), so buffers
are reused from step to step and never rounded beyond ``alignment``.

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
from dataclasses import dataclass
from typing import Any

from offcore.errors import CapacityExceededError, ConfigurationError, IllegalTransitionError
from offcore.units import format_bytes, parse_size

__all__ = ["HostBufferPool", "HostBuffer"]


@dataclass(eq=False)
class HostBuffer:
    """A slice of a pool block: ``view`` is a raw uint8 buffer of exactly ``nbytes``."""

    view: Any
    nbytes: int
    block: int
    offset: int
    size: int  # reserved bytes (nbytes rounded up to the pool's alignment)


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
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self._on_block = on_block

    @property
    def reserved_bytes(self) -> int:
        """Bytes of blocks held from the backend (what the pool costs the host)."""
        return sum(b.size for b in self._blocks)

    def _round(self, nbytes: int) -> int:
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def acquire(self, nbytes: int) -> HostBuffer:
        """An exact-size buffer of ``nbytes``; contents are undefined."""
        if nbytes <= 0:
            raise ConfigurationError(f"cannot acquire a host buffer of {nbytes} bytes")
        size = self._round(nbytes)
        with self._lock:
            for index, block in enumerate(self._blocks):
                offset = block.take(size)
                if offset is not None:
                    return self._hand_out(index, offset, size, nbytes)
            new_size = max(size, self.block_size)
            room = self.budget - self.reserved_bytes
            if new_size > room:
                # the rest of the budget as one block (not one exact block per request, which
                # would cost a pinned allocation per tensor); it may still be too small
                new_size = max(size, room // self.alignment * self.alignment)
            if new_size > room:
                raise CapacityExceededError(
                    f"host pool budget exhausted: {format_bytes(nbytes)} requested, "
                    f"{format_bytes(self.used_bytes)} of {format_bytes(self.budget)} in use. "
                    "Raise the host budget or let the policy fall back to pageable memory / keeping on device."
                )
            block = _Block(self._allocate_block(new_size), new_size)
            if self._on_block is not None:
                self._on_block(new_size)
            self._blocks.append(block)
            offset = block.take(size)
            assert offset is not None
            return self._hand_out(len(self._blocks) - 1, offset, size, nbytes)

    def _hand_out(self, index: int, offset: int, size: int, nbytes: int) -> HostBuffer:
        self.used_bytes += size
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        view = self._blocks[index].buffer[offset : offset + nbytes]
        return HostBuffer(view=view, nbytes=nbytes, block=index, offset=offset, size=size)

    def release(self, buffer: HostBuffer) -> None:
        """Return a buffer; the caller guarantees no copy still reads or writes it."""
        with self._lock:
            self._blocks[buffer.block].give(buffer.offset, buffer.size)
            self.used_bytes -= buffer.size

    def trim(self) -> int:
        """Give idle trailing blocks back to the backend; returns the bytes freed."""
        freed = 0
        with self._lock:
            while self._blocks and self._blocks[-1].idle:
                freed += self._blocks.pop().size
            if self._on_block is not None and freed:
                self._on_block(-freed)
        return freed
