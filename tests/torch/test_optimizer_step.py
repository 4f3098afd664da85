"""``OffloadOptimizer.step()`` (Note [One host step at step()]), on the sanitized fake device.

- with every gradient landed, ``step()`` makes one optimizer call over the first-needed lead
  (whose uploads it issues) and one over all the rest, never one per chunk;
- the rest's uploads, due when ``step()`` returns, are issued by ``zero_grad()``, or by the forward /
  a ``state_dict()`` / ``synchronize()`` when one comes first (Note [Who issues step()'s uploads]): the
  numbers stay bit-identical to the host reference either way (the sanitizer poisons what an unwaited
  copy would leave behind).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
import offcore_torch.optimizer.rounds as rounds_module  # noqa: E402
import offcore_torch.optimizer.slots as slots_module  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import assert_equivalent, place, run  # noqa: E402

MLP = mlp_workload(d_in=16, width=64, depth=3, d_out=8, batch_size=8)


@pytest.fixture
def always_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lead even for the small test model (the default needs more than 1 MiB of masters)."""
    monkeypatch.setattr(slots_module, "_LEAD_MIN_BYTES", 0)


def test_step_makes_two_optimizer_calls(
    make_fake_device: Any, always_lead: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, fused=True)
        calls: list[int] = []
        host_step = rounds_module._unhooked_step  # the host optimizer's step, without torch's step hooks

        def counting(host: Any) -> None:
            calls.append(sum(len(g["params"]) for g in host.param_groups))
            host_step(host)

        monkeypatch.setattr(rounds_module, "_unhooked_step", counting)
        issued: list[int] = []
        copy_uploads = opt._copy_uploads  # every upload goes through it, once (a batch at a time)

        def spy(slots: Any, *args: Any) -> Any:
            issued.extend(slot.index for slot in slots)
            return copy_uploads(slots, *args)

        opt._copy_uploads = spy  # type: ignore[method-assign]
        try:
            n = len(list(model.parameters()))
            for step in range(3):
                MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
                opt.host_grads()  # every gradient landed
                calls.clear()
                issued.clear()
                opt.step()
                lead = calls[0]
                assert len(calls) == 2 and 1 <= lead < n and sum(calls) == n, calls
                assert len(issued) >= lead  # the lead's uploads were issued before step() returned
                opt.zero_grad()
                assert sorted(issued) == list(range(n))  # zero_grad() issued the rest, each once
        finally:
            opt.close()


@pytest.mark.parametrize("issuer", ["zero_grad", "uses"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_due_uploads_bit_identical(make_fake_device: Any, always_lead: None, issuer: str, accumulation: int) -> None:
    first = issuer == "uses"  # zero_grad() after the next forward: the forward issues them
    want = run(
        MLP,
        device=make_fake_device(),
        offload=False,
        steps=4,
        accumulation=accumulation,
        zero_grad_before_backward=first,
    )
    got = run(
        MLP, device=make_fake_device(link="slow"), steps=4, accumulation=accumulation, zero_grad_before_backward=first
    )
    assert_equivalent(got, want)


def test_model_state_dict_right_after_step_with_uploads_not_issued(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.5)
        try:
            MLP.loss(model, MLP.make_batch(0, torch.device("cpu"))).backward()
            opt.step()
            saved = model.state_dict()  # Note [A checkpoint reads landed parameters]: issues and waits
            for name, param in model.named_parameters():
                assert torch.equal(saved[name], opt.master(param)), name
        finally:
            opt.close()
