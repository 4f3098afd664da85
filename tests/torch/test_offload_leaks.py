"""Nothing leaks: device, pinned and pageable bytes return to where they started.

Whether backward runs fully, partly or never, and whether forward raises, every
step's device memory, host-pool buffers and pageable fallbacks are given back
(``gc.collect()`` and ``offcore_torch.synchronize`` settle what is in flight). A leak
test that passes because nothing was offloaded proves nothing: on the fake device every
scenario must also have moved bytes, by the device's own ledger (not offcore's counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import copied_bytes, moved_since, pool_used_bytes, sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def levels(dev: Any) -> dict[str, int]:
    stats = dev.memory_stats()
    return {
        "device": stats.allocated_bytes,
        "pinned pool in use": pool_used_bytes(dev),
        "pageable": int(stats.get("pageable_bytes", 0)),
    }


def build(dev: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with dev:  # built while the device is active: the fake device counts the parameters
        model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
        model = model.to(dev.torch_device)
        x = torch.randn(128, 128, device=dev.torch_device)
    return model, x


def full_step(dev: Any, model: nn.Module, x: Any, **policy: Any) -> Any:
    with offcore_torch.offload_activations(dev, min_bytes=1, **policy) as handle:
        loss = model(x).square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return handle


def forward_only(dev: Any, model: nn.Module, x: Any, **policy: Any) -> None:
    with offcore_torch.offload_activations(dev, min_bytes=1, **policy):
        loss = model(x).square().mean()
    del loss  # the step is abandoned: backward never runs


def forward_raises(dev: Any, model: nn.Module, x: Any, **policy: Any) -> None:
    with pytest.raises(ValueError, match="boom"):
        with offcore_torch.offload_activations(dev, min_bytes=1, **policy):
            h = model[:4](x)
            if h.shape[0] > 0:
                raise ValueError("boom")


def partial_backward(dev: Any, model: nn.Module, x: Any, **policy: Any) -> None:
    with offcore_torch.offload_activations(dev, min_bytes=1, **policy):
        h = model[:2](x)
        loss = model[2:](h).square().mean()
    torch.autograd.grad(loss, [h])  # only the head's part of the graph runs
    del loss, h


def backward_raises(dev: Any, model: nn.Module, x: Any, **policy: Any) -> None:
    with offcore_torch.offload_activations(dev, min_bytes=1, **policy):
        loss = model(x).square().mean()
    with torch.no_grad():
        model[2].weight.add_(0.0)  # bumps the version: backward raises mid-way
    with pytest.raises(offcore.SavedTensorModifiedError):
        loss.backward()
    model.zero_grad(set_to_none=True)
    del loss


SCENARIOS: dict[str, Callable[..., None]] = {
    "full_step": full_step,
    "backward_raises": backward_raises,
    "forward_only": forward_only,
    "forward_raises": forward_raises,
    "partial_backward": partial_backward,
}

# Whether each scenario reloads (host to device). Forward copies to the host in all of them.
# Whether backward reloads depends on whether a device copy was freed before it needed it
# (its D2H landed in time): timing, so not asserted (None). A forward that raised makes no
# prefetch plan and runs no backward: it never reloads.
RELOADS: dict[str, bool | None] = {
    "full_step": None,
    "backward_raises": None,
    "forward_only": None,
    "forward_raises": False,
    "partial_backward": None,
}


def assert_moved(dev: Any, before: dict[str, int] | None, *, reloads: bool | None) -> None:
    """The step really offloaded (and reloaded, when ``reloads``), by the fake device's ledger."""
    if before is None:
        return  # a real accelerator keeps no ledger of its own
    moved = moved_since(dev, before)
    assert moved["d2h"] > 0, "nothing was copied to the host: the leak check would prove nothing"
    if reloads is not None:
        assert (moved["h2d"] > 0) is reloads, moved


@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_memory_returns_to_its_starting_level(dev: Any, scenario: str, prefetch: str) -> None:
    model, x = build(dev)
    with dev:
        SCENARIOS["full_step"](dev, model, x, prefetch=prefetch)  # warm-up: pools and streams exist
        settle(dev)
        before = levels(dev)
        copies = copied_bytes(dev) if is_fake_device(dev) else None
        SCENARIOS[scenario](dev, model, x, prefetch=prefetch)
        settle(dev)
        assert levels(dev) == before
        assert_moved(dev, copies, reloads=RELOADS[scenario])


def test_twenty_steps_keep_memory_flat(dev: Any) -> None:
    model, x = build(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[dict[str, int]] = []
    with dev:
        for step in range(20):
            copies = copied_bytes(dev) if is_fake_device(dev) else None
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                loss = model(x).square().mean()
            if step % 4 == 3:
                del loss  # abandon every fourth step
            else:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
            assert handle.stats().offloaded_storages > 0
            del handle
            settle(dev)
            assert_moved(dev, copies, reloads=None)
            seen.append(levels(dev))
    assert all(level == seen[1] for level in seen[1:]), seen  # step 0 creates the optimizer's state


def test_fallback_buffers_are_returned_too(backend: Any, make_fake_device: Any) -> None:
    dev = sanitized_device(backend, make_fake_device, link="slow")
    model, x = build(dev)
    with dev:
        stats = full_step(dev, model, x, host_budget="64KiB", fallback="pageable").stats()
        assert stats.fallbacks > 0 and stats.peak_pageable_bytes > 0
        settle(dev)
        before = levels(dev)
        for step in (full_step, forward_only, partial_backward):
            copies = copied_bytes(dev) if is_fake_device(dev) else None
            step(dev, model, x, host_budget="64KiB", fallback="pageable")
            settle(dev)
            assert levels(dev) == before
            assert_moved(dev, copies, reloads=None)


def test_pack_makes_no_python_object_of_autograd_nodes(dev: Any) -> None:
    """Deciding whether a saved tensor is a parameter must not read ``grad_fn`` (it would make each node's
    Python object, alive until backward: one more object per saved tensor for the garbage collector)."""
    import gc

    def live_nodes() -> int:
        return sum(1 for o in gc.get_objects() if type(o).__name__.endswith("Backward0"))

    with dev:
        x = torch.randn(256, device=dev.torch_device, requires_grad=True)
        gc.collect()
        before = live_nodes()
        with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            y = x * 1.0
            for _ in range(16):
                y = torch.sin(y)
            loss = y.sum()
        assert handle.stats().offloaded_storages >= 16  # the tensors went through pack's decisions
        assert live_nodes() - before == 0
        loss.backward()
        offcore_torch.synchronize(dev)
