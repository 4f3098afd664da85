"""The optimizer's worker runs the gradients' landings as queued tasks, not one executor Future each (Note [Worker
tasks without a Future each] in offcore_torch/optimizer/slots.py): a Future per gradient kept a dozen objects the
garbage collector tracks alive through backward, and with thousands of parameters every step ran a full
collection. The landings queued while the worker is busy are one submission to it; the numbers stay the host
reference's, and a landing's failure still reaches step()."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import OPTIMIZERS, assert_same, place, run  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=3, d_out=8, batch_size=8)
STEPS = 3


def test_landings_queued_behind_a_busy_worker_are_one_submission(make_fake_device: Any) -> None:
    want = run(MLP, device=make_fake_device(), offload=False, steps=STEPS, optimizer="adamw")
    dev = make_fake_device()
    submissions: list[Any] = []
    losses = []
    with dev:
        model = place(MLP.build(0), dev)
        params = list(model.parameters())
        opt = offcore_torch.OffloadOptimizer(params, torch.optim.AdamW, device=dev, **OPTIMIZERS["adamw"][1])
        worker = opt._worker
        real_submit = worker.submit

        def submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
            submissions.append(fn)
            return real_submit(fn, *args, **kwargs)

        worker.submit = submit  # type: ignore[method-assign]
        try:
            for step in range(STEPS):
                gate = threading.Event()
                real_submit(gate.wait)  # the worker is busy: every landing of this backward queues behind it
                sent: list[int] = []

                def sent_one(_: Any, sent: list[int] = sent, gate: threading.Event = gate) -> None:
                    sent.append(1)  # after the optimizer's own hook (registered first) sent the gradient
                    if len(sent) == len(params):
                        gate.set()  # every gradient was sent: let the worker go (backward waits for it at its end)

                hooks = [p.register_post_accumulate_grad_hook(sent_one) for p in params]
                submissions.clear()
                loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                loss.backward()
                for hook in hooks:
                    hook.remove()
                assert gate.is_set() and len(sent) == len(params)
                assert len(submissions) == 1, f"step {step}: {len(submissions)} submissions for {len(params)} gradients"
                losses.append(loss.detach().clone())
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            got = [p.detach().clone() for p in params]
        finally:
            del worker.submit
            opt.close()
    assert_same(losses, want.losses, "losses")
    assert_same(got, want.params, "params")
