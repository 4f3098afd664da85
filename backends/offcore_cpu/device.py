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
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, NoReturn

from offcore.errors import ConfigurationError
from offcore.kinds import Direction, Tier
from offcore.ledger import Ledger
from offcore.protocols import Availability, Capability, MemoryStats
from offcore.units import format_bandwidth, format_bytes, parse_size
from offcore_cpu.arena import MemoryArena
from offcore_cpu.buffers import NUMPY_OPS, BufferOps, describe, ops_for
from offcore_cpu.errors import InjectedFault, SanitizerViolation
from offcore_cpu.gates import Gate, GateSet
from offcore_cpu.host_pool import FakeHostBufferPool
from offcore_cpu.link import Link
from offcore_cpu.options import FakeDeviceOptions, FaultMode, numpy_importable, parse_fail_copy, parse_fault_mode
from offcore_cpu.sanitizer import Flight, Ordering, Sanitizer
from offcore_cpu.streams import ComputeStream, FakeEvent, WorkerStream

__all__ = ["FakeDevice"]

_NOTHING = contextlib.nullcontext()
# Copies up to this size run on the calling thread when their stream is idle and the
# sanitizer is off (Note [Inline copies on an idle stream]); larger ones keep overlapping
# with compute on a worker thread.
_INLINE_COPY_LIMIT = 1 << 20
# a copy's direction by (source on the device, destination on the device)
_DIRECTIONS = {
    (True, False): Direction.D2H,
    (False, True): Direction.H2D,
    (True, True): Direction.D2D,
    (False, False): Direction.H2H,
}


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


class FakeDevice:
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
        if self.options.fail_copy is not None:
            self._fault = (self.options.fail_copy, self.options.fail_copy_mode, f"fail_copy={self.options.fail_copy}")
        self._ops: BufferOps = NUMPY_OPS
        self._tracker: Any = None
        if self.options.buffers == "torch":  # torch is imported here, never for numpy buffers
            from offcore_cpu.torch_buffers import TORCH_OPS
            from offcore_cpu.torch_errors import TorchFakeDeviceOutOfMemoryError
            from offcore_cpu.tracking import StorageTracker

            self._ops = TORCH_OPS
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
        # Note [The small copy's fast path]
        self._small_pair: Callable[[Any, Any], tuple[int, Any, Any, int, int] | None] | None = None
        if self.options.buffers == "torch" and not self.options.sanitize:
            from offcore_cpu.torch_buffers import TORCH_OPS, memmove_holding_gil

            self._small_pair = TORCH_OPS.small_pair
            self._memmove = memmove_holding_gil

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
        # the binding allocates once per reload: plain ints and Tier members skip the parsing
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
        if tier is Tier.NVME:
            raise ConfigurationError("the fake device allocates device, pinned or pageable memory, not NVMe")
        if tier is Tier.DEVICE:
            tracker = self._tracker
            if tracker is not None and self._ops is not NUMPY_OPS and not self._sanitizer.enabled:
                counted = tracker.hooked_empty(size)  # Note [Device buffers counted by the hook] (tracking.py)
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
        ops = ops_for(buffer)
        if ops is None:
            return False
        owner = ops.owner(buffer)
        # an activation binding asks this of every saved tensor, almost always device memory: the
        # allocator hook's answer first (what it counts is device memory, never host memory: host
        # buffers are allocated with it suspended, and an arena registration of a counted storage
        # as host memory is refused), then the arena's (its lock and table)
        probe = self._arena._probe
        if probe is not None and probe(owner):
            return True
        return self._arena.tier_of(owner) is Tier.DEVICE

    def _on_device(self, ops: BufferOps | None, buffer: Any) -> bool:
        """:meth:`holds` when the buffer's family is already known (copy_ looks it up once)."""
        return ops is not None and self._arena.tier_of(ops.owner(buffer)) is Tier.DEVICE

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
        self._arena.register_many(owners, Tier.DEVICE)
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
        return self._arena.allocated(Tier.DEVICE)

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
        tier = Tier.PINNED if pinned else Tier.PAGEABLE
        return FakeHostBufferPool(
            lambda nbytes: self.allocate(nbytes, tier),
            poison=self._release_host,
            budget=budget,
            block_size=block_size,
            alignment=alignment,
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

    # -- copies --------------------------------------------------------------------------
    def direction(self, dst: Any, src: Any) -> Direction:
        """The direction of a copy from ``src`` to ``dst`` (by :meth:`holds`)."""
        return Direction.between(
            Tier.DEVICE if self.holds(src) else Tier.PINNED, Tier.DEVICE if self.holds(dst) else Tier.PINNED
        )

    def copy_(self, dst: Any, src: Any, *, stream: Any, start_event: Any = None) -> FakeEvent:
        """Enqueue ``dst[...] = src`` on ``stream``; the returned event completes when the data landed.

        ``start_event`` (optional) is recorded on ``stream`` right before the copy, after the
        checks, so it times the copy alone: a queued copy completes it itself when its stream
        reaches it (no separate work item, so no worker hand-off between the two is timed).

        Buffers are both numpy arrays or both torch tensors with the same number of bytes;
        either may be a typed or non-contiguous view if the other is contiguous. On a copy
        stream the copy occupies the link for ``latency + nbytes / bandwidth``; on the compute
        stream it runs on the calling thread before returning. An injected fault makes one
        call fail (Note [Injected copy faults]).
        """
        small = self._small_pair
        if small is not None and start_event is None and not self._closed:
            pair = small(dst, src)
            if pair is not None and type(stream) is WorkerStream and stream._compute is self._compute:
                return self._copy_small(dst, src, pair, stream)
        self._check_open("copy_")
        ops = ops_for(dst)
        if ops is None or ops is not ops_for(src):
            raise ConfigurationError(
                f"copy_ needs two numpy arrays or two torch tensors, got {describe(dst)} <- {describe(src)}; "
                "convert one side (torch.from_numpy / tensor.numpy())"
            )
        nbytes = ops.nbytes(dst)
        if nbytes != ops.nbytes(src):
            raise ConfigurationError(
                f"copy_ between buffers of different sizes: {describe(dst)} holds {nbytes} bytes, "
                f"{describe(src)} holds {ops.nbytes(src)}"
            )
        if ops is NUMPY_OPS and not dst.flags.writeable:
            raise ConfigurationError(f"copy_ destination {describe(dst)} is read-only")
        src_on_device, dst_on_device = self._on_device(ops, src), self._on_device(ops, dst)
        direction = Direction.between(
            Tier.DEVICE if src_on_device else Tier.PINNED, Tier.DEVICE if dst_on_device else Tier.PINNED
        )
        compute = self._compute
        if stream is not compute and (not isinstance(stream, WorkerStream) or stream not in self._streams):
            raise ConfigurationError(
                f"copy_ needs a stream of this device (dev.new_stream() or dev.current_stream()), got {stream!r}"
            )
        number, fault = self._count_copy()
        if fault is not None:
            if fault.mode == "submit":
                raise fault  # before anything is drawn, booked or enqueued
            return self._enqueue_fault(ops, dst, nbytes, stream, fault)
        sanitizer = self._sanitizer
        jitter = sanitizer.draw_jitter() if sanitizer.enabled and self._link.crosses_link(direction) else 0.0
        state = None if stream is compute else stream._state
        inline = (
            state is not None
            and nbytes <= _INLINE_COPY_LIMIT
            and not sanitizer.enabled
            and not self._gates.any_closed_for(state, direction)
        )
        started: Any = None  # completes start_event when a queued copy begins
        if start_event is not None:  # stamped before the copy's own tick (Note [Copies ordered by the program])
            if stream is compute or inline:
                stream.record_event(start_event)
            else:
                started = stream.record_start(start_event)
        if sanitizer.enabled:  # Note [Copies ordered by the program]
            self._check_order(ops, dst, src, direction, stream, number)
        if stream is compute:
            # Note [Plain copies need no suspension]: only the sanitizer's poisoning runs operators here
            with self._untracked() if sanitizer.enabled else _NOTHING:
                self._run_copy(ops, dst, src, direction, nbytes, jitter, compute.name, time.perf_counter(), number)
            return compute.record_event(FakeEvent(compute, enable_timing=True))
        if sanitizer.enabled:
            # Note [Use after free]: the queued copy holds device memory through aliases of its own
            with self._untracked():
                flight = Flight(
                    number, stream.name, direction, nbytes, ops, dst, src, {"src": src_on_device, "dst": dst_on_device}
                )
            sanitizer.start(flight)
            del dst, src  # the work item must not keep the caller's buffers alive
            run = functools.partial(self._run_flight, flight, jitter, state, time.perf_counter(), started)
            try:
                return stream.run_and_record(run, FakeEvent(compute, enable_timing=True))
            except BaseException:  # not enqueued (a closed stream): no flight to wait for
                sanitizer.finish(flight)
                raise
        if inline:
            # Note [Inline copies on an idle stream]
            event = stream.try_inline(
                functools.partial(self._inline_copy, ops, dst, src, direction, nbytes, stream.name, number)
            )
            if event is not None:
                return event
        return self._enqueue_copy(ops, dst, src, direction, nbytes, jitter, stream, number, started)

    def _enqueue_copy(
        self,
        ops: BufferOps,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        jitter: float,
        stream: WorkerStream,
        number: int,
        started: Any = None,
    ) -> FakeEvent:
        """Queue a copy on ``stream``'s worker: one work item runs it and completes the event (one hand-off)."""
        run = functools.partial(
            self._run_copy,
            ops,
            dst,
            src,
            direction,
            nbytes,
            jitter,
            stream.name,
            time.perf_counter(),
            number,
            stream._state,
            started,
        )
        return stream.run_and_record(run, FakeEvent(self._compute, enable_timing=True))

    # Note [The small copy's fast path]
    # Most copies a binding makes are small plain tensors between device and host memory on an idle
    # copy stream, with the sanitizer off: they run inline (Note [Inline copies on an idle stream]).
    # copy_'s general path asks each question of them through a helper per concern (the family's
    # ops, the plain and liveness checks twice per side, the arena per side, the gates, the link),
    # about 12 us of Python per copy for a memmove of 16 KiB. A device made without the sanitizer
    # and with torch buffers first asks TorchBuffers.small_pair, which answers every check the
    # general path makes of two exact ``torch.Tensor`` sides in one pass (or declines: then the
    # general path runs, checks again and reports what is wrong); _copy_small then numbers the
    # copy, books the link and moves the bytes under the stream's lock exactly as the inline path
    # does, falling back to the general path's fault handling and queueing where that would. What
    # it skips is only what cannot apply without the sanitizer: no jitter, no flight, no ordering
    # check. A copy gate (tests) sends every copy down the general path.
    def _copy_small(self, dst: Any, src: Any, pair: tuple[int, Any, Any, int, int], stream: WorkerStream) -> FakeEvent:
        """copy_ of a pair TorchBuffers.small_pair accepted, on one of this device's copy streams."""
        nbytes, dst_storage, src_storage, dst_address, src_address = pair
        tier_of = self._arena.tier_of
        direction = _DIRECTIONS[tier_of(src_storage) is Tier.DEVICE, tier_of(dst_storage) is Tier.DEVICE]
        with self._fault_lock:  # _count_copy, inlined (once per copy)
            number = self._copies = self._copies + 1
            armed = self._fault
            if armed is not None and armed[0] == number:
                self._fault = None
            else:
                armed = None
        ops = self._ops
        if armed is not None:
            fault = self._injected(armed)
            if fault.mode == "submit":
                raise fault
            return self._enqueue_fault(ops, dst, nbytes, stream, fault)
        state = stream._state
        if nbytes > _INLINE_COPY_LIMIT or self._gates.any_closed_for(state, direction):
            return self._enqueue_copy(ops, dst, src, direction, nbytes, 0.0, stream, number)
        with state.lock:
            if not (state.pending or state.error is not None or state.closed):
                enqueued = time.perf_counter()
                span = self._link.reserve(direction, nbytes, state.busy_until)
                if span is not None:
                    start, end = span
                    self._memmove(dst_address, src_address, nbytes)
                    if end > state.busy_until:
                        state.busy_until = end
                    landed = True
                else:
                    landed = False
            else:
                landed = False
        if not landed:
            return self._enqueue_copy(ops, dst, src, direction, nbytes, 0.0, stream, number)
        self.ledger.record_copy(direction, nbytes, seconds=end - start)
        self._copy_log.append(
            (stream.name, direction, nbytes, enqueued, start, end, 0.0, number, src_address, dst_address)
        )
        event = FakeEvent(self._compute, enable_timing=True)
        event._land_at(stream.name, end)
        return event

    # Note [A batch of copies is one work item]
    # A binding that streams a module's parameters copies its weight and bias (two storages)
    # back to back on one copy stream. Each queued copy_ is a work item of its own: a
    # hand-off to the stream's worker, which must win the interpreter back from the compute
    # thread at least twice per item (after taking it off the queue, after its memcpy). So
    # copy_many queues a run of copies as *one* work item: each copy still pays its own
    # latency on the link, is numbered, ledgered and logged as copy_ would, in order; only
    # the event is shared (it completes when the last copy landed). Leading copies that
    # would run inline on an idle stream still do (Note [Inline copies on an idle stream]).
    # Whatever copy_ treats specially (the sanitizer, an armed fault, a closed gate, the
    # compute stream) makes copy_many call copy_ for each pair instead: nothing is lost.
    def copy_many(self, pairs: Sequence[tuple[Any, Any]], *, stream: Any) -> FakeEvent:
        """Enqueue ``dst[...] = src`` for each ``(dst, src)`` of ``pairs``, in order, on ``stream``; the
        returned event completes when the last one landed. Each copy is checked, timed on the link and
        logged as :meth:`copy_` would; a copy stream gets them as one work item (Note [A batch of copies
        is one work item]). An optional member of the backend protocol.

            >>> done = dev.copy_many([(weight, host_w), (bias, host_b)], stream=h2d)   # doctest: +SKIP
        """
        self._check_open("copy_many")
        if not pairs:
            raise ConfigurationError("copy_many needs at least one (dst, src) pair")
        compute = self._compute
        state = None if stream is compute or not isinstance(stream, WorkerStream) else stream._state
        special = state is None or len(pairs) == 1 or self._sanitizer.enabled or stream not in self._streams
        checked: list[tuple[BufferOps, Any, Any, Direction, int]] = []
        if not special:
            for dst, src in pairs:
                ops = ops_for(dst)
                if ops is None or ops is not ops_for(src) or ops is NUMPY_OPS:
                    special = True  # copy_ checks and reports it (numpy: its read-only check)
                    break
                nbytes = ops.nbytes(dst)
                if nbytes != ops.nbytes(src):
                    special = True
                    break
                direction = Direction.between(
                    Tier.DEVICE if self._on_device(ops, src) else Tier.PINNED,
                    Tier.DEVICE if self._on_device(ops, dst) else Tier.PINNED,
                )
                if self._gates.any_closed_for(state, direction):
                    special = True
                    break
                checked.append((ops, dst, src, direction, nbytes))
        if not special:
            with self._fault_lock:  # numbered together, unless a fault is armed (copy_ counts to it)
                if self._fault is None:
                    first = self._copies + 1
                    self._copies += len(checked)
                else:
                    special = True
        if special:
            event: Any = None
            for dst, src in pairs:
                event = self.copy_(dst, src, stream=stream)
            return event
        name = stream.name
        at = 0
        inline: FakeEvent | None = None
        for ops, dst, src, direction, nbytes in checked:  # leading small copies on an idle stream: inline
            if nbytes > _INLINE_COPY_LIMIT:
                break
            inline = stream.try_inline(
                functools.partial(self._inline_copy, ops, dst, src, direction, nbytes, name, first + at)
            )
            if inline is None:
                break
            at += 1
        if at == len(checked):
            assert inline is not None
            return inline
        enqueued = time.perf_counter()
        items = [
            (ops, dst, src, direction, nbytes, 0.0, name, enqueued, first + i, state)
            for i, (ops, dst, src, direction, nbytes) in enumerate(checked[at:], start=at)
        ]
        del checked, pairs  # the work item alone holds the buffers

        def run() -> float:
            landed = 0.0
            for item in items:
                landed = self._run_copy(*item)
            items.clear()  # the buffers go with the item, before its event completes
            return landed

        return stream.run_and_record(run, FakeEvent(compute, enable_timing=True))

    def _check_order(self, ops: BufferOps, dst: Any, src: Any, direction: Direction, stream: Any, number: int) -> None:
        """Record a sanitized copy's accesses; report the earlier copies it races with (Note [Copies ordered by the program])."""
        order = self._compute.order
        sid = order.COMPUTE if stream is self._compute else stream._sid
        ranges = {"src": ops.byte_range(src), "dst": ops.byte_range(dst)}
        for earlier, side in order.copy(sid, ranges, number, stream.name, direction):
            this = f"copy #{number} ({direction.value}, stream {stream.name!r})"
            other = f"copy #{earlier.number} ({earlier.direction.value}, stream {earlier.stream_name!r})"
            if side == "src":
                what = f"reads bytes that {other} writes"
            elif _overlaps(ranges["dst"], earlier.ranges["dst"]):
                what = f"writes bytes that {other} also writes"
            else:
                what = f"writes bytes that {other} reads"
            self._sanitizer.report(
                "unordered",
                number,
                stream.name,
                direction,
                side,
                f"{this} {what}, and nothing orders it after that copy: a missing wait_event / wait_stream "
                "between the streams (or a synchronize before enqueueing it). On a GPU it may run first.",
            )

    # -- fault injection -----------------------------------------------------------------
    # Note [Injected copy faults]
    # Tests of code that must survive a failed copy (an offload binding that frees, retries
    # or reports) need a copy that fails on demand. The device numbers its copy_ calls from
    # 1 (those that passed their argument checks); the armed fault makes one of them fail,
    # once, and is then disarmed:
    # - mode "submit": copy_ raises InjectedFault at once, before anything happens: nothing
    #   is enqueued, no link time is booked, no jitter drawn, nothing ledgered or logged.
    # - mode "stream": the copy is enqueued and its *work* raises InjectedFault when its
    #   stream reaches it, exactly as a real failure of queued work does (Note [Failures
    #   on a worker stream]): the copy's event raises StreamWorkError (InjectedFault is its
    #   __cause__), so do events recorded later on that stream, and stream.synchronize()
    #   raises it once and clears it. A small copy on an idle stream fails inline (the
    #   failure lands on its event at once, as try_inline's does). With the sanitizer the
    #   destination is poisoned when the stream reaches the copy, and stays so. No bytes
    #   move, and the failed copy is not ledgered or logged. On the compute stream a copy
    #   runs on the calling thread, so its failure is raised by copy_ itself in both modes.
    # ``fail_copy=N`` arms copy number N at creation; ``inject_copy_fault(n)`` arms the
    # n-th copy from now, replacing any fault still armed.

    def inject_copy_fault(self, nth: int | None = 1, *, mode: str = "submit") -> None:
        """Make the ``nth`` ``copy_`` call from now fail once (1: the next one; None or 0: disarm).

        ``mode="submit"``: that ``copy_`` raises :class:`~offcore_cpu.errors.InjectedFault`
        and enqueues nothing. ``mode="stream"``: the copy is enqueued and fails on its stream;
        its event raises :class:`~offcore_cpu.errors.StreamWorkError`. Replaces a fault still
        armed (``fail_copy=N`` at creation arms one the same way). Note [Injected copy faults].

            >>> dev.inject_copy_fault(2, mode="stream")       # doctest: +SKIP
        """
        n = parse_fail_copy(nth, "nth")
        fault_mode = parse_fault_mode(mode, "mode")
        source = f"dev.inject_copy_fault({n}, mode={fault_mode!r})"
        with self._fault_lock:
            self._fault = None if n is None else (self._copies + n, fault_mode, source)

    @property
    def copy_fault_armed(self) -> bool:
        """True while a fault armed by ``fail_copy`` or :meth:`inject_copy_fault` has not fired yet."""
        with self._fault_lock:
            return self._fault is not None

    def _count_copy(self) -> tuple[int, InjectedFault | None]:
        """Number this copy_ call; the error to fail it with when the armed fault is due."""
        with self._fault_lock:
            self._copies += 1
            count = self._copies
            fault = self._fault
            if fault is None or fault[0] != count:
                return count, None
            self._fault = None
        return count, self._injected(fault)

    def _injected(self, fault: tuple[int, FaultMode, str]) -> InjectedFault:
        """The error an armed fault fails its copy with."""
        number, mode, source = fault
        return InjectedFault(
            f"copy #{number} on fake device {self._label} failed: fault injected by {source} (mode {mode!r})",
            copy_number=number,
            mode=mode,
        )

    def _enqueue_fault(self, ops: BufferOps, dst: Any, nbytes: int, stream: Any, fault: InjectedFault) -> FakeEvent:
        """A copy whose work fails on ``stream`` (mode "stream" of Note [Injected copy faults])."""
        fail = functools.partial(self._fail_copy, ops, dst, fault)
        compute = self._compute
        if stream is compute:
            with self._untracked():
                fail()  # raises: compute-stream copies run (and fail) inside copy_
        if nbytes <= _INLINE_COPY_LIMIT and not self._sanitizer.enabled:
            event = stream.try_inline(fail)  # fails inline: the event carries the failure
            if event is not None:
                return event
        return stream.run_and_record(fail, FakeEvent(compute, enable_timing=True))

    def _fail_copy(self, ops: BufferOps, dst: Any, fault: InjectedFault, *_not_before: float) -> NoReturn:
        if self._sanitizer.enabled:  # the stream reached the copy: its destination holds garbage
            ops.poison(dst)
        raise fault

    # Note [Plain copies need no suspension]
    # A copy's bytes move with ``ops.copy``; for a torch buffer that is a ``Tensor.copy_`` (an
    # operator: the accounting must not count it, so it runs inside ``_untracked()``), except
    # for small plain copies, which are one ``memmove`` (Note [Small copies keep the GIL]) that
    # no dispatch mode or allocator hook sees. ``_copy_bytes`` tries that first and suspends
    # the accounting only for the operator path; the suspension (a thread-local count, the
    # dispatch guard and the hook's ledger swapped out and back) cost about as much as the
    # memmove of 16 KiB. On the compute stream only the sanitizer's poisoning runs operators
    # around the copy, so only then is the whole copy suspended.
    def _copy_bytes(self, ops: BufferOps, dst: Any, src: Any) -> None:
        """Move the bytes of a copy, suspending the device's accounting only where an operator runs."""
        if not ops.copy_plain(dst, src):
            with self._untracked():
                ops.copy(dst, src)

    def _inline_copy(
        self,
        ops: BufferOps,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        stream_name: str,
        number: int,
        not_before: float,
    ) -> float | None:
        """Copy now on the calling thread and book the link; returns when the copy lands (None: queue it)."""
        enqueued = time.perf_counter()
        span = self._link.reserve(direction, nbytes, not_before)
        if span is None:  # a queued copy holds the link right now
            return None
        start, end = span
        self._copy_bytes(ops, dst, src)
        self.ledger.record_copy(direction, nbytes, seconds=end - start)
        self._copy_log.append(
            (stream_name, direction, nbytes, enqueued, start, end, 0.0, number, ops.address(src), ops.address(dst))
        )
        return end

    def _run_copy(
        self,
        ops: BufferOps,
        dst: Any,
        src: Any,
        direction: Direction,
        nbytes: int,
        jitter: float,
        stream_name: str,
        enqueued: float,
        number: int,
        state: Any = None,
        started: Any = None,
    ) -> float:
        """A copy without the sanitizer (or on the compute stream, run by ``copy_`` itself); returns when it landed."""
        if started is not None:
            started()  # the copy's start_event: its stream reached it
        sanitize = self._sanitizer.enabled
        if sanitize:  # Note [What the sanitizer poisons, and when], point 1
            ops.poison(dst)
        if state is not None and self._gates.any_closed_for(state, direction):  # Note [Gates]
            self._gates.pass_copy(state, direction, _held(number, stream_name, direction, nbytes))
        start, end = self._link.transfer(
            direction,
            nbytes,
            functools.partial(self._copy_bytes, ops, dst, src),
            extra_delay=jitter,
            data_first=not sanitize,
        )
        self.ledger.record_copy(direction, nbytes, seconds=end - start)
        # a tuple per copy; copy_log() builds the dicts only when asked
        self._copy_log.append(
            (stream_name, direction, nbytes, enqueued, start, end, jitter, number, ops.address(src), ops.address(dst))
        )
        return end

    def _run_flight(self, flight: Flight, jitter: float, state: Any, enqueued: float, started: Any = None) -> float:
        """A sanitized queued copy (Note [Use after free]): checks for frees when reached, before and after landing."""
        sanitizer, ops = self._sanitizer, flight.ops
        try:
            reached = time.perf_counter()
            if started is not None:
                started()  # the copy's start_event: its stream reached it
            sanitizer.check_freed(flight, "before its stream reached it")
            if ops.live(flight.dst):  # not into a storage freed under it (reported by check_freed)
                ops.poison(flight.dst)  # Note [What the sanitizer poisons, and when], point 1
            if self._gates.any_closed_for(state, flight.direction):  # Note [Gates]
                self._gates.pass_copy(
                    state, flight.direction, _held(flight.number, flight.stream, flight.direction, flight.nbytes)
                )
                reached = time.perf_counter()  # a held copy starts when its gate opens
            start, end = self._link.transfer(
                flight.direction,
                flight.nbytes,
                functools.partial(self._land, flight),
                extra_delay=jitter,
                since=reached,  # the sanitizer's own work (poison, checks) is not link time
            )
        finally:
            sanitizer.finish(flight)
            flight.src = flight.dst = None  # the copy holds no memory once its bytes landed
        self.ledger.record_copy(flight.direction, flight.nbytes, seconds=end - start)
        src, dst = flight.ranges["src"][0], flight.ranges["dst"][0]
        self._copy_log.append(
            (flight.stream, flight.direction, flight.nbytes, enqueued, start, end, jitter, flight.number, src, dst)
        )
        return end

    def _land(self, flight: Flight) -> None:
        """Move a sanitized copy's bytes, or poison, when a side was freed or released (Note [Use after free])."""
        ops = flight.ops
        self._sanitizer.check_freed(flight, "while the copy was in flight")
        if flight.lost:  # a freed or released source delivers poison; a released destination gets poison
            if ops.live(flight.dst):
                ops.poison(flight.dst)
            return
        ops.copy(flight.dst, flight.src)
        self._sanitizer.check_freed(flight, "while its bytes were moving")
        if "src" in flight.lost and ops.live(flight.dst):
            ops.poison(flight.dst)

    def copy_log(self) -> list[dict[str, Any]]:
        """The latest completed copies, oldest first, for traces.

        A ring: it keeps the last ``copy_log_limit`` copies (an option, 4096 by default; 0
        keeps none), so it never grows with the length of a run; ``dev.ledger`` keeps the
        totals of every copy. Failed copies are not logged. Each entry: ``stream``, ``direction``
        (``"d2h"``...), ``bytes``, ``enqueued``, ``start``, ``end`` (``time.perf_counter()``
        seconds), ``emulated_seconds``, ``number`` (the copy's 1-based number among the device's
        ``copy_`` calls: the order they were issued in) and ``src`` / ``dst`` (the address of each
        side's first byte, to tell which buffers a copy moved).
        """
        duration = self._link.duration
        return [
            {
                "stream": stream_name,
                "direction": direction.value,
                "bytes": nbytes,
                "enqueued": enqueued,
                "start": start,
                "end": end,
                "emulated_seconds": duration(direction, nbytes) + jitter,
                "number": number,
                "src": src,
                "dst": dst,
            }
            for stream_name, direction, nbytes, enqueued, start, end, jitter, number, src, dst in list(self._copy_log)
        ]

    def clear_copy_log(self) -> None:
        """Forget the logged copies (the ledger keeps its totals)."""
        self._copy_log.clear()

    def __repr__(self) -> str:
        o = self.options
        return (
            f"<FakeDevice {self._label} capacity={format_bytes(o.capacity)} "
            f"h2d={format_bandwidth(o.h2d_bandwidth)} d2h={format_bandwidth(o.d2h_bandwidth)} "
            f"latency={o.latency * 1e6:g}us {'duplex' if o.duplex else 'shared link'}"
            f"{' sanitize' if o.sanitize else ''} buffers={o.buffers}>"
        )


def _held(number: int, stream_name: str, direction: Direction, nbytes: int) -> dict[str, Any]:
    """What a copy gate reports about a copy it holds."""
    return {"copy": number, "stream": stream_name, "direction": direction.value, "bytes": nbytes}


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
