"""Saved tensors must come back as forward saved them: version checks and exact gradients.

Autograd does not compare version counters under saved-tensor hooks, so offcore does
(Note [Saved-tensor version checks] in ``offcore_torch.activations.offload``).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def test_in_place_change_of_an_offloaded_tensor_raises_naming_shape_dtype_and_op(dev: Any) -> None:
    with dev:
        x = torch.randn(128, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            h = x * 3  # saves nothing
            loss = h.sin().sum()  # sin saves h
        assert handle.stats().offloaded_storages == 1
        with torch.no_grad():
            h.add_(1)
        with pytest.raises(offcore.SavedTensorModifiedError) as info:
            loss.backward()
    message = str(info.value)
    assert "(128, 64)" in message and "torch.float32" in message
    assert "SinBackward0" in message
    assert "offloaded" in message


def test_in_place_change_while_the_copy_is_in_flight_raises(backend: Any, make_fake_device: Any) -> None:
    if not is_fake_device(backend):
        pytest.skip("holding a copy in flight needs the fake device's gates")
    dev = sanitized_device(backend, make_fake_device, link="slow")
    d2h = runtime_for(dev).d2h_stream
    with dev:
        x = torch.randn(512, 256, device=dev.torch_device, requires_grad=True)
        with dev.gate(d2h) as gate:  # the D2H copy stays in flight until the gate opens
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                h = x * 3
                loss = h.sin().sum()
                assert dev.copies_in_flight == 1, "sin saved h: its D2H copy must have been issued"
                (held,) = gate.wait_held(1)
                assert (held["direction"], held["bytes"]) == ("d2h", h.untyped_storage().nbytes())
                with torch.no_grad():
                    h.mul_(2)  # certainly while the copy of h is in flight
                assert gate.held() == [held], "the copy was still in flight after the change"
        settle(dev)
        # the sanitizer names the planted race too (Note [Operators checked against copies in flight])
        (violation,) = dev.sanitizer_violations(clear=True)
        assert (violation["kind"], violation["op"], violation["access"], violation["side"]) == (
            "access-in-flight",
            "aten.mul_.Tensor",
            "write",
            "source",
        )
        assert handle.stats().offloaded_storages == 1
        with pytest.raises(offcore.SavedTensorModifiedError, match="modified in place") as info:
            loss.backward()
    assert "before offcore saw its device-to-host copy complete" in str(info.value), "the in-flight case is named"


def test_optimizer_step_before_backward_raises_naming_the_op(dev: Any) -> None:
    with dev:
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(dev.torch_device)
        x = torch.randn(16, 32, device=dev.torch_device)
        with offcore_torch.offload_activations(dev, min_bytes=1):
            loss = model(x).square().mean()
        with torch.no_grad():
            model[2].weight.add_(0.01)  # what an optimizer step does to a parameter
        with pytest.raises(offcore.SavedTensorModifiedError) as info:
            loss.backward()
    message = str(info.value)
    assert "AddmmBackward0" in message or "MmBackward0" in message or "TBackward0" in message, message
    assert "optimizer.step()" in message


def test_a_real_optimizer_step_between_forward_and_backward_is_caught(dev: Any) -> None:
    with dev:
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(dev.torch_device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x = torch.randn(16, 32, device=dev.torch_device)
        with offcore_torch.offload_activations(dev, min_bytes=1):
            first = model(x).square().mean()
        first.backward(retain_graph=True)
        opt.step()  # changes the parameters that `first`'s graph saved
        with pytest.raises(offcore.SavedTensorModifiedError, match=r"shape \(64, 1\).*AddmmBackward0"):
            first.backward()


def test_untouched_graphs_pass_the_check(dev: Any) -> None:
    with dev:
        x = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1):
            loss = (x.exp() * x.sin()).sum()
        loss.backward()
    expected = x.detach().exp() * x.detach().sin() + x.detach().exp() * x.detach().cos()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ the teaching model
def teaching_loss(w: Any, v: Any, x: Any, target: Any) -> Any:
    """h = tanh(w x), y = v . h, L = 1/2 (y - target)^2, summed over a batch of columns of x."""
    h = torch.tanh(w @ x)
    y = v @ h
    return 0.5 * ((y - target) ** 2).sum()


def analytic_gradients(w: Any, v: Any, x: Any, target: Any) -> tuple[Any, Any]:
    h = torch.tanh(w @ x)
    r = v @ h - target  # dL/dy per column
    grad_v = h @ r
    grad_w = ((v[:, None] * (1 - h * h)) * r[None, :]) @ x.t()
    return grad_w, grad_v


def finite_difference(fn: Any, tensor: Any, eps: float = 1e-6) -> Any:
    grad = torch.zeros_like(tensor)
    flat, out = tensor.view(-1), grad.view(-1)
    for i in range(flat.numel()):
        old = flat[i].item()
        flat[i] = old + eps
        up = fn().item()
        flat[i] = old - eps
        down = fn().item()
        flat[i] = old
        out[i] = (up - down) / (2 * eps)
    return grad


@pytest.fixture
def teaching(dev: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    m, n, batch = 6, 5, 64
    values = {
        "w": torch.randn(m, n, generator=gen, dtype=torch.float64),
        "v": torch.randn(m, generator=gen, dtype=torch.float64),
        "x": torch.randn(n, batch, generator=gen, dtype=torch.float64),
        "target": torch.randn(batch, generator=gen, dtype=torch.float64),
    }
    with dev:
        return {k: t.to(dev.torch_device) for k, t in values.items()}


def test_teaching_model_gradients_match_analytic_and_finite_differences(dev: Any, teaching: dict[str, Any]) -> None:
    w = teaching["w"].clone().requires_grad_()
    v = teaching["v"].clone().requires_grad_()
    x, target = teaching["x"], teaching["target"]
    with dev:
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = teaching_loss(w, v, x, target)
            settle(dev)  # every copy landed and was released: backward must read the host copies
        loss.backward()
    stats = handle.stats()
    assert stats.offloaded_storages >= 2  # w @ x and tanh's output
    assert stats.reloaded_bytes > 0

    grad_w, grad_v = analytic_gradients(teaching["w"], teaching["v"], x, target)
    torch.testing.assert_close(w.grad, grad_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v.grad, grad_v, rtol=1e-12, atol=1e-12)

    w0, v0 = teaching["w"].clone(), teaching["v"].clone()
    fd_w = finite_difference(lambda: teaching_loss(w0, teaching["v"], x, target), w0)
    fd_v = finite_difference(lambda: teaching_loss(teaching["w"], v0, x, target), v0)
    torch.testing.assert_close(w.grad.cpu(), fd_w.cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v.grad.cpu(), fd_v.cpu(), rtol=1e-6, atol=1e-6)


def test_teaching_model_changing_v_in_place_before_backward_raises(dev: Any, teaching: dict[str, Any]) -> None:
    w = teaching["w"].clone().requires_grad_()
    v = teaching["v"].clone().requires_grad_()
    with dev:
        with offcore_torch.offload_activations(dev, min_bytes=1):
            loss = teaching_loss(w, v, teaching["x"], teaching["target"])
        with torch.no_grad():
            v.mul_(0.5)  # "backward must use the weights forward used"
        with pytest.raises(offcore.SavedTensorModifiedError, match=r"torch.float64, needed by (Mm|Mv)Backward0"):
            loss.backward()
