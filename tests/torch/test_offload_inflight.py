"""``max_inflight`` for saved activations (Note [Activation copies in flight are capped]), on the
sanitized fake device.

- without a cap, saved storages whose device-to-host copy has not landed stay on the device: with
  the link held, forward holds every one of them;
- with a cap, a save first waits on the oldest copy's event: the bytes offcore holds for copies in
  flight never exceed the cap (or one storage), across the regions of a device, and the measured
  forward peak stays within the peak of the same forward under ``no_grad`` plus the cap;
- the numbers are keep-all's, and nothing is left behind (bytes in flight, device memory, pool).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import GPTConfig, gpt_workload  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import memory_levels, settle  # noqa: E402
from torch import nn  # noqa: E402

import offcore  # noqa: E402

WIDTH, ROWS, DEPTH = 256, 512, 12
STORAGE = ROWS * WIDTH * 4  # every saved activation: 512 KiB
LAGGING = {"d2h_bandwidth": "64MiB/s", "h2d_bandwidth": "1GiB/s", "latency": "100us"}  # 8 ms a copy


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)])


def _grads(loss: Any, model: nn.Module) -> tuple[Any, ...]:
    return torch.autograd.grad(loss, list(model.parameters()))


def _assert_exact(got: Any, want: Any) -> None:
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "a number changed under offload"


def _watch(model: nn.Module, dev: Any) -> tuple[list[int], list[Any]]:
    """The bytes offcore holds for device-to-host copies in flight, read after every layer's forward."""
    runtime = runtime_for(dev)
    held: list[int] = []
    hooks = [
        layer.register_forward_hook(lambda *_: held.append(runtime.d2h_bytes_in_flight)) for layer in model.modules()
    ]
    return held, hooks


def test_without_a_cap_a_held_link_keeps_every_saved_storage(make_fake_device: Any) -> None:
    dev = make_fake_device(**LAGGING)
    with dev:
        model = _mlp().to(dev.torch_device)
        x = torch.randn(ROWS, WIDTH, device=dev.torch_device)
        with dev.gate(direction="d2h") as gate:
            with offcore_torch.offload_activations(dev, min_bytes=1, max_inflight=None) as handle:
                loss = model(x).square().mean()
            gate.wait_held(1)
            held = runtime_for(dev).d2h_bytes_in_flight  # (stats() would wait for the copies' timings)
        assert held == handle.stats().offloaded_bytes >= 2 * DEPTH * STORAGE
        loss.backward()
        settle(dev)


@pytest.mark.parametrize("cap", [0, 3 * STORAGE, "2MiB"])
def test_the_cap_bounds_what_offcore_holds_and_the_measured_peak(make_fake_device: Any, cap: Any) -> None:
    dev = make_fake_device(**LAGGING)
    limit = max(offcore.parse_size(cap, allow_zero=True), STORAGE)
    with dev:
        model = _mlp().to(dev.torch_device)
        x = torch.randn(ROWS, WIDTH, device=dev.torch_device)
        want = _grads(model(x).square().mean(), model)
        before = memory_levels(dev)
        base = dev.memory_stats().allocated_bytes
        dev.reset_peak_memory_stats()
        with torch.no_grad():  # the floor: the same forward saving nothing
            model(x).square().mean()
        floor = dev.memory_stats().peak_allocated_bytes - base
        held, hooks = _watch(model, dev)
        try:
            dev.reset_peak_memory_stats()
            # on demand: no reload is planned ahead, so only copies in flight add to the floor
            with offcore_torch.offload_activations(dev, min_bytes=1, max_inflight=cap, prefetch="on_demand") as handle:
                loss = model(x).square().mean()
            peak = dev.memory_stats().peak_allocated_bytes - base
            got = _grads(loss, model)
        finally:
            for hook in hooks:
                hook.remove()
        del loss
        settle(dev)
        stats = handle.stats()
        assert max(held) <= limit, (held, limit)
        assert stats.inflight_waits > 0 and stats.inflight_wait_s > 0
        assert stats.exposed_wait_s >= stats.inflight_wait_s
        assert stats.offloaded_bytes >= 2 * DEPTH * STORAGE  # everything went through the capped link
        assert peak <= floor + limit + STORAGE, (peak, floor, limit)  # + the storage being saved
        _assert_exact(got, want)
        assert runtime_for(dev).d2h_bytes_in_flight == 0
        del got  # want was there before
        assert memory_levels(dev) == before


def test_regions_of_one_device_share_the_cap(make_fake_device: Any) -> None:
    """Two micro-batches' forwards before either backward: the second's saves wait for the first's copies."""
    dev = make_fake_device(**LAGGING)
    cap = 4 * STORAGE
    with dev:
        model = _mlp().to(dev.torch_device)
        xs = [torch.randn(ROWS, WIDTH, device=dev.torch_device) for _ in range(2)]
        want = [_grads(model(x).square().mean(), model) for x in xs]
        held, hooks = _watch(model, dev)
        losses, handles = [], []
        try:
            for x in xs:
                with offcore_torch.offload_activations(dev, min_bytes=1, max_inflight=cap) as handle:
                    losses.append(model(x).square().mean())
                handles.append(handle)
        finally:
            for hook in hooks:
                hook.remove()
        assert max(held) <= cap, held
        assert handles[1].stats().inflight_waits > 0
        got = [_grads(loss, model) for loss in losses]
        for g, w in zip(got, want, strict=True):
            _assert_exact(g, w)
        del losses
        settle(dev)
        assert runtime_for(dev).d2h_bytes_in_flight == 0


def test_one_copy_at_a_time_trains_bit_identically(make_fake_device: Any) -> None:
    """TinyGPT with dropout, AdamW, three steps: ``max_inflight=0`` changes no number."""
    config = GPTConfig(vocab_size=64, d_model=64, n_heads=4, n_layers=2, seq_len=32, dropout=0.1)

    work = gpt_workload(config, batch_size=8)

    def train(dev: Any, offload: bool) -> tuple[list[float], list[Any]]:
        with dev:
            model = work.build(0).to(dev.torch_device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                batch = work.make_batch(step, torch.device(dev.torch_device))
                torch.manual_seed(100 + step)  # the dropout masks
                if offload:
                    with offcore_torch.offload_activations(dev, min_bytes=1, max_inflight=0) as handle:
                        loss = work.loss(model, batch)
                    loss.backward()
                    assert handle.stats().inflight_waits > 0
                else:
                    loss = work.loss(model, batch)
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            settle(dev)
            return losses, [p.detach().clone() for p in model.parameters()]

    want_losses, want_params = train(make_fake_device(), offload=False)
    got_losses, got_params = train(make_fake_device(link="slow"), offload=True)
    assert got_losses == want_losses
    _assert_exact(got_params, want_params)


def test_a_failed_copy_waited_for_keeps_its_tensor(make_fake_device: Any) -> None:
    """The oldest copy fails on its stream while a save waits for it: the failure is handed on (the
    tensor stays on the device, a warning says so), the forward goes on, the gradients are exact."""
    dev = make_fake_device(**LAGGING)
    with dev:
        model = _mlp().to(dev.torch_device)
        x = torch.randn(ROWS, WIDTH, device=dev.torch_device)
        want = _grads(model(x).square().mean(), model)
        dev.inject_copy_fault(1, mode="stream")
        with pytest.warns(offcore.OffcoreWarning, match="device-to-host copy failed"):
            with offcore_torch.offload_activations(dev, min_bytes=1, max_inflight=0) as handle:
                loss = model(x).square().mean()
        stats = handle.stats()
        assert stats.copy_failures == 1 and stats.inflight_waits > 0
        got = _grads(loss, model)
        _assert_exact(got, want)
        del loss
        settle(dev)
        assert runtime_for(dev).d2h_bytes_in_flight == 0


@pytest.mark.parametrize("bad", ["lots", -1, 1.5, True])
def test_a_bad_cap_is_a_clear_error(make_fake_device: Any, bad: Any) -> None:
    dev = make_fake_device()
    with pytest.raises(offcore.ConfigurationError, match="max_inflight"):
        offcore_torch.offload_activations(dev, max_inflight=bad)
