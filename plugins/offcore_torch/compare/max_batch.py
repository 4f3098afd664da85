"""The largest batch a strategy fits: extrapolated from the profile, then probed by real steps.

Note [The max batch is probed by real steps] says how.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from offcore.errors import ConfigurationError
from offcore.sim import Plan, StepProfile, simulate
from offcore.units import format_bytes
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.measurement import StepMeasurement
from offcore_torch.compare.runs import _is_oom, _optimizer_for, _release_optimizer
from offcore_torch.compare.settings import (
    _PROBE_LIMIT,
    _PROBE_MAX_FACTOR,
    _PROBE_STEPS,
    DTYPES,
    CompareSettings,
    Progress,
    _make_device,
    build_workload,
)


def _scaled(profile: StepProfile, measurement: StepMeasurement, factor: float) -> StepProfile:
    """The profile at ``factor`` × the batch: layer times and bytes and the per-sample other bytes scale."""
    layers = [layer.scaled(factor) for layer in profile.layers]  # saved tensors one by one, too
    per_sample = measurement.per_sample_other_bytes
    fixed = max(0, profile.other_bytes - per_sample)
    head = min(math.ceil(per_sample * factor), math.ceil(profile.head_bytes * factor))
    early = profile.head_forward_bytes
    return replace(
        profile,
        layers=layers,
        other_bytes=fixed + math.ceil(per_sample * factor),
        head_bytes=head,
        head_forward_bytes=None if early is None else min(math.ceil(early * factor), head),
        batch_size=1,
    )


def _extrapolated_batch(
    batch: int, capacity: int, measurement: StepMeasurement, peak: int | None, *, multiple: int = 1
) -> int | None:
    """The largest batch that fits ``capacity`` if the bytes above the resident state grow linearly with the batch.

    Extrapolated from a measured ``peak`` at ``batch``; the optimizer step's peak is a
    floor no batch size lowers. ``None`` when nothing above the resident state was seen.
    ``multiple``: a plan with gradient accumulation runs only batches its micro-batch
    count divides (the simulator's figure, ``_max_batch``, is such a multiple too).
    """
    if peak is None or measurement.optimizer_peak_bytes > capacity:
        return 0 if peak is not None else None
    resident = measurement.resident_bytes
    above = peak - resident
    if above <= 0:
        return None
    fits = max(0, int(batch * (capacity - resident) / above))
    return fits - fits % max(1, multiple)


def two_point_batch(batch: int, half: int, capacity: int, peak: int, half_peak: int, multiple: int) -> int | None:
    """The largest batch that fits ``capacity``, from the device peaks measured at ``batch`` and ``half``.

    # Note [The measured max batch has two points]
    # A peak is a fixed part (the resident state, the gradients a backward holds, what a
    # checkpointed step leaves allocated) plus a part that grows with the batch. One measured
    # point cannot tell them apart: extrapolating ``peak − resident`` through zero
    # (_extrapolated_batch) counts the fixed bytes above the resident state as growing, which
    # put checkpoint's "measured" max batch at 14 against 15-18 predicted in ``offcore compare``
    # and benchmarks/sim_vs_measured.py; two batch sizes measure the slope (16 there). Under
    # offload a peak also moves with copy timing (Note [The worst peak within the prefetch
    # budget]), so both points carry that noise. ``None`` when the peak did not grow.
    # compare shows this figure only where probing is off or impossible (Note [The max batch
    # is probed by real steps]): a prefetch budget fixed in bytes does not grow with the batch.

        >>> two_point_batch(8, 4, capacity=1000, peak=600, half_peak=400, multiple=1)   # 200 fixed + 50 a sample
        16
    """
    slope = (peak - half_peak) / (batch - half) if batch > half else 0.0
    if slope <= 0:
        return None
    fixed = peak - slope * batch
    fits = max(0, int((capacity - fixed) / slope))
    return fits - fits % max(1, multiple)


def _max_batch(profile: StepProfile, measurement: StepMeasurement, step_plan: Plan, batch: int) -> int:
    """The largest batch whose predicted peak fits the capacity under ``step_plan`` (0: not even 1)."""
    capacity = profile.capacity_bytes
    if capacity is None:
        return 0
    micro = replace(step_plan, microbatches=1, layer_names=None)
    if measurement.optimizer_peak_bytes > capacity:
        return 0
    # with accumulation the earlier micro-batches' gradients stay resident
    grads = measurement.param_bytes if step_plan.microbatches > 1 else 0

    def fits(size: int) -> bool:
        scaled = replace(_scaled(profile, measurement, size / batch), grad_bytes=grads)
        return simulate(scaled, micro, record_events=False).peak_bytes <= capacity

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= 4096 * batch and fits(high):
        low, high = high, high * 2
    if high > 4096 * batch:
        return low * step_plan.microbatches
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low * step_plan.microbatches


# Note [The max batch is probed by real steps]
# "Memory is measured, not assumed": a strategy's measured max batch is the largest batch whose
# full training steps (forward, backward, optimizer step) run on the compared device, found by
# running them, not by extrapolating peaks. Extrapolating (two_point_batch, _extrapolated_batch)
# assumes the peak grows linearly with the batch; under a prefetch budget fixed in bytes it does
# not (the loss's bytes grow, the budget's do not): param-stream's extrapolated 40 ran out of
# memory at 33 in the default `offcore compare`. Each probe builds the model and its optimizer at
# the probed batch and runs _PROBE_STEPS steps: AdamW allocates its state in the first step, and
# the offload runtimes' schedulers learn in it, so the second is the steady step whose peak
# counts. Each probe runs on a clean device state: on the fake device a fresh device with the
# compared capacity and link (Note [A fresh fake device after an out-of-memory error]: an OOM may
# leave bytes allocated); on another backend the compared device, the search giving up when a
# probe left bytes allocated. The search starts at the simulator's figure, tests its neighbour,
# and widens (doubling) only when that does not bracket the answer, then bisects: two probes
# when the simulator is right. Batches above _PROBE_MAX_FACTOR x --batch are not probed (each
# step would cost that many batch steps); there, and with --no-probe-max-batch, the
# extrapolation is shown, labelled "extrapolated" (StrategyResult.max_batch_source).


def probe_max_batch(
    fits: Callable[[int], bool],
    *,
    guess: int,
    multiple: int = 1,
    fits_at: int | None = None,
    fails_at: int | None = None,
    limit: int,
    max_probes: int = _PROBE_LIMIT,
) -> tuple[int | None, list[tuple[int, bool]]]:
    """The largest multiple of ``multiple`` for which ``fits(batch)`` holds (0: not even ``multiple``), and the probes.

    ``fits`` is assumed monotone (a batch that fits, every smaller one fits). ``guess`` is
    tested first, then its neighbour, widening by doubling steps until the answer is
    bracketed, then bisecting (Note [The max batch is probed by real steps]). ``fits_at`` /
    ``fails_at``: batches already known to fit / not to fit. Returns ``None`` as the batch
    when the answer lies above ``limit`` or needs more than ``max_probes`` probes.

        >>> probe_max_batch(lambda b: b <= 12, guess=12, limit=64)
        (12, [(12, True), (13, False)])
        >>> probe_max_batch(lambda b: b <= 12, guess=16, multiple=4, fits_at=8, limit=64)
        (12, [(16, False), (12, True)])
    """
    if multiple < 1 or limit < 0:
        raise ConfigurationError(f"probe_max_batch needs multiple >= 1 and limit >= 0, got {multiple}, {limit}")
    probes: list[tuple[int, bool]] = []
    low = (fits_at or 0) // multiple  # in units of `multiple`: known to fit (0 always "fits")
    high = None if fails_at is None else -(-fails_at // multiple)  # known not to fit
    top = limit // multiple

    def test(units: int) -> bool | None:
        if len(probes) >= max_probes:
            return None
        ok = bool(fits(units * multiple))
        probes.append((units * multiple, ok))
        return ok

    start = max(low + 1, guess // multiple)
    if high is not None:
        start = min(start, high - 1)
    if start > low and start <= top:
        ok = test(start)
        if ok is None:
            return None, probes
        if ok:
            low, step = start, 1
            while high is None:  # widen upwards
                if low + step > top:
                    return None, probes
                ok = test(low + step)
                if ok is None:
                    return None, probes
                if ok:
                    low, step = low + step, step * 2
                else:
                    high = low + step
        else:
            high, step = start, 1
            while high - low > 1 and high - step > low:  # widen downwards
                ok = test(high - step)
                if ok is None:
                    return None, probes
                if ok:
                    low = high - step
                    break
                high, step = high - step, step * 2
    elif high is None:
        return None, probes  # nothing to test below the limit and no known failure
    while high is not None and high - low > 1:
        middle = (low + high) // 2
        ok = test(middle)
        if ok is None:
            return None, probes
        low, high = (middle, high) if ok else (low, middle)
    return low * multiple, probes


def _steps_run(device: Any, settings: CompareSettings, step_plan: Plan, batch: int, *, collect: bool = True) -> bool:
    """Whether :data:`_PROBE_STEPS` full training steps at ``batch`` under ``step_plan`` run on ``device`` (no OOM).

    The model and its optimizer are built as in :func:`_train` (same seed, same optimizer),
    the batches from the workload at ``batch`` (Note [The max batch is probed by real steps]).
    ``collect=False`` skips the garbage collection after the run (~0.15 s: it walks all of
    torch) when ``device`` is closed right after and nothing else runs on it.
    """
    work = build_workload(replace(settings, batch=batch))
    torch_device = torch.device(device.torch_device)
    model = optimizer = handle = None
    try:
        with device:
            model = work.build(settings.seed).to(device=torch_device, dtype=DTYPES[settings.dtype])
            model, optimizer, handle = _optimizer_for(model, step_plan, device, settings)
        with PlanExecutor(model, step_plan, device) as executor:
            for step in range(_PROBE_STEPS):
                torch.manual_seed(settings.seed + step)
                with device:
                    data = work.make_batch(step, torch_device)
                    executor.forward_backward(data, work.loss)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
                del data
        return True
    except Exception as exc:
        if not _is_oom(exc):
            raise
        return False
    finally:
        _release_optimizer(optimizer, handle)
        del model, optimizer, handle
        if collect:
            gc.collect()
        try:
            device.synchronize()
        except Exception:  # a failed copy already reported through the OOM
            pass


def _measure_max_batch(
    settings: CompareSettings,
    step_plan: Plan,
    device: Any,
    options: dict[str, Any],
    *,
    guess: int,
    ran: bool,
    report: Progress,
    label: str,
    fresh: bool | None = None,
) -> tuple[int | None, list[tuple[int, bool]], str]:
    """``step_plan``'s max batch by real steps (Note [The max batch is probed by real steps]).

    ``ran``: whether the timed run at ``settings.batch`` completed (a known fit, else a known
    failure). ``fresh``: each probe on a new device made from ``options`` (default: on the
    fake device) rather than on ``device``. Returns the batch (``None``: not measured), the
    probes ``(batch, fits)`` and, when not measured, why.
    """
    fresh = settings.backend == "cpu" if fresh is None else fresh
    stuck: list[str] = []
    used = 0

    def fits(batch: int) -> bool:
        nonlocal used
        if stuck:
            raise _ProbeStopped
        # the bar counts the estimated probes (CompareSettings.total_steps); more probes only relabel it
        steps = min(_PROBE_STEPS, settings.probe_steps - used)
        used += steps
        report(steps, f"{label} max batch {batch}")
        if fresh:
            probe_device = _make_device(settings, **options)
            try:
                return _steps_run(probe_device, settings, step_plan, batch, collect=False)
            finally:
                if hasattr(probe_device, "close"):
                    probe_device.close()
        before = int(device.memory_stats().get("allocated_bytes", 0) or 0)
        ok = _steps_run(device, settings, step_plan, batch)
        left = int(device.memory_stats().get("allocated_bytes", 0) or 0) - before
        if left > 0:
            stuck.append(f"a probe at batch {batch} left {format_bytes(left)} allocated on the device")
        return ok

    try:
        batch, probes = probe_max_batch(
            fits,
            guess=max(1, guess),
            multiple=step_plan.microbatches,
            fits_at=settings.batch if ran else None,
            fails_at=None if ran else settings.batch,
            limit=_PROBE_MAX_FACTOR * settings.batch,
        )
    except _ProbeStopped:
        return None, [], stuck[0]
    finally:
        report(settings.probe_steps - used, label)
    if stuck:
        return None, probes, stuck[0]
    if batch is None:
        last = max((b for b, _ in probes), default=settings.batch)
        why = (
            f"still fits at batch {last}; larger batches than {_PROBE_MAX_FACTOR} x --batch are not probed"
            if len(probes) < _PROBE_LIMIT
            else f"no answer after {_PROBE_LIMIT} probes"
        )
        return None, probes, why
    return batch, probes, ""


class _ProbeStopped(Exception):
    """A probe left the device unclean: the search stops (Note [The max batch is probed by real steps])."""
