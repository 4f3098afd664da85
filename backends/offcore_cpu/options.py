"""The fake device's settings, parsed and checked once.

>>> from offcore_cpu.options import FakeDeviceOptions
>>> opts = FakeDeviceOptions.parse(capacity="2GiB", h2d_bandwidth="32GiB/s", latency="10us", buffers="numpy")
>>> opts.capacity, opts.h2d_bandwidth, round(opts.latency * 1e6, 6)
(2147483648, 34359738368.0, 10.0)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from offcore.errors import ConfigurationError
from offcore.units import parse_bandwidth, parse_duration, parse_size

__all__ = [
    "FakeDeviceOptions",
    "BufferFamily",
    "FaultMode",
    "torch_importable",
    "numpy_importable",
    "parse_fail_copy",
    "parse_fault_mode",
]

BufferFamily = Literal["torch", "numpy"]
FaultMode = Literal["submit", "stream"]


def torch_importable() -> bool:
    """True when torch is installed (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def numpy_importable() -> bool:
    return importlib.util.find_spec("numpy") is not None


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def parse_fail_copy(value: Any, what: str = "fail_copy") -> int | None:
    """The copy number a fault is injected at: a positive int, or None for none (``None`` and 0 disable)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"{what} must be a non-negative integer (the 1-based number of the copy_ call that fails; "
            f"None or 0: none), got {value!r}"
        )
    return value or None


def parse_fault_mode(value: Any, what: str = "fail_copy_mode") -> FaultMode:
    """``"submit"`` (copy_ raises, nothing is enqueued) or ``"stream"`` (the copy fails on its stream)."""
    if not isinstance(value, str) or value not in ("submit", "stream"):
        raise ConfigurationError(
            f"{what} must be 'submit' (copy_ raises at once) or 'stream' (the copy fails on its stream), got {value!r}"
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class FakeDeviceOptions:
    """Parsed options of ``offcore.device("cpu", ...)``; see ``docs/cpu-device.md``."""

    capacity: int = 2 * 1024**3
    h2d_bandwidth: float = 32 * 1024**3
    d2h_bandwidth: float = 32 * 1024**3
    latency: float = 10e-6
    duplex: bool = True
    sanitize: bool = False
    check_ops: bool = True  # with sanitize and torch buffers: Note [Operators checked against copies in flight]
    seed: int = 0
    jitter: float = 2e-3
    buffers: BufferFamily = "numpy"
    fail_copy: int | None = None
    fail_copy_mode: FaultMode = "submit"
    copy_log_limit: int = 4096
    accounting: str = "auto"  # torch buffers: "auto", "allocator" or "dispatch" (tracking.py)

    @classmethod
    def parse(
        cls,
        *,
        capacity: int | str = "2GiB",
        h2d_bandwidth: float | str = "32GiB/s",
        d2h_bandwidth: float | str = "32GiB/s",
        latency: float | str = "10us",
        duplex: bool = True,
        sanitize: bool = False,
        check_ops: bool = True,
        seed: int = 0,
        jitter: float | str = "2ms",
        buffers: str | None = None,
        fail_copy: int | None = None,
        fail_copy_mode: str = "submit",
        copy_log_limit: int = 4096,
        accounting: str = "auto",
        **unknown: Any,
    ) -> FakeDeviceOptions:
        """Check every option; raises :class:`offcore.ConfigurationError` naming the bad one."""
        if unknown:
            known = (
                "capacity, h2d_bandwidth, d2h_bandwidth, latency, duplex, sanitize, check_ops, seed, jitter, buffers, "
                "fail_copy, fail_copy_mode, copy_log_limit, accounting"
            )
            raise ConfigurationError(f"unknown option(s) {sorted(unknown)} for the cpu fake device; known: {known}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigurationError(f"seed must be an integer, got {seed!r}")
        if isinstance(copy_log_limit, bool) or not isinstance(copy_log_limit, int) or copy_log_limit < 0:
            raise ConfigurationError(
                f"copy_log_limit must be a non-negative integer (how many of the latest copies "
                f"dev.copy_log() keeps; 0: none), got {copy_log_limit!r}"
            )
        if accounting not in ("auto", "allocator", "dispatch"):
            raise ConfigurationError(
                "accounting must be 'auto' (the allocator hook where it builds), 'allocator' (count in torch's "
                f"CPU allocator) or 'dispatch' (count in a Python dispatch mode: the reference), got {accounting!r}"
            )
        if buffers is None:
            buffers = "torch" if torch_importable() else "numpy"
        if buffers not in ("torch", "numpy"):
            raise ConfigurationError(f"buffers must be 'torch' or 'numpy', got {buffers!r}")
        if buffers == "torch" and not torch_importable():
            raise ConfigurationError(
                "buffers='torch' needs torch installed (pip install 'offcore[torch]'); or use 'numpy'"
            )
        return cls(
            capacity=parse_size(capacity, what="fake device capacity"),
            h2d_bandwidth=parse_bandwidth(h2d_bandwidth, what="h2d_bandwidth"),
            d2h_bandwidth=parse_bandwidth(d2h_bandwidth, what="d2h_bandwidth"),
            latency=parse_duration(latency, what="copy latency"),
            duplex=_flag(duplex, "duplex"),
            sanitize=_flag(sanitize, "sanitize"),
            check_ops=_flag(check_ops, "check_ops"),
            seed=seed,
            jitter=parse_duration(jitter, what="sanitizer jitter"),
            buffers=buffers,  # type: ignore[arg-type]
            fail_copy=parse_fail_copy(fail_copy),
            fail_copy_mode=parse_fault_mode(fail_copy_mode),
            copy_log_limit=copy_log_limit,
            accounting=accounting,
        )
