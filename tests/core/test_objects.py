"""ManagedObject's state machine: legal paths, refused transitions, and Note [When may a device copy be freed?]."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import offcore  # noqa: E402
from offcore import Kind, ManagedObject, State, Tier  # noqa: E402
from offcore.objects import TRANSITIONS  # noqa: E402


class FakeEvent:
    """An event whose completion the test controls."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def offloading(nbytes: int = 4096, **kwargs: object) -> tuple[ManagedObject, FakeEvent]:
    obj = ManagedObject(kind=Kind.ACTIVATION, nbytes=nbytes, **kwargs)  # type: ignore[arg-type]
    event = FakeEvent()
    obj.start_offload(event, host_tier=Tier.PINNED)
    return obj, event


def test_a_new_object_is_resident_on_the_device_with_a_unique_id() -> None:
    a = ManagedObject(kind=Kind.PARAMETER, nbytes=8)
    b = ManagedObject(kind=Kind.PARAMETER, nbytes=8)
    assert a.state is State.RESIDENT and a.tier is Tier.DEVICE and a.id != b.id


def test_device_copy_cannot_be_freed_while_the_d2h_copy_is_pending() -> None:
    obj, event = offloading(name="block3.mlp.fc1")
    with pytest.raises(offcore.IllegalTransitionError) as caught:
        obj.release_device_copy()
    message = str(caught.value)
    assert "has not completed" in message and "block3.mlp.fc1" in message and "4096 bytes" in message
    assert event.queries >= 1, "the refusal must come from asking the event, not from a guess"
    assert obj.state is State.OFFLOADING and obj.tier is Tier.DEVICE, "a refused release changes nothing"
    event.done = True
    obj.release_device_copy()
    assert obj.state is State.OFFLOADED and obj.tier is Tier.PINNED
    # the landed copy's event is let go (one backend event per saved tensor is not kept until backward)
    assert obj.d2h_event is None


def test_dropping_a_restored_copy_is_no_back_door_around_the_pending_d2h() -> None:
    obj, event = offloading()
    with pytest.raises(offcore.IllegalTransitionError, match="only a restored object"):
        obj.drop_restored_copy()  # OFFLOADING -> OFFLOADED is in the table, but not without the event
    assert obj.state is State.OFFLOADING and obj.tier is Tier.DEVICE
    event.done = True
    obj.release_device_copy()
    obj.start_prefetch(FakeEvent(done=True))
    obj.finish_prefetch()
    obj.drop_restored_copy()  # a retained graph's restored copy goes; the host copy stays valid
    assert obj.state is State.OFFLOADED and obj.tier is Tier.PINNED and obj.h2d_event is None


def test_a_missing_event_counts_as_pending() -> None:
    obj = ManagedObject(kind=Kind.GRADIENT, nbytes=16)
    obj.start_offload(None)
    with pytest.raises(offcore.IllegalTransitionError):
        obj.release_device_copy()


@pytest.mark.parametrize("state", [State.RESIDENT, State.OFFLOADED, State.PREFETCHING, State.RESTORED, State.RELEASED])
def test_device_copy_release_is_refused_outside_offloading(state: State) -> None:
    obj = ManagedObject(kind=Kind.ACTIVATION, nbytes=1, state=state)
    with pytest.raises(offcore.IllegalTransitionError, match="only an offloading object"):
        obj.release_device_copy()
    assert obj.state is state, "a refused transition changes nothing"


def test_full_round_trip_and_reoffload() -> None:
    obj, d2h = offloading()
    d2h.done = True
    obj.release_device_copy()
    h2d = FakeEvent()
    obj.start_prefetch(h2d)
    assert obj.state is State.PREFETCHING
    with pytest.raises(offcore.IllegalTransitionError, match="not on the device yet"):
        obj.finish_prefetch()
    h2d.done = True
    obj.finish_prefetch()
    assert obj.state is State.RESTORED and obj.tier is Tier.DEVICE
    second = FakeEvent(done=True)
    obj.start_offload(second, host_tier=Tier.PAGEABLE)  # offloaded again (e.g. a parameter after backward)
    obj.release_device_copy()
    assert obj.tier is Tier.PAGEABLE
    obj.release()
    assert obj.state is State.RELEASED


def test_a_failed_prefetch_leaves_the_host_copy_in_charge() -> None:
    obj, d2h = offloading()
    d2h.done = True
    obj.release_device_copy()
    obj.start_prefetch(FakeEvent())
    obj.fail_prefetch()
    assert obj.state is State.OFFLOADED and obj.tier is Tier.PINNED and obj.h2d_event is None
    obj.start_prefetch(FakeEvent(done=True))  # a synchronous reload may follow
    with pytest.raises(offcore.IllegalTransitionError, match="only a prefetching object"):
        ManagedObject(kind=Kind.ACTIVATION, nbytes=1).fail_prefetch()


def test_finish_prefetch_after_the_consumer_stream_waited() -> None:
    obj, d2h = offloading()
    d2h.done = True
    obj.release_device_copy()
    obj.start_prefetch(FakeEvent(done=False))
    obj.finish_prefetch(stream_waited=True)  # ordered on the device, not yet seen by the host
    assert obj.state is State.RESTORED


def test_cancel_offload_keeps_the_device_copy() -> None:
    obj, _ = offloading()
    obj.cancel_offload()
    assert obj.state is State.RESIDENT and obj.d2h_event is None and obj.host_tier is None


def test_released_is_final() -> None:
    obj = ManagedObject(kind=Kind.OPTIMIZER_STATE, nbytes=1)
    obj.release()
    for action in (lambda: obj.start_offload(FakeEvent(True)), obj.release, lambda: obj.start_prefetch(None)):
        with pytest.raises(offcore.IllegalTransitionError, match="none"):
            action()


ACTIONS = {
    "start_offload": lambda o: o.start_offload(FakeEvent(done=True)),
    "release_device_copy": lambda o: o.release_device_copy(),
    "cancel_offload": lambda o: o.cancel_offload(),
    "start_prefetch": lambda o: o.start_prefetch(FakeEvent(done=True)),
    "finish_prefetch": lambda o: o.finish_prefetch(),
    "drop_restored_copy": lambda o: o.drop_restored_copy(),
    "fail_prefetch": lambda o: o.fail_prefetch(),
    "release": lambda o: o.release(),
}
TARGET = {
    "start_offload": State.OFFLOADING,
    "release_device_copy": State.OFFLOADED,
    "cancel_offload": State.RESIDENT,
    "start_prefetch": State.PREFETCHING,
    "finish_prefetch": State.RESTORED,
    "drop_restored_copy": State.OFFLOADED,
    "fail_prefetch": State.OFFLOADED,
    "release": State.RELEASED,
}
ONLY_FROM = {
    # these reach their target from one state only, whatever else may also lead there
    "release_device_copy": State.OFFLOADING,
    "finish_prefetch": State.PREFETCHING,
    "drop_restored_copy": State.RESTORED,
    "fail_prefetch": State.PREFETCHING,
}


@given(st.lists(st.sampled_from(sorted(ACTIONS)), max_size=25))
def test_random_action_sequences_follow_the_transition_table(actions: list[str]) -> None:
    obj = ManagedObject(kind=Kind.ACTIVATION, nbytes=64)
    for action in actions:
        before = obj.state
        legal = TARGET[action] in TRANSITIONS[before]
        if action in ONLY_FROM:
            legal = legal and before is ONLY_FROM[action]
        try:
            ACTIONS[action](obj)
        except offcore.IllegalTransitionError:
            assert not legal, f"{action} from {before} was refused but the table allows it"
            assert obj.state is before
        else:
            assert legal, f"{action} from {before} was accepted but the table forbids it"
            assert obj.state is TARGET[action]
        if obj.state in (State.RESIDENT, State.OFFLOADING, State.RESTORED):
            assert obj.tier is Tier.DEVICE, "the device copy is still the one to use"
        elif obj.state in (State.OFFLOADED, State.PREFETCHING):
            assert obj.tier.is_host
