"""The offload policy: what to offload, when, and what to do when the host budget runs out.

All knobs are validated up front, so a typo fails at ``offload_activations(...)`` with
a :class:`~offcore.ConfigurationError` instead of mid-step; an unknown keyword is
refused with the list of known ones (:data:`KNOWN_OPTIONS`).

    >>> from offcore_torch.policy import OffloadPolicy
    >>> policy = OffloadPolicy.parse(min_bytes="64KiB", watermark=0.3)
    >>> policy.min_bytes, policy.watermark, policy.prefetch
    (65536, 0.3, 'deadline')
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from offcore.errors import ConfigurationError
from offcore.residency import PREFETCH_MODES
from offcore.scheduler import Scheduler
from offcore.units import parse_duration, parse_size

__all__ = ["OffloadPolicy", "PREFETCH_MODES", "FALLBACKS", "KNOWN_OPTIONS"]

FALLBACKS = ("pageable", "keep")


def _modules(value: Any, what: str) -> tuple[nn.Module, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, nn.Module) else value
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
        raise ConfigurationError(f"{what} must be an nn.Module or a list of modules, got {type(value).__name__}")
    items = list(items)
    for item in items:
        if not isinstance(item, nn.Module):
            raise ConfigurationError(f"{what} must hold nn.Module objects, got {type(item).__name__}")
    if not items and what == "modules":
        raise ConfigurationError(
            "modules=[] would offload nothing; pass the submodules to offload, or None for the whole forward"
        )
    return tuple(items)


@dataclass(frozen=True)
class OffloadPolicy:
    """Validated settings of :func:`offcore_torch.offload_activations` (see there for meanings)."""

    min_bytes: int = 64 * 1024
    prefetch: str = "deadline"
    prefetch_budget: int = 256 * 1024**2
    margin: float = 0.0005
    host_budget: int = 4 * 1024**3
    pinned: bool = True
    fallback: str = "pageable"
    watermark: float | None = None
    hysteresis: float = 0.05
    modules: tuple[nn.Module, ...] | None = None
    exclude: tuple[nn.Module, ...] | None = None
    schedule: Scheduler | None = None
    trace: bool = False
    record: bool = False

    @classmethod
    def parse(
        cls,
        *,
        min_bytes: int | str = "64KiB",
        prefetch: str = "deadline",
        prefetch_budget: int | str = "256MiB",
        margin: float | str = "0.5ms",
        host_budget: int | str = "4GiB",
        pinned: bool = True,
        fallback: str = "pageable",
        watermark: float | None = None,
        hysteresis: float = 0.05,
        modules: nn.Module | Iterable[nn.Module] | None = None,
        exclude: nn.Module | Iterable[nn.Module] | None = None,
        schedule: Scheduler | None = None,
        trace: bool = False,
        record: bool = False,
        **unknown: Any,
    ) -> OffloadPolicy:
        if unknown:
            raise ConfigurationError(
                f"unknown offload option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, sorted(unknown)))}; "
                f"the known options are {', '.join(KNOWN_OPTIONS)}"
            )
        if prefetch not in PREFETCH_MODES:
            raise ConfigurationError(
                f"prefetch={prefetch!r} is not a prefetch mode: use 'deadline' (start each reload by its "
                "predicted need time) or 'on_demand' (reload when backward asks)"
            )
        if fallback not in FALLBACKS:
            raise ConfigurationError(
                f"fallback={fallback!r} is not a host-budget fallback: use 'pageable' (copy to ordinary host "
                "memory) or 'keep' (leave the tensor on the device)"
            )
        for name, flag in (("pinned", pinned), ("trace", trace), ("record", record)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"{name} must be True or False, got {flag!r}")
        if watermark is not None:
            if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 < watermark < 1:
                raise ConfigurationError(
                    f"watermark={watermark!r}: give a fraction of device capacity in (0, 1), e.g. 0.2 to offload "
                    "only while less than 20% of device memory is free; or None to offload always"
                )
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
            raise ConfigurationError(f"hysteresis={hysteresis!r}: give a fraction of capacity in [0, 1)")
        if watermark is not None and watermark + hysteresis > 1:
            raise ConfigurationError(
                f"watermark + hysteresis = {watermark + hysteresis:g} exceeds 1: offloading could never stop"
            )
        if schedule is not None and not isinstance(schedule, Scheduler):
            raise ConfigurationError(
                f"schedule must be an offcore.scheduler.Scheduler (reused across steps), got {type(schedule).__name__}"
            )
        return cls(
            min_bytes=parse_size(min_bytes, what="min_bytes", allow_zero=True),
            prefetch=prefetch,
            prefetch_budget=parse_size(prefetch_budget, what="prefetch_budget", allow_zero=True),
            margin=parse_duration(margin, what="prefetch margin"),
            host_budget=parse_size(host_budget, what="host_budget"),
            pinned=pinned,
            fallback=fallback,
            watermark=None if watermark is None else float(watermark),
            hysteresis=float(hysteresis),
            modules=_modules(modules, "modules"),
            exclude=_modules(exclude, "exclude"),
            schedule=schedule,
            trace=trace,
            record=record,
        )


#: The keyword arguments :meth:`OffloadPolicy.parse` (and so ``offload_activations``) accepts.
KNOWN_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(OffloadPolicy))
