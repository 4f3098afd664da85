"""The optimizer's per-parameter records (``_Slot``), its constants and module-level helpers.

(Moved from optimizer.py.)
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from offcore_layout import describe, plain_tensor_problem

from offcore.errors import (
    ConfigurationError,
)
from offcore.pool import HostBuffer

MASTER_WEIGHTS_KEY = "offcore_master_weights"
"""Top-level key of :meth:`OffloadOptimizer.state_dict` holding fp32 masters by parameter index
(only when the masters' dtype differs from the device parameters'; torch optimizers ignore it)."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_NO_STEPS_UNDER_BACKWARD = (
    "OffloadOptimizer: {what} steps parameters under backward, as their gradients land on the host; with "
    "offload_gradients=False the gradients stay on the device until step(), so nothing could step under "
    "backward: drop {what} or keep offload_gradients=True"
)
_LEAD_FRACTION = 16  # step(): the first-needed parameters up to 1/16 of the bytes are stepped (and uploaded) first
_LEAD_MIN_BYTES = 1024**2  # below this many master bytes, step() makes one optimizer call


_MASTER = "offcore_master"  # the fp32 master's entry in a parameter's object on NVMe (Note [Masters on NVMe])
_INFLIGHT_DEFAULT_BYTES = 64 * 1024**2  # max_inflight_gradients: at least this (Note [In-flight gradients are capped])


_UNBOUNDED = 1 << 62  # upload_budget=None: no budget (Note [Uploads are issued in batches])
_UPLOAD_BATCH_BYTES = 1024**2  # uploads of up to this many bytes together are one copy_many (same Note)
_COLLECT, _STEPPED, _USES = "collect", "stepped", "uses"  # phases of a round (Note [The optimizer's moves ...])


class _Slot:
    """One device parameter and its host copies."""

    __slots__ = (
        "index",
        "param",
        "group",
        "master",
        "grad",
        "stage",
        "buffers",
        "accumulated",
        "arrivals",
        "stepped",
        "h2d",
        "synced_version",
        "synced_storage",
        "h2d_versions",
        "h2d_dst",
        "h2d_pair",
        "hook",
        "layout",
        "state_nbytes",
        "state_buf",
        "host_param",
        "upload_due",
        "nvme_master",
        "pre_hook",
        "shown",
        "clears",
        "fresh",
    )

    def __init__(self, index: int, param: torch.Tensor, group: dict[str, Any]) -> None:
        self.index = index
        self.param = param
        self.group = group
        self.master: torch.Tensor = param  # replaced by the host copy
        self.grad: torch.Tensor = param
        self.stage: torch.Tensor | None = None  # pinned, device dtype: casts of masters for the H2D
        self.buffers: list[HostBuffer] = []
        self.accumulated = False  # main thread: the host gradient holds a sum to add to
        self.arrivals = 0  # gradients of this round
        self.stepped = False  # its host step of this round ran (or is queued)
        self.h2d: Any = None  # event of the last H2D of the master into the device parameter
        self.synced_version = param._version
        # Note [Writes to parameters after step()]: the storage the master matched (``p.data = ...`` changes it)
        self.synced_storage = _storage_id(param)
        self.h2d_versions: tuple[int, ...] = ()  # versions the parameter may have once its last H2D landed
        # the last H2D's destination, kept alive until the next one: ``p.data = ...`` may drop the parameter's
        # storage while the copy into it is in flight (Note [Writes to parameters after step()])
        self.h2d_dst: torch.Tensor | None = None
        # the last batched upload's (destination, source), given to copy_many again while both are the same
        # tensors (Note [An upload's destination is made once per storage] in rounds.py)
        self.h2d_pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self.hook: Any = None
        # tier="nvme" (Note [Optimizer states on NVMe]): the state tensors kept on disk, as
        # (name, dtype, shape, byte offset) in one object of ``state_nbytes``; ``state_buf`` is the
        # pool buffer holding them while they are in memory (read for a step, or a failed write)
        self.layout: list[tuple[str, torch.dtype, torch.Size, int]] | None = None
        self.state_nbytes = 0
        self.state_buf: HostBuffer | None = None
        # Note [Parameters on the host with offload_parameters]: the handle's host copy of the parameter
        # (None: the parameter lives on the device and the step is uploaded into it)
        self.host_param: torch.Tensor | None = None
        # Note [One host step at step()]: stepped by step(), its upload not issued yet (sched lock)
        self.upload_due = False
        self.nvme_master = False  # its master lives in its NVMe object between steps (Note [Masters on NVMe])
        # Note [The host gradient is the device parameter's .grad]: the tensor hook that reads ``param.grad``
        # before autograd accumulates into it, and the _HostGradient ``param.grad`` was last set to (or None)
        self.pre_hook: Any = None
        self.shown: torch.Tensor | None = None  # a _HostGradient (optimizer.py)
        self.clears = 0  # times its host gradient was cleared: a _HostGradient of an earlier count is stale
        self.fresh: object | None = None  # Note [Checked fresh in this step()]: the mark of the step() that checked it

    def unhook(self) -> None:
        """Remove its gradient hooks, and the _HostGradient shown as ``param.grad`` if it is still there."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.pre_hook is not None:
            self.pre_hook.remove()
            self.pre_hook = None
        if self.shown is not None and self.param.grad is self.shown:
            self.param.grad = None  # the host gradient goes with the optimizer's host memory
        self.shown = None


class _AllOf:
    """The transfers of one group: ``synchronize()`` waits for all, then raises the first failure."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def synchronize(self) -> None:
        error: BaseException | None = None
        for handle in self.handles:
            try:
                handle.synchronize()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def _params_of(group: Any) -> list[Any]:
    """The parameters of a group (a dict with ``params``, or the parameters themselves): tensors or
    ``(name, tensor)`` pairs, as torch's optimizers take them."""
    params = group["params"] if isinstance(group, dict) else group
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _tensor_of(param: Any) -> Any:
    """The tensor of a parameter given as a tensor or as ``(name, tensor)`` (``model.named_parameters()``)."""
    if isinstance(param, tuple) and len(param) == 2 and isinstance(param[0], str):
        return param[1]
    return param


def _check_params(groups: list[Any]) -> None:
    """Refuse what cannot be offloaded before anything is allocated: non-tensors, sparse parameters."""
    for group in groups:
        for named in _params_of(group):
            param = _tensor_of(named)
            if not isinstance(param, torch.Tensor):
                raise ConfigurationError(
                    f"OffloadOptimizer params must be tensors or (name, tensor) pairs, got {type(param).__name__}"
                )
            name = f" {named[0]!r}" if isinstance(named, tuple) else ""
            if _is_dtensor(param):
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({describe(param)}) is a DTensor (sharded with "
                    "fully_shard / FSDP2): its bytes are the local shard, not the global shape. Use "
                    "offcore_torch.distributed.FSDPOffloadOptimizer(model, optimizer_class, device=...), which steps "
                    "each rank's shard on the host"
                )
            problem = plain_tensor_problem(param)
            if problem is not None and param.layout is torch.strided:
                # Note [Raw pointers see checked tensors only]: the device copies only plain tensors
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({describe(param)}) cannot be offloaded: {problem}. "
                    "Offload plain dense parameters"
                )
            if not param.is_leaf:
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({describe(param)}) is not a leaf tensor (it was computed "
                    f"by {type(param.grad_fn).__name__}); optimizers step leaves: pass the nn.Parameter, or "
                    "tensor.detach().requires_grad_()"
                )
            if param.layout is not torch.strided:
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({tuple(param.shape)}) is sparse ({param.layout}); sparse "
                    "parameters are not supported (the host copies are dense): make it a dense parameter"
                )


def _is_dtensor(tensor: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed when unused)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(tensor, dtensor)


def _check_dense_gradient(slot: _Slot, grad: torch.Tensor) -> None:
    """A sparse gradient (``nn.Embedding(sparse=True)``) is refused before any copy starts."""
    if grad.layout is not torch.strided:
        raise ConfigurationError(
            f"OffloadOptimizer: parameter {slot.index} ({tuple(slot.param.shape)}) got a sparse gradient "
            f"({grad.layout}); sparse gradients are not supported (the host gradient is dense): use a dense "
            "embedding (nn.Embedding(..., sparse=False))"
        )


def _unhooked_step(host: torch.optim.Optimizer) -> None:
    """``host.step()`` without torch's step hooks (global and per-instance): the host optimizer's
    steps are parts of one ``OffloadOptimizer.step()``, whose hooks run once, on the caller's thread
    (Note [Step hooks run once per step])."""
    step = type(host).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        host.step()
    else:
        inner(host)


def _storage_id(param: torch.Tensor) -> int | None:
    """The identity of ``param``'s storage object: ``p.data = ...`` changes it; offload_parameters' freeing and
    re-allocating under the same storage does not (Note [Parameter storage is swapped, the Parameter object
    is not] in parameters.py), nor does it run that class's ``__torch_function__`` (None: no storage)."""
    if type(param) in _NO_TORCH_FUNCTION:  # nothing to disable: spare the context manager (per parameter, per step)
        try:
            return int(param.untyped_storage()._cdata)
        except Exception:
            return None
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return int(param.untyped_storage()._cdata)
        except Exception:
            return None


_NO_TORCH_FUNCTION = (torch.Tensor, torch.nn.Parameter)  # torch dispatches no __torch_function__ for these


def _typed(buffer: HostBuffer, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    return buffer.view.view(dtype).view(shape)


_WORKER_THREAD = threading.local()  # marked on the optimizers' worker threads (Note [Streamed parameters ...])


# Note [Worker tasks without a Future each]
# Each gradient that lands is a task on the optimizer's worker (``_submit``: its ``_land``). A
# ``concurrent.futures.Future`` per task brought about a dozen objects the garbage collector tracks (its Condition,
# lock, waiters, the executor's work item and bound methods), alive from backward until the gradients are settled:
# long enough to be promoted to the oldest generation, so that with thousands of parameters every step ran a full
# collection over the process's objects (~25 µs per parameter at 8,000 small ones, wherever it fell). Tasks are
# ``_Task`` records instead, queued in order and run by one "pump" submitted to the worker while there are any
# (the same single worker thread, in the same order as the executor's queue took them before); ``_futures`` holds
# them, and a Condition per optimizer says when one finished. ``done()`` and ``exception()`` keep the meanings
# the optimizer used from Future (``_drain`` raises the first failure, ``_settle_worker`` keeps the
# failed ones for step()).
class _Task:
    """One task queued on the optimizer's worker (Note [Worker tasks without a Future each])."""

    __slots__ = ("fn", "args", "finished", "error")

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn: Any = fn
        self.args: tuple[Any, ...] | None = args
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished

    def exception(self) -> BaseException | None:
        """The task's exception (asked once it is done), or None."""
        return self.error


def _mark_worker_thread() -> None:
    """The worker's initializer: a module function, so the executor holds no reference to its optimizer."""
    _WORKER_THREAD.marked = True


def _lead_and_rest(slots: list[_Slot]) -> tuple[list[_Slot], list[_Slot]]:
    """``step()``'s two optimizer calls (Note [One host step at step()]): the first-needed parameters
    up to 1/_LEAD_FRACTION of the master bytes (none when there is little to step), then the rest."""
    if len(slots) < 2:
        return [], slots
    total = sum([s.master.nbytes for s in slots])
    if total < _LEAD_MIN_BYTES:
        return [], slots
    lead, size = [], 0
    for slot in slots[:-1]:
        lead.append(slot)
        size += slot.master.nbytes
        if size * _LEAD_FRACTION >= total:
            break
    return lead, slots[len(lead) :]


def _grad_accumulator(param: torch.Tensor) -> Any:
    """The AccumulateGrad node of a leaf ``param`` (the node that writes its ``.grad``).

    The view is taken past the parameter's own ``__torch_function__``: an ``offload_parameters``
    parameter would take it for a use outside a module and fetch (and hold) its device copy; the
    view reads no data and its node is the parameter's, whatever its class."""
    with torch.enable_grad(), torch._C.DisableTorchFunctionSubclass():
        return param.view_as(param).grad_fn.next_functions[0][0]


def _accumulates(accumulator: Any) -> bool:
    """Inside a parameter's tensor hook: whether this pass writes ``.grad`` (runs the parameter's AccumulateGrad
    node). False under ``torch.autograd.grad(..., inputs=params)``: its captured gradients run the parameter's tensor
    hooks too, it neither reads nor clears ``.grad`` (Note [The host gradient is the device parameter's .grad]), and
    torch refuses the question for a leaf there. Otherwise True: a ``backward(inputs=...)`` leaving the parameter out
    does not run its hooks, and the engine's "no" may be about a node torch replaced (``p.data =`` a tensor of
    another dtype makes a new AccumulateGrad), so it is not trusted."""
    try:
        torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:  # "... currently running autograd.grad(). This is currently not supported."
        return False
    return True
