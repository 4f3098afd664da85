"""Graphs other than one forward + one full backward: partial, retained, several in flight, checkpointed."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import copied_bytes, moved_since, pool_used_bytes, sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def make_mlp(dev: Any, width: int = 128, depth: int = 3) -> Any:
    torch.manual_seed(0)
    with dev:  # built while the device is active: the fake device counts the parameters
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(width, 1)).to(dev.torch_device)


def grads_of(model: nn.Module) -> list[Any]:
    return [p.grad.detach().clone() for p in model.parameters()]


def reference_grads(model: nn.Module, x: Any, *, times: int = 1) -> list[Any]:
    model.zero_grad(set_to_none=True)
    for _ in range(times):
        model(x).square().mean().backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return grads


def assert_equal_grads(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_partial_backward_then_the_rest(dev: Any) -> None:
    with dev:
        x = torch.randn(64, 128, device=dev.torch_device)
        trunk, left, right = make_mlp(dev, depth=2), make_mlp(dev, depth=1), make_mlp(dev, depth=1)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            h = trunk[:-1](x)
            loss_left, loss_right = left(h).square().mean(), right(h).square().mean()
            settle(dev)
        # only the left head's parameters: part of the graph runs, the right head's saves stay offloaded
        partial = torch.autograd.grad(loss_left, list(left.parameters()), retain_graph=True)
        (loss_left + loss_right).backward()
        for got in partial:
            assert torch.isfinite(got).all()

        ref_left = torch.autograd.grad(left(trunk[:-1](x)).square().mean(), list(left.parameters()))
    for got, expected in zip(partial, ref_left, strict=True):
        assert torch.equal(got, expected)
    assert handle.stats().reloaded_bytes > 0


def test_retain_graph_allows_a_second_backward_from_the_host_copy(dev: Any) -> None:
    with dev:
        model = make_mlp(dev)
        x = torch.randn(64, 128, device=dev.torch_device)
        expected = reference_grads(model, x, times=2)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = model(x).square().mean()
            settle(dev)  # every copy landed and was released: backward reads the host copies
        loss.backward(retain_graph=True)
        first_reload = handle.stats().reloaded_bytes
        settle(dev)  # autograd freed what the first backward used: the second reloads from the host
        loss.backward()
        assert_equal_grads(grads_of(model), expected)
    stats = handle.stats()
    assert first_reload > 0
    assert stats.reloaded_bytes > first_reload
    del loss
    settle(dev)
    assert pool_used_bytes(dev) == 0


@pytest.mark.parametrize("order", ["first_in_first_out", "last_in_first_out"])
def test_micro_batches_two_forwards_then_two_backwards(dev: Any, order: str) -> None:
    with dev:
        model = make_mlp(dev)
        xs = [torch.randn(64, 128, device=dev.torch_device) for _ in range(2)]
        model.zero_grad(set_to_none=True)
        for x in xs:
            model(x).square().mean().backward()
        expected = grads_of(model)
        model.zero_grad(set_to_none=True)

        losses, handles = [], []
        for x in xs:
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                losses.append(model(x).square().mean())
            handles.append(handle)
        backward_order = [0, 1] if order == "first_in_first_out" else [1, 0]
        for i in backward_order:
            losses[i].backward()
        got = grads_of(model)
    if order == "first_in_first_out":
        assert_equal_grads(got, expected)
    else:  # the same gradients summed in the other order: equal up to rounding
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)
    for handle in handles:
        assert handle.stats().offloaded_storages > 0
        assert handle.stats().reloaded_bytes + handle.stats().reused_live_bytes > 0


def test_checkpoint_inside_the_region(dev: Any) -> None:
    with dev:
        model = make_mlp(dev, depth=4)
        x = torch.randn(64, 128, device=dev.torch_device)
        expected = reference_grads(model, x)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            h = checkpoint(model[:4], x, use_reentrant=False)  # recomputed in backward
            loss = model[4:](h).square().mean()
        loss.backward()
        assert_equal_grads(grads_of(model), expected)
    assert handle.stats().offloaded_storages > 0  # what lies outside the checkpointed part


def test_checkpoint_around_the_region_lets_checkpoint_own_the_saves(dev: Any) -> None:
    with dev:
        model = make_mlp(dev, depth=4)
        x = torch.randn(64, 128, device=dev.torch_device)
        expected = reference_grads(model, x)
        handles: list[Any] = []

        def block(inp: Any) -> Any:
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                handles.append(handle)
                return model[:4](inp)

        h = checkpoint(block, x, use_reentrant=False)
        loss = model[4:](h).square().mean()
        loss.backward()
        assert_equal_grads(grads_of(model), expected)
    assert len(handles) == 2  # forward and checkpoint's recomputation
    assert all(handle.bypassed for handle in handles)


def test_graph_with_checkpoint_and_offload_nested_both_ways_over_steps(dev: Any) -> None:
    def train(offload: bool) -> tuple[list[Any], list[Any], list[Any]]:
        """Three SGD steps; losses, final parameters and each region's stats."""
        with dev:
            model = make_mlp(dev, depth=4)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x = torch.randn(64, 128, device=dev.torch_device)
            losses, stats = [], []
            for _ in range(3):
                with offcore_torch.offload_activations(dev, min_bytes=1) if offload else nullcontext() as handle:
                    h = checkpoint(model[:4], x, use_reentrant=False)
                    loss = model[4:](h).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().clone())
                if handle is not None:
                    stats.append(handle.stats())
            return losses, [p.detach().clone() for p in model.parameters()], stats

    expected_losses, expected_params, _ = train(offload=False)
    copies = copied_bytes(dev) if is_fake_device(dev) else None
    losses, params, stats = train(offload=True)
    assert_equal_grads(losses, expected_losses)  # bit-identical losses at every step ...
    assert_equal_grads(params, expected_params)  # ... and parameters after the last
    assert all(s.offloaded_storages > 0 for s in stats), "what lies outside the checkpointed part is offloaded"
    if copies is not None:
        settle(dev)
        assert moved_since(dev, copies)["d2h"] == sum(s.offloaded_bytes for s in stats) > 0


def test_a_backward_that_raised_does_not_poison_the_next_one(dev: Any) -> None:
    with dev:
        model = make_mlp(dev)
        x = torch.randn(64, 128, device=dev.torch_device)
        expected = reference_grads(model, x)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = model(x).square().mean()
        hook = model[-1].weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("stop")))
        with pytest.raises(RuntimeError, match="stop"):
            loss.backward(retain_graph=True)
        hook.remove()
        model.zero_grad(set_to_none=True)
        loss.backward()  # a new backward pass over the retained graph: a new round
        assert_equal_grads(grads_of(model), expected)
    assert handle._round == 1
