"""One device budget shared by every residency scheduler of one device, across kinds.

Each binding of a device (activation regions, a parameter-offload handle, an optimizer) runs
its own :class:`offcore.residency.ResidencyScheduler`. Given a :class:`DeviceBudget`
(``shared_budget=``), each of them reserves here the bytes it copies onto the device *ahead
of their use* (prefetched or held copies: what Note [Budget semantics] in residency.py
calls outstanding), keyed by ``(owner, key)`` with the kind and the copy's predicted next use
(seconds on the bindings' common clock, ``time.perf_counter``). When a reservation would go
over ``capacity_bytes``, the budget picks victims among *every* owner's reservations whose
next use comes later than the request's, furthest next use first (Belady across kinds), and
asks their owners to evict them; when that cannot make room the request is refused (the
binding copies on demand at the use instead).

    >>> from offcore.budget import DeviceBudget
    >>> from offcore.kinds import Kind
    >>> budget = DeviceBudget(100)
    >>> evicted = []
    >>> a, b = object(), object()
    >>> budget.attach(a, evicted.append)
    >>> budget.attach(b, evicted.append)
    >>> budget.admit(a, Kind.PARAMETER, 1, 60, next_use=5.0)
    True
    >>> budget.admit(b, Kind.ACTIVATION, 7, 60, next_use=1.0)   # needed sooner: key 1 of a goes
    True
    >>> evicted, budget.used_bytes
    ([1], 60)

# Note [One device budget across kinds]
# The budget bounds the bytes offcore's bindings keep on the device *ahead of their use*
# across kinds, not the device's whole allocation: the bytes compute uses right now (the
# module being computed, activations being produced, a gradient before its D2H) are the
# program's, as on a device without offcore. So the device peak is at most what the step
# needs without any copy ahead of use, plus ``capacity_bytes``, plus the *slack*: bytes of
# another owner evicted for a request but not freed yet, which its binding frees at its next
# trigger (the next use it sees) -- the victims' owner is asked (``evict(key)``) from the
# requester's thread and only bookkeeps at once. Next uses are compared on one clock: each
# scheduler reports ``t_backward + plan.need[key]`` in ``time.perf_counter`` seconds.
# Reservations of one owner are all given back by :meth:`DeviceBudget.release_owner` when its
# round ends, so a scheduler dropped without closing leaks nothing. A victim may be a prefetch
# whose copy is still in flight: its binding drops it, but a use before the copy landed must
# still wait for that copy (Note [An evicted prefetch still in flight] in
# plugins/offcore_torch/activations/offload.py; reading the buffer as it is gave wrong gradients).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offcore.errors import ConfigurationError
from offcore.kinds import Kind
from offcore.units import format_bytes

__all__ = ["DeviceBudget", "BudgetStats"]


@dataclass
class _Reservation:
    owner: int
    kind: Kind
    key: int
    nbytes: int
    next_use: float


@dataclass
class BudgetStats:
    """Per kind: bytes reserved now and at peak, requests admitted, refused, and copies evicted."""

    capacity_bytes: int
    used_bytes: int
    peak_bytes: int
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)


class DeviceBudget:
    """Bytes copied ahead of use on one device, shared by every scheduler of that device (see the module doc).

    ``capacity_bytes``: the budget (>= 0). Thread-safe (a host optimizer's uploads run on a
    worker thread).

        >>> DeviceBudget(1 << 20).free_bytes
        1048576
    """

    def __init__(self, capacity_bytes: int, *, name: str = "") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigurationError(f"device budget must be a non-negative number of bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.name = name
        self._lock = threading.RLock()
        self._reservations: dict[tuple[int, int], _Reservation] = {}
        self._owners: dict[int, Callable[[], Callable[[int], None] | None]] = {}  # weak: an owner may just go
        self._minimums: dict[int, tuple[int, str]] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self._kind_bytes: dict[Kind, int] = dict.fromkeys(Kind, 0)
        self._kind_peak: dict[Kind, int] = dict.fromkeys(Kind, 0)
        self._counters: dict[Kind, dict[str, int]] = {k: {"admitted": 0, "refused": 0, "evicted": 0} for k in Kind}

    # -- owners ---------------------------------------------------------------------------
    def attach(self, owner: Any, evict: Callable[[int], None], *, minimum: int = 0, what: str = "") -> None:
        """Let ``owner`` reserve; ``evict(key)`` is called when one of its copies is chosen as a victim.

        ``minimum``: the largest object the owner must be able to hold ahead of its use at once
        (``what`` names it). A budget below the largest minimum of its owners cannot work: the
        :class:`~offcore.errors.ConfigurationError` names the smallest budget that can.
        """
        with self._lock:
            if minimum > 0:
                self._minimums[id(owner)] = (minimum, what or "an object")
            try:
                self.check()
            except ConfigurationError:
                self._minimums.pop(id(owner), None)
                raise
            try:
                ref: Callable[[], Callable[[int], None] | None] = weakref.WeakMethod(evict)  # type: ignore[arg-type]
            except TypeError:
                ref = lambda: evict  # noqa: E731 - a plain function: held as it is
            self._owners[id(owner)] = ref
            try:  # an owner dropped without detach gives its reservations back
                weakref.finalize(owner, self._forget, id(owner))
            except TypeError:
                pass

    def detach(self, owner: Any) -> None:
        """``owner`` is done: its reservations are given back and it is never asked to evict again."""
        with self._lock:
            self.release_owner(owner)
            self._owners.pop(id(owner), None)
            self._minimums.pop(id(owner), None)

    def _forget(self, ident: int) -> None:
        with self._lock:
            for key in [k for k in self._reservations if k[0] == ident]:
                self._remove(key)
            self._owners.pop(ident, None)
            self._minimums.pop(ident, None)

    def smallest_working(self) -> int:
        """The smallest budget that can work for the owners attached now (their largest minimum)."""
        with self._lock:
            return max((m for m, _ in self._minimums.values()), default=0)

    def check(self) -> None:
        """Raise a ConfigurationError naming the smallest budget that can work when this one cannot."""
        with self._lock:
            if not self._minimums:
                return
            need, what = max(self._minimums.values(), key=lambda mw: mw[0])
            if need > self.capacity_bytes:
                raise ConfigurationError(
                    f"device budget {format_bytes(self.capacity_bytes)} cannot hold {what} "
                    f"({format_bytes(need)}) ahead of its use; the smallest budget that can work is "
                    f"{format_bytes(need)} ({need} bytes): pass budget>={need}"
                )

    # -- reservations -----------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def holds(self, owner: Any, key: int) -> bool:
        """Whether ``owner`` has ``key`` reserved."""
        return (id(owner), key) in self._reservations

    def victims(self, nbytes: int, next_use: float) -> list[tuple[int, int]] | None:
        """The reservations ``(id(owner), key)`` to evict so ``nbytes`` more fit: furthest next use first,
        only among those needed after ``next_use``. ``[]`` when there is room already; None when evicting
        every such reservation would still not make room."""
        with self._lock:
            over = self.used_bytes + nbytes - self.capacity_bytes
            if over <= 0:
                return []
            candidates = sorted(
                (r for r in self._reservations.values() if r.next_use > next_use),
                key=lambda r: (r.next_use, r.owner, r.key),
                reverse=True,
            )
            out: list[tuple[int, int]] = []
            freed = 0
            for r in candidates:
                if freed >= over:
                    break
                out.append((r.owner, r.key))
                freed += r.nbytes
            return out if freed >= over else None

    def admit(self, owner: Any, kind: Kind, key: int, nbytes: int, *, next_use: float = math.inf) -> bool:
        """Reserve ``nbytes`` for ``owner``'s ``key`` (next used at ``next_use``), evicting copies needed
        later (any owner's) when the budget is full. Returns False (nothing reserved, nothing evicted)
        when that cannot make room."""
        with self._lock:
            ident = (id(owner), key)
            if ident in self._reservations:
                return True
            if self.used_bytes + nbytes > self.capacity_bytes:
                chosen = self.victims(nbytes, next_use)
                if chosen is None:
                    self._counters[kind]["refused"] += 1
                    return False
                for victim_owner, victim_key in chosen:
                    victim = self._reservations[(victim_owner, victim_key)]
                    self._remove((victim_owner, victim_key))
                    self._counters[victim.kind]["evicted"] += 1
                    ref = self._owners.get(victim_owner)
                    evict = ref() if ref is not None else None
                    if evict is not None:
                        evict(victim_key)
            self._reservations[ident] = _Reservation(id(owner), kind, key, nbytes, next_use)
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            self._kind_bytes[kind] += nbytes
            self._kind_peak[kind] = max(self._kind_peak[kind], self._kind_bytes[kind])
            self._counters[kind]["admitted"] += 1
            return True

    def update(self, owner: Any, key: int, next_use: float) -> None:
        """A new prediction of ``key``'s next use."""
        with self._lock:
            r = self._reservations.get((id(owner), key))
            if r is not None:
                r.next_use = next_use

    def release(self, owner: Any, key: int) -> None:
        """``owner``'s copy of ``key`` is no longer ahead of its use (used, freed or dropped)."""
        with self._lock:
            self._remove((id(owner), key))

    def release_owner(self, owner: Any) -> None:
        """Give back every reservation of ``owner`` (its round ended)."""
        with self._lock:
            for ident in [k for k in self._reservations if k[0] == id(owner)]:
                self._remove(ident)

    def _remove(self, ident: tuple[int, int]) -> None:
        r = self._reservations.pop(ident, None)
        if r is not None:
            self.used_bytes -= r.nbytes
            self._kind_bytes[r.kind] -= r.nbytes

    def stats(self) -> BudgetStats:
        """Bytes reserved now and at peak, and per kind: bytes, peak, admitted, refused, evicted."""
        with self._lock:
            by_kind = {
                k.value: {"bytes": self._kind_bytes[k], "peak_bytes": self._kind_peak[k], **self._counters[k]}
                for k in Kind
            }
            return BudgetStats(self.capacity_bytes, self.used_bytes, self.peak_bytes, by_kind)

    def __repr__(self) -> str:
        return (
            f"DeviceBudget({format_bytes(self.capacity_bytes)}, {format_bytes(self.used_bytes)} reserved, "
            f"{len(self._owners)} owners)"
        )
