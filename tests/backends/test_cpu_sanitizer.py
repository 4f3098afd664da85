"""The fake device's sanitizer sees use-after-free, and its gates hold copies in mid-flight.

Note [Use after free] in ``offcore_cpu.sanitizer``: a device buffer whose last reference
dies while a queued copy still reads (or writes) it is poisoned and the copy delivers
poison; a host buffer returned to its pool (or passed to ``dev.poison``) while a copy
uses it likewise; each case is a recorded violation. Note [Gates] in ``offcore_cpu.gates``:
every race here is made certain with a gate (``gate.wait_held``), never with timing.
Numpy tests run without torch (``tox -e core``); torch tests skip without it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest
from offcore_cpu.errors import GateTimeoutError, SanitizerViolation

from offcore import ConfigurationError, Tier

KiB = 1024


@pytest.fixture
def make_device(make_checked_device: Any) -> Any:
    return make_checked_device


@pytest.fixture(params=["numpy", "torch"])
def family(request: pytest.FixtureRequest) -> str:
    if request.param == "torch":
        pytest.importorskip("torch")
    return str(request.param)


def pattern(dev: Any, nbytes: int, tier: Tier = Tier.DEVICE) -> Any:
    """A buffer of ``tier`` holding bytes 0, 1, 2, ... (mod 251)."""
    buf = dev.allocate(nbytes, tier)
    values = np.arange(nbytes, dtype=np.uint64) % 251
    if isinstance(buf, np.ndarray):
        buf[:] = values.astype(np.uint8)
    else:
        import torch

        buf.copy_(torch.from_numpy(values.astype(np.uint8)))
    return buf


def as_numpy(buf: Any) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else buf.numpy()


def poisoned(buf: Any) -> bool:
    return bool((as_numpy(buf) == 0xFF).all())


def expected_pattern(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) % 251).astype(np.uint8)


# ============================================================================ device memory freed in flight


def test_a_device_source_freed_while_its_copy_is_held_delivers_poison(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream(name="d2h")
    device, host = pattern(dev, 4 * KiB), dev.allocate(4 * KiB, Tier.PINNED)
    with dev.gate(stream) as gate:
        done = dev.copy_(host, device, stream=stream)
        held = gate.wait_held(1)
        assert held == [{"copy": 1, "stream": "d2h", "direction": "d2h", "bytes": 4 * KiB}]
        assert dev.copies_in_flight == 1
        del device  # the planted early free: the copy has not read it yet
    done.synchronize()
    assert poisoned(host), "a copy whose source was freed must deliver poison, not the old bytes"
    (violation,) = dev.sanitizer_violations()
    assert violation["kind"] == "use-after-free" and violation["side"] == "source"
    assert (violation["copy"], violation["stream"], violation["direction"]) == (1, "d2h", "d2h")
    assert "freed" in violation["message"] and "copy #1" in violation["message"]
    with pytest.raises(SanitizerViolation, match=r"1 violation\(s\)") as caught:
        dev.check_sanitizer()
    assert caught.value.violations == [violation]
    assert dev.sanitizer_violations() == [], "check_sanitizer forgets what it reported"
    assert dev.copies_in_flight == 0


def test_a_device_source_kept_until_the_event_completes_is_copied_exactly(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream()
    device, host = pattern(dev, 4 * KiB), dev.allocate(4 * KiB, Tier.PINNED)
    with dev.gate(stream) as gate:
        done = dev.copy_(host[: 2 * KiB], device[: 2 * KiB], stream=stream)  # views: temporaries of kept buffers
        gate.wait_held(1)
        assert poisoned(host[: 2 * KiB]), "the destination holds poison while the copy is in flight"
    done.synchronize()
    np.testing.assert_array_equal(as_numpy(host[: 2 * KiB]), expected_pattern(2 * KiB))
    before = dev.memory_stats().allocated_bytes
    del device  # freed after the event completed: fine, and really freed at once
    assert dev.memory_stats().allocated_bytes == before - 4 * KiB
    assert dev.sanitizer_violations() == []
    dev.check_sanitizer()


def test_a_device_destination_freed_before_its_upload_landed_is_a_violation(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream()
    host, device = pattern(dev, 4 * KiB, Tier.PINNED), dev.allocate(4 * KiB, Tier.DEVICE)
    with dev.gate(stream, direction="h2d") as gate:
        done = dev.copy_(device, host, stream=stream)
        gate.wait_held(1)
        del device
    done.synchronize()
    (violation,) = dev.sanitizer_violations(clear=True)
    assert (violation["kind"], violation["side"], violation["direction"]) == ("use-after-free", "destination", "h2d")


def test_a_free_before_the_stream_reaches_the_copy_is_seen_too(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream()
    device, host = pattern(dev, 4 * KiB), dev.allocate(4 * KiB, Tier.PINNED)
    with dev.hold(stream) as hold:  # the stream stops before the copy
        done = dev.copy_(host, device, stream=stream)
        hold.wait_held(1)
        del device
        assert not done.query()
    done.synchronize()
    assert poisoned(host)
    (violation,) = dev.sanitizer_violations(clear=True)
    assert "before its stream reached it" in violation["message"]


def test_compute_stream_copies_and_unsanitized_devices_record_nothing(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    host = dev.allocate(64, Tier.PINNED)
    dev.copy_(host, pattern(dev, 64), stream=dev.current_stream())  # runs inside copy_: never in flight
    np.testing.assert_array_equal(as_numpy(host), expected_pattern(64))
    plain = make_device(buffers=family)
    stream = plain.new_stream()
    host = plain.allocate(64, Tier.PINNED)
    with plain.gate(stream) as gate:
        done = plain.copy_(host, pattern(plain, 64), stream=stream)  # the queued copy holds the temporary itself
        gate.wait_held(1)
        assert plain.copies_in_flight == 0
    done.synchronize()
    np.testing.assert_array_equal(as_numpy(host), expected_pattern(64))
    assert dev.sanitizer_violations() == [] and plain.sanitizer_violations() == []


HOLDERS = ["a view", "a detached alias", "the storage object", "a tensor set to the storage", "a numpy array"]


def make_holder(holder: str, base: Any) -> Any:
    import torch

    if holder == "a view":
        return base[8:]
    if holder == "a detached alias":
        return base.detach()
    if holder == "the storage object":
        return base.untyped_storage()
    if holder == "a tensor set to the storage":
        return torch.empty(0).set_(base.untyped_storage())
    return base.numpy()


@pytest.mark.parametrize("holder", HOLDERS)
def test_memory_still_held_elsewhere_is_not_reported(make_device: Any, holder: str) -> None:
    """Dropping the copied tensor frees nothing while anything else holds the storage: no false alarm."""
    torch = pytest.importorskip("torch")
    dev = make_device(sanitize=True)
    stream = dev.new_stream()
    with dev:
        base = torch.arange(1024, dtype=torch.float32)
    expected = base.clone()
    keep = make_holder(holder, base)
    host = dev.allocate(4 * KiB, Tier.PINNED)
    with dev.gate(stream) as gate:
        done = dev.copy_(host, base.view(torch.uint8), stream=stream)
        gate.wait_held(1)
        del base  # only `keep` holds the memory now
    done.synchronize()
    assert dev.sanitizer_violations() == []
    assert torch.equal(host.view(torch.float32), expected)
    del keep


# ============================================================================ host buffers released in flight


def test_a_host_buffer_returned_to_its_pool_during_its_upload_delivers_poison(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream(name="h2d")
    pool = dev.host_pool("1MiB", block_size="1MiB")
    staging = pool.acquire(4 * KiB)
    as_numpy(staging.view)[:] = expected_pattern(4 * KiB)
    device = dev.allocate(4 * KiB, Tier.DEVICE)
    with dev.gate(stream) as gate:
        done = dev.copy_(device, staging.view, stream=stream)
        gate.wait_held(1)
        pool.release(staging)  # the planted bug: back to the pool before the upload landed ...
        again = pool.acquire(4 * KiB)  # ... and handed out again, rewritten by its next owner
        as_numpy(again.view)[:] = expected_pattern(4 * KiB)
    done.synchronize()
    assert poisoned(device), "the upload must deliver poison, not the next owner's (here: identical) bytes"
    (violation,) = dev.sanitizer_violations(clear=True)
    assert (violation["kind"], violation["side"], violation["direction"]) == ("released-in-flight", "source", "h2d")
    assert "returned to its pool" in violation["message"]
    pool.release(again)


def test_a_download_into_a_released_host_buffer_corrupts_its_next_owner(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream()
    pool = dev.host_pool("1MiB", block_size="1MiB")
    staging = pool.acquire(4 * KiB)
    device = pattern(dev, 4 * KiB)
    with dev.gate(stream) as gate:
        done = dev.copy_(staging.view, device, stream=stream)
        gate.wait_held(1)
        pool.release(staging)
        again = pool.acquire(4 * KiB)
        as_numpy(again.view)[:] = 7  # the next owner's data
    done.synchronize()
    assert poisoned(again.view), "the late download lands in the next owner's bytes"
    (violation,) = dev.sanitizer_violations(clear=True)
    assert (violation["kind"], violation["side"], violation["direction"]) == (
        "released-in-flight",
        "destination",
        "d2h",
    )


def test_poisoning_a_buffer_a_copy_still_uses_is_a_release_too(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream()
    host, device = pattern(dev, 4 * KiB, Tier.PAGEABLE), dev.allocate(4 * KiB, Tier.DEVICE)
    with dev.gate(stream) as gate:
        done = dev.copy_(device, host, stream=stream)
        gate.wait_held(1)
        dev.poison(host[1024:2048])  # overlaps the copy's source
        dev.poison(dev.allocate(64, Tier.PINNED))  # unrelated: no violation
    done.synchronize()
    assert poisoned(device)
    (violation,) = dev.sanitizer_violations(clear=True)
    assert violation["kind"] == "released-in-flight" and "dev.poison" in violation["message"]


def test_releases_after_the_copy_landed_are_fine(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family, latency="1ms")
    stream = dev.new_stream()
    pool = dev.host_pool("1MiB", block_size="1MiB")
    for _ in range(20):
        staging = pool.acquire(4 * KiB)
        device = pattern(dev, 4 * KiB)
        done = dev.copy_(staging.view, device, stream=stream)
        done.synchronize()
        np.testing.assert_array_equal(as_numpy(staging.view), expected_pattern(4 * KiB))
        pool.release(staging)
        del device
    assert dev.sanitizer_violations() == []


# ============================================================================ gates


def test_a_copy_gate_holds_copies_after_poisoning_before_reading(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    stream = dev.new_stream()
    device, host = pattern(dev, 4 * KiB), pattern(dev, 4 * KiB, Tier.PINNED)
    with dev.gate(stream) as gate:
        assert gate.closed
        done = dev.copy_(host, device, stream=stream)
        gate.wait_held(1)
        assert poisoned(host), "reached: the destination holds poison"
        as_numpy(device)[:] = 9  # not read yet: the copy moves what is there when it lands
        assert not done.query() and len(gate.held()) == 1
    assert not gate.closed
    done.synchronize()
    assert gate.passed == 1 and gate.held() == []
    assert (as_numpy(host) == 9).all()


def test_a_copy_gate_filters_by_stream_and_direction(make_device: Any, family: str) -> None:
    dev = make_device(sanitize=True, buffers=family)
    held_stream, free_stream = dev.new_stream(name="held"), dev.new_stream(name="free")
    device, host = pattern(dev, 4 * KiB), pattern(dev, 4 * KiB, Tier.PINNED)
    out = dev.allocate(4 * KiB, Tier.PINNED)
    with dev.gate(held_stream, direction="d2h") as gate:
        dev.copy_(device, host, stream=held_stream).synchronize()  # h2d on the held stream: not held
        dev.copy_(out, device, stream=free_stream).synchronize()  # d2h on another stream: not held
        held = dev.copy_(out, device, stream=held_stream)
        assert gate.wait_held(1)[0]["stream"] == "held"
        assert not held.query()
    held.synchronize()
    assert [e["number"] for e in dev.copy_log()] == [1, 2, 3]


def test_a_gate_forces_small_copies_off_the_inline_path(make_device: Any) -> None:
    dev = make_device(buffers="numpy")  # no sanitizer: an idle stream would copy inline
    stream = dev.new_stream()
    device, host = pattern(dev, 64), dev.allocate(64, Tier.PINNED)
    host[:] = 0
    with dev.gate(stream) as gate:
        done = dev.copy_(host, device, stream=stream)
        gate.wait_held(1)
        assert not done.query() and not host.any(), "held: nothing moved yet"
    done.synchronize()
    np.testing.assert_array_equal(host, expected_pattern(64))


def test_closing_the_device_opens_its_gates(make_device: Any) -> None:
    dev = make_device(buffers="numpy", sanitize=True)
    stream = dev.new_stream()
    gate = dev.gate(stream)
    hold = dev.hold(dev.new_stream())
    done = dev.copy_(dev.allocate(64, Tier.PINNED), dev.allocate(64, Tier.DEVICE), stream=stream)
    gate.wait_held(1)
    closer = threading.Thread(target=dev.close)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() must not wait forever on a closed gate"
    assert not gate.closed and not hold.closed and done.query()
    dev.sanitizer_violations(clear=True)  # the device buffer was a temporary


def test_a_forgotten_gate_opens_itself_and_fails_the_test(make_device: Any) -> None:
    dev = make_device(buffers="numpy")
    stream = dev.new_stream()
    with pytest.raises(GateTimeoutError, match="left closed"):
        with dev.hold(stream, timeout=0.05) as hold:
            stream.synchronize()  # would hang without the timeout
    assert hold.timed_out and not hold.closed
    with pytest.raises(GateTimeoutError, match="0 item"):
        with dev.gate(stream, timeout=5) as gate:
            gate.wait_held(1, timeout=0.01)  # nothing was issued


def test_gate_arguments_are_checked(make_device: Any) -> None:
    dev = make_device(buffers="numpy")
    other = make_device(buffers="numpy")
    for bad in (dev.current_stream(), other.new_stream(), "stream"):
        with pytest.raises(ConfigurationError, match="copy stream of this device"):
            dev.gate(bad)
        with pytest.raises(ConfigurationError, match="copy stream of this device"):
            dev.hold(bad)
    with pytest.raises(ConfigurationError, match="direction"):
        dev.gate(direction="sideways")
    with pytest.raises(ConfigurationError, match="timeout"):
        dev.gate(timeout=0)


def test_the_copy_log_names_each_copy_and_its_buffers(make_device: Any, family: str) -> None:
    for sanitize in (False, True):
        dev = make_device(buffers=family, sanitize=sanitize)
        stream = dev.new_stream()
        device, host = pattern(dev, 256), dev.allocate(256, Tier.PINNED)
        dev.copy_(host, device, stream=stream).synchronize()
        dev.copy_(device[:128], host[128:], stream=dev.current_stream())
        ops = type(device)
        assert ops is type(host)
        first, second = dev.copy_log()
        address = (lambda b: b.__array_interface__["data"][0]) if family == "numpy" else (lambda b: b.data_ptr())
        assert (first["number"], first["src"], first["dst"]) == (1, address(device), address(host))
        assert (second["number"], second["src"], second["dst"]) == (2, address(host[128:]), address(device))


def test_a_busy_program_with_correct_waits_records_nothing(make_device: Any, family: str) -> None:
    """Round trips on two streams with jitter; every buffer dropped only after the events covering it: no alarm."""
    dev = make_device(sanitize=True, buffers=family, latency="50us", jitter="200us", seed=3)
    d2h, h2d = dev.new_stream(), dev.new_stream()
    pool = dev.host_pool("1MiB", block_size="64KiB")
    pending: list[tuple[Any, Any, Any, Any]] = []
    for i in range(40):
        device = pattern(dev, 2 * KiB)
        staging = pool.acquire(2 * KiB)
        done = dev.copy_(staging.view, device, stream=d2h)
        back = dev.allocate(2 * KiB, Tier.DEVICE)
        h2d.wait_event(done)  # the upload reads what the download wrote
        loaded = dev.copy_(back, staging.view, stream=h2d)
        pending.append((loaded, device, staging, back))
        if i % 4 == 3:  # retire the oldest round trips: their upload's event covers the download too
            while len(pending) > 2:
                loaded, device, staging, back = pending.pop(0)
                loaded.synchronize()
                np.testing.assert_array_equal(as_numpy(back), expected_pattern(2 * KiB))
                pool.release(staging)
                del device, back
    for loaded, _device, staging, back in pending:
        loaded.synchronize()
        np.testing.assert_array_equal(as_numpy(back), expected_pattern(2 * KiB))
        pool.release(staging)
    assert dev.sanitizer_violations() == []


@pytest.mark.parametrize("side", ["destination", "source"])
def test_a_storage_shrunk_under_a_queued_copy_is_a_violation_not_a_crash(make_device: Any, side: str) -> None:
    """``untyped_storage().resize_(0)`` frees a storage whatever aliases the copy holds: the sanitizer reports
    it and writes nothing there (it poisoned the freed memory before: the process crashed)."""
    pytest.importorskip("torch")
    dev = make_device(sanitize=True, buffers="torch")
    stream = dev.new_stream()
    device, host = dev.allocate(4 * KiB, Tier.DEVICE), pattern(dev, 4 * KiB, Tier.PINNED)
    dst, src = (device, host) if side == "destination" else (host, device)
    with dev.hold(stream) as hold:  # the stream stops before the copy
        done = dev.copy_(dst, src, stream=stream)
        hold.wait_held(1)
        device.untyped_storage().resize_(0)
    with contextlib.suppress(Exception):  # the copy itself may fail too (FreedStorageError): what matters is below
        done.synchronize()
    violations = dev.sanitizer_violations(clear=True)
    assert any(v["kind"] == "use-after-free" and v["side"] == side for v in violations), violations
    assert any("freed or shrunk (resize_)" in v["message"] for v in violations), violations


def test_the_ordering_sees_recordings_that_need_no_work_item() -> None:
    """The recordings the fast paths make without a work item (an idle copy stream's, an untimed one on the
    compute stream) still carry the sanitizer's clocks, and a query that finds one complete is observed."""
    from offcore_cpu.sanitizer import Ordering
    from offcore_cpu.streams import ComputeStream, FakeEvent, WorkerStream

    compute = ComputeStream()
    compute.order = order = Ordering()
    stream = WorkerStream(compute, name="idle")
    try:
        untimed = compute.record_event(FakeEvent(compute))
        assert untimed._clock is not None  # stamped: a stream that waits on it is ordered after the host
        observed: list[Any] = []
        seen = order.observe
        order.observe = lambda clock: (observed.append(clock), seen(clock))  # type: ignore[method-assign]
        landed = stream.record_event(FakeEvent(compute, enable_timing=True))  # idle: complete at once
        assert landed.query()
        assert observed == [landed._clock] and landed._clock is not None
    finally:
        stream.close()
