"""offcore.bandwidth (measure_copy_bandwidth, measure_link, fit_link) on the synchronous reference backend (any backend works)."""

from __future__ import annotations

import math

import pytest
from reference_backend import ReferenceBackend

import offcore
from offcore.bandwidth import LinkMeasurement, LinkProbe, fit_link, measure_copy_bandwidth, measure_link


class CountingBackend(ReferenceBackend):
    """Counts copies per direction, to show what the probe enqueues."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.copies: list[tuple[bool, bool, int]] = []

    def copy_(self, dst, src, *, stream):  # type: ignore[no-untyped-def]
        self.copies.append((self.holds(src), self.holds(dst), dst.nbytes))
        return super().copy_(dst, src, stream=stream)


def test_one_probe_per_size_with_positive_rates() -> None:
    backend = CountingBackend(capacity="8MiB")
    probes = measure_copy_bandwidth(backend, ["64KiB", 2**20], repeat=2)
    assert [p.size_bytes for p in probes] == [64 * 1024, 2**20]
    for probe in probes:
        assert isinstance(probe, LinkProbe) and probe.timing == "events"
        for rate in (probe.h2d, probe.d2h, probe.both_h2d, probe.both_d2h):
            assert rate > 0 and not math.isnan(rate)
        assert set(probe.as_dict()) == {"size_bytes", "h2d", "d2h", "both_h2d", "both_d2h", "timing"}
    # per size: 2 warm-up copies, then per repeat 2 alone + 2 together, half of them each way
    h2d = [c for c in backend.copies if not c[0] and c[1]]
    d2h = [c for c in backend.copies if c[0] and not c[1]]
    assert len(h2d) == len(d2h) == 2 * (1 + 2 * 2)
    assert backend.memory_stats().allocated_bytes == 0, "probe buffers are freed"


def test_host_clock_when_the_backend_has_no_timing_events() -> None:
    class NoTiming(ReferenceBackend):
        capabilities = frozenset({offcore.Capability.NUMPY})

    (probe,) = measure_copy_bandwidth(NoTiming(), ["256KiB"], repeat=1)
    assert probe.timing == "host clock" and probe.h2d > 0


def test_sizes_that_do_not_fit_the_device_are_refused_up_front() -> None:
    with pytest.raises(offcore.CapacityExceededError, match="choose smaller sizes"):
        measure_copy_bandwidth(ReferenceBackend(capacity="1MiB"), ["1MiB"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"repeat": 0}, "repeat"), ({"sizes": ["-1"]}, "'-1'"), ({"host_tier": offcore.Tier.DEVICE}, "host_tier")],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    arguments = {"sizes": ["64KiB"], **kwargs}
    with pytest.raises(offcore.ConfigurationError, match=match):
        measure_copy_bandwidth(ReferenceBackend(), **arguments)


def test_measure_link_fits_latency_and_bandwidth_over_the_two_largest_sizes() -> None:
    backend = CountingBackend(capacity="64MiB")
    link = measure_link(backend, min_bytes="64KiB", max_bytes="1MiB", target_s=10.0, repeats=1)
    assert isinstance(link, LinkMeasurement)
    assert link.sizes == (64 * 1024, 256 * 1024, 2**20), "x4 from min_bytes up to max_bytes"
    assert link.d2h_bandwidth > 0 and link.h2d_bandwidth > 0 and link.latency_s >= 0
    assert backend.memory_stats().allocated_bytes == 0, "the measurement's buffers are freed"
    assert link.to_dict()["sizes"] == list(link.sizes)


def test_fit_link_is_the_two_point_line_and_falls_back_to_the_ratio() -> None:
    bandwidth, latency = fit_link([(2**20, 1e-4 + 2**20 / 2e9), (2**22, 1e-4 + 2**22 / 2e9)])
    assert bandwidth == pytest.approx(2e9) and latency == pytest.approx(1e-4)
    assert fit_link([(2**20, 1e-3)]) == (pytest.approx(2**20 / 1e-3), 0.0)
    assert fit_link([(2**20, 2e-3), (2**22, 1e-3)]) == (pytest.approx((2**20 + 2**22) / 3e-3), 0.0)
    assert fit_link([(2**20, 0.0)]) == (math.inf, 0.0), "nothing measurable: faster than the clock"


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"repeats": 0}, "repeats"), ({"min_bytes": "1MiB", "max_bytes": "64KiB"}, "max_bytes")]
)
def test_measure_link_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(offcore.ConfigurationError, match=match):
        measure_link(ReferenceBackend(), **kwargs)
