"""Parsing and formatting of sizes and bandwidths.

Sizes accept integers (bytes) or strings with SI (``kB``, ``MB``, ``GB``, ``TB``: powers
of 1000) or IEC (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024) units. Bandwidths
accept integers or floats (bytes per second) or the same strings followed by ``/s``::

    >>> parse_size("64MiB")
    67108864
    >>> parse_bandwidth("32GiB/s")
    34359738368.0
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from fractions import Fraction

from offcore.errors import ConfigurationError

__all__ = ["parse_size", "parse_bandwidth", "parse_duration", "format_bytes", "format_bandwidth"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


_MAX_SIZE = 2**63 - 1  # sizes are int64 in every framework offcore talks to


def _split(text: str, what: str, example: str, original: str | None = None) -> tuple[Fraction, int]:
    """Number and unit factor of ``text``; errors quote ``original`` (what the user wrote)."""
    shown = text if original is None else original
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ConfigurationError(
            f"cannot read {what} {shown!r}: write a positive number with an optional unit, e.g. {example!r}"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigurationError(
            f"unknown unit {unit!r} in {what} {shown!r}: use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    exponent = number.lower().partition("e")[2]
    if exponent and abs(int(exponent)) > 30:  # also keeps Fraction from building a 10**huge integer
        raise ConfigurationError(f"{what} {shown!r} is out of range: write it with a unit, e.g. {example!r}")
    return Fraction(number), factor  # exact: floats lose bytes above 2**53


def parse_size(value: int | str, *, what: str = "size", allow_zero: bool = False) -> int:
    """Return a size in bytes from an integer or a string such as ``"64MiB"``.

    Raises :class:`~offcore.ConfigurationError` for negative, zero (unless
    ``allow_zero``), fractional-byte or malformed values.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be a number of bytes or a string like '64MiB', not {value!r}")
    if isinstance(value, numbers.Integral):  # int, numpy integers
        nbytes = operator.index(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigurationError(f"{what} must be a whole number of bytes, got {value!r}")
        nbytes = int(value)
    elif isinstance(value, str):
        number, factor = _split(value, what, "64MiB")
        total = number * factor
        if total.denominator != 1:
            raise ConfigurationError(f"{what} {value!r} is not a whole number of bytes")
        nbytes = int(total)
    else:
        raise ConfigurationError(f"{what} must be an int or a string like '64MiB', not {type(value).__name__}")
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise ConfigurationError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    if nbytes > _MAX_SIZE:
        raise ConfigurationError(f"{what} {value!r} is too large: at most {_MAX_SIZE} bytes (8 EiB)")
    return nbytes


def parse_bandwidth(value: int | float | str, *, what: str = "bandwidth") -> float:
    """Return a bandwidth in bytes per second from a number or a string like ``"32GiB/s"``.

    ``float("inf")`` or ``"inf"`` means unlimited (copies take no emulated time).
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be bytes per second or a string like '32GiB/s', not {value!r}")
    if isinstance(value, numbers.Real):  # int, float, numpy scalars
        rate = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() in ("inf", "unlimited"):
            return math.inf
        if text.count("/") != 1 or not text.lower().endswith("/s"):
            raise ConfigurationError(
                f"cannot read {what} {value!r}: write bytes per second or a size per second, e.g. '32GiB/s'"
            )
        number, factor = _split(text[:-2], what, "32GiB/s", original=value)
        try:
            rate = float(number * factor)
        except OverflowError:
            rate = math.inf
        if math.isinf(rate):
            raise ConfigurationError(f"{what} {value!r} is too large; write 'inf' for an unlimited bandwidth")
    else:
        raise ConfigurationError(f"{what} must be a number or a string like '32GiB/s', not {type(value).__name__}")
    if math.isnan(rate) or rate <= 0:
        raise ConfigurationError(f"{what} must be positive, got {value!r}")
    return rate


def parse_duration(value: int | float | str, *, what: str = "duration") -> float:
    """Return seconds from a number (seconds) or a string such as ``"5us"``, ``"2ms"``, ``"1s"``."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be seconds or a string like '10us', not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = re.match(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|ns)?\s*$", value)
        if match is None:
            raise ConfigurationError(f"cannot read {what} {value!r}: write e.g. '10us', '2ms' or '0.5s'")
        scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1.0}[match.group(2)]
        seconds = float(match.group(1)) * scale
    else:
        raise ConfigurationError(f"{what} must be a number or a string like '10us', not {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(f"{what} must be a finite non-negative time, got {value!r}")
    return seconds


def format_bytes(nbytes: float) -> str:
    """Format a byte count with IEC units (``'3.00 GiB'``)."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if round(value, 2) < 1024 or unit == "TiB":  # never '1024.00 GiB'
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bandwidth(rate: float) -> str:
    """Format bytes per second (``'32.00 GiB/s'``)."""
    if math.isinf(rate):
        return "unlimited"
    return f"{format_bytes(rate)}/s"
