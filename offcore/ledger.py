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

    # Note [One cell per (tier, kind)]
    # add and remove run once per host buffer and per copy on a binding's hot path. Each (tier, kind) has
    # one cell, ``[current, peak, tier cell]``, and each tier one, ``[current, peak]`` (shared by the cells
    # of its kinds): a record is one dict lookup and list updates, not a lookup per running total. A cell is
    # made by the first add or remove of its (tier, kind), as the totals' entries were.
    _cells: dict[tuple[Tier, Kind], list[Any]] = field(default_factory=dict)
    _tiers: dict[Tier, list[int]] = field(default_factory=dict)
    copies: dict[Direction, CopyTotals] = field(default_factory=lambda: defaultdict(CopyTotals))
    wait_seconds: float = 0.0
    waits: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _cell(self, tier: Tier, kind: Kind) -> list[Any]:
        """The cell of (``tier``, ``kind``), made at its first use (lock held)."""
        tier_cell = self._tiers.get(tier)
        if tier_cell is None:
            tier_cell = self._tiers[tier] = [0, 0]
        cell = self._cells[(tier, kind)] = [0, 0, tier_cell]
        return cell

    def add(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` as now living on ``tier``."""
        with self._lock:
            cell = self._cells.get((tier, kind)) or self._cell(tier, kind)
            now = cell[0] = cell[0] + nbytes
            if now > cell[1]:
                cell[1] = now
            tier_cell = cell[2]
            total = tier_cell[0] = tier_cell[0] + nbytes
            if total > tier_cell[1]:
                tier_cell[1] = total

    def remove(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        """Count ``nbytes`` of ``kind`` as really freed from ``tier``."""
        with self._lock:
            cell = self._cells.get((tier, kind)) or self._cell(tier, kind)
            if cell[0] < nbytes:
                raise IllegalTransitionError(
                    f"ledger underflow: removing {nbytes} bytes of {kind.value} from {tier.value}, "
                    f"which holds {cell[0]}; every remove needs a matching add"
                )
            cell[0] -= nbytes
            cell[2][0] -= nbytes

    def _tier_total(self, tier: Tier) -> int:
        tier_cell = self._tiers.get(tier)
        return 0 if tier_cell is None else tier_cell[0]

    def bytes(self, tier: Tier, kind: Kind | None = None) -> int:
        """Bytes now on ``tier`` (of ``kind``, or of every kind)."""
        with self._lock:
            if kind is None:
                return self._tier_total(tier)
            cell = self._cells.get((tier, kind))
            return 0 if cell is None else cell[0]

    def peak(self, tier: Tier, kind: Kind | None = None) -> int:
        """Peak bytes on ``tier`` since the last ``reset_step`` (of ``kind``, or all kinds together)."""
        with self._lock:
            cell = self._tiers.get(tier) if kind is None else self._cells.get((tier, kind))
            return 0 if cell is None else cell[1]

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
            for cell in self._cells.values():
                cell[1] = cell[0]
            for tier_cell in self._tiers.values():
                tier_cell[1] = tier_cell[0]
            self.copies.clear()
            self.wait_seconds = 0.0
            self.waits.clear()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        with self._lock:
            tiers = {t for t, _ in self._cells}
            return {
                "bytes": {t.value: {k.value: c[0] for (tt, k), c in self._cells.items() if tt is t} for t in tiers},
                "peak_bytes": {t.value: self._tiers[t][1] for t in tiers},
                "copies": {
                    d.value: {"bytes": c.bytes, "seconds": c.seconds, "copies": c.copies, "bandwidth": c.bandwidth}
                    for d, c in self.copies.items()
                },
                "wait_seconds": self.wait_seconds,
            }
