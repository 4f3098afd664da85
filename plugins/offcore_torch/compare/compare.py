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
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from offcore.comparison import STRATEGIES, Comparison, Gates, StrategyResult
from offcore.errors import CapacityExceededError
from offcore.sim import Plan
from offcore.units import format_bandwidth, format_bytes
from offcore_torch.compare.executor import PlanExecutor
from offcore_torch.compare.link import measure_link
from offcore_torch.compare.max_batch import _extrapolated_batch, _max_batch, _measure_max_batch, two_point_batch
from offcore_torch.compare.measurement import StepMeasurement
from offcore_torch.compare.profiler import measure_step
from offcore_torch.compare.runs import (
    _accumulation_loss_delta,
    _compare_runs,
    _fill,
    _optimizer_for,
    _release_optimizer,
    _Run,
    _train,
)
from offcore_torch.compare.settings import (
    _KIND_ROUNDS,
    _OVERHEAD_PAIRS,
    DTYPES,
    GPU_REFERENCE,
    CompareSettings,
    Progress,
    _make_device,
    build_workload,
    pcie_like_bandwidths,
)
from offcore_torch.compare.strategies import (
    StrategyPlan,
    _replan_with_measured_peaks,
    bounded_offload_plan,
    plan_strategies,
    predicted_step_series,
    strategy_plans,
)
from offcore_torch.layers import find_layers
from offcore_torch.models import Workload

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


# ----------------------------------------------------------------------------- main


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
