"""Sizes, bandwidths and durations: round trips and clear rejection of nonsense."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import offcore  # noqa: E402
from offcore.units import format_bandwidth, format_bytes, parse_bandwidth, parse_duration, parse_size  # noqa: E402

IEC = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
SI = {"kB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}


@given(st.integers(min_value=1, max_value=2**62))
def test_integer_sizes_are_bytes(nbytes: int) -> None:
    assert parse_size(nbytes) == nbytes
    assert parse_size(str(nbytes)) == nbytes
    assert parse_size(f"{nbytes}B") == nbytes


@given(st.integers(min_value=1, max_value=2**20), st.sampled_from(sorted({**IEC, **SI}.items())))
def test_size_with_unit_round_trips(count: int, unit: tuple[str, int]) -> None:
    name, factor = unit
    assert parse_size(f"{count}{name}") == count * factor
    assert parse_size(f" {count} {name[:-1].lower()}B ") == count * factor  # spaces and the prefix's case are forgiven


@given(st.integers(min_value=1, max_value=2**50))
def test_format_bytes_is_the_value_to_two_decimals(nbytes: int) -> None:
    number, unit = format_bytes(nbytes).split()
    if unit == "B":
        assert int(number) == nbytes < 1024
    else:
        assert 1 <= float(number) < 1024 or unit == "TiB"
        # exact decimal arithmetic: a value on a rounding boundary (54144 B = 52.875 KiB -> '52.88') is off by exactly
        # half a unit of the last digit, which floats overshoot by an ulp
        assert abs(Fraction(number) * IEC[unit] - nbytes) <= Fraction(5, 1000) * IEC[unit]


@given(st.floats(min_value=1e-3, max_value=1e13, allow_nan=False), st.sampled_from(["B", "KiB", "MB", "GiB"]))
def test_bandwidth_round_trips(rate: float, unit: str) -> None:
    factor = {"B": 1, "KiB": 1024, "MB": 1e6, "GiB": 1024**3}[unit]
    text = f"{rate!r}{unit}/s"
    assert parse_bandwidth(text) == pytest.approx(rate * factor, rel=1e-12)
    assert parse_bandwidth(rate) == rate


def test_documented_figures() -> None:
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("0.5KiB") == 512
    assert parse_bandwidth("32GiB/s") == 32 * 2**30
    # the design's worked number: 256 MiB at 32 GiB/s takes 7.8125 ms
    assert parse_size("256MiB") / parse_bandwidth("32GiB/s") * 1e3 == 7.8125
    assert parse_bandwidth("inf") == math.inf and format_bandwidth(math.inf) == "unlimited"
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(512) == "512 B"
    assert format_bandwidth(32 * 2**30) == "32.00 GiB/s"
    assert parse_duration("10us") == pytest.approx(1e-5)
    assert parse_duration("2ms") == pytest.approx(2e-3)
    assert parse_duration(0) == 0.0


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.sampled_from(["s", "ms", "us", "ns"]))
def test_durations_round_trip(value: float, unit: str) -> None:
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
    assert parse_duration(f"{value!r}{unit}") == pytest.approx(value * scale)


@pytest.mark.parametrize(
    "value",
    [
        "-1",
        -1,
        0,
        "0",
        "0MiB",
        "abc",
        "",
        "   ",
        True,
        False,
        "1.5",
        "64 MiB MiB",
        "12XB",
        "1e400",
        "1e999999999",
        1.5,
        math.inf,
        None,
        [1],
    ],
)
def test_nonsense_sizes_are_rejected_naming_the_value(value: object) -> None:
    with pytest.raises(offcore.ConfigurationError) as caught:
        parse_size(value)  # type: ignore[arg-type]
    message = str(caught.value)
    assert repr(value) in message or type(value).__name__ in message, message


def test_zero_size_only_when_allowed() -> None:
    assert parse_size(0, allow_zero=True) == 0
    assert parse_size("0GiB", allow_zero=True) == 0


def test_numpy_integers_are_sizes() -> None:
    import numpy as np

    assert parse_size(np.int64(4096)) == 4096
    with pytest.raises(offcore.ConfigurationError):
        parse_size(np.int64(-1))


@pytest.mark.parametrize(
    "value",
    [
        "64MB/s/s",
        "-1",
        "-1GB/s",
        0,
        "0/s",
        "0GiB/s",
        "abc",
        "32GiB",
        "/s",
        "GiB/s",
        True,
        float("nan"),
        -5.0,
        None,
        "1e400GB/s",
    ],
)
def test_nonsense_bandwidths_are_rejected_naming_the_value(value: object) -> None:
    with pytest.raises(offcore.ConfigurationError) as caught:
        parse_bandwidth(value)  # type: ignore[arg-type]
    message = str(caught.value)
    assert repr(value) in message or type(value).__name__ in message, message


@pytest.mark.parametrize("value", ["-1", -1, "5min", "abc", True, math.inf, math.nan, "1e400s", None])
def test_nonsense_durations_are_rejected_naming_the_value(value: object) -> None:
    with pytest.raises(offcore.ConfigurationError) as caught:
        parse_duration(value)  # type: ignore[arg-type]
    assert repr(value) in str(caught.value) or type(value).__name__ in str(caught.value)


def test_what_names_the_setting_in_the_message() -> None:
    with pytest.raises(offcore.ConfigurationError, match="device capacity"):
        parse_size("-3GiB", what="device capacity")


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("10Gb/s", 10e9 / 8),
        ("10Gbit/s", 10e9 / 8),
        ("10Gbits/s", 10e9 / 8),
        ("10Gbps", 10e9 / 8),
        ("10 gb/s", 10e9 / 8),
        ("100Mbps", 100e6 / 8),
        ("1kb/s", 125.0),
        ("8b/s", 1.0),
        ("8bps", 1.0),
        ("1Gib/s", 2**30 / 8),
        ("10GB/s", 10e9),
        ("10GBps", 10e9),
        ("10gB/s", 10e9),
        ("10GiB/s", 10 * 2**30),
        ("10B/s", 10.0),
        ("10Bps", 10.0),
        ("10G/s", 10e9),
    ],
)
def test_bandwidths_tell_bits_from_bytes(text: str, rate: float) -> None:
    assert parse_bandwidth(text) == rate


@pytest.mark.parametrize(
    ("text", "spelling"), [("64Mb", "'64MB'"), ("64mb", "'64MB'"), ("1Gibit", "'1GiB'"), ("512b", "'512B'")]
)
def test_sizes_in_bits_are_refused_with_the_byte_spelling(text: str, spelling: str) -> None:
    with pytest.raises(offcore.ConfigurationError, match="in bits") as caught:
        parse_size(text, what="capacity")
    assert repr(text) in str(caught.value) and spelling in str(caught.value)


@pytest.mark.parametrize("value", ["10Gi/s", "10iB/s", "10Gbyte/s", "10Gbpss", "10GB/ps"])
def test_malformed_bit_and_byte_units_are_refused(value: str) -> None:
    with pytest.raises(offcore.ConfigurationError, match=re.escape(repr(value))):
        parse_bandwidth(value)


@pytest.mark.parametrize(
    ("parse", "value"),
    [
        (parse_bandwidth, 10**400),
        (parse_bandwidth, 10**5000),
        (parse_duration, 10**400),
        (parse_size, 10**400),
        (parse_size, -(10**5000)),
        (parse_size, "1" * 5000 + "MiB"),
        (parse_bandwidth, "1" * 5000 + "GB/s"),
    ],
    ids=[
        "bandwidth 10**400",
        "bandwidth 10**5000",
        "duration 10**400",
        "size 10**400",
        "size -10**5000",
        "size of 5000 digits",
        "bandwidth of 5000 digits",
    ],
)
def test_huge_values_are_configuration_errors_with_a_short_message(parse: object, value: object) -> None:
    with pytest.raises(offcore.ConfigurationError) as caught:
        parse(value)  # type: ignore[operator]
    assert len(str(caught.value)) < 300, "the value is abbreviated, not printed in full"
    assert "large" in str(caught.value) or "range" in str(caught.value) or "positive" in str(caught.value)


def test_huge_device_settings_are_configuration_errors() -> None:
    for option in ("h2d_bandwidth", "latency"):
        with pytest.raises(offcore.ConfigurationError, match="too large"):
            offcore.device("cpu", **{option: 10**400})
