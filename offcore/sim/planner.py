"""The planner: keep / offload / recompute per layer under a device budget, fastest first.

Search space: one :class:`~offcore.sim.plan.Action` per layer, a checkpoint interval
``K``, a prefetch byte budget, and a micro-batch count for gradient accumulation.
Every candidate is scored by :func:`~offcore.sim.simulator.simulate` (predicted step
time and device peak); the planner returns the fastest plan whose peak fits the budget.

Two methods:

- ``"greedy"`` (any size): from several starts (all keep, all offload, all recompute,
  and periodic offload/recompute mixes such as ``OOR`` repeated),
  descend until the peak fits by repeatedly taking the move with the best
  Δtime / Δbytes (bytes = drop of the peak plus the drop of the bytes-above-budget
  integral over the step, so moves that shave the peak's shoulders count too; a move that
  fits outright at lower cost wins), then improve locally with single moves and, for
  small stacks, pairs of moves, until no move makes the step faster within the budget.
- ``"exhaustive"`` (n ≤ ``exact_max_layers``): every action vector, best-first by the
  analytic bound of :mod:`offcore.sim.bounds`, pruned when the bound cannot beat the
  best plan found; exact over the same space.

``"auto"`` uses exhaustive up to 8 layers and greedy above.

Note [Every named strategy is in the search space]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``offcore compare`` runs named strategies (keep all, offload all, recompute all, a
hybrid, keep all with accumulation) next to the planner's plan. Each of them is an action
vector with a ``K``, a prefetch policy and a micro-batch count, so it lies in this search
space; the exhaustive search finds the optimum over it, but the greedy one may not. Pass
them as ``candidates``: each is simulated in the same evaluator (same profile, same
micro-batch split, same overhead) and, when it fits, is an incumbent the search must beat
and a start of the local search. So the returned plan is never predicted slower than a
candidate that fits the same budget. ``microbatch_profiles`` gives, per micro-batch
count, the full-step profile to split (a runtime keeps earlier micro-batches' gradients
resident, and some resident bytes shrink with the micro-batch); the prediction returned
is ``simulate(that profile, plan, microbatch_overhead_s=...)`` — the very figure the
search minimised.

Note [Measured peaks]
~~~~~~~~~~~~~~~~~~~~~
The simulator's peaks come within about 10 % of the measured ones either way (issue 14;
an offloaded step's peak also depends on how long copies take while it runs), so near
the budget a plan that fits may be ruled out by the model, or one that does not may be
let in. When a plan has *run* on the device, its measured peak is better evidence
than the model: ``measured_peaks`` replaces the simulated peak of those plans (only
those: their neighbours are still judged by the model) in the fit test, and makes them
candidates. The other way round, a plan measured *above* its simulated peak shows the
model misses bytes (transients it does not see): the largest such shortfall is a margin
every plan not measured must keep below the budget. The time the search minimises is
unchanged (simulated).

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(4, forward_s=5e-3, backward_s=10e-3, saved_bytes=64 * 2**20,
    ...                     d2h_bandwidth="16GiB/s", h2d_bandwidth="16GiB/s")
    >>> result = plan(p, budget_bytes="160MiB")
    >>> result.predicted.peak_bytes <= 160 * 2**20, result.plan.strategy
    (True, 'offload')
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.sim.bounds import batch_lower_bounds, batch_memory_floor, instance_lower_bound
from offcore.sim.plan import Action, Plan, PrefetchPolicy
from offcore.sim.profile import StepProfile
from offcore.sim.simulator import SimResult, simulate
from offcore.units import format_bytes, parse_duration, parse_size

__all__ = [
    "plan",
    "exhaustive_plan",
    "size_prefetch_budget",
    "steady_prefetch",
    "STEADY_MARGIN_S",
    "PlanResult",
    "Plan",
    "Action",
    "PrefetchPolicy",
]

Method = Literal["auto", "greedy", "exhaustive"]
ALL_ACTIONS: tuple[Action, ...] = (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE)
_TIME_TOLERANCE = 1e-12


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer.

    Attributes:
        plan: the chosen plan.
        predicted: its simulated step (with the event timeline).
        budget_bytes: the device budget it was planned for.
        keep_all: the simulated keep-everything baseline (may exceed the budget).
        lower_bound_s: the instance's analytic lower bound under the budget, or ``None``
            when it was not computed (scipy missing or ``lower_bound=False``).
        method: ``"greedy"`` or ``"exhaustive"``.
        evaluated: how many distinct plans were simulated.
        alternatives: per micro-batch count searched, the fastest plan found that fits
            (``microbatches`` set) and its predicted step time; counts where nothing fits
            are absent. ``alternatives[1]`` is the best bit-identical plan (no accumulation).
        profile: the full-step profile ``predicted`` was simulated on (the one of the
            chosen micro-batch count).
    """

    plan: Plan
    predicted: SimResult
    budget_bytes: int
    keep_all: SimResult
    lower_bound_s: float | None
    method: str
    evaluated: int
    alternatives: Mapping[int, tuple[Plan, float]] = field(default_factory=dict)
    profile: StepProfile | None = None

    @property
    def accumulates(self) -> bool:
        """True when the plan splits the step into micro-batches (gradients summed: not bit-identical)."""
        return self.plan.microbatches > 1

    @property
    def gap_to_lower_bound(self) -> float | None:
        """Predicted step time / lower bound (≥ 1), or ``None`` without a bound."""
        if self.lower_bound_s is None or self.lower_bound_s <= 0:
            return None
        return self.predicted.step_time_s / self.lower_bound_s

    @property
    def slowdown_vs_keep_all(self) -> float:
        """Predicted step time / the keep-all step time (the keep-all step may not fit)."""
        return self.predicted.step_time_s / self.keep_all.step_time_s if self.keep_all.step_time_s else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: plan, prediction, baseline, bound."""
        return {
            "plan": self.plan.to_dict(),
            "predicted": self.predicted.summary(),
            "keep_all": self.keep_all.summary(),
            "budget_bytes": self.budget_bytes,
            "lower_bound_s": self.lower_bound_s,
            "gap_to_lower_bound": self.gap_to_lower_bound,
            "method": self.method,
            "evaluated": self.evaluated,
            "alternatives": {
                str(m): {"plan": p.describe(), "step_time_s": t} for m, (p, t) in sorted(self.alternatives.items())
            },
        }


@dataclass(frozen=True)
class _Score:
    time: float
    peak: int
    above: float  # byte-seconds above the budget
    plan: Plan


class _Evaluator:
    """Simulates plans of one micro-profile (cached), scaled to the full step."""

    def __init__(
        self,
        micro: StepProfile,
        microbatches: int,
        overhead_s: float,
        budget: int,
        measured_peaks: Mapping[Plan, int] | None = None,
        margin_bytes: int = 0,
    ) -> None:
        self.micro = micro
        self.microbatches = microbatches
        self.overhead_s = overhead_s
        self.budget = budget
        self.measured_peaks = dict(measured_peaks or {})
        self.margin_bytes = margin_bytes
        self.cache: dict[Plan, _Score] = {}
        self.lowest: _Score | None = None  # the lowest-peak plan simulated so far

    def __call__(self, plan: Plan) -> _Score:
        cached = self.cache.get(plan)
        if cached is not None:
            return cached
        result = simulate(self.micro, plan, record_events=False)
        m = self.microbatches
        measured = self.measured_peaks.get(plan)
        score = _Score(
            time=m * result.step_time_s + (m - 1) * self.overhead_s,
            # Note [Measured peaks]: a plan that ran within the budget fits, whatever the model predicts
            peak=result.peak_bytes + self.margin_bytes if measured is None else measured,
            above=m * result.bytes_time_above(self.budget - self.margin_bytes) if measured is None else 0.0,
            plan=plan,
        )
        self.cache[plan] = score
        if self.lowest is None or score.peak < self.lowest.peak:
            self.lowest = score
        return score


@dataclass(frozen=True)
class _Options:
    allowed: tuple[Action, ...]
    intervals: tuple[int, ...]
    prefetch: tuple[PrefetchPolicy, ...]
    pair_moves: bool


def _prefetch_candidates(
    micro: StepProfile,
    mode: str,
    margin_s: float,
    budgets: Iterable[int | str | None] | None,
) -> tuple[PrefetchPolicy, ...]:
    if mode == "on_demand":
        return (PrefetchPolicy("on_demand"),)
    if mode != "deadline":
        raise ConfigurationError(f"the planner schedules prefetch mode 'deadline' or 'on_demand', not {mode!r}")
    if budgets is None:
        largest = max(layer.saved_bytes for layer in micro.layers)
        budgets = [None] + ([largest * k for k in (1, 2, 4)] if largest > 0 else [])
    policies = []
    for value in budgets:
        policies.append(PrefetchPolicy("deadline", margin_s=margin_s, budget_bytes=value))
    return tuple(dict.fromkeys(policies))


def _neighbours(plan: Plan, options: _Options, *, downgrades_only: bool) -> list[Plan]:
    """Plans one move away: one layer's action, K, or the prefetch policy."""
    order = {Action.KEEP: 0, Action.OFFLOAD: 1, Action.RECOMPUTE: 2}
    found: list[Plan] = []
    actions = plan.actions
    for index, current in enumerate(actions):
        for action in options.allowed:
            if action is current or (downgrades_only and order[action] < order[current]):
                continue
            changed = list(actions)
            changed[index] = action
            found.append(replace(plan, actions=tuple(changed)))
    if any(a is Action.RECOMPUTE for a in actions):
        for interval in options.intervals:
            if interval != plan.checkpoint_interval:
                found.append(replace(plan, checkpoint_interval=interval))
    if any(a is Action.OFFLOAD for a in actions):
        for policy in options.prefetch:
            if policy != plan.prefetch:
                found.append(replace(plan, prefetch=policy))
    return found


def _pairs(plan: Plan, options: _Options) -> Iterable[Plan]:
    actions = plan.actions
    n = len(actions)
    for i in range(n):
        for j in range(i + 1, n):
            for a in options.allowed:
                if a is actions[i]:
                    continue
                for c in options.allowed:
                    if c is actions[j]:
                        continue
                    changed = list(actions)
                    changed[i], changed[j] = a, c
                    yield replace(plan, actions=tuple(changed))


def _descend(start: Plan, evaluate: _Evaluator, options: _Options, budget: int) -> _Score:
    """Reduce the peak until it fits, best Δtime per Δbytes first."""
    current = evaluate(start)
    while current.peak > budget:
        best_ratio: tuple[float, _Score] | None = None
        best_fit: _Score | None = None
        for candidate in _neighbours(current.plan, options, downgrades_only=True):
            score = evaluate(candidate)
            if score.peak > current.peak:
                continue  # a descent never raises the peak
            gain = (current.peak - score.peak) + (current.above - score.above) / max(current.time, 1e-30)
            if gain <= 0:
                continue
            cost = score.time - current.time
            ratio = cost / gain
            if best_ratio is None or ratio < best_ratio[0]:
                best_ratio = (ratio, score)
            if score.peak <= budget and (best_fit is None or score.time < best_fit.time):
                best_fit = score
        if best_ratio is None:
            return current  # stuck: no move lowers the memory
        chosen = best_ratio[1]
        if best_fit is not None and best_fit.time <= chosen.time:
            chosen = best_fit
        current = chosen
    return current


def _improve(current: _Score, evaluate: _Evaluator, options: _Options, budget: int) -> _Score:
    """Best-improvement local search over single (and optionally paired) moves, within the budget."""
    while True:
        best = current
        for candidate in _neighbours(current.plan, options, downgrades_only=False):
            score = evaluate(candidate)
            if score.peak <= budget and score.time < best.time * (1 - _TIME_TOLERANCE):
                best = score
        if best is current and options.pair_moves:
            for candidate in _pairs(current.plan, options):
                score = evaluate(candidate)
                if score.peak <= budget and score.time < best.time * (1 - _TIME_TOLERANCE):
                    best = score
        if best is current:
            return current
        current = best


def _greedy(evaluate: _Evaluator, n: int, options: _Options, budget: int) -> _Score | None:
    """Best feasible score over several starts (all keep, all offload, all recompute)."""
    base = Plan([options.allowed[0]] * n, checkpoint_interval=options.intervals[0], prefetch=options.prefetch[0])
    starts = [replace(base, actions=(action,) * n) for action in options.allowed]
    if Action.OFFLOAD in options.allowed and Action.RECOMPUTE in options.allowed:
        # periodic offload/recompute mixes: local optima of uniform stacks that single moves
        # from the uniform starts do not reach
        patterns = ["O" * k + "R" for k in range(1, 6)] + ["ORR", "OORR", "ORRR"]
        for pattern in patterns:
            period = [Action.OFFLOAD if c == "O" else Action.RECOMPUTE for c in pattern]
            actions = tuple(period[i % len(period)] for i in range(n))
            if len(set(actions)) > 1:
                starts.append(replace(base, actions=actions))
    best: _Score | None = None
    for start in starts:
        score = _descend(start, evaluate, options, budget)
        if score.peak > budget:
            continue
        score = _improve(score, evaluate, options, budget)
        if best is None or score.time < best.time * (1 - _TIME_TOLERANCE):
            best = score
    return best


def _exhaustive(
    evaluate: _Evaluator, micro: StepProfile, options: _Options, budget: int, incumbent: float
) -> _Score | None:
    """Exact search over all action vectors of the allowed actions (with every K and prefetch policy)."""
    n = micro.n_layers
    codes_of = {Action.KEEP: 0, Action.OFFLOAD: 1, Action.RECOMPUTE: 2}
    allowed_codes = [codes_of[a] for a in options.allowed]
    codes = np.array(list(itertools.product(allowed_codes, repeat=n)), dtype=np.int8).reshape(-1, n)
    floor = batch_memory_floor(micro, codes)
    feasible = floor <= budget
    if not feasible.any():
        return None
    codes = codes[feasible]
    m = evaluate.microbatches
    bounds = m * batch_lower_bounds(micro, codes, max_interval=max(options.intervals)) + (m - 1) * evaluate.overhead_s
    order = np.argsort(bounds, kind="stable")
    actions_of = (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE)
    best: _Score | None = None
    best_time = incumbent
    for index in order:
        if bounds[index] >= best_time * (1 - _TIME_TOLERANCE):
            break
        actions = tuple(actions_of[c] for c in codes[index])
        has_offload = Action.OFFLOAD in actions
        runs = _longest_recompute_run(actions)
        intervals = options.intervals if runs > 1 else options.intervals[:1]
        policies = options.prefetch if has_offload else options.prefetch[:1]
        for interval in intervals:
            for policy in policies:
                score = evaluate(Plan(actions, checkpoint_interval=interval, prefetch=policy))
                if score.peak <= budget and score.time < best_time * (1 - _TIME_TOLERANCE):
                    best, best_time = score, score.time
    return best


def _longest_recompute_run(actions: Sequence[Action]) -> int:
    longest = run = 0
    for action in actions:
        run = run + 1 if action is Action.RECOMPUTE else 0
        longest = max(longest, run)
    return longest


def _microbatch_candidates(profile: StepProfile, microbatches: Sequence[int] | Literal["auto"]) -> list[int]:
    if microbatches == "auto":
        return [m for m in (1, 2, 4, 8) if profile.batch_size % m == 0]
    values = list(microbatches)
    if not values:
        raise ConfigurationError("microbatches is empty: give at least 1")
    for m in values:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigurationError(f"microbatches must be positive integers, got {m!r}")
        if profile.batch_size % m:
            raise ConfigurationError(f"cannot split batch_size {profile.batch_size} into {m} micro-batches")
    return sorted(set(values))


def _run(
    profile: StepProfile,
    budget_bytes: int | str | None,
    *,
    method: Method,
    allowed_actions: Sequence[Action | str],
    checkpoint_intervals: Sequence[int],
    microbatches: Sequence[int] | Literal["auto"],
    microbatch_overhead_s: float | str,
    prefetch_mode: str,
    prefetch_margin_s: float | str,
    prefetch_budgets: Iterable[int | str | None] | None,
    pair_moves: bool | Literal["auto"],
    lower_bound: bool,
    lower_bound_time_limit_s: float,
    exact_max_layers: int,
    candidates: Sequence[Plan],
    microbatch_profiles: Mapping[int, StepProfile] | None,
    measured_peaks: Mapping[Plan, int] | None,
) -> PlanResult:
    if not isinstance(profile, StepProfile):
        raise ConfigurationError(f"plan() needs a StepProfile, got {type(profile).__name__}")
    if budget_bytes is None:
        if profile.capacity_bytes is None:
            raise ConfigurationError("give budget_bytes, or a profile with capacity_bytes, to plan under")
        budget_bytes = profile.capacity_bytes
    budget = parse_size(budget_bytes, what="budget_bytes")
    overhead = parse_duration(microbatch_overhead_s, what="microbatch_overhead_s")
    margin = parse_duration(prefetch_margin_s, what="prefetch_margin_s")
    allowed = tuple(dict.fromkeys(Action.parse(a) for a in allowed_actions))
    if not allowed:
        raise ConfigurationError("allowed_actions is empty: allow at least one of keep, offload, recompute")
    allowed = tuple(a for a in ALL_ACTIONS if a in allowed)
    intervals = tuple(sorted(set(checkpoint_intervals)))
    if not intervals or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in intervals):
        raise ConfigurationError(f"checkpoint_intervals must be positive integers, got {checkpoint_intervals!r}")
    if method not in ("auto", "greedy", "exhaustive"):
        raise ConfigurationError(f"method must be 'auto', 'greedy' or 'exhaustive', not {method!r}")
    n = profile.n_layers
    if method == "exhaustive" and n > exact_max_layers:
        raise ConfigurationError(
            f"exhaustive planning of {n} layers means 3^{n} plans; it is limited to {exact_max_layers} layers "
            "(raise exact_max_layers, or use method='greedy')"
        )
    candidates = tuple(candidates)
    for candidate in candidates:
        if not isinstance(candidate, Plan):
            raise ConfigurationError(f"candidates must be Plans, got {type(candidate).__name__}")
        candidate.check(profile)
    use_exhaustive = method == "exhaustive" or (method == "auto" and n <= min(8, exact_max_layers))
    pairs = (n <= 32) if pair_moves == "auto" else bool(pair_moves)

    measured: dict[int, dict[Plan, int]] = {}
    for known, peak in (measured_peaks or {}).items():
        if not isinstance(known, Plan) or isinstance(peak, bool) or not isinstance(peak, int) or peak < 0:
            raise ConfigurationError("measured_peaks maps Plans to peak bytes (non-negative integers)")
        known.check(profile)
        measured.setdefault(known.microbatches, {})[replace(known, microbatches=1, layer_names=None)] = peak
        candidates = (*candidates, known)
    by_count = _profiles_by_count(profile, microbatches, microbatch_profiles, candidates)
    # Note [Measured peaks]: the model's largest under-prediction among the measured plans is a
    # margin every plan not measured must keep below the budget
    margin_bytes = 0
    for m, known_peaks in measured.items():
        for known, peak in known_peaks.items():
            simulated = simulate(by_count[m], replace(known, microbatches=m), record_events=False).peak_bytes
            margin_bytes = max(margin_bytes, peak - simulated)
    seeds: dict[int, list[Plan]] = {}
    for candidate in candidates:
        # the evaluator of a micro-batch count caches plans without microbatches and names
        seeds.setdefault(candidate.microbatches, []).append(replace(candidate, microbatches=1, layer_names=None))

    best: _Score | None = None
    best_m = 1
    lowest: tuple[int, _Score] | None = None
    alternatives: dict[int, tuple[Plan, float]] = {}
    evaluated = 0
    for m, full in by_count.items():
        micro = full.split_microbatches(m)
        options = _Options(
            allowed=allowed,
            intervals=intervals,
            prefetch=_prefetch_candidates(micro, prefetch_mode, margin, prefetch_budgets),
            pair_moves=pairs,
        )
        evaluate = _Evaluator(micro, m, overhead, budget, measured.get(m), margin_bytes)
        found = _greedy(evaluate, n, options, budget)  # also the incumbent that prunes the exact search
        for seed in seeds.get(m, ()):  # Note [Every named strategy is in the search space]
            score = evaluate(seed)
            if score.peak > budget:
                continue
            score = _improve(score, evaluate, options, budget)
            if found is None or score.time < found.time * (1 - _TIME_TOLERANCE):
                found = score
        if use_exhaustive:
            incumbent = found.time * (1 + 1e-9) if found is not None else math.inf
            exact = _exhaustive(evaluate, micro, options, budget, incumbent)
            if exact is not None:
                found = exact
        evaluated += len(evaluate.cache)
        low = evaluate.lowest
        assert low is not None
        if lowest is None or low.peak < lowest[1].peak:
            lowest = (m, low)
        if found is not None:
            alternatives[m] = (replace(found.plan, microbatches=m, layer_names=profile.layer_names), found.time)
            if best is None or found.time < best.time * (1 - 1e-9):
                best, best_m = found, m

    keep_all_plan = Plan.keep_all(n)
    keep_all = simulate(profile, keep_all_plan)
    if best is None:
        assert lowest is not None
        m, low = lowest
        raise CapacityExceededError(
            f"no plan fits a device budget of {format_bytes(budget)} ({budget} bytes): the smallest peak the "
            f"planner found is {format_bytes(low.peak)} ({low.peak} bytes) with plan {low.plan.describe()} and "
            f"{m} micro-batch(es), of which {format_bytes(by_count[m].static_bytes)} are resident parameters, "
            "gradients and other state. Raise the budget to at least that, or shrink the step "
            "(smaller batch or sequence, more micro-batches, smaller layers)."
        )
    chosen = replace(best.plan, microbatches=best_m, layer_names=profile.layer_names)
    # the figure the search minimised: the same profile, split and overhead (evaluated by _Evaluator)
    predicted = simulate(by_count[best_m], chosen, microbatch_overhead_s=overhead)
    bound: float | None = None
    if lower_bound:
        try:
            bound = min(
                instance_lower_bound(
                    full,
                    budget,
                    checkpoint_intervals=intervals,
                    microbatches=[m],
                    microbatch_overhead_s=overhead,
                    allowed_actions=allowed,
                    time_limit_s=lower_bound_time_limit_s,
                )
                for m, full in by_count.items()
            )
        except ConfigurationError:
            bound = None  # scipy missing
        if bound is not None and not math.isfinite(bound):
            bound = None
    return PlanResult(
        plan=chosen,
        predicted=predicted,
        budget_bytes=budget,
        keep_all=keep_all,
        lower_bound_s=bound,
        method="exhaustive" if use_exhaustive else "greedy",
        evaluated=evaluated,
        alternatives=alternatives,
        profile=by_count[best_m],
    )


def _profiles_by_count(
    profile: StepProfile,
    microbatches: Sequence[int] | Literal["auto"],
    microbatch_profiles: Mapping[int, StepProfile] | None,
    candidates: Sequence[Plan],
) -> dict[int, StepProfile]:
    """The full-step profile to plan on for each micro-batch count searched (sorted by count)."""
    given = dict(microbatch_profiles or {})
    for m, full in given.items():
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigurationError(f"microbatch_profiles keys must be positive integers, got {m!r}")
        if not isinstance(full, StepProfile):
            raise ConfigurationError(f"microbatch_profiles[{m}] must be a StepProfile, got {type(full).__name__}")
        if full.n_layers != profile.n_layers or full.layer_names != profile.layer_names:
            raise ConfigurationError(f"microbatch_profiles[{m}] has other layers than the profile")
        if full.batch_size % m:
            raise ConfigurationError(f"microbatch_profiles[{m}]: cannot split batch_size {full.batch_size} into {m}")
    if microbatches == "auto" and given:
        counts = set(given)
    else:
        counts = set(_microbatch_candidates(profile, microbatches))
    counts.update(candidate.microbatches for candidate in candidates)
    return {m: given.get(m, profile) for m in sorted(counts)}


def plan(
    profile: StepProfile,
    budget_bytes: int | str | None = None,
    *,
    method: Method = "auto",
    allowed_actions: Sequence[Action | str] = ALL_ACTIONS,
    checkpoint_intervals: Sequence[int] = (1, 2, 4),
    microbatches: Sequence[int] | Literal["auto"] = "auto",
    microbatch_overhead_s: float | str = 0.0,
    prefetch_mode: str = "deadline",
    prefetch_margin_s: float | str = 0.0,
    prefetch_budgets: Iterable[int | str | None] | None = None,
    pair_moves: bool | Literal["auto"] = "auto",
    lower_bound: bool = True,
    lower_bound_time_limit_s: float = 10.0,
    exact_max_layers: int = 10,
    candidates: Sequence[Plan] = (),
    microbatch_profiles: Mapping[int, StepProfile] | None = None,
    measured_peaks: Mapping[Plan, int] | None = None,
) -> PlanResult:
    """Plan keep / offload / recompute per layer so the step fits ``budget_bytes`` and runs fastest.

    Args:
        profile: the step to plan (see :mod:`offcore.sim.profile`).
        budget_bytes: device budget (bytes or ``"40GiB"``); defaults to the profile's
            capacity.
        method: ``"greedy"``, ``"exhaustive"`` (exact, ``n ≤ exact_max_layers``) or
            ``"auto"`` (exhaustive up to 8 layers).
        allowed_actions: restrict the actions (e.g. ``("keep", "recompute")`` plans
            checkpointing only).
        checkpoint_intervals: the ``K`` values to try for recompute segments.
        microbatches: micro-batch counts for gradient accumulation (``"auto"``: the
            divisors of ``batch_size`` among 1, 2, 4, 8). The profile is split linearly
            (:meth:`StepProfile.split_microbatches`); ``microbatch_overhead_s`` charges
            each extra micro-step, so measure it before trusting accumulation's figures.
        prefetch_mode, prefetch_margin_s, prefetch_budgets: prefetch policy candidates
            (default: deadline prefetch, no margin, budgets of none and 1, 2, 4 × the
            largest layer).
        pair_moves: also try pairs of moves in the local search (``"auto"``: ≤ 32 layers).
        lower_bound: compute the instance's analytic lower bound (needs scipy), giving the
            MILP at most ``lower_bound_time_limit_s`` (then its proven bound is used).
        candidates: plans that must be in the search (with their own ``microbatches``,
            which are searched too): the result is never predicted slower than one of
            them that fits (Note [Every named strategy is in the search space]).
        microbatch_profiles: for some micro-batch counts, the full-step profile to split
            instead of ``profile`` (e.g. with the gradients of earlier micro-batches
            resident). With ``microbatches="auto"`` its keys are the counts searched.
        measured_peaks: device peaks measured for some plans (strategies that already
            ran); for those plans they replace the simulated peak in the fit test, and the
            plans are candidates, and the model's largest under-prediction among them is a
            margin the other plans keep below the budget (Note [Measured peaks]).
            ``predicted`` is still simulated.

    Raises:
        ConfigurationError: bad arguments (negative or zero budget, unknown action, ...).
        CapacityExceededError: no plan fits; the message gives the smallest peak found.

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(3, forward_s=1.0, backward_s=2.0, saved_bytes=100)
    >>> plan(p, 300).plan.actions == (Action.KEEP,) * 3
    True
    """
    return _run(
        profile,
        budget_bytes,
        method=method,
        allowed_actions=allowed_actions,
        checkpoint_intervals=checkpoint_intervals,
        microbatches=microbatches,
        microbatch_overhead_s=microbatch_overhead_s,
        prefetch_mode=prefetch_mode,
        prefetch_margin_s=prefetch_margin_s,
        prefetch_budgets=prefetch_budgets,
        pair_moves=pair_moves,
        lower_bound=lower_bound,
        lower_bound_time_limit_s=lower_bound_time_limit_s,
        exact_max_layers=exact_max_layers,
        candidates=candidates,
        microbatch_profiles=microbatch_profiles,
        measured_peaks=measured_peaks,
    )


def exhaustive_plan(profile: StepProfile, budget_bytes: int | str | None = None, **options: Any) -> PlanResult:
    """The exact optimum over the planner's search space (``plan(..., method="exhaustive")``).

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(3, forward_s=1.0, backward_s=2.0, saved_bytes=100)
    >>> exhaustive_plan(p, 200, allowed_actions=("keep", "recompute")).predicted.step_time_s
    10.0
    """
    options.setdefault("method", "exhaustive")
    return plan(profile, budget_bytes, **options)


# Note [A finite prefetch budget makes the peak hold]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An offloaded step's device peak is set in backward by how many reloads are outstanding
# (issued, not yet used) at once, and the deadline runtime issues reloads from its *own* online
# link estimate, which moves with load (Note [The worst peak within the prefetch budget] in
# simulator.py): with no budget (PlanExecutor then passes the capacity) a slow estimate brought
# in many reloads at once, a quiet run few; the measured peak moved 20-30 % run to run, and by
# one saved tensor at the turn (whether the first reload started at forward's end). The runtime
# enforces ``prefetch_budget`` (offcore/residency.py, Note [Budget semantics]) and ``margin``, so
# ``steady_prefetch`` gives a plan both: a margin of STEADY_MARGIN_S makes every reload due at
# the first trigger, so the runtime and the simulator alike keep the budget full from the end of
# forward on (whatever the link estimate), and the budget is the smallest on a ladder (the
# largest single saved tensor, then doubling) whose simulated step is no slower than an
# unbounded one's (``size_prefetch_budget``): on a fast link one tensor, a slow link gets the
# lead its copies need. The peak then holds in every run: the simulated one, which equals
# SimResult.worst_peak_bytes. ``offcore compare`` gives its offloaded strategies this policy.

STEADY_MARGIN_S = 3600.0
"""A prefetch margin longer than any step: every reload is due at once, the budget alone holds them back."""


def steady_prefetch(
    profile: StepProfile, step_plan: Plan, *, microbatch_overhead_s: float = 0.0, peak_limit: int | None = None
) -> PrefetchPolicy:
    """The prefetch policy whose reloads keep a sized budget full (Note [A finite prefetch budget makes the peak hold]).

    ``step_plan``'s policy with ``margin_s=STEADY_MARGIN_S`` and the budget :func:`size_prefetch_budget`
    picks under it (its own budget when it has one; ``peak_limit`` as there); unchanged for on-demand prefetch or a plan
    that offloads nothing.

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(4, forward_s=1e-3, backward_s=2e-3, saved_bytes=1 << 20,
    ...                     d2h_bandwidth="16GiB/s", h2d_bandwidth="16GiB/s")
    >>> steady_prefetch(p, Plan.uniform(4, "offload")).budget_bytes
    1048576
    """
    policy = step_plan.prefetch
    if policy.mode == "on_demand" or Action.OFFLOAD not in step_plan.actions:
        return policy
    early = replace(step_plan, prefetch=replace(policy, mode="deadline", margin_s=STEADY_MARGIN_S, lead_s=None))
    budget = policy.budget_bytes
    if budget is None:
        budget = size_prefetch_budget(
            profile, early, microbatch_overhead_s=microbatch_overhead_s, peak_limit=peak_limit
        )
    return replace(early.prefetch, budget_bytes=budget)


def size_prefetch_budget(
    profile: StepProfile,
    step_plan: Plan,
    *,
    tolerance: float = 0.01,
    microbatch_overhead_s: float = 0.0,
    peak_limit: int | None = None,
) -> int | None:
    """The smallest reload budget that costs ``step_plan`` no step time (Note [A finite prefetch budget makes the peak hold]).

    The plan's own policy (mode, margin) is kept. Returns ``None`` when the plan offloads nothing or prefetches on demand (no budget applies).
    Candidates: the largest saved tensor of an offloaded layer, doubled until it covers every
    offloaded byte; the first whose simulated step time is within ``tolerance`` (a fraction)
    of the step with no budget is returned (the last candidate covers every reload, so one
    always qualifies). With ``peak_limit`` (device bytes), a budget whose simulated peak exceeds
    it is not taken while a smaller one stays within it: memory first, then time (the largest
    candidate within the limit, or the smallest candidate when none is).

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(4, forward_s=1e-3, backward_s=2e-3, saved_bytes=1 << 20,
    ...                     d2h_bandwidth="16GiB/s", h2d_bandwidth="16GiB/s")
    >>> size_prefetch_budget(p, Plan.uniform(4, "offload"))
    1048576
    """
    if not isinstance(step_plan, Plan):
        raise ConfigurationError(f"size_prefetch_budget needs a Plan, got {type(step_plan).__name__}")
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ConfigurationError(f"tolerance must be a non-negative fraction, got {tolerance!r}")
    if step_plan.prefetch.mode == "on_demand" or Action.OFFLOAD not in step_plan.actions:
        return None
    micro = profile.split_microbatches(step_plan.microbatches) if step_plan.microbatches > 1 else profile
    offloaded = [
        layer for layer, action in zip(micro.layers, step_plan.actions, strict=True) if action is Action.OFFLOAD
    ]
    sizes = [nbytes for layer in offloaded for _, nbytes in layer.saved_tensors] or [
        layer.saved_bytes for layer in offloaded
    ]
    total = sum(sizes)
    if total <= 0:
        return None

    def run(budget: int | None) -> SimResult:
        policy = replace(step_plan.prefetch, budget_bytes=budget)
        candidate = replace(step_plan, prefetch=policy)
        return simulate(profile, candidate, microbatch_overhead_s=microbatch_overhead_s, record_events=False)

    limit = run(None).step_time_s * (1.0 + tolerance)
    ladder = [max(sizes)]
    while ladder[-1] < total:
        ladder.append(min(total, ladder[-1] * 2))
    fitting: int | None = None
    for budget in ladder:
        result = run(budget)
        if peak_limit is not None and max(result.peak_bytes, result.worst_peak_bytes) > peak_limit:
            return fitting if fitting is not None else budget
        fitting = budget
        if result.step_time_s <= limit:
            return budget
    return ladder[-1]
