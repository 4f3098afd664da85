"""What :func:`~offcore_torch.compare.profiler.measure_step` records while the step runs: marks, memory, per-layer records, saved storages, and the bytes of parameters, gradients and optimizer states."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from offcore_torch.activations.storage import storage_key


class _Marks:
    """Timing events on the current stream, resolved to seconds after the step."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.origin = self.mark()
        self.events: list[Any] = []

    def mark(self) -> Any:
        event = self.device.new_event(enable_timing=True)
        event.record(self.device.current_stream())
        return event

    def seconds(self, event: Any) -> float:
        return self.origin.elapsed_time(event) / 1e3


class _Memory:
    """Peak tracking split into intervals: every reset first folds the running peak into the step's."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.step_peak = self.allocated()
        device.reset_peak_memory_stats()

    def allocated(self) -> int:
        return int(self.device.memory_stats().get("allocated_bytes", 0) or 0)

    def restart(self) -> int:
        """Fold the peak so far into the step's peak, restart peak tracking; returns bytes allocated now."""
        stats = self.device.memory_stats()
        self.step_peak = max(self.step_peak, int(stats.get("peak_allocated_bytes", 0) or 0))
        self.device.reset_peak_memory_stats()
        return int(stats.get("allocated_bytes", 0) or 0)

    def peak_and_allocated(self) -> tuple[int, int]:
        """The peak since the last restart (folded into the step's) and the bytes allocated now, in one read."""
        stats = self.device.memory_stats()
        peak = int(stats.get("peak_allocated_bytes", 0) or 0)
        self.step_peak = max(self.step_peak, peak)
        return peak, int(stats.get("allocated_bytes", 0) or 0)

    def reset(self) -> None:
        """Restart peak tracking right after :meth:`peak_and_allocated` folded the peak so far."""
        self.device.reset_peak_memory_stats()

    def peak_since_restart(self) -> int:
        peak = int(self.device.memory_stats().get("peak_allocated_bytes", 0) or 0)
        self.step_peak = max(self.step_peak, peak)
        return peak


@dataclass
class _LayerRecord:
    name: str
    calls: int = 0
    forward_start: Any = None
    forward_end: Any = None
    backward_start: Any = None
    backward_end: Any = None
    saved_bytes: int = 0
    saved_storages: int = 0
    input_bytes: int = 0
    forward_transient: int = 0
    backward_transient: int = 0
    backward_level: int = 0
    # Note [Gross working bytes of a backward]: per save (save order), the gross transient from its use
    # to the next; the save whose interval is open (-1: none used yet) and the gross before the first use
    save_gross: list[int] = field(default_factory=list)
    current: int = -1
    first_used: int = -1
    before_first_use: int = 0
    released_bytes: int = 0  # this layer's saves autograd released since its backward began
    in_backward: bool = False
    host_start: float = 0.0  # host clock at the forward's start and end, and at each save (sim.profile.saved_tensors)
    host_end: float = 0.0
    saves: list[tuple[float, int]] = field(default_factory=list)
    # Note [Reads of kept tensors are triggers] (offcore/sim/simulator.py): per save, the backward reads of
    # tensors the profiler does not count (parameters, ...) after its use and before the layer's next save's
    reads: list[int] = field(default_factory=list)

    def reads_after(self) -> tuple[int, ...]:
        """``LayerProfile.reads_after``; empty when its backward used none of its saves."""
        return tuple(self.reads) if self.first_used >= 0 else ()

    def gross_working_bytes(self) -> tuple[int, ...]:
        """``LayerProfile.gross_working_bytes`` (Note [Gross working bytes of a backward]); empty when its
        backward used none of its saves."""
        if self.first_used < 0:
            return ()
        out = list(self.save_gross)
        out[self.first_used] = max(out[self.first_used], self.before_first_use)
        return tuple(out)

    def saved_tensors(self) -> tuple[tuple[float, int], ...]:
        """``LayerProfile.saved_tensors``: each save's share of the forward elapsed, and its bytes."""
        span = self.host_end - self.host_start
        out, previous = [], 0.0
        for moment, nbytes in self.saves:
            share = min(1.0, max(previous, (moment - self.host_start) / span if span > 0 else 1.0))
            out.append((share, nbytes))
            previous = share
        return tuple(out)


# Note [Gross working bytes of a backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``working_bytes`` is a backward's peak above its start, net of the saves autograd frees as it
# goes: right for a layer whose saves are all on the device when its backward starts (kept,
# recomputed). An offloaded layer's saves come back one by one and go as autograd lets go of them,
# so its backward holds the saves reloaded and not yet released plus the transient bytes of the
# nodes running: the simulator needs that transient with the frees not netted in, and where in the
# backward it happens (Note [An offloaded layer's saves go as backward uses them] in
# offcore/sim/simulator.py). The profiler wraps every record of a layer's saved storage (``_Held``):
#   - its unpack (a node uses the save) closes the interval of the save used before it: the peak
#     since then, minus the backward's start level, plus the layer's bytes released so far, is that
#     save's gross working set (``LayerProfile.gross_working_bytes``, per save; what comes before the
#     first use counts for the first save used);
#   - when autograd released the last record of a storage during its layer's backward, the peak is
#     folded the same way first, then the profiler's own reference dropped (the storage goes) and
#     the bytes freed added to the released count.
# Peaks are folded, never lost: the hook that starts a layer's backward and the one that ends the
# next layer's run on the same tensor, the start first, so the start folds the layer still in
# backward before it restarts the peak (the net ``backward_transient`` used to lose all but the
# last instants of every backward but the last one's to that restart: 128 KiB where the block's
# backward peaks 576 KiB above its start, at the ``offcore compare`` default).
# ``LayerProfile.forward_working_bytes`` is the forward's transient alone.


class _Held:
    """One saved record of a layer's storage (Note [Gross working bytes of a backward])."""

    __slots__ = ("tensor", "key", "live", "on_release")

    def __init__(self, tensor: Tensor, key: int, live: dict[int, int], on_release: Callable[[int], None]) -> None:
        self.tensor: Tensor | None = tensor
        self.key = key
        self.live = live
        self.on_release = on_release
        live[key] = live.get(key, 0) + 1

    def __del__(self) -> None:
        self.tensor = None
        left = self.live.get(self.key, 0) - 1
        if left > 0:
            self.live[self.key] = left
            return
        self.live.pop(self.key, None)
        try:
            self.on_release(self.key)
        except Exception:  # pragma: no cover - a measurement must never break the caller's backward
            pass


def _grad_bytes(module: nn.Module) -> int:
    """Bytes of the gradients of ``module``'s parameters (one per storage), allocated by its backward."""
    storages = {
        storage_key(p.untyped_storage()): p.untyped_storage().nbytes() for p in module.parameters() if p.requires_grad
    }
    return sum(storages.values())


def _param_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters (one per storage): what parameter streaming copies for it."""
    storages = {storage_key(p.untyped_storage()): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


def _largest_module_param_bytes(model: nn.Module) -> int:
    """The largest bytes of one module's *own* parameters (one per storage, tied ones once per module):
    offcore_torch.offload_parameters' unit of copy, whose double is its default prefetch budget
    (``StepProfile.parameter_budget_bytes``)."""
    largest = 0
    for module in model.modules():
        own = {storage_key(p.untyped_storage()): p.untyped_storage().nbytes() for p in module.parameters(recurse=False)}
        largest = max(largest, sum(own.values()))
    return largest


def _outside_params(model: nn.Module, layers: Sequence[nn.Module]) -> dict[str, int]:
    """Bytes and tensors of the modules' own parameters outside ``layers`` (a tied weight once per module
    using it): what parameter streaming copies for them in one pass (``StepProfile.outside_param_bytes``,
    ``outside_param_copies``)."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    nbytes = copies = 0
    for module in model.modules():
        if id(module) in inside:
            continue
        own = {storage_key(p.untyped_storage()): p.untyped_storage().nbytes() for p in module.parameters(recurse=False)}
        nbytes += sum(own.values())
        copies += len(own)
    return {"outside_param_bytes": nbytes, "outside_param_copies": copies}


def _param_copies(module: nn.Module) -> int:
    """``module``'s parameter tensors (one per storage): the H2D copies parameter streaming makes per use."""
    return len({storage_key(p.untyped_storage()) for p in module.parameters()})


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, device: Any) -> int:
    """Device bytes of ``optimizer``'s state tensors (one per storage)."""
    storages: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor) and device.holds(value):
                storages[storage_key(value.untyped_storage())] = value.untyped_storage().nbytes()
    return sum(storages.values())


# Note [The host step is timed on host copies]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under optimizer offload (offcore_torch.OffloadOptimizer) the step runs on the host over host
# copies of the parameters. The profiler times it as such: a fresh instance of the device
# optimizer's class with its first group's hyper-parameters over plain host clones of the
# parameters with zero gradients, one untimed step (its state appears) and the median of three
# timed ones, divided by the parameter bytes. The simulator charges each layer's host step
# ``param_bytes × host_step_s_per_byte`` (Note [Optimizer offload and parameter streaming in the
# simulator] in offcore/sim/simulator.py). OffloadOptimizer steps in chunks with per-group
# narrowing; that overhead is not in this figure.
def _host_step_s_per_byte(optimizer: torch.optim.Optimizer, repeats: int = 3) -> float:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if not nbytes:
        return 0.0
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    with torch.no_grad():
        host = [torch.zeros(p.shape, dtype=p.dtype, device="cpu").requires_grad_(True) for p in params]
        for tensor in host:
            tensor.grad = torch.zeros_like(tensor)
    try:
        twin = type(optimizer)(host, **hyper)
    except Exception:  # an optimizer whose groups carry what its constructor refuses: the class defaults
        twin = type(optimizer)(host)
    twin.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        twin.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / nbytes


def _on_a_host_thread(fn: Callable[[], float]) -> float:
    """``fn()`` on a fresh thread, where no device context is active (as OffloadOptimizer's worker)."""
    out: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="offcore-profile-host-step")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _tensors(value: Any) -> list[Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, Tensor)]
