"""Parameters streamed by next use: ``offload_parameters`` keeps a model's parameters on the host.

Between uses every parameter (and, with ``buffers=True``, every buffer) lives in a pinned
host buffer; its device storage is empty. Each module's parameters are copied in on the
runtime's host-to-device stream before its forward and again before its backward, by the
deadline the core scheduler (:class:`offcore.residency.ResidencyScheduler`) learnt from
earlier steps, within a byte budget of copies made ahead of use; the device copy is freed
after the last use of each pass. The ``nn.Parameter`` objects stay the same objects
(optimizers, tied weights and ``state_dict`` keys keep working).

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> with dev:
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ...     handle = offcore_torch.offload_parameters(model, dev)
    ...     for _ in range(2):
    ...         model(torch.randn(8, 64)).square().mean().backward()
    >>> handle.stats().h2d_copies > 0
    True
    >>> handle.remove()                     # every parameter back on the device, bit-identical

# Note [Parameter storage is swapped, the Parameter object is not]
# A parameter's device memory is freed and re-allocated *under* its storage:
# ``untyped_storage().resize_(0)`` frees it, ``resize_(nbytes)`` allocates it again and an
# H2D copy fills it (FSDP does the same with its unsharded parameters). The tensor, its
# ``UntypedStorage`` object, its version counter and every view of it stay the same
# objects. That matters for autograd: ``Linear`` saves ``weight.t()``, a view that holds
# the *storage*, not the Parameter; swapping ``param.data`` instead would leave that view
# on the old memory (nothing freed until backward). Why it is safe:
# - the version counter: the copies write through an alias made with ``set_`` (its own
#   version counter), and ``resize_`` of a storage bumps no version, so streaming never
#   changes ``param._version``; autograd's check of a saved parameter still catches a real
#   in-place change between forward and backward (an optimizer step before backward);
# - the values: a parameter saved for backward is read by backward only after its module's
#   backward pre-hook (a multi-grad hook on the module's outputs, which fires before any of
#   the module's backward nodes runs) has copied it in again and the compute stream waited
#   for the copy; the host copy is exact, so backward reads the bytes forward read;
# - a use nobody announced (a weight used outside its module's forward, ``load_state_dict``,
#   an optimizer step) goes through ``__torch_function__`` of the parameter's class (a
#   subclass of ``nn.Parameter`` set on the same object) and fetches it synchronously; it
#   stays on the device until the end of backward or the optimizer step;
# - a device copy whose version counter moved (an optimizer step, ``load_state_dict``) is
#   written back to the host before it is freed, and so is every buffer of a module that ran
#   forward in training mode (BatchNorm's kernel updates its running statistics in place
#   without a version bump), so the host copy is always the data.
# A storage is resized only on the compute stream, after every copy touching it completed
# (a copy in flight is waited for first), so no copy reads freed memory.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from offcore_layout import describe, plain_tensor_problem
from torch.optim.optimizer import register_optimizer_step_post_hook

from offcore.errors import CapacityExceededError, ConfigurationError, CopyFailedError, OffcoreError, OffcoreWarning
from offcore.kinds import Direction, Kind, Tier
from offcore.ledger import Ledger
from offcore.objects import State
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore.units import parse_size
from offcore_torch.budget import shared_budget_for
from offcore_torch.nvme import nvme_tier_for, open_nvme
from offcore_torch.runtime import DeviceRuntime, check_bool, check_device, runtime_for

__all__ = ["offload_parameters", "ParameterOffloadHandle", "ParameterOffloadStats"]

_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
_SEARCH = 64  # how far ahead of the cursor a use is looked up in the predicted sequence
_UNIT_SECONDS = 1e-3  # the first step's predicted spacing of uses (seconds), before anything was measured

_CALL_IMPL_CODE = torch.nn.Module._call_impl.__code__  # Note [Forwards ended by a BaseException]

# functions that read no tensor data: a parameter whose storage is empty may pass through them
_METADATA = frozenset(
    {
        "untyped_storage",
        "_typed_storage",
        "data_ptr",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "get_device",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__hash__",
        "__len__",
        "_is_view",
        "__reduce_ex__",
        "__deepcopy__",
        "__setstate__",
        "_version",
    }
)


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
# storage; Note [A batch of copies is one work item] in backends/offcore_cpu/device.py), each copy
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


# ------------------------------------------------------------------------- tensors
def _tensors(tree: Any, keep: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts for which ``keep`` is true."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if keep(item):
                out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return out


def _offcore_tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return _tensors((args, kwargs), lambda t: getattr(t, "_offcore_slot", None) is not None)


def _torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Fetch offloaded parameters that an operator reads outside their module's announced use."""
    if torch.compiler.is_compiling():  # Note [Compiled blocks are units]: fetched at the block's eager call
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    name = getattr(func, "__name__", "")
    if not kwargs and name not in _NOT_PLAIN:
        # Note [An operator inside a module's use]: every offloaded argument is on the device and
        # landed (pinned by its module's call or fetched outside already): nothing to fetch or wait for
        for arg in args:
            if type(arg) in _OFFLOADED:
                slot = arg._offcore_slot
                if not (slot.pins or slot.outside) or slot.event is not None or slot.handle._tier is not None:
                    break
            elif isinstance(arg, (list, tuple, dict)):
                break
        else:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args)
    kwargs = kwargs or {}
    needs = True
    if name in ("__get__", "__set__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__set__" and attr == "data":
            raise ConfigurationError(
                "offload_parameters: replacing .data of an offloaded parameter or buffer would detach it from its "
                "host copy; call handle.remove() first (or copy_() into the parameter instead)"
            )
        needs = name == "__get__" and attr == "data"
    elif name in _METADATA:
        needs = False
    if needs:
        tensors = _offcore_tensors(args, kwargs)
        if tensors:
            handle = tensors[0]._offcore_slot.handle
            handle._use_outside([t._offcore_slot for t in tensors], escaped=name == "__get__")
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class OffloadedParameter(torch.nn.Parameter):
    """The class an offloaded ``nn.Parameter`` carries (the same object; see Note [Parameter storage is swapped])."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


class OffloadedBuffer(torch.Tensor):
    """The class an offloaded buffer carries while ``offload_parameters(..., buffers=True)`` is active."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


_OFFLOADED = frozenset({OffloadedParameter, OffloadedBuffer})
_NOT_PLAIN = _METADATA | {"__get__", "__set__"}  # what _torch_function's general path treats specially

# Note [An operator inside a module's use]
# Every operator on an offloaded parameter passes through ``_torch_function`` (a Python call; ~130
# per step of a small GPT, most of them inside the parameter's own module call). The general path
# collects the offloaded tensors of the arguments and asks the handle to fetch or wait for them;
# inside a module's use the storages are pinned and their copies already waited for, so that
# path does nothing. The fast path sees that from the flat positional arguments alone (each
# offloaded one pinned or fetched outside, with no copy in flight, not on the NVMe tier) and calls
# the operator at once; anything else (keyword arguments, nested lists, metadata functions,
# ``.data``) takes the general path.


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

    def __init__(self, index: int, handle: ParameterOffloadHandle, tensor: torch.Tensor, name: str, is_buffer: bool):
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

    handle: ParameterOffloadHandle | None = None

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


# ------------------------------------------------------------------------- the handle
class ParameterOffloadHandle:
    """What :func:`offload_parameters` returns: ``stats()``, ``release()``, ``remove()`` (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: Any,
        *,
        budget: int | str | float | None,
        buffers: bool,
        pinned: bool,
        margin: float | str,
        prefetch: str,
        persist_below: int = 0,
        record: bool = False,
        nvme: Any = None,
        tier: str = "host",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigurationError(f"offload_parameters needs an nn.Module, got {type(model).__name__}")
        if getattr(model, "_offcore_parameter_handle", None) is not None:
            raise ConfigurationError("this model's parameters are offloaded already (call handle.remove() first)")
        self.model = model
        self.device = device
        self.runtime: DeviceRuntime = runtime_for(device)
        self.ledger = Ledger()
        self.buffers = buffers
        self.prefetch = prefetch
        self.persist_below = persist_below
        self.record = record
        self._persistent: list[torch.Tensor] = []  # below persist_below: kept on the device, never offloaded
        self._persistent_ids: set[int] = set()
        self._recorded: list[dict[str, Any]] = []  # record=True: one entry per step (schedule log, settings, actions)
        self._tier: Any = None  # Note [Parameters on NVMe]
        self._tier_owned = False
        self._nvme = nvme
        self._margin = margin
        self._slots: list[_Slot] = []
        self._by_storage: dict[int, _Slot] = {}
        self._units: list[_Unit] = []
        self._module_unit: dict[int, _Unit] = {}
        self._histories: dict[tuple[bool, bool], _History] = {}
        self._step: _Step | None = None
        self._frames: list[tuple[_Unit | None, list[_Slot], bool]] = []
        self._tasks: set[int] = set()
        self._hooks: list[Any] = []
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "stalls", "unplanned", "outside", "evicted", "refused", "steps", "copy_failures"), 0
        )
        self._removed = False
        self._pool: Any = None
        self._foreign_step = False  # an optimizer stepped since the last release point
        self._early: frozenset[int] = frozenset()  # Note [The next step starts early]
        self._turn: frozenset[int] = frozenset()  # Note [Backward's first parameters stay after forward]
        self._thread = threading.current_thread()
        self._last_mode: tuple[bool, bool] | None = None  # the mode of the last step that ended
        self._host_optimizers: set[int] = set()  # ids of optimizers stepping the host copies (and their host ones)

        # a device that is entered (``with dev:``) to place allocations on it, and can be inactive now
        self._enterable = hasattr(device, "__enter__") and hasattr(device, "active")
        # Note [A module's copies are one batch]: the backend's copy_many (an optional member), if it has one
        self._copy_many: Callable[..., Any] | None = getattr(device, "copy_many", None)
        self._collect(model)
        self._param_ids = {id(s.tensor) for s in self._slots}
        largest = max((u.nbytes for u in self._units), default=0)
        capacity = int(getattr(device, "capacity", 0) or 0)
        if budget is None:
            self.budget = 2 * largest
        elif isinstance(budget, float) and not isinstance(budget, bool) and 0.0 < budget <= 1.0:
            if capacity <= 0:
                raise ConfigurationError("budget as a fraction needs a device with a known capacity")
            self.budget = int(budget * capacity)
        else:
            self.budget = parse_size(budget, what="parameter budget", allow_zero=True)
        self._capacity = capacity
        # Note [One device budget across kinds] (offcore/budget.py): offcore_torch.device_budget's, if set
        self._shared = shared_budget_for(device)
        if self._shared is not None:
            if budget is None:
                self.budget = self._shared.capacity_bytes
            self._shared.attach(self, _no_evict, minimum=largest, what="the largest module's parameters")
        try:
            if tier == "nvme":
                self._tier, self._tier_owned = open_nvme(device, nvme)
            self._offload_all()
            self._install()
        except BaseException:
            self._teardown()
            raise
        model._offcore_parameter_handle = self  # type: ignore[assignment]

    # -- setup -----------------------------------------------------------------------
    def _slot_for(self, tensor: torch.Tensor, name: str, is_buffer: bool) -> _Slot | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        problem = None if tensor.is_meta else plain_tensor_problem(tensor)  # meta: "on meta", below
        if problem is not None:  # Note [Raw pointers see checked tensors only]: checked before any storage use
            raise ConfigurationError(
                f"offload_parameters: {name} ({describe(tensor)}) cannot be offloaded: {problem}. Offload plain "
                "dense parameters (FSDP2 shards its parameters itself: offload its optimizer with "
                "offcore_torch.distributed.FSDPOffloadOptimizer)"
            )
        if tensor.numel() == 0:
            return None
        storage = tensor.untyped_storage()
        slot = self._by_storage.get(id(storage))
        if slot is not None:
            if slot.tensor is not tensor:
                raise ConfigurationError(
                    f"offload_parameters: {name} shares its storage with {slot.name} but is another tensor; "
                    "tie parameters by assigning the same nn.Parameter (model.head.weight = model.emb.weight)"
                )
            return slot
        if tensor.storage_offset() != 0 or storage.nbytes() != tensor.numel() * tensor.element_size():
            raise ConfigurationError(
                f"offload_parameters: {name} is a view into a larger storage; only tensors that own their whole "
                "storage can be offloaded"
            )
        if tensor.numel() * tensor.element_size() < self.persist_below:
            # Note [Small parameters stay on the device]
            if id(tensor) not in self._persistent_ids:
                if tensor.device.type != "cpu" and not self.device.holds(tensor):
                    raise ConfigurationError(
                        f"offload_parameters: {name} is on {tensor.device}, neither in the device's memory nor on "
                        "the host"
                    )
                self._persistent_ids.add(id(tensor))
                self._persistent.append(tensor)
            return None
        from_host = not self.device.holds(tensor)
        if from_host and tensor.device.type != "cpu":
            raise ConfigurationError(
                f"offload_parameters: {name} is on {tensor.device}, neither in the device's memory nor on the host"
            )
        slot = _Slot(len(self._slots), self, tensor, name, is_buffer)
        slot.from_host = from_host
        if not from_host:
            self.ledger.add(Tier.DEVICE, Kind.PARAMETER, slot.nbytes)  # on the device until offloaded
        self._slots.append(slot)
        self._by_storage[id(storage)] = slot
        return slot

    def _collect(self, model: torch.nn.Module) -> None:
        # Note [Compiled blocks are units]
        # A block compiled with ``torch.compile(block)`` (an ``OptimizedModule``; FSDP2's per-block recipe) is
        # one unit: every parameter of its tree is fetched by the wrapper's own hooks, which run eagerly at the
        # block's boundary, and released after it (backward: the output's hook fetches them again). Hooks and
        # ``__torch_function__`` traced inside the compiled code return at once (``is_compiling()`` is a
        # constant for dynamo): no graph break, and nothing of offcore's state guarded, so no recompile.
        compiled: list[str] = []
        for mod_name, module in model.named_modules():
            if any(mod_name.startswith(prefix) for prefix in compiled):
                continue
            members = [("", module)]
            if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
                compiled.append(f"{mod_name}." if mod_name else "")
                members = list(module.named_modules())
            slots: list[_Slot] = []
            for sub_name, sub in members:
                self._collect_own(sub, ".".join(n for n in (mod_name, sub_name) if n), slots)
            if slots:
                unit = _Unit(len(self._units), mod_name or type(module).__name__, slots, sum(s.nbytes for s in slots))
                self._units.append(unit)
                self._module_unit[id(module)] = unit

    def _collect_own(self, module: torch.nn.Module, mod_name: str, slots: list[_Slot]) -> None:
        """Add the slots of ``module``'s own parameters (and buffers) to ``slots``."""
        for pname, param in module._parameters.items():
            if param is None:
                continue
            slot = self._slot_for(param, f"{mod_name}.{pname}".lstrip("."), False)
            if slot is not None and slot not in slots:
                slots.append(slot)
        if self.buffers:
            for bname, buf in module._buffers.items():
                if buf is None:
                    continue
                slot = self._slot_for(buf, f"{mod_name}.{bname}".lstrip("."), True)
                if slot is not None and slot not in slots:
                    slots.append(slot)

    def _offload_all(self) -> None:
        dev, rt = self.device, self.runtime
        for tensor in self._persistent:  # Note [Small parameters stay on the device]
            if not dev.holds(tensor):
                self._to_device_with_data(tensor)
        if self._tier is not None:
            self._offload_all_to_nvme()
            return
        # one pinned block holding every host copy exactly (slices are 512-byte aligned)
        total = max(512, sum(-(-s.nbytes // 512) * 512 for s in self._slots))
        self._pool = dev.host_pool(total, pinned=True, block_size=total)
        compute = dev.current_stream()
        rt.d2h_stream.wait_stream(compute)
        last = None
        for slot in self._slots:
            slot.host = self._pool.acquire(slot.nbytes)
            slot.host_view = slot.host.view
            self.ledger.add(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
            if slot.from_host:
                slot.host_view.copy_(slot.alias)
                continue
            last = dev.copy_(slot.host_view, slot.alias, stream=rt.d2h_stream)
        if last is not None:
            last.synchronize()
        for slot in self._slots:
            if slot.from_host:
                self._to_device_empty(slot)
            self._set_class(slot)
            self._resize(slot, 0)
            slot.resident = False
        self.ledger.reset_step()  # peaks and copies count from here

    # -- the NVMe tier (Note [Parameters on NVMe]) ----------------------------------------
    # Note [Parameters on NVMe]
    # With an NVMe tier (``nvme=`` per call, or the device's ``offcore_torch.nvme_tier``) each storage's
    # copy between uses is a file of the tier (key ``(id(handle), slot index)``), written once at setup
    # and again whenever a device copy changed (``_write_back``: D2H into a staging buffer, then the
    # write, both awaited). Host memory is a pinned *staging* pool (the budget plus four of the largest
    # module's parameters, at most every parameter), not a copy of every parameter. A use is two hops:
    # NVMe -> staging buffer (the tier's read) and staging buffer -> device (the H2D copy). Every key
    # of a step whose storages are only on disk is ``spilled`` to the ResidencyScheduler, which plans
    # the reads on the tier's measured read link (``stage_duration``: ``tier.read_link``) so that each
    # lands by the trigger that starts its H2D copy (Note [Two hops from NVMe] in offcore/residency.py):
    # the prefetch of such a key starts earlier by the read's time. STAGE actions start the reads
    # (refused when the pool is full: offered again); each trigger tells the scheduler which reads
    # landed (``staged``, itself a trigger). A use whose read has not landed waits for it (or reads
    # on demand). A staging buffer goes back once its H2D copy landed (``_ready``; on a GPU that
    # waits for the copy on the host), when the device copy is freed, and at the end of a step; when
    # the pool is full on a use, buffers no use holds go first, then the stages in flight
    # (``stage_failed``). The host copy is never the data, so ``host_tensor`` (an OffloadOptimizer
    # stepping the host copies in place) is refused with a ConfigurationError. ``remove()`` brings the
    # parameters back a storage at a time and removes the files (the handle's own tier is closed, its
    # directory removed; a device's tier loses the handle's keys).
    def _offload_all_to_nvme(self) -> None:
        dev, rt = self.device, self.runtime
        largest = max((u.nbytes for u in self._units), default=0)
        rounded = sum(-(-s.nbytes // 512) * 512 for s in self._slots)
        staging = max(512, min(rounded, self.budget + 4 * largest + 512 * len(self._slots)))
        self._pool = dev.host_pool(staging, pinned=True, block_size=staging)
        rt.d2h_stream.wait_stream(dev.current_stream())
        for slot in self._slots:  # one at a time through one staging buffer
            buffer = self._pool.acquire(slot.nbytes)
            try:
                if slot.from_host:
                    buffer.view.copy_(slot.alias)
                else:
                    dev.copy_(buffer.view, slot.alias, stream=rt.d2h_stream).synchronize()
                key = (id(self), slot.index)
                self._tier.write(key, buffer.view.numpy(), kind=Kind.PARAMETER).synchronize()
                slot.disk_key = key
                self.ledger.add(Tier.NVME, Kind.PARAMETER, slot.nbytes)
            finally:
                self._pool.release(buffer)
            if slot.from_host:
                self._to_device_empty(slot)
            self._set_class(slot)
            self._resize(slot, 0)
            slot.resident = False
        self.ledger.reset_step()

    def _acquire_host(self, slot: _Slot, *, reclaim: bool, keep: Collection[_Slot] = ()) -> bool:
        """A staging buffer for ``slot``; with ``reclaim``, buffers no use needs now (none of ``keep``) are
        given back first when the pool is full (False: no room)."""
        try:
            buffer = self._pool.acquire(slot.nbytes)
        except CapacityExceededError:
            if not reclaim:
                return False
            kept = (slot, *keep)
            self._reclaim_host(keep=kept)
            try:
                buffer = self._pool.acquire(slot.nbytes)
            except CapacityExceededError:
                self._reclaim_host(keep=kept, stages=True)  # the stages in flight go too (read again later)
                buffer = self._pool.acquire(slot.nbytes)  # only the storages in use hold buffers now
        slot.host = buffer
        slot.host_view = buffer.view
        self.ledger.add(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
        return True

    def _start_read(self, slot: _Slot) -> None:
        assert slot.host_view is not None
        slot.reading = self._tier.read(slot.disk_key, slot.host_view.numpy())

    def _finish_read(self, slot: _Slot) -> None:
        reading, slot.reading = slot.reading, None
        if reading is not None:
            try:
                reading.synchronize()  # raises the tier's error (missing, truncated, checksum) naming the file
            except BaseException:
                self._release_host(slot)
                raise

    def _host_in(self, slots: list[_Slot]) -> None:
        """The host copies of ``slots`` in host memory (read from NVMe on demand, or the stage awaited)."""
        for slot in slots:
            if slot.host is None:
                # the others of the list are not pinned yet (a module's pre-hook pins after its copies): a
                # full pool must not give back the buffers this call just filled or awaits
                self._acquire_host(slot, reclaim=True, keep=slots)
                self._start_read(slot)
        for slot in slots:
            self._finish_read(slot)

    def _release_host(self, slot: _Slot) -> None:
        """Give ``slot``'s staging buffer back once no copy out of it or read into it is in flight."""
        if slot.host is None or self._tier is None:
            return
        if slot.reading is not None:
            with contextlib.suppress(Exception):  # its error was reported where it was needed, or never will be
                slot.reading.synchronize()
            slot.reading = None
        landing, slot.landing = slot.landing, None
        if landing is not None:
            try:
                if not landing.query():
                    landing.synchronize()
            except Exception:  # Note [A failed copy is a completed copy]: it reads the buffer no more
                self._copy_failed()
        self._pool.release(slot.host)
        self.ledger.remove(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
        slot.host = None
        slot.host_view = None

    def _reclaim_host(self, keep: Collection[_Slot] = (), *, stages: bool = False) -> None:
        """Give back every staging buffer no use holds now and not of ``keep`` (their data stays on NVMe);
        ``stages``: those of the stages in flight too (the scheduler offers them again)."""
        step = self._step
        if stages and step is not None:
            for key in list(step.staging):
                del step.staging[key]
                step.rs.stage_failed(key)
        spared = {id(s) for slots in step.staging.values() for s in slots} if step is not None else set()
        spared.update(id(s) for s in keep)  # and those the caller is filling
        for slot in self._slots:
            if slot.host is not None and not slot.pins and id(slot) not in spared:
                self._release_host(slot)

    def _stage(self, step: _Step, key: int) -> bool:
        """Start the NVMe -> host reads of ``key``'s storages not in host memory (False: no staging room)."""
        unit = self._units[step.sequence[key][0]]
        started: list[_Slot] = []
        for slot in unit.slots:
            if slot.host is None and not slot.resident:
                if not self._acquire_host(slot, reclaim=False):
                    for done in started:
                        self._release_host(done)
                    return False
                self._start_read(slot)
                started.append(slot)
        step.staging[key] = unit.slots
        return True

    def _poll_stages(self, step: _Step, t: float) -> None:
        """Tell the scheduler which stages landed (each a trigger: its prefetches may start now)."""
        for key, slots in list(step.staging.items()):
            if step.staging.get(key) is not slots:
                # an earlier key's actions took this stage meanwhile: a prefetch that found the staging pool
                # full gave back every stage in flight (_reclaim_host(stages=True)); the scheduler offers it again
                continue
            if all(s.reading is None or s.reading.query() for s in slots):
                del step.staging[key]
                for slot in slots:
                    self._finish_read(slot)
                self._execute(step, step.rs.staged(key, t))

    def _to_device_with_data(self, tensor: torch.Tensor) -> None:
        """A small tensor of a model built on the host moves to the device with its values (it stays there)."""
        with self._device_active():
            new = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=self.device.torch_device
            )
            with torch.no_grad():
                new.copy_(tensor)
        with torch.no_grad():
            tensor.data = new

    def _to_device_empty(self, slot: _Slot) -> None:
        """A tensor of a model built on the host gets a device storage (one tensor on the device at a time,
        freed right after by the caller), so the whole model never has to fit on the device."""
        tensor = slot.tensor
        with self._device_active():
            new = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=self.device.torch_device
            )
        with torch.no_grad():
            tensor.data = new
        slot.storage = new.untyped_storage()
        slot.alias = torch.empty(0, dtype=torch.uint8, device=new.device).set_(slot.storage)
        slot.vref = _version_ref(tensor)
        slot.version = slot.vref._version
        self.ledger.add(Tier.DEVICE, Kind.PARAMETER, slot.nbytes)

    def _set_class(self, slot: _Slot) -> None:
        tensor = slot.tensor
        slot.klass = type(tensor)
        if slot.is_buffer:
            if type(tensor) is not torch.Tensor:
                raise ConfigurationError(f"offload_parameters: buffer {slot.name} is a {type(tensor).__name__}")
            tensor.__class__ = OffloadedBuffer
        else:
            if type(tensor) is not torch.nn.Parameter:
                raise ConfigurationError(
                    f"offload_parameters: parameter {slot.name} is a {type(tensor).__name__}; only plain "
                    "nn.Parameter objects can be offloaded"
                )
            tensor.__class__ = OffloadedParameter
        tensor._offcore_slot = slot  # type: ignore[attr-defined]

    def _install(self) -> None:
        seen: set[int] = set()
        modules = [self.model] + [m for m in self.model.modules() if id(m) in self._module_unit]
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook))
            self._hooks.append(module.register_forward_hook(self._post_hook, always_call=True))
        for slot in self._slots:
            if not slot.is_buffer and slot.tensor.requires_grad:
                self._hooks.append(slot.tensor.register_post_accumulate_grad_hook(self._accumulated))
        self._hooks.append(register_optimizer_step_post_hook(self._optimizer_stepped))

    # -- device memory -----------------------------------------------------------------
    def _resize(self, slot: _Slot, nbytes: int) -> None:
        """Allocate (``nbytes``) or free (0) the device memory under ``slot``'s storage, on the compute stream."""
        dev = self.device
        if self._enterable and not dev.active:
            with dev:
                self._resize_now(slot, nbytes)
        else:
            self._resize_now(slot, nbytes)
        if nbytes:
            self.ledger.add(Tier.DEVICE, Kind.PARAMETER, nbytes)
        elif slot.resident:
            self.ledger.remove(Tier.DEVICE, Kind.PARAMETER, slot.nbytes)

    @staticmethod
    def _resize_now(slot: _Slot, nbytes: int) -> None:
        if nbytes:
            # an operator (not UntypedStorage.resize_ from Python): both of the fake device's
            # accountings see it, and torch allocates with the storage's own allocator
            slot.alias.resize_(nbytes)
        else:
            slot.storage.resize_(0)
            slot.alias.set_(slot.storage)  # a dispatched op on the storage: the accounting sees the size

    @contextlib.contextmanager
    def _device_active(self) -> Iterator[None]:
        dev = self.device
        if not self._enterable or dev.active:
            yield
            return
        with dev:
            yield

    def _copy_in(self, slots: list[_Slot]) -> Any:
        """Allocate and start the H2D copies of the slots not on the device; returns the last copy's event."""
        need = [s for s in slots if not s.resident]
        if not need:
            return None
        dev, rt = self.device, self.runtime
        if self._tier is not None:
            self._host_in(need)  # Note [Parameters on NVMe]: the first hop, if its stage has not landed
        done: list[_Slot] = []
        try:
            for slot in need:
                self._resize(slot, slot.nbytes)
                slot.resident = True
                done.append(slot)
        except BaseException:
            for slot in done:
                self._resize(slot, 0)
                slot.resident = False
            raise
        h2d = rt.h2d_stream
        h2d.wait_stream(dev.current_stream())
        try:
            event = None
            many = self._copy_many
            batch: list[_Slot] = []
            nbytes = 0
            for slot in need:
                nbytes += slot.nbytes
                timed = rt.sample(Direction.H2D)
                if many is not None and not timed:
                    batch.append(slot)  # Note [A module's copies are one batch]
                    continue
                start, issued = rt.begin_timing(dev, h2d, record=False) if timed else (None, 0.0)
                event = dev.copy_(slot.alias, slot.host_view, stream=h2d, start_event=start)
                if timed:
                    rt.end_timing(
                        dev,
                        h2d,
                        start,
                        issued,
                        nbytes=slot.nbytes,
                        direction=Direction.H2D,
                        label="param",
                        ledger=self.ledger,
                    )
                slot.event = event
                slot.landing = event
                slot.version = slot.vref._version
            if batch:
                if len(batch) > 1:
                    batch.sort(key=_slot_bytes)  # the small ones first: they may run at once on an idle stream
                event = many([(slot.alias, slot.host_view) for slot in batch], stream=h2d)
                for slot in batch:
                    slot.event = event
                    slot.landing = event
                    slot.version = slot.vref._version
        except BaseException:
            # Note [A parameter copy that failed is copied again]: a copy refused at submission leaves the ones
            # issued before it in flight (a batch's events are not even on their slots yet). Let them land
            # before anything frees their storages or returns their staging buffers, and leave every storage of
            # this call not resident: its host copy is intact, the next use copies it again.
            with contextlib.suppress(Exception):
                h2d.synchronize()
            self.runtime.recover(h2d)
            for slot in need:
                slot.event = slot.landing = None
                if slot.resident:
                    self._resize(slot, 0)
                    slot.resident = False
            raise
        self.ledger.record_copy(Direction.H2D, nbytes, copies=len(need))
        return event

    def _ready(self, slots: list[_Slot], label: str) -> None:
        """Make the compute stream wait for the copies into ``slots`` still in flight."""
        compute = None
        for slot in slots:
            event = slot.event
            if event is None:
                continue
            slot.event = None
            try:
                if event.query():
                    continue
            except Exception as exc:  # Note [A parameter copy that failed is copied again]
                self._copy_again(slot, exc)
                continue
            if compute is None:
                compute = self.device.current_stream()
            t0 = time.perf_counter()
            try:
                compute.wait_event(event)
            except Exception as exc:  # Note [A parameter copy that failed is copied again]
                self._copy_again(slot, exc)
            self.ledger.record_wait(time.perf_counter() - t0, what=label)
        if self._tier is not None:  # the staging buffers go back once their copies landed
            for slot in slots:
                if slot.host is not None and slot.resident:
                    self._release_host(slot)

    # Note [A prefetch refused at submission is not an error of the caller's]
    # Prefetches are issued from wherever a trigger lands: a module's hooks, and also the end of an
    # OffloadOptimizer's step() (host_updated starts the next round early, Note [The next step starts
    # early]). A prefetch copy that the device refuses at submission (``copy_`` raising) left
    # _copy_in's storages not resident, their host copies intact; raising it out of step() told the
    # caller the step failed *after* the update was applied, so a retry applied it twice. A prefetch is
    # only ahead of time: its failure is a warning and a counted copy failure, the prefetch is refused
    # for this trigger, and the use copies the storages in (raising there, where nothing else happened,
    # if that copy fails too). Out-of-memory refusals stay what they were (no more prefetches).

    # Note [A parameter copy that failed is copied again]
    # A host-to-device copy of a parameter can fail on its stream (the event raises when waited for,
    # as an asynchronous CUDA error does; the fake device's injected faults do). The host copy is
    # intact (Note [A failed copy is a completed copy] in runtime.py), so: the stream's sticky error is
    # cleared (runtime.recover), and where the device copy is needed now (a use waits for it) it is
    # copied again, once, and waited for; where it is not (a prefetch nobody used, dropped or freed)
    # nothing is written back -- the device copy never held the data. A second failure raises
    # CopyFailedError, with the storage freed and not resident, so the next use copies it again. A
    # write-back (device to host) that fails is copied again the same way from the device copy, which
    # stays resident if the second one fails too.
    # Before, the failed event stayed on the slot: every later step re-raised the same error, and
    # handle.remove() too (the model could not even be taken back).
    def _copy_failed(self) -> None:
        self._counters["copy_failures"] += 1
        self.runtime.recover(self.runtime.h2d_stream)

    def _copy_again(self, slot: _Slot, first: BaseException) -> None:
        """A use waits for ``slot``'s copy, which failed on its stream: copy it again from the host (once)."""
        self._copy_failed()
        warnings.warn(
            f"offcore: the host-to-device copy of {slot.name} failed on its stream ({first}); copied again from "
            "its intact host copy (Note [A parameter copy that failed is copied again])",
            OffcoreWarning,
            stacklevel=3,
        )
        try:
            if self._tier is not None and slot.host is None:
                self._host_in([slot])
            self.device.copy_(slot.alias, slot.host_view, stream=self.runtime.h2d_stream).synchronize()
        except Exception as again:
            self.runtime.recover(self.runtime.h2d_stream)
            self._resize(slot, 0)
            slot.resident = False
            raise CopyFailedError(
                f"offload_parameters: the copy of {slot.name} to the device failed twice ({first}; {again}). Its "
                "host copy is intact: fix the cause and run the step again (the next use copies it again)"
            ) from again
        slot.version = slot.vref._version

    def _maybe_free(self, slot: _Slot) -> None:
        if not slot.resident or slot.pins or slot.holds or slot.bwd_tasks or slot.outside or self._removed:
            return
        if slot.event is not None:  # a prefetch nobody used: let it land first
            event, slot.event = slot.event, None
            try:
                event.synchronize()
            except Exception:  # Note [A parameter copy that failed is copied again]: nothing to write back
                self._copy_failed()
                slot.version = slot.vref._version
        if slot.dirty or slot.vref._version != slot.version:
            self._write_back(slot)
        self._resize(slot, 0)
        slot.resident = False
        if slot.host is not None and self._tier is not None:
            self._release_host(slot)

    def _write_back(self, slot: _Slot) -> None:
        """Copy a device copy that changed (its version moved, or ``.data`` escaped) back to the host."""
        dev, rt = self.device, self.runtime
        rt.d2h_stream.wait_stream(dev.current_stream())
        rt.d2h_stream.wait_stream(rt.h2d_stream)  # after any upload into it (an optimizer's, too)
        if self._tier is not None and slot.host is None:
            self._acquire_host(slot, reclaim=True)  # overwritten whole by the D2H below
        try:
            dev.copy_(slot.host_view, slot.alias, stream=rt.d2h_stream).synchronize()
        except Exception as first:
            # Note [A parameter copy that failed is copied again], the other way: the device copy is the data
            # and intact (still resident); copied again, once; a second failure keeps it on the device
            self._counters["copy_failures"] += 1
            rt.recover(rt.d2h_stream)
            warnings.warn(
                f"offcore: the write-back of {slot.name} to the host failed on its stream ({first}); copied again "
                "from its intact device copy (Note [A parameter copy that failed is copied again])",
                OffcoreWarning,
                stacklevel=3,
            )
            try:
                dev.copy_(slot.host_view, slot.alias, stream=rt.d2h_stream).synchronize()
            except Exception as again:
                rt.recover(rt.d2h_stream)
                raise CopyFailedError(
                    f"offload_parameters: the write-back of {slot.name} to the host failed twice ({first}; {again}). "
                    "Its device copy is intact and stays on the device: fix the cause and run the step again"
                ) from again
        self.ledger.record_copy(Direction.D2H, slot.nbytes)
        if self._tier is not None:  # the disk copy is the data between uses (Note [Parameters on NVMe])
            assert slot.host_view is not None
            self._tier.write(slot.disk_key, slot.host_view.numpy(), kind=Kind.PARAMETER).synchronize()
        slot.version = slot.vref._version
        slot.dirty = False

    # -- steps -------------------------------------------------------------------------
    def _mode(self) -> tuple[bool, bool]:
        return (torch.is_grad_enabled(), self.model.training)

    def _default_sequence(self, grad: bool) -> list[tuple[int, str]]:
        forward = [(u.id, "f") for u in self._units if not u.name.startswith("<outside")]
        backward = [(uid, "b") for uid, _ in reversed(forward)] if grad else []
        return forward + backward

    def _begin_step(self, t: float, mode: tuple[bool, bool] | None = None) -> _Step:
        self._end_step()
        if self._foreign_step:  # an optimizer stepped since: what it fetched is written back and freed
            self._release_outside()
        mode = self._mode() if mode is None else mode
        history = self._histories.get(mode)
        if history is None:
            history = self._histories[mode] = _History(Scheduler(margin=self._margin))
        sequence = history.sequence if history.sequence is not None else self._default_sequence(mode[0])
        rt = self.runtime
        rt.poll()
        rs = _ParameterScheduler(
            history.predictor,
            duration=rt.h2d_duration,
            prefetch=self.prefetch,
            budget=self.budget,
            device_capacity=self._capacity,
            device_in_use=self._device_in_use if self._capacity else None,
            shared_budget=self._shared,
            record=self.record,
            stage_duration=self._tier.read_link.duration if self._tier is not None else None,
        )
        rs.handle = self
        ratio = history.predictor.backward_ratio
        rs.forward_began(t)
        for key, (uid, _) in enumerate(sequence):
            # a synthetic save time whose reverse-order default puts use ``key`` at key x 1 ms
            rs.produced(key, t - key * _UNIT_SECONDS / ratio)
            rs.register(key, Kind.PARAMETER, self._units[uid].nbytes, name=self._units[uid].name)
            rs.offload_started(key, _DONE)
            rs.landed(key, needed=False)
            if self._tier is not None and any(s.host is None and not s.resident for s in self._units[uid].slots):
                rs.spilled(key)  # Note [Parameters on NVMe]: two hops, the stage planned on the NVMe link
        actions = rs.forward_ended(t)
        rs.backward_began(t)  # one round on one clock from the step's start: forward and backward uses alike
        step = self._step = _Step(rs, history, list(sequence), t_last=t, mode=mode)
        self._early = self._first_forward_slots(sequence) if mode[0] else frozenset()
        # not under a shared device budget: a kept copy is not reserved there (the budget's bound holds)
        self._turn = self._first_backward_slots(sequence) if mode[0] and self._shared is None else frozenset()
        self._counters["steps"] += 1
        self._execute(step, actions)
        return step

    def _first_forward_slots(self, sequence: list[tuple[int, str]]) -> frozenset[int]:
        """The storages the next forward uses first, up to the budget: backward's last uses keep them."""
        return self._first_slots(sequence, "f")

    def _first_backward_slots(self, sequence: list[tuple[int, str]]) -> frozenset[int]:
        """The storages backward uses first, up to the budget: not freed after their forward use."""
        return self._first_slots(sequence, "b")

    def _first_slots(self, sequence: list[tuple[int, str]], pass_tag: str) -> frozenset[int]:
        """The storages of the first units of one pass (``"f"`` / ``"b"``) in ``sequence``, up to the budget."""
        out: set[int] = set()
        total = 0
        for uid, tag in sequence:
            if tag != pass_tag:
                continue
            unit = self._units[uid]
            total += unit.nbytes
            if total > self.budget:
                break
            out.update(slot.index for slot in unit.slots)
        return frozenset(out)

    # Note [Backward's first parameters stay after forward]
    # The last modules of forward are the first of backward, a loss computation apart. Freed after
    # their forward use, they would be copied in again at once, and that copy is exposed at the start
    # of backward (the plan issues it at the last forward trigger, too late to hide it). So in a
    # grad-enabled step the storages backward uses first (up to the budget, as for Note [The next step
    # starts early]) stay on the device after their forward use; the plan's prefetch for their
    # backward use finds them there (no copy) and holds them, and their backward use frees them after
    # their gradients are accumulated. A step that ends without a backward frees them (``_end_step``).
    # Not under a shared device budget (offcore_torch.device_budget): a copy kept this way is not
    # reserved there, and the budget's bound on the device peak must hold.

    def _device_in_use(self) -> int:
        device = self.device
        fast = getattr(device, "allocated_bytes", None)  # optional member (offcore.protocols.OPTIONAL_MEMBERS)
        if fast is not None:
            return int(fast())
        stats = device.memory_stats()
        return int(getattr(stats, "allocated_bytes", None) or stats.get("allocated_bytes", 0))

    def _end_step(self) -> None:
        """Close the running step: teach its history, drop prefetches nobody used, free what is left."""
        step, self._step = self._step, None
        if step is None:
            return
        rs = step.rs
        rs.backward_ended(step.t_last)  # teaches the predictor; nothing is held on landing here
        for key, slots in list(step.held.items()):
            self._drop_hold(step, key, slots)
        for index in self._turn - self._early:  # kept for a backward that did not come (or has passed)
            self._maybe_free(self._slots[index])
        if self._tier is not None:  # stages nobody used: their buffers go back (the data stays on NVMe)
            step.staging.clear()
            self._reclaim_host()
        rs.detach_budget()
        if self.record:
            self._recorded.append({"log": list(rs.log), "settings": rs.settings(), "actions": list(rs.actions)})
        step.history.sequence = step.actual
        self._last_mode = step.mode
        self.runtime.resolve_timings()

    def _evicted_now(self, rs: ResidencyScheduler, key: int) -> None:
        """The shared budget evicted ``key`` for another request: free its held copy now (Note [A parameter
        copy evicted for another owner is freed at once])."""
        step = self._step
        if step is None or step.rs is not rs or threading.current_thread() is not self._thread:
            return
        slots = step.held.get(key)
        if slots is not None:
            self._drop_hold(step, key, slots)

    def _drop_hold(self, step: _Step, key: int, slots: list[_Slot]) -> None:
        del step.held[key]
        obj = step.rs.objects[key]
        if obj.state is State.PREFETCHING:
            obj.finish_prefetch(stream_waited=True)
        if obj.state is State.RESTORED:
            obj.drop_restored_copy()
        for slot in slots:
            slot.holds -= 1
            self._maybe_free(slot)

    def _execute(self, step: _Step, actions: Iterator[Any]) -> None:
        rs = step.rs
        for action in actions:
            key = action.key
            if action.kind is ActionKind.PREFETCH:
                unit = self._units[step.sequence[key][0]]
                try:
                    event = self._copy_in(unit.slots)
                except Exception as exc:
                    if _is_oom(exc):
                        self._counters["refused"] += 1
                        rs.refused(key, "oom")
                        continue
                    # Note [A prefetch refused at submission is not an error of the caller's]
                    self._counters["copy_failures"] += 1
                    warnings.warn(
                        f"offcore: the prefetch of {unit.name}'s parameters failed at submission ({exc}); they are "
                        "copied in when used (Note [A prefetch refused at submission is not an error of the "
                        "caller's])",
                        OffcoreWarning,
                        stacklevel=2,
                    )
                    rs.refused(key, "failed")
                    continue
                for slot in unit.slots:
                    slot.holds += 1
                step.held[key] = unit.slots
                rs.started(key, event)
            elif action.kind is ActionKind.STAGE:
                if self._stage(step, key):
                    rs.stage_started(key)
                else:
                    rs.stage_refused(key, "no_room")
            elif action.kind is ActionKind.EVICT:
                slots = step.held.get(key)
                self._counters["evicted"] += 1
                if slots is not None:
                    self._drop_hold(step, key, slots)

    def _match(self, step: _Step, uid: int, tag: str) -> int | None:
        sequence = step.sequence
        end = min(len(sequence), step.cursor + _SEARCH)
        for key in range(step.cursor, end):
            if sequence[key] == (uid, tag):
                step.cursor = key + 1
                return key
        return None

    def _use(self, unit: _Unit, tag: str) -> None:
        """A use of ``unit`` now: its storages on the device and the compute stream ordered after their copies.

        The storages are pinned while the scheduler's actions run (an eviction must not free a
        storage this use shares with the evicted one); the caller pins them for the use itself.
        """
        t = time.perf_counter()
        step = self._step
        if step is None:
            step = self._begin_step(t)
        self.runtime.poll()
        if step.staging:
            self._poll_stages(step, t)
        step.actual.append((unit.id, tag))
        step.t_last = t
        key = self._match(step, unit.id, tag)
        rs = step.rs
        for slot in unit.slots:
            slot.pins += 1
        try:
            if key is None:
                missing = any(not s.resident for s in unit.slots)
                self._copy_in(unit.slots)
                self._counters["unplanned" if missing else "hits"] += 1
                self._ready(unit.slots, unit.name)
                return
            if key in step.held:
                actions = rs.used(key, t, managed_key=key)
                self._ready(unit.slots, unit.name)
                rs.awaited(key)
                rs.consumed(key)
                self._counters["hits"] += 1
                for slot in step.held.pop(key):
                    slot.holds -= 1
            else:
                missing = any(not s.resident for s in unit.slots)
                event = self._copy_in(unit.slots)
                rs.reloaded(key, event)
                self._counters["stalls" if missing else "hits"] += 1
                actions = rs.used(key, t, managed_key=key)
                rs.consumed(key)
                self._ready(unit.slots, unit.name)
            self._execute(step, actions)
        finally:
            for slot in unit.slots:
                slot.pins -= 1

    # -- hooks -------------------------------------------------------------------------
    # Note [Forwards ended by a BaseException]
    # The post hook that pops a module's frame is registered with ``always_call=True``, but torch calls
    # those hooks only when forward raised an ``Exception``: a ``KeyboardInterrupt`` (or ``SystemExit``,
    # ``GeneratorExit``) raised in forward or in a user's hook leaves every frame of that forward behind,
    # and the handle believed it was inside forward from then on: ``remove()`` refused forever and the
    # step never ended (its pins and pinned buffers held). A frame is stale when no call of a module this
    # handle hooks is on the stack of the handle's thread: the root model's pre hook finding frames checks
    # that (a root model is not called inside its own forward), so does ``remove()``; stale frames are
    # dropped as a failed forward's are (``_abort``).
    def _frames_are_stale(self) -> bool:
        if threading.current_thread() is not self._thread:
            return False  # a forward may be running on the handle's thread
        hooked = {id(self.model), *self._module_unit}
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _CALL_IMPL_CODE and id(frame.f_locals.get("self")) in hooked:
                return False
            frame = frame.f_back
        return True

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # Note [Compiled blocks are units]
            return
        if self._frames and module is self.model and self._frames_are_stale():
            self._abort()  # Note [Forwards ended by a BaseException]
        unit = self._module_unit.get(id(module))
        in_backward = _graph_task_id() >= 0
        frame: tuple[_Unit | None, list[_Slot], bool] = (unit, [], in_backward)
        if not self._frames and not in_backward:
            if self._tasks:
                self._forget_failed_backwards()
            self._frames.append(frame)
            if self._foreign_step:
                self._release_outside()
            step = self._step
            if step is None or not step.prestarted or step.forward_seen or step.mode != self._mode():
                step = self._begin_step(time.perf_counter())
            step.forward_seen = True
        else:
            self._frames.append(frame)
        if unit is None:
            return
        self._use(unit, "f")
        training = module.training
        for slot in unit.slots:
            slot.pins += 1
            frame[1].append(slot)
            if training and slot.is_buffer:
                # kernels update buffers without a version bump (BatchNorm's running statistics)
                slot.dirty = True

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if not self._frames:
            return
        unit, pinned, in_backward = self._frames.pop()
        failed = sys.exc_info()[0] is not None
        task = _graph_task_id()
        for slot in pinned:
            slot.pins -= 1
            if task >= 0 and not failed:
                self._pin_backward(slot, task)
        if failed and not self._frames:
            self._abort()
            return
        if unit is not None and not failed and task < 0 and torch.is_grad_enabled():
            tensors = _output_tensors(output)
            if len(tensors) == 1:
                # one output: its tensor hook fires once per backward pass, before the module's backward
                # nodes run, as register_multi_grad_hook(mode="any") would (without its per-call lock and
                # wrapper, a measurable cost per module call)
                tensors[0].register_hook(self._backward_hook(unit))
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_hook(unit), mode="any")
        turn = self._turn if task < 0 and not failed and torch.is_grad_enabled() else ()
        for slot in pinned:
            if slot.index not in turn:  # Note [Backward's first parameters stay after forward]
                self._maybe_free(slot)

    def _backward_hook(self, unit: _Unit) -> Callable[[Any], None]:
        def hook(_grad: Any) -> None:
            task = _graph_task_id()
            self._use(unit, "b")
            for slot in unit.slots:
                self._pin_backward(slot, task)

        return hook

    def _pin_backward(self, slot: _Slot, task: int) -> None:
        if task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(task))
        slot.bwd_tasks.add(task)

    def _accumulated(self, param: torch.Tensor) -> None:
        slot = getattr(param, "_offcore_slot", None)
        if slot is None:
            return
        slot.bwd_tasks.discard(_graph_task_id())
        if slot.index in self._early and not self._frames and len(self._tasks) <= 1 and not self._host_optimizers:
            return  # needed first by the next forward: kept for the next round (Note [The next step starts early])
        self._maybe_free(slot)

    # Note [A backward that raised leaves its task behind]
    # A parameter used by a backward is kept on the device until that backward's end (``bwd_tasks``, the
    # graph task's ``queue_callback``). A backward that raised never runs its callbacks: its task stayed in
    # ``_tasks`` and on its slots for good. Those copies were then never freed (device memory held until
    # ``remove()``), the step-end work of Note [The next step starts early] never ran again, and
    # ``host_updated`` skipped them -- so after an OffloadOptimizer step the next forward read the copy
    # fetched before the step: silently stale parameters (a tied embedding, used first and last, showed it;
    # tests/torch/test_abandoned_step_combinations.py). The handle is driven from one thread and a backward
    # runs to its end before the thread that called it goes on, so a task still recorded when that thread
    # is outside any backward and any module call (a top-level forward begins, ``host_updated``,
    # ``release``) belongs to a backward that raised: it is ended there, as if it had returned.
    def _forget_failed_backwards(self) -> None:
        """End the backward tasks that raised (Note [A backward that raised leaves its task behind])."""
        if self._frames or _graph_task_id() >= 0 or threading.current_thread() is not self._thread:
            return
        for task in list(self._tasks):
            self._backward_done(task)

    def _backward_done(self, task: int) -> None:
        self._tasks.discard(task)
        last = not self._tasks
        for slot in self._slots:
            slot.bwd_tasks.discard(task)
        if last:
            self._release_outside()
            if not self._frames and self._step is not None and not self._removed and not self._host_optimizers:
                # Note [The next step starts early]: its first copies of what is still on the device cost nothing.
                # In the mode of the step that ends: autograd runs this callback with grad disabled, and a
                # round begun in that mode would never be taken over by the next (grad-enabled) forward
                step = self._begin_step(time.perf_counter(), mode=self._step.mode)
                step.prestarted = True
        # what the next forward needs first stays, whether or not the new round's plan holds it yet (its
        # copy would otherwise be freed here and made again, exposed, at the forward: Note [The next step
        # starts early]); its first use frees it after the module, as any copy
        keep = self._early if last and self._step is not None and self._step.prestarted else frozenset()
        for slot in self._slots:
            if slot.index not in keep:
                self._maybe_free(slot)

    # Note [The next step starts early]
    # When a backward ends (outside any forward), the next step's round begins at once, in the
    # same mode: its first copies (the first modules' forward, or what an optimizer step reads
    # next) start under the optimizer step and data loading instead of at the next forward,
    # where they would be exposed. The next top-level forward takes this round over when its
    # mode (grad enabled, train/eval) matches and no forward used it yet; otherwise it ends it
    # (its copies are dropped) and begins its own. The step's clock starts at the end of
    # backward, so the learnt use times include the time between steps. Backward's last uses
    # are the next forward's first: the storages the next forward needs first (up to the
    # budget) are not freed when their gradients are accumulated, so the new round's first
    # copies find them on the device and cost nothing.

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After any optimizer's step (a global hook: it may run on another thread, e.g. a host optimizer
        on a worker). One that steps these parameters: write back what it fetched and changed, free it.
        Any other (a host optimizer whose step is uploaded into these parameters by its owner, as
        OffloadOptimizer does): only noted; the next release point writes back what was fetched."""
        if id(optimizer) in self._host_optimizers:
            return  # steps the host copies (Note [Parameters on the host with offload_parameters])
        ours = self._param_ids
        if any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
            if self._frames or threading.current_thread() is not self._thread:
                self._foreign_step = True
                return
            self._foreign_step = True
            self._release_outside()  # the next step's prefetches (already started) stay
        else:
            self._foreign_step = True

    def _release_outside(self) -> None:
        """Free what was fetched outside a module; after an optimizer step, write it all back first."""
        fetched = [s for s in self._slots if s.outside]
        if not fetched:
            self._foreign_step = False
            return
        if self._foreign_step:
            # an optimizer may have uploaded into the parameters on a copy stream (OffloadOptimizer),
            # and copies need not bump the version counter: wait for them, write every copy back
            self._foreign_step = False
            self.runtime.h2d_stream.synchronize()
            for slot in fetched:
                slot.dirty = True
        for slot in fetched:
            slot.outside = False
            self._maybe_free(slot)

    def _use_outside(self, slots: list[_Slot], *, escaped: bool) -> None:
        """An operator reads ``slots``: those no module call pins now are fetched and kept until released."""
        if self._removed:
            return
        fresh = [s for s in slots if not (s.outside or s.pins)]
        if fresh:
            task = _graph_task_id()
            fresh = [s for s in fresh if task < 0 or task not in s.bwd_tasks]
        if fresh:
            step = self._step
            for slot in fresh:
                if step is not None and not slot.resident:
                    if slot.unit is None:
                        slot.unit = _Unit(len(self._units), f"<outside {slot.name}>", [slot], slot.nbytes)
                        self._units.append(slot.unit)
                    self._use(slot.unit, "o")
                slot.outside = True
            self._counters["outside"] += len(fresh)
            self._copy_in(fresh)
        self._ready(slots, "outside")
        if escaped:
            for slot in slots:
                slot.dirty = True

    def _abort(self) -> None:
        """Forward raised at the top level: drop every pin, hold and prefetch of the step."""
        self._frames.clear()
        for slot in self._slots:
            slot.pins = 0
        self._end_step()
        for slot in self._slots:
            self._maybe_free(slot)

    # -- public ------------------------------------------------------------------------
    def release(self) -> None:
        """Write back what changed and free every device copy not in use (after an optimizer step, an
        exception, or to read device memory between steps). Called automatically after ``optimizer.step()``."""
        if self._frames:
            return
        if self._tasks:
            self._forget_failed_backwards()
        self._end_step()
        self._release_outside()
        for slot in self._slots:
            self._maybe_free(slot)

    def host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host copy of an offloaded parameter or buffer (a typed view of its pinned buffer).

        Writing it changes the parameter: call :meth:`host_updated` afterwards.
        """
        slot = getattr(tensor, "_offcore_slot", None)
        if slot is None or slot.handle is not self:
            raise ConfigurationError("host_tensor: this tensor is not offloaded by this handle")
        if self._tier is not None:
            raise ConfigurationError(
                "the parameters of this handle live on NVMe (offload_parameters(..., nvme=...) or the device's "
                "nvme_tier): they have no host copy to step in place, so OffloadOptimizer cannot use them as its "
                "masters yet; pass params_on_host=False to OffloadOptimizer (its own host masters), or "
                "offload_parameters(..., tier='host') to keep the parameters in host memory"
            )
        assert slot.host_view is not None
        return slot.host_view.view(tensor.dtype).view(tensor.shape)

    def host_updated(self, tensors: Any = None) -> None:
        """The host copies were changed (a host optimizer step): device copies still held are dropped, so
        the next use streams the new values in. With an OffloadOptimizer attached, the next step's round
        begins now (Note [The next step starts early]): its first copies, of the new values, start.

        ``tensors`` (default: every parameter) are the ones whose host copy is the data now: their
        device copies are dropped *without* being written back (a copy fetched before the step holds
        the old values)."""
        if tensors is None:
            updated = [s for s in self._slots if not s.is_buffer]
        else:
            updated = []
            for tensor in tensors:
                slot = getattr(tensor, "_offcore_slot", None)
                if slot is None or slot.handle is not self:
                    raise ConfigurationError("host_updated: a tensor is not offloaded by this handle")
                updated.append(slot)
        for slot in updated:
            slot.outside = False
            slot.dirty = False
            slot.version = slot.vref._version
        self.release()  # ends a backward that raised too (Note [A backward that raised leaves its task behind])
        for slot in self._slots:
            if slot.resident and not (slot.pins or slot.bwd_tasks):
                if slot.event is not None:
                    event, slot.event = slot.event, None
                    try:
                        event.synchronize()
                    except Exception:  # Note [A parameter copy that failed is copied again]: dropped anyway
                        self._copy_failed()
                self._resize(slot, 0)
                slot.resident = False
        mode = self._last_mode
        if (
            self._host_optimizers
            and mode is not None
            and mode[0]
            and not (self._frames or self._tasks or self._removed)
        ):
            # Note [The next step starts early], after the host step: its first copies are of the new values
            step = self._begin_step(time.perf_counter(), mode=mode)
            step.prestarted = True

    def _attach_host_optimizer(self, optimizer: Any) -> None:
        """An OffloadOptimizer steps these host copies in place (Note [Parameters on the host with
        offload_parameters] in optimizer.py): its steps are not foreign steps, and nothing is kept or
        copied in at the end of backward (the values change in the step)."""
        self._host_optimizers.add(id(optimizer))
        host = getattr(optimizer, "host_optimizer", None)
        if host is not None:
            self._host_optimizers.add(id(host))
        self._early = frozenset()

    def _detach_host_optimizer(self, optimizer: Any) -> None:
        self._host_optimizers.discard(id(optimizer))
        host = getattr(optimizer, "_host", None)
        if host is not None:
            self._host_optimizers.discard(id(host))

    def stats(self, *, reset: bool = False) -> ParameterOffloadStats:
        """Bytes, copies and waits so far (see :class:`ParameterOffloadStats`)."""
        self.runtime.resolve_timings()
        ledger = self.ledger
        h2d, d2h = ledger.copies[Direction.H2D], ledger.copies[Direction.D2H]
        host = {"parameter": 0, "buffer": 0}
        nvme = 0
        for slot in self._slots:
            if slot.disk_key is not None:
                nvme += slot.nbytes  # on disk between uses; its host bytes are the staging pool's
            else:
                host["buffer" if slot.is_buffer else "parameter"] += slot.nbytes
        out = ParameterOffloadStats(
            host_bytes=host,
            device_bytes=ledger.bytes(Tier.DEVICE, Kind.PARAMETER),
            peak_device_bytes=ledger.peak(Tier.DEVICE, Kind.PARAMETER),
            h2d_bytes=h2d.bytes,
            h2d_copies=h2d.copies,
            d2h_bytes=d2h.bytes,
            d2h_copies=d2h.copies,
            prefetch_hits=self._counters["hits"],
            stalls=self._counters["stalls"],
            unplanned=self._counters["unplanned"],
            outside_fetches=self._counters["outside"],
            evicted=self._counters["evicted"],
            refused=self._counters["refused"],
            steps=self._counters["steps"],
            budget=self.budget,
            exposed_wait_s=ledger.wait_seconds,
            waits=dict(ledger.waits),
            persistent_bytes=sum(t.numel() * t.element_size() for t in self._persistent),
            nvme_bytes=nvme,
            staging_bytes=self._pool.reserved_bytes if self._tier is not None and self._pool is not None else 0,
            copy_failures=self._counters["copy_failures"],
        )
        if reset:
            ledger.reset_step()
            for name in self._counters:
                self._counters[name] = 0
        return out

    @property
    def schedules(self) -> list[dict[str, Any]]:
        """Each finished step's schedule (needs ``record=True``): ``{"log", "settings", "actions"}``, the
        events fed to that step's :class:`~offcore.residency.ResidencyScheduler` with their times, its
        settings and the actions it returned. ``offcore.sim.replay.replay(s["log"], **s["settings"])``
        decides ``s["actions"]`` again (without a shared device budget, which a replay does not model).

            >>> s = handle.schedules[-1]                                        # doctest: +SKIP
            >>> replay(s["log"], **s["settings"]) == s["actions"]               # doctest: +SKIP
            True
        """
        if not self.record:
            raise ConfigurationError("this handle records no schedule: pass record=True to offload_parameters")
        return list(self._recorded)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of every parameter (and buffer, with ``buffers=True``) this handle manages."""
        return sum(s.nbytes for s in self._slots)

    @property
    def largest_module_bytes(self) -> int:
        """Bytes of the largest module's own parameters (what one use brings in at once)."""
        return max((u.nbytes for u in self._units), default=0)

    def remove(self) -> None:
        """Bring every parameter and buffer back to the device (bit-identical) and remove every hook."""
        if self._removed:
            return
        if self._frames and not self._frames_are_stale():
            raise OffcoreError("handle.remove() inside the model's forward")
        if self._frames:  # Note [Forwards ended by a BaseException]
            self._abort()
        self._end_step()
        for slot in self._slots:
            slot.outside = False
            slot.holds = 0
            slot.bwd_tasks.clear()
            self._maybe_free(slot)  # writes back what changed
        if self._tier is not None:  # through the staging buffers, a storage at a time
            for slot in self._slots:
                self._copy_in([slot])
                self._ready([slot], "remove")
        else:
            self._copy_in(self._slots)
            self._ready(self._slots, "remove")
        self._teardown()

    def discard(self) -> None:
        """Remove every hook and give the host copies back *without* bringing the parameters back: the
        model is unusable afterwards (its parameters have empty storages). For a model that would not
        fit on the device whole, once it is no longer needed."""
        if self._removed:
            return
        self._frames.clear()
        self._step = None
        self._teardown(restore=False)

    def _teardown(self, *, restore: bool = True) -> None:
        self._removed = True
        if self._shared is not None:
            self._shared.detach(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with contextlib.suppress(Exception):
            self.runtime.h2d_stream.synchronize()
            self.runtime.d2h_stream.synchronize()
        for slot in self._slots:
            if slot.tensor.__dict__.get("_offcore_slot") is slot:
                del slot.tensor._offcore_slot  # type: ignore[attr-defined]
                slot.tensor.__class__ = slot.klass
            if not slot.resident and restore:  # setup failed half-way: restore from the host copy
                if slot.host_view is None and slot.disk_key is not None and self._tier is not None:
                    self._host_in([slot])  # its copy is on NVMe
                self._resize(slot, slot.nbytes)
                slot.resident = True
                assert slot.host_view is not None
                slot.alias.copy_(slot.host_view)
            if slot.host is not None:
                self._pool.release(slot.host)
                self.ledger.remove(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
                slot.host = None
                slot.host_view = None
        self._close_tier()
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.trim()
        if getattr(self.model, "_offcore_parameter_handle", None) is self:
            del self.model._offcore_parameter_handle

    def _close_tier(self) -> None:
        """Remove this handle's files: its own tier is closed (its directory goes), a device's shared tier
        loses this handle's keys."""
        tier, self._tier = self._tier, None
        if tier is None:
            return
        for slot in self._slots:
            if slot.reading is not None:
                with contextlib.suppress(Exception):
                    slot.reading.synchronize()
                slot.reading = None
            if slot.disk_key is not None:
                if not self._tier_owned:
                    with contextlib.suppress(Exception):
                        tier.delete(slot.disk_key)
                self.ledger.remove(Tier.NVME, Kind.PARAMETER, slot.nbytes)
                slot.disk_key = None
        if self._tier_owned:
            tier.close()

    def __enter__(self) -> ParameterOffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"ParameterOffloadHandle({len(self._slots)} storages, {self.parameter_bytes} bytes, budget {self.budget}"
            f"{', removed' if self._removed else ''})"
        )


def offload_parameters(
    model: torch.nn.Module,
    device: Any,
    *,
    budget: int | str | float | None = None,
    buffers: bool = False,
    pinned: bool = True,
    margin: float | str = "0.5ms",
    prefetch: str = "deadline",
    persist_below: int | str = 0,
    record: bool = False,
    nvme: Any = None,
    tier: str | None = None,
) -> ParameterOffloadHandle:
    """Keep ``model``'s parameters on the host between uses, streamed in by next use (see the module doc).

    - ``budget``: device bytes copied in ahead of their use at once (bytes, ``"64MiB"``, or a
      fraction of the device's capacity such as ``0.1``); default twice the largest module's
      own parameters. The module being computed is not counted: the device holds at most
      ``budget`` + the parameters in use.
    - ``buffers``: offload buffers too (BatchNorm running statistics are written back when forward
      changed them).
    - ``margin``: slack before each predicted use; ``prefetch``: ``"deadline"`` (each copy planned to land
      just before its predicted use), ``"asap"`` (the next uses' copies start as soon as the budget has room:
      the deepest prefetch the budget allows, for links whose copy times the plan underestimates) or
      ``"on_demand"``.
    - ``persist_below``: parameters (and buffers) smaller than this many bytes stay on the device
      (biases, norms: each use of one costs as much CPU as a large weight's; Note [Small
      parameters stay on the device]); default 0 (everything streamed).
    - ``tier``: ``"host"`` (default) keeps the parameters in pinned host memory between uses; ``"nvme"`` on
      disk, staged NVMe -> pinned host -> device (Note [Parameters on NVMe]), in the tier ``nvme=`` names
      or else the device's (:func:`offcore_torch.nvme_tier`) -- as for activations and the optimizer, the
      device's tier is used only when asked for.
    - ``nvme``: a directory or an :class:`offcore.nvme.NvmeSpec` (a path and a byte budget) for this
      handle's own tier; giving it implies ``tier="nvme"``.
    - ``record``: keep each step's scheduler events and actions (:attr:`ParameterOffloadHandle.schedules`),
      replayable through :func:`offcore.sim.replay.replay` to the same actions.

    Returns a :class:`ParameterOffloadHandle` (``stats()``, ``release()``, ``remove()``; also a
    context manager that removes itself).

        >>> handle = offload_parameters(model, dev, budget="32MiB")   # doctest: +SKIP
    """
    check_device(device, "offload_parameters")
    check_bool(buffers, "buffers", "offload_parameters")
    check_bool(pinned, "pinned", "offload_parameters")
    if prefetch not in ("deadline", "asap", "on_demand"):
        raise ConfigurationError(f"prefetch must be 'deadline', 'asap' or 'on_demand', got {prefetch!r}")
    if not pinned:
        raise ConfigurationError(
            "offload_parameters keeps host copies in pinned memory (pinned=False is not supported)"
        )
    if not isinstance(margin, (int, float)):
        from offcore.units import parse_duration

        margin = parse_duration(margin, what="margin")
    if not math.isfinite(float(margin)) or margin < 0:
        raise ConfigurationError(f"margin must be a non-negative duration, got {margin!r}")
    persist = parse_size(persist_below, what="persist_below", allow_zero=True)
    if nvme is False:  # the spelling of "host" before tier= existed
        nvme = None
    if tier is None:
        tier = "nvme" if nvme is not None else "host"
    if tier not in ("host", "nvme"):
        raise ConfigurationError(
            f"tier={tier!r}: parameters live in 'host' memory (the default) or on 'nvme' (nvme=PATH, or the "
            "device's tier set with offcore_torch.nvme_tier(device, PATH))"
        )
    if tier == "host" and nvme is not None:
        raise ConfigurationError(f"nvme={nvme!r} was given with tier='host': pass tier='nvme' (or leave tier out)")
    if tier == "nvme" and nvme is None and nvme_tier_for(device) is None:
        raise ConfigurationError(
            "tier='nvme' needs a tier: pass nvme=PATH (or an offcore.nvme.NvmeSpec), or set the device's with "
            "offcore_torch.nvme_tier(device, PATH, budget=...)"
        )
    return ParameterOffloadHandle(
        model,
        device,
        budget=budget,
        buffers=buffers,
        pinned=pinned,
        margin=margin,
        prefetch=prefetch,
        persist_below=persist,
        record=bool(record),
        nvme=nvme,
        tier=tier,
    )
