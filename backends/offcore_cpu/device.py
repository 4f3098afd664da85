"""The CPU fake device: an emulated accelerator on the host, implementing offcore's Backend.

    >>> import numpy as np, offcore
    >>> dev = offcore.device("cpu", capacity="64MiB", h2d_bandwidth="8GiB/s", buffers="numpy")
    >>> stream = dev.new_stream()
    >>> on_device = dev.allocate(1024, offcore.Tier.DEVICE)
    >>> on_device[:] = 3
    >>> host = dev.allocate(1024, offcore.Tier.PINNED)
    >>> done = dev.copy_(host, on_device, stream=stream)      # D2H on the copy stream
    >>> done.synchronize(); int(host.sum())
    3072
    >>> dev.memory_stats().allocated_bytes
    1024
    >>> dev.close()

The pieces, one module each: :mod:`~offcore_cpu.options` (settings),
:mod:`~offcore_cpu.arena` (byte accounting), :mod:`~offcore_cpu.tracking` (torch
tensors created while active), :mod:`~offcore_cpu.streams` (streams, events, worker
threads), :mod:`~offcore_cpu.link` (bandwidth and latency), :mod:`~offcore_cpu.sanitizer`
and :mod:`~offcore_cpu.host_pool`; :mod:`~offcore_cpu.gates` holds streams and copies for tests.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from offcore.errors import ConfigurationError
from offcore.kinds import Direction, Tier
from offcore.ledger import Ledger
from offcore.protocols import Availability, Capability, MemoryStats
from offcore.units import format_bandwidth, format_bytes, parse_size
from offcore_cpu.arena import MemoryArena
from offcore_cpu.buffers import NUMPY_OPS, BufferOps, describe, ops_for
from offcore_cpu.copying import Copies
from offcore_cpu.errors import SanitizerViolation
from offcore_cpu.gates import Gate, GateSet
from offcore_cpu.host_pool import FakeHostBufferPool, PoisoningHostBufferPool
from offcore_cpu.link import Link
from offcore_cpu.options import FakeDeviceOptions, FaultMode, numpy_importable
from offcore_cpu.sanitizer import Ordering, Sanitizer
from offcore_cpu.streams import ComputeStream, FakeEvent, WorkerStream

# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_DEVICE, _NVME, _PAGEABLE, _PINNED = Tier.DEVICE, Tier.NVME, Tier.PAGEABLE, Tier.PINNED

__all__ = ["FakeDevice"]

_NOTHING = contextlib.nullcontext()


class _OpCheckHold:
    """A device's hold of its creating thread's operator-checking mode, dropped once, on that thread."""

    __slots__ = ("_module", "_thread")

    def __init__(self, module: Any) -> None:
        self._module: Any = module
        self._thread = threading.get_ident()

    def drop(self) -> None:
        if self._module is not None and threading.get_ident() == self._thread:
            module, self._module = self._module, None
            module.release()


def _close_streams(streams: weakref.WeakSet[WorkerStream], op_check: _OpCheckHold | None = None) -> None:
    for stream in list(streams):
        stream.close()
    if op_check is not None:
        op_check.drop()


class FakeDevice(Copies):
    """An emulated accelerator: capacity-limited memory, copy streams, a bandwidth-limited link.

    Create it with ``offcore.device("cpu", **options)``:

    - ``capacity`` (``"2GiB"``): device memory; exceeding it raises
      :class:`~offcore_cpu.errors.FakeDeviceOutOfMemoryError` (with torch buffers also a
      ``torch.OutOfMemoryError``).
    - ``h2d_bandwidth`` / ``d2h_bandwidth`` (``"32GiB/s"``, ``"inf"`` for unlimited) and
      ``latency`` (``"10us"``) per copy; ``duplex`` (True): each direction has its own link.
    - ``sanitize`` (False), ``seed`` (0), ``jitter`` (``"2ms"``): see :mod:`offcore_cpu.sanitizer`
      (poison, jitter, use-after-free checks; :meth:`sanitizer_violations`, :meth:`check_sanitizer`).
      ``check_ops`` (True): with ``sanitize`` and torch buffers, torch operators the host runs are
      checked against the copies in flight (Note [Operators checked against copies in flight]).
    - ``buffers``: ``"torch"`` (default when torch is installed) or ``"numpy"``.
    - ``fail_copy`` (None) and ``fail_copy_mode`` (``"submit"``): fault injection, the
      ``fail_copy``-th ``copy_`` call fails (Note [Injected copy faults]; re-arm with
      :meth:`inject_copy_fault`).
    - ``copy_log_limit`` (4096): :meth:`copy_log` keeps the latest this many copies (0: none).

    ``with dev:`` makes it the active device; with torch buffers every tensor created
    on the calling thread is then counted as device memory (Note [Counting device
    memory with storages]).
    """

    name: ClassVar[str] = "cpu"

    def __init__(self, index: int = 0, **options: Any) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or index != 0:
            raise ConfigurationError(f"the cpu fake device has one device, index 0; got {index!r}")
        self.options = FakeDeviceOptions.parse(**options)
        self.index = index
        self.ledger = Ledger()
        self._label = f"{self.name}:{index}"
        self._link = Link(
            h2d_bandwidth=self.options.h2d_bandwidth,
            d2h_bandwidth=self.options.d2h_bandwidth,
            latency=self.options.latency,
            duplex=self.options.duplex,
        )
        self._sanitizer = Sanitizer(
            enabled=self.options.sanitize,
            seed=self.options.seed,
            jitter=self.options.jitter,
            check_ops=self.options.check_ops and self.options.buffers == "torch",
        )
        self._compute = ComputeStream()
        if self.options.sanitize:  # Note [Copies ordered by the program] in sanitizer.py
            self._compute.order = Ordering()
        self._streams: weakref.WeakSet[WorkerStream] = weakref.WeakSet()
        self._gates = GateSet()  # Note [Gates] in gates.py
        # (stream, direction, bytes, enqueued, start, end, jitter, number, src, dst) per copy: a ring of tuples, so
        # a long run keeps the latest copy_log_limit of them (about 200 bytes each), never more
        self._copy_log: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=self.options.copy_log_limit)
        self._local = threading.local()  # .depth of `with dev:` on this thread
        # Note [Injected copy faults]: copy_ calls so far, and the armed fault
        # (the number of the copy that fails, its mode, what armed it)
        self._fault_lock = threading.Lock()
        self._copies = 0
        self._fault: tuple[int, FaultMode, str] | None = None
        self._fault_at = 0  # the armed fault's copy number, 0 when none is armed (read first by the fast path)
        if self.options.fail_copy is not None:
            self._arm((self.options.fail_copy, self.options.fail_copy_mode, f"fail_copy={self.options.fail_copy}"))
        self._ops: BufferOps = NUMPY_OPS
        self._tensor_type: type | None = None  # torch.Tensor with torch buffers (holds: its own family, no lookup)
        self._tracker: Any = None
        if self.options.buffers == "torch":  # torch is imported here, never for numpy buffers
            import torch

            from offcore_cpu.torch_buffers import TORCH_OPS
            from offcore_cpu.torch_errors import TorchFakeDeviceOutOfMemoryError
            from offcore_cpu.tracking import StorageTracker

            self._ops, self._tensor_type = TORCH_OPS, torch.Tensor
            self._arena = MemoryArena(self._label, self.options.capacity, error_class=TorchFakeDeviceOutOfMemoryError)
            self._tracker = StorageTracker(
                self._arena, poison_uninitialised=self.options.sanitize, accounting=self.options.accounting
            )
        else:
            self._arena = MemoryArena(self._label, self.options.capacity)
        capabilities = {Capability.NUMPY, Capability.EVENT_TIMING, Capability.PINNED_MEMORY}
        if self.options.buffers == "torch":
            capabilities.add(Capability.TORCH)
        if self.options.duplex:
            capabilities.add(Capability.DUPLEX_COPY)
        if self.options.sanitize:
            capabilities.add(Capability.SANITIZER)
        self.capabilities: frozenset[Capability] = frozenset(capabilities)
        # Note [One checking mode per thread, at the bottom of its stack] (op_check.py)
        self._op_check: _OpCheckHold | None = None
        if self._sanitizer.check_ops:
            from offcore_cpu import op_check

            self._op_check = _OpCheckHold(op_check) if op_check.acquire(at_creation=True) else None
        self._finalizer = weakref.finalize(self, _close_streams, self._streams, self._op_check)
        self._closed = False
        # Note [The small copy's fast path] in copying.py: the pair check it asks first
        self._small_pair: Callable[[Any, Any], tuple[int, int, int, int] | None] | None = None
        if self.options.buffers == "torch" and not self.options.sanitize:
            from offcore_cpu.torch_buffers import memmove_holding_gil, small_pair_checker

            hook = self._tracker.hook  # None with the dispatch accounting: the checks in Python
            self._small_pair = small_pair_checker(
                self._on_device_storage, None if hook is None else hook.small_pair, self._tracker.ledger
            )
            self._memmove = memmove_holding_gil if hook is None else hook.move_bytes
        self._reserve = self._link.reserver  # Note [A direction's route is built once] (link.py)
        # allocate's device buffers counted by the hook (torch buffers, no sanitizer): asked first
        self._hooked_empty: Callable[[int], Any] | None = None
        if self._tracker is not None and self._ops is not NUMPY_OPS and not self.options.sanitize:
            self._hooked_empty = self._tracker.hooked_empty

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: copies and new streams are refused (Note [A closed device says so])."""
        return self._closed

    def _check_open(self, what: str) -> None:
        # Note [A closed device says so]: a copy on a closed device failed in its stream's submit, naming the
        # binding's internal stream ("create a new one with dev.new_stream()"), after the sanitizer had
        # recorded it (a record per copy that never went away)
        if self._closed:
            raise ConfigurationError(
                f"{what} on fake device {self._label}, which is closed (dev.close() ran): make a new device with "
                "offcore.device('cpu', ...) and new bindings on it"
            )

    # -- registry ------------------------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        """Available wherever numpy imports (torch is optional); one device."""
        if not numpy_importable():
            return Availability(False, "numpy is not installed: pip install numpy", 0)
        return Availability(True, "", 1)

    @property
    def capacity(self) -> int:
        """Device memory in bytes."""
        return self.options.capacity

    @property
    def torch_device(self) -> Any:
        """Where models and tensors go: ``torch.device("cpu")`` (the fake device's memory is host memory)."""
        import torch

        return torch.device("cpu")

    @property
    def accounting(self) -> str | None:
        """How tensors are counted inside ``with dev:``: ``"allocator"`` (torch's CPU allocator hooked),
        ``"dispatch"`` (a Python dispatch mode: the reference), None with numpy buffers (nothing to count).
        See Note [Counting device memory with allocations] in ``offcore_cpu/tracking.py``."""
        return None if self._tracker is None else self._tracker.accounting

    # -- activation ----------------------------------------------------------------------
    def __enter__(self) -> FakeDevice:
        """Make this the active device on the calling thread (re-entrant)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._sanitizer.check_ops:  # Note [One checking mode per thread, at the bottom of its stack]
            from offcore_cpu import op_check

            op_check.acquire(at_creation=False)
        if self._tracker is not None:
            self._tracker.activate()
        return self

    def __exit__(self, *exc: object) -> None:
        if getattr(self._local, "depth", 0) == 0:
            return
        self._local.depth -= 1
        if self._tracker is not None:
            self._tracker.deactivate()
        if self._sanitizer.check_ops:
            from offcore_cpu import op_check

            op_check.release()

    @property
    def active(self) -> bool:
        """True inside ``with dev:`` on the calling thread."""
        return getattr(self._local, "depth", 0) > 0

    def host_work(self) -> contextlib.AbstractContextManager[Any]:
        """Host work, not device memory: tensors created on the calling thread inside are host memory.

        Inside ``with dev:`` every tensor created on the calling thread counts as device memory (the
        fake device's memory is host memory); a binding that runs host-side arithmetic on that
        thread (a host optimizer step) wraps it in this. Explicit ``allocate(n, "device")`` inside
        still counts. Operators inside bypass Python dispatch modes, as the device's own bookkeeping
        does. Re-entrant; a no-op with numpy buffers. (The optional member ``host_work`` of
        :data:`offcore.protocols.OPTIONAL_MEMBERS`.)

            >>> with dev, dev.host_work():                  # doctest: +SKIP
            ...     scratch = torch.empty(1024)             # host memory: not in memory_stats()
        """
        return self._untracked()

    def _untracked(self) -> contextlib.AbstractContextManager[Any]:
        """Operators of the device's own bookkeeping are not counted as device memory."""
        if self._tracker is None:
            return _NOTHING
        return self._tracker.suspended()

    # -- streams and events --------------------------------------------------------------
    def current_stream(self) -> ComputeStream:
        """The compute stream: the calling host thread (events on it complete at once)."""
        return self._compute

    def new_stream(self, priority: int = 0, *, name: str | None = None) -> WorkerStream:
        """A new copy stream: an in-order queue served by its own worker thread (started lazily)."""
        self._check_open("new_stream()")
        stream = WorkerStream(self._compute, name=name, priority=priority)
        self._streams.add(stream)
        return stream

    def new_event(self, enable_timing: bool = False) -> FakeEvent:
        """A new, unrecorded event (complete until recorded, as in torch)."""
        return FakeEvent(self._compute, enable_timing=enable_timing)

    def synchronize(self) -> None:
        """Wait for every stream of this device; raises the first failure of queued work."""
        errors: list[BaseException] = []
        for stream in list(self._streams):
            try:
                stream.synchronize()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Open every gate, finish queued work and stop every stream's worker thread; copies are refused from
        then on."""
        self._closed = True
        self._small_pair = None  # copies take the general path, which refuses them (Note [A closed device says so])
        self._gates.open_all()
        self._finalizer()

    # -- gates (Note [Gates] in gates.py) ------------------------------------------------
    def gate(self, stream: Any = None, *, direction: Direction | str | None = None, timeout: float = 60.0) -> Gate:
        """A closed copy gate: copies on copy streams stop in mid-flight until it opens.

        ``stream`` (a stream of this device) and ``direction`` (``"h2d"``, ``"d2h"``...)
        narrow which copies it holds. A held copy's destination already holds poison
        (with the sanitizer) and its source has not been read. Use it as a context
        manager (it opens on exit); ``gate.wait_held(n)`` blocks until ``n`` copies wait.

            >>> with dev.gate(copy_stream) as gate:          # doctest: +SKIP
            ...     done = dev.copy_(host, device, stream=copy_stream)
            ...     gate.wait_held(1)                         # the copy is in flight, for sure
        """
        state = None if stream is None else self._worker_state(stream, "gate")
        if direction is not None and type(direction) is not Direction:
            try:
                direction = Direction(direction)
            except ValueError:
                raise ConfigurationError(f"unknown direction {direction!r}: use 'h2d', 'd2h', 'h2h' or 'd2d'") from None
        label = f"copies{'' if stream is None else f' on {stream.name!r}'}{'' if direction is None else f' {direction.value}'}"
        return self._gates.add(Gate(label, timeout=timeout, stream=state, direction=direction), copies=True)

    def hold(self, stream: Any, *, timeout: float = 60.0) -> Gate:
        """A closed stream gate: ``stream`` stops at this point of its queue until the gate opens.

        >>> with dev.hold(copy_stream) as gate:          # doctest: +SKIP
        ...     done = dev.copy_(host, device, stream=copy_stream)
        ...     assert not done.query()                   # queued behind the gate
        """
        self._worker_state(stream, "hold")
        gate = self._gates.add(Gate(f"stream {stream.name!r}", timeout=timeout), copies=False)
        stream.launch_host_func(functools.partial(gate.pass_, {"hold": stream.name, "stream": stream.name}))
        return gate

    def open_gates(self) -> None:
        """Open every gate of this device (test teardown: no stream stays blocked)."""
        self._gates.open_all()

    def _worker_state(self, stream: Any, what: str) -> Any:
        if not isinstance(stream, WorkerStream) or stream not in self._streams:
            raise ConfigurationError(
                f"{what} needs a copy stream of this device (dev.new_stream()), got {stream!r}: the compute "
                "stream runs copies on the calling thread and cannot be held"
            )
        return stream._state

    # -- memory --------------------------------------------------------------------------
    def allocate(self, nbytes: int, tier: Tier | str) -> Any:
        """A raw one-dimensional uint8 buffer of ``nbytes`` on ``tier`` (device, pinned or pageable).

        Device buffers count against ``capacity``; host buffers count as pinned or pageable
        bytes in :meth:`memory_stats`. With the sanitizer, contents start poisoned.

            >>> buf = dev.allocate(4096, "device")          # doctest: +SKIP
        """
        hooked = self._hooked_empty  # Note [Device buffers counted by the hook] (tracking.py), asked first
        if hooked is not None and tier is _DEVICE and type(nbytes) is int:  # the binding's reloads
            counted = hooked(nbytes)  # None for 0 or fewer bytes: parsed and answered below
            if counted is not None:
                return counted
        # plain ints and Tier members skip the parsing
        size = (
            nbytes
            if type(nbytes) is int and nbytes >= 0
            else parse_size(nbytes, what="allocation size", allow_zero=True)
        )
        if type(tier) is not Tier:
            try:
                tier = Tier(tier)
            except ValueError:
                raise ConfigurationError(f"unknown tier {tier!r}: use 'device', 'pinned' or 'pageable'") from None
        if tier is _NVME:
            raise ConfigurationError("the fake device allocates device, pinned or pageable memory, not NVMe")
        if tier is _DEVICE:
            if hooked is not None:  # a size the fast path above did not take (a str, a numpy integer)
                counted = hooked(size)
                if counted is not None:
                    return counted
            self._arena.check_fits(size)  # fail before touching host memory
        with self._untracked():
            buffer = self._ops.empty(size)
            owner = self._ops.owner(buffer)
            self._arena.register(owner, self._ops.owner_nbytes(owner), tier)
            if self._sanitizer.enabled:
                self._ops.poison(buffer)
        return buffer

    def holds(self, buffer: Any) -> bool:
        """True when ``buffer`` (or the storage/array it views) is device memory of this device."""
        # an activation binding asks this of every saved tensor, almost always device memory: the
        # allocator hook's answer first (what it counts is device memory, never host memory: host
        # buffers are allocated with it suspended, and an arena registration of a counted storage
        # as host memory is refused), then the arena's (its lock and table)
        ops = self._ops if type(buffer) is self._tensor_type else ops_for(buffer)  # a plain tensor: torch's, known
        if ops is self._ops and (owns := self._arena._owns) is not None:  # torch: the hook's owns by address
            owner = buffer.untyped_storage()  # TORCH_OPS.owner
            try:
                if owns(owner.data_ptr()):
                    return True
            except (RuntimeError, NotImplementedError):  # meta storages and the like: the arena answers
                pass
            return self._arena.tier_of(owner) is _DEVICE
        if ops is None:
            return False
        arena = self._arena
        owner = ops.owner(buffer)
        if arena._probe is not None and arena._probe(owner):
            return True
        return arena.tier_of(owner) is _DEVICE

    def _on_device(self, ops: BufferOps | None, buffer: Any) -> bool:
        """:meth:`holds` when the buffer's family is already known (copy_ looks it up once)."""
        return ops is not None and self._arena.tier_of(ops.owner(buffer)) is _DEVICE

    def adopt(self, obj: Any) -> Any:
        """Count tensors created before activation as device memory, as ``.to('cuda')`` would; returns ``obj``.

        ``obj`` is an ``nn.Module`` (parameters, gradients and buffers), a tensor or
        array, or an iterable of them. All fit or none is adopted (out-of-memory error).

            >>> model = dev.adopt(torch.nn.Linear(1024, 1024))   # doctest: +SKIP
        """
        owners: list[tuple[Any, int]] = []
        for buffer in self._buffers_of(obj):
            ops = ops_for(buffer)
            if ops is None:
                raise ConfigurationError(f"cannot adopt {type(buffer).__name__}: expected tensors, arrays or a module")
            owner = ops.owner(buffer)
            owners.append((owner, ops.owner_nbytes(owner)))
        self._arena.register_many(owners, _DEVICE)
        return obj

    @staticmethod
    def _buffers_of(obj: Any) -> Iterator[Any]:
        if ops_for(obj) is not None:
            yield obj
            return
        parameters = getattr(obj, "parameters", None)
        if callable(parameters) and callable(getattr(obj, "buffers", None)):  # an nn.Module
            for parameter in obj.parameters():
                yield parameter
                if parameter.grad is not None:
                    yield parameter.grad
            yield from obj.buffers()
            return
        if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
            for item in obj:
                yield from FakeDevice._buffers_of(item)
            return
        raise ConfigurationError(f"cannot adopt {type(obj).__name__}: expected tensors, arrays or a module")

    def memory_stats(self) -> MemoryStats:
        """``allocated_bytes``, ``peak_allocated_bytes``, ``capacity_bytes``, ``free_bytes``,
        ``device_allocations`` and host figures ``pinned_bytes``, ``peak_pinned_bytes``,
        ``pageable_bytes``, ``peak_pageable_bytes``."""
        return MemoryStats(self._arena.stats())

    def allocated_bytes(self) -> int:
        """``memory_stats()["allocated_bytes"]`` without building the stats (an optional member of the protocol).

        >>> dev.allocated_bytes() == dev.memory_stats()["allocated_bytes"]   # doctest: +SKIP
        True
        """
        ledger = self._arena._ledger  # the allocator hook's: read under its own lock (once per prefetch decision)
        if ledger is not None:
            return int(ledger.current())
        return self._arena.allocated(_DEVICE)

    def reset_peak_memory_stats(self) -> None:
        """Peaks restart from the current figures."""
        self._arena.reset_peaks()

    def host_pool(
        self, budget: int | str, *, pinned: bool = True, block_size: int | str = "64MiB", alignment: int = 512
    ) -> FakeHostBufferPool:
        """An exact-size host buffer pool of at most ``budget`` bytes of pinned (or pageable) blocks.

        With the sanitizer on, buffers are poisoned when they return to the pool.

            >>> pool = dev.host_pool("1GiB")                   # doctest: +SKIP
            >>> buf = pool.acquire(4096); pool.release(buf)    # doctest: +SKIP
        """
        tier = _PINNED if pinned else _PAGEABLE
        if self._sanitizer.enabled:
            return PoisoningHostBufferPool(
                lambda nbytes: self.allocate(nbytes, tier),
                poison=self._release_host,
                budget=budget,
                block_size=block_size,
                alignment=alignment,
            )
        return FakeHostBufferPool(
            lambda nbytes: self.allocate(nbytes, tier), budget=budget, block_size=block_size, alignment=alignment
        )

    def poison(self, buffer: Any) -> bool:
        """With the sanitizer on, overwrite ``buffer`` with 0xFF bytes (NaN); returns whether it did.

        Bindings call it on buffers they stop using, so a late reader sees garbage.
        """
        ops = ops_for(buffer)
        if ops is None:
            raise ConfigurationError(f"cannot poison {type(buffer).__name__}: expected a tensor or a numpy array")
        if not self._sanitizer.enabled:
            return False
        self._sanitizer.released(ops, buffer, f"{describe(buffer)} was passed to dev.poison (released)")
        with self._untracked():
            ops.poison(buffer)
        return True

    def host_writes(self, buffers: Sequence[Any], *, what: str) -> Callable[[], None]:
        """Declare host work queued on another thread that will write ``buffers``; returns its finisher.

        A binding that hands writes of tensors the user can see to a worker thread (an
        optimizer summing gradients on the host) declares them when it queues the work and
        calls the finisher once the work is done. Meanwhile, with the sanitizer's operator
        check, an operator of the calling program touching those bytes is an
        ``access-in-flight`` violation, as for a copy in flight (Note [Operators checked
        against copies in flight] in ``offcore_cpu/sanitizer.py``). A no-op finisher without
        it. (The member ``host_writes`` of :attr:`offcore.Capability.SANITIZER`.)

            >>> done = dev.host_writes([master.grad], what="the host gradient of parameter 0")  # doctest: +SKIP
            >>> worker.submit(accumulate).add_done_callback(lambda _: done())                  # doctest: +SKIP
        """
        return self._sanitizer.host_writes(self._ops, list(buffers), what)  # type: ignore[no-any-return]

    def _release_host(self, buffer: Any) -> None:
        """A host-pool buffer goes back to its pool: poisoned, and copies still using it are flagged."""
        if not self._sanitizer.enabled:  # the common case first: once per offloaded storage
            return
        ops = ops_for(buffer)
        if ops is None:
            return
        self._sanitizer.released(ops, buffer, f"host buffer {describe(buffer)} was returned to its pool")
        with self._untracked():
            ops.poison(buffer)

    # -- sanitizer records (Note [Use after free] in sanitizer.py) --------------------------
    def sanitizer_violations(self, *, clear: bool = False) -> list[dict[str, Any]]:
        """The violations the sanitizer saw, oldest first.

        Each record: ``kind`` (``"use-after-free"`` for device memory whose last reference
        died while a copy used it, ``"released-in-flight"`` for a buffer returned to its pool or
        passed to :meth:`poison` while a copy used it, ``"unordered"`` for a copy racing with an
        earlier copy of another stream, ``"access-in-flight"`` for a torch operator on the host
        touching bytes of a copy in flight), ``copy`` (the copy's number), ``stream`` (the
        copy's), ``direction``, ``side`` (``"source"`` / ``"destination"``) and ``message``;
        an ``"access-in-flight"`` record also has ``op`` (``"aten.mul_.Tensor"``), ``argument``,
        ``tensor`` (dtype, shape, bytes), ``access`` (``"read"`` / ``"write"``) and ``op_stream``.
        ``clear=True`` forgets them. Always empty without the sanitizer.
        """
        return self._sanitizer.violations(clear=clear)

    def check_sanitizer(self, *, clear: bool = True) -> None:
        """Raise :class:`~offcore_cpu.errors.SanitizerViolation` listing every violation seen (then forgotten)."""
        found = self._sanitizer.violations(clear=clear)
        if found:
            lines = "\n".join(f"- [{v['kind']}] {v['message']}" for v in found[:20])
            more = f"\n(and {len(found) - 20} more)" if len(found) > 20 else ""
            raise SanitizerViolation(
                f"the sanitizer of fake device {self._label} saw {len(found)} violation(s): buffers freed or "
                f"released, copies unordered, or operators run, while a copy still used them:\n{lines}{more}",
                found,
            )

    @property
    def copies_in_flight(self) -> int:
        """Sanitized copies enqueued on copy streams whose bytes have not landed yet (0 without the sanitizer)."""
        return self._sanitizer.in_flight()

    def __repr__(self) -> str:
        o = self.options
        return (
            f"<FakeDevice {self._label} capacity={format_bytes(o.capacity)} "
            f"h2d={format_bandwidth(o.h2d_bandwidth)} d2h={format_bandwidth(o.d2h_bandwidth)} "
            f"latency={o.latency * 1e6:g}us {'duplex' if o.duplex else 'shared link'}"
            f"{' sanitize' if o.sanitize else ''} buffers={o.buffers}>"
        )
