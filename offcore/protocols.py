"""The Stream, Event and Backend protocols, in PyTorch's vocabulary.

A backend adapter implements :class:`Backend`; its streams and events satisfy
:class:`Stream` and :class:`Event`, whose members are exactly those of
``torch.Stream`` / ``torch.Event`` that offcore uses, so ``torch.cuda.Stream`` and
``torch.npu.Stream`` satisfy them as they are.

Buffers are whatever the backend moves: ``torch.Tensor`` for the torch backends, and
``numpy.ndarray`` too for the CPU fake device. A *raw buffer* is a one-dimensional
``uint8`` buffer (``allocate`` returns one); typed views are made by the binding.

    >>> import offcore
    >>> dev = offcore.device("cpu", capacity="1GiB")        # doctest: +SKIP
    >>> copy_stream = dev.new_stream()                      # doctest: +SKIP
    >>> done = dev.copy_(host_buf, dev_buf, stream=copy_stream)   # doctest: +SKIP
    >>> done.synchronize()                                  # doctest: +SKIP
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from offcore.kinds import Tier

if TYPE_CHECKING:
    from offcore.pool import HostBufferPool

__all__ = ["Stream", "Event", "Backend", "Availability", "Capability", "MemoryStats", "OPTIONAL_MEMBERS"]


@runtime_checkable
class Event(Protocol):
    """A marker in a stream's work queue (``torch.Event`` semantics)."""

    def record(self, stream: Any = None) -> None:
        """Capture the work enqueued so far on ``stream`` (default: the current stream)."""

    def wait(self, stream: Any = None) -> None:
        """Make ``stream``'s later work wait until this event completes (does not block the host)."""

    def query(self) -> bool:
        """True once the recorded work has completed (an unrecorded event counts as complete)."""

    def synchronize(self) -> None:
        """Block the calling host thread until the event completes."""

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event and ``end_event``; both need ``enable_timing=True``."""


@runtime_checkable
class Stream(Protocol):
    """An in-order work queue on a device (``torch.Stream`` semantics)."""

    def query(self) -> bool:
        """True when all work enqueued so far has completed."""

    def synchronize(self) -> None:
        """Block the host until all work enqueued so far has completed."""

    def wait_event(self, event: Any) -> None:
        """Later work on this stream waits for ``event``."""

    def wait_stream(self, stream: Any) -> None:
        """Later work on this stream waits for all work enqueued so far on ``stream``."""

    def record_event(self, event: Any = None) -> Any:
        """Record ``event`` (or a new one) at the current end of this stream and return it."""


class Capability(str, enum.Enum):
    """Optional backend features, advertised in ``Backend.capabilities``.

    Some capabilities bring members of their own (:data:`OPTIONAL_MEMBERS`); a caller
    uses such a member only after checking that the backend advertises the capability.
    """

    PINNED_MEMORY = "pinned_memory"
    """Page-locked host buffers that copy asynchronously."""
    DUPLEX_COPY = "duplex_copy"
    """H2D and D2H copies can run at the same time."""
    EVENT_TIMING = "event_timing"
    """Events created with ``enable_timing=True`` report ``elapsed_time``."""
    TORCH = "torch"
    """Buffers are torch tensors; the member ``torch_device`` (a ``torch.device``) names the device."""
    NUMPY = "numpy"
    """Buffers may be numpy arrays (frameworks other than PyTorch)."""
    SANITIZER = "sanitizer"
    """Poisons freed memory and in-flight buffers, jitters copies. Member ``poison(buffer)``: overwrite
    ``buffer`` with 0xFF bytes (NaN, -1) and flag a copy still using it; bindings call it on host
    buffers they stop using, so a late reader sees garbage. Member ``host_writes(buffers, *, what)``:
    declare host work another thread will do writing ``buffers``; returns a callable to call when it
    is done (until then the program's operators touching those bytes are reported)."""
    PRIVATE_FORMATS = "private_formats"
    """Tensors may carry a device-private memory format that must be restored (Ascend NZ). Members
    ``format_of(tensor) -> int | None`` (read at offload) and ``restore_format(tensor, fmt)`` (applied
    to the tensor rebuilt at reload; returns the tensor to use)."""
    TIMING_READ_SYNCHRONIZES = "timing_read_synchronizes"
    """Reading ``elapsed_time`` is a barrier (torch_npu drains every task queue and synchronizes
    both events): copy timings are read only between steps, never while one runs."""


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, why not, and how many devices it sees."""

    available: bool
    reason: str = ""
    device_count: int = 0

    def __bool__(self) -> bool:
        return self.available


class MemoryStats(dict):  # type: ignore[type-arg]
    """Device memory figures in bytes, ``torch.cuda.memory_stats``-style.

    Always holds ``allocated_bytes``, ``peak_allocated_bytes`` and ``capacity_bytes``.
    """

    @property
    def allocated_bytes(self) -> int:
        return int(self["allocated_bytes"])

    @property
    def peak_allocated_bytes(self) -> int:
        return int(self["peak_allocated_bytes"])

    @property
    def capacity_bytes(self) -> int:
        return int(self["capacity_bytes"])


OPTIONAL_MEMBERS: MappingProxyType[str, Capability | None] = MappingProxyType(
    {
        "torch_device": Capability.TORCH,
        "poison": Capability.SANITIZER,
        "host_writes": Capability.SANITIZER,
        "format_of": Capability.PRIVATE_FORMATS,
        "restore_format": Capability.PRIVATE_FORMATS,
        "close": None,
        "allocated_bytes": None,
        "active": None,
        "host_work": None,
        "copy_many": None,
    }
)
"""Backend members outside :class:`Backend`, and the capability that promises each.

A backend advertising the capability has the member; callers check the capability first.
``close()`` (``None``: no capability) is an optional lifecycle member: a backend that holds
threads, a memory cap or pinned blocks provides it, and callers that end a device's use call
it when present (``getattr(dev, "close", None)``). ``allocated_bytes()`` (``None`` too) is an optional
fast read of ``memory_stats()["allocated_bytes"]`` (same figure, no dict built): bindings that probe
the device's room per reload use it when present and fall back to ``memory_stats()``. ``host_work()`` (``None``
too) is an optional context manager meaning "host work, not device memory": the tensors the framework
creates on the calling thread inside it are host memory even inside ``with device:``. Only a backend
whose device memory is host memory and counts what is created inside ``with device:`` (the CPU fake
device) needs it; elsewhere host tensors are host memory anyway, and callers use
``contextlib.nullcontext()`` when it is absent. Nothing else on a device may be relied on
by the core, the bindings or the conformance suite (``tests/core/test_protocol_usage.py``).
"""


@runtime_checkable
class Backend(Protocol):
    """One device of one backend, as the core sees it.

    Instances come from :func:`offcore.device`; the class is what the registry holds.
    ``with backend:`` makes the device the active one (for the fake device: starts
    tracking every tensor allocated on it, as ``torch.cuda.memory_allocated`` would).

    These members are required; the bindings and the conformance suite call nothing else
    except the optional members of :data:`OPTIONAL_MEMBERS`, each after checking the
    capability that promises it: ``torch_device`` (:attr:`Capability.TORCH`), ``poison`` and ``host_writes``
    (:attr:`Capability.SANITIZER`), ``format_of`` and ``restore_format``
    (:attr:`Capability.PRIVATE_FORMATS`), and ``close()``, ``allocated_bytes()``, ``active`` (True
    while the calling thread is inside ``with device:``, for devices that are entered) and
    ``host_work()`` (a context manager: host work on the calling thread, not device memory) and
    ``copy_many(pairs, stream=...)`` (``copy_`` of each ``(dst, src)`` in order, one event for the last;
    a backend whose copy streams pay per work item queues them as one) when present.
    """

    name: ClassVar[str]
    capabilities: frozenset[Capability]

    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here; never raises."""

    def current_stream(self) -> Stream:
        """The stream compute is being enqueued on right now (read at use, never cached)."""

    def new_stream(self, *, priority: int = 0) -> Stream:
        """A new stream (offcore uses one per copy direction)."""

    def new_event(self, *, enable_timing: bool = False) -> Event:
        """A new, unrecorded event."""

    def allocate(self, nbytes: int, tier: Tier) -> Any:
        """A raw ``uint8`` buffer of ``nbytes`` on ``tier`` (device, pinned or pageable host)."""

    def holds(self, buffer: Any) -> bool:
        """True when ``buffer`` (a tensor or array) lives in this device's memory."""

    def copy_(self, dst: Any, src: Any, *, stream: Stream, start_event: Event | None = None) -> Event:
        """Enqueue ``dst[...] = src`` on ``stream`` and return an event that completes when it lands.

        ``dst`` and ``src`` have the same number of bytes; either side may be a
        non-contiguous view. The caller orders ``stream`` after the producer of ``src``.
        ``start_event`` (a timing event, optional): recorded on ``stream`` immediately before
        the copy's own work, after whatever the backend does on the host first (checks,
        staging), so that ``start_event.elapsed_time(done)`` times the transfer alone
        (Note [Copy timings start at the copy] in offcore_torch's runtime).
        """

    def host_pool(self, budget: int | str, *, pinned: bool = True) -> HostBufferPool:
        """A new budgeted pool of exact-size host buffers that are copy endpoints of this device.

        ``pinned``: page-locked buffers (where the backend has them), else pageable ones.
        Bindings create one per (budget, pinned) and reuse its buffers from step to step;
        a backend without pinned memory may return pageable buffers for both.
        """

    def memory_stats(self) -> MemoryStats:
        """Device memory figures (allocated and peak bytes, capacity)."""

    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking from the current allocation."""

    def synchronize(self) -> None:
        """Block until all work on all of this device's streams has completed."""

    def __enter__(self) -> Backend: ...

    def __exit__(self, *exc: object) -> None: ...
