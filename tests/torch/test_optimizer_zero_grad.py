"""``zero_grad()`` after ``step()`` issues the uploads still due itself (Note [zero_grad() issues step()'s
uploads]), on the sanitized fake device.

- it returns while ``step()``'s upload job is held on the worker: it does not wait for that thread;
- when it returns, every upload of the round is issued (in flight, ``wait_for_parameters`` sees it),
  and the job, released afterwards, issues nothing more;
- a write to a parameter after ``zero_grad()`` (after waiting for the in-flight uploads, as for any copy
  on another stream) wins over the job, and the next step starts from it: bit-identical to the plain
  optimizer that sees the same write.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
import offcore_torch.optimizer as optimizer_module  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402

MLP = mlp_workload(d_in=16, width=64, depth=3, d_out=8, batch_size=8)
CPU = torch.device("cpu")


def _h2d_copies(dev: Any) -> int:
    return sum(1 for c in dev.copy_log() if c["direction"] == "h2d")


def _held_job(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """step()'s upload job waits for ``release`` before it looks at anything; ``entered`` says it is running."""
    entered, release = threading.Event(), threading.Event()
    issue_due = optimizer_module.OffloadOptimizer._issue_due

    def held(self: Any, slots: Any) -> None:
        entered.set()
        assert release.wait(30), "the test never released the upload job"
        issue_due(self, slots)

    monkeypatch.setattr(optimizer_module.OffloadOptimizer, "_issue_due", held)
    return entered, release


def test_zero_grad_issues_the_due_uploads_without_waiting_for_the_worker(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optimizer_module, "_LEAD_MIN_BYTES", 0)  # a lead, and a rest whose uploads are due
    entered, release = _held_job(monkeypatch)
    dev = make_fake_device(sanitize=True)
    with dev:
        model = place(MLP.build(0), dev)
        params = list(model.parameters())
        opt = offcore_torch.OffloadOptimizer(params, torch.optim.AdamW, device=dev, fused=True)
        try:
            MLP.loss(model, MLP.make_batch(0, CPU)).backward()
            opt.step()
            assert entered.wait(30)  # the job runs, and is held
            due = [s for s in opt._slots if s.upload_due]
            assert due, "nothing was left for the job: the test checks nothing"
            for slot in opt._slots:  # the lead's uploads land (the log records a copy when it lands)
                if slot.h2d is not None:
                    slot.h2d.synchronize()
            before = _h2d_copies(dev)
            opt.zero_grad()  # would hang here if it waited for the held job
            assert not any(s.upload_due for s in opt._slots)
            issued = _h2d_copies_after(dev, opt)
            assert issued - before == len(due), (before, issued, len(due))
            release.set()
            opt.synchronize()  # collects the job
            assert _h2d_copies(dev) == issued, "the job issued an upload zero_grad() had issued already"
            assert all(p.grad is None for p in params)
        finally:
            release.set()
            opt.close()


def _h2d_copies_after(dev: Any, opt: Any) -> int:
    """The H2D copies once everything issued so far landed (the log records a copy when it lands)."""
    opt.wait_for_parameters()
    for slot in opt._slots:
        if slot.h2d is not None:
            slot.h2d.synchronize()
    return _h2d_copies(dev)


@pytest.mark.parametrize("how", ["copy_", "data"])
def test_a_write_after_zero_grad_wins_over_the_held_job(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The job is released only after the write: it must not overwrite it (Note [Writes to parameters after step()])."""
    monkeypatch.setattr(optimizer_module, "_LEAD_MIN_BYTES", 0)
    runs = []
    for offload in (False, True):
        dev = make_fake_device(sanitize=True)
        release = None
        if offload:
            entered, release = _held_job(monkeypatch)
        with dev:
            model = place(MLP.build(0), dev)
            params = list(model.parameters())
            if offload:
                opt: Any = offcore_torch.OffloadOptimizer(params, torch.optim.SGD, device=dev, lr=0.1, momentum=0.9)
            else:
                opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            try:
                for step in range(3):
                    MLP.loss(model, MLP.make_batch(step, CPU)).backward()
                    opt.step()
                    opt.zero_grad()
                    if step == 0:
                        if offload:
                            assert entered.wait(30)
                            opt.wait_for_parameters()  # the issued uploads land before a write of one's own
                        with torch.no_grad():
                            for p in params:
                                if how == "copy_":
                                    p.copy_(torch.full_like(p, 0.25))
                                else:
                                    p.data = torch.full_like(p, 0.25)
                        if release is not None:
                            release.set()
                            opt.synchronize()
                            for p in params:
                                assert torch.equal(p, torch.full_like(p, 0.25))  # the write won
                if offload:
                    opt.synchronize()
                runs.append([p.detach().clone() for p in params])
            finally:
                if release is not None:
                    release.set()
                if offload:
                    opt.close()
    for plain, offloaded in zip(*runs, strict=True):
        assert torch.equal(plain, offloaded)
