"""The ledger: where bytes are, what was copied, and how long anyone waited.

>>> from offcore.ledger import Ledger
>>> from offcore.kinds import Kind, Tier, Direction
>>> ledger = Ledger()
>>> ledger.add(Tier.PINNED, Kind.ACTIVATION, 4096)
>>> ledger.record_copy(Direction.D2H, 4096, seconds=0.001)
>>> ledger.bytes(Tier.PINNED), ledger.peak(Tier.PINNED)
(4096, 4096)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from offcore.errors import IllegalTransitionError
from offcore.kinds import Direction, Kind, Tier

__all__ = ["Ledger", "CopyTotals"]


@dataclass
class CopyTotals:
    """Copied bytes and busy seconds in one direction.

    ``bytes`` and ``copies`` count every copy; ``seconds`` only the timed ones, whose bytes
    are ``timed_bytes`` (a binding may time a sample of its copies), so ``bandwidth`` is
    the achieved rate of the timed copies.
    """

    bytes: int = 0
    seconds: float = 0.0
    copies: int = 0
    timed_bytes: int = 0

    @property
    def bandwidth(self) -> float:
        """Achieved bytes per second of the timed copies (0 when nothing was timed).

        Totals filled in by hand (``bytes`` and ``seconds`` of every copy, no ``timed_bytes``)
        count every copy as timed.
        """
        if self.seconds <= 0:
            return 0.0
        return (self.timed_bytes or self.bytes) / self.seconds


@dataclass
class Ledger:
    """Bytes per (tier, kind), current and peak; copies per direction; waits.

    Directions are the device's (``d2h``, ``h2d``, ``h2h``, ``d2d``) and the NVMe tier's
    (``h2n``, ``n2h``: an :class:`~offcore.nvme.NvmeTier` given this ledger records each completed
    transfer, Note [The NVMe tier's copies in the ledger and the trace]).

    Thread-safe: copy workers may record from their own threads. ``reset_step()``
    starts a new step: peaks restart from the current level, copy and wait totals
    from zero. Every record is O(1) (a running total per tier, not a sum over kinds):
    bindings call it once per copy and per host buffer on their hot path.
    """

    _current: dict[tuple[Tier, Kind], int] = field(default_factory=lambda: defaultdict(int))
    _peak: dict[tuple[Tier, Kind], int] = field(default_factory=lambda: defaultdict(int))
    _tier_current: dict[Tier, int] = field(default_factory=lambda: defaultdict(int))
    _tier_peak: dict[Tier, int] = field(default_factory=lambda: defaultdict(int))
    copies: dict[Direction, CopyTotals] = field(default_factory=lambda: defaultdict(CopyTotals))
    wait_seconds: float = 0.0
    waits: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` as now living on ``tier``."""
        with self._lock:
            key = (tier, kind)
            now = self._current[key] + nbytes
            self._current[key] = now
            if now > self._peak[key]:
                self._peak[key] = now
            total = self._tier_current[tier] + nbytes
            self._tier_current[tier] = total
            if total > self._tier_peak[tier]:
                self._tier_peak[tier] = total

    def remove(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` as really freed from ``tier``."""
        with self._lock:
            key = (tier, kind)
            if self._current[key] < nbytes:
                raise IllegalTransitionError(
                    f"ledger underflow: removing {nbytes} bytes of {kind.value} from {tier.value}, "
                    f"which holds {self._current[key]}; every remove needs a matching add"
                )
            self._current[key] -= nbytes
            self._tier_current[tier] -= nbytes

    def _tier_total(self, tier: Tier) -> int:
        return self._tier_current.get(tier, 0)

    def bytes(self, tier: Tier, kind: Kind | None = None) -> int:
        """Bytes now on ``tier`` (of ``kind``, or of every kind)."""
        with self._lock:
            if kind is None:
                return self._tier_total(tier)
            return self._current.get((tier, kind), 0)

    def peak(self, tier: Tier, kind: Kind | None = None) -> int:
        """Peak bytes on ``tier`` since the last ``reset_step`` (of ``kind``, or all kinds together)."""
        with self._lock:
            if kind is None:
                return self._tier_peak.get(tier, 0)
            return self._peak.get((tier, kind), 0)

    def record_copy(self, direction: Direction, nbytes: int, *, seconds: float | None = None, copies: int = 1) -> None:
        """Count a copy of ``nbytes`` in ``direction``; ``seconds``: its measured time, if it was timed.

        ``copies``: how many copies ``nbytes`` totals (a binding may count its copies in
        plain integers on its hot path and add them here in a batch).
        """
        with self._lock:
            totals = self.copies[direction]
            totals.bytes += nbytes
            totals.copies += copies
            if seconds is not None:
                totals.timed_bytes += nbytes
                totals.seconds += seconds

    def record_timing(self, direction: Direction, nbytes: int, seconds: float) -> None:
        """Add the measured time of a copy already counted by :meth:`record_copy` (timed later, when it landed)."""
        with self._lock:
            totals = self.copies[direction]
            totals.timed_bytes += nbytes
            totals.seconds += seconds

    def record_wait(self, seconds: float, *, what: str = "") -> None:
        """Charge ``seconds`` of exposed wait (to ``what``, e.g. an object's name)."""
        with self._lock:
            self.wait_seconds += seconds
            if what:
                self.waits[what] += seconds

    def reset_step(self) -> None:
        with self._lock:
            for key, value in self._current.items():
                self._peak[key] = value
            for tier in list(self._tier_peak):
                self._tier_peak[tier] = self._tier_total(tier)
            self.copies.clear()
            self.wait_seconds = 0.0
            self.waits.clear()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        with self._lock:
            tiers = {t for t, _ in self._current} | set(self._tier_peak)
            return {
                "bytes": {t.value: {k.value: v for (tt, k), v in self._current.items() if tt is t} for t in tiers},
                "peak_bytes": {t.value: self._tier_peak[t] for t in tiers},
                "copies": {
                    d.value: {"bytes": c.bytes, "seconds": c.seconds, "copies": c.copies, "bandwidth": c.bandwidth}
                    for d, c in self.copies.items()
                },
                "wait_seconds": self.wait_seconds,
            }
