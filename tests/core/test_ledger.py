"""Ledger: bytes per (tier, kind) with peaks, copies per direction, waits, per-step reset."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("hypothesis", reason="the property tests here need hypothesis (pip install offcore[test])")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import offcore  # noqa: E402
from offcore import Direction, Kind, Ledger, Tier  # noqa: E402


def test_bytes_and_peaks_per_tier_and_kind() -> None:
    ledger = Ledger()
    ledger.add(Tier.DEVICE, Kind.ACTIVATION, 300)
    ledger.add(Tier.DEVICE, Kind.PARAMETER, 100)
    ledger.add(Tier.PINNED, Kind.ACTIVATION, 50)
    ledger.remove(Tier.DEVICE, Kind.ACTIVATION, 200)
    assert ledger.bytes(Tier.DEVICE) == 200
    assert ledger.bytes(Tier.DEVICE, Kind.ACTIVATION) == 100
    assert ledger.bytes(Tier.PINNED) == 50
    assert ledger.peak(Tier.DEVICE) == 400
    assert ledger.peak(Tier.DEVICE, Kind.ACTIVATION) == 300
    assert ledger.peak(Tier.NVME) == 0 and ledger.bytes(Tier.NVME) == 0


def test_tier_peak_is_the_peak_of_the_sum_not_the_sum_of_peaks() -> None:
    ledger = Ledger()
    ledger.add(Tier.DEVICE, Kind.ACTIVATION, 100)
    ledger.remove(Tier.DEVICE, Kind.ACTIVATION, 100)
    ledger.add(Tier.DEVICE, Kind.GRADIENT, 100)
    assert ledger.peak(Tier.DEVICE) == 100
    assert ledger.peak(Tier.DEVICE, Kind.ACTIVATION) == ledger.peak(Tier.DEVICE, Kind.GRADIENT) == 100


def test_underflow_is_an_error() -> None:
    ledger = Ledger()
    ledger.add(Tier.PINNED, Kind.ACTIVATION, 10)
    with pytest.raises(offcore.IllegalTransitionError, match="matching add"):
        ledger.remove(Tier.PINNED, Kind.ACTIVATION, 11)
    assert ledger.bytes(Tier.PINNED) == 10


def test_copies_and_waits_and_bandwidth() -> None:
    ledger = Ledger()
    ledger.record_copy(Direction.D2H, 256 * 2**20, seconds=0.0078125)
    ledger.record_copy(Direction.D2H, 256 * 2**20, seconds=0.0078125)
    ledger.record_copy(Direction.H2D, 1024)
    ledger.record_wait(0.002, what="layer3.attn")
    ledger.record_wait(0.001, what="layer3.attn")
    ledger.record_wait(0.004)
    d2h = ledger.copies[Direction.D2H]
    assert (d2h.bytes, d2h.copies) == (512 * 2**20, 2)
    assert d2h.bandwidth == 32 * 2**30  # the design's 32 GiB/s
    assert ledger.copies[Direction.H2D].bandwidth == 0.0  # untimed
    assert ledger.wait_seconds == pytest.approx(0.007)
    assert ledger.waits == {"layer3.attn": pytest.approx(0.003)}


def test_reset_step_restarts_peaks_from_the_current_level_and_clears_totals() -> None:
    ledger = Ledger()
    ledger.add(Tier.DEVICE, Kind.ACTIVATION, 1000)
    ledger.remove(Tier.DEVICE, Kind.ACTIVATION, 900)
    ledger.record_copy(Direction.D2H, 900, seconds=1.0)
    ledger.record_wait(0.5, what="x")
    ledger.reset_step()
    assert ledger.peak(Tier.DEVICE) == 100 and ledger.peak(Tier.DEVICE, Kind.ACTIVATION) == 100
    assert ledger.bytes(Tier.DEVICE) == 100
    assert not ledger.copies and ledger.wait_seconds == 0.0 and not ledger.waits
    ledger.add(Tier.DEVICE, Kind.ACTIVATION, 50)
    assert ledger.peak(Tier.DEVICE) == 150


def test_snapshot_is_json_ready() -> None:
    ledger = Ledger()
    ledger.add(Tier.PINNED, Kind.OPTIMIZER_STATE, 800_000_000)
    ledger.record_copy(Direction.H2D, 10, seconds=0.5)
    snapshot = json.loads(json.dumps(ledger.snapshot()))
    assert snapshot["bytes"]["pinned"]["optimizer_state"] == 800_000_000
    assert snapshot["peak_bytes"]["pinned"] == 800_000_000
    assert snapshot["copies"]["h2d"] == {"bytes": 10, "seconds": 0.5, "copies": 1, "bandwidth": 20.0}


@given(st.lists(st.tuples(st.sampled_from(list(Kind)), st.integers(1, 10**6), st.booleans()), max_size=40))
def test_books_match_a_replay(events: list[tuple[Kind, int, bool]]) -> None:
    ledger = Ledger()
    held: dict[Kind, int] = dict.fromkeys(Kind, 0)
    peak_total = 0
    for kind, nbytes, remove in events:
        if remove and held[kind] >= nbytes:
            ledger.remove(Tier.DEVICE, kind, nbytes)
            held[kind] -= nbytes
        else:
            ledger.add(Tier.DEVICE, kind, nbytes)
            held[kind] += nbytes
        peak_total = max(peak_total, sum(held.values()))
    assert ledger.bytes(Tier.DEVICE) == sum(held.values())
    assert ledger.peak(Tier.DEVICE) == peak_total
    for kind in Kind:
        assert ledger.bytes(Tier.DEVICE, kind) == held[kind]


def test_concurrent_recording_loses_nothing() -> None:
    ledger = Ledger()

    def work() -> None:
        for _ in range(2000):
            ledger.add(Tier.PINNED, Kind.ACTIVATION, 1)
            ledger.record_copy(Direction.D2H, 1, seconds=1e-6)
            ledger.remove(Tier.PINNED, Kind.ACTIVATION, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.copies[Direction.D2H].copies == 8000
    assert ledger.bytes(Tier.PINNED) == 0
    assert 1 <= ledger.peak(Tier.PINNED) <= 4
