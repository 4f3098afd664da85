"""OffloadOptimizer under failed copies (Note [Failed copies in the optimizer]), on the fake device.

Every copy of a step (each gradient's D2H, each parameter's H2D) is failed once, at submission
and on its stream: the optimizer copies again (the device gradient is still held; the host master
is intact), so the run ends with the numbers of a run without faults, and device bytes and pool
bytes are back to their baseline. A gradient lost for good (two failures in a row) is a clear
CopyFailedError, and the step is then not applied until ``zero_grad()`` starts the round over.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from offload_helpers import frozen_heap, pool_used_bytes  # noqa: E402
from optimizer_offload_helpers import OPTIMIZERS, assert_same, place, run  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=8)
STEPS = 2  # the faults go into the last step's copies


@pytest.fixture
def fake(backend: Any) -> None:
    if not is_fake_device(backend):
        pytest.skip("fault injection is a fake-device option")


def _train(dev: Any, *, fault: tuple[int, str] | None, overlap: bool) -> tuple[list[Any], list[Any], int, int, int]:
    """STEPS steps; ``fault`` (nth copy of step 1, mode) armed at the start of step 1. Returns the losses, the
    parameters, the copies of step 1, the device bytes beyond the parameters and ``opt.copy_failures``."""
    losses = []
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            device=dev,
            accumulation_steps=1 if overlap else None,
            **OPTIMIZERS["adamw"][1],
        )
        try:
            for step in range(STEPS):
                if step == 1 and fault is not None:
                    opt.synchronize()
                    dev.clear_copy_log()
                    dev.inject_copy_fault(fault[0], mode=fault[1])
                loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                loss.backward()
                losses.append(loss.detach().clone())
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            copies = len(dev.copy_log())
            dev.inject_copy_fault(None)
            params = [p.detach().clone() for p in model.parameters()]
            gc.collect()  # a raised error's traceback forms cycles with the frames that held tensors
            device_bytes = dev.memory_stats().allocated_bytes - sum(p.numel() * p.element_size() for p in params)
            return losses, params, copies, device_bytes, opt.copy_failures
        finally:
            opt.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
@pytest.mark.parametrize("mode", ["submit", "stream"])
def test_every_failed_copy_is_copied_again(fake: None, make_fake_device: Any, mode: str, overlap: bool) -> None:
    want = run(MLP, device=make_fake_device(), offload=False, steps=STEPS, optimizer="adamw")
    _, _, total, baseline, _ = _train(make_fake_device(), fault=(10**6, mode), overlap=overlap)  # never fires
    assert total >= 2 * len(list(MLP.build(0).parameters()))  # at least each gradient's D2H and H2D
    with frozen_heap():  # each run's gc.collect() walks only what the runs since made
        for nth in range(1, total + 1):
            dev = make_fake_device(link="slow")
            # a recovered copy is said and counted, as the other bindings' are (it was silent)
            with pytest.warns(offcore.OffcoreWarning, match="recovered without changing a number"):
                losses, params, _, device_bytes, failures = _train(dev, fault=(nth, mode), overlap=overlap)
            # (on its stream, the failure is sticky: the copies queued behind it fail too, each made again)
            assert failures == 1 if mode == "submit" else failures >= 1, f"copy {nth} ({mode}): {failures}"
            assert not dev.copy_fault_armed, f"copy {nth} of {total} was never made"
            assert_same(losses, want.losses, f"losses, fault in copy {nth} ({mode})")
            assert_same(params, want.params, f"params, fault in copy {nth} ({mode})")
            assert device_bytes == baseline, f"device bytes after a fault in copy {nth}: {device_bytes} vs {baseline}"
            assert pool_used_bytes(dev) == 0


def test_a_gradient_lost_for_good_refuses_the_step(fake: None, make_fake_device: Any) -> None:
    want = run(MLP, device=make_fake_device(), offload=False, steps=2, optimizer="adamw")
    dev = make_fake_device(link="slow")
    with dev:
        model = place(MLP.build(0), dev)
        baseline = dev.memory_stats().allocated_bytes
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, **OPTIMIZERS["adamw"][1]
        )
        real_copy = dev.copy_
        fails = [0]

        def flaky(dst: Any, src: Any, **kwargs: Any) -> Any:
            if fails[0] < 2 and kwargs.get("stream") is opt._runtime.d2h_stream:
                fails[0] += 1
                raise RuntimeError("injected: the copy engine refused")
            return real_copy(dst, src, **kwargs)

        try:
            dev.copy_ = flaky  # type: ignore[method-assign]
            loss = MLP.loss(model, MLP.make_batch(0, torch.device("cpu")))
            with pytest.raises(offcore.CopyFailedError, match="failed twice"):
                loss.backward()
            dev.copy_ = real_copy  # type: ignore[method-assign]
            with pytest.raises(offcore.CopyFailedError, match="not applied"):
                opt.step()
            opt.synchronize()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), MLP.build(0).parameters(), strict=True))
            opt.zero_grad()
            for p in model.parameters():
                p.grad = None  # the gradients backward left on the device before it raised
            losses = []
            for step in range(2):  # the round starts over: the numbers of a run without the fault
                loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                loss.backward()
                losses.append(loss.detach().clone())
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            assert_same(losses, want.losses, "losses")
            assert_same([p.detach() for p in model.parameters()], want.params, "params")
        finally:
            dev.copy_ = real_copy  # type: ignore[method-assign]
            opt.close()
        del loss, losses
        gc.collect()  # the raised errors' tracebacks form cycles with frames that held tensors
        assert dev.memory_stats().allocated_bytes == baseline
        assert pool_used_bytes(dev) == 0
