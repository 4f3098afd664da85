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

Bits and bytes are told apart by the letter, as IEEE 1541 writes them: ``B`` is a
byte, ``b`` (or ``bit``, ``bits``) is a bit, whatever the case of the prefix (``kB``,
``KB`` and ``kiB`` are bytes; ``mb`` and ``Gib`` are bits). A bandwidth in bits is
divided by 8 -- ``"10Gb/s"``, ``"10Gbit/s"`` and ``"10Gbps"`` are 1.25 GB/s -- while
``"10GB/s"``, ``"10GBps"`` and ``"10GiB/s"`` are bytes::

    >>> parse_bandwidth("10Gb/s"), parse_bandwidth("10Gbps"), parse_bandwidth("10GB/s")
    (1250000000.0, 1250000000.0, 10000000000.0)

A size is a whole number of bytes, so a size written in bits (``"64Mb"``) is refused
with the byte spelling to use instead. A prefix alone (``"64M"``, ``"16G/s"``) and a
bare number mean bytes.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import re
from fractions import Fraction

from offcore.errors import ConfigurationError

__all__ = ["parse_size", "parse_bandwidth", "parse_duration", "format_bytes", "format_bandwidth"]

_PREFIXES = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

# prefix (any case), an optional binary 'i', then B (byte), b / bit / bits (bit) or nothing (bytes)
_UNIT = re.compile(r"^(?P<prefix>[kKmMgGtT]?)(?P<binary>[iI]?)(?P<base>B|b|[bB][iI][tT][sS]?|)$")

_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

_MAX_DIGITS = 60  # longer numbers are typos (and Fraction would build huge integers)

_MAX_SIZE = 2**63 - 1  # sizes are int64 in every framework offcore talks to

_MAX_BANDWIDTH = 1.7976931348623157e308  # float's largest

_BYTE_UNITS = "B, kB, MB, GB, TB, KiB, MiB, GiB or TiB"


def _show(value: object) -> str:
    """``repr(value)`` for an error message, shortened when huge (``repr`` of a 5000-digit int raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return (
            f"<{'a negative' if value < 0 else 'an'} integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
        )
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-10:]} ({len(text)} characters)"


def _byte_spelling(unit: str) -> str:
    """The byte unit a bit unit such as ``mb`` or ``Gibit`` stands next to (``MB``, ``GiB``)."""
    match = _UNIT.match(unit)
    prefix, binary = (match.group("prefix").lower(), match.group("binary")) if match else ("", "")
    if binary:
        return prefix.upper() + "iB"
    return {"": "", "k": "k", "m": "M", "g": "G", "t": "T"}[prefix] + "B"


def _unit(unit: str) -> tuple[int, bool] | None:
    """``(bytes or bits per unit, in bits?)`` of a unit such as ``GiB`` or ``Gb``; None if unknown."""
    match = _UNIT.match(unit)
    if match is None:
        return None
    prefix, binary, base = match.group("prefix", "binary", "base")
    if binary and not prefix:  # "iB"
        return None
    if binary and not base:  # "Gi": say GiB
        return None
    power = _PREFIXES[prefix.lower()]
    factor = (1024 if binary else 1000) ** power
    return factor, bool(base) and base != "B"


def _split(
    text: str, what: str, example: str, original: str | None = None, *, rate: bool = False
) -> tuple[Fraction, Fraction]:
    """Number and bytes-per-unit factor of ``text``; errors quote ``original`` (what the user wrote).

    With ``rate``, a bit unit (``Gb``, ``Gbit``) gives a factor of 1/8 of its byte unit;
    without, a bit unit is refused (sizes are whole bytes).
    """
    shown = _show(text if original is None else original)
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ConfigurationError(
            f"cannot read {what} {shown}: write a positive number with an optional unit, e.g. {example!r}"
        )
    number, unit = match.groups()
    parsed = _unit(unit)
    if parsed is None:
        bits = " (or in bits: kb, Mb, Gb, Gbit, with a lowercase b)" if rate else ""
        raise ConfigurationError(f"unknown unit {unit!r} in {what} {shown}: use {_BYTE_UNITS}{bits}")
    factor, in_bits = parsed
    if in_bits and not rate:
        byte_unit = _byte_spelling(unit)
        raise ConfigurationError(
            f"{what} {shown} is in bits (a lowercase 'b' is a bit, 'B' a byte); a size is a number of bytes: "
            f"write it with {byte_unit!r}, e.g. {number + byte_unit!r}"
        )
    digits, _, exponent = number.lower().partition("e")
    if len(digits) > _MAX_DIGITS or (exponent and abs(int(exponent)) > 30):
        raise ConfigurationError(f"{what} {shown} is out of range: write it with a unit, e.g. {example!r}")
    return Fraction(number), Fraction(factor, 8) if in_bits else Fraction(factor)  # exact: floats lose bytes


# Note [Texts are read once]
# offload_activations is called once per step, and its options are mostly the same strings every
# step ("64KiB", "256MiB", "0.5ms"); reading one (exact fractions, a regular expression) cost about
# 30 us, a third of a region's fixed cost. parse_size and parse_duration read a text once per
# (text, what) and reuse the result; a bad text raises each time (an exception is never cached),
# and the checks that depend on the caller (allow_zero, the limits) run on every call.
@functools.lru_cache(maxsize=256)
def _bytes_of_text(value: str, what: str) -> int:
    number, factor = _split(value, what, "64MiB")
    total = number * factor
    if total.denominator != 1:
        raise ConfigurationError(f"{what} {_show(value)} is not a whole number of bytes")
    return int(total)


@functools.lru_cache(maxsize=256)
def _seconds_of_text(value: str, what: str) -> float:
    match = re.match(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|ns)?\s*$", value)
    if match is None:
        raise ConfigurationError(f"cannot read {what} {_show(value)}: write e.g. '10us', '2ms' or '0.5s'")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1.0}[match.group(2)]
    return float(match.group(1)) * scale


def parse_size(value: int | str, *, what: str = "size", allow_zero: bool = False) -> int:
    """Return a size in bytes from an integer or a string such as ``"64MiB"``.

    Raises :class:`~offcore.ConfigurationError` for negative, zero (unless
    ``allow_zero``), fractional-byte or malformed values.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be a number of bytes or a string like '64MiB', not {_show(value)}")
    if isinstance(value, numbers.Integral):  # int, numpy integers
        nbytes = operator.index(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigurationError(f"{what} must be a whole number of bytes, got {_show(value)}")
        nbytes = int(value)
    elif isinstance(value, str):
        nbytes = _bytes_of_text(value, what)
    else:
        raise ConfigurationError(f"{what} must be an int or a string like '64MiB', not {type(value).__name__}")
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise ConfigurationError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, got {_show(value)}")
    if nbytes > _MAX_SIZE:
        raise ConfigurationError(f"{what} {_show(value)} is too large: at most {_MAX_SIZE} bytes (8 EiB)")
    return nbytes


def parse_bandwidth(value: int | float | str, *, what: str = "bandwidth") -> float:
    """Return a bandwidth in bytes per second from a number or a string like ``"32GiB/s"``.

    Strings are a size per second (``"32GiB/s"``, ``"53GB/s"``, ``"32GBps"``: bytes) or
    bits per second (``"100Gb/s"``, ``"100Gbit/s"``, ``"100Gbps"``: divided by 8); see
    the module doc. ``float("inf")`` or ``"inf"`` means unlimited (copies take no
    emulated time).

    Raises :class:`~offcore.ConfigurationError` for zero, negative, NaN, too large
    (``10**400``) or malformed values and unknown units.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be bytes per second or a string like '32GiB/s', not {_show(value)}")
    if isinstance(value, numbers.Real):  # int, float, numpy scalars
        try:
            rate = float(value)
        except OverflowError:  # an int beyond float's range, e.g. 10**400
            rate = math.inf
        if math.isinf(rate) and rate > 0 and not (isinstance(value, float) and math.isinf(value)):
            raise ConfigurationError(
                f"{what} {_show(value)} is too large: at most {_MAX_BANDWIDTH:g} bytes per second; "
                "pass float('inf') or 'inf' for an unlimited bandwidth"
            )
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() in ("inf", "unlimited"):
            return math.inf
        if text.count("/") == 0 and re.search(r"[bB]ps$", text):  # "10Gbps" (bits), "10GBps" (bytes)
            body = text[:-2]
        elif text.count("/") == 1 and text.lower().endswith("/s"):
            body = text[:-2]
        else:
            raise ConfigurationError(
                f"cannot read {what} {_show(value)}: write bytes per second or a size per second, e.g. '32GiB/s' "
                "(bytes) or '100Gb/s' (bits)"
            )
        number, factor = _split(body, what, "32GiB/s", original=value, rate=True)
        try:
            rate = float(number * factor)
        except OverflowError:
            rate = math.inf
        if math.isinf(rate):
            raise ConfigurationError(f"{what} {_show(value)} is too large; write 'inf' for an unlimited bandwidth")
    else:
        raise ConfigurationError(f"{what} must be a number or a string like '32GiB/s', not {type(value).__name__}")
    if math.isnan(rate) or rate <= 0:
        raise ConfigurationError(f"{what} must be positive, got {_show(value)}")
    return rate


def parse_duration(value: int | float | str, *, what: str = "duration") -> float:
    """Return seconds from a number (seconds) or a string such as ``"5us"``, ``"2ms"``, ``"1s"``."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be seconds or a string like '10us', not {_show(value)}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond float's range, e.g. 10**400
            raise ConfigurationError(f"{what} {_show(value)} is too large: give a finite time in seconds") from None
    elif isinstance(value, str):
        seconds = _seconds_of_text(value, what)
    else:
        raise ConfigurationError(f"{what} must be a number or a string like '10us', not {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigurationError(f"{what} must be a finite non-negative time, got {_show(value)}")
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
