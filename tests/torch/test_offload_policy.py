"""Policies that depend on memory: the host budget's fallback and the device watermark."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

from offcore.protocols import MemoryStats  # noqa: E402


def build(dev: Any, width: int = 256, depth: int = 4) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with dev:  # built while the device is active: the fake device counts the parameters
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(width, 1)).to(dev.torch_device)
        x = torch.randn(256, width, device=dev.torch_device)
    return model, x


def step_grads(dev: Any, model: nn.Module, x: Any, **policy: Any) -> tuple[list[Any], Any]:
    model.zero_grad(set_to_none=True)
    with dev:
        if policy:
            with offcore_torch.offload_activations(dev, **policy) as handle:
                loss = model(x).square().mean()
        else:
            handle, loss = None, model(x).square().mean()
        loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, handle


@pytest.mark.parametrize("fallback", ["pageable", "keep"])
def test_exhausted_host_budget_falls_back_without_failing_the_step(
    backend: Any, make_fake_device: Any, fallback: str
) -> None:
    dev = sanitized_device(backend, make_fake_device, link="slow")
    model, x = build(dev)
    expected, _ = step_grads(dev, model, x)
    # each saved activation is 256 KiB: the 600 KiB budget holds two of them
    got, handle = step_grads(dev, model, x, min_bytes=1, host_budget="600KiB", fallback=fallback)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    stats = handle.stats()
    assert stats.fallbacks > 0
    assert stats.offloaded_storages >= 2
    if fallback == "pageable":
        assert stats.peak_pageable_bytes > 0
        assert stats.kept.get("host_budget", 0) == 0
    else:
        assert stats.peak_pageable_bytes == 0
        assert stats.kept["host_budget"] == stats.fallbacks
    assert stats.peak_pinned_bytes <= 600 * 1024
    settle(dev)


def test_watermark_offloads_only_under_memory_pressure(backend: Any, make_fake_device: Any) -> None:
    if not is_fake_device(backend):
        pytest.skip("needs a device whose capacity the test chooses (the fake device)")
    dev = make_fake_device(link="unlimited", capacity="8MiB")
    model, x = build(dev)  # ~1.3 MiB of parameters and batch; 256 KiB per saved activation
    with dev:
        with offcore_torch.offload_activations(dev, min_bytes=1) as always:
            loss = model(x).square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        settle(dev)
        with offcore_torch.offload_activations(dev, min_bytes=1, watermark=0.8) as pressured:
            loss = model(x).square().mean()
        loss.backward()
    stats = pressured.stats()
    assert stats.kept["watermark"] >= 1, "the first activations fit while free memory is above 80%"
    assert 0 < stats.offloaded_storages < always.stats().offloaded_storages


class _ScriptedMemory:
    """memory_stats() returning free fractions from a script (tests the hysteresis rule alone)."""

    def __init__(self, device: Any, free_fractions: list[float]) -> None:
        self.device, self.free = device, list(free_fractions)

    def __call__(self) -> MemoryStats:
        capacity = 1000
        free = int(self.free.pop(0) * capacity)
        return MemoryStats(
            allocated_bytes=capacity - free, peak_allocated_bytes=capacity, capacity_bytes=capacity, free_bytes=free
        )


def test_watermark_hysteresis(backend: Any, make_fake_device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = sanitized_device(backend, make_fake_device)
    handle = offcore_torch.offload_activations(dev, watermark=0.5, hysteresis=0.05)
    script = [0.60, 0.45, 0.52, 0.55, 0.56, 0.52, 0.49]
    expected = [False, True, True, True, False, False, True]
    monkeypatch.setattr(dev, "memory_stats", _ScriptedMemory(dev, script))
    assert [handle._under_pressure() for _ in script] == expected
