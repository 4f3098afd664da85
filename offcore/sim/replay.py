"""Replay a recorded step through the residency scheduler on a simulated clock.

A binding that ran with ``record=True`` (``offcore_torch.offload_activations(...,
record=True)``) keeps every event it fed its :class:`~offcore.residency.ResidencyScheduler`
with the binding's times, every reading of the device's memory the scheduler took, and
what each plan rested on (the predicted use times and the link's predicted copy times).
:func:`replay` feeds the same events, at the same times, to a *new* scheduler of the same
class with simulated events (every copy's event reports landed when the log says so) and
returns the actions it decided. That they equal the recorded actions — the same copies,
in the same order, at the same trigger points, with the same evictions — is what makes
a simulation with this class a prediction of what the runtime does
(tests/torch/test_schedule_replay.py checks it on a real step of the fake device).

A step with objects on the NVMe tier (Note [Two hops from NVMe] in offcore/residency.py)
replays too: ``staged`` is a trigger whose offer the following ``next`` events take (as
``used``'s and ``forward_ended``'s), and a plan that had stages recorded a third
``plan_inputs`` item, the stage durations it rested on, which the replayed plan uses for its
NVMe link (tests/core/test_sim_replay_nvme.py).

    >>> from offcore.kinds import Kind
    >>> from offcore.residency import ResidencyScheduler
    >>> from offcore.scheduler import Scheduler
    >>> done = type("Landed", (), {"query": lambda self: True})()
    >>> rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.003, record=True)
    >>> for key in (0, 1):
    ...     rs.produced(key, 0.001 * key); _ = rs.register(key, Kind.ACTIVATION, 64); rs.offload_started(key, done)
    >>> _ = rs.landed(0), rs.landed(1)
    >>> for action in rs.forward_ended(0.002):
    ...     rs.started(action.key, done)
    >>> replay(rs.log, **rs.settings()) == rs.actions
    True
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from offcore.errors import IllegalTransitionError, OffcoreError
from offcore.residency import Action, ResidencyScheduler
from offcore.scheduler import Scheduler, StepObservation

__all__ = ["replay", "ReplayedPredictor", "ReplayDiverged"]


class ReplayDiverged(OffcoreError):
    """The replayed scheduler decided differently, so a later recorded event no longer applies."""


class _Landed:
    """A simulated copy event: the log says when the copy landed, so it has landed when asked."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_LANDED = _Landed()
# events whose positional argument after the key is an event object the log does not keep
_WITH_EVENT = {"offload_started", "started", "reloaded"}
# triggers: the events whose result is an offer of actions, taken one by one by the ``next`` events after them
_OFFERS = {"used", "forward_ended", "staged", "host_updated", "host_updated_all"}


class ReplayedPredictor(Scheduler):
    """A next-use predictor that returns, plan after plan, the predictions a recorded step used."""

    def __init__(self, predictions: Iterable[Mapping[int, float]], *, margin: float = 0.0) -> None:
        super().__init__(margin=margin)
        self._predictions = collections.deque(dict(p) for p in predictions)

    def predict(self, step: StepObservation) -> dict[int, float]:
        if not self._predictions:
            raise ReplayDiverged("the replay made more plans than the recorded step")
        return self._predictions.popleft()

    def observe(self, step: StepObservation) -> None:
        """Learning is not replayed: the next plan's inputs come from the log."""


def replay(
    log: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]],
    *,
    prefetch: str = "deadline",
    budget: int = 256 * 1024**2,
    margin: float = 0.0,
    device_capacity: int = 0,
) -> list[Action]:
    """The actions a new :class:`ResidencyScheduler` decides when fed ``log`` (see the module doc).

    ``prefetch``, ``budget``, ``margin`` and ``device_capacity`` are the recorded
    scheduler's settings (``margin`` only matters for the prefetch plan's latest starts).
    """
    plans = [args for name, args, _ in log if name == "plan_inputs"]
    readings = collections.deque(args[0] for name, args, _ in log if name == "device_in_use")
    durations: dict[int, float] = {}
    stage_durations: dict[int, float] = {}  # the third item of a plan that had stages

    def duration(nbytes: int) -> float:
        return durations.get(nbytes, math.inf)

    def stage_duration(nbytes: int) -> float:
        return stage_durations.get(nbytes, math.inf)

    def device_in_use() -> int:
        if not readings:
            raise ReplayDiverged("the replay read the device's memory more often than the recorded step")
        return int(readings.popleft())

    class _Scheduler(ResidencyScheduler):
        def _make_plan(self, readers: dict[int, list[int]] | None) -> None:
            if self.prefetch_mode == "deadline" and plan_inputs:
                inputs = plan_inputs.popleft()
                durations.clear()
                durations.update(inputs[1])
                stage_durations.clear()
                if len(inputs) > 2:
                    stage_durations.update(inputs[2])
            super()._make_plan(readers)

    plan_inputs = collections.deque(plans)
    predictor = ReplayedPredictor((p[0] for p in plans), margin=margin)
    sched = _Scheduler(
        predictor,
        duration=duration,
        prefetch=prefetch,
        budget=budget,
        margin=margin,
        device_capacity=device_capacity,
        device_in_use=device_in_use if device_capacity > 0 else None,
        record=True,
        stage_duration=stage_duration,
    )
    offer: Iterator[Action] = iter(())
    for name, args, kwargs in log:
        if name in ("device_in_use", "plan_inputs"):
            continue  # consumed by the probe and the plan above, in order
        if name == "next":
            next(offer, None)
            continue
        if name in _WITH_EVENT:
            args = (*args, _LANDED)
        try:
            result = getattr(sched, name)(*args, **kwargs)
        except IllegalTransitionError as exc:
            raise ReplayDiverged(
                f"the replay decided differently before event {name}{args}: the recorded event no longer "
                f"applies ({exc}); actions so far: {len(sched.actions)}"
            ) from exc
        if name in _OFFERS:
            offer = iter(result)
    return [a for a in sched.actions]
