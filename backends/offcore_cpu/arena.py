"""Byte accounting of the fake device's memory: device arena and host figures.

The arena does not own memory; it counts *owners* (a ``torch.UntypedStorage`` or
the root ``numpy.ndarray`` of a buffer) by weak reference, so an owner's bytes are
counted from registration until the owner really dies, exactly the meaning of
``torch.cuda.memory_allocated``: a view keeps its storage's bytes alive, and freeing
a tensor frees nothing while another tensor still shares its storage.

    >>> import numpy as np
    >>> from offcore.kinds import Tier
    >>> arena = MemoryArena("cpu:0", capacity=1 << 20)
    >>> buf = np.empty(4096, np.uint8)
    >>> arena.register(buf, buf.nbytes, Tier.DEVICE)
    >>> arena.stats()["allocated_bytes"]
    4096
    >>> del buf
    >>> arena.stats()["allocated_bytes"]
    0
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from offcore.errors import ConfigurationError
from offcore.kinds import Tier
from offcore_cpu.errors import FakeDeviceOutOfMemoryError, out_of_memory

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_DEVICE, _PAGEABLE, _PINNED = Tier.DEVICE, Tier.PAGEABLE, Tier.PINNED

__all__ = ["MemoryArena"]


@dataclass
class _Allocation:
    tier: Tier
    nbytes: int
    ref: weakref.ref  # type: ignore[type-arg]
    count: int  # 1 while it holds memory, 0 while empty (resized to 0): device_allocations counts it
    marked: int = 0  # a host owner's data pointer the allocator hook knows it by (Note [Host buffers the hook knows])


class MemoryArena:
    """Live bytes per tier with peaks; the device tier is limited to ``capacity``.

    A device request that does not fit raises ``error_class`` (see
    Note [Two flavours of FakeDeviceOutOfMemoryError]).

    Thread-safe. Owners must support weak references; their bytes are released by the
    weakref callback when they die (from whatever thread drops the last reference).
    """

    def __init__(
        self,
        device_name: str,
        capacity: int,
        *,
        error_class: type[FakeDeviceOutOfMemoryError] = FakeDeviceOutOfMemoryError,
    ) -> None:
        self.device_name = device_name
        self.capacity = capacity
        self.error_class = error_class
        # RLock: a weakref callback may run (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()
        self._allocations: dict[int, _Allocation] = {}
        self._current: dict[Tier, int] = dict.fromkeys(Tier, 0)
        self._peak: dict[Tier, int] = dict.fromkeys(Tier, 0)
        self._counts: dict[Tier, int] = dict.fromkeys(Tier, 0)  # live allocations per tier (stats() is O(1))
        # Note [Counting device memory with allocations] (tracking.py): with torch's allocator hooked, the
        # device tier's bytes, peak and count live in the hook's ledger, shared with allocations the hook counts
        self._ledger: Any = None
        self._probe: Callable[[Any], bool] | None = None
        self._take_over: Callable[[Any], bool] | None = None
        # probe by a storage's data pointer: the small copy's fast path asks it (Note [The small copy's fast path])
        self._owns: Callable[[int], bool] | None = None
        # Note [Host buffers the hook knows] (_alloc_hook.cpp): host owners marked in the hook, unmarked when they die
        self._mark_host: Callable[[Any], int] | None = None
        self._unmark_host: Callable[[int], None] | None = None

    def use_ledger(
        self,
        ledger: Any,
        probe: Callable[[Any], bool],
        take_over: Callable[[Any], bool] | None = None,
        owns: Callable[[int], bool] | None = None,
        host_marks: tuple[Callable[[Any], int], Callable[[int], None]] | None = None,
    ) -> None:
        """Keep the device tier's figures in ``ledger`` (the allocator hook's); ``probe(owner)`` tells
        whether the hook counts ``owner`` on this device; ``take_over(owner)`` hands a newly registered
        device owner, already charged to the ledger, to the hook (True) so that its frees and resizes
        are counted where they happen (Note [Adopted storages are the hook's]); ``owns(address)``
        is ``probe`` of a storage by its data pointer, for callers that checked it is a live CPU
        storage; ``host_marks`` (mark, unmark) tell the hook about host owners while they are counted
        (Note [Host buffers the hook knows] in _alloc_hook.cpp). Only before anything is counted on the device."""
        with self._lock:
            if self._current[_DEVICE] or self._counts[_DEVICE]:
                raise ConfigurationError("the fake device's ledger can only be replaced before any device allocation")
            self._ledger = ledger
            self._probe = probe
            self._take_over = take_over
            self._owns = owns
            if host_marks is not None:
                self._mark_host, self._unmark_host = host_marks

    # -- registration -------------------------------------------------------------------
    def check_fits(self, nbytes: int) -> None:
        """Raise the fake device's out-of-memory error unless ``nbytes`` more fit on the device."""
        with self._lock:
            allocated = self._device_bytes()
            if allocated + nbytes > self.capacity:
                raise out_of_memory(self.device_name, nbytes, allocated, self.capacity, error_class=self.error_class)

    def _device_bytes(self) -> int:
        return self._ledger.current() if self._ledger is not None else self._current[_DEVICE]

    def _charge(self, tier: Tier, nbytes: int, count: int) -> None:
        """Count ``nbytes`` more (``count`` more owners) on ``tier``; the device's must fit."""
        if tier is _DEVICE and self._ledger is not None:
            if nbytes > 0 and not self._ledger.try_add(nbytes, count):
                self.check_fits(nbytes)  # raises the out-of-memory error
                self._ledger.add(nbytes, count)  # freed meanwhile: it fits now
            elif nbytes <= 0:
                self._ledger.add(nbytes, count)
            return
        if tier is _DEVICE and nbytes > 0:
            self.check_fits(nbytes)
        self._counts[tier] += count
        self._add(tier, nbytes)

    def _hooked(self, owner: Any) -> bool:
        """True when the allocator hook counts ``owner`` as this device's memory."""
        return self._probe is not None and self._probe(owner)

    def register(self, owner: Any, nbytes: int, tier: Tier) -> None:
        """Count ``owner``'s ``nbytes`` on ``tier`` until it dies (no-op when already counted there).

        :meth:`register_many` for one owner, without its batching (once per allocation).
        """
        key = id(owner)
        with self._lock:
            known = self._allocations.get(key)
            if known is not None or self._hooked(owner):
                if known is None or known.tier is not tier:
                    self.register_many([(owner, nbytes)], tier)  # raises the mismatch error, if any
                return
            count = 1 if nbytes > 0 else 0
            self._charge(tier, nbytes, count)
            self._track(key, owner, nbytes, count, tier)

    def _track(self, key: int, owner: Any, nbytes: int, count: int, tier: Tier) -> None:
        """Remember a newly charged owner until it dies -- or hand it to the allocator hook."""
        if tier is _DEVICE and count and self._take_over is not None and self._take_over(owner):
            return  # the hook credits the ledger when the memory is freed
        ref = weakref.ref(owner, functools.partial(self._forget, key))
        marked = 0
        if tier is not _DEVICE and self._mark_host is not None:
            marked = self._mark_host(owner)
        self._allocations[key] = _Allocation(tier, nbytes, ref, count, marked)

    def register_many(self, owners: Iterable[tuple[Any, int]], tier: Tier) -> int:
        """Register several owners at once: all fit on the device, or none is counted.

        Returns the bytes newly counted. An owner already counted on another tier is a
        :class:`~offcore.ConfigurationError` (a host buffer cannot become device memory).
        """
        with self._lock:
            new: dict[int, tuple[Any, int]] = {}
            for owner, nbytes in owners:
                known = self._allocations.get(id(owner))
                known_tier = known.tier if known is not None else _DEVICE if self._hooked(owner) else None
                if known_tier is not None:
                    if known_tier is not tier:
                        raise ConfigurationError(
                            f"this buffer is already counted as {known_tier.value} memory of the fake device "
                            f"{self.device_name}; it cannot also be {tier.value} memory. Copy it into a "
                            f"{tier.value} buffer instead."
                        )
                    continue
                new[id(owner)] = (owner, nbytes)
            total = sum(nbytes for _, nbytes in new.values())
            self._charge(tier, total, sum(1 for _, nbytes in new.values() if nbytes > 0))
            for key, (owner, nbytes) in new.items():
                self._track(key, owner, nbytes, 1 if nbytes > 0 else 0, tier)
            return total

    def resize(self, owner: Any, nbytes: int) -> None:
        """A counted owner changed size (``resize_``); growth on the device is capacity-checked."""
        with self._lock:
            allocation = self._allocations.get(id(owner))
            if allocation is None or allocation.nbytes == nbytes:
                return
            growth = nbytes - allocation.nbytes
            count = 1 if nbytes > 0 else 0  # an emptied storage holds no allocation (as CUDA's allocator)
            self._charge(allocation.tier, growth, count - allocation.count)
            allocation.nbytes = nbytes
            allocation.count = count

    def _add(self, tier: Tier, nbytes: int) -> None:
        self._current[tier] += nbytes
        if self._current[tier] > self._peak[tier]:
            self._peak[tier] = self._current[tier]

    def _forget(self, key: int, _ref: Any) -> None:
        with self._lock:
            allocation = self._allocations.get(key)
            # The key may have been reused only after this callback ran, so the entry is ours
            # unless it was already removed; compare the weakref to be sure.
            if allocation is not None and allocation.ref is _ref:
                del self._allocations[key]
                if allocation.marked and self._unmark_host is not None:
                    self._unmark_host(allocation.marked)
                if allocation.tier is _DEVICE and self._ledger is not None:
                    self._ledger.sub(allocation.nbytes, allocation.count)
                    return
                self._current[allocation.tier] -= allocation.nbytes
                self._counts[allocation.tier] -= allocation.count

    # -- queries --------------------------------------------------------------------------
    def tier_of(self, owner: Any) -> Tier | None:
        """The tier ``owner`` is counted on, or None when the arena does not know it."""
        # read without the lock (a copy asks this of both its buffers): one dict lookup is atomic, and
        # the weak reference tells a live registration from a stale one whose id was reused
        allocation = self._allocations.get(id(owner))
        if allocation is not None and allocation.ref() is owner:
            return allocation.tier
        if self._hooked(owner):  # the hook counts only device memory (holds() asks it without the lock too)
            return _DEVICE
        with self._lock:
            allocation = self._allocations.get(id(owner))
            if allocation is None or allocation.ref() is not owner:
                return _DEVICE if self._hooked(owner) else None
            return allocation.tier

    def allocated(self, tier: Tier = Tier.DEVICE) -> int:
        ledger = self._ledger
        if ledger is not None and tier is _DEVICE:
            return int(ledger.current())  # the hook's ledger reads under its own lock
        with self._lock:
            return self._device_bytes() if tier is _DEVICE else self._current[tier]

    def stats(self) -> dict[str, int]:
        """Current and peak bytes; the keys of :class:`offcore.MemoryStats`."""
        with self._lock:
            ledger = self._ledger
            device = ledger.current() if ledger is not None else self._current[_DEVICE]
            return {
                "allocated_bytes": device,
                "peak_allocated_bytes": ledger.peak() if ledger is not None else self._peak[_DEVICE],
                "capacity_bytes": self.capacity,
                "free_bytes": max(self.capacity - device, 0),
                "device_allocations": ledger.allocations() if ledger is not None else self._counts[_DEVICE],
                "pinned_bytes": self._current[_PINNED],
                "peak_pinned_bytes": self._peak[_PINNED],
                "pageable_bytes": self._current[_PAGEABLE],
                "peak_pageable_bytes": self._peak[_PAGEABLE],
            }

    def reset_peaks(self) -> None:
        """Peaks restart from the current figures (``torch.cuda.reset_peak_memory_stats``)."""
        with self._lock:
            self._peak = dict(self._current)
            if self._ledger is not None:
                self._ledger.reset_peak()
