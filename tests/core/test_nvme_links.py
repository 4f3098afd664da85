"""The NVMe tier's directions in the ledger and the trace, and its measured links (no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from offcore.bandwidth import NvmeLinkMeasurement, measure_nvme_link
from offcore.errors import ConfigurationError
from offcore.kinds import Direction, Kind, Tier
from offcore.ledger import Ledger
from offcore.nvme import NvmeSpec, NvmeTier
from offcore.trace import TraceRecorder


def test_directions_between_host_and_nvme_and_no_single_hop_to_the_device() -> None:
    assert Direction.between(Tier.PINNED, Tier.NVME) is Direction.H2N
    assert Direction.between(Tier.NVME, Tier.PAGEABLE) is Direction.N2H
    assert Direction.H2N.is_nvme and Direction.N2H.is_nvme and not Direction.H2D.is_nvme
    assert Direction.between(Tier.DEVICE, Tier.PINNED) is Direction.D2H  # unchanged
    for src, dst in ((Tier.NVME, Tier.DEVICE), (Tier.DEVICE, Tier.NVME), (Tier.NVME, Tier.NVME)):
        with pytest.raises(ConfigurationError, match="two hops|n2h then h2d|only to and from host"):
            Direction.between(src, dst)


def test_reads_and_writes_are_copies_in_the_ledger_and_spans_in_the_trace(tmp_path: Path) -> None:
    ledger, trace = Ledger(), TraceRecorder()
    with NvmeTier(tmp_path, budget="1MiB", ledger=ledger, trace=trace) as tier:
        for key, n in (("a", 1000), ("b", 3000)):
            tier.write(key, np.ones(n, np.uint8), kind=Kind.PARAMETER).synchronize()
        out = np.empty(3000, np.uint8)
        tier.read("b", out).synchronize()
        h2n, n2h = ledger.copies[Direction.H2N], ledger.copies[Direction.N2H]
        assert (h2n.copies, h2n.bytes, n2h.copies, n2h.bytes) == (2, 4000, 1, 3000)
        assert h2n.seconds > 0 and n2h.seconds > 0 and h2n.timed_bytes == 4000
        assert ledger.snapshot()["copies"]["n2h"]["bytes"] == 3000
        assert Direction.D2H not in ledger.copies  # the device's directions stay the device's
    events = trace.to_dict()["traceEvents"]
    spans = [(e["cat"], e["name"], e["args"]["nbytes"]) for e in events if e["ph"] == "X"]
    assert spans == [("h2n", "a", 1000), ("h2n", "b", 3000), ("n2h", "b", 3000)]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"h2n", "n2h"} <= tracks


def test_a_failed_transfer_is_not_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    ledger = Ledger()

    def broken(*args: object) -> int:
        raise OSError(errno.EIO, "injected")

    with NvmeTier(tmp_path, budget="1MiB", ledger=ledger) as tier:
        monkeypatch.setattr(os, "pwritev", broken)
        with pytest.raises(OSError):
            tier.write("x", np.ones(100, np.uint8)).synchronize()
    assert Direction.H2N not in ledger.copies


def test_spec_passes_the_ledger_and_trace(tmp_path: Path) -> None:
    ledger, trace = Ledger(), TraceRecorder()
    tier = NvmeSpec(str(tmp_path), budget="1MiB").open(ledger=ledger, trace=trace)
    try:
        tier.write("k", np.zeros(10)).synchronize()
    finally:
        tier.close()
    assert ledger.copies[Direction.H2N].bytes == 80 and len(trace) == 1


def test_measure_nvme_link_fits_both_directions_and_feeds_the_tiers_links(tmp_path: Path) -> None:
    ledger = Ledger()
    with NvmeTier(tmp_path, budget="8MiB", ledger=ledger) as tier:
        link = measure_nvme_link(tier, min_bytes="64KiB", max_bytes="1MiB", target_s=10.0, repeats=2)
        assert isinstance(link, NvmeLinkMeasurement)
        assert link.sizes == (64 << 10, 256 << 10, 1 << 20)  # grew x4 up to max_bytes
        assert link.read_bandwidth > 0 and link.write_bandwidth > 0 and link.direct is tier.direct
        assert link.read_duration(1 << 20) > 0 and link.duration(Direction.H2N, 1 << 20) == link.write_duration(1 << 20)
        assert tier.read_link.samples == tier.write_link.samples == 6  # the tier's online links saw the probe
        assert len(tier) == 0 and tier.used_bytes == 0  # the probe's object is gone
        assert ledger.copies[Direction.N2H].copies == 6
        assert link.to_dict()["sizes"] == [64 << 10, 256 << 10, 1 << 20]
        with pytest.raises(ConfigurationError, match="n2h or h2n"):
            link.duration(Direction.H2D, 1)


def test_measure_nvme_link_stays_within_the_budget(tmp_path: Path) -> None:
    from offcore.errors import CapacityExceededError

    with NvmeTier(tmp_path, budget="300KiB") as tier:
        link = measure_nvme_link(tier, min_bytes="64KiB", max_bytes="64MiB", target_s=10.0, repeats=1)
        assert max(link.sizes) <= 300 << 10
        tier.write("big", np.zeros(250 << 10, np.uint8)).synchronize()
        with pytest.raises(CapacityExceededError, match="probing the NVMe tier"):
            measure_nvme_link(tier, min_bytes="64KiB")


def test_the_scheduler_stages_with_the_tiers_measured_read_link(tmp_path: Path) -> None:
    from offcore.residency import ResidencyScheduler
    from offcore.scheduler import Scheduler

    with NvmeTier(tmp_path, budget="4MiB") as tier:
        measure_nvme_link(tier, min_bytes="64KiB", max_bytes="256KiB", target_s=10.0, repeats=1)
        rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.001, stage_duration=tier.read_link.duration)
        rs.forward_began(0.0)
        rs.produced(0, 0.0)
        rs.register(0, Kind.ACTIVATION, 256 << 10)
        rs.offload_started(0, type("Done", (), {"query": lambda self: True})())
        rs.landed(0)
        rs.spilled(0)
        list(rs.forward_ended(0.001))
        assert rs.plan is not None
        assert rs.plan.stage_durations == {256 << 10: tier.read_link.duration(256 << 10)}
