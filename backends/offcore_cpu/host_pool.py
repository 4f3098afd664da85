"""The fake device's host buffer pool: offcore's exact-size pool on the device's host memory.

Blocks come from ``FakeDevice.allocate(n, Tier.PINNED or Tier.PAGEABLE)``, so they
show in ``memory_stats()`` as pinned or pageable bytes; with the sanitizer on, a
buffer is poisoned when it returns to the pool, so a copy still reading it (a missing
wait before release) moves garbage instead of the right numbers, and the device
records the early release as a violation (Note [Use after free] in sanitizer.py).

    >>> import offcore
    >>> dev = offcore.device("cpu", buffers="numpy", sanitize=True)
    >>> pool = dev.host_pool("1MiB", block_size="1MiB")
    >>> buf = pool.acquire(16)
    >>> buf.view[:] = 7
    >>> pool.release(buf)
    >>> int(buf.view[0])                   # poisoned on release
    255
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offcore.pool import HostBuffer, HostBufferPool

__all__ = ["FakeHostBufferPool", "PoisoningHostBufferPool"]


class FakeHostBufferPool(HostBufferPool):
    """A :class:`offcore.HostBufferPool` of the fake device's host memory (a device without the sanitizer:
    a released buffer goes back as it is, with the base class's ``release`` and nothing added per buffer)."""


class PoisoningHostBufferPool(FakeHostBufferPool):
    """The pool of a sanitizing device: it poisons released buffers through ``poison``."""

    def __init__(self, allocate_block: Callable[[int], Any], *, poison: Callable[[Any], object], **kwargs: Any) -> None:
        super().__init__(allocate_block, **kwargs)
        self._poison = poison

    def release(self, buffer: HostBuffer) -> None:
        """Return ``buffer``, poisoned first."""
        self._poison(buffer.view)
        super().release(buffer)
