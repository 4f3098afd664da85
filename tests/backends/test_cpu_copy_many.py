"""The fake device's ``copy_many``: ``copy_`` of each pair, queued as one work item (Note [A batch of
copies is one work item] in backends/offcore_cpu/copying.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from offcore import ConfigurationError, Direction, Tier

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


def _pairs(dev: Any, torch: Any, sizes: list[int]) -> list[tuple[Any, Any]]:
    """(device buffer, host buffer) per size; the host side holds distinct bytes."""
    pairs = []
    for i, n in enumerate(sizes):
        host = dev.allocate(n, Tier.PINNED)
        host.copy_(torch.arange(n, dtype=torch.int64).remainder(251).add(i).to(torch.uint8))
        pairs.append((dev.allocate(n, Tier.DEVICE), host))
    return pairs


def test_copy_many_copies_each_pair_numbers_ledgers_and_logs_each(make_device: Any, torch: Any) -> None:
    dev = make_device(buffers="torch", h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s", latency="20us")
    stream = dev.new_stream()
    pairs = _pairs(dev, torch, [2 * MiB, 3 * KiB, 2 * MiB])  # the first is too large to run inline
    before = dev.ledger.copies[Direction.H2D].copies
    done = dev.copy_many(pairs, stream=stream)
    done.synchronize()
    for device, host in pairs:
        assert torch.equal(device, host)
    assert dev.ledger.copies[Direction.H2D].copies == before + 3
    log = [e for e in dev.copy_log() if e["stream"] == stream.name]
    assert [e["bytes"] for e in log] == [2 * MiB, 3 * KiB, 2 * MiB]  # in order
    assert [e["number"] for e in log] == sorted(e["number"] for e in log)
    assert len({e["number"] for e in log}) == 3
    for earlier, later in zip(log, log[1:], strict=False):  # each pays the link on its own, one after another
        assert earlier["end"] <= later["start"]
        assert later["end"] - later["start"] >= later["emulated_seconds"] * 0.99


def test_copy_many_is_one_work_item_on_a_busy_stream(make_device: Any, torch: Any) -> None:
    dev = make_device(buffers="torch", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    stream = dev.new_stream()
    pairs = _pairs(dev, torch, [4 * KiB, 8 * KiB, 2 * MiB])
    gate = threading.Event()
    stream.launch_host_func(gate.wait)  # the stream is busy: nothing runs inline
    try:
        pending = stream._state.pending
        done = dev.copy_many(pairs, stream=stream)
        assert stream._state.pending == pending + 1
        assert not done.query()
    finally:
        gate.set()
    done.synchronize()
    for device, host in pairs:
        assert torch.equal(device, host)


def test_leading_small_copies_run_inline_on_an_idle_stream(make_device: Any, torch: Any) -> None:
    dev = make_device(buffers="torch", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    stream = dev.new_stream()
    small = _pairs(dev, torch, [4 * KiB, 8 * KiB])
    dev.copy_many(small, stream=stream)
    assert stream._state.pending == 0  # both ran on the calling thread
    for device, host in small:
        assert torch.equal(device, host)
    mixed = _pairs(dev, torch, [4 * KiB, 2 * MiB])
    done = dev.copy_many(mixed, stream=stream)
    assert torch.equal(mixed[0][0], mixed[0][1])  # the small one already landed its bytes
    done.synchronize()
    assert torch.equal(mixed[1][0], mixed[1][1])


@pytest.mark.parametrize("setting", ["sanitize", "fault", "compute", "gate"])
def test_what_copy_treats_specially_goes_through_copy(make_device: Any, torch: Any, setting: str) -> None:
    dev = make_device(
        buffers="torch", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0, sanitize=setting == "sanitize"
    )
    stream = dev.current_stream() if setting == "compute" else dev.new_stream()
    pairs = _pairs(dev, torch, [4 * KiB, 2 * MiB])
    if setting == "fault":
        dev.inject_copy_fault(2)  # the second copy of the batch fails at submit, as copy_'s would
        with pytest.raises(Exception, match="fault injected"):
            dev.copy_many(pairs, stream=stream)
        stream.synchronize()
        assert torch.equal(pairs[0][0], pairs[0][1])  # the first one was made
        return
    if setting == "gate":
        with dev.gate(stream) as gate:
            done = dev.copy_many(pairs, stream=stream)
            gate.wait_held(1)  # held by the gate, as copy_'s copies are
        done.synchronize()
    else:
        dev.copy_many(pairs, stream=stream).synchronize()
    for device, host in pairs:
        assert torch.equal(device, host)
    if setting == "sanitize":
        dev.check_sanitizer()


def test_copy_many_refuses_what_copy_refuses(make_device: Any, torch: Any) -> None:
    dev = make_device(buffers="torch", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    stream = dev.new_stream()
    with pytest.raises(ConfigurationError, match="at least one"):
        dev.copy_many([], stream=stream)
    a, b = dev.allocate(4 * KiB, Tier.DEVICE), dev.allocate(8 * KiB, Tier.PINNED)
    ok = _pairs(dev, torch, [4 * KiB])[0]
    with pytest.raises(ConfigurationError, match="different sizes"):
        dev.copy_many([ok, (a, b)], stream=stream)
