"""Detailed tests of the CPU fake device (``offcore_cpu``); the shared conformance suite runs separately.

Numpy-only tests come first (``buffers="numpy"``, they run under ``tox -e core``);
torch tests skip when torch is not installed. No test asserts a wall-clock duration:
ordering is made deterministic with gates (``launch_host_func(gate.wait)``, set in a
``finally`` so that a failing test never leaves a stream blocked) and events.
"""

from __future__ import annotations

import contextlib
import gc
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from offcore_cpu.device import FakeDevice
from offcore_cpu.errors import EventNotReadyError, FakeDeviceOutOfMemoryError, StreamWorkError
from offcore_cpu.link import Link

import offcore
from offcore import Capability, CapacityExceededError, ConfigurationError, Direction, Tier

MiB = 1 << 20


@pytest.fixture
def ndev(make_device: Any) -> FakeDevice:
    """A numpy-buffer fake device with a fast link."""
    return make_device(capacity="64MiB", buffers="numpy", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.fixture
def tdev(make_device: Any, torch: Any) -> FakeDevice:
    """A torch-buffer fake device with a fast link."""
    return make_device(capacity="64MiB", buffers="torch", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)


@contextlib.contextmanager
def _gate(stream: Any) -> Iterator[threading.Event]:
    """Block ``stream`` until the gate is set (deterministic 'copy has not landed yet').

    Set in ``finally``: a failing test never leaves the stream blocked (closing the device
    would then wait forever)."""
    gate = threading.Event()
    stream.launch_host_func(gate.wait)
    try:
        yield gate
    finally:
        gate.set()


# ============================================================================ registry and options


def test_device_comes_from_the_registry_and_satisfies_the_protocol(ndev: FakeDevice) -> None:
    assert isinstance(ndev, FakeDevice)
    assert isinstance(ndev, offcore.Backend)
    assert type(ndev).name == "cpu" and ndev.index == 0 and ndev.capacity == 64 * MiB
    status = FakeDevice.availability()
    assert status.available and status.device_count == 1


def test_capabilities_follow_the_options(make_device: Any) -> None:
    plain = make_device(buffers="numpy")
    assert plain.capabilities == {
        Capability.NUMPY,
        Capability.EVENT_TIMING,
        Capability.PINNED_MEMORY,
        Capability.DUPLEX_COPY,
    }
    shared = make_device(buffers="numpy", duplex=False, sanitize=True)
    assert Capability.DUPLEX_COPY not in shared.capabilities
    assert Capability.SANITIZER in shared.capabilities


def test_torch_capability_and_device(make_device: Any, torch: Any) -> None:
    dev = make_device()  # torch installed: torch buffers by default
    assert Capability.TORCH in dev.capabilities
    assert dev.torch_device == torch.device("cpu")
    assert isinstance(dev.allocate(16, Tier.DEVICE), torch.Tensor)


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        ({"capacity": "-1"}, "capacity"),
        ({"capacity": 0}, "capacity"),
        ({"capacity": "2 GiBs"}, "unit"),
        ({"h2d_bandwidth": "64MB/s/s"}, "h2d_bandwidth"),
        ({"d2h_bandwidth": 0}, "d2h_bandwidth"),
        ({"latency": "-1ms"}, "latency"),
        ({"latency": "soon"}, "latency"),
        ({"jitter": "fast"}, "jitter"),
        ({"duplex": "yes"}, "duplex"),
        ({"sanitize": 1}, "sanitize"),
        ({"seed": "zero"}, "seed"),
        ({"buffers": "jax"}, "buffers"),
        ({"copy_log_limit": -1}, "copy_log_limit"),
        ({"copy_log_limit": None}, "copy_log_limit"),
        ({"copy_log_limit": 1.5}, "copy_log_limit"),
        ({"bandwidth": "1GiB/s"}, "unknown option"),
    ],
)
def test_nonsense_options_are_refused_clearly(options: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ConfigurationError, match=complaint):
        offcore.device("cpu", buffers="numpy", **options) if "buffers" not in options else offcore.device(
            "cpu", **options
        )


def test_only_device_index_zero_exists() -> None:
    with pytest.raises(ConfigurationError, match="indices 0..0"):
        offcore.device("cpu:1", buffers="numpy")
    with pytest.raises(ConfigurationError, match="index 0"):
        FakeDevice(index=2, buffers="numpy")


def test_numpy_device_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, offcore\n"
        "dev = offcore.device('cpu', buffers='numpy', capacity='1MiB')\n"
        "s = dev.new_stream()\n"
        "d = dev.allocate(64, offcore.Tier.DEVICE); d[:] = 1\n"
        "h = dev.allocate(64, offcore.Tier.PINNED)\n"
        "dev.copy_(h, d, stream=s).synchronize()\n"
        "with dev: pass\n"
        "from offcore_cpu import FakeDeviceOutOfMemoryError\n"
        "try:\n"
        "    dev.allocate(2 << 20, offcore.Tier.DEVICE)\n"
        "except FakeDeviceOutOfMemoryError as exc:\n"
        "    assert 'Tried to allocate 2.00 MiB' in str(exc)\n"
        "assert int(h.sum()) == 64\n"
        "assert 'torch' not in sys.modules, 'the numpy path imported torch'\n"
        "dev.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ============================================================================ streams and events


def test_compute_stream_is_the_calling_thread(ndev: FakeDevice) -> None:
    compute = ndev.current_stream()
    assert compute is ndev.current_stream()
    assert compute.query()
    compute.synchronize()
    event = compute.record_event()
    assert event.query()


def test_compute_wait_event_blocks_until_the_copy_stream_reaches_the_event(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    order: list[str] = []
    with _gate(stream) as gate:
        stream.launch_host_func(lambda: order.append("copy stream"))
        reached = stream.record_event()
        threading.Timer(0.05, gate.set).start()  # only delays the worker; the test waits on events
    ndev.current_stream().wait_event(reached)
    order.append("compute")
    assert order == ["copy stream", "compute"]


def test_one_stream_runs_its_work_strictly_in_order(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    seen: list[int] = []
    for i in range(200):
        stream.launch_host_func(lambda i=i: seen.append(i))
    stream.synchronize()
    assert seen == list(range(200))
    assert stream.query()


def test_copies_on_one_stream_never_overlap(make_device: Any) -> None:
    dev = make_device(buffers="numpy", h2d_bandwidth="2GiB/s", d2h_bandwidth="2GiB/s", latency="50us")
    stream = dev.new_stream()
    device = [dev.allocate(256 * 1024, Tier.DEVICE) for _ in range(4)]
    host = [dev.allocate(256 * 1024, Tier.PINNED) for _ in range(4)]
    for d, h in zip(device, host, strict=True):
        dev.copy_(d, h, stream=stream)
        dev.copy_(h, d, stream=stream)
    stream.synchronize()
    log = [entry for entry in dev.copy_log() if entry["stream"] == stream.name]
    assert len(log) == 8
    assert [e["direction"] for e in log] == ["h2d", "d2h"] * 4
    for earlier, later in zip(log, log[1:], strict=False):
        assert earlier["end"] <= later["start"]


def test_cross_stream_wait_holds_the_consumer_until_the_producer_reaches_the_event(ndev: FakeDevice) -> None:
    producer, consumer = ndev.new_stream(name="producer"), ndev.new_stream(name="consumer")
    order: list[str] = []
    with _gate(producer) as gate:
        producer.launch_host_func(lambda: order.append("producer"))
        consumer.wait_event(producer.record_event())
        consumer.launch_host_func(lambda: order.append("consumer"))
        consumer_done = consumer.record_event()
        assert not consumer_done.query(), "the consumer ran past a wait whose event cannot have completed"
        gate.set()
    consumer_done.synchronize()
    assert order == ["producer", "consumer"]


def test_wait_stream_orders_after_everything_enqueued_so_far(ndev: FakeDevice) -> None:
    producer, consumer = ndev.new_stream(), ndev.new_stream()
    with _gate(producer) as gate:
        consumer.wait_stream(producer)
        done = consumer.record_event()
        assert not done.query()
        gate.set()
    done.synchronize()
    assert producer.query()


def test_a_wait_keeps_the_recording_it_saw(ndev: FakeDevice) -> None:
    producer, consumer = ndev.new_stream(), ndev.new_stream()
    with _gate(producer) as gate:
        event = ndev.new_event()
        event.record(producer)
        consumer.wait_event(event)
        event.record()  # re-recorded on the compute stream: complete at once
        assert event.query()
        done = consumer.record_event()
        assert not done.query(), "the consumer must still wait for the first recording"
        gate.set()
    done.synchronize()


def test_event_record_and_wait_default_to_the_compute_stream(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    event = ndev.new_event()
    event.record()
    assert event.query()
    with _gate(stream) as gate:
        pending = stream.record_event()
        assert not pending.query()
        gate.set()
    pending.wait()  # the compute stream: blocks until complete
    assert pending.query()


def test_unrecorded_event_is_complete(ndev: FakeDevice) -> None:
    event = ndev.new_event()
    assert event.query() is True
    event.synchronize()
    ndev.new_stream().wait_event(event)  # nothing to wait for


def test_event_timing_is_positive_across_a_copy(make_device: Any) -> None:
    dev = make_device(buffers="numpy", h2d_bandwidth="1GiB/s", latency="1ms")
    stream = dev.new_stream()
    start, end = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
    start.record(stream)
    dev.copy_(dev.allocate(MiB, Tier.DEVICE), dev.allocate(MiB, Tier.PINNED), stream=stream)
    end.record(stream)
    end.synchronize()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float) and elapsed > 0.0


def test_elapsed_time_errors_say_what_is_missing(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    plain_start, plain_end = ndev.new_event(), ndev.new_event()
    plain_start.record(stream)
    plain_end.record(stream)
    plain_end.synchronize()
    with pytest.raises(ConfigurationError, match="timing"):
        plain_start.elapsed_time(plain_end)
    start, end = ndev.new_event(enable_timing=True), ndev.new_event(enable_timing=True)
    with pytest.raises(ConfigurationError, match="never recorded"):
        start.elapsed_time(end)
    start.record()
    with _gate(stream) as gate:
        end.record(stream)
        with pytest.raises(EventNotReadyError, match="synchronize"):
            start.elapsed_time(end)
        gate.set()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0


def test_a_failure_in_queued_work_surfaces_on_synchronize(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    before = stream.record_event()

    def broken() -> None:
        raise ValueError("the copy engine caught fire")

    stream.launch_host_func(broken)
    after = stream.record_event()
    consumer = ndev.new_stream()
    consumer.wait_event(after)
    with pytest.raises(StreamWorkError, match="caught fire") as caught:
        stream.synchronize()
    assert isinstance(caught.value.__cause__, ValueError)
    stream.synchronize()  # raised once, then cleared
    before.synchronize()  # recorded before the failure: fine
    with pytest.raises(StreamWorkError):
        after.synchronize()
    with pytest.raises(StreamWorkError):
        after.query()
    with pytest.raises(StreamWorkError, match="caught fire"):  # a waiting stream inherits the failure
        consumer.synchronize()
    with pytest.raises(StreamWorkError):  # so does the compute stream when it waits
        ndev.current_stream().wait_event(after)


def test_a_failing_copy_surfaces_on_device_synchronize(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    raw_device = ndev.allocate(4 * 6 * 4, Tier.DEVICE).view(np.float32).reshape(4, 6)
    raw_host = ndev.allocate(4 * 12 * 4, Tier.PINNED).view(np.float32).reshape(4, 12)
    # same byte count, different non-contiguous layouts: only the worker finds out
    event = ndev.copy_(raw_host[:, ::2], raw_device.T, stream=stream)
    with pytest.raises(StreamWorkError, match="neither side is contiguous"):
        ndev.synchronize()
    with pytest.raises(StreamWorkError):
        event.synchronize()


def test_worker_threads_start_lazily_are_daemons_and_stop_on_close(ndev: FakeDevice) -> None:
    stream = ndev.new_stream(name="lazy")
    assert not [t for t in threading.enumerate() if "lazy" in t.name], "a thread started before any work"
    stream.launch_host_func(lambda: None)
    (thread,) = [t for t in threading.enumerate() if t.name.endswith("lazy")]
    assert thread.daemon
    stream.close()
    assert not thread.is_alive()
    with pytest.raises(ConfigurationError, match="closed"):
        stream.launch_host_func(lambda: None)


def test_an_unreferenced_stream_stops_its_thread(ndev: FakeDevice) -> None:
    stream = ndev.new_stream(name="orphan")
    stream.launch_host_func(lambda: None)  # starts the worker (an event on an idle stream does not)
    stream.synchronize()
    (thread,) = [t for t in threading.enumerate() if t.name.endswith("orphan")]
    del stream
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_device_close_finishes_queued_work(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    done: list[int] = []
    for i in range(20):
        stream.launch_host_func(lambda i=i: done.append(i))
    ndev.close()
    assert done == list(range(20))
    assert stream.closed


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_closed_device_refuses_copies_and_streams_saying_it_is_closed(sanitize: bool) -> None:
    """Note [A closed device says so]: a copy on a closed (sanitized) device failed naming an internal stream
    ("create a new one with dev.new_stream()") and left a sanitizer record per copy behind."""
    dev = offcore.device("cpu", capacity="1MiB", sanitize=sanitize, buffers="numpy")
    stream = dev.new_stream()
    src, dst = dev.allocate(64, Tier.DEVICE), dev.allocate(64, Tier.PINNED)
    dev.copy_(dst, src, stream=stream).synchronize()
    dev.close()
    assert dev.closed
    for call in (
        lambda: dev.copy_(dst, src, stream=stream),
        lambda: dev.copy_(dst, src, stream=dev.current_stream()),
        lambda: dev.copy_many([(dst, src), (dst, src)], stream=stream),
        dev.new_stream,
    ):
        with pytest.raises(ConfigurationError, match=r"fake device cpu:0, which is closed \(dev.close\(\) ran\)"):
            call()
    assert dev.copies_in_flight == 0


def test_streams_accept_only_fake_events(ndev: FakeDevice) -> None:
    with pytest.raises(ConfigurationError, match="fake-device events"):
        ndev.new_stream().wait_event(object())


# ============================================================================ copies (numpy)


def test_copy_directions_follow_holds_and_are_ledgered(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    d1, d2 = ndev.allocate(1000, Tier.DEVICE), ndev.allocate(1000, Tier.DEVICE)
    h1, h2 = ndev.allocate(1000, Tier.PINNED), ndev.allocate(1000, Tier.PAGEABLE)
    h1[:] = np.arange(1000) % 251
    for dst, src, direction in [
        (d1, h1, Direction.H2D),
        (d2, d1, Direction.D2D),
        (h2, d2, Direction.D2H),
        (h1, h2, Direction.H2H),
    ]:
        assert ndev.direction(dst, src) is direction
        ndev.copy_(dst, src, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(h2, np.arange(1000) % 251)
    for direction in (d for d in Direction if not d.is_nvme):  # the NVMe tier's directions are not the device's
        totals = ndev.ledger.copies[direction]
        assert (totals.copies, totals.bytes) == (1, 1000), direction
    assert [e["direction"] for e in ndev.copy_log()] == ["h2d", "d2d", "d2h", "h2h"]


def test_typed_and_non_contiguous_views_copy_exactly_through_raw_buffers(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    rng = np.random.default_rng(0)
    source = ndev.allocate(6 * 10 * 4, Tier.DEVICE).view(np.float32).reshape(6, 10)
    source[...] = rng.standard_normal((6, 10), dtype=np.float32)
    transposed = source.T  # non-contiguous
    raw_host = ndev.allocate(transposed.nbytes, Tier.PINNED)
    ndev.copy_(raw_host, transposed, stream=stream)  # typed view -> raw bytes
    back = ndev.allocate(transposed.nbytes, Tier.DEVICE).view(np.float32).reshape(12, 5)[:, :].reshape(10, 6)
    ndev.copy_(back, raw_host, stream=stream).synchronize()  # raw bytes -> typed view
    np.testing.assert_array_equal(back, transposed)
    assert ndev.holds(back) and not ndev.holds(raw_host)


def test_copy_refuses_mismatched_buffers(ndev: FakeDevice) -> None:
    stream = ndev.new_stream()
    device = ndev.allocate(64, Tier.DEVICE)
    with pytest.raises(ConfigurationError, match="different sizes"):
        ndev.copy_(device, np.zeros(63, np.uint8), stream=stream)
    with pytest.raises(ConfigurationError, match="two numpy arrays or two torch tensors"):
        ndev.copy_(device, [0] * 64, stream=stream)
    frozen = np.zeros(64, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ConfigurationError, match="read-only"):
        ndev.copy_(frozen, device, stream=stream)


def test_copy_refuses_to_mix_numpy_and_torch(ndev: FakeDevice, torch: Any) -> None:
    with pytest.raises(ConfigurationError, match="two numpy arrays or two torch tensors"):
        ndev.copy_(ndev.allocate(64, Tier.DEVICE), torch.zeros(64, dtype=torch.uint8), stream=ndev.new_stream())


def test_copy_needs_a_stream_of_this_device(ndev: FakeDevice, make_device: Any) -> None:
    other = make_device(buffers="numpy")
    with pytest.raises(ConfigurationError, match="stream of this device"):
        ndev.copy_(ndev.allocate(8, Tier.DEVICE), ndev.allocate(8, Tier.PINNED), stream=other.new_stream())


def test_copy_on_the_compute_stream_has_landed_when_it_returns(make_device: Any) -> None:
    dev = make_device(buffers="numpy", latency="1ms")
    host = dev.allocate(4096, Tier.PINNED)
    host[:] = 9
    device = dev.allocate(4096, Tier.DEVICE)
    event = dev.copy_(device, host, stream=dev.current_stream())
    assert event.query()
    assert int(device.sum()) == 9 * 4096


def test_copy_log_is_a_bounded_ring(make_device: Any) -> None:
    fast = {"buffers": "numpy", "h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0}
    dev = make_device(**fast)
    assert dev.options.copy_log_limit == 4096
    device, host = dev.allocate(64, Tier.DEVICE), dev.allocate(64, Tier.PINNED)
    for _ in range(5000):  # a long run keeps only the latest 4096
        dev.copy_(host, device, stream=dev.current_stream())
    assert len(dev.copy_log()) == 4096
    assert dev.ledger.snapshot()["copies"]["d2h"]["copies"] == 5000, "the ledger keeps every copy"

    small = make_device(copy_log_limit=8, **fast)
    stream = small.new_stream()
    device, host = small.allocate(64, Tier.DEVICE), small.allocate(64, Tier.PINNED)
    for n in range(1, 21):  # inline, queued and compute-stream copies share the ring
        small.copy_(host[:n], device[:n], stream=stream if n % 2 else small.current_stream())
        if n % 5 == 0:
            with _gate(stream) as gate:
                small.copy_(host[:n], device[:n], stream=stream)
                gate.set()
            stream.synchronize()
    stream.synchronize()
    log = small.copy_log()
    assert len(log) == 8 and [e["bytes"] for e in log][-3:] == [19, 20, 20]

    none = make_device(copy_log_limit=0, **fast)
    none.copy_(none.allocate(8, Tier.PINNED), none.allocate(8, Tier.DEVICE), stream=none.new_stream()).synchronize()
    assert none.copy_log() == [] and none.ledger.snapshot()["copies"]["d2h"]["copies"] == 1


@pytest.mark.parametrize("buffers", ["numpy", "torch"])
def test_the_copy_log_holds_nothing_the_collector_tracks(make_device: Any, buffers: str) -> None:
    """Note [The copy log holds no tracked objects]: the ring's 4096 tuples would otherwise each count towards
    the next full garbage collection; every kind of copy logs strings and numbers only."""
    if buffers == "torch":
        pytest.importorskip("torch")
    dev = make_device(buffers=buffers, h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    stream = dev.new_stream()
    device, host = dev.allocate(64, Tier.DEVICE), dev.allocate(64, Tier.PINNED)
    dev.copy_(host, device, stream=stream).synchronize()  # inline (the fast path with torch buffers)
    dev.copy_(device, host, stream=dev.current_stream())  # on the compute stream
    with _gate(stream) as gate:  # queued
        done = dev.copy_(host, device, stream=stream)
        gate.set()
    done.synchronize()
    if buffers == "torch":
        dev.copy_many([(host, device), (device, host)], stream=stream).synchronize()
    gc.collect()
    assert len(dev._copy_log) >= 3
    assert not any(gc.is_tracked(entry) for entry in dev._copy_log)
    assert {e["direction"] for e in dev.copy_log()} == {"d2h", "h2d"}


def test_copy_time_follows_the_link_model(make_device: Any) -> None:
    dev = make_device(buffers="numpy", h2d_bandwidth="1GiB/s", d2h_bandwidth="512MiB/s", latency="20us")
    stream = dev.new_stream()
    device, host = dev.allocate(MiB, Tier.DEVICE), dev.allocate(MiB, Tier.PINNED)
    dev.copy_(device, host, stream=stream)
    dev.copy_(host, device, stream=stream)
    dev.copy_(host, host.copy(), stream=stream)
    stream.synchronize()
    h2d, d2h, h2h = dev.copy_log()
    assert h2d["emulated_seconds"] == pytest.approx(20e-6 + MiB / 2**30, rel=1e-12)
    assert d2h["emulated_seconds"] == pytest.approx(20e-6 + MiB / 2**29, rel=1e-12)
    assert h2h["emulated_seconds"] == 0.0  # host-to-host never crosses the link
    for entry in (h2d, d2h):
        # a guarantee of construction (the worker waits until the deadline), not a speed figure
        assert entry["end"] - entry["start"] >= entry["emulated_seconds"]
        assert entry["enqueued"] <= entry["start"]


def test_link_durations() -> None:
    link = Link(h2d_bandwidth=32 * 2**30, d2h_bandwidth=16 * 2**30, latency=0.0, duplex=True)
    assert link.duration(Direction.H2D, 256 * MiB) == 7.8125e-3
    assert link.duration(Direction.D2H, 256 * MiB) == 15.625e-3
    assert link.duration(Direction.D2D, 256 * MiB) == 0.0
    unlimited = Link(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf, latency=5e-6, duplex=True)
    assert unlimited.duration(Direction.H2D, 256 * MiB) == 5e-6  # only the latency is left


@pytest.mark.parametrize("duplex", [True, False])
def test_an_unlimited_links_instant_booking_is_the_timed_one_to_the_bit(duplex: bool) -> None:
    """Note [A direction's route is built once]: infinite bandwidth and no latency book with the instant
    method; from the same channel state it answers what the timed method does, and leaves the same state."""
    instant = Link(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf, latency=0.0, duplex=duplex)
    timed = Link(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf, latency=0.0, duplex=duplex)
    assert instant.reserver[Direction.H2D] == instant._routes[Direction.H2D]._reserve_instant
    soon = time.perf_counter() + 60.0  # in the future: the bookings do not depend on the clock
    for direction, not_before, booked in [
        (Direction.H2D, soon, 0.0),
        (Direction.D2H, soon, soon + 1.5),  # the channel is booked beyond not_before
        (Direction.H2D, soon + 0.25, soon + 0.125),
        (Direction.D2H, 0.0, soon + 3.0),
    ]:
        for link in (instant, timed):
            link._routes[direction].channel.free_at = booked
        got = instant.reserve(direction, 16 * 1024, not_before)
        want = timed._routes[direction].reserve(16 * 1024, not_before)
        assert got == want and got is not None and got[0] == got[1] == max(not_before, booked)
        assert instant.booked_until() == timed.booked_until()
    for link in (
        Link(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf, latency=5e-6, duplex=True),
        Link(h2d_bandwidth=2**30, d2h_bandwidth=math.inf, latency=0.0, duplex=True),
    ):
        start, end = link.reserve(Direction.H2D, 16 * 1024, soon)  # type: ignore[misc]
        assert end - start >= link.duration(Direction.H2D, 16 * 1024) > 0


@pytest.mark.parametrize("data_first", [False, True])
def test_transfer_ends_at_its_emulated_time_whichever_moment_the_bytes_move(data_first: bool) -> None:
    # data_first (the fake device without its sanitizer) moves the bytes at once and sleeps once;
    # the default moves them only after the latency. Both land no earlier than start + duration.
    link = Link(h2d_bandwidth=2**30, d2h_bandwidth=2**30, latency=2e-3, duplex=True)
    called: list[float] = []
    start, end = link.transfer(Direction.H2D, MiB, lambda: called.append(time.perf_counter()), data_first=data_first)
    assert len(called) == 1
    assert end - start >= link.duration(Direction.H2D, MiB)
    if not data_first:
        assert called[0] - start >= 2e-3  # guaranteed by construction: the worker slept first


def test_duplex_link_has_a_channel_per_direction() -> None:
    link = Link(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf, latency=0.0, duplex=True)
    with link.channel(Direction.H2D):
        start, end = link.transfer(Direction.D2H, 8, lambda: None)  # would deadlock on a shared link
    assert end >= start


def test_shared_link_serialises_the_two_directions() -> None:
    link = Link(h2d_bandwidth=math.inf, d2h_bandwidth=math.inf, latency=0.0, duplex=False)
    finished = threading.Event()
    with link.channel(Direction.H2D):
        other = threading.Thread(target=lambda: (link.transfer(Direction.D2H, 8, lambda: None), finished.set()))
        other.start()
        other.join(timeout=0.1)  # it cannot finish while the channel is held
        assert not finished.is_set()
    other.join(timeout=10)
    assert finished.is_set()


def test_shared_link_copies_never_overlap(make_device: Any) -> None:
    dev = make_device(buffers="numpy", duplex=False, h2d_bandwidth="4GiB/s", d2h_bandwidth="4GiB/s")
    up, down = dev.new_stream(), dev.new_stream()
    for _ in range(4):
        dev.copy_(dev.allocate(MiB, Tier.DEVICE), dev.allocate(MiB, Tier.PINNED), stream=up)
        dev.copy_(dev.allocate(MiB, Tier.PINNED), dev.allocate(MiB, Tier.DEVICE), stream=down)
    dev.synchronize()
    intervals = sorted((e["start"], e["end"]) for e in dev.copy_log())
    assert len(intervals) == 8
    for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
        assert end <= start


# ============================================================================ memory (numpy)


def test_numpy_device_allocations_are_counted_until_they_die(ndev: FakeDevice) -> None:
    base = ndev.memory_stats()
    assert base.allocated_bytes == 0 and base.capacity_bytes == 64 * MiB
    buffer = ndev.allocate(MiB, Tier.DEVICE)
    view = buffer[10:20].view(np.uint16)
    assert ndev.holds(buffer) and ndev.holds(view)
    stats = ndev.memory_stats()
    assert stats.allocated_bytes == MiB and stats["free_bytes"] == 63 * MiB
    del buffer
    gc.collect()
    assert ndev.memory_stats().allocated_bytes == MiB, "a live view keeps its memory"
    del view
    gc.collect()
    stats = ndev.memory_stats()
    assert stats.allocated_bytes == 0 and stats.peak_allocated_bytes == MiB
    assert not ndev.holds(np.zeros(4, np.uint8))
    assert not ndev.holds("not a buffer")


def test_host_allocations_count_as_pinned_or_pageable(ndev: FakeDevice) -> None:
    pinned = ndev.allocate(3 * MiB, Tier.PINNED)
    pageable = ndev.allocate(MiB, "pageable")
    stats = ndev.memory_stats()
    assert (stats["pinned_bytes"], stats["pageable_bytes"], stats.allocated_bytes) == (3 * MiB, MiB, 0)
    del pinned
    gc.collect()
    stats = ndev.memory_stats()
    assert stats["pinned_bytes"] == 0 and stats["peak_pinned_bytes"] == 3 * MiB
    ndev.reset_peak_memory_stats()
    assert ndev.memory_stats()["peak_pinned_bytes"] == 0
    assert pageable.nbytes == MiB


def test_allocate_rejects_bad_requests(ndev: FakeDevice) -> None:
    with pytest.raises(ConfigurationError, match="tier"):
        ndev.allocate(16, "gpu")
    with pytest.raises(ConfigurationError, match="NVMe"):
        ndev.allocate(16, Tier.NVME)
    with pytest.raises(ConfigurationError, match="allocation size"):
        ndev.allocate(-5, Tier.DEVICE)


def test_numpy_out_of_memory_error(ndev: FakeDevice) -> None:
    keep = ndev.allocate(60 * MiB, Tier.DEVICE)
    with pytest.raises(FakeDeviceOutOfMemoryError) as caught:
        ndev.allocate(8 * MiB, Tier.DEVICE)
    assert isinstance(caught.value, CapacityExceededError)
    message = str(caught.value)
    assert "Tried to allocate 8.00 MiB" in message
    assert "60.00 MiB already allocated" in message and "capacity 64.00 MiB" in message
    assert "batch size" in message and "offload" in message
    error = caught.value
    assert (error.requested_bytes, error.allocated_bytes, error.capacity_bytes) == (8 * MiB, 60 * MiB, 64 * MiB)
    assert ndev.memory_stats().allocated_bytes == 60 * MiB, "a refused allocation counts nothing"
    del keep


def test_adopt_numpy_arrays(ndev: FakeDevice) -> None:
    arrays = [np.zeros(1000, np.float32), np.ones(24, np.uint8)]
    assert ndev.adopt(arrays) is arrays
    assert ndev.memory_stats().allocated_bytes == 4000 + 24
    assert ndev.holds(arrays[0][5:])
    ndev.adopt(arrays)  # adopting twice counts once
    assert ndev.memory_stats().allocated_bytes == 4024
    with pytest.raises(CapacityExceededError):
        ndev.adopt([np.zeros(40 * MiB, np.uint8), np.zeros(40 * MiB, np.uint8)])
    assert ndev.memory_stats().allocated_bytes == 4024, "all or nothing"
    with pytest.raises(ConfigurationError, match="pinned"):
        ndev.adopt(ndev.allocate(16, Tier.PINNED))
    with pytest.raises(ConfigurationError, match="cannot adopt"):
        ndev.adopt(3.5)


# ============================================================================ host pool


def test_host_pool_blocks_are_host_memory_with_a_budget(ndev: FakeDevice) -> None:
    pool = ndev.host_pool("2MiB", block_size="1MiB")
    first = pool.acquire(700 * 1024)
    second = pool.acquire(700 * 1024)
    assert not ndev.holds(first.view)
    assert ndev.memory_stats()["pinned_bytes"] == pool.reserved_bytes == 2 * MiB
    with pytest.raises(CapacityExceededError, match="budget"):
        pool.acquire(700 * 1024)
    pool.release(first)
    pool.release(second)
    assert pool.trim() == 2 * MiB
    del first, second  # their views kept the blocks alive
    gc.collect()
    assert ndev.memory_stats()["pinned_bytes"] == 0
    pageable = ndev.host_pool("1MiB", pinned=False)
    buffer = pageable.acquire(4096)
    assert ndev.memory_stats()["pageable_bytes"] == MiB
    pageable.release(buffer)


# ============================================================================ sanitizer (numpy)


def test_sanitized_allocations_start_poisoned(make_device: Any) -> None:
    dev = make_device(buffers="numpy", sanitize=True)
    for tier in (Tier.DEVICE, Tier.PINNED, Tier.PAGEABLE):
        assert (dev.allocate(256, tier) == 0xFF).all(), tier
    assert np.isnan(dev.allocate(64, Tier.DEVICE).view(np.float32)).all()


def test_poison_is_a_no_op_without_the_sanitizer(ndev: FakeDevice, make_device: Any) -> None:
    data = np.arange(8, dtype=np.int32)
    assert ndev.poison(data) is False
    np.testing.assert_array_equal(data, np.arange(8))
    sanitizing = make_device(buffers="numpy", sanitize=True)
    strided = np.arange(16, dtype=np.float64)[::2]
    assert sanitizing.poison(strided) is True
    assert np.isnan(strided).all()
    with pytest.raises(ConfigurationError, match="poison"):
        sanitizing.poison([1, 2, 3])


def test_sanitized_host_pool_poisons_released_buffers(make_device: Any) -> None:
    dev = make_device(buffers="numpy", sanitize=True)
    pool = dev.host_pool("1MiB", block_size="1MiB")
    buffer = pool.acquire(64)
    buffer.view[:] = 1
    pool.release(buffer)
    assert (buffer.view == 0xFF).all()
    quiet = make_device(buffers="numpy").host_pool("1MiB", block_size="1MiB")
    kept = quiet.acquire(64)
    kept.view[:] = 1
    quiet.release(kept)
    assert (kept.view == 1).all()


def _offload_numbers(dev: FakeDevice, *, wait: bool) -> np.ndarray:
    """A binding's D2H offload in miniature; ``wait=False`` plants the missing wait."""
    values = np.linspace(-3.0, 3.0, 4096, dtype=np.float32)
    device = dev.allocate(values.nbytes, Tier.DEVICE).view(np.float32)
    device[:] = values
    pool = dev.host_pool("1MiB", block_size="1MiB")
    staging = pool.acquire(values.nbytes)
    copy_stream = dev.new_stream()
    copy_stream.wait_stream(dev.current_stream())
    done = dev.copy_(staging.view, device.view(np.uint8), stream=copy_stream)
    if wait:
        dev.current_stream().wait_event(done)
    result = staging.view.view(np.float32).copy()  # the host reads its "offloaded" activation
    done.synchronize()
    pool.release(staging)
    return result


def test_sanitizer_turns_a_missing_wait_into_wrong_numbers(make_device: Any) -> None:
    expected = np.linspace(-3.0, 3.0, 4096, dtype=np.float32)
    # 200 ms latency plus 0..2 ms jitter: the read right after copy_ comes long before the data
    dev = make_device(buffers="numpy", sanitize=True, latency="200ms", seed=7)
    planted = _offload_numbers(dev, wait=False)
    assert not np.array_equal(planted, expected)
    assert np.isnan(planted).all(), "the destination should hold poison until the copy lands"
    np.testing.assert_array_equal(_offload_numbers(dev, wait=True), expected)


def test_sanitizer_keeps_stream_ordered_reuse_exact(make_device: Any) -> None:
    """Poison lands when the stream reaches a copy, so queued readers of a reused buffer are safe."""
    dev = make_device(buffers="numpy", sanitize=True, latency="1ms")
    stream = dev.new_stream()
    device = dev.allocate(4096, Tier.DEVICE)
    device[:] = np.arange(4096) % 13
    saved = dev.allocate(4096, Tier.PINNED)
    incoming = dev.allocate(4096, Tier.PINNED)
    incoming[:] = 5
    dev.copy_(saved, device, stream=stream)  # D2H reads `device` ...
    dev.copy_(device, incoming, stream=stream)  # ... before the H2D that overwrites it
    stream.synchronize()
    np.testing.assert_array_equal(saved, np.arange(4096) % 13)
    assert (device == 5).all()


def test_jitter_is_reproducible_by_seed(make_device: Any) -> None:
    def jitters(seed: int) -> list[float]:
        dev = make_device(buffers="numpy", sanitize=True, seed=seed, latency=0, jitter="1ms")
        stream = dev.new_stream()
        kept = [(dev.allocate(64, Tier.DEVICE), dev.allocate(64, Tier.PINNED)) for _ in range(5)]
        for device, host in kept:
            dev.copy_(device, host, stream=stream)
        stream.synchronize()
        assert dev.sanitizer_violations() == []  # every buffer outlived its copy
        return [entry["emulated_seconds"] for entry in dev.copy_log()]

    first = jitters(3)
    assert first == jitters(3)
    assert first != jitters(4)
    assert all(0.0 <= j <= 1e-3 + 64 / 2**35 for j in first)


# ============================================================================ torch: accounting


def test_tensors_created_while_active_are_device_memory(tdev: FakeDevice, torch: Any) -> None:
    before = torch.ones(10)
    with tdev:
        x = torch.randn(1024)
        assert tdev.memory_stats().allocated_bytes == 4096
        assert tdev.holds(x) and not tdev.holds(before)
        view = x[100:].view(-1, 4)
        x.mul_(2)  # in place: no new memory
        assert tdev.memory_stats().allocated_bytes == 4096, "views and in-place ops do not allocate"
        assert tdev.holds(view)
        del x
        gc.collect()
        assert tdev.memory_stats().allocated_bytes == 4096, "the view keeps the storage alive"
        del view
        gc.collect()
        assert tdev.memory_stats().allocated_bytes == 0
        doubled = before * 2  # a new result on the active device
        assert tdev.holds(doubled) and tdev.memory_stats().allocated_bytes == 40
    after = torch.zeros(8)
    assert not tdev.holds(after), "tensors made outside `with dev:` are host tensors"
    assert tdev.memory_stats().peak_allocated_bytes == 4096


def test_tensors_from_python_data_are_device_memory(tdev: FakeDevice, torch: Any) -> None:
    # torch.tensor & co. allocate outside dispatch and then call aten.lift_fresh, which returns
    # its argument: Note [Fresh tensors from Python data]
    with tdev:
        made = {
            "tensor": torch.tensor([1.0, 2.0, 3.0]),
            "scalar": torch.tensor(3),
            "as_tensor": torch.as_tensor([[1, 2], [3, 4]], dtype=torch.int16),
            "asarray": torch.asarray([1.0, 2.0], dtype=torch.float64),
            "Tensor": torch.Tensor([1.0, 2.0]),
            "nested": torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]),
            "lift_fresh_copy": torch.ops.aten.lift_fresh_copy(torch.ones(5)),
        }
        gc.collect()
        for name, t in made.items():
            assert tdev.holds(t), name
        expected = sum(t.untyped_storage().nbytes() for t in made.values())
        assert expected == 12 + 8 + 8 + 16 + 8 + 8 + 20
        stats = tdev.memory_stats()
        assert stats.allocated_bytes == expected and stats["device_allocations"] == len(made)
        t = made.pop("tensor")
        del t
        gc.collect()
        assert tdev.memory_stats().allocated_bytes == expected - 12, "the bytes go back when it dies"


def test_tensors_over_foreign_memory_stay_host_memory(tdev: FakeDevice, torch: Any) -> None:
    # from_numpy also reaches aten.lift_fresh under a dispatch mode, but its memory is numpy's:
    # a binding's host buffers wrapped this way must not count as device memory
    array = np.arange(16, dtype=np.float32)
    with tdev:
        foreign = [
            torch.from_numpy(array),
            torch.as_tensor(array),
            torch.asarray(array),
            torch.frombuffer(bytearray(64), dtype=torch.uint8),
        ]
        assert tdev.memory_stats().allocated_bytes == 0
        assert not any(tdev.holds(t) for t in foreign)
        copied = torch.tensor(array)  # a copy: device memory, counted once
        assert tdev.holds(copied)
        stats = tdev.memory_stats()
        assert stats.allocated_bytes == stats.peak_allocated_bytes == array.nbytes


def test_peak_and_reset_follow_torch_cuda_semantics(tdev: FakeDevice, torch: Any) -> None:
    with tdev:
        big = torch.empty(MiB, dtype=torch.uint8)
        small = torch.empty(1000, dtype=torch.uint8)
        del big
        gc.collect()
        stats = tdev.memory_stats()
        assert (stats.allocated_bytes, stats.peak_allocated_bytes) == (1000, MiB + 1000)
        tdev.reset_peak_memory_stats()
        assert tdev.memory_stats().peak_allocated_bytes == 1000
        del small


def test_training_step_is_counted_like_cuda(tdev: FakeDevice, torch: Any) -> None:
    with tdev:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        params = 64 * 32 * 4 + 32 * 4
        assert tdev.memory_stats().allocated_bytes == params
        model(torch.randn(8, 64)).sum().backward()
        gc.collect()
        assert tdev.memory_stats().allocated_bytes == 2 * params, "parameters + gradients remain"
        assert tdev.memory_stats().peak_allocated_bytes > 2 * params


def test_host_allocations_while_active_are_not_device_memory(tdev: FakeDevice, torch: Any) -> None:
    with tdev:
        pinned = tdev.allocate(MiB, Tier.PINNED)
        pool = tdev.host_pool("4MiB", block_size="2MiB")
        staging = pool.acquire(1000)
        stats = tdev.memory_stats()
        assert stats.allocated_bytes == 0
        assert stats["pinned_bytes"] == 3 * MiB
        assert not tdev.holds(pinned) and not tdev.holds(staging.view)
        assert not tdev.holds(pinned[10:].view(torch.int16)), "views of host buffers stay host"
        device = tdev.allocate(MiB, Tier.DEVICE)
        assert tdev.memory_stats().allocated_bytes == MiB and tdev.holds(device)
        pool.release(staging)


def test_out_of_memory_is_torch_s_error_with_a_helpful_message(make_device: Any, torch: Any) -> None:
    dev = make_device(capacity="1MiB")
    with dev:
        keep = torch.empty(512 * 1024, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(MiB, dtype=torch.uint8)
        assert dev.memory_stats().allocated_bytes == 512 * 1024
    error = caught.value
    assert isinstance(error, CapacityExceededError) and isinstance(error, offcore.OffcoreError)
    assert isinstance(error, FakeDeviceOutOfMemoryError)
    message = str(error)
    assert "Tried to allocate 1.00 MiB" in message and "512.00 KiB already allocated" in message
    assert "capacity 1.00 MiB" in message and "batch size" in message
    with pytest.raises(torch.OutOfMemoryError):
        dev.allocate(2 * MiB, Tier.DEVICE)
    del keep


def test_out_of_memory_error_pickles(make_device: Any, torch: Any) -> None:
    import pickle

    dev = make_device(capacity="1MiB")
    with pytest.raises(FakeDeviceOutOfMemoryError) as caught:
        dev.allocate(2 * MiB, Tier.DEVICE)
    assert isinstance(caught.value, torch.OutOfMemoryError)
    clone = pickle.loads(pickle.dumps(caught.value))
    assert type(clone) is type(caught.value) and str(clone) == str(caught.value)
    assert clone.requested_bytes == 2 * MiB


def test_adopt_a_model_created_before_activation(tdev: FakeDevice, torch: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    assert tdev.memory_stats().allocated_bytes == 0
    assert tdev.adopt(model) is model
    expected = sum(p.numel() * 4 for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    assert tdev.memory_stats().allocated_bytes == expected
    assert all(tdev.holds(p) for p in model.parameters())
    tdev.adopt(model)
    assert tdev.memory_stats().allocated_bytes == expected, "adopting twice counts once"
    tied = torch.randn(32)
    tdev.adopt([tied, tied[4:], tied.view(4, 8)])
    assert tdev.memory_stats().allocated_bytes == expected + 128, "views share one storage"
    with pytest.raises(torch.OutOfMemoryError):
        tdev.adopt(torch.empty(65 * MiB, dtype=torch.uint8))
    del model
    gc.collect()
    assert tdev.memory_stats().allocated_bytes == 128


def test_reentrant_activation_and_other_threads(tdev: FakeDevice, torch: Any) -> None:
    made_elsewhere: list[Any] = []
    with tdev:
        with tdev:
            inner = torch.zeros(16)
        outer = torch.zeros(16)  # still active after the inner exit
        worker = threading.Thread(target=lambda: made_elsewhere.append(torch.zeros(16)))
        worker.start()
        worker.join()
        assert tdev.active
    assert not tdev.active
    assert tdev.holds(inner) and tdev.holds(outer)
    assert not tdev.holds(made_elsewhere[0]), "accounting is per thread, as the dispatch mode is"


def test_only_the_innermost_active_device_counts(make_device: Any, torch: Any) -> None:
    outer_dev, inner_dev = make_device(capacity="1MiB"), make_device(capacity="1MiB")
    with outer_dev:
        with inner_dev:
            a = torch.zeros(8)
        b = torch.zeros(8)
    assert inner_dev.holds(a) and not outer_dev.holds(a)
    assert outer_dev.holds(b) and not inner_dev.holds(b)


def test_resize_changes_the_count(tdev: FakeDevice, torch: Any) -> None:
    with tdev:
        x = torch.zeros(16)
        x.resize_(1024)
        assert tdev.memory_stats().allocated_bytes == 4096
        with pytest.raises(torch.OutOfMemoryError):
            x.resize_(64 * MiB)


# ============================================================================ torch: copies and sanitizer


def test_torch_copies_through_raw_buffers(tdev: FakeDevice, torch: Any) -> None:
    stream = tdev.new_stream()
    with tdev:
        activation = torch.randn(6, 10).t()  # non-contiguous, on the device
        host = tdev.allocate(activation.numel() * 4, Tier.PINNED)
        stream.wait_stream(tdev.current_stream())
        tdev.copy_(host, activation, stream=stream)
        restored = torch.empty_strided(activation.shape, activation.stride())
        done = tdev.copy_(restored, host, stream=stream)
        tdev.current_stream().wait_event(done)
        assert torch.equal(restored, activation)
    assert tdev.direction(host, activation) is Direction.D2H
    assert tdev.direction(restored, host) is Direction.H2D


def test_one_element_strided_views_copy_to_and_from_raw_bytes(tdev: FakeDevice, torch: Any) -> None:
    """``torch.zeros(2)[::2]`` is contiguous yet has stride 2; viewing it as bytes needs care."""
    stream = tdev.new_stream()
    strided = torch.zeros(4)[::2][1:]  # one float32 at storage offset 2, stride 2
    raw = torch.tensor([0, 0, 192, 63], dtype=torch.uint8)  # 1.5 as little-endian float32
    tdev.copy_(strided, raw, stream=stream)
    back = torch.zeros(4, dtype=torch.uint8)
    tdev.copy_(back, strided, stream=stream).synchronize()
    assert strided.item() == 1.5 and torch.equal(back, raw)
    array = np.zeros(4, np.float32)[::2][1:]
    tdev.copy_(array, raw.numpy().copy(), stream=stream).synchronize()
    assert array[0] == 1.5


def test_sanitizer_poisons_uninitialised_device_tensors(make_device: Any, torch: Any) -> None:
    dev = make_device(sanitize=True)
    with dev:
        assert torch.isnan(torch.empty(64)).all()
        assert torch.isnan(torch.empty_like(torch.zeros(3, 3))).all()
        assert (torch.empty(8, dtype=torch.int32) == -1).all()
        assert (torch.zeros(64) == 0).all(), "initialised tensors are left alone"
        assert (dev.allocate(32, Tier.DEVICE) == 255).all()
        strided = torch.arange(12.0)[::3]
        assert dev.poison(strided) and torch.isnan(strided).all()


def _reload_and_use(dev: FakeDevice, torch: Any, *, wait: bool) -> Any:
    """A binding's unpack in miniature: H2D a saved activation, then compute with it."""
    with dev:
        weights = torch.linspace(-1.0, 1.0, 1024)
        saved = dev.allocate(1024 * 4, Tier.PINNED)
        saved.view(torch.float32).copy_(torch.linspace(0.5, 2.0, 1024))
        copy_stream = dev.new_stream()
        restored = torch.empty(1024)  # reused device memory: stale bytes
        done = dev.copy_(restored, saved.view(torch.float32), stream=copy_stream)
        if wait:
            dev.current_stream().wait_event(done)
        result = (weights * restored).sum()
        done.synchronize()
        return result


def test_sanitizer_turns_a_missing_reload_wait_into_nan(make_device: Any, torch: Any) -> None:
    expected = (torch.linspace(-1.0, 1.0, 1024) * torch.linspace(0.5, 2.0, 1024)).sum()
    dev = make_device(sanitize=True, latency="200ms")
    assert torch.isnan(_reload_and_use(dev, torch, wait=False))
    assert torch.equal(_reload_and_use(dev, torch, wait=True), expected)


@pytest.mark.parametrize("nbytes", [0, 24, 4096, 256 * 1024, 256 * 1024 + 8, 1 << 20])
def test_torch_copies_move_raw_bytes_below_and_above_the_gil_held_limit(
    make_device: Any, torch: Any, nbytes: int
) -> None:
    # small contiguous copies are a memmove holding the GIL, large ones Tensor.copy_
    # (Note [Small copies keep the GIL]); both must move exactly the bytes, across dtypes
    dev = make_device(buffers="torch")
    with dev:
        src = torch.arange(nbytes // 4, dtype=torch.int32).view(torch.float32)
    host = dev.allocate(nbytes, Tier.PINNED)
    dev.copy_(host, src.view(-1).view(torch.uint8), stream=dev.new_stream()).synchronize()
    assert torch.equal(host.view(torch.int32), torch.arange(nbytes // 4, dtype=torch.int32))
    back = torch.empty(nbytes // 8, 2, dtype=torch.float32).t()  # non-contiguous: the copy_ path
    if nbytes and nbytes % 8 == 0:
        dev.copy_(back, host.view(torch.float32).view(2, nbytes // 8), stream=dev.current_stream())
        assert torch.equal(back.contiguous().view(-1).view(torch.int32), torch.arange(nbytes // 4, dtype=torch.int32))


# ============================================================================ inline copies on an idle stream


def test_an_inline_copy_lands_at_its_emulated_time_and_orders_later_work(make_device: Any) -> None:
    # Note [Inline copies on an idle stream]: the bytes move at once, the event and everything
    # queued after it on the stream wait for the emulated end of the transfer
    dev = make_device(buffers="numpy", h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s", latency="5ms")
    stream = dev.new_stream()
    device, host = dev.allocate(64 * 1024, Tier.DEVICE), dev.allocate(64 * 1024, Tier.PINNED)
    device[:] = 7
    done = dev.copy_(host, device, stream=stream)
    ran_at: list[float] = []
    stream.launch_host_func(lambda: ran_at.append(time.perf_counter()))
    after = stream.record_event()
    done.synchronize()
    synced_at = time.perf_counter()
    (entry,) = dev.copy_log()
    assert entry["end"] - entry["start"] >= entry["emulated_seconds"] >= 5e-3
    assert synced_at >= entry["end"]  # the event completes no earlier than the transfer's end
    after.synchronize()
    assert ran_at and ran_at[0] >= entry["end"]  # later work on the stream starts after it
    assert int(host.sum()) == 7 * 64 * 1024


def test_a_copy_behind_queued_work_is_not_run_inline(make_device: Any) -> None:
    dev = make_device(buffers="numpy", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    stream = dev.new_stream()
    device, host = dev.allocate(4096, Tier.DEVICE), dev.allocate(4096, Tier.PINNED)
    device[:], host[:] = 1, 0
    with _gate(stream) as gate:
        done = dev.copy_(host, device, stream=stream)
        assert not done.query() and int(host.sum()) == 0  # queued behind the gate, untouched
        gate.set()
    done.synchronize()
    assert int(host.sum()) == 4096


def test_back_to_back_inline_copies_share_the_link_in_order(make_device: Any) -> None:
    dev = make_device(buffers="numpy", h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s", latency="1ms", duplex=False)
    d2h, h2d = dev.new_stream(), dev.new_stream()
    device, host = dev.allocate(MiB // 4, Tier.DEVICE), dev.allocate(MiB // 4, Tier.PINNED)
    events = [dev.copy_(host, device, stream=d2h), dev.copy_(device, host, stream=h2d)]
    for event in events:
        event.synchronize()
    first, second = dev.copy_log()
    assert second["start"] >= first["end"]  # one shared link: the second transfer waits for the first
    assert d2h.query() and h2d.query()


# ============================================================================ copies into freed storage


@pytest.mark.parametrize("numel", [1000, 300_000], ids=["plain-memmove", "copy_"])
@pytest.mark.parametrize("freed", ["destination", "source"])
@pytest.mark.parametrize("when", ["before", "queued"])
def test_a_copy_over_a_freed_storage_is_refused_not_a_crash(
    tdev: FakeDevice, torch: Any, numel: int, freed: str, when: str
) -> None:
    """A buffer freed (its storage resized to 0) before its copy runs: the copy fails with FreedStorageError,
    surfaced by the copy's event, instead of a memmove into freed memory (the process died with SIGSEGV:
    found when an optimizer upload raced a parameter handle's free). ``queued``: freed while the copy waits
    on its stream, as in that race."""
    from offcore_cpu.errors import FreedStorageError

    with tdev:
        device_buffer = torch.empty(numel)
    host = torch.randn(numel)
    dst, src = (device_buffer, host) if freed == "destination" else (host, device_buffer)
    victim = dst if freed == "destination" else src
    stream = tdev.new_stream()
    if when == "before":
        victim.untyped_storage().resize_(0)
        event = tdev.copy_(dst, src, stream=stream)
    else:
        with _gate(stream):
            event = tdev.copy_(dst, src, stream=stream)
            victim.untyped_storage().resize_(0)
    with pytest.raises(StreamWorkError) as raised:
        event.synchronize()
    assert isinstance(raised.value.__cause__, FreedStorageError), raised.value.__cause__
    assert f"the copy's {freed}" in str(raised.value) and "freed or resized" in str(raised.value)
    with pytest.raises(StreamWorkError):
        stream.synchronize()  # the stream reports it once, then carries on
    good = torch.randn(numel)
    with tdev:
        target = torch.empty(numel)
    tdev.copy_(target, good, stream=stream).synchronize()
    assert torch.equal(target, good)
