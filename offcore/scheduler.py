"""Deadline-driven prefetch scheduling by next-use time (framework-neutral, no torch).

A host-to-device copy of ``V`` bytes over a link of bandwidth ``BW`` must start by
``t_prefetch = t_need − V/BW − margin`` to land before the object is needed at ``t_need``.
This module learns ``t_need`` for every saved object of a training step (keyed by the
order in which the step saved it) from the forward pass and from earlier steps, measures
``BW`` from copies that really happened, and turns both into a prefetch plan that a
binding (``offcore_torch``) consults each time backward touches a saved object.

    >>> from offcore.scheduler import BandwidthEstimator, Scheduler, StepObservation
    >>> link = BandwidthEstimator()
    >>> link.observe(1 << 20, 0.001)                     # 1 MiB took 1 ms
    >>> round(link.duration(4 << 20), 4)                 # 4 MiB: about 4 ms
    0.004
    >>> sched = Scheduler(margin=0.0)
    >>> first = StepObservation(pack_times={0: 0.0, 1: 0.01}, forward_seconds=0.01)
    >>> sched.predict(first)                             # no history: reverse order, backward = 2 x forward
    {0: 0.02, 1: 0.0}

# Note [Prefetch plan: serial link, latest start, horizon]
# Copies in one direction run in order on one copy stream, so a plan is a chain: sorted
# by ``t_need``, each copy must finish before its own deadline (minus the margin) *and*
# before the next copy in the chain has to start. Walking the chain from the last
# deadline back gives every copy's latest start (an as-late-as-possible schedule). A
# binding can only act when backward calls it (each unpack is a trigger), so at a
# trigger it starts every copy whose latest start falls before the *next* trigger's
# predicted time — waiting for that trigger would make it late. The byte budget is the
# binding's to enforce (it knows which prefetched bytes are still unconsumed); the plan
# only yields candidates in deadline order.
"""

from __future__ import annotations

import bisect
import math
import operator
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice

from offcore.errors import ConfigurationError
from offcore.units import parse_duration

__all__ = ["BandwidthEstimator", "StepObservation", "Scheduler", "PrefetchPlan"]


class BandwidthEstimator:
    """Online fit of ``copy seconds = latency + bytes / bandwidth`` from measured copies.

    Samples decay geometrically (``decay`` per sample) so the estimate follows a link
    whose speed changes (both directions at once on PCIe, another process). With fewer
    than two distinct sizes the latency is taken as zero and the bandwidth is the
    ratio of totals. ``bandwidth`` is ``None`` until something was measured.

        >>> est = BandwidthEstimator()
        >>> for size in (1 << 20, 4 << 20):
        ...     est.observe(size, 1e-5 + size / 1e9)
        >>> round(est.bandwidth / 1e9, 3), round(est.latency * 1e6, 1)
        (1.0, 10.0)
    """

    def __init__(self, *, decay: float = 0.95) -> None:
        if not 0.0 < decay <= 1.0:
            raise ConfigurationError(f"bandwidth estimator decay must be in (0, 1], got {decay!r}")
        self.decay = decay
        self.samples = 0
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> None:
        """Add one measured copy of ``nbytes`` that took ``seconds`` (non-positive times are ignored)."""
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        with self._lock:
            d = self.decay
            x, y = float(nbytes), float(seconds)
            self._n = self._n * d + 1.0
            self._sx = self._sx * d + x
            self._sy = self._sy * d + y
            self._sxx = self._sxx * d + x * x
            self._sxy = self._sxy * d + x * y
            self.samples += 1

    def _fit(self) -> tuple[float, float] | None:
        """(latency seconds, seconds per byte), or None without samples."""
        if self._n <= 0 or self._sx <= 0:
            return None
        n, sx, sy, sxx, sxy = self._n, self._sx, self._sy, self._sxx, self._sxy
        var = n * sxx - sx * sx
        if var > 1e-9 * n * sxx:  # at least two distinct sizes
            slope = (n * sxy - sx * sy) / var
            intercept = (sy - slope * sx) / n
            if slope > 0 and intercept >= 0:
                return intercept, slope
        return 0.0, sy / sx

    @property
    def bandwidth(self) -> float | None:
        """Estimated bytes per second, or None before the first measurement."""
        with self._lock:
            fit = self._fit()
        if fit is None:
            return None
        return math.inf if fit[1] <= 0 else 1.0 / fit[1]

    @property
    def latency(self) -> float:
        """Estimated fixed seconds per copy (0 before two distinct sizes were seen)."""
        with self._lock:
            fit = self._fit()
        return 0.0 if fit is None else fit[0]

    def duration(self, nbytes: int) -> float:
        """Predicted seconds for a copy of ``nbytes`` (``inf`` before any measurement: unknown link)."""
        with self._lock:
            fit = self._fit()
        if fit is None:
            return math.inf
        return fit[0] + nbytes * fit[1]


@dataclass
class StepObservation:
    """What one step (one graph) showed: when each object was saved and first used again.

    Keys are the order in which the step saved tensors (0, 1, 2, ...), so the same key
    names the same saved tensor in every step of a fixed model. ``pack_times`` are
    seconds since the forward pass started; ``first_use`` seconds since backward
    started (its first use of any saved object).
    """

    pack_times: dict[int, float] = field(default_factory=dict)
    forward_seconds: float = 0.0
    first_use: dict[int, float] = field(default_factory=dict)
    backward_seconds: float = 0.0


class PrefetchPlan:
    """Offloaded objects in deadline order with their latest start times (see the module Note).

    ``use_times`` maps every key of the step (offloaded or not: each use is a trigger)
    to its predicted use, in seconds after backward starts; ``offloaded`` maps the keys
    that need a copy to their bytes; ``readers`` (optional) maps an offloaded key to
    every key that reads the same object (a storage saved several times): the object
    is needed at the first of their uses. ``stage`` (optional, key → bytes) names the
    offloaded objects whose host copy is on NVMe: each gets a stage (NVMe → host) on its
    own serial link of ``stage_duration(nbytes)`` seconds, planned as late as possible to
    land by the trigger at which its host → device copy starts (``stage_latest``,
    ``due_stages``; Note [Two hops from NVMe] in offcore/residency.py). At each trigger the binding calls
    ``due(virtual_time(key, now))`` and starts the returned keys' copies in order,
    calling ``issued(key)`` for each; it stops early when its byte budget is full, and
    the remaining keys come again at the next trigger.

        >>> plan = PrefetchPlan({0: 0.0, 1: 0.002, 2: 0.010}, {1: 1000, 2: 1000}, lambda n: 0.003, margin=0.0)
        >>> plan.latest_start
        {2: 0.007, 1: -0.001}
        >>> plan.due(plan.virtual_time(0, 0.0))       # key 1 must start now, key 2 can wait
        [1]
    """

    def __init__(
        self,
        use_times: Mapping[int, float],
        offloaded: Mapping[int, int],
        duration: Callable[[int], float],
        *,
        margin: float,
        readers: Mapping[int, Iterable[int]] | None = None,
        stage: Mapping[int, int] | None = None,
        stage_duration: Callable[[int], float] | None = None,
    ) -> None:
        self.use_times: dict[int, float] = dict(use_times)
        self.nbytes: dict[int, int] = dict(offloaded)
        # built once per step for every offloaded object: the loops below keep to locals and
        # C-level key functions (no tuple or lambda per key)
        use_times, nbytes_of = self.use_times, self.nbytes
        # an object is needed at the first use of any key that reads it (a storage saved several times);
        # an object no reader names is needed at its own use (0.0 when it has none)
        if readers:
            need: dict[int, float] = {}
            for key in nbytes_of:
                keys = readers.get(key)
                if keys is None:
                    need[key] = use_times.get(key, 0.0)
                else:
                    uses = [use_times[k] for k in keys if k in use_times]
                    need[key] = min(uses) if uses else use_times.get(key, 0.0)
        else:
            need = {key: use_times.get(key, 0.0) for key in nbytes_of}
        self.need = need
        # deadline order, ties by key: a stable sort by need of the keys in key order
        self.order: list[int] = sorted(sorted(nbytes_of), key=need.__getitem__)
        self._position: dict[int, int] | None = None  # a key's place in ``order``, built by the first reopen()
        # predicted copy seconds per size, as the plan used them (a replay of the step reuses them): asked
        # once per size, in the order the chain below meets the sizes (the last deadline first)
        backwards = self.order[::-1]
        durations = {nbytes: duration(nbytes) for nbytes in dict.fromkeys(map(nbytes_of.__getitem__, backwards))}
        self.durations = durations
        latest: dict[int, float] = {}
        self.latest_start = latest
        chain_start = math.inf
        for key in backwards:
            # min() keeps its first argument on a tie or a NaN, as ``finish if not finish > chain_start``
            chain_start = latest[key] = min(need[key] - margin, chain_start) - durations[nbytes_of[key]]
        # Note [Latest starts in deadline order]
        # Each copy's latest start is at most the next one's less its own seconds, so with no negative or NaN
        # duration (and no NaN need) ``latest_start`` along ``order`` never decreases: the copies due before a
        # horizon are then a prefix of what is left, found by one bisect (``due``). The plan checks it (one
        # C-level pass) rather than assume it of the duration it was given, and scans otherwise.
        self._latest_seq: list[float] = list(map(latest.__getitem__, self.order))
        seq = self._latest_seq
        self._sorted_latest = all(map(operator.le, seq, islice(seq, 1, None)))
        self._triggers = sorted(self.use_times.values())
        self._cursor = 0
        self._done: set[int] = set()
        self._drift = 0.0
        # Note [Two hops from NVMe] (offcore/residency.py): the NVMe → host chain, on its own link
        self.margin = margin
        self.stage_duration: Callable[[int], float] | None = stage_duration
        self.stage_latest: dict[int, float] = {}
        self.stage_durations: dict[int, float] = {}
        self.stage_order: list[int] = []
        self._stage_done: set[int] = set()
        if stage:
            self._plan_stages(stage)

    def _stage_finish(self, key: int) -> float:
        """When ``key``'s stage must have landed: by the trigger that starts its host → device copy (the last
        one before that copy's latest start, see :meth:`due`; a binding may notice a landed read only at a
        trigger), less the margin. A copy due before the first trigger: by its latest start."""
        latest = self.latest_start[key]
        i = bisect.bisect_left(self._triggers, latest)
        at = self._triggers[i - 1] if i else latest
        return at - self.margin

    def _stage_seconds(self, nbytes: int) -> float:
        seconds = self.stage_durations.get(nbytes)
        if seconds is None:
            duration = self.stage_duration
            seconds = self.stage_durations[nbytes] = math.inf if duration is None else duration(nbytes)
        return seconds

    def _plan_stages(self, stage: Mapping[int, int]) -> None:
        """The NVMe → host chain: as late as possible, serial on its link, each landing by :meth:`_stage_finish`."""
        keys = [k for k in self.order if k in stage]  # deadline order, as the host → device chain
        finish_of = {k: self._stage_finish(k) for k in keys}
        order = sorted(keys, key=finish_of.__getitem__, reverse=True)
        chain_start = math.inf
        latest: dict[int, float] = {}
        for key in order:
            finish = min(finish_of[key], chain_start)
            chain_start = latest[key] = finish - self._stage_seconds(stage[key])
        self.stage_latest.update(latest)
        self.stage_order = sorted(self.stage_latest, key=self._stage_rank)

    def _stage_rank(self, key: int) -> tuple[float, float, int]:
        return self.stage_latest[key], self.need[key], key

    def add_stage(self, key: int) -> None:
        """``key`` went to NVMe after this plan was made: stage it in time for its copy (not chained with the
        other stages: an estimate, the link's queue is not replanned)."""
        if key not in self.nbytes or key in self.stage_latest:
            return
        self.stage_latest[key] = self._stage_finish(key) - self._stage_seconds(self.nbytes[key])
        bisect.insort(self.stage_order, key, key=self._stage_rank)
        self._stage_done.discard(key)

    def due_stages(self, vtime: float) -> list[int]:
        """Keys on NVMe (stage order) whose stage's latest start falls before the next trigger after ``vtime``."""
        horizon = self.horizon(vtime)
        out: list[int] = []
        for key in self.stage_order:
            if self.stage_latest[key] > horizon:
                break
            if key not in self._stage_done and key not in self._done:
                out.append(key)
        return out

    def stage_issued(self, key: int) -> None:
        """``key``'s stage started (or it needs none any more)."""
        if key in self.stage_latest:
            self._stage_done.add(key)

    def stage_reopen(self, key: int) -> None:
        """``key``'s stage failed or was not started: it is due again."""
        self._stage_done.discard(key)

    def __len__(self) -> int:
        """Keys still waiting for a copy."""
        return len(self.order) - len(self._done)

    def virtual_time(self, key: int | None, now: float) -> float:
        """Map ``now`` (seconds since backward started) onto the plan's clock.

        When ``key`` has a predicted use time the plan's clock jumps to it (the step
        runs early or late by the difference, the drift); otherwise the last drift is
        applied to ``now``.
        """
        predicted = self.use_times.get(key) if key is not None else None
        if predicted is not None:
            self._drift = now - predicted
            return predicted
        return now - self._drift

    def horizon(self, vtime: float) -> float:
        """Predicted time of the next trigger after ``vtime`` (``inf`` when none is expected)."""
        i = bisect.bisect_right(self._triggers, vtime)
        return self._triggers[i] if i < len(self._triggers) else math.inf

    def due(self, vtime: float) -> list[int]:
        """Keys (deadline order) whose latest start falls before the next trigger after ``vtime``."""
        # once per trigger: horizon() inlined, the cursor kept in a local
        triggers = self._triggers
        i = bisect.bisect_right(triggers, vtime)
        horizon = triggers[i] if i < len(triggers) else math.inf
        order, done = self.order, self._done
        cursor, end = self._cursor, len(order)
        while cursor < end and order[cursor] in done:
            cursor += 1
        self._cursor = cursor
        if self._sorted_latest:  # Note [Latest starts in deadline order]: the due keys are a prefix
            stop = bisect.bisect_right(self._latest_seq, horizon, cursor)
            if stop == cursor:  # the common trigger: nothing due
                return []
            if stop == cursor + 1:  # one due: the cursor's key (not done, see above)
                return [order[cursor]]
            return [key for key in order[cursor:stop] if key not in done]
        latest = self.latest_start
        out: list[int] = []
        for i in range(cursor, end):
            key = order[i]
            if key in done:
                continue
            if latest[key] > horizon:
                break
            out.append(key)
        return out

    def issued(self, key: int) -> None:
        """``key`` needs no more planning (its copy started, it was used, or it needs no copy)."""
        if key in self.nbytes:
            self._done.add(key)

    def reopen(self, key: int) -> None:
        """``key`` needs a copy again (its prefetched device copy was evicted before use)."""
        if key in self._done:
            self._done.discard(key)
            position = self._position
            if position is None:  # built on first use: most steps evict nothing
                position = self._position = {k: i for i, k in enumerate(self.order)}
            self._cursor = min(self._cursor, position[key])


class Scheduler:
    """Predicts when backward needs each saved object, learning from earlier steps.

    One scheduler is meant to live across steps (``offcore_torch`` keeps one per device
    unless given one). Before any backward was observed it predicts the reverse of the
    save order with backward taking ``backward_ratio`` × the forward time (the usual
    ≈2× of a training step); afterwards it uses the measured first-use times, smoothed
    over steps (``smoothing`` is the weight of the newest step).

        >>> s = Scheduler(margin="0.5ms")
        >>> s.observe(StepObservation({0: 0.0, 1: 0.004}, 0.005, {1: 0.0, 0: 0.006}, 0.008))
        >>> s.predict(StepObservation({0: 0.0, 1: 0.004}, 0.005))
        {0: 0.006, 1: 0.0}
    """

    def __init__(self, *, margin: float | str = "0.5ms", smoothing: float = 0.5, backward_ratio: float = 2.0) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ConfigurationError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not backward_ratio > 0:
            raise ConfigurationError(f"backward_ratio must be positive, got {backward_ratio!r}")
        self.margin = parse_duration(margin, what="prefetch margin")
        self.smoothing = smoothing
        self.backward_ratio = backward_ratio
        self.steps_observed = 0
        self._first_use: dict[int, float] = {}
        self._lock = threading.Lock()

    def predict(self, step: StepObservation) -> dict[int, float]:
        """Predicted first use (seconds after backward starts) of every key in ``step.pack_times``."""
        if not step.pack_times:
            return {}
        last_pack = max(step.pack_times.values())
        with self._lock:
            learned = dict(self._first_use)
            ratio = self.backward_ratio
        out: dict[int, float] = {}
        for key, packed_at in step.pack_times.items():
            t = learned.get(key)
            out[key] = t if t is not None else ratio * (last_pack - packed_at)
        return out

    def observe(self, step: StepObservation) -> None:
        """Learn from a finished step (steps whose backward never ran teach nothing)."""
        if not step.first_use:
            return
        with self._lock:
            a = self.smoothing
            for key, t in step.first_use.items():
                old = self._first_use.get(key)
                self._first_use[key] = t if old is None else (1 - a) * old + a * t
            if step.forward_seconds > 0 and step.backward_seconds > 0:
                measured = step.backward_seconds / step.forward_seconds
                self.backward_ratio = (1 - a) * self.backward_ratio + a * measured
            self.steps_observed += 1

    def plan(
        self,
        step: StepObservation,
        offloaded: Mapping[int, int],
        duration: Callable[[int], float],
        margin: float | None = None,
        readers: Mapping[int, Iterable[int]] | None = None,
        *,
        stage: Mapping[int, int] | None = None,
        stage_duration: Callable[[int], float] | None = None,
    ) -> PrefetchPlan:
        """A plan for the keys in ``offloaded`` (key → bytes); every key of ``step`` is a trigger.

        ``readers`` as in :class:`PrefetchPlan`; ``stage`` (key → bytes, a subset of ``offloaded``)
        the objects whose host copy is on NVMe, staged over ``stage_duration`` first
        (Note [Two hops from NVMe] in offcore/residency.py).
        """
        return PrefetchPlan(
            self.predict(step),
            offloaded,
            duration,
            margin=self.margin if margin is None else margin,
            readers=readers,
            stage=stage,
            stage_duration=stage_duration,
        )
