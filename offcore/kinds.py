"""What offcore moves (object kinds) and where it can put it (tiers).

>>> from offcore.kinds import Kind, Tier, TierSpec
>>> TierSpec(Tier.PINNED, capacity="8GiB", bandwidth="25GB/s").capacity
8589934592
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from offcore.errors import ConfigurationError
from offcore.units import format_bandwidth, format_bytes, parse_bandwidth, parse_size

__all__ = ["Kind", "Tier", "TierSpec", "Direction"]

# Note [Enum members are read once per module]
# On Python 3.11 ``enum.EnumType`` defines ``__getattr__``, so CPython reads *every* attribute of an
# enum class through its slow ``__getattr__`` hook: ``State.OFFLOADING`` costs about 80 ns where a
# module global costs 15 (3.12 dropped the hook). The per-object paths (a saved tensor's pack,
# landing, prefetch, restore and release; a parameter's upload) read ~50 members per object, a
# few µs of host time each, so the modules on those paths bind the members they read to private
# module globals once, under a comment naming this Note (``_OFFLOADING = State.OFFLOADING``), and
# their function bodies read those. Signatures, class bodies and module-level tables keep the
# enum's own spelling (they run once). The members are the same objects: ``is`` and ``==`` agree.


class Kind(str, enum.Enum):
    """The four kinds of training state, each next used at a different moment."""

    ACTIVATION = "activation"
    """Saved for backward: needed between its forward op and the matching backward op."""
    PARAMETER = "parameter"
    """Needed by its module's forward and backward; backward must see the version forward used."""
    GRADIENT = "gradient"
    """Produced by backward, consumed by reduction, accumulation and the optimizer."""
    OPTIMIZER_STATE = "optimizer_state"
    """Needed when its parameter is updated; may stay on the host (CPU optimizer)."""


class Tier(str, enum.Enum):
    """Residency tiers, fastest first."""

    DEVICE = "device"
    PINNED = "pinned"
    PAGEABLE = "pageable"
    NVME = "nvme"

    @property
    def is_host(self) -> bool:
        return self in (Tier.PINNED, Tier.PAGEABLE)


class Direction(str, enum.Enum):
    """Copy directions, as the ledger and the trace name them."""

    D2H = "d2h"
    H2D = "h2d"
    H2H = "h2h"
    D2D = "d2d"
    H2N = "h2n"
    """Host memory → the NVMe tier (a tier write)."""
    N2H = "n2h"
    """The NVMe tier → host memory (a tier read; the first hop of NVMe → device)."""

    @property
    def is_nvme(self) -> bool:
        """Whether this direction is a transfer of the NVMe tier (``h2n`` / ``n2h``)."""
        return self in (Direction.H2N, Direction.N2H)

    @staticmethod
    def between(src: Tier, dst: Tier) -> Direction:
        """The direction of one copy from ``src`` to ``dst``.

        NVMe moves only to and from host memory: NVMe ↔ device is two hops (``n2h`` then ``h2d``,
        ``d2h`` then ``h2n``), and asking for it in one is a :class:`~offcore.ConfigurationError`.

            >>> Direction.between(Tier.NVME, Tier.PINNED).value, Direction.between(Tier.DEVICE, Tier.PINNED).value
            ('n2h', 'd2h')
        """
        if src is Tier.NVME or dst is Tier.NVME:
            if src is dst or Tier.DEVICE in (src, dst):
                raise ConfigurationError(
                    f"no single copy goes from {src.value} to {dst.value}: the NVMe tier moves only to and from host "
                    "memory (NVMe → device is n2h then h2d; device → NVMe is d2h then h2n)"
                )
            return Direction.N2H if src is Tier.NVME else Direction.H2N
        if src is Tier.DEVICE and dst is Tier.DEVICE:
            return Direction.D2D
        if src is Tier.DEVICE:
            return Direction.D2H
        if dst is Tier.DEVICE:
            return Direction.H2D
        return Direction.H2H


@dataclass(frozen=True)
class TierSpec:
    """A tier with its byte budget and the bandwidth of copies to and from the device.

    ``capacity`` and ``bandwidth`` take bytes (per second) or strings (``"8GiB"``, ``"25GB/s"``).
    """

    tier: Tier
    capacity: int = field(default=0)
    bandwidth: float = field(default=math.inf)

    def __init__(self, tier: Tier, capacity: int | str, bandwidth: float | str = math.inf) -> None:
        object.__setattr__(self, "tier", Tier(tier))
        object.__setattr__(self, "capacity", parse_size(capacity, what=f"{Tier(tier).value} capacity"))
        object.__setattr__(self, "bandwidth", parse_bandwidth(bandwidth, what=f"{Tier(tier).value} bandwidth"))

    def __str__(self) -> str:
        return f"{self.tier.value}: {format_bytes(self.capacity)} at {format_bandwidth(self.bandwidth)}"
