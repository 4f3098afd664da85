"""Prefetch never makes the allocator flush its cache more than once per backward.

A prefetch is speculative; a caching allocator that is asked for memory it does not have
frees its whole cache, with a device-wide synchronize, before it raises. offcore asks only
for what fits within the device's capacity, and after one refusal starts no more
prefetches in that backward round (Note [No speculative allocation after a refusal]).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

from offcore.errors import CapacityExceededError  # noqa: E402
from offcore.kinds import Tier  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    if not is_fake_device(backend):
        pytest.skip("counts the fake device's allocation calls")
    return make_fake_device(link="slow")


def model_and_input(dev: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with dev:
        layers = [m for _ in range(6) for m in (nn.Linear(256, 256), nn.Tanh())]
        model = nn.Sequential(*layers).to(dev.torch_device)
        x = torch.randn(256, 256, device=dev.torch_device)
    return model, x


def step(dev: Any, model: nn.Module, x: Any, **policy: Any) -> Any:
    with dev:
        with offcore_torch.offload_activations(dev, min_bytes=1, prefetch_budget="64MiB", **policy) as handle:
            loss = model(x).square().mean()
        settle(dev)  # every copy landed: backward must reload what it reads
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    settle(dev)
    return handle.stats(), grads


def test_one_refusal_stops_prefetching_for_the_round(dev: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = model_and_input(dev)
    _, want = step(dev, model, x)  # warm-up: the schedule is learnt, the next step prefetches
    calls: list[str] = []
    allocate = type(dev).allocate

    def refusing(self: Any, nbytes: int, tier: Any) -> Any:
        if Tier(tier) is Tier.DEVICE:
            calls.append("device")
            if len(calls) == 1:
                raise CapacityExceededError("the allocator has no room (planted, once)")
        return allocate(self, nbytes, tier)

    monkeypatch.setattr(type(dev), "allocate", refusing)
    stats, grads = step(dev, model, x)
    monkeypatch.undo()
    assert stats.kept.get("prefetch_oom") == 1 and len(calls) >= 1
    # every other reload went on demand, on the compute stream: one refused speculative ask
    assert calls.count("device") == 1 + stats.stalls, (calls, stats.stalls)
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
    stats, _ = step(dev, model, x)  # the next round prefetches again
    assert stats.prefetched_bytes > 0 and "prefetch_oom" not in stats.kept


def test_a_prefetch_that_cannot_fit_the_capacity_is_not_asked_for(dev: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = model_and_input(dev)
    _, want = step(dev, model, x)
    memory_stats = type(dev).memory_stats
    full = {"on": False}

    def reporting_full(self: Any) -> Any:
        stats = memory_stats(self)
        if full["on"]:
            stats["allocated_bytes"] = stats["capacity_bytes"]  # as if the device were full
        return stats

    allocated_bytes = getattr(type(dev), "allocated_bytes", None)

    def reporting_full_bytes(self: Any) -> int:  # the optional fast read the binding prefers
        return int(reporting_full(self)["allocated_bytes"])

    calls: list[int] = []
    allocate = type(dev).allocate

    def counting(self: Any, nbytes: int, tier: Any) -> Any:
        if Tier(tier) is Tier.DEVICE:
            calls.append(nbytes)
        return allocate(self, nbytes, tier)

    monkeypatch.setattr(type(dev), "memory_stats", reporting_full)
    if allocated_bytes is not None:
        monkeypatch.setattr(type(dev), "allocated_bytes", reporting_full_bytes)
    monkeypatch.setattr(type(dev), "allocate", counting)
    with dev:
        with offcore_torch.offload_activations(dev, min_bytes=1, prefetch_budget="64MiB") as handle:
            loss = model(x).square().mean()
            full["on"] = True  # from the end of forward, where prefetching starts
        settle(dev)
        loss.backward()
        full["on"] = False
        grads = [p.grad.clone() for p in model.parameters()]
    settle(dev)
    stats = handle.stats()
    assert stats.kept.get("prefetch_no_room", 0) > 0 and stats.prefetched_bytes == 0
    assert len(calls) == stats.stalls, "only on-demand reloads asked the allocator"
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
