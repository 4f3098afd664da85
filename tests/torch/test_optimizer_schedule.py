"""OffloadOptimizer's moves go through the core scheduler (Note [The optimizer's moves go through the core]).

- gradients are Kind.GRADIENT objects whose device copies the core frees once their D2H landed;
- the host steps and uploads at ``step()`` follow the core's need order, learnt from the forward;
- with a small ``upload_budget`` the core holds uploads back until the forward's triggers, and the
  numbers stay bit-identical to the host reference.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import assert_equivalent, place, run  # noqa: E402

from offcore.kinds import Kind  # noqa: E402
from offcore.objects import State  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=3, d_out=8, batch_size=8)


class _Reversed(torch.nn.Module):
    """Registers layers a, b, c but runs c, b, a: the forward's order is not the registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.b(torch.tanh(self.c(x)))))


def _record_uploads(opt: Any) -> list[tuple[int, str]]:
    log: list[tuple[int, str]] = []
    copy_uploads = opt._copy_uploads  # every upload goes through it, once (a batch at a time)

    def spy(slots: Any, *args: Any) -> Any:
        log.extend((slot.index, opt._phase) for slot in slots)
        return copy_uploads(slots, *args)

    opt._copy_uploads = spy
    return log


def test_gradients_are_core_objects_freed_once_landed(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev)
        try:
            MLP.loss(model, MLP.make_batch(0, torch.device("cpu"))).backward()
            opt.synchronize()
            grads = [o for k, o in opt._rs.objects.items() if k < 0]
            assert len(grads) == len(list(model.parameters()))
            assert all(o.kind is Kind.GRADIENT and o.state is State.OFFLOADED for o in grads)
            params = [o for k, o in opt._rs.objects.items() if k >= 0]
            assert all(o.kind is Kind.PARAMETER for o in params)
            opt.step()
        finally:
            opt.close()


def test_step_order_is_the_cores_need_order(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with dev:
        model = place(_Reversed(), dev)
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1)
        log = _record_uploads(opt)
        try:
            for step in range(3):
                model(torch.randn(4, 8)).square().mean().backward()
                log.clear()
                opt.step()
                opt.zero_grad()
                # c's weight and bias (slots 4, 5) are used first, a's (0, 1) last: gradients arrive
                # a, b, c, so the default (LIFO) and the learnt order agree on c, b, a
                assert [i for i, _ in log] == [4, 5, 2, 3, 0, 1], (step, log)
            assert opt._predictor.steps_observed >= 1  # the forward's uses taught the core
        finally:
            opt.close()


def test_learnt_order_follows_the_forward(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with dev:
        model = place(_Reversed(), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.SGD, device=dev, lr=0.1, offload_gradients=False
        )
        log = _record_uploads(opt)
        try:
            for step in range(3):
                model(torch.randn(4, 8)).square().mean().backward()
                log.clear()
                opt.step()
                opt.zero_grad()
                order = [i for i, _ in log]
                if step == 0:  # gradients come over at step() in registration order: no signal yet
                    assert order == [0, 1, 2, 3, 4, 5]
                else:  # learnt from the forward's first uses
                    assert order == [4, 5, 2, 3, 0, 1], (step, order)
        finally:
            opt.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_small_upload_budget_uploads_at_forward_triggers(make_fake_device: Any, overlap: bool) -> None:
    want = run(MLP, device=make_fake_device(), offload=False, steps=4, accumulation=2, overlap=overlap)
    got = run(
        MLP,
        device=make_fake_device(link="slow"),
        steps=4,
        accumulation=2,
        overlap=overlap,
        options={"upload_budget": 1},
    )
    assert_equivalent(got, want)


def test_budget_holds_uploads_until_the_forward(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, upload_budget=1, overlap_uploads=True
        )
        log = _record_uploads(opt)
        try:
            for step in range(2):
                MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()  # uploads what the budget still holds back
            phases = [phase for _, phase in log]
            # at step(), or right after it by the worker (Note [One host step at step()]), within the budget
            # (the first copy is always allowed)
            assert phases[0] in ("collect", "stepped")
            assert "uses" in phases  # the rest at the forward's triggers
            assert sorted(i for i, _ in log) == sorted(2 * list(range(len(list(model.parameters())))))
        finally:
            opt.close()
