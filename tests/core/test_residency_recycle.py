"""ResidencyScheduler.recycle and ManagedObject.renew: a new round renews the finished round's objects in place
(Note [Objects renewed across rounds] in offcore/residency.py)."""

from __future__ import annotations

import dataclasses

import pytest

from offcore.errors import ConfigurationError
from offcore.kinds import Kind, Tier
from offcore.objects import ManagedObject, State
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler


class _Landed:
    def query(self) -> bool:
        return True


def test_a_renewed_object_is_a_new_object_in_every_field_but_its_identity() -> None:
    obj = ManagedObject(kind=Kind.GRADIENT, nbytes=64, name="old")
    obj.start_offload(_Landed(), Tier.PAGEABLE)
    obj.release_device_copy()
    obj.start_prefetch(_Landed())
    obj.version, obj.next_use = 3, 1.5
    old_id = obj.id
    obj.renew(Kind.PARAMETER, 256, "new")
    fresh = ManagedObject(kind=Kind.PARAMETER, nbytes=256, name="new")
    for field in dataclasses.fields(ManagedObject):  # a field added later must be renewed too
        if field.name != "id":
            assert getattr(obj, field.name) == getattr(fresh, field.name), field.name
    assert obj.id not in (old_id, fresh.id)


def _round(predictor: Scheduler, sizes: dict[int, int], *, finished: ResidencyScheduler | None, record: bool = False):
    rs = ResidencyScheduler(predictor, duration=lambda n: 1e-6 * n, prefetch="asap", budget=150, record=record)
    if finished is not None:
        rs.recycle(finished)
    rs.forward_began(0.0)
    for key, nbytes in sizes.items():
        rs.register(key, Kind.PARAMETER, nbytes)
        rs.awaiting_host(key)
    rs.make_plan()
    return rs


def _drive(rs: ResidencyScheduler, t0: float, gradients: int) -> list[tuple[str, int]]:
    """One optimizer round: gradients (released at once), host steps, the next forward's uses."""
    done: list[tuple[str, int]] = []
    for g in range(1, gradients + 1):
        rs.register(-g, Kind.GRADIENT, 32)
        rs.offload_started(-g, _Landed())
        rs.released(-g)
        assert rs.landed(-g, needed=False).kind is ActionKind.FREE
    for action in rs.host_updated_all(sorted(k for k in rs.objects if k >= 0)):
        rs.started(action.key, event=_Landed())
        done.append((action.kind.value, action.key))
    rs.backward_began(t0)
    for i, key in enumerate((2, 0, 1)):
        if rs.objects[key].state is State.OFFLOADED:
            rs.reloaded(key, _Landed())
        else:
            rs.awaited(key)
        rs.consumed(key)
        for action in rs.used(key, t0 + 0.1 * i, managed_key=key):
            rs.started(action.key, event=_Landed())
            done.append((action.kind.value, action.key))
    rs.backward_ended(t0 + 1.0)
    return done


def test_a_recycled_round_renews_the_same_objects_and_decides_as_a_new_one() -> None:
    sizes = {0: 100, 1: 100, 2: 100}
    fresh_predictor, recycled_predictor = Scheduler(margin=0.0), Scheduler(margin=0.0)
    fresh = recycled = None
    third: list[ManagedObject] = []  # gradient -3: in rounds 0 and 2, not in 1
    for step in range(3):
        fresh = _round(fresh_predictor, sizes, finished=None, record=True)
        before = dict(recycled.objects) if recycled is not None else {}
        recycled = _round(recycled_predictor, sizes, finished=recycled, record=True)
        # the same actions and events, round after round (the predictor learns the same uses)
        assert _drive(fresh, 10.0 * step, (3, 2, 3)[step]) == _drive(recycled, 10.0 * step, (3, 2, 3)[step])
        assert [e for e in fresh.log if e[0] != "next"] == [e for e in recycled.log if e[0] != "next"]
        assert fresh.actions == recycled.actions
        for key, obj in before.items():  # the finished round's objects, renewed for the same keys
            if key in recycled.objects:
                assert recycled.objects[key] is obj
        if -3 in recycled.objects:
            third.append(recycled.objects[-3])
    assert len(third) == 2 and third[0] is third[1]  # round 1 left it a spare, round 2 renewed it
    assert (
        fresh_predictor.plan(  # what the rounds taught the predictor is the same
            recycled.observation, sizes, lambda n: 1e-6 * n, margin=0.0
        ).need
        == recycled_predictor.plan(recycled.observation, sizes, lambda n: 1e-6 * n, margin=0.0).need
    )


def test_the_finished_round_keeps_no_object_and_refuses_events_about_them() -> None:
    predictor = Scheduler(margin=0.0)
    finished = _round(predictor, {0: 100, 1: 100}, finished=None)
    obj = finished.objects[0]
    rs = ResidencyScheduler(predictor, duration=lambda n: 1e-6 * n, prefetch="asap", budget=150)
    rs.recycle(finished)
    assert finished.objects == {}
    with pytest.raises(KeyError):
        finished.host_updated_prefetches([0])  # never a change to the object the new round renews
    assert rs.register(0, Kind.PARAMETER, 100) is obj
    assert obj.state is State.RESIDENT
    assert rs.register(5, Kind.PARAMETER, 100) is not obj  # no spare for that key: a new object


def test_recycle_is_refused_after_a_register_and_on_itself() -> None:
    predictor = Scheduler(margin=0.0)
    finished = _round(predictor, {0: 100}, finished=None)
    rs = _round(predictor, {1: 100}, finished=None)
    with pytest.raises(ConfigurationError, match="before the first register"):
        rs.recycle(finished)
    with pytest.raises(ConfigurationError, match="its own"):
        finished.recycle(finished)
