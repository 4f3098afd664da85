"""``step()``'s host step on the caller's thread (Note [One host step at step()]), on the sanitized fake device.

- the host optimizer runs on the thread that called ``step()``, with offloaded gradients and with
  ``offload_gradients=False`` (whose gradients land before the step: Note [Device gradients are read on
  the host once per round]); with the caller path switched off (``_STEP_ON_CALLER``), on the worker;
- inside ``with dev:`` the host step's temporaries are host memory (the backend's ``host_work()``):
  the device peak across ``step()`` is what was allocated before it, in both accounting modes;
(Bit-identity on this path, with a lead: test_optimizer_step.py and the reference suites, which run it.)
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
import offcore_torch.optimizer.optimizer as optimizer_module  # noqa: E402
import offcore_torch.optimizer.rounds as rounds_module  # noqa: E402
import offcore_torch.optimizer.slots as slots_module  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402

MLP = mlp_workload(d_in=16, width=64, depth=3, d_out=8, batch_size=8)


@pytest.mark.parametrize(
    "offload_gradients,on_caller",
    [(True, True), (False, True), (True, False)],
    ids=["offloaded-grads", "device-grads", "worker"],
)
def test_the_host_step_runs_on_the_caller_when_the_worker_is_idle(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, offload_gradients: bool, on_caller: bool
) -> None:
    monkeypatch.setattr(slots_module, "_LEAD_MIN_BYTES", 0)  # a lead too
    monkeypatch.setattr(optimizer_module, "_STEP_ON_CALLER", on_caller)
    dev = make_fake_device()
    threads: list[threading.Thread] = []
    host_step = rounds_module._unhooked_step

    def spy(host: Any) -> None:
        threads.append(threading.current_thread())
        host_step(host)

    monkeypatch.setattr(rounds_module, "_unhooked_step", spy)
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, fused=True, offload_gradients=offload_gradients
        )
        try:
            for step in range(2):
                MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
                threads.clear()
                opt.step()
                assert len(threads) == 2, threads  # the lead and the rest
                if on_caller:
                    assert all(t is threading.current_thread() for t in threads), threads
                else:
                    assert all(t.name.startswith("offcore-optimizer") for t in threads), threads
                opt.zero_grad()
        finally:
            opt.close()


@pytest.mark.parametrize("accounting", ["allocator", "dispatch"])
@pytest.mark.parametrize("kwargs", [{"foreach": True}, {"foreach": False}, {"fused": True}], ids=str)
def test_the_caller_step_takes_no_device_memory(make_fake_device: Any, accounting: str, kwargs: dict[str, Any]) -> None:
    dev = make_fake_device(accounting=accounting)
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, **kwargs)
        try:
            for step in range(2):  # the first step makes the states; the second reuses them
                MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
                opt.host_grads()  # every gradient landed: what is left is step()'s host step
                before = dev.memory_stats().allocated_bytes
                dev.reset_peak_memory_stats()
                opt.step()
                opt.synchronize()
                stats = dev.memory_stats()
                assert stats.peak_allocated_bytes == before, (step, stats.peak_allocated_bytes - before)
                assert stats.allocated_bytes == before
                opt.zero_grad()
        finally:
            opt.close()
