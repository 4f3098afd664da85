"""``max_inflight_gradients`` (Note [In-flight gradients are capped]), measured on the sanitized fake device.

- without a cap, gradients whose D2H is stalled pile up on the device (a gated link: all of them);
- with a cap, backward waits on the oldest copy's event: the optimizer's device gradients never
  exceed the cap, and the device peak (the backend's accounting) stays within the peak of a run
  whose gradients vanish on arrival plus the cap, with the D2H copies held at a gate and then slow;
- the numbers are those of the host reference.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import assert_equivalent, place, run  # noqa: E402

import offcore  # noqa: E402
from offcore.kinds import Kind, Tier  # noqa: E402

WORK = mlp_workload(d_in=256, width=256, depth=4, d_out=256, batch_size=16)  # five 256 KiB weights
CAP = 600 * 1024  # two weights' gradients and their biases


def _grad_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _backward(model: torch.nn.Module, step: int) -> None:
    WORK.loss(model, WORK.make_batch(step, torch.device("cpu"))).backward()


def test_without_a_cap_stalled_gradients_pile_up(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = place(WORK.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, max_inflight_gradients="1GiB"
        )
        params = list(model.parameters())
        held: list[int] = []
        try:
            with dev.gate(direction="d2h") as gate:

                def last(param: torch.Tensor) -> None:  # after the optimizer's hook of the last gradient
                    if len(held) < len(params) - 1:
                        held.append(-1)
                        return
                    gate.wait_held(1)  # no copy can land: every gradient is held
                    held.append(opt.ledger.bytes(Tier.DEVICE, Kind.GRADIENT))
                    gate.open()  # backward returns once every gradient landed on the host

                watch = [p.register_post_accumulate_grad_hook(last) for p in params]
                _backward(model, 0)
                for handle in watch:
                    handle.remove()
            assert held[-1] == _grad_bytes(model) > CAP
            opt.step()
            opt.zero_grad()
        finally:
            opt.close()


def test_the_cap_bounds_the_measured_device_peak(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = place(WORK.build(0), dev)
        before = dev.memory_stats().allocated_bytes
        # the floor: the same backward with every gradient dropped the moment it exists
        drops = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
        dev.reset_peak_memory_stats()
        for step in range(2):
            _backward(model, step)
        floor = dev.memory_stats().peak_allocated_bytes
        for handle in drops:
            handle.remove()
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, max_inflight_gradients=CAP
        )
        held: list[int] = []  # after each gradient's D2H started (hooks run in registration order)
        watch = [
            p.register_post_accumulate_grad_hook(lambda p: held.append(opt.ledger.bytes(Tier.DEVICE, Kind.GRADIENT)))
            for p in model.parameters()
        ]
        try:
            dev.reset_peak_memory_stats()
            for step in range(2):
                with dev.gate(direction="d2h") as gate:  # the first copy stalls until backward is under way
                    opener = threading.Thread(target=lambda g=gate: (g.wait_held(1), g.open()))
                    opener.start()
                    _backward(model, step)
                    opener.join()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            peak = dev.memory_stats().peak_allocated_bytes
            assert len(held) == 2 * len(list(model.parameters()))
            assert max(held) <= CAP < _grad_bytes(model), held
            assert opt.ledger.peak(Tier.DEVICE, Kind.GRADIENT) <= CAP
            assert peak <= floor + CAP, (peak, floor)
            assert dev.memory_stats().allocated_bytes == before
        finally:
            for handle in watch:
                handle.remove()
            opt.close()


def test_a_cap_below_one_gradient_is_one_at_a_time_and_exact(make_fake_device: Any) -> None:
    want = run(WORK, device=make_fake_device(), offload=False, steps=3)
    got = run(WORK, device=make_fake_device(link="slow"), steps=3, options={"max_inflight_gradients": 1})
    assert_equivalent(got, want)


def test_bad_cap_is_a_clear_error(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with pytest.raises(offcore.ConfigurationError, match="max_inflight_gradients"):
        offcore_torch.OffloadOptimizer(
            torch.nn.Linear(4, 4).parameters(), torch.optim.SGD, device=dev, lr=1, max_inflight_gradients="lots"
        )
