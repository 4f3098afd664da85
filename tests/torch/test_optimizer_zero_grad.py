"""Who issues the uploads ``step()`` left due (Note [Who issues step()'s uploads]), on the sanitized fake device,
with ``overlap_uploads=True`` (by default ``step()`` issues them itself and the compute stream waits for them:
Note [Parameters read after step() are the stepped ones], tests/torch/test_optimizer_contract.py).

- ``zero_grad()`` issues all of them, in need order, on its own thread; nothing is queued on the worker;
- without ``zero_grad()``, the forward's first use of a parameter issues all of them at once, so the
  later layers' copies are in flight while the first layers compute;
- a write to the parameters between ``step()`` and ``zero_grad()`` (nothing issued yet) wins, and the next step starts from it: bit-identical to the plain optimizer that sees the same write.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
import offcore_torch.optimizer.optimizer as optimizer_module  # noqa: E402
import offcore_torch.optimizer.slots as slots_module  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402

MLP = mlp_workload(d_in=16, width=64, depth=3, d_out=8, batch_size=8)
CPU = torch.device("cpu")


@contextlib.contextmanager
def _adamw(dev: Any) -> Iterator[tuple[Any, list[Any], Any]]:
    """Inside ``with dev:``, the test MLP on ``dev`` and an OffloadOptimizer running fused AdamW over it (closed on exit)."""
    with dev:
        model = place(MLP.build(0), dev)
        params = list(model.parameters())
        opt = offcore_torch.OffloadOptimizer(params, torch.optim.AdamW, device=dev, fused=True, overlap_uploads=True)
        try:
            yield model, params, opt
        finally:
            opt.close()


def _spy_flushes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, threading.Thread]]:
    """(parameter index, thread) of every upload issued, in order."""
    flushes: list[tuple[int, threading.Thread]] = []
    copy_uploads = optimizer_module.OffloadOptimizer._copy_uploads  # every upload goes through it, once

    def spy(self: Any, slots: Any, *args: Any) -> Any:
        flushes.extend((slot.index, threading.current_thread()) for slot in slots)
        return copy_uploads(self, slots, *args)

    monkeypatch.setattr(optimizer_module.OffloadOptimizer, "_copy_uploads", spy)
    return flushes


def test_zero_grad_issues_the_due_uploads_on_its_thread_in_need_order(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slots_module, "_LEAD_MIN_BYTES", 0)  # a lead, and a rest whose uploads are due
    flushes = _spy_flushes(monkeypatch)
    with _adamw(make_fake_device(sanitize=True)) as (model, params, opt):
        for step in range(3):
            MLP.loss(model, MLP.make_batch(step, CPU)).backward()
            opt.step()
            due = [s.index for s in opt._due if s.upload_due]
            assert due, "nothing was left due: the test checks nothing"
            assert opt._worker_idle()  # no job in the background
            flushes.clear()
            opt.zero_grad()
            assert [i for i, _ in flushes] == due  # all of them, in need order
            assert all(t is threading.current_thread() for _, t in flushes)
            assert not any(s.upload_due for s in opt._slots)
            assert opt._worker_idle()
            assert all(p.grad is None for p in params)
        opt.synchronize()


def test_the_first_use_issues_all_due_uploads(make_fake_device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module, "_LEAD_MIN_BYTES", 0)
    flushes = _spy_flushes(monkeypatch)
    with _adamw(make_fake_device(sanitize=True)) as (model, params, opt):
        first = next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
        seen: list[int] = []
        # runs after the optimizer's pre-hook (registered at construction)
        first.register_forward_pre_hook(lambda *_: seen.append(len(flushes)))
        for step in range(3):
            MLP.loss(model, MLP.make_batch(step, CPU)).backward()
            opt.step()
            due = [s.index for s in opt._due if s.upload_due]
            flushes.clear()
            seen.clear()
            MLP.loss(model, MLP.make_batch(step + 1, CPU))  # no zero_grad(): the forward needs them first
            assert due and seen[0] == len(due), (seen, due)  # the first module's use issued them all
            assert [i for i, _ in flushes] == due
            opt.zero_grad()
        opt.synchronize()


@pytest.mark.parametrize("how", ["copy_", "data"])
def test_a_write_between_step_and_the_forward_wins(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The write comes before zero_grad() (an EMA swap, a resume): the uploads are still due then; issued
    afterwards, they are cancelled (Note [Writes to parameters after step()]) and the next step starts
    from the write."""
    monkeypatch.setattr(slots_module, "_LEAD_MIN_BYTES", 0)
    runs = []
    for offload in (False, True):
        dev = make_fake_device(sanitize=True)
        with dev:
            model = place(MLP.build(0), dev)
            params = list(model.parameters())
            if offload:
                opt: Any = offcore_torch.OffloadOptimizer(
                    params, torch.optim.SGD, device=dev, lr=0.1, momentum=0.9, overlap_uploads=True
                )
            else:
                opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            try:
                for step in range(3):
                    MLP.loss(model, MLP.make_batch(step, CPU)).backward()
                    opt.step()
                    if step == 0:
                        if offload:
                            assert any(s.upload_due for s in opt._slots), "nothing due: the test checks nothing"
                            # the lead's uploads are in flight: a write of one's own waits for them first
                            opt.wait_for_parameters([p for p in params if id(p) in opt._pending_h2d])
                            assert any(s.upload_due for s in opt._slots)
                        with torch.no_grad():
                            for p in params:
                                if how == "copy_":
                                    p.copy_(torch.full_like(p, 0.25))
                                else:
                                    p.data = torch.full_like(p, 0.25)
                    opt.zero_grad()  # after the write: the uploads it issues are cancelled
                    if step == 0 and offload:
                        opt.synchronize()
                        for p in params:
                            assert torch.equal(p, torch.full_like(p, 0.25))  # the write won
                if offload:
                    opt.synchronize()
                runs.append([p.detach().clone() for p in params])
            finally:
                if offload:
                    opt.close()
    for plain, offloaded in zip(*runs, strict=True):
        assert torch.equal(plain, offloaded)


def test_reads_between_step_and_the_forward_see_the_step_after_wait_for_parameters(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EMA update or a norm logged right after ``step()``: ``wait_for_parameters()`` issues what is due and
    orders the reads after the uploads, so they see the stepped values (the masters, fp32 here)."""
    monkeypatch.setattr(slots_module, "_LEAD_MIN_BYTES", 0)
    with _adamw(make_fake_device(sanitize=True, link="slow")) as (model, params, opt):
        ema = [p.detach().clone() for p in params]
        for step in range(3):
            MLP.loss(model, MLP.make_batch(step, CPU)).backward()
            opt.step()
            assert any(s.upload_due for s in opt._slots), "nothing due: the test checks nothing"
            opt.wait_for_parameters()
            with torch.no_grad():
                for e, p in zip(ema, params, strict=True):
                    assert torch.equal(p, opt.master(p))
                    e.mul_(0.9).add_(p, alpha=0.1)
            opt.zero_grad()
