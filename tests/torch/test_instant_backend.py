"""The instant backend (offcore_torch.instant): the conformance suite, and activation offload bit-exact on it.

``benchmarks/hook_overhead.py`` measures offcore's own cost per object on this backend;
these tests keep it a correct backend (every conformance test) on which offload
restores every saved tensor bit for bit, so what the benchmark times is real work.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.instant import InstantDevice, register_instant  # noqa: E402

import offcore  # noqa: E402

register_instant()

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.torch


SUITE = """
from offcore_torch.instant import register_instant
from offcore.testing import BackendConformance

register_instant()

class TestInstant(BackendConformance):
    backend_spec = "instant"
    backend_options = {"capacity": "256MiB"}
    hypothesis_examples = 15
"""


@pytest.mark.slow
def test_conformance_suite_passes(pytester: pytest.Pytester) -> None:
    """The whole suite, in a subprocess that selects every registered backend (the "instant" one included)."""
    pytester.makepyfile(test_instant_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 40, result.stdout.str()
    assert not outcomes.get("failed") and not outcomes.get("errors"), result.stdout.str()


def test_registered_and_constructed_by_name() -> None:
    offcore.registry.reset_registry()  # as tests/core's registry tests leave it
    register_instant()  # a second call does nothing; after offcore.registry.reset_registry() it registers again
    dev = offcore.device("instant", capacity="1MiB")
    assert isinstance(dev, InstantDevice)
    host = dev.allocate(64, offcore.Tier.PINNED)
    device = dev.allocate(64, offcore.Tier.DEVICE)
    assert not dev.holds(host) and dev.holds(device)
    assert dev.memory_stats().allocated_bytes == 64
    with pytest.raises(offcore.CapacityExceededError):
        dev.allocate(2 << 20, offcore.Tier.DEVICE)


def test_offload_on_the_instant_backend_is_bit_exact() -> None:
    register_instant()  # again: a test before may have reset offcore's registry
    dev = offcore.device("instant")

    def step(offload: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        with offcore_torch.offload_activations(dev, min_bytes=0) if offload else torch.enable_grad() as handle:
            y = x
            for _ in range(6):
                y = torch.tanh(y @ w)
            loss = y.square().sum()
        loss.backward()
        if offload:
            assert handle.stats().offloaded_storages >= 6
        return x.grad, w.grad

    kept, offloaded = step(False), step(True)
    for a, b in zip(kept, offloaded, strict=True):
        assert torch.equal(a, b)


def test_a_buffer_freed_by_a_collection_inside_the_devices_lock_does_not_deadlock() -> None:
    """A storage's death callback takes the device's lock; a collection run while this thread holds it (the
    device makes objects there, and one may trigger the collector) frees a buffer kept alive by a cycle."""
    import gc
    import threading

    dev = InstantDevice(capacity="1MiB")
    buffer = dev.allocate(4096, offcore.Tier.DEVICE)
    cycle: list[object] = [buffer]
    cycle.append(cycle)  # only the collector frees it
    del buffer
    assert dev.memory_stats().allocated_bytes == 4096
    del cycle

    def collect_inside_the_lock() -> None:
        with dev._lock:
            gc.collect()  # the buffer dies here: _device_freed runs on this thread

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=60)  # a bound on a deadlock, not a wait for a result
    assert not worker.is_alive(), "the device's lock deadlocked in a storage's death callback"
    assert dev.memory_stats().allocated_bytes == 0
