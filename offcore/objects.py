"""Managed objects and the state machine that guards their moves.

# Note [When may a device copy be freed?]
# A device copy may be dropped only once (1) the device-to-host copy that duplicates
# it has *completed* (its event queried true on the copy stream, not merely been
# enqueued), and (2) nobody else holds the storage: dropping offcore's reference to
# a storage another tensor still references frees nothing, so the ledger must not
# count it. (1) is enforced here: ``ManagedObject.release_device_copy`` raises
# IllegalTransitionError while the D2H event is pending. (2) is the binding's job
# (offcore_torch counts a storage as freed only when its weakref dies). The same rule
# holds in reverse for host buffers: a host buffer returns to its pool only after the
# host-to-device copy reading it has completed.

    >>> obj = ManagedObject(kind=Kind.ACTIVATION, nbytes=1024)
    >>> obj.state
    <State.RESIDENT: 'resident'>
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from offcore.errors import IllegalTransitionError
from offcore.kinds import Kind, Tier

__all__ = ["State", "ManagedObject", "TRANSITIONS"]

_ids = itertools.count()


class State(str, enum.Enum):
    RESIDENT = "resident"
    """Only a device copy exists."""
    OFFLOADING = "offloading"
    """A device-to-host copy is in flight: both copies are held."""
    OFFLOADED = "offloaded"
    """Only the host copy exists; the device copy has been released."""
    PREFETCHING = "prefetching"
    """A host-to-device copy is in flight: both copies are held."""
    RESTORED = "restored"
    """The device copy is back; the host copy may be returned to its pool."""
    RELEASED = "released"
    """Neither copy is held any more (consumed or abandoned)."""


# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_OFFLOADED, _OFFLOADING, _PREFETCHING, _RELEASED, _RESIDENT, _RESTORED = (
    State.OFFLOADED,
    State.OFFLOADING,
    State.PREFETCHING,
    State.RELEASED,
    State.RESIDENT,
    State.RESTORED,
)
_DEVICE, _PINNED = Tier.DEVICE, Tier.PINNED


TRANSITIONS: dict[State, frozenset[State]] = {
    State.RESIDENT: frozenset({State.OFFLOADING, State.RELEASED}),
    State.OFFLOADING: frozenset({State.OFFLOADED, State.RESIDENT, State.RELEASED}),
    State.OFFLOADED: frozenset({State.PREFETCHING, State.RELEASED}),
    State.PREFETCHING: frozenset({State.RESTORED, State.OFFLOADED, State.RELEASED}),
    State.RESTORED: frozenset({State.RELEASED, State.OFFLOADING, State.OFFLOADED}),
    State.RELEASED: frozenset(),
}


# Note [Transitions checked inline]: the hot path (one offloaded storage goes through about six
# transitions per step) tests membership in the set of states each target may be entered from,
# built once from TRANSITIONS, and assigns; only a refused transition calls ``_move`` (which
# raises with the full message). Same checks as ``_move``, one set lookup and no call.
# offcore/residency.py's ``host_updated_prefetches`` makes start_offload and release_device_copy's
# transitions itself, where it knows the source state: a change to what they set here goes there too.
_ENTERED_FROM: dict[State, frozenset[State]] = {
    new: frozenset(old for old, allowed in TRANSITIONS.items() if new in allowed) for new in State
}
_FROM_FOR_OFFLOADING = _ENTERED_FROM[State.OFFLOADING]
_FROM_FOR_PREFETCHING = _ENTERED_FROM[State.PREFETCHING]
_FROM_FOR_RESTORED = _ENTERED_FROM[State.RESTORED]
_FROM_FOR_RELEASED = _ENTERED_FROM[State.RELEASED]
# release_device_copy and drop_restored_copy check their one source state themselves
assert State.OFFLOADED in TRANSITIONS[State.OFFLOADING] and State.OFFLOADED in TRANSITIONS[State.RESTORED]


class _Pending:
    """Anything with ``query() -> bool`` (an Event)."""

    def query(self) -> bool:  # pragma: no cover - protocol only
        raise NotImplementedError


@dataclass(eq=False, slots=True)  # slots: one per offloaded storage, on the hot path
class ManagedObject:
    """One unit of training state that offcore moves between tiers.

    ``version`` is the framework's version counter when the object was captured;
    ``next_use`` the estimated time (seconds from step start) it is needed on the
    device again. Events are whatever the backend returns (``query()`` is all that is
    used here).
    """

    kind: Kind
    nbytes: int
    tier: Tier = Tier.DEVICE
    state: State = State.RESIDENT
    version: int = 0
    next_use: float | None = None
    name: str = ""
    id: int = field(default_factory=_ids.__next__)  # a C call: no Python frame per object
    d2h_event: Any = None
    h2d_event: Any = None
    host_tier: Tier | None = None

    def renew(self, kind: Kind, nbytes: int, name: str = "") -> None:
        """Make this object what ``ManagedObject(kind=kind, nbytes=nbytes, name=name)`` would be: every field
        back to its default, and a new ``id`` (Note [Objects renewed across rounds] in offcore/residency.py).
        Only for an object no one will report an event about any more (its scheduler's round is over)."""
        self.kind = kind
        self.nbytes = nbytes
        self.tier = _DEVICE
        self.state = _RESIDENT
        self.version = 0
        self.next_use = None
        self.name = name
        self.id = _ids.__next__()
        self.d2h_event = None
        self.h2d_event = None
        self.host_tier = None

    def _move(self, new: State) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransitionError(
                f"object {self.describe()} cannot go from {self.state.value} to {new.value}; "
                f"allowed next states: {sorted(s.value for s in TRANSITIONS[self.state]) or 'none'}"
            )
        self.state = new

    def describe(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"#{self.id}{label} ({self.kind.value}, {self.nbytes} bytes)"

    def start_offload(self, event: Any, host_tier: Tier = Tier.PINNED) -> None:
        """A D2H copy was enqueued; ``event`` completes when it lands."""
        if self.state in _FROM_FOR_OFFLOADING:  # Note [Transitions checked inline]
            self.state = _OFFLOADING
        else:
            self._move(_OFFLOADING)
        self.d2h_event = event
        self.host_tier = host_tier

    def release_device_copy(self) -> None:
        """Drop the device copy. Refused while the D2H copy is still in flight (see the Note above)."""
        if self.state is not _OFFLOADING:
            # explicit: RESTORED -> OFFLOADED is legal (drop_restored_copy), but not through here,
            # and a half-done _move must never leave the state changed under a raised error
            raise IllegalTransitionError(
                f"object {self.describe()} is {self.state.value}: only an offloading object (a device-to-host "
                "copy started with start_offload) can release its device copy; "
                f"allowed next states: {sorted(s.value for s in TRANSITIONS[self.state]) or 'none'}"
            )
        if self.d2h_event is None or not self.d2h_event.query():
            raise IllegalTransitionError(
                f"refusing to free the device copy of {self.describe()}: its device-to-host copy has not "
                "completed. Wait for (or synchronize) the copy's event before releasing the device copy."
            )
        self.state = _OFFLOADED  # OFFLOADING -> OFFLOADED, checked above (Note [Transitions checked inline])
        self.tier = self.host_tier or _PINNED
        # the landed copy's event is not asked again (only an OFFLOADING object's is): let it go now rather
        # than keep an event (and a backend's marker) alive per saved tensor until backward
        self.d2h_event = None

    def cancel_offload(self) -> None:
        """Keep the device copy after all (e.g. the host pool refused); the host copy is dropped."""
        self._move(_RESIDENT)
        self.d2h_event = None
        self.host_tier = None

    def start_prefetch(self, event: Any) -> None:
        if self.state in _FROM_FOR_PREFETCHING:  # Note [Transitions checked inline]
            self.state = _PREFETCHING
        else:
            self._move(_PREFETCHING)
        self.h2d_event = event

    def fail_prefetch(self) -> None:
        """The host-to-device copy failed: its device buffer is garbage, the host copy is still the data."""
        if self.state is not _PREFETCHING:
            raise IllegalTransitionError(
                f"object {self.describe()} is {self.state.value}: only a prefetching object can fail its prefetch"
            )
        self._move(_OFFLOADED)
        self.h2d_event = None
        self.tier = self.host_tier or _PINNED

    def finish_prefetch(self, *, stream_waited: bool = False) -> None:
        """The device copy is usable.

        Refused while the H2D copy is in flight, unless the caller made the consuming
        stream wait on the copy's event (``stream_waited=True``): then later work on
        that stream is ordered after the copy even though the host has not seen it land.
        """
        if self.state is _PREFETCHING and not stream_waited and (self.h2d_event is None or not self.h2d_event.query()):
            raise IllegalTransitionError(
                f"{self.describe()} is not on the device yet: wait for its host-to-device copy's event "
                "on the consuming stream before using it."
            )
        if self.state in _FROM_FOR_RESTORED:  # Note [Transitions checked inline]
            self.state = _RESTORED
        else:
            self._move(_RESTORED)
        self.tier = _DEVICE

    def drop_restored_copy(self) -> None:
        """Drop the restored device copy again while the host copy stays valid (reused by a later
        backward over a retained graph). Only from RESTORED: a prefetch in flight must land first."""
        if self.state is not _RESTORED:
            # from OFFLOADING the table allows OFFLOADED too, but only release_device_copy may
            # take that edge: it checks that the device-to-host copy has landed
            raise IllegalTransitionError(
                f"object {self.describe()} is {self.state.value}: only a restored object can drop its "
                "restored device copy (an offloading one releases it with release_device_copy once its "
                "device-to-host copy has completed)"
            )
        self.state = _OFFLOADED  # RESTORED -> OFFLOADED, checked above (Note [Transitions checked inline])
        self.h2d_event = None
        self.tier = self.host_tier or _PINNED

    def release(self) -> None:
        """Drop every copy (consumed by backward, or the step was abandoned)."""
        if self.state in _FROM_FOR_RELEASED:  # Note [Transitions checked inline]
            self.state = _RELEASED
        else:
            self._move(_RELEASED)
