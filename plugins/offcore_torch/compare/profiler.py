"""Measure one real training step, layer by layer, into the simulator's :class:`offcore.sim.StepProfile`.

The planner (:mod:`offcore.sim.planner`) needs per layer the forward, backward and
recompute time, the bytes it saves for backward, its input bytes (what a checkpoint
keeps) and its transient working set, plus the link's bandwidth per direction and the
device capacity. :func:`profile_step` collects all of it from one real step on any
offcore backend:

- **times** from the backend's timing events (``device.new_event(enable_timing=True)``
  recorded on ``device.current_stream()``, read at each use): forward from module
  forward pre/post hooks; backward from tensor gradient hooks on each layer's outputs
  (its backward starts) and inputs (its backward ends). Tensor hooks do not add nodes
  to the graph, so in-place ops after a layer keep working. Recompute cost = forward
  time.
- **saved bytes** from ``torch.autograd.graph.saved_tensors_hooks``: every storage
  autograd saves is counted once (views share it), attributed to the layer whose
  forward saved it first; parameters and buffers (and their views) and tensors not on
  the device are excluded — the same rule as :func:`offcore_torch.offload_activations`.
- **memory** from ``device.memory_stats()``: resident bytes at the step's start, the
  step's peak, and each layer's transient peak above its own level.
- **link** from timed copies on a copy stream (:func:`measure_link`), and the capacity
  from ``memory_stats()["capacity_bytes"]``.

    >>> import offcore, torch
    >>> from offcore_torch.compare.profiler import profile_step
    >>> dev = offcore.device("cpu", capacity="1GiB", h2d_bandwidth="8GiB/s", d2h_bandwidth="8GiB/s")
    >>> with dev:
    ...     model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)])
    ...     x = torch.randn(256, 64)
    ...     profile = profile_step(model, lambda: model(x).square().mean(), dev)
    >>> profile.n_layers, profile.layers[0].saved_bytes > 0, profile.capacity_bytes == 2**30
    (3, True, True)
    >>> dev.close()

With ``calibrate=True`` it also runs a few extra forward/backward passes (RNG state and
gradients restored afterwards, no optimizer step; Note [Profiler calibration]): plain
ones, to remove the instrumentation's own cost from the layer times, and ones under
:func:`offcore_torch.offload_activations`, to measure the offloading runtime's host work
per saved storage (``LayerProfile.offload_overhead_s``). Every measured profile sets
``reuse_in_flight`` (the activation plugin reuses device copies still in flight).

Only the profiled layers are planned; what runs outside them (embedding, output head,
loss, optimizer) is measured as *other* time and bytes in :class:`StepMeasurement`, so
a predicted step time is ``simulate(...).step_time_s + measurement.other_compute_s``.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from offcore.bandwidth import LinkMeasurement
from offcore.bandwidth import measure_link as _core_measure_link
from offcore.errors import ConfigurationError
from offcore.kinds import Tier
from offcore.sim import Plan, StepProfile, simulate
from offcore.sim.profile import LayerProfile
from offcore_torch.activations.storage import is_offloadable_kind, is_parameter_like, storage_key
from offcore_torch.layers import resolve_layers

__all__ = [
    "LinkMeasurement",
    "StepMeasurement",
    "measure_copy_latency",
    "measure_link",
    "measure_step",
    "profile_step",
]

LayersArg = Sequence[nn.Module] | Sequence[tuple[str, nn.Module]] | None


# ----------------------------------------------------------------------------- the link
# Note [One link estimator] (offcore.bandwidth): the link is measured once, torch-free, in
# the core (``LinkMeasurement`` is re-exported from there unchanged); the profiler's
# ``measure_link`` takes its bandwidths and measures the latency apart (Note [The latency
# is measured with small copies]).
#
#     >>> import offcore
#     >>> dev = offcore.device("cpu", h2d_bandwidth="128MiB/s", d2h_bandwidth="256MiB/s", latency=0)
#     >>> link = measure_link(dev, max_bytes="4MiB")
#     >>> 0.5 < link.d2h_bandwidth / 2**28 < 1.5
#     True
#
# Note [The latency is measured with small copies]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The core fits ``latency + bytes / bandwidth`` through its two largest probes (1 and 4 MiB
# on the fake device's PCIe-like link: copies of 7 and 28 ms), so its latency is the
# difference of two long copies' noise: on the loaded 2-core VM it read 0 to 1.3 ms, six
# runs in a row, for a link whose copies cost 10-20 us each. The simulator charges the
# latency to every copy: to each parameter tensor streamed (about 100 per TinyGPT step,
# Note [Parameter copies pay one latency each] in offcore/sim/simulator.py) and each saved
# tensor offloaded, so that noise alone moved predicted steps by 10-30 %. The latency that
# matters is what a copy costs beyond its bytes when copies queue back to back, as the
# runtimes issue them: :func:`measure_copy_latency` times ``copies`` small copies issued
# together on a copy stream (median of ``repeats``), per copy, minus their bytes'
# bandwidth time. ``measure_link`` returns the core's bandwidths with that latency.


def measure_copy_latency(
    backend: Any,
    bandwidth: float = math.inf,
    *,
    nbytes: int = 4096,
    copies: int = 32,
    repeats: int = 5,
) -> float:
    """Seconds one host-to-device copy costs beyond ``nbytes / bandwidth`` when ``copies`` small copies
    are issued back to back on one copy stream (Note [The latency is measured with small copies]).

        >>> import offcore
        >>> dev = offcore.device("cpu", h2d_bandwidth="1GiB/s", latency="200us")
        >>> 150e-6 < measure_copy_latency(dev, 2**30) < 2e-3
        True
        >>> dev.close()
    """
    if not (isinstance(copies, int) and not isinstance(copies, bool) and copies >= 1):
        raise ConfigurationError(f"copies must be a positive integer, got {copies!r}")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ConfigurationError(f"repeats must be a positive integer, got {repeats!r}")
    stream = backend.new_stream()
    stream.wait_stream(backend.current_stream())
    host = [backend.allocate(nbytes, Tier.PINNED) for _ in range(copies)]
    device_buffers = [backend.allocate(nbytes, Tier.DEVICE) for _ in range(copies)]
    samples = []
    try:
        for _ in range(repeats + 1):  # the first round warms the copy thread up
            start = time.perf_counter()
            for dst, src in zip(device_buffers, host, strict=True):
                backend.copy_(dst, src, stream=stream)
            stream.synchronize()
            samples.append(time.perf_counter() - start)
    finally:
        stream.synchronize()
        del host, device_buffers
    per_copy = statistics.median(samples[1:]) / copies
    return max(0.0, per_copy - (0.0 if math.isinf(bandwidth) else nbytes / bandwidth))


def measure_link(backend: Any, **options: Any) -> LinkMeasurement:
    """The link as the simulator takes it: :func:`offcore.bandwidth.measure_link`'s bandwidths (``options``
    pass through) and :func:`measure_copy_latency`'s latency (Note [The latency is measured with small copies])."""
    link = _core_measure_link(backend, **options)
    return replace(link, latency_s=measure_copy_latency(backend, link.h2d_bandwidth))


# ------------------------------------------------------------------------ the step
@dataclass(frozen=True)
class StepMeasurement:
    """Everything one profiled step measured; :attr:`profile` is the simulator's input.

    Times in seconds, sizes in bytes.

    - ``profile``: one :class:`~offcore.sim.LayerProfile` per layer, the link, the
      capacity; ``other_bytes`` is *calibrated* so that the simulated keep-all peak
      equals the measured ``peak_bytes`` (it holds what the layers do not: optimizer
      state, the batch, the output head's and the loss's saved tensors and transients).
    - ``forward_s`` / ``backward_s`` / ``optimizer_s``: the whole step's phases;
      ``other_forward_s`` / ``other_backward_s``: the parts outside the layers.
    - ``param_bytes``; ``resident_bytes``: device bytes allocated when the step began;
      ``other_saved_bytes``: saved outside any layer; ``peak_bytes``: the peak of forward
      and backward (what a plan changes); ``optimizer_peak_bytes``: the peak during the
      optimizer step (parameters, gradients, optimizer state and its temporaries; no plan
      changes it — a device must hold ``max(simulated peak, optimizer_peak_bytes)``, see
      :meth:`predicted_peak`).
    - ``layer_calls``: how often each layer ran in forward (1 expected).
    - ``instrumentation_scale``: the factor applied to the instrumented forward and
      backward times (plain / instrumented, ≤ 1; 1 without calibration);
      ``offload_overhead_per_storage_s``: the offloading runtime's host time per saved
      storage (0 without calibration); ``recompute_overhead_per_storage_s``: what
      ``torch.utils.checkpoint`` adds to a recompute beyond the forward, per saved
      storage (in each layer's ``recompute_s``); ``layer_storages``: saved storages per layer.
    - ``optimizer_state_bytes``: the device bytes of the optimizer's state (AdamW: 2 × the
      fp32 parameters), part of ``profile.other_bytes``; ``host_step_s_per_byte``: one timed
      step of the same optimizer class and arguments over host copies of the parameters,
      per parameter byte (Note [The host step is timed on host copies]); both 0 without an
      optimizer. Also in ``profile`` (:class:`~offcore.sim.StepProfile`).
    """

    profile: StepProfile
    forward_s: float
    backward_s: float
    optimizer_s: float
    other_forward_s: float
    other_backward_s: float
    param_bytes: int
    resident_bytes: int
    other_saved_bytes: int
    peak_bytes: int
    optimizer_peak_bytes: int
    calibration_bytes: int
    link: LinkMeasurement | None = None
    layer_calls: tuple[int, ...] = field(default=())
    instrumentation_scale: float = 1.0
    offload_overhead_per_storage_s: float = 0.0
    recompute_overhead_per_storage_s: float = 0.0
    layer_storages: tuple[int, ...] = field(default=())
    optimizer_state_bytes: int = 0
    host_step_s_per_byte: float = 0.0

    @property
    def step_s(self) -> float:
        """Forward + backward + optimizer as measured."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def other_compute_s(self) -> float:
        """Compute outside the profiled layers (embedding, head, loss, optimizer): add it to simulated step times."""
        return self.other_forward_s + self.other_backward_s + self.optimizer_s

    @property
    def per_sample_other_bytes(self) -> int:
        """The part of ``profile.other_bytes`` that scales with the batch (saved outside layers + calibration)."""
        return self.other_saved_bytes + self.calibration_bytes

    def profile_for_microbatches(self, microbatches: int) -> StepProfile:
        """The profile to predict a plan with ``microbatches`` > 1 on.

        :meth:`StepProfile.split_microbatches` scales only the layers. Two resident
        terms change too: the output head's saved tensors shrink with the micro-batch
        (batch-dependent *other* bytes divided by ``microbatches``), and the gradients
        of earlier micro-batches stay on the device while later ones run
        (``grad_bytes`` = the parameter bytes).
        """
        if microbatches == 1:
            return self.profile
        fixed = self.profile.other_bytes - self.per_sample_other_bytes
        head = min(-(-self.per_sample_other_bytes // microbatches), self.profile.head_bytes)
        early = self.profile.head_forward_bytes
        return replace(
            self.profile,
            other_bytes=max(0, fixed) + head,
            head_bytes=head,
            head_forward_bytes=None if early is None else min(-(-early // microbatches), head),
            grad_bytes=self.param_bytes,
        )

    def predict(self, plan: Plan, **kwargs: Any) -> Any:
        """``simulate`` the plan on the matching profile; returns (SimResult, predicted step seconds)."""
        result = simulate(self.profile_for_microbatches(plan.microbatches), plan, **kwargs)
        return result, result.step_time_s + self.other_compute_for(plan)

    @property
    def other_compute_offloaded_optimizer_s(self) -> float:
        """Compute outside the layers when the optimizer steps on the host (no device optimizer step):
        the embedding, the head and the loss; the simulator models the host step itself."""
        return self.other_forward_s + self.other_backward_s

    def other_compute_for(self, plan: Plan) -> float:
        """What to add to ``plan``'s simulated step time: :attr:`other_compute_s`, without the device
        optimizer step when ``plan.optimizer == "offload"``."""
        return self.other_compute_offloaded_optimizer_s if plan.optimizer == "offload" else self.other_compute_s

    def predicted_peak(self, result: Any) -> int:
        """The device peak of a simulated step plus the optimizer step: ``max(result.peak_bytes, optimizer peak)``.

        With ``optimizer="offload"`` there is no device optimizer step: the simulated peak."""
        if result.plan.optimizer == "offload":
            return int(result.peak_bytes)
        return max(int(result.peak_bytes), self.optimizer_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (the profile as :meth:`StepProfile.to_dict`)."""
        return {
            "profile": self.profile.to_dict(),
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "other_forward_s": self.other_forward_s,
            "other_backward_s": self.other_backward_s,
            "param_bytes": self.param_bytes,
            "resident_bytes": self.resident_bytes,
            "other_saved_bytes": self.other_saved_bytes,
            "peak_bytes": self.peak_bytes,
            "optimizer_peak_bytes": self.optimizer_peak_bytes,
            "calibration_bytes": self.calibration_bytes,
            "link": None if self.link is None else self.link.to_dict(),
            "layer_calls": list(self.layer_calls),
            "instrumentation_scale": self.instrumentation_scale,
            "offload_overhead_per_storage_s": self.offload_overhead_per_storage_s,
            "recompute_overhead_per_storage_s": self.recompute_overhead_per_storage_s,
            "layer_storages": list(self.layer_storages),
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "host_step_s_per_byte": self.host_step_s_per_byte,
        }


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


def measure_step(
    model: nn.Module,
    step: Callable[[], Tensor],
    device: Any,
    *,
    layers: LayersArg = None,
    optimizer: torch.optim.Optimizer | None = None,
    link: LinkMeasurement | bool = True,
    batch_size: int = 1,
    capacity_bytes: int | None = None,
    calibrate: bool = False,
    calibration_passes: int = 3,
) -> StepMeasurement:
    """Run one training step of ``model`` on ``device`` and measure it (see the module doc).

    Args:
        model: the model, already on ``device.torch_device``.
        step: runs the forward and returns the scalar loss (``lambda: loss_fn(model(x), y)``);
            the profiler calls ``loss.backward()`` and, with ``optimizer``, ``step()`` and
            ``zero_grad()``.
        device: an offcore backend device (``offcore.device(...)``).
        layers: the modules to profile, in forward order (default:
            :func:`offcore_torch.layers.find_layers`). Each must run once per forward.
        optimizer: when given, its step is timed as part of the step.
        link: ``True`` measures the link (:func:`measure_link`); a
            :class:`LinkMeasurement` is used as given; ``False`` leaves the profile's
            link unlimited.
        batch_size: samples in the step (the planner splits it into micro-batches).
        capacity_bytes: overrides the device capacity in the profile.
        calibrate: also run ``calibration_passes`` pairs of extra forward/backward passes
            (one plain, one under ``offload_activations``) to correct the layer times
            for the profiler's own cost and to measure the offload overhead per storage
            (Note [Profiler calibration]). Gradients and the RNG state are restored;
            buffers a forward updates (batch-norm statistics) are updated again.

    Raises:
        ConfigurationError: ``step`` did not return a scalar tensor that requires grad,
            or a layer ran more than once or never.
    """
    if isinstance(calibration_passes, bool) or not (isinstance(calibration_passes, int) and calibration_passes >= 1):
        raise ConfigurationError(
            f"calibration_passes must be a positive integer, got {calibration_passes!r}; 3 is a good default"
        )
    named = resolve_layers(model, layers)
    n = len(named)
    records = [_LayerRecord(name) for name, _ in named]
    index_of = {id(module): i for i, (_, module) in enumerate(named)}
    param_keys = {storage_key(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    param_bytes = sum(
        t.untyped_storage().nbytes() for t in {storage_key(p.untyped_storage()): p for p in model.parameters()}.values()
    )
    seen_storages: set[int] = set()
    # Note [Gross working bytes of a backward]: the layers' storages, their live records, the profiler's refs
    counted: dict[int, tuple[int, int, int]] = {}  # storage key -> (layer, bytes, save index)
    live: dict[int, int] = {}
    held: dict[int, Tensor] = {}
    stack: list[int] = []
    other_saved = 0
    handles: list[Any] = []
    grad_hooks: list[Any] = []

    with device:
        device.synchronize()
        memory = _Memory(device)
        resident = memory.allocated()
        marks = _Marks(device)

        def on_forward_pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            i = index_of[id(module)]
            record = records[i]
            record.calls += 1
            stack.append(i)
            memory.restart()
            record.forward_start = marks.mark()
            record.host_start = time.perf_counter()
            storages = {}
            for tensor in _tensors((args, kwargs)):
                storage = tensor.untyped_storage()
                key = storage_key(storage)
                if key not in param_keys and device.holds(tensor):
                    storages[key] = storage.nbytes()
                if tensor.requires_grad:
                    grad_hooks.append(tensor.register_hook(_backward_end_hook(i)))
            record.input_bytes = sum(storages.values())

        def on_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            i = index_of[id(module)]
            record = records[i]
            record.host_end = time.perf_counter()
            record.forward_end = marks.mark()
            peak = memory.peak_since_restart()
            record.forward_transient = max(0, peak - memory.allocated())
            if stack and stack[-1] == i:
                stack.pop()
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    grad_hooks.append(tensor.register_hook(_backward_start_hook(i)))

        def _backward_start_hook(i: int) -> Callable[[Tensor], None]:
            def hook(_grad: Tensor) -> None:
                record = records[i]
                if record.backward_start is None:
                    # the next layer's end hook may run after this one (a hook on the same tensor, registered
                    # later): its peak so far is folded before the restart
                    for other in records:
                        if other.in_backward:
                            fold(other)
                    record.backward_level = memory.restart()
                    record.backward_start = marks.mark()
                    record.in_backward = True

            return hook

        def _backward_end_hook(i: int) -> Callable[[Tensor], None]:
            def hook(_grad: Tensor) -> None:
                record = records[i]
                record.backward_end = marks.mark()
                fold(record)
                record.in_backward = False

            return hook

        def fold(record: _LayerRecord) -> int:
            """The peak since the last restart into ``record``'s backward working sets, net and gross; returns
            the bytes allocated now."""
            peak, allocated = memory.peak_and_allocated()
            record.backward_transient = max(record.backward_transient, peak - record.backward_level)
            gross = max(0, peak - record.backward_level + record.released_bytes)
            if record.current < 0:
                record.before_first_use = max(record.before_first_use, gross)
            else:
                record.save_gross[record.current] = max(record.save_gross[record.current], gross)
            return allocated

        last_used: list[_LayerRecord | None] = [None]  # the layer whose save backward used last

        def unpack(packed: Any) -> Any:
            entry = counted.get(packed.key) if type(packed) is _Held else None
            if entry is None:  # Note [Reads of kept tensors are triggers]: a read after the last save used
                record = last_used[0]
                if record is not None and record.in_backward and record.current >= 0:
                    record.reads[record.current] += 1
                return packed.tensor if type(packed) is _Held else packed
            if records[entry[0]].in_backward:
                record = last_used[0] = records[entry[0]]
                if record.current != entry[2]:  # the next save used: the interval of the previous one ends
                    fold(record)
                    memory.reset()
                    record.current = entry[2]
                    if record.first_used < 0:
                        record.first_used = entry[2]
            return packed.tensor

        def released(key: int) -> None:
            """Note [Gross working bytes of a backward]: autograd let go of the last record of a counted
            storage; fold the peak before its bytes go, then count them as released."""
            if key not in counted:  # the step is over (the records outlived it)
                return
            i, nbytes, _ = counted[key]
            record = records[i]
            if not record.in_backward:
                held.pop(key, None)
                return
            before = fold(record)
            held.pop(key, None)  # the storage goes now, unless something else holds it
            freed = before - memory.restart()
            record.released_bytes += max(0, min(nbytes, freed))

        def pack(tensor: Tensor) -> Any:
            nonlocal other_saved
            if not is_offloadable_kind(tensor) or is_parameter_like(tensor):
                return tensor
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            if key in counted:  # another record of a layer's storage: one more holder to wait for
                return _Held(tensor, key, live, released)
            if key in param_keys or key in seen_storages or not device.holds(tensor):
                return tensor
            seen_storages.add(key)
            if stack:
                records[stack[-1]].saved_bytes += storage.nbytes()
                records[stack[-1]].saved_storages += 1
                records[stack[-1]].saves.append((time.perf_counter(), storage.nbytes()))
                counted[key] = (stack[-1], storage.nbytes(), len(records[stack[-1]].saves) - 1)
                records[stack[-1]].save_gross.append(0)
                records[stack[-1]].reads.append(0)
                held[key] = tensor  # the profiler's own reference, dropped when autograd released every record
                return _Held(tensor, key, live, released)
            other_saved += storage.nbytes()
            return tensor

        for _, module in named:
            handles.append(module.register_forward_pre_hook(on_forward_pre, with_kwargs=True))
            handles.append(module.register_forward_hook(on_forward, with_kwargs=True, always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = step()
            forward_end = marks.mark()
            if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise ConfigurationError(
                    "the profiled step must return the scalar loss (a one-element tensor that requires grad), "
                    f"got {type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
                )
            loss.backward()
            del loss
            backward_end = marks.mark()
            memory.restart()
            step_peak = memory.step_peak  # forward and backward: what the layers' plan acts on
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            optimizer_end = marks.mark()
        finally:
            for handle in handles + grad_hooks:
                handle.remove()
            counted.clear()
            held.clear()
        device.synchronize()
        optimizer_end.synchronize()
        optimizer_peak = memory.peak_since_restart() if optimizer is not None else 0
        peak = step_peak

    for record in records:
        if record.calls != 1:
            raise ConfigurationError(
                f"layer {record.name!r} ran {record.calls} times in one forward; the profiler and the planner "
                "need each layer to run exactly once (pass layers=[...] that are called once each)"
            )

    t = marks.seconds
    forward_total = t(forward_end)
    backward_total = t(backward_end) - forward_total
    optimizer_s = t(optimizer_end) - t(backward_end)
    scale, per_storage, checkpoint_extra_s = 1.0, 0.0, 0.0
    if calibrate:
        scale, per_storage, checkpoint_extra_s = _calibrate(
            model, step, device, [module for _, module in named], forward_total + backward_total, calibration_passes
        )

    layer_forwards = [(t(r.forward_end) - t(r.forward_start)) * scale for r in records]
    storages_total = sum(r.saved_storages for r in records)
    # recompute = forward + checkpoint machinery per saved storage (Note [Profiler calibration])
    recompute_per_storage = (
        max(0.0, checkpoint_extra_s - math.fsum(max(0.0, f) for f in layer_forwards)) / storages_total
        if calibrate and storages_total
        else 0.0
    )
    layer_profiles: list[LayerProfile] = []
    backward_starts = [t(r.backward_start) if r.backward_start is not None else None for r in records]
    for i, record in enumerate(records):
        forward_s = layer_forwards[i]
        start = backward_starts[i]
        if start is None:  # no gradient flowed through this layer's outputs
            backward_s = 0.0
        else:
            if record.backward_end is not None:
                end = t(record.backward_end)
            else:  # its inputs need no gradient: it ends where the next layer (in backward) starts
                later = [s for s in backward_starts[:i] if s is not None and s >= start]
                end = max(later) if later else t(backward_end)
            backward_s = max(0.0, end - start) * scale
        layer_profiles.append(
            LayerProfile(
                record.name,
                forward_s=max(0.0, forward_s),
                backward_s=backward_s,
                saved_bytes=record.saved_bytes,
                recompute_s=max(0.0, forward_s) + recompute_per_storage * record.saved_storages,
                working_bytes=max(record.forward_transient, record.backward_transient),
                forward_working_bytes=record.forward_transient,
                gross_working_bytes=record.gross_working_bytes(),
                reads_after=record.reads_after(),
                input_bytes=record.input_bytes,
                offload_overhead_s=per_storage * record.saved_storages,
                saved_tensors=record.saved_tensors(),
                grad_bytes=_grad_bytes(named[i][1]),
                param_bytes=_param_bytes(named[i][1]),
                param_copies=_param_copies(named[i][1]),
            )
        )
    forward_total *= scale
    backward_total *= scale

    if link is True:
        with device:
            link_measurement: LinkMeasurement | None = measure_link(device)
    elif link is False:
        link_measurement = None
    elif isinstance(link, LinkMeasurement):
        link_measurement = link
    else:
        raise ConfigurationError(f"link must be True, False or a LinkMeasurement, got {type(link).__name__}")

    capacity = capacity_bytes
    if capacity is None:
        capacity = int(device.memory_stats().get("capacity_bytes", 0) or 0) or None
    base_other = max(0, resident - param_bytes) + other_saved
    state_bytes, host_step = 0, 0.0
    if optimizer is not None:
        # the state resident when the step began (none before an optimizer's first step)
        state_bytes = min(_optimizer_state_bytes(optimizer, device), max(0, resident - param_bytes))
        host_step = _on_a_host_thread(lambda: _host_step_s_per_byte(optimizer))
    profile = StepProfile(
        layer_profiles,
        param_bytes=param_bytes,
        grad_bytes=0,
        other_bytes=base_other,
        head_bytes=other_saved,  # saved by the head and the loss: alive around the turn only
        head_forward_bytes=other_saved,  # Note [The turn sees the head's saved bytes] in offcore/sim/simulator.py
        capacity_bytes=capacity,
        batch_size=batch_size,
        reuse_in_flight=True,  # offcore_torch uses device copies still in flight (simulator.py Note)
        optimizer_state_bytes=state_bytes,
        host_step_s_per_byte=host_step,
        parameter_budget_bytes=2 * _largest_module_param_bytes(model),
        **_outside_params(model, [module for _, module in named]),
        **(link_measurement.as_profile_fields() if link_measurement is not None else {}),
    )
    # Note [Calibrated other bytes]: the layers' lifetimes are modelled; the rest (head, loss,
    # gradients appearing in backward, allocator transients) is folded into `other_bytes` so
    # that the simulated keep-all peak equals the measured one. Never negative: when the model
    # overestimates, the prediction stays conservative.
    simulated_peak = simulate(profile, Plan.keep_all(n), record_events=False).peak_bytes
    calibration = max(0, peak - simulated_peak)
    if calibration:  # at the turn, where the keep-all peak usually is: part of the head's bytes
        profile = replace(profile, other_bytes=base_other + calibration, head_bytes=other_saved + calibration)
        short = peak - simulate(profile, Plan.keep_all(n), record_events=False).peak_bytes
        if short > 0:  # the simulated peak is elsewhere: the rest is resident for the whole step (not per sample)
            profile = replace(profile, other_bytes=profile.other_bytes + short)
    return StepMeasurement(
        profile=profile,
        forward_s=forward_total,
        backward_s=backward_total,
        optimizer_s=optimizer_s,
        other_forward_s=max(0.0, forward_total - math.fsum(lp.forward_s for lp in layer_profiles)),
        other_backward_s=max(0.0, backward_total - math.fsum(lp.backward_s for lp in layer_profiles)),
        param_bytes=param_bytes,
        resident_bytes=resident,
        other_saved_bytes=other_saved,
        peak_bytes=peak,
        optimizer_peak_bytes=optimizer_peak,
        calibration_bytes=calibration,
        link=link_measurement,
        layer_calls=tuple(r.calls for r in records),
        instrumentation_scale=scale,
        offload_overhead_per_storage_s=per_storage,
        recompute_overhead_per_storage_s=recompute_per_storage,
        layer_storages=tuple(r.saved_storages for r in records),
        optimizer_state_bytes=state_bytes,
        host_step_s_per_byte=host_step,
    )


# Note [Profiler calibration]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The instrumented step pays for its own hooks (timing events, memory statistics, the
# saved-tensor hook) inside the layers it times, so its layer times overstate a plain
# step's (by ~10 % for a small model on the CPU fake device). Calibration times plain
# forward+backward passes with two events and scales every layer's forward, backward and
# recompute time (and the time outside the layers) by plain / instrumented (never above 1).
# The offloading runtime's own host work (pack and unpack per saved storage: Python, pool,
# events) runs on the compute stream too; passes under offload_activations(modules=layers,
# min_bytes=0) give it as (offloaded pass − its exposed wait − plain pass) / storages
# offloaded, the median over interleaved pairs, so a drift of host load hits both sides.
# Passes with every layer under torch.utils.checkpoint (non-reentrant, RNG preserved, as
# the executor runs them) give the recompute cost: (checkpointed − plain) is the layers'
# forward again plus the checkpoint machinery; the machinery per saved storage goes into
# each layer's recompute_s on top of its forward time.


def _calibrate(
    model: nn.Module,
    step: Callable[[], Tensor],
    device: Any,
    modules: list[nn.Module],
    instrumented_s: float,
    passes: int,
) -> tuple[float, float, float]:
    """Note [Profiler calibration]: (scale of instrumented times, offload overhead per storage, checkpointed − plain)."""
    from offcore.scheduler import Scheduler
    from offcore_torch.activations.offload import offload_activations

    params = list(model.parameters())
    stashed = [p.grad for p in params]
    torch_device = torch.device(device.torch_device)
    fork = (
        torch.random.fork_rng(devices=[])
        if torch_device.type == "cpu"
        else torch.random.fork_rng(devices=[torch_device.index or 0], device_type=torch_device.type)
    )
    scheduler = Scheduler()

    def checkpointed(module: nn.Module) -> Callable[..., Any]:
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(
                original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
            )

        return forward

    def timed(mode: str) -> tuple[float, float, int]:
        for p in params:
            p.grad = None
        device.synchronize()
        start = device.new_event(enable_timing=True)
        end = device.new_event(enable_timing=True)
        start.record(device.current_stream())
        wait, storages = 0.0, 0
        if mode == "offload":
            with offload_activations(device, modules=modules, min_bytes=0, schedule=scheduler) as handle:
                loss = step()
            loss.backward()
        elif mode == "checkpoint":
            own = [module.__dict__.get("forward") for module in modules]  # an instance-level forward, if any
            for module in modules:
                module.forward = checkpointed(module)  # type: ignore[method-assign]
            try:
                loss = step()
            finally:
                for module, previous in zip(modules, own, strict=True):
                    if previous is None:
                        del module.forward
                    else:
                        module.forward = previous  # type: ignore[method-assign]
            loss.backward()
        else:
            loss = step()
            loss.backward()
        del loss
        end.record(device.current_stream())
        device.synchronize()
        end.synchronize()
        if mode == "offload":
            stats = handle.stats()
            wait, storages = stats.exposed_wait_s, stats.offloaded_storages
        return start.elapsed_time(end) / 1e3, wait, storages

    plain: list[float] = []
    overheads: list[float] = []
    recomputes: list[float] = []
    try:
        with device, fork, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            timed("offload")  # warm the runtime (pool, streams) and the scheduler
            timed("checkpoint")
            for _ in range(passes):
                seconds, _, _ = timed("plain")
                plain.append(seconds)
                offloaded, wait, storages = timed("offload")
                if storages:
                    overheads.append(max(0.0, offloaded - wait - seconds) / storages)
                recomputes.append(timed("checkpoint")[0] - seconds)
    finally:
        for p, grad in zip(params, stashed, strict=True):
            p.grad = grad
    scale = min(1.0, statistics.median(plain) / instrumented_s) if instrumented_s > 0 else 1.0
    return scale, statistics.median(overheads) if overheads else 0.0, statistics.median(recomputes)


def profile_step(
    model: nn.Module,
    step: Callable[[], Tensor],
    device: Any,
    **options: Any,
) -> StepProfile:
    """:func:`measure_step` and return only its :class:`~offcore.sim.StepProfile` (same arguments).

    >>> profile = profile_step(model, lambda: loss_fn(model(x), y), dev, batch_size=8)   # doctest: +SKIP
    >>> from offcore.sim import plan
    >>> plan(profile, budget_bytes="2GiB").plan.describe()                               # doctest: +SKIP
    'OOKR K=1 m=1 prefetch=deadline/∞'
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return measure_step(model, step, device, **options).profile
