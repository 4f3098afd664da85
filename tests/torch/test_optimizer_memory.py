"""OffloadOptimizer's memory, measured by the fake device's accounting, and nothing leaks after errors.

- the device never holds optimizer state, and after a step no gradient either;
- with offloaded gradients, the device peak exceeds that of a run whose gradients vanish on
  arrival by at most the gradients in flight (the optimizer's own ledger of them);
- an exception in backward or in the host step leaves no device, pinned or pageable bytes
  behind once the optimizer is closed.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402

import offcore  # noqa: E402
from offcore.kinds import Kind, Tier  # noqa: E402

WORK = mlp_workload(d_in=64, width=256, depth=3, d_out=16, batch_size=32)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _step(model: torch.nn.Module, step: int) -> None:
    loss = WORK.loss(model, WORK.make_batch(step, torch.device("cpu")))
    loss.backward()


def test_no_optimizer_state_and_bounded_gradients_on_device(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    model = WORK.build(0)
    with dev:
        place(model, dev)
        params = _param_bytes(model)
        before = dev.memory_stats().allocated_bytes
        # the floor: the same steps with every gradient dropped the moment it exists
        handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
        dev.reset_peak_memory_stats()
        for step in range(2):
            _step(model, step)
        floor = dev.memory_stats().peak_allocated_bytes
        for h in handles:
            h.remove()
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, accumulation_steps=1)
        try:
            dev.reset_peak_memory_stats()
            for step in range(2):
                _step(model, step)
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            peak = dev.memory_stats().peak_allocated_bytes
            in_flight = opt.ledger.peak(Tier.DEVICE, Kind.GRADIENT)
            assert dev.memory_stats().allocated_bytes == before  # no state, no gradient left on the device
            assert opt.ledger.bytes(Tier.PAGEABLE, Kind.OPTIMIZER_STATE) >= 2 * params  # exp_avg, exp_avg_sq: host
            assert opt.ledger.bytes(Tier.DEVICE, Kind.GRADIENT) == 0
            assert 0 < in_flight <= params
            assert peak <= floor + in_flight, (peak, floor, in_flight)
        finally:
            opt.close()
        # keep-all for scale: torch's AdamW on the device holds 2x the parameters in state plus the gradients
        keep = torch.optim.AdamW(model.parameters())
        dev.reset_peak_memory_stats()
        _step(model, 0)
        keep.step()
        assert dev.memory_stats().allocated_bytes >= before + 3 * params
        assert peak < dev.memory_stats().peak_allocated_bytes


class _Boom(torch.autograd.Function):
    """Identity in forward; raises in backward (after the later layers' gradients were offloaded)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


class _FailingAdamW(torch.optim.AdamW):
    calls = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("boom in the host step")
        return super().step(closure)


@pytest.mark.parametrize("where", ["backward", "host_step"])
def test_nothing_leaks_after_an_exception(make_fake_device: Any, where: str) -> None:
    dev = make_fake_device(link="slow")
    model = WORK.build(0)
    x, y = WORK.make_batch(0, torch.device("cpu"))
    if where == "backward":  # raises in backward after the later layers' gradients were offloaded
        model.layers[1].register_forward_pre_hook(lambda module, args: (_Boom.apply(args[0]),))
    with dev:
        place(model, dev)
        before = dev.memory_stats()
        cls = _FailingAdamW if where == "host_step" else torch.optim.AdamW
        _FailingAdamW.calls = 0
        opt = offcore_torch.OffloadOptimizer(model.parameters(), cls, device=dev, accumulation_steps=1)
        with pytest.raises(RuntimeError, match="boom"):
            for _ in range(3):
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        opt.zero_grad()
        # torch keeps a failed backward's unexecuted nodes until the thread's next backward: run one
        torch.autograd.backward(torch.zeros((), requires_grad=True))
        opt.close()
        del opt
        gc.collect()
        after = dev.memory_stats()
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["pinned_bytes"] == before["pinned_bytes"]
    assert after["pageable_bytes"] == before["pageable_bytes"]


def test_host_budget_too_small_is_a_clear_error(make_fake_device: Any) -> None:
    dev = make_fake_device()
    model = WORK.build(0)
    with dev:
        place(model, dev)
        with pytest.raises(offcore.CapacityExceededError, match="host_budget"):
            offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, host_budget="64KiB")
        assert dev.memory_stats()["pinned_bytes"] == 0


def test_gradient_after_its_step_is_refused(make_fake_device: Any) -> None:
    dev = make_fake_device()
    model = WORK.build(0)
    with dev:
        place(model, dev)
        with offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.SGD, device=dev, lr=0.1, accumulation_steps=1
        ) as opt:
            _step(model, 0)
            with pytest.raises(offcore.OffcoreError, match="after its host step"):
                _step(model, 1)  # a second micro-step without opt.step(): it would be dropped from the update
            opt.step()
            opt.zero_grad()


def test_bad_arguments(make_fake_device: Any) -> None:
    dev = make_fake_device()
    model = torch.nn.Linear(4, 4)
    with pytest.raises(offcore.ConfigurationError, match="Optimizer subclass"):
        offcore_torch.OffloadOptimizer(model.parameters(), "adamw", device=dev)  # type: ignore[arg-type]
    with pytest.raises(offcore.ConfigurationError, match="accumulation_steps"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=1, accumulation_steps=0)
    with pytest.raises(offcore.ConfigurationError, match="empty"):
        offcore_torch.OffloadOptimizer([], torch.optim.SGD, device=dev, lr=1)
