"""``zero_grad()`` between ``step()`` and the next forward (Note [zero_grad() does not wait for uploads]).

- it returns while step()'s upload-issuing job is still running on the worker (the job is held
  on an event here: waiting for it would stall until the hold times out, and the check fails);
- the next forward still reads the stepped parameters: losses and parameters bit-identical to the
  host reference over several steps, the uploads issued by the job or by the parameters' use.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
import offcore_torch.optimizer as optimizer_module  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import OPTIMIZERS, assert_same, place, run  # noqa: E402

MLP = mlp_workload(d_in=16, width=64, depth=3, d_out=8, batch_size=8)
STEPS = 4


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_does_not_wait_for_the_upload_job_and_nothing_changes(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, set_to_none: bool
) -> None:
    monkeypatch.setattr(optimizer_module, "_LEAD_MIN_BYTES", 0)  # a lead and a rest: the rest's uploads are a job
    want = run(MLP, device=make_fake_device(), offload=False, steps=STEPS, optimizer="adamw")
    dev = make_fake_device(sanitize=True)
    losses: list[Any] = []
    jobs = 0
    with dev:
        model = place(MLP.build(0), dev)
        cls, kwargs = OPTIMIZERS["adamw"]
        opt = offcore_torch.OffloadOptimizer(model.parameters(), cls, device=dev, **kwargs)
        issue_due = opt._issue_due
        try:
            for step in range(STEPS):
                loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                loss.backward()
                losses.append(loss.detach().clone())
                started, release, finished = threading.Event(), threading.Event(), threading.Event()

                def held(
                    slots: list[Any], started: Any = started, release: Any = release, finished: Any = finished
                ) -> None:
                    started.set()
                    release.wait(timeout=30)  # a zero_grad() that waits for this job stalls here
                    issue_due(slots)
                    finished.set()

                opt._issue_due = held  # type: ignore[method-assign]
                opt.step()
                if started.wait(timeout=30):  # step() queued the job (it does whenever uploads are left)
                    jobs += 1
                    opt.zero_grad(set_to_none=set_to_none)
                    assert not finished.is_set(), "zero_grad() waited for step()'s upload job"
                    release.set()
                else:
                    release.set()
                    opt.zero_grad(set_to_none=set_to_none)
            opt.synchronize()
            params = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
    assert jobs >= STEPS - 1, jobs
    assert_same(losses, want.losses, "losses")
    assert_same(params, want.params, "parameters")
    assert dev.sanitizer_violations() == []
