"""Each strategy's plan on the planning profile (the planner chooses per kind), and its predicted step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from offcore.comparison import Gates, StrategyResult
from offcore.errors import CapacityExceededError
from offcore.sim import Action, Plan, StepProfile, plan, simulate, steady_prefetch
from offcore.sim.planner import STEADY_MARGIN_S
from offcore.units import format_bytes
from offcore_torch.compare.measurement import StepMeasurement
from offcore_torch.compare.settings import CompareSettings

# ----------------------------------------------------------------------------- plans


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
