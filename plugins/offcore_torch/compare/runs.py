"""One training run of ``offcore compare``: trained on a device, its figures recorded, compared bit for bit with the reference."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from offcore.comparison import StrategyResult
from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.sim import Plan
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.settings import DTYPES, CompareSettings, Progress
from offcore_torch.models import Workload
from offcore_torch.optimizer.optimizer import OffloadOptimizer
from offcore_torch.parameters.parameters import offload_parameters
from offcore_torch.testing import bit_identical


# ----------------------------------------------------------------------------- one run
@dataclass
class _Run:
    """One training run's records (CPU copies)."""

    losses: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    params: Tensor | None = None
    step_times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    stats: list[list[Any]] = field(default_factory=list)
    error: str | None = None
    memory: list[tuple[float, int]] = field(default_factory=list)
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)
    half_peak: int | None = None
    """The device peak of one more step at half the batch (Note [The measured max batch has two points])."""


class _MemorySampler:
    """Samples the device's allocated bytes on a thread while a step runs (for the memory plot)."""

    def __init__(self, device: Any, interval_s: float = 5e-4) -> None:
        self.device = device
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offcore-compare-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            stats = self.device.memory_stats()
            self.samples.append((time.perf_counter(), int(stats.get("allocated_bytes", 0) or 0)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> _MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", copy=True) for t in tensors])


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, CapacityExceededError))


def _train(
    device: Any,
    work: Workload,
    settings: CompareSettings,
    step_plan: Plan,
    *,
    observe: bool,
    progress: Progress,
    label: str,
) -> _Run:
    """Train ``warmup + iters`` (+1 observed) steps under ``step_plan``; an OOM ends the run early."""
    run = _Run()
    torch_device = torch.device(device.torch_device)
    dtype = DTYPES[settings.dtype]
    total = settings.warmup + settings.iters
    steps = total + (1 if observe else 0)
    done = 0
    model = optimizer = handle = host = None
    params: list[Tensor] = []
    try:
        # Note: only the training work runs inside `with device:`; the CPU copies the comparison
        # keeps (losses, gradients) are made outside it, or the fake device would count them.
        with device:
            model = work.build(settings.seed).to(device=torch_device, dtype=dtype)
            model, optimizer, handle = _optimizer_for(model, step_plan, device, settings)
        params = [p for _, p in model.named_parameters()]
        offloaded = isinstance(optimizer, OffloadOptimizer)
        # Note [Compare reads the host copies under optimizer offload]: OffloadOptimizer sets
        # param.grad to None as each gradient leaves; the host gradients and masters are the values
        # (bit-identical to the device's by its contract), read without touching device memory
        host = optimizer if offloaded else None

        def grads_of() -> list[Tensor]:
            return [_host_grad(host, p) for p in params] if host is not None else [p.grad for p in params]

        def values_of() -> list[Tensor]:
            return [host.master(p) for p in params] if host is not None else params

        with PlanExecutor(model, step_plan, device, offload={"trace": observe}) as executor:
            for step in range(steps):
                observed = step == total
                if observed:  # the parameters the comparison checks are those after the timed steps
                    run.params = _flat(values_of())
                with device:
                    batch = work.make_batch(step % total if observed else step, torch_device)
                device.synchronize()
                device.reset_peak_memory_stats()
                torch.manual_seed(settings.seed + step)
                sampler = _MemorySampler(device) if observed else None
                if sampler is not None:
                    sampler.__enter__()
                try:
                    start = time.perf_counter()
                    with device:
                        outcome = executor.forward_backward(batch, work.loss)
                        device.synchronize()
                    backward_done = time.perf_counter()
                    if not observed:
                        run.losses.append(outcome.loss.detach().to("cpu", copy=True))
                        run.grads.append(_flat(grads_of()))
                    optimizer_start = time.perf_counter()
                    with device:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        device.synchronize()
                    end = time.perf_counter()
                finally:
                    if sampler is not None:
                        sampler.__exit__()
                seconds = (backward_done - start) + (end - optimizer_start)
                peak = int(device.memory_stats().get("peak_allocated_bytes", 0) or 0)
                if observed:
                    run.memory = [(t - start, b) for t, b in sampler.samples] if sampler else []
                    run.timeline = _timeline(outcome, start, optimizer_start, end)
                    run.traces = [h.trace_dict() for h in outcome.handles]
                elif step >= settings.warmup:
                    run.step_times.append(seconds)
                    run.peaks.append(peak)
                    run.stats.append(outcome.stats())
                del outcome, batch
                done += 1
                progress(1, label)
            if not observe:
                run.params = _flat(values_of())
            half = settings.batch // 2
            if half >= 1 and half % step_plan.microbatches == 0:
                # Note [The measured max batch has two points]: one more step at half the batch, after the
                # compared ones (its losses and parameters are not compared)
                with device:
                    batch = tuple(part[:half] for part in work.make_batch(0, torch_device))
                device.synchronize()
                device.reset_peak_memory_stats()
                with device:
                    executor.forward_backward(batch, work.loss)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
                run.half_peak = int(device.memory_stats().get("peak_allocated_bytes", 0) or 0)
                del batch
    except Exception as exc:
        if not _is_oom(exc):
            raise
        # keep the message only: the traceback's frames hold the step's tensors
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        run.error = ". ".join(message.split(". ")[:2]).rstrip(".")[:300]
    finally:
        _release_optimizer(optimizer, handle)
        # the parameters (and, under parameter streaming, device copies the handle issued for the next
        # step) go now, not at a later collection: the next strategy runs on this device
        params, host = [], None
        del model, optimizer, handle
        gc.collect()
        try:
            device.synchronize()
        except Exception:  # a failed copy already reported through the OOM
            pass
        if steps - done:
            progress(steps - done, label)
    return run


def _release_optimizer(optimizer: Any, handle: Any) -> None:
    """Stop a host optimizer and give a parameter handle's host copies back (after :func:`_optimizer_for`)."""
    try:
        if isinstance(optimizer, OffloadOptimizer):
            optimizer.close()
    finally:
        if handle is not None:
            handle.discard()


def _optimizer_for(model: nn.Module, step_plan: Plan, device: Any, settings: CompareSettings) -> tuple[Any, Any, Any]:
    """The model, its optimizer and the parameter-offload handle (or None) for ``step_plan`` (inside ``with device:``).

    Every strategy runs the same optimizer class and arguments (``torch.optim.AdamW(lr=...)``);
    ``plan.optimizer == "offload"`` runs it on the host through :class:`OffloadOptimizer`
    (``accumulation_steps=1``: a parameter steps as soon as its gradient landed, under backward);
    ``plan.parameters == "stream"`` streams the parameters with :func:`offload_parameters` (the
    OffloadOptimizer then steps the handle's host copies: no H2D after the step).
    """
    handle = offload_parameters(model, device) if step_plan.parameters == "stream" else None
    try:
        if step_plan.optimizer == "offload":
            accumulation = 1 if step_plan.microbatches == 1 else step_plan.microbatches
            tier: dict[str, Any] = {}
            if step_plan.optimizer_tier == "nvme":
                if settings.nvme_path is None:
                    raise ConfigurationError("a plan with optimizer_tier='nvme' needs CompareSettings.nvme_path")
                tier = {"tier": "nvme", "nvme_path": settings.nvme_path}
            optimizer: Any = OffloadOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                device=device,
                accumulation_steps=accumulation,
                lr=settings.lr,
                **tier,
            )
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    except BaseException:
        if handle is not None:
            handle.discard()
        raise
    return model, optimizer, handle


def _host_grad(optimizer: Any, param: Tensor) -> Tensor:
    grad = optimizer.host_grad(param)
    if grad is None:
        raise ConfigurationError("OffloadOptimizer has no host gradient for a parameter after backward")
    return grad


def _timeline(outcome: Any, start: float, optimizer_start: float, end: float) -> list[tuple[str, str, float, float]]:
    """Compute phases (host clock) and the offload regions' copies and waits, relative to ``start``."""
    spans: list[tuple[str, str, float, float]] = []
    for name, begin, finish in outcome.phases:
        spans.append(("compute", name, begin - start, finish - start))
    spans.append(("compute", "optimizer", optimizer_start - start, end - start))
    forward_starts = [begin for name, begin, _ in outcome.phases if name.startswith("forward")]
    for handle, origin in zip(outcome.handles, forward_starts, strict=False):
        # the region's trace starts at its forward (its first event), which is where the phase began
        for event in handle.trace_dict()["traceEvents"]:
            if event.get("ph") != "X" or event.get("cat") == "compute":
                continue
            begin = origin - start + event["ts"] / 1e6
            spans.append((event.get("cat", ""), event["name"], begin, begin + event.get("dur", 0.0) / 1e6))
    return spans


# ----------------------------------------------------------------------------- equality
def _accumulation_loss_delta(run: _Run | None, reference: _Run) -> float | None:
    """The largest loss change of the accumulate run against the reference (``None``: it did not run)."""
    if run is None or run.error is not None:
        return None
    return _compare_runs(run, reference)[1]


def _compare_runs(run: _Run, reference: _Run) -> tuple[bool, float | None, float | None]:
    """(bit-identical everywhere, max |Δloss|, max relative gradient difference) of two runs."""
    if not run.losses or len(run.losses) != len(reference.losses):
        return False, None, None
    identical = all(bit_identical(a, b) for a, b in zip(run.losses, reference.losses, strict=True))
    identical = identical and all(bit_identical(a, b) for a, b in zip(run.grads, reference.grads, strict=True))
    if run.params is not None and reference.params is not None:
        identical = identical and bit_identical(run.params, reference.params)
    loss_delta = max(abs(float(a) - float(b)) for a, b in zip(run.losses, reference.losses, strict=True))
    grad_diff = 0.0
    for a, b in zip(run.grads, reference.grads, strict=True):
        norm = float(b.double().norm())
        grad_diff = max(grad_diff, float((a.double() - b.double()).norm()) / norm if norm else 0.0)
    return identical, loss_delta, grad_diff


def _fill(result: StrategyResult, run: _Run) -> None:
    result.status = "ok"
    result.step_times_s = list(run.step_times)
    result.peak_device_bytes = max(run.peaks) if run.peaks else None
    stats = [s for step in run.stats for s in step]
    result.peak_pinned_bytes = max((s.peak_pinned_bytes for s in stats), default=0)
    result.peak_pageable_bytes = max((s.peak_pageable_bytes for s in stats), default=0)
    per_step_copies = [sum(s.offloaded_bytes + s.reloaded_bytes for s in step) for step in run.stats]
    result.copied_bytes = max(per_step_copies, default=0)
    waits = sorted(sum(s.exposed_wait_s for s in step) for step in run.stats)
    result.exposed_wait_s = waits[len(waits) // 2] if waits else 0.0
    result.losses = [float(loss) for loss in run.losses]
    result.memory_series = list(run.memory)
    result.timeline = list(run.timeline)
