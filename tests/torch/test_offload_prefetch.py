"""Deadline prefetch: reloads start before backward needs them, within a byte budget, at measured speed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402
from offcore.scheduler import Scheduler, StepObservation  # noqa: E402

WIDTH, ROWS, DEPTH = 512, 256, 6
ACTIVATION = WIDTH * ROWS * 4  # bytes of one saved activation


@pytest.fixture
def dev(backend: Any) -> Iterator[Any]:
    """Ample bandwidth and the sanitizer on (with small jitter, so copies stay short next to compute)."""
    if not is_fake_device(backend):
        yield backend
        return
    device = offcore.device(
        "cpu",
        capacity="4GiB",
        sanitize=True,
        h2d_bandwidth="8GiB/s",
        d2h_bandwidth="8GiB/s",
        latency="10us",
        jitter="20us",
    )
    yield device
    device.synchronize()
    device.close()


def build(dev: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with dev:
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(WIDTH, 1)).to(dev.torch_device)
        x = torch.randn(ROWS, WIDTH, device=dev.torch_device)
    return model, x


def train(dev: Any, steps: int = 3, **policy: Any) -> list[Any]:
    model, x = build(dev)
    handles = []
    with dev:
        for _ in range(steps):
            with offcore_torch.offload_activations(dev, min_bytes=1, **policy) as handle:
                loss = model(x).square().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
            handles.append(handle)
    return [h.stats() for h in handles]


def test_steady_state_reloads_are_prefetched_before_use(dev: Any) -> None:
    stats = train(dev, steps=3, prefetch="deadline")[-1]
    assert stats.stalls == 0, stats.stalled_objects
    assert stats.prefetch_hits >= DEPTH - 1
    assert stats.prefetched_bytes >= (DEPTH - 1) * ACTIVATION
    assert stats.reloaded_bytes == stats.prefetched_bytes


def test_on_demand_reloads_stall_every_time(dev: Any) -> None:
    stats = train(dev, steps=3, prefetch="on_demand")[-1]
    assert stats.prefetched_bytes == 0
    assert stats.stalls >= DEPTH - 1
    assert len(stats.stalled_objects) == stats.stalls
    assert set(stats.waits) >= set(stats.stalled_objects)  # each stall is charged to its object


def test_prefetch_budget_is_counted_in_bytes(dev: Any) -> None:
    budget = ACTIVATION * 3 // 2  # one activation ahead, not two
    stats = train(dev, steps=3, prefetch_budget=budget)[-1]
    assert 0 < stats.peak_prefetched_bytes <= budget
    assert stats.prefetched_bytes > 0


def test_zero_budget_disables_prefetch(dev: Any) -> None:
    stats = train(dev, steps=2, prefetch_budget=0)[-1]
    assert stats.prefetched_bytes == 0
    assert stats.stalls > 0


def test_copy_bandwidth_is_measured_not_assumed(dev: Any) -> None:
    stats = train(dev, steps=2)[-1]
    runtime = runtime_for(dev)
    assert runtime.d2h_link.samples > 0 and runtime.h2d_link.samples > 0
    assert stats.d2h_bandwidth > 0 and stats.h2d_bandwidth > 0
    if is_fake_device(dev):  # an emulated copy never beats its link (8 GiB/s)
        assert stats.d2h_bandwidth <= 1.05 * 8 * 2**30
        assert stats.h2d_bandwidth <= 1.05 * 8 * 2**30


def test_a_schedule_object_learns_across_steps(dev: Any) -> None:
    schedule = Scheduler(margin="0.2ms")
    before = runtime_for(dev).scheduler.steps_observed
    train(dev, steps=3, schedule=schedule)
    assert schedule.steps_observed == 3
    assert runtime_for(dev).scheduler.steps_observed == before  # the device default was not used
    predicted = schedule.predict(StepObservation(pack_times=dict.fromkeys(range(4 * DEPTH), 0.0)))
    assert predicted and all(t >= 0 for t in predicted.values())
