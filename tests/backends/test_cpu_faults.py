"""Fault injection on the CPU fake device: ``fail_copy=N``, ``fail_copy_mode``, ``dev.inject_copy_fault``.

See Note [Injected copy faults] in ``offcore_cpu/copying.py``. Numpy buffers unless a test
says otherwise; no test asserts a wall-clock duration (gates order the work).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from offcore_cpu.device import FakeDevice
from offcore_cpu.errors import InjectedFault, StreamWorkError

import offcore
from offcore import ConfigurationError, OffcoreError, Tier

KiB, MiB = 1 << 10, 1 << 20
FAST = {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0}


@pytest.fixture
def make_device() -> Iterator[Any]:
    made: list[FakeDevice] = []

    def make(**options: Any) -> FakeDevice:
        dev = offcore.device("cpu", **{"capacity": "64MiB", "buffers": "numpy", **options})
        made.append(dev)
        return dev

    yield make
    for dev in made:
        dev.close()


@contextlib.contextmanager
def _gate(stream: Any) -> Iterator[threading.Event]:
    """Block ``stream`` until the gate is set; set in ``finally`` so a failing test never hangs the run."""
    gate = threading.Event()
    stream.launch_host_func(gate.wait)
    try:
        yield gate
    finally:
        gate.set()


def _buffers(dev: FakeDevice, nbytes: int) -> tuple[Any, Any]:
    """A device buffer holding a byte pattern and a zeroed pinned buffer of the same size."""
    device, host = dev.allocate(nbytes, Tier.DEVICE), dev.allocate(nbytes, Tier.PINNED)
    device[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    host[:] = 0
    return device, host


def _worker_started(name: str) -> bool:
    return any(t.name.endswith(f" {name}") for t in threading.enumerate())


# ============================================================================ options


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        ({"fail_copy": -1}, "fail_copy"),
        ({"fail_copy": "3"}, "fail_copy"),
        ({"fail_copy": True}, "fail_copy"),
        ({"fail_copy": 1.5}, "fail_copy"),
        ({"fail_copy": 2, "fail_copy_mode": "later"}, "fail_copy_mode"),
        ({"fail_copy_mode": None}, "fail_copy_mode"),
        ({"fail_copy_mode": ["stream"]}, "fail_copy_mode"),
    ],
)
def test_bad_fault_options_are_refused(options: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ConfigurationError, match=complaint):
        offcore.device("cpu", buffers="numpy", **options)


def test_unknown_option_message_lists_the_fault_options() -> None:
    with pytest.raises(ConfigurationError, match="fail_copy, fail_copy_mode"):
        offcore.device("cpu", buffers="numpy", fail_copies=1)


@pytest.mark.parametrize("off", [None, 0])
def test_fail_copy_none_or_zero_disables(make_device: Any, off: Any) -> None:
    dev = make_device(fail_copy=off, **FAST)
    assert dev.options.fail_copy is None
    device, host = _buffers(dev, 4 * KiB)
    for _ in range(3):
        dev.copy_(host, device, stream=dev.current_stream())
    assert np.array_equal(host, device)


def test_inject_copy_fault_refuses_bad_arguments(make_device: Any) -> None:
    dev = make_device()
    for nth in (-1, "2", 2.0, False):
        with pytest.raises(ConfigurationError, match="nth"):
            dev.inject_copy_fault(nth)
    with pytest.raises(ConfigurationError, match="mode"):
        dev.inject_copy_fault(1, mode="worker")


def test_injected_fault_is_an_offcore_error_and_pickles() -> None:
    fault = InjectedFault("copy #3 failed: fault injected by fail_copy=3", copy_number=3, mode="stream")
    assert isinstance(fault, OffcoreError) and isinstance(fault, RuntimeError)
    back = pickle.loads(pickle.dumps(fault))
    assert (type(back), str(back), back.copy_number, back.mode) == (InjectedFault, str(fault), 3, "stream")
    import offcore_cpu

    assert offcore_cpu.InjectedFault is InjectedFault


# ============================================================================ mode "submit"


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_submit_fault_raises_at_once_and_changes_nothing(make_device: Any, sanitize: bool) -> None:
    dev = make_device(sanitize=sanitize, jitter="100us", latency="50us", fail_copy=2)
    stream = dev.new_stream(name="submit-fault")
    device, host = _buffers(dev, 4 * KiB)
    dev.copy_(host, device, stream=dev.current_stream())  # copy #1 (compute stream): no worker thread
    host[:] = 0
    stats, ledger, log = dev.memory_stats(), dev.ledger.snapshot(), dev.copy_log()
    link_free_at = dev._link.booked_until()

    with pytest.raises(InjectedFault, match=r"copy #2 .*fault injected by fail_copy=2 \(mode 'submit'\)") as caught:
        dev.copy_(host, device, stream=stream)
    assert isinstance(caught.value, OffcoreError)
    assert (caught.value.copy_number, caught.value.mode) == (2, "submit")
    # nothing happened: no memory, no link booking, no ledger or log entry, nothing enqueued
    assert dev.memory_stats() == stats
    assert dev.ledger.snapshot() == ledger and dev.copy_log() == log
    assert dev._link.booked_until() == link_free_at
    assert stream.query() and "pending=0" in repr(stream)
    assert not _worker_started("submit-fault"), "the failed copy reached the stream"
    assert not host.any(), "the destination was touched"
    stream.synchronize()  # no failure pending on the stream

    done = dev.copy_(host, device, stream=stream)  # copy #3 works, byte for byte
    done.synchronize()
    assert np.array_equal(host, device)
    assert len(dev.copy_log()) == 2
    dev.copy_(host, device, stream=stream).synchronize()  # the fault fired once


def test_submit_fault_draws_no_jitter(make_device: Any) -> None:
    """The sanitizer's seeded jitter sequence is the same as on a device where the copy never happened."""
    reference = make_device(sanitize=True, jitter="1ms", seed=7)
    faulty = make_device(sanitize=True, jitter="1ms", seed=7, fail_copy=1)
    for dev in (reference, faulty):
        stream = dev.new_stream()
        device, host = _buffers(dev, 4 * KiB)
        if dev is faulty:
            with pytest.raises(InjectedFault):
                dev.copy_(host, device, stream=stream)
        dev.copy_(host, device, stream=stream).synchronize()
    assert reference.copy_log()[0]["emulated_seconds"] == faulty.copy_log()[0]["emulated_seconds"]


# ============================================================================ mode "stream"

# (sanitize, how the copy reaches its stream)
STREAM_CASES = [
    (False, "inline"),  # small copy on an idle stream: Note [Inline copies on an idle stream]
    (False, "queued"),  # small copy behind queued work
    (False, "large"),  # above the inline limit: always the worker
    (True, "queued"),
    (True, "small"),  # the sanitizer keeps every copy on the worker
]


@pytest.mark.parametrize(
    ("sanitize", "path"), STREAM_CASES, ids=[f"{'sanitized' if s else 'plain'}-{p}" for s, p in STREAM_CASES]
)
def test_stream_fault_fails_on_the_stream_like_a_real_failure(make_device: Any, sanitize: bool, path: str) -> None:
    dev = make_device(sanitize=sanitize, jitter="100us", fail_copy=1, fail_copy_mode="stream", **FAST)
    name = f"stream-fault-{path}-{sanitize}"
    stream = dev.new_stream(name=name)
    nbytes = 2 * MiB if path == "large" else 4 * KiB
    device, host = _buffers(dev, nbytes)
    with _gate(stream) if path == "queued" else contextlib.nullcontext() as gate:
        before = stream.record_event()
        failed = dev.copy_(host, device, stream=stream)  # enqueued: no error yet
        if path == "inline":
            assert not _worker_started(name), "an inline copy must fail on the calling thread"
        later = stream.record_event()
        if gate is not None:
            assert not failed.query()  # still queued behind the gate
            gate.set()

    with pytest.raises(StreamWorkError, match=r"InjectedFault: copy #1 .*fail_copy=1 \(mode 'stream'\)") as caught:
        failed.synchronize()
    assert isinstance(caught.value.__cause__, InjectedFault) and caught.value.__cause__.mode == "stream"
    with pytest.raises(StreamWorkError):
        failed.query()
    with pytest.raises(StreamWorkError, match="fail_copy=1"):  # later events carry the failure
        later.synchronize()
    before.synchronize()  # recorded before the failing copy: fine
    if sanitize:
        assert (host == 0xFF).all(), "the failed copy's destination must hold poison"
    else:
        assert not host.any(), "a failed copy moves no bytes"
    assert dev.ledger.snapshot() == offcore.Ledger().snapshot() and dev.copy_log() == []

    with pytest.raises(StreamWorkError, match="fail_copy=1"):
        stream.synchronize()  # raised once ...
    stream.synchronize()  # ... and cleared
    dev.synchronize()
    stream.record_event().synchronize()  # events no longer carry it

    done = dev.copy_(host, device, stream=stream)  # the stream works again, byte for byte
    done.synchronize()
    assert np.array_equal(host, device)
    assert len(dev.copy_log()) == 1


def test_stream_fault_surfaces_on_device_synchronize(make_device: Any) -> None:
    dev = make_device(fail_copy=1, fail_copy_mode="stream", **FAST)
    stream = dev.new_stream()
    device, host = _buffers(dev, 4 * KiB)
    dev.copy_(host, device, stream=stream)
    with pytest.raises(StreamWorkError, match="fail_copy=1"):
        dev.synchronize()
    dev.synchronize()


def test_a_stream_waiting_on_the_failed_copy_inherits_the_failure(make_device: Any) -> None:
    dev = make_device(fail_copy=1, fail_copy_mode="stream", **FAST)
    producer, consumer = dev.new_stream(), dev.new_stream()
    device, host = _buffers(dev, 4 * KiB)
    with _gate(producer) as gate:
        failed = dev.copy_(host, device, stream=producer)
        consumer.wait_event(failed)
        gate.set()
    with pytest.raises(StreamWorkError, match="fail_copy=1"):
        consumer.synchronize()
    with pytest.raises(StreamWorkError):
        dev.current_stream().wait_event(failed)


@pytest.mark.parametrize("mode", ["submit", "stream"])
def test_a_fault_on_the_compute_stream_is_raised_by_copy(make_device: Any, mode: str) -> None:
    # the compute stream is the calling thread: its copies run (and fail) inside copy_
    dev = make_device(sanitize=True, fail_copy=1, fail_copy_mode=mode, **FAST)
    device, host = _buffers(dev, 4 * KiB)
    with pytest.raises(InjectedFault, match=f"mode '{mode}'"):
        dev.copy_(host, device, stream=dev.current_stream())
    assert (host == 0xFF).all() if mode == "stream" else not host.any()
    dev.copy_(host, device, stream=dev.current_stream())
    assert np.array_equal(host, device)


def test_stream_fault_with_torch_buffers(make_device: Any) -> None:
    torch = pytest.importorskip("torch")
    dev = make_device(buffers="torch", sanitize=True, jitter="100us", **FAST)
    stream = dev.new_stream()
    with dev:
        x = torch.arange(1024, dtype=torch.float32)
    host = dev.allocate(x.nbytes, Tier.PINNED).view(torch.float32)
    dev.inject_copy_fault(1, mode="stream")
    failed = dev.copy_(host, x, stream=stream)
    with pytest.raises(StreamWorkError, match="inject_copy_fault"):
        failed.synchronize()
    assert torch.isnan(host).all(), "the sanitizer poisons the failed copy's destination"
    with pytest.raises(StreamWorkError):
        stream.synchronize()
    dev.copy_(host, x, stream=stream).synchronize()
    assert torch.equal(host, x)


# ============================================================================ re-arming


def test_inject_copy_fault_counts_from_now_and_fires_once(make_device: Any) -> None:
    dev = make_device(**FAST)
    compute = dev.current_stream()
    device, host = _buffers(dev, KiB)

    def copy() -> None:
        dev.copy_(host, device, stream=compute)

    copy()
    copy()
    dev.inject_copy_fault(2)  # the 2nd copy from now: copy #4 of the device
    copy()
    with pytest.raises(InjectedFault, match=r"copy #4 .*dev\.inject_copy_fault\(2, mode='submit'\)") as caught:
        copy()
    assert caught.value.copy_number == 4
    for _ in range(3):
        copy()  # one-shot

    dev.inject_copy_fault(1)
    dev.inject_copy_fault(None)  # disarmed
    copy()
    dev.inject_copy_fault(3)
    dev.inject_copy_fault(1)  # replaces the armed fault
    with pytest.raises(InjectedFault):
        copy()
    copy()
    copy()  # the replaced fault (3rd from its arming) does not fire either
    dev.inject_copy_fault()  # default: the next copy
    with pytest.raises(InjectedFault):
        copy()


def test_inject_copy_fault_replaces_the_option(make_device: Any) -> None:
    dev = make_device(fail_copy=1, **FAST)
    device, host = _buffers(dev, KiB)
    dev.inject_copy_fault(0)
    dev.copy_(host, device, stream=dev.current_stream())
    assert np.array_equal(host, device)


def test_exactly_one_copy_fails_when_threads_copy_at_once(make_device: Any) -> None:
    dev = make_device(fail_copy=37, **FAST)
    failures: list[InjectedFault] = []
    lock = threading.Lock()

    def worker() -> None:
        device, host = _buffers(dev, 256)
        for _ in range(25):
            try:
                dev.copy_(host, device, stream=dev.current_stream())
            except InjectedFault as exc:
                with lock:
                    failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [f.copy_number for f in failures] == [37]
