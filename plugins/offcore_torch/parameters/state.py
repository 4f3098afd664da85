"""What offload_parameters keeps per parameter and per step (``_Slot``, ``_Step``,
``ParameterOffloadStats``), its constants and helpers.

Moved from parameters.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offcore.errors import CapacityExceededError
from offcore.residency import ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore_torch.parameters.tensors import _tensors

_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
_SEARCH = 64  # how far ahead of the cursor a use is looked up in the predicted sequence
_UNIT_SECONDS = 1e-3  # the first step's predicted spacing of uses (seconds), before anything was measured

_CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__  # Note [Forwards ended by a BaseException]


def _no_evict(key: int) -> None:
    """The handle itself holds no reservation (its per-step schedulers do)."""


def _version_ref(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor sharing ``tensor``'s storage and version counter (Note [Versions are read through a plain alias])."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.detach(tensor)


# Note [Versions are read through a plain alias]
# Streaming compares a parameter's version counter before and after each use (a copy that
# changed is written back). Reading ``param._version`` on the offloaded class goes through
# ``__torch_function__`` (a Python call per read, hundreds per step); ``detach()`` of the
# parameter shares its version counter and its storage object, so ``slot.vref._version`` reads
# the same counter at C speed. The alias holds no memory of its own (the storage is resized
# under both); it is made again whenever the parameter's storage is replaced (``_to_device_empty``).


# Note [Small parameters stay on the device]
# ``persist_below`` (bytes) keeps every parameter or buffer smaller than it on the device for
# good, as DeepSpeed ZeRO-3's ``stage3_param_persistence_threshold`` does: a bias or a LayerNorm
# weight costs a copy, a resize and its bookkeeping on every use (as much CPU as a large
# weight's) for a few bytes of device memory. Such a tensor gets no slot and keeps its class
# (no ``__torch_function__``), a module whose parameters are all small gets no unit (no hooks,
# no scheduler use), and ``remove()``/``discard()`` leave it as it is. Its bytes count in
# ``stats().persistent_bytes``, not in ``host_bytes``; a model built on the host has it moved to
# the device with its values at setup.


# Note [A module's copies are one batch]
# A module's storages (a weight and its bias) are used together, so ``_copy_in`` hands the untimed
# copies of one use to the backend's optional ``copy_many`` (offcore.protocols.OPTIONAL_MEMBERS) at
# once, smallest first, and every slot of the batch waits for its one event (the last copy's): the
# fake device queues them as one work item (one hand-off to its copy worker instead of one per
# storage; Note [A batch of copies is one work item] in backends/offcore_cpu/copying.py), each copy
# still paying its own latency on the link. A copy the runtime times (``rt.sample``) is issued on its
# own with its start event, as before, so the link estimate is unchanged.


def _slot_bytes(slot: _Slot) -> int:
    return slot.nbytes


def _no_graph_task() -> int:
    return -1


# the running backward's graph task id (-1 outside backward): torch's own function where it has one
# (called several times per module call; a Python wrapper around it cost a frame each time)
_graph_task_id: Callable[[], int] = _GRAPH_TASK_ID if _GRAPH_TASK_ID is not None else _no_graph_task


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (CapacityExceededError, torch.OutOfMemoryError))


class _Done:
    """A completed event (parameters start on the host: their first offload is already done)."""

    def query(self) -> bool:
        return True


_DONE = _Done()


# ------------------------------------------------------------------------- state
class _Slot:
    """One storage (a parameter or buffer; tied parameters share one) and its host copy."""

    __slots__ = (
        "index",
        "handle",
        "tensor",
        "name",
        "storage",
        "alias",
        "nbytes",
        "host",
        "host_view",
        "is_buffer",
        "resident",
        "event",
        "pins",
        "holds",
        "bwd_tasks",
        "outside",
        "version",
        "dirty",
        "klass",
        "unit",
        "from_host",
        "vref",
        "disk_key",
        "reading",
        "landing",
    )

    def __init__(self, index: int, handle: Any, tensor: torch.Tensor, name: str, is_buffer: bool):
        self.index = index
        self.handle = handle
        self.tensor = tensor
        self.name = name
        self.storage = tensor.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.alias = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(self.storage)
        self.host: Any = None
        self.host_view: torch.Tensor | None = None
        self.is_buffer = is_buffer
        self.resident = True
        self.event: Any = None  # H2D into the storage, not yet waited for by the compute stream
        self.pins = 0  # module calls using it now
        self.holds = 0  # prefetches made ahead of a use, not yet used
        self.bwd_tasks: set[int] = set()  # backward passes that still need it
        self.outside = False  # fetched outside an announced use: kept until backward ends or the optimizer stepped
        self.vref = _version_ref(tensor)  # Note [Versions are read through a plain alias]
        self.version = self.vref._version
        self.dirty = False
        self.klass: type = type(tensor)
        self.unit: _Unit | None = None  # the unit of a use outside a module
        self.from_host = False  # the model was built on the host: the tensor moves to the device empty
        self.disk_key: Any = None  # its key on the NVMe tier (Note [Parameters on NVMe]); None: host memory
        self.reading: Any = None  # the NVMe -> host read into ``host`` in flight
        self.landing: Any = None  # the last H2D copy out of ``host`` (the staging buffer is reused after it)


class _ParameterScheduler(ResidencyScheduler):
    """The handle's per-step scheduler: a copy the shared budget evicts is freed at once (Note [A parameter
    copy evicted for another owner is freed at once])."""

    handle: Any = None  # the ParameterOffloadHandle (parameters.py), or None

    def _budget_evict(self, key: int) -> None:
        counted = key in self._counted
        super()._budget_evict(key)
        handle = self.handle
        if counted and handle is not None:
            handle._evicted_now(self, key)


# Note [A parameter copy evicted for another owner is freed at once]
# Under one device budget (offcore/budget.py) another owner's request may evict a parameter copy
# held ahead of its use. The scheduler bookkeeps at once and hands the EVICT to the binding at its
# next trigger -- for parameters the next module call, while an activation region's unpacks come
# many times between two of those: each of its requests could evict another held parameter copy
# and allocate its own before any of them was freed, so the device held the evicted copies *and*
# their replacements (measured: up to the whole budget twice over; the "about 1 run in 4" overshoot
# of tests/torch/test_device_budget.py). The handle frees such a copy inside the eviction instead
# (on its own thread; from another thread the EVICT waits for the next trigger as before): what the
# budget gives to the request is free on the device before the request allocates. The EVICT still
# reaches the handle at its next trigger and finds nothing held (counted only), so the actions, the
# log and a replay are unchanged.


@dataclass(eq=False)
class _Unit:
    """The storages one module call (or one use outside a module) needs."""

    id: int
    name: str
    slots: list[_Slot]
    nbytes: int


@dataclass(eq=False)
class _History:
    """What earlier steps of one mode (grad enabled, train/eval) taught: the use order and its times."""

    predictor: Scheduler
    sequence: list[tuple[int, str]] | None = None


@dataclass(eq=False)
class _Step:
    """One step: the uses from a top-level forward until the next one, scheduled by one ResidencyScheduler."""

    rs: ResidencyScheduler
    history: _History
    sequence: list[tuple[int, str]]
    actual: list[tuple[int, str]] = field(default_factory=list)
    cursor: int = 0
    held: dict[int, list[_Slot]] = field(default_factory=dict)
    t_last: float = 0.0
    mode: tuple[bool, bool] = (True, True)
    prestarted: bool = False  # begun at the end of the previous backward (Note [The next step starts early])
    forward_seen: bool = False
    staging: dict[int, list[_Slot]] = field(default_factory=dict)  # stages (NVMe -> host) in flight, by key


@dataclass(frozen=True)
class ParameterOffloadStats:
    """What :func:`offload_parameters` did since it started (or since ``stats(reset=True)``).

    Bytes per kind on the host (``host_bytes``: ``{"parameter": ..., "buffer": ...}``);
    parameter bytes on the device now and at peak (offcore's own count of the storages it
    manages); copies and bytes per direction (``d2h`` are write-backs of changed copies);
    ``prefetch_hits`` (uses whose copy was started ahead), ``stalls`` (uses that copied on
    demand), ``unplanned`` (uses the plan did not predict), ``outside_fetches`` (uses outside
    a module call), ``evicted``; ``exposed_wait_s`` and ``waits`` (seconds the compute stream
    waited, per module); ``persistent_bytes`` (parameters below ``persist_below``, kept on the
    device, Note [Small parameters stay on the device]); ``copy_failures`` (copies that failed on their
    stream and were made again or dropped, Note [A parameter copy that failed is copied again]).
    """

    host_bytes: dict[str, int]
    device_bytes: int
    peak_device_bytes: int
    h2d_bytes: int
    h2d_copies: int
    d2h_bytes: int
    d2h_copies: int
    prefetch_hits: int
    stalls: int
    unplanned: int
    outside_fetches: int
    evicted: int
    refused: int
    steps: int
    budget: int
    exposed_wait_s: float
    waits: dict[str, float]
    persistent_bytes: int = 0
    nvme_bytes: int = 0
    staging_bytes: int = 0
    copy_failures: int = 0


def _output_tensors(output: Any) -> list[torch.Tensor]:
    return _tensors(output, lambda t: t.requires_grad)
