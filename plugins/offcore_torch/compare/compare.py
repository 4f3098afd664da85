"""Run ``offcore compare``: one fixed workload, several strategies, one device, measured side by side.

The workflow (seed 004): fix the workload (model, dtype, batch, sequence length,
warm-up, iterations, seed); run a keep-all *reference* on an unlimited-capacity device
of the same backend and profile one warmed-up step (:mod:`offcore_torch.compare.profiler`);
choose the compared device (by default the CPU fake device with 70 % of the measured
keep-all peak, so the baseline runs out of memory, and a PCIe-like link scaled to this
machine's compute speed); then run every strategy through the
:class:`~offcore_torch.compare.executor.PlanExecutor` on that device and record its figures
next to the simulator's prediction. :mod:`offcore.comparison` decides and reports.

    >>> from offcore_torch.compare.compare import CompareSettings, run_compare          # doctest: +SKIP
    >>> comparison = run_compare(CompareSettings(iters=2, strategies=("baseline", "checkpoint")))  # doctest: +SKIP
    >>> print(comparison.text())                                                 # doctest: +SKIP
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

import offcore
from offcore.comparison import STRATEGIES, Comparison, Gates, StrategyResult
from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.sim import Action, Plan, StepProfile, plan, simulate, steady_prefetch, transformer_layer_profile
from offcore.sim.planner import STEADY_MARGIN_S
from offcore.units import format_bandwidth, format_bytes
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.profiler import StepMeasurement, measure_link, measure_step
from offcore_torch.layers import find_layers
from offcore_torch.models import GPTConfig, Workload, gpt_workload
from offcore_torch.optimizer.optimizer import OffloadOptimizer
from offcore_torch.parameters.parameters import offload_parameters
from offcore_torch.testing import bit_identical

__all__ = [
    "CompareSettings",
    "run_compare",
    "DTYPES",
    "pcie_like_bandwidths",
    "GPU_REFERENCE",
    "build_workload",
    "profile_workload",
    "WorkloadProfiler",
    "measure_microbatch_overhead",
    "strategy_plans",
    "plan_strategies",
    "bounded_offload_plan",
    "StrategyPlan",
]

Progress = Callable[[int, str], None]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""The dtypes the built-in workload trains in (float16 lacks CPU kernels for parts of the model)."""


@dataclass(frozen=True)
class GpuReference:
    """The machine the fake link imitates: a GPU with its achieved compute rate and its host link."""

    name: str = "H200-class GPU (400 TFLOP/s achieved) on PCIe Gen5 (53 GB/s D2H, 35 GB/s H2D)"
    flops_per_s: float = 400e12
    d2h_bandwidth: float = 53e9
    h2d_bandwidth: float = 35e9
    layer: str = "LLaMA-7B layer at sequence 4096 (bf16, flash attention)"

    def d2h_fraction(self) -> float:
        """Share of one layer's saved bytes the D2H link moves during that layer's forward."""
        layer = transformer_layer_profile(
            batch=1, seq=4096, hidden=4096, heads=32, ffn=11008, flops_per_s=self.flops_per_s
        )
        return self.d2h_bandwidth * layer.forward_s / layer.saved_bytes


GPU_REFERENCE = GpuReference()


def pcie_like_bandwidths(
    saved_bytes: float, forward_s: float, reference: GpuReference = GPU_REFERENCE
) -> tuple[float, float, str]:
    """D2H and H2D bandwidths that give this machine's layer the GPU reference's copy-to-compute ratio.

    A PCIe Gen5 link next to an H200-class GPU moves about 44 % of a LLaMA-7B layer's
    saved activations during that layer's forward; the fake link is set to move the same
    share of *this* layer's saved bytes in *this* layer's measured forward time (H2D at
    the reference's 35/53 of D2H). Returns ``(d2h, h2d, explanation)``.

    >>> d2h, h2d, why = pcie_like_bandwidths(saved_bytes=4e6, forward_s=0.01)
    >>> round(d2h / 1e6), round(h2d / d2h, 3)
    (176, 0.66)
    """
    if not (saved_bytes > 0 and forward_s > 0):
        raise ConfigurationError("scaling the link needs a layer with saved bytes and a positive forward time")
    fraction = reference.d2h_fraction()
    d2h = fraction * saved_bytes / forward_s
    h2d = d2h * reference.h2d_bandwidth / reference.d2h_bandwidth
    why = (
        f"next to an {reference.name}, the link copies {fraction:.0%} of what a {reference.layer} saves in the time "
        f"of that layer's forward; here a layer saves {format_bytes(int(saved_bytes))} in a {forward_s * 1e3:.1f} ms "
        f"forward, so the fake link gets the same ratio: D2H {format_bandwidth(d2h)}, H2D {format_bandwidth(h2d)}"
    )
    return d2h, h2d, why


_PROBE_STEPS = 2  # full steps a max-batch probe runs (Note [The max batch is probed by real steps])
_PROBE_ESTIMATE = 2  # probes a strategy usually needs (the progress bar's estimate)
_PROBE_LIMIT = 12  # probes before the search gives up (the extrapolation stands)
_PROBE_MAX_FACTOR = 8  # batches above this multiple of --batch are not probed (too slow; extrapolated)
_OVERHEAD_PAIRS = 7  # timed pairs of (1, 2 micro-batches) steps, after one warm-up pair


@dataclass(frozen=True)
class CompareSettings:
    """The fixed workload, the strategies and the compared device (see ``offcore compare --help``)."""

    backend: str = "cpu"
    dtype: str = "float32"
    batch: int = 8
    seq_len: int = 64
    layers: int = 4
    d_model: int = 64
    heads: int = 4
    vocab: int = 256
    dropout: float = 0.0
    warmup: int = 1
    iters: int = 3
    seed: int = 0
    lr: float = 1e-3
    strategies: tuple[str, ...] = STRATEGIES
    capacity: int | None = None
    capacity_fraction: float = 0.7
    d2h_bandwidth: float | None = None
    h2d_bandwidth: float | None = None
    latency_s: float = 10e-6
    observe: bool = True
    sanitize: bool = False
    threads: int | None = None
    budget_fraction: float | None = None
    planner_headroom: float = 0.0
    nvme_path: str | None = None
    """A directory on an NVMe disk: the row ``optimizer-offload-nvme`` runs there (skipped without it)."""
    probe_max_batch: bool = True
    """Measure each strategy's max batch by real steps (Note [The max batch is probed by real steps]);
    ``False`` (``--no-probe-max-batch``): the two-point extrapolation instead."""

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        for name in ("batch", "seq_len", "layers", "d_model", "heads", "vocab", "iters"):
            positive(name)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigurationError(f"--warmup must be an integer >= 0, got {self.warmup!r}")
        if self.dtype not in DTYPES:
            raise ConfigurationError(f"--dtype {self.dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
        if self.d_model % self.heads:
            raise ConfigurationError(f"--d-model {self.d_model} must be divisible by --heads {self.heads}")
        if self.layers < 2:
            raise ConfigurationError(
                f"--layers must be at least 2 (the plan acts on a stack of blocks), got {self.layers}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigurationError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 < self.capacity_fraction < 1.0:
            raise ConfigurationError(f"the capacity fraction must be in (0, 1), got {self.capacity_fraction!r}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ConfigurationError(
                f"unknown strategies {unknown or '(none given)'}: choose from {', '.join(STRATEGIES)}"
            )
        if self.budget_fraction is not None and not 0.0 < self.budget_fraction <= 1.0:
            raise ConfigurationError(f"budget_fraction must be in (0, 1], got {self.budget_fraction!r}")
        if not 0.0 <= self.planner_headroom < 0.5:
            raise ConfigurationError(f"planner_headroom must be in [0, 0.5), got {self.planner_headroom!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ConfigurationError(f"--threads must be a positive integer, got {self.threads!r}")
        if self.backend != "cpu" and (self.d2h_bandwidth is not None or self.h2d_bandwidth is not None):
            raise ConfigurationError(
                f"--d2h-bandwidth / --h2d-bandwidth set the fake device's emulated link; the {self.backend} backend "
                "uses its hardware link (drop them)"
            )

    @property
    def needs_overhead(self) -> bool:
        """Whether the micro-batch overhead is measured (accumulation possible and used)."""
        return self.batch % 2 == 0 and bool({"accumulate", "planned"} & set(self.strategies))

    @property
    def needs_kind_overheads(self) -> bool:
        """Whether the optimizer-offload / parameter-streaming runtimes' overheads are measured (a strategy uses them)."""
        return bool(
            {"optimizer-offload", "optimizer+activation-offload", "param-stream", "planned"} & set(self.strategies)
        )

    @property
    def profile_steps(self) -> int:
        """Steps of the reference phase: the reference run, the profiled step, the overhead runs."""
        kinds = 3 * (_KIND_ROUNDS + 2) if self.needs_kind_overheads else 0
        return self.warmup + self.iters + 1 + (2 * (_OVERHEAD_PAIRS + 1) if self.needs_overhead else 0) + kinds

    @property
    def total_steps(self) -> int:
        """Every training step the comparison runs (for a progress bar)."""
        reprofile = 1 if self.backend == "cpu" else 0
        return self.profile_steps + len(self.strategies) * (self.steps_per_strategy + reprofile + self.probe_steps)

    @property
    def probe_steps(self) -> int:
        """The steps one strategy's max-batch probes count for on a progress bar (their usual number)."""
        return _PROBE_ESTIMATE * _PROBE_STEPS if self.probe_max_batch else 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def steps_per_strategy(self) -> int:
        return self.warmup + self.iters + (1 if self.observe else 0)

    def workload(self) -> dict[str, Any]:
        return {
            "model": "TinyGPT",
            "layers": self.layers,
            "d_model": self.d_model,
            "heads": self.heads,
            "vocab": self.vocab,
            "dropout": self.dropout,
            "dtype": self.dtype,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "warmup": self.warmup,
            "iters": self.iters,
            "seed": self.seed,
            "optimizer": f"AdamW(lr={self.lr:g})",
        }


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


# Note [The predicted timeline is the predicted step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A predicted step time is the simulated layers' step plus what runs outside them
# (StepMeasurement.other_compute_s: the embedding, the head and the loss in forward and
# backward, the optimizer step). The predicted timeline and memory series draw all of it, so
# they end at the predicted step time and line up with the measured phases (forward#k,
# backward#k, optimizer): at each turn from a micro-step's forward to its backward the head
# and the loss run forward then backward (their bytes, StepProfile.head_bytes, held meanwhile),
# and the optimizer step closes the step at its measured peak.


def predicted_step_series(
    result: Any, measurement: StepMeasurement
) -> tuple[list[tuple[str, str, float, float]], list[tuple[float, int]]]:
    """The predicted timeline and memory series of one whole step (Note [The predicted timeline is the predicted step]).

    ``result`` is the simulated step of the planned layers; the spans and points come back
    shifted to make room for the compute outside them, which is drawn as its own spans.

        >>> timeline, memory = predicted_step_series(result, measurement)   # doctest: +SKIP
        >>> timeline[-1][1], timeline[-1][3] == predicted_s                  # doctest: +SKIP
        ('optimizer', True)
    """
    last = result.plan.layer_names[-1] if result.plan.layer_names else None
    forwards = [e for e in result.events if e.kind == "forward"]
    last_layer = last if last is not None else (forwards[-1].layer if forwards else "")
    # the turns: where the last layer's forward ends. A wait for copies in flight splits a forward in
    # pieces (Note [The simulator caps forward's copies in flight]): a piece followed, past its waits,
    # by another forward piece of the same layer is not an end
    computed = sorted((e for e in result.events if e.stream == "compute" and e.kind != "wait"), key=lambda e: e.start)
    turns = sorted(
        {
            e.end
            for e, after in zip(computed, [*computed[1:], None], strict=True)
            if e.kind == "forward"
            and e.layer == last_layer
            and not (after is not None and after.kind == "forward" and after.layer == last_layer)
        }
    )
    head_forward = measurement.other_forward_s / max(1, len(turns))
    head = head_forward + measurement.other_backward_s / max(1, len(turns))

    def shift(t: float, *, inclusive: bool) -> float:
        """``t`` on the whole step's clock: after every turn it passed, the head ran."""
        return t + head * sum(1 for turn in turns if turn < t or (inclusive and turn == t))

    spans: list[tuple[str, str, float, float]] = []
    for e in result.events:
        # at a turn, what starts there runs after the head, except the copy of forward's last save
        start = shift(e.start, inclusive=e.stream != "d2h" and e.kind != "forward")
        spans.append((e.stream, e.name, start, start + (e.end - e.start)))
    for k, turn in enumerate(turns):
        begin = shift(turn, inclusive=False)
        suffix = f"#{k}" if len(turns) > 1 else ""
        spans.append(("compute", f"forward:head+loss{suffix}", begin, begin + head_forward))
        spans.append(("compute", f"backward:head+loss{suffix}", begin + head_forward, begin + head))
    end = result.step_time_s + head * max(1, len(turns))
    host_optimizer = result.plan.optimizer == "offload"  # its host step is in the simulated step
    optimizer_s = 0.0 if host_optimizer else measurement.optimizer_s
    spans.append(("compute", "optimizer", end, end + optimizer_s))
    spans.sort(key=lambda span: (span[2], span[0]))

    memory: list[tuple[float, int]] = []
    points = list(zip(result.memory_times, result.memory_bytes, strict=True))
    index = 0
    while index < len(points):
        t = points[index][0]
        same = [level for time_, level in points[index:] if time_ == t]
        if t in turns:  # the head's bytes are held while it runs: the instant's peak lasts `head`
            top = same.index(max(same))
            memory.extend((shift(t, inclusive=False), level) for level in same[: top + 1])
            memory.extend((shift(t, inclusive=True), level) for level in same[top:])
        else:
            memory.extend((shift(t, inclusive=False), level) for level in same)
        index += len(same)
    final = memory[-1][1] if memory else 0
    if memory and memory[-1][0] < end:
        memory.append((end, final))
    optimizer_peak = 0 if host_optimizer else measurement.optimizer_peak_bytes
    memory.append((end, max(final, optimizer_peak)))  # the optimizer step's own peak
    memory.append((end + optimizer_s, final))
    return spans, memory


# ----------------------------------------------------------------------------- plans
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


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy's plan, how it was chosen, and its prediction on the planning profile.

    ``predicted`` is ``simulate`` of the plan on the profile every strategy is planned on
    (for "planned": the very result the planner minimised); ``predicted_s`` adds the
    compute outside the planned layers (``StepMeasurement.other_compute_s``).
    """

    plan: Plan | None
    why: str
    predicted: Any = None
    predicted_s: float | None = None
    predicted_peak_bytes: int | None = None


def _divisors(batch: int) -> list[int]:
    return [m for m in range(2, batch + 1) if batch % m == 0]


def plan_strategies(
    settings: CompareSettings,
    profile: StepProfile,
    measurement: StepMeasurement,
    budget: int,
    overhead: float,
    *,
    max_loss_delta: float | None = None,
    accumulation: bool = True,
    measured_peaks: dict[Plan, int] | None = None,
) -> dict[str, StrategyPlan]:
    """Every strategy's plan, chosen and predicted on one profile (Note [One profile for every plan]).

    ``max_loss_delta`` is the quality gate: ``0`` demands bit-identical results, which
    gradient accumulation does not give, so the planner then searches without it (as does
    ``accumulation=False``). ``measured_peaks``: device peaks of plans that already ran,
    which the planner trusts over the model's (Note [Measured peaks] in offcore/sim/planner.py).
    """
    # Note [One profile for every plan]: the named strategies' fits, the planner's search and
    # every prediction shown come from the same profile, micro-batch profiles, overhead and
    # target, so "planned" (the optimum over a space that contains every named plan, Note
    # [Every named strategy is in the search space] in offcore/sim/planner.py) is never
    # predicted slower than a named strategy predicted to fit.
    planning = replace(measurement, profile=profile)
    n = profile.n_layers
    names = profile.layer_names
    target = int(budget * (1.0 - settings.planner_headroom))
    divisors = _divisors(settings.batch)
    profiles = {m: planning.profile_for_microbatches(m) for m in [1, *divisors]}

    def predict(step_plan: Plan) -> tuple[Any, float, int]:
        result = simulate(profiles[step_plan.microbatches], step_plan, microbatch_overhead_s=overhead)
        return result, result.step_time_s + planning.other_compute_for(step_plan), planning.predicted_peak(result)

    named: dict[str, tuple[Plan | None, str]] = {
        "baseline": (Plan.keep_all(n, layer_names=names), "keep every activation on the device"),
        "checkpoint": (
            Plan.uniform(n, Action.RECOMPUTE, layer_names=names),
            "recompute every layer in backward (torch.utils.checkpoint per layer)",
        ),
        "offload": (Plan.uniform(n, Action.OFFLOAD, layer_names=names), "offload every layer's saved activations"),
    }
    half = (n + 1) // 2
    named["hybrid"] = (
        Plan([Action.OFFLOAD] * half + [Action.RECOMPUTE] * (n - half), layer_names=names),
        f"offload the first {half} layers (their reloads have the most time before backward needs them), "
        "recompute the rest",
    )
    # Note [Optimizer offload and parameter streaming in the simulator] (offcore/sim/simulator.py)
    named["optimizer-offload"] = (
        Plan.keep_all(n, layer_names=names, optimizer="offload"),
        "keep every activation; AdamW on the host (OffloadOptimizer): gradients D2H as backward makes them, "
        "each layer's host step as its gradients land, parameters H2D after it; no optimizer state on the device",
    )
    named["optimizer+activation-offload"] = (
        Plan.uniform(n, Action.OFFLOAD, layer_names=names, optimizer="offload"),
        "offload every layer's saved activations and run AdamW on the host (OffloadOptimizer)",
    )
    named["optimizer-offload-nvme"] = (
        (
            Plan.keep_all(n, layer_names=names, optimizer="offload", optimizer_tier="nvme"),
            f"keep every activation; AdamW on the host with its states on the NVMe tier at {settings.nvme_path} "
            "(OffloadOptimizer(tier='nvme')): read, stepped and written back per group at step()",
        )
        if settings.nvme_path is not None
        else (None, "no --nvme-path given (a directory on an NVMe disk for the optimizer states)")
    )
    named["param-stream"] = (
        Plan.uniform(n, Action.OFFLOAD, layer_names=names, optimizer="offload", parameters="stream"),
        "every kind off the device: parameters streamed in before each use (offload_parameters), activations "
        "offloaded, AdamW on the host over the streamed host copies (OffloadOptimizer)",
    )
    if not divisors:
        named["accumulate"] = (None, "batch 1 cannot be split into micro-batches")
    else:
        chosen, why = divisors[-1], "no micro-batch count fits the budget: the most micro-batches"
        for m in divisors:
            peak = predict(Plan.keep_all(n, microbatches=m, layer_names=names))[2]
            if peak <= target:
                chosen, why = m, f"the fewest micro-batches whose predicted peak ({format_bytes(peak)}) fits the budget"
                break
        named["accumulate"] = (
            Plan.keep_all(n, microbatches=chosen, layer_names=names),
            f"keep all, {chosen} micro-batches of {settings.batch // chosen}: {why}",
        )
    # Note [A finite prefetch budget makes the peak hold] (offcore/sim/planner.py): the offloaded
    # strategies reload within the smallest budget that costs them no predicted time, and drain
    # each layer's copies (Note [Drained offloads bound the forward's copies in flight])
    for name, (step_plan, why) in named.items():
        if step_plan is not None and Action.OFFLOAD in step_plan.actions:
            bounded = bounded_offload_plan(profiles[step_plan.microbatches], step_plan, overhead, peak_limit=target)
            named[name] = (bounded, why)
    plans: dict[str, StrategyPlan] = {}
    for name, (step_plan, why) in named.items():
        if step_plan is None:
            plans[name] = StrategyPlan(None, why)
        else:
            result, seconds, peak = predict(step_plan)
            plans[name] = StrategyPlan(step_plan, why, result, seconds, peak)
    if "planned" in settings.strategies:
        chosen = _planned(
            settings, profile, planning, profiles, target, overhead, named, max_loss_delta, accumulation, measured_peaks
        )
        plans["planned"] = _per_kind(chosen, plans, target, measured_peaks)
    return plans


def bounded_offload_plan(
    profile: StepProfile, step_plan: Plan, overhead_s: float = 0.0, peak_limit: int | None = None
) -> Plan:
    """``step_plan`` with a peak that holds in every run: :func:`offcore.sim.steady_prefetch` (reloads
    as early as a sized budget allows; with ``peak_limit``, no budget whose simulated peak exceeds it
    while a smaller one fits) and ``drain_offloads``. Unchanged when it offloads nothing.

    Note [A finite prefetch budget makes the peak hold] (offcore/sim/planner.py) and Note [Drained
    offloads bound the forward's copies in flight] (offcore/sim/simulator.py): the runtime enforces
    both, so the measured peak no longer moves with its link estimate or its copies' speed.

    >>> from offcore.sim import uniform_profile
    >>> p = uniform_profile(2, forward_s=1e-3, backward_s=2e-3, saved_bytes=4096, h2d_bandwidth="1GiB/s")
    >>> bounded = bounded_offload_plan(p, Plan.uniform(2, "offload"))
    >>> bounded.prefetch.budget_bytes, bounded.drain_offloads
    (4096, True)
    """
    if Action.OFFLOAD not in step_plan.actions:
        return step_plan
    prefetch = steady_prefetch(profile, step_plan, microbatch_overhead_s=overhead_s, peak_limit=peak_limit)
    return replace(step_plan, prefetch=prefetch, drain_offloads=True)


_KIND_STRATEGIES = ("optimizer-offload", "optimizer+activation-offload", "param-stream")


def _per_kind(
    chosen: StrategyPlan, plans: dict[str, StrategyPlan], target: int, measured_peaks: dict[Plan, int] | None
) -> StrategyPlan:
    """The planner's activation plan, or a strategy that moves other kinds when it is predicted faster and fits.

    Note [The planner chooses per kind]: offcore.sim.plan searches activation plans with the
    optimizer on the device; the optimizer-offload and parameter-streaming plans are simulated
    on the same profile (their host step and copies in the simulated step, the device optimizer
    step not added), so their predicted step times compare with the planner's. "planned" takes
    the fastest predicted to fit the target (a measured peak within it counts as fitting).
    """
    best = chosen
    for name in _KIND_STRATEGIES:
        candidate = plans.get(name)
        if candidate is None or candidate.plan is None or candidate.predicted_s is None:
            continue
        peak = candidate.predicted_peak_bytes or 0
        ran = next((v for k, v in (measured_peaks or {}).items() if k.describe() == candidate.plan.describe()), None)
        if min(peak, ran if ran is not None else peak) > target:
            continue
        if best.predicted_s is None or best.plan is None or candidate.predicted_s < best.predicted_s:
            best = candidate
    if best is chosen:
        return chosen
    was = (
        f"the activation planner's best, predicted {chosen.predicted_s * 1e3:.1f} ms"
        if chosen.plan is not None and chosen.predicted_s is not None
        else f"the activation planner found nothing ({chosen.why})"
    )
    return replace(
        best,
        why=f"{best.why}: predicted {best.predicted_s * 1e3:.1f} ms with peak "
        f"{format_bytes(best.predicted_peak_bytes or 0)} within {format_bytes(target)}, faster than {was} "
        "(the planner chooses per kind: Note [The planner chooses per kind])",
    )


def strategy_plans(
    settings: CompareSettings,
    profile: StepProfile,
    measurement: StepMeasurement,
    budget: int,
    overhead: float,
    *,
    max_loss_delta: float | None = None,
) -> dict[str, tuple[Plan | None, str]]:
    """The plan of each strategy and how it was chosen (``None`` when the strategy cannot run)."""
    chosen = plan_strategies(settings, profile, measurement, budget, overhead, max_loss_delta=max_loss_delta)
    return {name: (choice.plan, choice.why) for name, choice in chosen.items()}


def _planned(
    settings: CompareSettings,
    profile: StepProfile,
    planning: StepMeasurement,
    profiles: dict[int, StepProfile],
    target: int,
    overhead: float,
    named: dict[str, tuple[Plan | None, str]],
    max_loss_delta: float | None,
    accumulation: bool,
    measured_peaks: dict[Plan, int] | None = None,
) -> StrategyPlan:
    """The planner's plan over keep / offload / recompute per layer × K × prefetch × micro-batches."""
    headroom = f" ({settings.planner_headroom:.0%} below the budget)" if settings.planner_headroom else ""
    if planning.optimizer_peak_bytes > target:
        return StrategyPlan(
            None,
            f"the planner found no plan within the budget: the optimizer step alone peaks at "
            f"{format_bytes(planning.optimizer_peak_bytes)}, above {format_bytes(target)}; no activation plan "
            "changes that",
        )
    if not accumulation:
        excluded = "accumulation not searched (its loss moved more than --max-loss-delta)"
    elif max_loss_delta is not None and max_loss_delta <= 0:
        accumulation = False
        excluded = "accumulation not searched: --max-loss-delta 0 demands bit-identical results, which it does not give"
    else:
        excluded = ""
    counts = sorted(profiles) if accumulation else [1]
    # the planner searches activation plans with the device optimizer: the optimizer-offload and
    # parameter-streaming strategies are compared as rows, not searched (docs/planner.md)
    candidates = [
        p
        for p, _ in named.values()
        if p is not None and p.microbatches in counts and p.optimizer == "device" and p.parameters == "resident"
    ]
    measured = {
        p: peak
        for p, peak in (measured_peaks or {}).items()
        if p.microbatches in counts and p.optimizer == "device" and p.parameters == "resident"
    }
    # Note [A finite prefetch budget makes the peak hold]: the planner searches finite budgets only,
    # from the one sized for the named offloaded strategies up (no budget: a peak that moves with load)
    sized = {p.prefetch.budget_bytes for p in candidates if p.prefetch.budget_bytes is not None}
    budgets = sorted({b * k for b in sized for k in (1, 2, 4)}) or None
    try:
        result = plan(
            profile,
            target,
            prefetch_budgets=budgets,
            prefetch_margin_s=STEADY_MARGIN_S if budgets else 0.0,
            lower_bound=False,
            microbatches=counts,
            microbatch_profiles={m: profiles[m] for m in counts},
            microbatch_overhead_s=overhead,
            candidates=candidates,
            measured_peaks=measured,
        )
    except CapacityExceededError as exc:
        return StrategyPlan(None, f"the planner found no plan within the budget: {exc}")
    predicted = result.predicted
    seconds = predicted.step_time_s + planning.other_compute_s
    peak = planning.predicted_peak(predicted)
    why = (
        f"offcore.sim.plan under {format_bytes(target)}{headroom}: predicted {seconds * 1e3:.1f} ms "
        f"({predicted.step_time_s * 1e3:.1f} ms of layer compute and copies), peak {format_bytes(peak)}; "
        f"searched keep/offload/recompute per layer, K, prefetch and micro-batches {counts}, every named "
        f"strategy included ({result.method}, {result.evaluated} plans simulated)"
    )
    if result.accumulates:
        m = result.plan.microbatches
        limit = "" if max_loss_delta is None else f" (allowed: --max-loss-delta {max_loss_delta:g})"
        why += (
            f"; accumulates {m} micro-batches: not bit-identical, the gradients are summed in another order"
            + (" and dropout draws other masks" if settings.dropout else "")
            + limit
        )
        alternative = result.alternatives.get(1)
        if alternative is not None:
            why += (
                f"; the fastest bit-identical plan, {alternative[0].describe()}, is predicted at "
                f"{(alternative[1] + planning.other_compute_s) * 1e3:.1f} ms"
            )
        else:
            why += "; no plan without accumulation fits"
    ran = next((value for known, value in measured.items() if known.describe() == result.plan.describe()), None)
    if ran is not None and peak > target:
        why += (
            f"; the model predicts a peak above the target, but this plan ran at {format_bytes(ran)} on the "
            "device, which the planner trusts (the simulator's peaks for offload and recompute are conservative)"
        )
    if excluded:
        why += f"; {excluded}"
    return StrategyPlan(result.plan, why, predicted, seconds, peak)


def _replan_with_measured_peaks(
    choice: StrategyPlan,
    results: list[StrategyResult],
    settings: CompareSettings,
    profile: StepProfile,
    measurement: StepMeasurement,
    budget: int,
    overhead: float,
    gates: Gates,
    accumulation: bool,
    note: Callable[[str], None],
) -> StrategyPlan:
    """Plan again when the strategies that ran show the memory model wrong near the budget.

    Note [Measured peaks] (offcore/sim/planner.py): the strategies run before "planned".
    A measured peak within the target beats the simulator's figure (and is the peak reported
    for a plan chosen on it); a peak
    measured above its prediction (or an out-of-memory error under a predicted fit) shows
    bytes the model misses, which the planner then keeps as a margin below the budget.
    """
    target = int(budget * (1.0 - settings.planner_headroom))
    capacity = profile.capacity_bytes
    measured: dict[Plan, int] = {}
    surprises = []
    for result in results:
        if result.plan_dict is None or result.predicted_peak_bytes is None:
            continue
        known = Plan.from_dict(result.plan_dict)
        predicted = result.predicted_peak_bytes
        if result.ok and result.peak_device_bytes is not None:
            measured[known] = result.peak_device_bytes
            if result.peak_device_bytes <= target < predicted:
                surprises.append(
                    f"{result.name} ran at {format_bytes(result.peak_device_bytes)} (predicted {format_bytes(predicted)})"
                )
            elif result.peak_device_bytes > predicted and result.peak_device_bytes > target - (target >> 4):
                surprises.append(
                    f"{result.name} peaked at {format_bytes(result.peak_device_bytes)}, above its predicted "
                    f"{format_bytes(predicted)}"
                )
        elif result.status == "oom" and capacity is not None and predicted <= capacity:
            measured[known] = capacity + 1  # its peak was above the capacity, whatever the model said
            surprises.append(f"{result.name} ran out of memory though predicted at {format_bytes(predicted)}")
    if not surprises:
        return choice
    again = plan_strategies(
        settings,
        profile,
        measurement,
        budget,
        overhead,
        max_loss_delta=gates.max_loss_delta,
        accumulation=accumulation,
        measured_peaks=measured,
    )["planned"]
    if choice.plan is not None and again.plan is not None and again.plan.describe() == choice.plan.describe():
        return choice
    if again.plan is not None and again.predicted_peak_bytes is not None:
        # chosen on a measured peak (the planner's fit test used it): that is the figure it fits by
        ran = [peak for known, peak in measured.items() if known.describe() == again.plan.describe()]
        if ran and min(ran) <= target:
            again = replace(again, predicted_peak_bytes=min(again.predicted_peak_bytes, min(ran)))
    note(
        "planned: re-planned with the measured peaks of the strategies that ran (target "
        f"{format_bytes(target)}): {', '.join(surprises)}"
    )
    return again


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


# ----------------------------------------------------------------------------- main
def _make_device(settings: CompareSettings, **options: Any) -> Any:
    if settings.backend == "cpu":
        options.setdefault("sanitize", settings.sanitize)
        return offcore.device("cpu", **options)
    options.pop("d2h_bandwidth", None)
    options.pop("h2d_bandwidth", None)
    options.pop("latency", None)
    return offcore.device(settings.backend, **options)


def build_workload(settings: CompareSettings) -> Workload:
    """The fixed TinyGPT workload of ``settings`` (model builder, batches, loss)."""
    config = GPTConfig(
        vocab_size=settings.vocab,
        d_model=settings.d_model,
        n_heads=settings.heads,
        n_layers=settings.layers,
        seq_len=settings.seq_len,
        dropout=settings.dropout,
    )
    return gpt_workload(config, batch_size=settings.batch, data_seed=settings.seed)


class WorkloadProfiler:
    """A warmed-up keep-all copy of the workload (kernels and optimizer state ready) that profiles a step on demand.

    ``offcore compare`` profiles once to plan, and again right before each strategy
    runs (on the fake device), so each prediction comes from a step measured under the
    same host load as the steps it is compared with.
    """

    def __init__(self, device: Any, work: Workload, settings: CompareSettings) -> None:
        self.device, self.work, self.settings = device, work, settings
        self.torch_device = torch.device(device.torch_device)
        with device:
            self.model = work.build(settings.seed).to(device=self.torch_device, dtype=DTYPES[settings.dtype])
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr)
            for step in range(max(1, settings.warmup)):
                work.loss(self.model, work.make_batch(step, self.torch_device)).backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.batch = work.make_batch(0, self.torch_device)

    def measure(self, **options: Any) -> StepMeasurement:
        """One profiled step (:func:`offcore_torch.compare.profiler.measure_step`; ``options`` pass through; default no link, calibrated)."""
        options.setdefault("link", False)
        options.setdefault("calibrate", True)  # Note [Profiler calibration]
        torch.manual_seed(self.settings.seed)
        with self.device:
            return measure_step(
                self.model,
                lambda: self.work.loss(self.model, self.batch),
                self.device,
                layers=find_layers(self.model),
                optimizer=self.optimizer,
                batch_size=self.settings.batch,
                **options,
            )


def profile_workload(device: Any, work: Workload, settings: CompareSettings) -> StepMeasurement:
    """Warm a fresh model up (kernels, optimizer state), then profile one step (no link: it is measured later)."""
    return WorkloadProfiler(device, work, settings).measure()


def measure_microbatch_overhead(device: Any, work: Workload, settings: CompareSettings, report: Progress) -> float:
    """Seconds each extra micro-step costs: the median paired difference of 2-micro-batch and 1-micro-batch steps.

    The simulator splits a step's compute linearly; real micro-steps also pay fixed costs
    (kernel launches, Python, the head and loss per micro-batch), which this measures.
    Two warmed-up copies of the workload take turns (one step each, ``_OVERHEAD_PAIRS``
    times), so a change of host load hits both sides of each difference alike.
    """
    n = settings.layers
    torch_device = torch.device(device.torch_device)
    dtype = DTYPES[settings.dtype]
    runners = []
    for microbatches in (1, 2):
        with device:
            model = work.build(settings.seed).to(device=torch_device, dtype=dtype)
            optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
        executor = PlanExecutor(model, Plan.keep_all(n, microbatches=microbatches), device)
        runners.append((model, optimizer, executor))

    def step(index: int, number: int) -> float:
        _, optimizer, executor = runners[index]
        with device:
            batch = work.make_batch(number, torch_device)
        device.synchronize()
        start = time.perf_counter()
        with device, executor:
            executor.forward_backward(batch, work.loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            device.synchronize()
        report(1, "overhead")
        return time.perf_counter() - start

    differences = []
    for number in range(_OVERHEAD_PAIRS + 1):  # the first pair warms up
        one, two = step(0, number), step(1, number)
        if number:
            differences.append(two - one)
    return max(0.0, statistics.median(differences))


_KIND_ROUNDS = 5  # timed rounds (one step of each variant) after two warm-up rounds


# Note [Measured overhead of the optimizer and parameter runtimes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# OffloadOptimizer and offload_parameters do their own work on the compute stream (per-parameter
# hooks and events, copies issued, storages swapped, and the host worker contending for the host's
# cores); on a small model it is most of their cost. It is measured on the unlimited reference
# device as compare times a step (forward, backward, optimizer.step(), zero_grad, synchronize):
# warmed-up copies of the workload take turns (keep all with the device optimizer, with
# OffloadOptimizer, with OffloadOptimizer over streamed parameters), and the median paired
# difference, less what the simulator already predicts for that difference on an unlimited link
# (streaming: the copies; the optimizer: the device optimizer step the baseline pays), is the overhead
# (StepProfile.optimizer_offload_overhead_s, parameter_stream_overhead_s), never negative.
# Parameter streaming's difference is taken in the compute thread's CPU time
# (``time.thread_time``), not in wall time: its work is all on that thread (hooks, the
# scheduler's round, copies issued, storages resized: ~130 us per module call on the fake
# device), and the wall-time difference of two ~50 ms steps on a shared 2-core host moved
# from -26 to +14 ms across ten paired rounds (median 5 ms in one run, 18 ms or 0 in others)
# while the CPU-time difference stayed within 6.5-7.8 ms. What waits on copies is the
# simulator's part (the link). The optimizer's stays in wall time: most of it is the host
# worker taking the compute thread's core on a loaded 2-core host (CPU time of the compute
# thread: 1.3-6.7 ms; wall: 12-84 ms), which the simulator's separate "host" stream does not
# see; in CPU time the optimizer strategies ran 1.4-2 x their prediction at load 5.7 (wall
# time: within 15 % at load 4.3).
def measure_kind_overheads(
    device: Any,
    work: Workload,
    settings: CompareSettings,
    measurement: StepMeasurement,
    report: Progress,
    *,
    rounds: int = _KIND_ROUNDS,
) -> tuple[float, float]:
    """``(optimizer offload, parameter streaming)`` compute-stream seconds per step (Note [Measured overhead
    of the optimizer and parameter runtimes]); ``rounds`` timed rounds (medians of the per-round
    differences: more rounds, a steadier figure on a busy host)."""
    n = settings.layers
    variants = [
        Plan.keep_all(n),
        Plan.keep_all(n, optimizer="offload"),
        Plan.keep_all(n, optimizer="offload", parameters="stream"),
    ]
    torch_device = torch.device(device.torch_device)
    built: list[tuple[Any, Any, Any]] = []
    times: list[list[float]] = [[] for _ in variants]
    cpu: list[list[float]] = [[] for _ in variants]
    try:
        for step_plan in variants:
            with device:
                model = work.build(settings.seed).to(device=torch_device, dtype=DTYPES[settings.dtype])
                built.append(_optimizer_for(model, step_plan, device, settings))
        for number in range(max(1, rounds) + 2):
            for index, (model, optimizer, _) in enumerate(built):
                with device:
                    batch = work.make_batch(number % max(1, settings.iters), torch_device)
                    device.synchronize()
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    work.loss(model, batch).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    device.synchronize()
                    seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - start_cpu
                    del batch
                if number >= 2:
                    times[index].append(seconds)
                    cpu[index].append(cpu_seconds)
                report(1, "profile")
    finally:
        for _, optimizer, handle in built:
            _release_optimizer(optimizer, handle)
        built.clear()
        gc.collect()
    unlimited = replace(measurement, profile=measurement.profile.with_link(d2h_bandwidth="inf", h2d_bandwidth="inf"))
    predicted = [unlimited.predict(step_plan)[1] for step_plan in variants]
    optimizer_diff = statistics.median(b - a for a, b in zip(times[0], times[1], strict=True))
    stream_diff = statistics.median(c - b for b, c in zip(cpu[1], cpu[2], strict=True))
    return (
        max(0.0, optimizer_diff - (predicted[1] - predicted[0])),
        max(0.0, stream_diff - (predicted[2] - predicted[1])),
    )


def run_compare(
    settings: CompareSettings,
    *,
    gates: Gates | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> Comparison:
    """Run the whole comparison (see the module doc) and return its :class:`~offcore.comparison.Comparison`.

    ``progress(steps, label)`` is called as training steps complete (for a progress
    bar); ``log(line)`` with each decision made along the way. An out-of-memory error
    in one strategy is recorded as its status; the others still run.
    """
    threads = settings.threads if settings.threads is not None else (1 if settings.backend == "cpu" else None)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        # The fake device computes on the calling thread next to its copy threads; one intra-op
        # thread keeps step times stable (several spin against each other on a busy host).
        torch.set_num_threads(threads)
    try:
        return _run_compare(settings, gates or Gates(), progress, log, threads or previous_threads)
    finally:
        torch.set_num_threads(previous_threads)


def _run_compare(
    settings: CompareSettings,
    gates: Gates,
    progress: Progress | None,
    log: Callable[[str], None] | None,
    threads: int,
) -> Comparison:
    report = progress or (lambda steps, label: None)
    say = log or (lambda line: None)
    notes: list[str] = []

    def note(line: str) -> None:
        notes.append(line)
        say(line)

    work = build_workload(settings)

    # 1. reference run and profile on an unlimited-capacity device of the same backend
    unlimited = _make_device(settings, capacity="1TiB", d2h_bandwidth="inf", h2d_bandwidth="inf", latency=0)
    # On the fake device the profiler stays to re-profile before each strategy (two fake devices
    # coexist freely); a real device's capacity cap is process-wide, so there the one profile serves.
    reprofile = settings.backend == "cpu"
    profiler: WorkloadProfiler | None = None
    try:
        reference = _train(
            unlimited, work, settings, Plan.keep_all(settings.layers), observe=False, progress=report, label="reference"
        )
        if reference.error is not None:
            raise CapacityExceededError(
                f"the keep-all reference ran out of memory on the whole {settings.backend} device: "
                f"{reference.error}. Shrink the workload (--batch, --seq-len, --layers, --d-model)."
            )
        profiler = WorkloadProfiler(unlimited, work, settings)
        measurement = profiler.measure()
        report(1, "profile")
        overhead = measure_microbatch_overhead(unlimited, work, settings, report) if settings.needs_overhead else 0.0
        if settings.needs_kind_overheads:
            optimizer_overhead, stream_overhead = measure_kind_overheads(unlimited, work, settings, measurement, report)
            profiled = replace(
                measurement.profile,
                optimizer_offload_overhead_s=optimizer_overhead,
                parameter_stream_overhead_s=stream_overhead,
            )
            measurement = replace(measurement, profile=profiled)
    finally:
        if not reprofile:
            profiler = None
            if hasattr(unlimited, "close"):
                unlimited.close()
    base = measurement.profile
    keep_all_peak = measurement.peak_bytes
    mean_saved = sum(layer.saved_bytes for layer in base.layers) / base.n_layers
    mean_forward = base.forward_s / base.n_layers
    note(
        f"profile: {base.n_layers} layers, {format_bytes(int(mean_saved))} saved and {mean_forward * 1e3:.1f} ms "
        f"forward per layer; keep-all peak {format_bytes(keep_all_peak)} "
        f"(parameters {format_bytes(measurement.param_bytes)}, resident at step start "
        f"{format_bytes(measurement.resident_bytes)}); the optimizer step peaks at "
        f"{format_bytes(measurement.optimizer_peak_bytes)}"
    )

    # 2. the compared device
    if settings.capacity is not None:
        capacity = settings.capacity
        note(f"capacity: {format_bytes(capacity)} (--capacity)")
    else:
        # Note [Default capacity]: the resident state (parameters, optimizer state, the batch)
        # does not shrink under any strategy; the activation part of the keep-all peak does.
        # Keep the resident bytes and a fraction of the rest, so the baseline cannot fit and
        # the strategies are judged on the memory they can save, whatever the model's size.
        resident = min(measurement.resident_bytes, keep_all_peak)
        capacity = resident + int(settings.capacity_fraction * (keep_all_peak - resident))
        where = "the fake device" if settings.backend == "cpu" else f"a cap on the {settings.backend} device"
        note(
            f"capacity: {format_bytes(capacity)} ({where}) = resident {format_bytes(resident)} + "
            f"{settings.capacity_fraction:.0%} of the keep-all step's {format_bytes(keep_all_peak - resident)} "
            "above it, so the baseline does not fit and the strategies have to earn their memory"
        )
        optimizer_floor = int(measurement.optimizer_peak_bytes * (1.0 + settings.planner_headroom)) + 1
        if optimizer_floor > capacity:
            capacity = optimizer_floor
            note(
                f"capacity raised to {format_bytes(capacity)}: the optimizer step alone peaks at "
                f"{format_bytes(measurement.optimizer_peak_bytes)} (parameters, gradients, optimizer state and "
                "its temporaries), which no activation strategy changes"
                + ("; the baseline fits at this capacity" if capacity >= keep_all_peak else "")
            )
    options: dict[str, Any] = {"capacity": capacity}
    if settings.backend == "cpu":
        d2h, h2d, why = pcie_like_bandwidths(mean_saved, mean_forward)
        if settings.d2h_bandwidth is not None or settings.h2d_bandwidth is not None:
            d2h = settings.d2h_bandwidth if settings.d2h_bandwidth is not None else d2h
            h2d = settings.h2d_bandwidth if settings.h2d_bandwidth is not None else h2d
            why = f"fake link from the command line: D2H {format_bandwidth(d2h)}, H2D {format_bandwidth(h2d)}"
        note(f"link: {why}; latency {settings.latency_s * 1e6:g} us per copy")
        options.update(d2h_bandwidth=d2h, h2d_bandwidth=h2d, latency=settings.latency_s)
    device = _make_device(settings, **options)
    try:
        with device:
            link = measure_link(device, repeats=2)
        profile = base.with_link(**link.as_profile_fields(), capacity_bytes=capacity)
        if settings.nvme_path is not None and "optimizer-offload-nvme" in settings.strategies:
            from offcore.bandwidth import measure_nvme_link
            from offcore.nvme import NvmeTier

            with NvmeTier(settings.nvme_path, budget="1GiB") as probe:  # the simulator's NVMe links
                nvme_link = measure_nvme_link(probe, max_bytes="64MiB")
            note(f"NVMe tier at {settings.nvme_path}: {nvme_link}")
            profile = profile.with_nvme_link(nvme_link)
        measurement = replace(measurement, profile=profile, link=link)
        note(
            f"measured link: D2H {format_bandwidth(link.d2h_bandwidth)}, H2D {format_bandwidth(link.h2d_bandwidth)}, "
            f"latency {link.latency_s * 1e6:.0f} us, {'duplex' if link.duplex else 'one shared link'}"
        )
        if gates.memory_budget is not None:
            budget = gates.memory_budget
        elif settings.budget_fraction is not None:
            budget = int(settings.budget_fraction * keep_all_peak)
            note(f"planning budget: {format_bytes(budget)} = {settings.budget_fraction:.0%} of the keep-all peak")
        else:
            budget = capacity
        plans = plan_strategies(settings, profile, measurement, budget, overhead, max_loss_delta=gates.max_loss_delta)
        if settings.needs_overhead:
            note(f"micro-batch overhead: {overhead * 1e3:.1f} ms per extra micro-step (measured, given to the planner)")

        # 3. every strategy on the compared device
        baseline_run: _Run | None = None
        results: list[StrategyResult] = []
        runs: dict[str, _Run] = {}
        for name in STRATEGIES:
            if name not in settings.strategies:
                continue
            choice = plans[name]
            if name == "planned":
                # the quality gate as the decision applies it: accumulation's measured loss change
                moved = _accumulation_loss_delta(runs.get("accumulate"), baseline_run or reference)
                accumulation = moved is None or moved <= gates.max_loss_delta
                if not accumulation and choice.plan is not None and choice.plan.microbatches > 1:
                    note(
                        f"planned: re-planned without accumulation, whose loss moved by {moved:.3g} > "
                        f"--max-loss-delta {gates.max_loss_delta:g} in the accumulate run"
                    )
                    choice = plan_strategies(
                        settings,
                        profile,
                        measurement,
                        budget,
                        overhead,
                        max_loss_delta=gates.max_loss_delta,
                        accumulation=False,
                    )["planned"]
                choice = _replan_with_measured_peaks(
                    choice, results, settings, profile, measurement, budget, overhead, gates, accumulation, note
                )
            step_plan, why = choice.plan, choice.why
            result = StrategyResult(name, why=why, tokens_per_step=settings.tokens_per_step)
            if step_plan is None:
                result.status, result.error = "skipped", why
                report(settings.steps_per_strategy + (1 if reprofile else 0) + settings.probe_steps, name)
                results.append(result)
                continue
            result.plan = step_plan.describe()
            result.plan_dict = step_plan.to_dict()
            # Note [One profile for every plan]: the figure shown is the planning profile's (for
            # "planned", the planner's own result); a step profiled right before the run, under the
            # host load of the moment, is kept alongside
            predicted = choice.predicted
            if profiler is not None:
                fresh = profiler.measure(link=link, capacity_bytes=capacity)
                kinds = {  # measured once (Note [Measured overhead of the optimizer and parameter runtimes])
                    "optimizer_offload_overhead_s": profile.optimizer_offload_overhead_s,
                    "parameter_stream_overhead_s": profile.parameter_stream_overhead_s,
                }
                fresh = replace(fresh, profile=replace(fresh.profile, **kinds))
                result.reprofiled_step_s = fresh.predict(step_plan, microbatch_overhead_s=overhead)[1]
                report(1, "profile")
            result.predicted_step_s = choice.predicted_s
            result.predicted_peak_bytes = choice.predicted_peak_bytes
            result.predicted_wait_s = predicted.exposed_wait_s
            result.predicted_timeline, result.predicted_memory = predicted_step_series(predicted, measurement)
            result.predicted_max_batch = _max_batch(profile, measurement, step_plan, settings.batch)
            result.max_batch, result.max_batch_source = result.predicted_max_batch, "simulated"
            run = _train(device, work, settings, step_plan, observe=settings.observe, progress=report, label=name)
            runs[name] = run
            if run.error is not None:
                result.status = "oom"
                result.error = run.error
                say(f"{name}: out of memory ({result.error})")
                left = int(device.memory_stats().get("allocated_bytes", 0) or 0)
                if left and settings.backend == "cpu":
                    # Note [A fresh fake device after an out-of-memory error]: an OOM inside a
                    # checkpointed backward can leave bytes allocated after the run ended (seen:
                    # 3.0 MiB); they would count against every later strategy. The emulated
                    # device is recreated with the same capacity and link.
                    note(
                        f"{name}: {format_bytes(left)} stayed allocated on the fake device after its out-of-memory "
                        "error; the next strategies run on a fresh one with the same capacity and link"
                    )
                    if hasattr(device, "close"):
                        device.close()
                    device = _make_device(settings, **options)
            else:
                _fill(result, run)
                result.max_batch = _extrapolated_batch(
                    settings.batch, capacity, measurement, result.peak_device_bytes, multiple=step_plan.microbatches
                )
                result.max_batch_source = "extrapolated"
                if run.half_peak is not None and result.peak_device_bytes is not None:
                    two_point = two_point_batch(
                        settings.batch,
                        settings.batch // 2,
                        capacity,
                        result.peak_device_bytes,
                        run.half_peak,
                        step_plan.microbatches,
                    )
                    if two_point is not None and measurement.optimizer_peak_bytes <= capacity:
                        result.max_batch = two_point
            if name == "baseline" and not result.ok:  # the reference measured its keep-all peak
                result.max_batch = _extrapolated_batch(settings.batch, capacity, measurement, measurement.peak_bytes)
                result.max_batch_source = "extrapolated"
            result.extrapolated_max_batch = result.max_batch if result.max_batch_source == "extrapolated" else None
            if settings.probe_max_batch:
                # Note [The max batch is probed by real steps]
                guess = result.predicted_max_batch or result.max_batch or settings.batch
                measured, probes, why = _measure_max_batch(
                    settings, step_plan, device, options, guess=guess, ran=result.ok, report=report, label=name
                )
                result.max_batch_probes = [[batch, ok] for batch, ok in probes]
                if measured is not None:
                    result.max_batch, result.max_batch_source = measured, "measured"
                else:
                    note(f"{name}: max batch not measured ({why}); the {result.max_batch_source} figure stands")
            if name == "baseline" and result.ok:
                baseline_run = run
            results.append(result)
    finally:
        if hasattr(device, "close"):
            device.close()
        if reprofile and hasattr(unlimited, "close"):
            del profiler
            unlimited.close()

    # 4. equality with the baseline (or the unlimited reference when it could not run)
    target = baseline_run or reference
    reference_label = (
        "baseline"
        if baseline_run is not None
        else f"reference run (keep all on an unlimited-capacity {settings.backend} device; the baseline did not fit)"
    )
    for result in results:
        run = runs.get(result.name)
        if run is None or not result.ok:
            continue
        identical, loss_delta, grad_diff = _compare_runs(run, target)
        result.bit_identical, result.loss_delta, result.grad_rel_diff = identical, loss_delta, grad_diff
        result.compared_with = "baseline" if baseline_run is not None else "reference run"
        if result.plan_dict and result.plan_dict.get("microbatches", 1) > 1 and not identical:
            result.equality_note = (
                "gradient accumulation sums micro-batch gradients: equal to the full batch only up to "
                "floating-point summation order" + (" (and dropout draws other masks)" if settings.dropout else "")
            )
    device_info = {
        "backend": settings.backend,
        "capacity_bytes": capacity,
        "d2h_bandwidth": profile.d2h_bandwidth,
        "h2d_bandwidth": profile.h2d_bandwidth,
        "latency_s": profile.latency_s,
        "duplex": profile.duplex,
    }
    return Comparison(
        workload={**settings.workload(), "torch_threads": threads},
        device=device_info,
        results=results,
        gates=gates,
        reference=reference_label,
        notes=notes,
        profile=measurement.to_dict(),
        plugin_traces={name: run.traces for name, run in runs.items() if run.traces},
    )


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
