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
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from offcore.bandwidth import LinkMeasurement
from offcore.errors import ConfigurationError
from offcore.sim import Plan, StepProfile, simulate
from offcore.sim.profile import LayerProfile
from offcore_torch.activations.storage import is_offloadable_kind, is_parameter_like, storage_key
from offcore_torch.compare.calibration import _calibrate
from offcore_torch.compare.link import measure_copy_latency, measure_link
from offcore_torch.compare.measurement import StepMeasurement
from offcore_torch.compare.recording import (
    _grad_bytes,
    _Held,
    _host_step_s_per_byte,
    _largest_module_param_bytes,
    _LayerRecord,
    _Marks,
    _Memory,
    _on_a_host_thread,
    _optimizer_state_bytes,
    _outside_params,
    _param_bytes,
    _param_copies,
    _tensors,
)
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
