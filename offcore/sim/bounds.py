"""Analytic lower bounds on the step time, for one plan and for a whole instance.

# Note [The analytic lower bound]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# No schedule of a plan can beat any of these (``f, b, r`` forward, backward and
# recompute times; ``d_j, h_j`` the D2H and H2D copy times of offloaded layer ``j``,
# latency included; ``F(i)`` the end of layer ``i``'s forward; ``tail(i)`` the backward
# work from layer ``i``'s backward to the end of the step, i.e. ``Σ_{l≤i} b_l`` plus the
# recompute of every segment whose backward starts at or after ``i``):
#
#   1. compute:  T ≥ Σ f + Σ b + Σ_recomputed r     (the compute stream is serial)
#   2. copies, with the prefix constraints of forward and backward: every copy queue is a
#      single machine whose jobs have a release time ("head": a D2H cannot start before
#      its layer's first save, ``release(j)`` — the end of its forward without
#      ``LayerProfile.saved_tensors`` —, an H2D not before its D2H ends) and a "tail" (after a
#      D2H ends, that layer's H2D and all backward from that layer on must still run; after
#      an H2D, all backward from that layer on — from the layer before when the layer's saves
#      are used through its backward). For any set S of jobs on one machine
#          T ≥ min_S head + Σ_S duration + min_S tail,
#      evaluated for the offloaded layers from each one to the end of the stack. One shared
#      link is one machine for both directions; a duplex link is one per direction (a
#      reload may run while a later D2H is in flight: the scheduler skips copies in flight).
#      With no compute at all on a shared link this is the bytes there and back over their
#      bandwidth, e.g. 10 × 256 MiB over 32 GiB/s: 156.25 ms.
#      With ``StepProfile.reuse_in_flight`` any offloaded layer may skip its reload (Note
#      [Reuse of device copies still in flight] in simulator.py), so only the D2H queue
#      is bounded: T ≥ F(i) + Σ_{j≥i} d_j (the step ends when its last copy landed), and no
#      reload is counted as an exposed wait in the MILP.
#
# For an *instance* (any plan that fits a device budget) the planner needs a bound that
# holds for every feasible plan. :func:`instance_lower_bound` minimises T over the
# per-layer choices under (1), a relaxed (2) (``min head`` and ``min tail`` taken at a
# layer that need not be offloaded itself), and memory conditions every plan must meet
# (over the bytes resident all step, ``StepProfile.resident_bytes``; a layer's "own"
# bytes are its largest saved tensor, what is on the device whatever its saves' lifetimes):
#   - at the end of layer i's forward: the kept activations and checkpoints so far, the
#     offloaded layers whose D2H cannot have finished yet (the D2H queue can only have
#     drained Σ d_l ≤ F(i) − release(j) of the layers from any j on), its own bytes and
#     working set;
#   - at the turn: the head's bytes and every kept activation;
#   - during layer i's backward: the kept activations and checkpoints of earlier layers,
#     its own bytes and working set, and the reload of layer i−1 if that reload
#     overlaps it; a reload that overlaps nothing is an exposed wait of h_{i−1} in (1).
# That is a small MILP (scipy.optimize.milp). Prefetches further ahead and recompute
# segments longer than one layer are not counted, so the bound can be optimistic when the
# budget is tight: the planner's reported gap to it is an upper bound on its true gap.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from offcore.errors import ConfigurationError
from offcore.sim.plan import Action, Plan
from offcore.sim.profile import StepProfile
from offcore.units import parse_size

__all__ = ["plan_lower_bound", "instance_lower_bound", "batch_lower_bounds", "batch_memory_floor"]


def _tails(profile: StepProfile, plan: Plan) -> list[float]:
    """tail(i): backward work from layer i's backward (inclusive) to the end of the step."""
    n = profile.n_layers
    extra = [0.0] * n  # recompute that runs right before layer z's backward
    for first, last in plan.segments():
        extra[last] = math.fsum(profile.layers[k].recompute_time for k in range(first, last + 1))
    tails: list[float] = []
    total = 0.0
    for i in range(n):
        total += profile.layers[i].backward_s + extra[i]
        tails.append(total - _own_backward(profile, i))
    return tails


def _own_backward(profile: StepProfile, i: int) -> float:
    """The part of layer i's backward that may run before one of its saves is used.

    A layer saving tensors one by one (``saved_tensors``) uses them through its backward,
    so a reload of one of them may still overlap that backward: its own backward is then
    left out of the tail after the copy.
    """
    layer = profile.layers[i]
    return layer.backward_s if len({f for f, _ in layer.saved_tensors}) > 1 else 0.0


def _single_step_bound(profile: StepProfile, plan: Plan) -> float:
    layers = profile.layers
    recompute = math.fsum(layers[i].recompute_time for i, a in enumerate(plan.actions) if a is Action.RECOMPUTE)
    compute = profile.forward_s + profile.backward_s + recompute
    offloaded = [i for i, a in enumerate(plan.actions) if a is Action.OFFLOAD]
    if not offloaded:
        return compute
    tail = _tails(profile, plan)
    release = _releases(profile)
    d = [profile.transfer_s(layers[j].saved_bytes, "d2h") for j in offloaded]
    h = [profile.transfer_s(layers[j].saved_bytes, "h2d") for j in offloaded]
    if profile.reuse_in_flight:  # a reload may be skipped: bound the D2H queue alone
        h = [0.0] * len(h)
        tail = [0.0] * len(tail)
    best = compute
    count = len(offloaded)
    for lo in range(count):
        first = offloaded[lo]
        if profile.duplex:  # one machine per direction
            total = max(math.fsum(d[lo:]), math.fsum(h[lo:]))
        else:
            total = math.fsum(d[lo:]) + math.fsum(h[lo:])
        best = max(best, release[first] + total + tail[first])
    return best


def _releases(profile: StepProfile) -> list[float]:
    """release(j): when layer j's first save can be copied out (no detail: the end of its forward)."""
    out: list[float] = []
    clock = 0.0
    for layer in profile.layers:
        first = layer.saved_tensors[0][0] if layer.saved_tensors else 1.0
        out.append(clock + first * layer.forward_s)
        clock += layer.forward_s
    return out


def _own_bytes(profile: StepProfile) -> list[int]:
    """A layer's largest saved tensor: on the device at some moment of its forward and of its backward."""
    return [max((n for _, n in layer.saved_tensors), default=layer.saved_bytes) for layer in profile.layers]


def plan_lower_bound(profile: StepProfile, plan: Plan, *, microbatch_overhead_s: float = 0.0) -> float:
    """A lower bound on the step time of ``plan`` (Note [The analytic lower bound]).

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(10, forward_s=0.0, backward_s=0.0, saved_bytes=256 * 2**20,
    ...                     d2h_bandwidth="32GiB/s", h2d_bandwidth="32GiB/s", duplex=False)
    >>> plan_lower_bound(p, Plan.uniform(10, "offload"))           # 5 GiB over 32 GiB/s
    0.15625
    """
    plan.check(profile)
    m = plan.microbatches
    single = _single_step_bound(profile.split_microbatches(m), plan)
    return m * single + (m - 1) * microbatch_overhead_s


# --- vectorised forms for exhaustive search ------------------------------------------------

_CODES = {Action.KEEP: 0, Action.OFFLOAD: 1, Action.RECOMPUTE: 2}


def batch_lower_bounds(profile: StepProfile, codes: np.ndarray, *, max_interval: int = 1) -> np.ndarray:
    """Relaxed lower bounds for many action vectors at once (rows of ``codes``; 0 keep, 1 offload, 2 recompute).

    Valid for every checkpoint interval up to ``max_interval`` and every prefetch policy;
    never larger than :func:`plan_lower_bound` of the same vector.
    """
    layers = profile.layers
    f = np.array([layer.forward_s for layer in layers])
    b = np.array([layer.backward_s for layer in layers])
    r = np.array([layer.recompute_time for layer in layers])
    d = np.array([profile.transfer_s(layer.saved_bytes, "d2h") for layer in layers])
    h = np.array([profile.transfer_s(layer.saved_bytes, "h2d") for layer in layers])
    recomputed = (codes == 2) * r
    compute = f.sum() + b.sum() + recomputed.sum(axis=1)
    release = np.array(_releases(profile))
    own_backward = np.array([_own_backward(profile, i) for i in range(len(layers))])
    tail = np.cumsum(b) - own_backward + _shifted_cumsum(recomputed, max_interval - 1)
    if profile.reuse_in_flight:  # a reload may be skipped: bound the D2H queue alone
        h = np.zeros_like(h)
        tail = np.zeros_like(tail)
    offloaded = codes == 1

    def suffix(values: np.ndarray) -> np.ndarray:
        return np.cumsum((offloaded * values)[:, ::-1], axis=1)[:, ::-1]

    copies = np.maximum(suffix(d), suffix(h)) if profile.duplex else suffix(d + h)
    link = (release + copies + tail).max(axis=1)
    return np.maximum(compute, link)


def _shifted_cumsum(values: np.ndarray, shift: int) -> np.ndarray:
    """out[:, i] = sum(values[:, : i - shift + 1]) (0 where i < shift)."""
    cumulative = np.cumsum(values, axis=1)
    if shift <= 0:
        return cumulative
    out = np.zeros_like(cumulative)
    out[:, shift:] = cumulative[:, :-shift]
    return out


def batch_memory_floor(profile: StepProfile, codes: np.ndarray) -> np.ndarray:
    """A lower bound on the device peak of each action vector (rows of ``codes``).

    The larger of, over layers i: during i's forward, the resident bytes + kept activations
    of earlier layers + i's own (its largest saved tensor, unless recomputed) + its working
    set; at the start of i's backward, resident + kept earlier + i's own + working; at the
    turn, resident + the head's bytes + every kept activation.
    """
    layers = profile.layers
    s = np.array([layer.saved_bytes for layer in layers], dtype=np.int64)
    own = np.array(_own_bytes(profile), dtype=np.int64)
    w = np.array([layer.working_bytes for layer in layers], dtype=np.int64)
    fw = np.array([layer.forward_work for layer in layers], dtype=np.int64)
    gw = np.array([layer.offloaded_backward_work for layer in layers], dtype=np.int64)
    kept = (codes == 0) * s
    before = np.cumsum(kept, axis=1) - kept
    during_forward = before + (codes != 2) * own + fw
    at_backward = before + own + np.where(codes == 1, gw, w)
    at_turn = profile.head_bytes + kept.sum(axis=1)
    return profile.resident_bytes + np.maximum(np.maximum(during_forward, at_backward).max(axis=1), at_turn)


# --- instance bound (MILP) -------------------------------------------------------------------


@contextlib.contextmanager
def _solver_output_silenced() -> Iterator[None]:
    """Some HiGHS builds print debug lines on the C-level stdout even with ``disp=False``."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real stdout (e.g. captured): nothing to hide
        yield
        return
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(saved, 1)
    finally:
        os.close(saved)


def instance_lower_bound(
    profile: StepProfile,
    budget_bytes: int | str,
    *,
    checkpoint_intervals: Sequence[int] = (1,),
    microbatches: Sequence[int] = (1,),
    microbatch_overhead_s: float = 0.0,
    allowed_actions: Sequence[Action | str] = (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE),
    time_limit_s: float = 20.0,
) -> float:
    """A lower bound on the step time of *every* plan that fits ``budget_bytes``.

    Solves the MILP of Note [The analytic lower bound] with ``scipy.optimize.milp`` for
    each micro-batch count and returns the smallest; ``math.inf`` when no plan can fit.
    When the solver hits ``time_limit_s`` (large stacks) the best proven dual bound is
    returned, which is still a valid, if weaker, lower bound.

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(4, forward_s=1.0, backward_s=2.0, saved_bytes=100)
    >>> round(instance_lower_bound(p, 400), 9)                      # everything fits: the compute
    12.0
    >>> round(instance_lower_bound(p, 250, allowed_actions=("keep", "recompute")), 9)   # two recomputes
    14.0
    """
    budget = parse_size(budget_bytes, what="budget_bytes")
    allowed = {Action.parse(a) for a in allowed_actions}
    if not allowed:
        raise ConfigurationError("allowed_actions is empty: allow at least one of keep, offload, recompute")
    kmax = max(checkpoint_intervals) if checkpoint_intervals else 1
    best = math.inf
    for m in microbatches:
        if profile.batch_size % m:
            continue
        micro = profile.split_microbatches(m)
        single = _milp_bound(micro, budget, kmax, allowed, time_limit_s)
        if math.isfinite(single):
            best = min(best, m * single + (m - 1) * microbatch_overhead_s)
    return best


def _milp_bound(profile: StepProfile, budget: int, kmax: int, allowed: set[Action], time_limit_s: float) -> float:
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError:  # pragma: no cover - scipy is in the 'plan' extra
        raise ConfigurationError(
            "instance_lower_bound needs scipy: install it with pip install 'offcore[plan]'"
        ) from None
    layers = profile.layers
    n = len(layers)
    f = np.array([layer.forward_s for layer in layers])
    b = np.array([layer.backward_s for layer in layers])
    r = np.array([layer.recompute_time for layer in layers])
    s = np.array([layer.saved_bytes for layer in layers], dtype=float)
    own = np.array(_own_bytes(profile), dtype=float)
    release = np.array(_releases(profile))
    w = np.array([layer.offloaded_backward_work for layer in layers], dtype=float)  # in backward, any action
    fw = np.array([layer.forward_work for layer in layers], dtype=float)
    x = np.array([layer.input_bytes for layer in layers], dtype=float)
    d = np.array([profile.transfer_s(layer.saved_bytes, "d2h") for layer in layers])
    h = np.array([profile.transfer_s(layer.saved_bytes, "h2d") for layer in layers])
    reuse = profile.reuse_in_flight  # a reload may be skipped: no exposed reload, D2H queue alone
    if reuse:
        h = np.zeros_like(h)
    static = float(profile.resident_bytes)
    if np.any(static + own + w > budget):  # a layer's own backward needs its own bytes and working set
        return math.inf
    time_scale = max(float(f.sum() + b.sum()), 1e-30)
    forward_end = np.cumsum(f)

    # Variables: keep, off, rec (binary, one set per layer); start_l (segment starts, continuous,
    # forced to 1 by rec_l − rec_{l−1}); freed[i, l] for l < i (continuous in [0, off_l]: the
    # share of layer l's bytes whose D2H has completed by the end of layer i's forward);
    # overlap_l (binary: layer l's reload overlaps the backward of layer l+1, else it is exposed); T.
    keep, off, rec, start, overlap = 0, n, 2 * n, 3 * n, 4 * n
    freed_index: dict[tuple[int, int], int] = {}
    column = 5 * n
    for i in range(n):
        for j in range(i):
            freed_index[(i, j)] = column
            column += 1
    T = column
    nv = column + 1
    entries: list[tuple[int, int, float]] = []
    lower: list[float] = []
    upper: list[float] = []

    def add(row: dict[int, float], lo: float, hi: float) -> None:
        index = len(lower)
        entries.extend((index, col, value) for col, value in row.items() if value != 0.0)
        lower.append(lo)
        upper.append(hi)

    for i in range(n):  # one action per layer
        add({keep + i: 1.0, off + i: 1.0, rec + i: 1.0}, 1.0, 1.0)
    # segment starts: start_l >= rec_l - rec_{l-1}; every kmax recomputed layers in a row contain one
    for i in range(n):
        row = {start + i: 1.0, rec + i: -1.0}
        if i > 0:
            row[rec + i - 1] = 1.0
        add(row, 0.0, math.inf)
        add({start + i: 1.0, rec + i: -1.0}, -math.inf, 0.0)
        if i >= kmax - 1:
            window = range(i - kmax + 1, i + 1)
            row = {start + j: 1.0 for j in window}
            for j in window:
                row[rec + j] = row.get(rec + j, 0.0) - 1.0
            add(row, 1.0 - kmax, math.inf)
    # (1) compute, plus the reloads that cannot overlap the backward before them (exposed waits)
    row = {T: 1.0}
    for i in range(n):
        row[rec + i] = -r[i] / time_scale
        row[off + i] = -h[i] / time_scale
        row[overlap + i] = h[i] / time_scale
        add({overlap + i: 1.0, off + i: -1.0}, -math.inf, 0.0)
    add(row, float(f.sum() + b.sum()) / time_scale, math.inf)
    # (2) copies: one queue on a shared link, one per direction on a duplex one; prefix constraints
    backward_prefix = np.cumsum(b) - np.array([_own_backward(profile, i) for i in range(n)])
    queues = [d, h] if profile.duplex else [d + h]
    for i in range(n):
        for seconds in queues:
            row = {T: 1.0}
            for j in range(i, n):
                row[off + j] = -seconds[j] / time_scale
            for j in range(0, i - kmax + 2):
                row[rec + j] = -r[j] / time_scale
            add(row, float(release[i] + (0.0 if reuse else backward_prefix[i])) / time_scale, math.inf)
    # (3) memory at the end of each forward: kept, checkpoints, offloaded but not yet copied out
    for i in range(n):
        row: dict[int, float] = {}
        for j in range(i):
            row[keep + j] = s[j] / budget
            row[off + j] = s[j] / budget
            row[freed_index[(i, j)]] = -s[j] / budget
            row[start + j] = x[j] / budget
        row[keep + i] = own[i] / budget
        row[off + i] = own[i] / budget
        row[start + i] = x[i] / budget
        add(row, -math.inf, (budget - static - fw[i]) / budget)
        for j in range(i):  # freed share <= offloaded
            add({freed_index[(i, j)]: 1.0, off + j: -1.0}, -math.inf, 0.0)
        for first in range(i):  # D2H jobs released at or after release(first) end by F(i)
            row = {freed_index[(i, j)]: d[j] / time_scale for j in range(first, i)}
            add(row, -math.inf, float(forward_end[i] - release[first]) / time_scale)
    # (3b) at the turn: the head's bytes and every kept activation
    add({keep + j: s[j] / budget for j in range(n)}, -math.inf, (budget - static - profile.head_bytes) / budget)
    # (4) memory during each backward: kept earlier layers, checkpoints, its own saved bytes, and
    #     the next layer's reload when that overlaps it
    for i in range(n):
        row = {}
        for j in range(i):
            row[keep + j] = s[j] / budget
            row[start + j] = x[j] / budget
        row[start + i] = x[i] / budget
        if i > 0:
            row[overlap + i - 1] = own[i - 1] / budget
        add(row, -math.inf, (budget - static - own[i] - w[i]) / budget)

    upper_bounds = np.ones(nv)
    upper_bounds[T] = np.inf
    upper_bounds[overlap + n - 1] = 0.0  # the last layer's reload waits for its own D2H: see (2)
    for action, first_column in ((Action.KEEP, keep), (Action.OFFLOAD, off), (Action.RECOMPUTE, rec)):
        if action not in allowed:
            upper_bounds[first_column : first_column + n] = 0.0
    integrality = np.zeros(nv)
    integrality[: 3 * n] = 1
    integrality[overlap : overlap + n] = 1
    cost = np.zeros(nv)
    cost[T] = 1.0
    rows_, cols_, values_ = zip(*entries, strict=True)
    matrix = csr_array((values_, (rows_, cols_)), shape=(len(lower), nv))
    with _solver_output_silenced():
        result = milp(
            cost,
            constraints=LinearConstraint(matrix, np.array(lower), np.array(upper)),
            integrality=integrality,
            bounds=Bounds(np.zeros(nv), upper_bounds),
            options={"time_limit": time_limit_s, "disp": False},
        )
    if result.status == 2:  # infeasible: no plan fits
        return math.inf
    compute_only = 1.0  # T ≥ Σ f + Σ b, always
    candidates = [compute_only]
    dual = getattr(result, "mip_dual_bound", None)
    if result.status == 0 and result.fun is not None:
        value = float(result.fun)
        if dual is not None and math.isfinite(dual):
            value = min(value, float(dual))
        candidates.append(value)
    elif dual is not None and math.isfinite(dual):  # stopped early: the proven bound still holds
        candidates.append(float(dual))
    return max(candidates) * time_scale
