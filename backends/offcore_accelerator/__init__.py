"""One device adapter for every torch accelerator module (``torch.cuda``, ``torch.npu``).

The CUDA and Ascend NPU backends (``offcore_cuda``, ``offcore_npu``) differ only in
which torch device module they drive, how they say whether it can run here, and a
few hardware details (how host memory is pinned, NPU private formats). Everything
else -- streams, events, the budgeted pinned pool, copies with explicit events,
memory statistics -- lives once, here, in :class:`TorchAcceleratorDevice`,
parametrised by the device module. Backends subclass it; they never import each
other (layering: ``offcore_cuda, offcore_npu -> offcore_accelerator -> offcore_layout -> offcore``; it sits in the
backends layer and imports no plugin).

This module imports torch only when a device is used, never at import time, so a
backend whose torch is missing or broken still imports and reports why.

    >>> import offcore
    >>> dev = offcore.device("cuda:0", host_budget="8GiB")        # doctest: +SKIP
    >>> copy_stream = dev.new_stream()                              # doctest: +SKIP
    >>> host = dev.allocate(x.nbytes, offcore.Tier.PINNED)          # doctest: +SKIP
    >>> done = dev.copy_(host, x, stream=copy_stream)               # doctest: +SKIP
    >>> done.synchronize()                                          # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import offcore_layout as layout

from offcore.errors import BackendUnavailableError, CapacityExceededError, ConfigurationError
from offcore.kinds import Tier
from offcore.pool import HostBuffer, HostBufferPool
from offcore.protocols import Availability, Capability, MemoryStats
from offcore.units import format_bytes, parse_size

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_DEVICE, _PAGEABLE, _PINNED = Tier.DEVICE, Tier.PAGEABLE, Tier.PINNED

__all__ = [
    "AcceleratorOptions",
    "PinnedHostPool",
    "PinnedSlots",
    "TorchAcceleratorDevice",
    "import_torch",
    "tensor_over",
    "default_host_budget",
    "power_of_two_ceil",
]

_DEFAULT_HOST_BUDGET_CAP = 8 * 1024**3


def import_torch() -> tuple[Any, str]:
    """``(torch, "")`` or ``(None, reason)``; never raises.

    ``import torch`` can fail with any exception, not only ImportError: torch's
    device-backend autoload imports every installed extension (torch_npu among
    them) and re-raises their failures as RuntimeError.
    """
    try:
        import torch
    except Exception as exc:
        hint = ""
        if "TORCH_DEVICE_BACKEND_AUTOLOAD" in str(exc) or "backend extension" in str(exc):
            hint = (
                " A torch device extension failed to load; on a machine without that device set "
                "TORCH_DEVICE_BACKEND_AUTOLOAD=0 (see docs/backends.md)."
            )
        return None, f"torch cannot be imported ({type(exc).__name__}: {exc}).{hint}"
    return torch, ""


def default_host_budget() -> int:
    """The default pinned-memory budget: a quarter of physical memory, at most 8 GiB."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _DEFAULT_HOST_BUDGET_CAP
    return max(64 * 1024**2, min(_DEFAULT_HOST_BUDGET_CAP, physical // 4))


# Note [Pinned buffers live as long as their storage]
# A buffer handed out by ``allocate(nbytes, Tier.PINNED)`` is a slice of a big pinned
# block. It must return to the pool when the *last* tensor using its memory dies --
# a typed view made from it (``buf.view(torch.float32)``) may outlive the raw buffer.
# A weakref on the returned tensor object would fire too early, so ``tensor_over``
# wraps the slice in a tensor with its *own* storage (``torch.from_numpy`` over an
# ``__array_interface__`` holder): the holder lives exactly as long as that storage,
# and its finalizer releases the slice. The same mechanism unregisters CUDA
# host-registered blocks (offcore_cuda) only after every view of them is gone.
# Buffers used by an in-flight copy must still be kept alive by the caller until the
# copy's event completed (see Note [When may a device copy be freed?] in offcore/objects.py).


class _AddressSpan:
    """An ``__array_interface__`` over raw memory; its lifetime is the wrapping storage's."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def _run_quietly(callback: Callable[[], None], _keepalive: Any) -> None:
    try:
        callback()
    except Exception:  # a finalizer must never raise (it may run in an allocator thread)
        pass


def tensor_over(address: int, nbytes: int, *, on_free: Callable[[], None], keepalive: Any = None) -> Any:
    """A 1-D ``uint8`` CPU tensor over ``nbytes`` at ``address`` with its own storage.

    ``on_free`` runs once that storage (and so every view of the tensor) is gone;
    ``keepalive`` stays referenced until then. See Note [Pinned buffers live as long
    as their storage].

        >>> import torch
        >>> backing = torch.zeros(64, dtype=torch.uint8)
        >>> freed = []
        >>> t = tensor_over(backing.data_ptr() + 8, 16, on_free=lambda: freed.append(1), keepalive=backing)
        >>> t[:] = 7
        >>> int(backing[8]), freed
        (7, [])
        >>> del t; freed
        [1]
    """
    import numpy as np
    import torch

    span = _AddressSpan(address, nbytes)
    finalizer = weakref.finalize(span, _run_quietly, on_free, keepalive)
    finalizer.atexit = False  # at interpreter exit the runtime may already be torn down
    return torch.from_numpy(np.asarray(span))


def power_of_two_ceil(nbytes: int) -> int:
    """The smallest power of two >= ``nbytes``: what a caching host allocator pins for it.

    >>> power_of_two_ceil(96 << 20) >> 20, power_of_two_ceil(64 << 20) >> 20
    (128, 64)
    """
    return 1 << max(0, (nbytes - 1).bit_length())


# Note [The pinned budget counts what is really pinned]
# PyTorch's caching host allocator (ATen's CachingHostAllocatorImpl::allocate, which
# torch.empty(..., pin_memory=True) reaches on CUDA, and which torch_npu's
# NPUCachingHostAllocatorImpl inherits) rounds every request up to a power of two
# (c10::llvm::PowerOf2Ceil; torch 2.13 skips the rounding only above
# pinned_max_round_threshold, unlimited by default). A 96 MiB pool block thus pins
# 128 MiB. The pool's budget would count 96, and a host_budget of 16 GiB could pin up
# to 32 GiB. So pinned pools count each block at its *footprint* (what the backend
# really pins for it: a power of two through the allocator, whole pages with
# cudaHostRegister), refuse a block whose footprint does not fit, and size the last
# block of the budget so that its footprint fits. Blocks of a power-of-two
# ``block_size`` (the default 64 MiB) cost nothing extra; a larger single buffer does,
# and that is what the budget now says.


class PinnedHostPool(HostBufferPool):
    """A :class:`offcore.HostBufferPool` whose budget counts the host memory really pinned.

    ``footprint(nbytes)`` is what the backend pins for a block of ``nbytes``;
    ``reserved_bytes`` is the sum of the footprints of the blocks held (Note [The pinned
    budget counts what is really pinned]).

        >>> import numpy as np
        >>> pool = PinnedHostPool(lambda n: np.zeros(n, np.uint8), footprint=power_of_two_ceil, budget=8 << 20,
        ...                       block_size=3 << 20)
        >>> buffer = pool.acquire(1000)
        >>> pool.reserved_bytes >> 20      # a 3 MiB block pins 4 MiB
        4
    """

    def __init__(
        self,
        allocate_block: Callable[[int], Any],
        *,
        footprint: Callable[[int], int],
        budget: int | str,
        block_size: int | str = "64MiB",
    ) -> None:
        self._footprint = footprint
        self._allocate_pinned = allocate_block
        self._overhead: dict[int, int] = {}  # id(block) -> footprint - size, while the block lives
        super().__init__(self._allocate_counted, budget=budget, block_size=block_size)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of host memory pinned for the blocks held (their footprints)."""
        return super().reserved_bytes + sum(list(self._overhead.values()))

    def _new_block_size(self, size: int) -> int | None:
        new_size = super()._new_block_size(size)
        if new_size is None:
            return None
        room = self.budget - self.reserved_bytes
        if self._footprint(new_size) <= room:
            return new_size
        # the largest block whose footprint still fits (footprints grow with the size)
        low, high = 0, room // self.alignment
        while low < high:
            middle = (low + high + 1) // 2
            if self._footprint(middle * self.alignment) <= room:
                low = middle
            else:
                high = middle - 1
        new_size = max(size, low * self.alignment)
        return new_size if self._footprint(new_size) <= room else None

    def _allocate_counted(self, nbytes: int) -> Any:
        real = self._footprint(nbytes)
        reserved = self.reserved_bytes
        if reserved + real > self.budget:
            raise CapacityExceededError(
                f"host pool budget exhausted: a block of {format_bytes(nbytes)} pins {format_bytes(real)} "
                f"(the host allocator rounds it up), {format_bytes(reserved)} of {format_bytes(self.budget)} "
                "already pinned. Raise the host budget or use a power-of-two block_size."
            )
        block = self._allocate_pinned(nbytes)
        if self._footprint(nbytes) != real:  # the backend changed how it pins (cuda: register -> allocator)
            real = self._footprint(nbytes)
            if reserved + real > self.budget:
                del block
                raise CapacityExceededError(
                    f"host pool budget exhausted: a block of {format_bytes(nbytes)} pins {format_bytes(real)}, "
                    f"{format_bytes(reserved)} of {format_bytes(self.budget)} already pinned"
                )
        if real > nbytes:
            key = id(block)
            self._overhead[key] = real - nbytes
            weakref.finalize(block, self._overhead.pop, key, None).atexit = False
        return block


class PinnedSlots:
    """The device's own pinned pool, made safe to release into from finalizers.

    A storage finalizer (Note [Pinned buffers live as long as their storage]) can run
    at any allocation -- the cyclic garbage collector may fire inside
    ``HostBufferPool.acquire`` while its lock is held by the same thread. So a
    finalizer never waits for a lock: it queues the slot, and the queue is drained
    by whoever next holds ``guard`` (every pool operation here ends with a drain).
    Staging buffers of copies still in flight are held here too, each with its event.
    """

    def __init__(self, pool: HostBufferPool) -> None:
        self.pool = pool
        self.guard = threading.Lock()
        self._returned: collections.deque[HostBuffer] = collections.deque()
        self._in_flight: collections.deque[tuple[Any, HostBuffer]] = collections.deque()

    def drain(self, *, blocking: bool = True) -> None:
        """Give queued slots back to the pool (skipped, not waited for, when ``blocking`` is False)."""
        if not self.guard.acquire(blocking=blocking):
            return
        try:
            self._give_back()
        finally:
            self.guard.release()

    def _give_back(self) -> None:
        while self._returned:
            self.pool.release(self._returned.popleft())

    def release_soon(self, slot: HostBuffer) -> None:
        """Return ``slot``; safe from a finalizer (never blocks)."""
        self._returned.append(slot)
        self.drain(blocking=False)

    def acquire(self, nbytes: int) -> HostBuffer:
        """An exact-size slot; first returns completed staging buffers if the pool is full."""
        with self.guard:
            self._give_back()
            try:
                slot = self.pool.acquire(nbytes)
            except CapacityExceededError:
                self._reap(all_done=False)
                slot = self.pool.acquire(nbytes)
        self.drain(blocking=False)
        return slot

    def release(self, slot: HostBuffer) -> None:
        with self.guard:
            self.pool.release(slot)
            self._give_back()

    def hold_until(self, event: Any, slot: HostBuffer) -> None:
        """Keep ``slot`` out of the pool until ``event`` has completed."""
        with self.guard:
            self._in_flight.append((event, slot))

    def reap(self, *, all_done: bool = False) -> None:
        """Return staging slots whose copies completed (all of them after a device synchronize)."""
        with self.guard:
            self._reap(all_done)
            self._give_back()

    def _reap(self, all_done: bool) -> None:
        pending: collections.deque[tuple[Any, HostBuffer]] = collections.deque()
        while self._in_flight:
            event, slot = self._in_flight.popleft()
            if all_done or event.query():
                self.pool.release(slot)
            else:
                pending.append((event, slot))
        self._in_flight = pending

    def trim(self) -> int:
        with self.guard:
            self._give_back()
            return self.pool.trim()


# Note [Which pinned block holds an address]
# Every copy asks whether its host side is pinned (a pageable one is staged through a pinned slot).
# The adapter knows its own pinned blocks (runtimes differ on a pointer inside one), one range per
# live block: 64 MiB blocks, so a 100 GiB host budget is ~1,600 of them. A scan of them per copy
# made each copy's host cost grow with the host memory in use; the starts are kept sorted and the
# block that may hold an address is found by bisection. Readers take no lock: writers (a new block,
# a block's finalizer, which may run on any thread, even inside a writer through the garbage
# collector) rebuild the sorted starts from a copy of the ranges and swap the list in whole, under
# a re-entrant lock, so a reader sees the old list or the new one. A start whose range is gone by
# the time it is read answers "not one of ours", and ``Tensor.is_pinned()`` is asked instead:
# never pinned when it is not.
class PinnedRanges:
    """The address ranges of live pinned blocks; :meth:`holds` finds the one an address falls in (bisection).

    >>> ranges = PinnedRanges()
    >>> ranges.add(4096, 8192)
    >>> ranges.holds(5000), ranges.holds(8192), len(ranges)
    (True, False, 1)
    >>> ranges.discard(4096); len(ranges)
    0
    """

    def __init__(self) -> None:
        self._ends: dict[int, int] = {}  # start -> end (exclusive)
        self._starts: list[int] = []  # sorted; replaced whole, never changed in place
        self._lock = threading.RLock()

    def add(self, start: int, end: int) -> None:
        with self._lock:
            self._ends[start] = end
            self._starts = sorted(self._ends.copy())

    def discard(self, start: int) -> None:
        with self._lock:
            if self._ends.pop(start, None) is not None:
                self._starts = sorted(self._ends.copy())

    def holds(self, address: int) -> bool:
        starts = self._starts
        i = bisect.bisect_right(starts, address) - 1
        if i < 0:
            return False
        end = self._ends.get(starts[i])
        return end is not None and address < end

    def __len__(self) -> int:
        return len(self._ends)


@dataclass(frozen=True)
class AcceleratorOptions:
    """The checked keyword options of a torch accelerator device.

    ``host_budget``: bytes of pinned host memory the device's own pool may hold
    (``allocate(..., Tier.PINNED)`` and staging of pageable copies).
    ``block_size``: size of the pinned blocks that pool carves exact-size buffers from.
    ``capacity``: cap device memory below the hardware total; enforced with the
    device module's ``set_per_process_memory_fraction`` so exceeding it raises
    ``torch.OutOfMemoryError``, as on the fake device. ``None``: the whole device.
    ``stage_pageable``: copy a pageable host side through a pinned staging buffer.
    """

    host_budget: int
    block_size: int
    capacity: int | None
    stage_pageable: bool

    KNOWN: ClassVar[tuple[str, ...]] = ("host_budget", "block_size", "capacity", "stage_pageable")

    @classmethod
    def parse(
        cls,
        backend: str,
        *,
        host_budget: int | str | None = None,
        block_size: int | str = "64MiB",
        capacity: int | str | None = None,
        stage_pageable: bool = True,
        extra_known: tuple[str, ...] = (),
        **unknown: Any,
    ) -> AcceleratorOptions:
        """Check every option; raises :class:`offcore.ConfigurationError` naming the bad one."""
        if unknown:
            known = ", ".join((*cls.KNOWN, *extra_known))
            hint = ""
            fake_only = {"h2d_bandwidth", "d2h_bandwidth", "latency", "duplex", "sanitize", "jitter", "buffers", "seed"}
            if fake_only & set(unknown):
                hint = " (bandwidth, latency and sanitizer settings belong to the cpu fake device; a real device is measured)"
            raise ConfigurationError(
                f"unknown option(s) {sorted(unknown)} for the {backend} backend{hint}; known: {known}"
            )
        if not isinstance(stage_pageable, bool):
            raise ConfigurationError(f"stage_pageable must be True or False, got {stage_pageable!r}")
        budget = default_host_budget() if host_budget is None else parse_size(host_budget, what="host_budget")
        block = parse_size(block_size, what="block_size")
        cap = None if capacity is None else parse_size(capacity, what="capacity")
        return cls(host_budget=budget, block_size=block, capacity=cap, stage_pageable=stage_pageable)


def check_index(backend: str, index: Any) -> int:
    """A device index: a non-negative int (``cuda:1`` -> 1)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigurationError(
            f"{backend} device index must be a non-negative integer (e.g. '{backend}:1'), got {index!r}"
        )
    return index


class TorchAcceleratorDevice:
    """A :class:`offcore.Backend` over one torch accelerator device module.

    Subclasses set ``name``, ``device_type``, ``capabilities`` and ``hardware`` and
    implement :meth:`device_module` (``torch.cuda``, ``torch.npu``) and :meth:`_probe`.

    Copies (``copy_``) run ``dst.copy_(src, non_blocking=True)`` inside the device
    module's stream context and return an event recorded right after, never
    ``record_stream``. A pageable host side is staged through a pinned buffer when
    ``stage_pageable`` (the default) and the pool has room: host-to-device stays
    asynchronous; device-to-pageable-host blocks the calling thread until the copy
    landed (the event returned has completed). Without room, the copy runs directly,
    which the runtime makes synchronous -- correct, never silently racy.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    capabilities: frozenset[Capability] = frozenset(
        {Capability.TORCH, Capability.PINNED_MEMORY, Capability.EVENT_TIMING}
    )
    extra_options: ClassVar[tuple[str, ...]] = ()
    hardware: ClassVar[str] = "the device"
    """How availability messages name the hardware (``"CUDA"``, ``"the Ascend NPU"``)."""

    # ----------------------------------------------------------------- subclass API
    @classmethod
    def device_module(cls) -> Any:
        """The torch device module driven by this backend (``torch.cuda``, ``torch.npu``)."""
        raise NotImplementedError

    @classmethod
    def _probe(cls) -> Availability:
        """Whether this backend can run here, and if not, why (may raise: see availability)."""
        raise NotImplementedError

    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here, and if not, why; never raises."""
        try:
            return cls._probe()
        except Exception as exc:
            return Availability(False, f"probing {cls.hardware} raised {type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------- construction
    def __init__(self, index: int = 0, **options: Any) -> None:
        extra = {k: options.pop(k) for k in self.extra_options if k in options}
        self.options = AcceleratorOptions.parse(self.name, extra_known=self.extra_options, **options)
        self.index = check_index(self.name, index)
        self._configure(**extra)
        status = type(self).availability()
        if not status.available:
            raise BackendUnavailableError(f"backend {self.name!r} is unavailable: {status.reason}")
        if index >= status.device_count:
            raise ConfigurationError(
                f"{self.name}:{index}: this machine has {status.device_count} {self.name} device(s), "
                f"indices 0..{status.device_count - 1}"
            )
        self._setup()

    def _configure(self, **extra: Any) -> None:
        """Check backend-specific options (before any device call)."""

    def _setup(self) -> None:
        import torch

        self._torch = torch
        self._mod = type(self).device_module()
        total = int(self._mod.get_device_properties(self.index).total_memory)
        self.total_memory = total
        cap = self.options.capacity
        self._restore_fraction: Callable[[], Any] | None = None
        if cap is not None:
            if cap > total:
                raise ConfigurationError(
                    f"capacity {format_bytes(cap)} exceeds {self.name}:{self.index}'s memory ({format_bytes(total)}); "
                    "pass a smaller capacity or none to use the whole device"
                )
            self._restore_fraction = self._cap_memory(cap / total)
        self.capacity = cap if cap is not None else total
        self._device_contexts: list[Any] = []
        self.staged_copies = 0
        self.direct_pageable_copies = 0
        self._pinned_ranges = PinnedRanges()  # every live pinned block (Note [Which pinned block holds an address])
        self.pinned_pool = self.host_pool(self.options.host_budget, pinned=True)
        self._slots = PinnedSlots(self.pinned_pool)

    def _cap_memory(self, fraction: float) -> Callable[[], Any]:
        """Limit the caching allocator to ``fraction`` of the device; returns the undo.

        The limit is per process and device, so the previous fraction comes back when
        this device object is closed or garbage-collected.
        """
        mod, index = self._mod, self.index
        getter = getattr(mod, "get_per_process_memory_fraction", None)
        previous = float(getter(index)) if getter is not None else 1.0
        mod.set_per_process_memory_fraction(float(fraction), index)
        undo = weakref.finalize(self, mod.set_per_process_memory_fraction, previous, index)
        undo.atexit = False
        return undo

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, capacity={format_bytes(self.capacity)})"

    # ------------------------------------------------------------------ properties
    @property
    def torch_device(self) -> Any:
        """Where the model goes: ``torch.device("<type>", index)``."""
        return self._torch.device(self.device_type, self.index)

    @property
    def block_size(self) -> int:
        return self.options.block_size

    # ------------------------------------------------------------ streams, events
    def current_stream(self) -> Any:
        """The stream compute is enqueued on now (read at each call, never cached)."""
        return self._mod.current_stream(self.index)

    def new_stream(self, *, priority: int = 0) -> Any:
        """A new stream on this device (lower priority numbers run first)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigurationError(f"stream priority must be an integer, got {priority!r}")
        return self._mod.Stream(device=self.index, priority=priority)

    def new_event(self, *, enable_timing: bool = False) -> Any:
        """A new, unrecorded event."""
        return self._mod.Event(enable_timing=bool(enable_timing))

    def synchronize(self) -> None:
        """Block until all work on this device has completed; returns staging buffers."""
        self._mod.synchronize(self.index)
        self._slots.reap(all_done=True)

    def __enter__(self) -> TorchAcceleratorDevice:
        context = self._mod.device(self.index)
        context.__enter__()
        self._device_contexts.append(context)
        return self

    def __exit__(self, *exc: object) -> None:
        context = self._device_contexts.pop()
        context.__exit__(*exc)

    # ---------------------------------------------------------------- host memory
    def _allocate_pinned_block(self, nbytes: int) -> Any:
        """One pinned ``uint8`` host block of at least ``nbytes`` (override to pin differently)."""
        try:
            block = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise CapacityExceededError(
                f"pinning {format_bytes(nbytes)} of host memory failed ({exc}); lower host_budget or block_size"
            ) from exc
        if not block.is_pinned():
            raise BackendUnavailableError(
                f"torch.empty(..., pin_memory=True) returned pageable memory on this {self.name} build; "
                "asynchronous copies need pinned host memory"
            )
        return block

    def _tracked_pinned_block(self, nbytes: int) -> Any:
        """A pinned block whose address range ``_is_pinned`` recognises while the pool holds it.

        Runtimes differ in how ``Tensor.is_pinned()`` treats a pointer *inside* a pinned
        block (torch_npu looks up the storage's base pointer), so the adapter also knows
        its own blocks. A range is forgotten when the block tensor the pool holds dies;
        views that outlive it are then merely staged again (never treated as pinned
        when they are not).
        """
        block = self._allocate_pinned_block(nbytes)
        start = block.data_ptr()
        ranges = self._pinned_ranges
        ranges.add(start, start + block.numel())
        weakref.finalize(block, ranges.discard, start).atexit = False
        return block

    def _pinned_footprint(self, nbytes: int) -> int:
        """Host bytes really pinned for a block of ``nbytes`` (override with ``_allocate_pinned_block``).

        ``torch.empty(..., pin_memory=True)`` goes through the caching host allocator,
        which rounds up to a power of two (Note [The pinned budget counts what is really pinned]).
        """
        return power_of_two_ceil(nbytes)

    def _allocate_pageable_block(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)

    def host_pool(self, budget: int | str, *, pinned: bool = True) -> HostBufferPool:
        """A new budgeted, reusable, exact-size host pool whose blocks are (pinned) tensors.

        >>> pool = dev.host_pool("2GiB")                  # doctest: +SKIP
        >>> buf = pool.acquire(x.nbytes)                  # doctest: +SKIP
        >>> done = dev.copy_(buf.view, x, stream=s)       # doctest: +SKIP
        >>> done.synchronize(); pool.release(buf)         # doctest: +SKIP
        """
        if not pinned:
            return HostBufferPool(self._allocate_pageable_block, budget=budget, block_size=self.options.block_size)
        # blocks as large as what pinning them costs anyway (64 MiB stays 64 MiB, 96 MiB becomes 128 MiB)
        block_size = self._pinned_footprint(self.options.block_size)
        return PinnedHostPool(
            self._tracked_pinned_block, footprint=self._pinned_footprint, budget=budget, block_size=block_size
        )

    def allocate(self, nbytes: int, tier: Tier) -> Any:
        """A raw ``uint8`` buffer of exactly ``nbytes`` on ``tier``.

        ``Tier.DEVICE``: a device tensor from the caching allocator. ``Tier.PINNED``: a
        slice of the device's pinned pool (``host_budget``), returned to it when the
        last tensor using it dies (Note [Pinned buffers live as long as their storage]).
        ``Tier.PAGEABLE``: an ordinary CPU tensor.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigurationError(f"allocate needs a positive number of bytes, got {nbytes!r}")
        if type(tier) is not Tier:  # a member as it is (Tier() of one is a Python-level call per allocation)
            tier = Tier(tier)
        if tier is _DEVICE:
            return self._allocate_device(nbytes)
        if tier is _PAGEABLE:
            return self._torch.empty(nbytes, dtype=self._torch.uint8)
        if tier is _PINNED:
            slots = self._slots
            slot = slots.acquire(nbytes)
            return tensor_over(slot.view.data_ptr(), nbytes, on_free=lambda: slots.release_soon(slot), keepalive=slot)
        raise ConfigurationError(
            f"the {self.name} backend allocates device, pinned or pageable buffers, not {tier.value!r}; "
            "NVMe is not a device backend's tier (an NVMe tier in offcore's core is planned, not built yet)"
        )

    def _empty_device(self, nbytes: int) -> Any:
        """``nbytes`` of uninitialised device memory from the caching allocator, as ``uint8``."""
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.torch_device)

    def _allocate_device(self, nbytes: int) -> Any:
        torch = self._torch
        try:
            return self._empty_device(nbytes)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # some runtimes report a full device as a plain RuntimeError
            if "out of memory" not in str(exc).lower():
                raise
            raise torch.OutOfMemoryError(
                f"{self.name}:{self.index} out of memory allocating {format_bytes(nbytes)} "
                f"(capacity {format_bytes(self.capacity)}): {exc}"
            ) from exc

    def holds(self, buffer: Any) -> bool:
        """True when ``buffer`` is a tensor in this device's memory (that offcore may move).

        A backend may answer False for a device tensor it must not move (the NPU's private
        formats, see offcore_npu); its own copies still accept it (:meth:`_resident`).
        """
        return self._resident(buffer)

    def _resident(self, buffer: Any) -> bool:
        """True when ``buffer`` is a tensor in this device's memory."""
        device = getattr(buffer, "device", None)
        return device is not None and device.type == self.device_type and device.index == self.index

    def _is_pinned(self, tensor: Any) -> bool:
        if self._pinned_ranges.holds(tensor.data_ptr()):
            return True
        return bool(tensor.is_pinned())

    # ----------------------------------------------------------------------- copy
    def _side(self, tensor: Any, role: str) -> str:
        if not isinstance(tensor, self._torch.Tensor):
            raise ConfigurationError(
                f"the {self.name} backend copies torch tensors; {role} is a {type(tensor).__name__}"
            )
        problem = layout.plain_tensor_problem(tensor)
        if problem is not None:  # Note [Raw pointers see checked tensors only]
            raise ConfigurationError(
                f"the {self.name} backend cannot copy {role} ({layout.describe(tensor)}): {problem}. Copy plain dense "
                "tensors (a DTensor's to_local() shard)"
            )
        if self._resident(tensor):
            return "device"
        if tensor.device.type == "cpu":
            return "host"
        raise ConfigurationError(
            f"{role} is on {tensor.device}, but this is {self.name}:{self.index}; "
            f"copy between host memory and {self.name}:{self.index} only (use that device's own backend object)"
        )

    def copy_(self, dst: Any, src: Any, *, stream: Any, start_event: Any = None) -> Any:
        """Enqueue ``dst[...] = src`` on ``stream``; return an event that completes when it landed.

        The bytes of ``src`` land in ``dst`` unchanged: when dtypes or shapes differ
        (a raw ``uint8`` host buffer and a typed tensor) the contiguous side is
        reinterpreted, never converted. The caller orders ``stream`` after the
        producer of ``src`` and keeps both tensors alive until the event completes.
        ``start_event`` is recorded on ``stream`` right before the transfer itself (after
        the checks and any staging memcpy), so it times the transfer alone.
        """
        if stream is None:
            raise ConfigurationError("copy_ needs the stream to enqueue on (e.g. dev.new_stream())")
        dst_side, src_side = self._side(dst, "dst"), self._side(src, "src")
        dst, src = match_layout(dst, src)
        self._slots.reap()
        if dst_side == "host" and src_side == "host":
            stream.synchronize()  # the source may be the target of earlier work on this stream
            if start_event is not None:
                start_event.record(stream)
            dst.copy_(src)
            return self._record(stream)
        if dst_side == "device" and src_side == "host" and not self._is_pinned(src):
            return self._copy_from_pageable(dst, src, stream, start_event)
        if dst_side == "host" and src_side == "device" and not self._is_pinned(dst):
            return self._copy_to_pageable(dst, src, stream, start_event)
        return self._copy_async(dst, src, stream, start_event)

    # Note [A batch of pinned copies records one event]
    # Each copy_ records an event on its stream, and enters the stream's context: host work per copy
    # that a batch of small copies (a group of small saved storages, offcore_torch's Note [Small
    # storages are offloaded in groups]) pays for every member. copy_many enqueues a batch whose
    # pairs are all pinned host <-> device under one stream context and records one event after the
    # last: the copies run in order on the stream, so that event completes after all of them. A batch
    # with any other pair (pageable, host to host, device to device) is copy_ per pair, in order: each
    # of those has its own handling (staging, a synchronize), and the last copy's event is returned.
    def copy_many(self, pairs: Sequence[tuple[Any, Any]], *, stream: Any) -> Any:
        """Enqueue ``dst[...] = src`` for each ``(dst, src)`` of ``pairs``, in order, on ``stream``; the returned
        event completes when the last one landed (Note [A batch of pinned copies records one event]).

            >>> done = dev.copy_many([(weight, host_w), (bias, host_b)], stream=h2d)   # doctest: +SKIP
        """
        if stream is None:
            raise ConfigurationError("copy_many needs the stream to enqueue on (e.g. dev.new_stream())")
        if not pairs:
            raise ConfigurationError("copy_many needs at least one (dst, src) pair")
        matched = []
        for dst, src in pairs:
            sides = (self._side(dst, "dst"), self._side(src, "src"))
            if sides == ("device", "host"):
                pinned = self._is_pinned(src)
            elif sides == ("host", "device"):
                pinned = self._is_pinned(dst)
            else:
                pinned = False
            if not pinned:  # a pair copy_ handles its own way: every pair through it, in order
                event: Any = None
                for each_dst, each_src in pairs:
                    event = self.copy_(each_dst, each_src, stream=stream)
                return event
            matched.append(match_layout(dst, src))
        self._slots.reap()
        with self._mod.stream(stream):
            for dst, src in matched:
                dst.copy_(src, non_blocking=True)
        return self._record(stream)

    def _record(self, stream: Any) -> Any:
        event = self._mod.Event()
        event.record(stream)
        return event

    def _copy_async(self, dst: Any, src: Any, stream: Any, start_event: Any = None) -> Any:
        with self._mod.stream(stream):
            if start_event is not None:
                start_event.record(stream)
            dst.copy_(src, non_blocking=True)
        return self._record(stream)

    def _staging_buffer(self, nbytes: int) -> HostBuffer | None:
        if not self.options.stage_pageable:
            return None
        try:
            return self._slots.acquire(nbytes)
        except CapacityExceededError:
            return None

    def _copy_from_pageable(self, dst: Any, src: Any, stream: Any, start_event: Any = None) -> Any:
        staging = self._staging_buffer(src.numel() * src.element_size())
        if staging is None:
            self.direct_pageable_copies += 1
            return self._copy_async(dst, src, stream, start_event)
        pinned = typed_view(staging.view, src.dtype, src.shape)
        pinned.copy_(src)  # host memcpy; the slot is ours until the H2D below completes
        event = self._copy_async(dst, pinned, stream, start_event)
        self._slots.hold_until(event, staging)
        self.staged_copies += 1
        return event

    def _copy_to_pageable(self, dst: Any, src: Any, stream: Any, start_event: Any = None) -> Any:
        staging = self._staging_buffer(src.numel() * src.element_size())
        if staging is None:
            self.direct_pageable_copies += 1
            event = self._copy_async(dst, src, stream, start_event)
            event.synchronize()
            return event
        pinned = typed_view(staging.view, src.dtype, src.shape)
        event = self._copy_async(pinned, src, stream, start_event)
        event.synchronize()  # the bytes must be in the staging buffer before the host copies them on
        dst.copy_(pinned)
        self._slots.release(staging)
        self.staged_copies += 1
        return event

    # ---------------------------------------------------------------------- stats
    def memory_stats(self) -> MemoryStats:
        """Device memory in bytes from the device module, plus the pinned pool's figures.

        ``allocated_bytes`` / ``peak_allocated_bytes``: the caching allocator's
        ``allocated_bytes.all.current`` / ``.peak``; ``reserved_bytes``: its reservation;
        ``free_bytes``: what may still be allocated within ``capacity``. The allocator's
        statistics are read once per call (Note [One read of the allocator statistics]).
        """
        mod, index = self._mod, self.index
        self._slots.drain(blocking=False)
        allocated, peak, reserved, peak_reserved = self._allocator_figures()
        stats = MemoryStats(
            allocated_bytes=allocated,
            peak_allocated_bytes=peak,
            capacity_bytes=int(self.capacity),
            total_bytes=int(self.total_memory),
            reserved_bytes=reserved,
            peak_reserved_bytes=peak_reserved,
            pinned_used_bytes=self.pinned_pool.used_bytes,
            pinned_peak_used_bytes=self.pinned_pool.peak_used_bytes,
            pinned_reserved_bytes=self.pinned_pool.reserved_bytes,
            pinned_budget_bytes=self.pinned_pool.budget,
        )
        try:
            device_free, _ = mod.mem_get_info(index)
        except Exception:  # older runtimes without mem_get_info: derive from the reservation
            device_free = self.total_memory - reserved
        stats["device_free_bytes"] = int(device_free)
        stats["free_bytes"] = int(max(0, min(device_free, self.capacity - reserved)))
        return stats

    # Note [One read of the allocator statistics]
    # torch.cuda.memory_allocated, max_memory_allocated, memory_reserved and
    # max_memory_reserved each call memory_stats(), which asks the allocator for its
    # whole statistics dict, flattens it and sorts it (torch/cuda/memory.py; torch_npu's
    # torch_npu/npu/memory.py is the same code), so four figures cost four full
    # rebuilds -- and the watermark policy asks for memory_stats() at every saved
    # tensor. The adapter reads the statistics once: ``memory_stats_as_nested_dict``
    # where the module has it (the dict before flattening and sorting), else
    # ``memory_stats``, and takes the four figures from the same keys torch's helpers
    # read ("allocated_bytes.all.current", "allocated_bytes.all.peak",
    # "reserved_bytes.all.current", "reserved_bytes.all.peak"); a missing key counts 0,
    # as in torch (an allocator not yet initialised reports {}).

    def _allocator_figures(self) -> tuple[int, int, int, int]:
        """(allocated, peak allocated, reserved, peak reserved) bytes from one statistics read."""
        mod, index = self._mod, self.index
        nested = getattr(mod, "memory_stats_as_nested_dict", None)
        if nested is not None:
            raw = nested(index)
            allocated = raw.get("allocated_bytes", {}).get("all", {})
            reserved = raw.get("reserved_bytes", {}).get("all", {})
            return (
                int(allocated.get("current", 0)),
                int(allocated.get("peak", 0)),
                int(reserved.get("current", 0)),
                int(reserved.get("peak", 0)),
            )
        flat = mod.memory_stats(index)
        return (
            int(flat.get("allocated_bytes.all.current", 0)),
            int(flat.get("allocated_bytes.all.peak", 0)),
            int(flat.get("reserved_bytes.all.current", 0)),
            int(flat.get("reserved_bytes.all.peak", 0)),
        )

    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking (device allocator and pinned pool) from the current level."""
        self._mod.reset_peak_memory_stats(self.index)
        self.pinned_pool.peak_used_bytes = self.pinned_pool.used_bytes

    def close(self) -> None:
        """Wait for outstanding copies, free idle pinned blocks, lift the capacity cap."""
        self.synchronize()
        self._slots.trim()
        if self._restore_fraction is not None:
            self._restore_fraction()
            self._restore_fraction = None

    # ------------------------------------------------------------- formats (NPU)
    def format_of(self, tensor: Any) -> int | None:
        """The device-private memory format of ``tensor``, or None (no private formats here)."""
        return None

    def restore_format(self, tensor: Any, fmt: int | None) -> Any:
        """``tensor`` in private format ``fmt`` (a no-op on backends without private formats)."""
        return tensor


def typed_view(raw: Any, dtype: Any, shape: Any) -> Any:
    """The first bytes of a contiguous raw ``uint8`` tensor viewed as ``dtype`` of ``shape``."""
    return layout.typed_prefix(raw, dtype, shape)


def match_layout(dst: Any, src: Any) -> tuple[Any, Any]:
    """``(dst, src)`` with equal dtype and shape, reinterpreting the bytes of a contiguous side.

    The rule every backend shares (:func:`offcore_layout.match_layout`), for torch tensors.

    >>> import torch
    >>> raw = torch.zeros(8, dtype=torch.uint8)
    >>> d, s = match_layout(raw, torch.tensor([1.5, -2.0], dtype=torch.float32))
    >>> d.dtype, tuple(d.shape)
    (torch.float32, (2,))
    """
    return layout.match_layout(dst, src, layout.TORCH)
