"""The sanitizer reports the binding's hazards, not only poisons them (Note [Operators checked against copies in flight]).

Each hazard is a user's read of state offcore still moves. With the binding's protection
switched off (today's overlap, kept as an opt-in), the read races with a copy in flight and
the sanitized fake device records an ``access-in-flight`` violation naming the operator, the
argument, the copy and both streams -- not only a NaN somewhere. The copies are held at a
gate (Note [Gates]), so each race is certain, never a matter of timing. With the protection
on (the default), the same read is ordered after the copy: no violation, the stepped values.

1. parameters read right after ``step()`` while OffloadOptimizer's uploads are in flight
   (``overlap_uploads=True``): an EMA update, a weight norm. (``torch.func.functional_call`` with the
   model's parameters waits in the optimizer's module pre-hook even then: it is checked with the protection on.)
2. ``.grad`` written by the optimizer's worker thread after ``backward()`` returned: clipping over the
   optimizer's ``param_groups`` (Lightning's) reads the host gradients while the worker still sums into them
   (Note [Host work the worker does is declared to the sanitizer]). With the protection on, the tests of
   ``test_optimizer_contract.py`` run the same reads with the reporting on and see no violation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402

WORK = mlp_workload(d_in=32, width=32, depth=2, d_out=32, batch_size=4)


def _trained(dev: Any, **options: Any) -> tuple[torch.nn.Module, Any]:
    """A model with an OffloadOptimizer that has a backward behind it (its step not taken yet)."""
    model = place(WORK.build(0), dev)
    opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1, **options)
    WORK.loss(model, WORK.make_batch(0, torch.device("cpu"))).backward()
    return model, opt


def _ema(model: torch.nn.Module, ema: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for average, p in zip(ema, model.parameters(), strict=True):
            average.mul_(0.9).add_(p, alpha=0.1)


def _norm(model: torch.nn.Module, out: list[torch.Tensor]) -> None:
    out.extend(torch.linalg.vector_norm(p.detach()) for p in model.parameters())


def _functional_call(model: torch.nn.Module, out: list[torch.Tensor]) -> None:
    twin = WORK.build(1)  # another module of the architecture: the optimizer's hooks are not on it
    batch = WORK.make_batch(1, torch.device("cpu"))
    with torch.no_grad():
        out.append(torch.func.functional_call(twin, dict(model.named_parameters()), (batch[0],)))


READS: dict[str, tuple[Callable[[torch.nn.Module, list[torch.Tensor]], None], str]] = {
    "ema": (lambda model, out: _ema(model, out), "aten.add_.Tensor"),
    "weight norm": (_norm, "aten.linalg_vector_norm.default"),
    "functional_call": (_functional_call, "aten.addmm.default"),
}


@pytest.mark.parametrize("read", ["ema", "weight norm"])  # functional_call: the optimizer's module pre-hook waits
def test_a_parameter_read_after_step_with_uploads_in_flight_is_reported(make_fake_device: Any, read: str) -> None:
    """Hazard 1 with ``overlap_uploads=True``: the read races with the step's upload (reported, not only NaN)."""
    dev = make_fake_device(link="slow")
    reader, op = READS[read]
    with dev:
        model, opt = _trained(dev, overlap_uploads=True)
        try:
            out = [p.detach().clone() for p in model.parameters()] if read == "ema" else []
            with dev.gate(direction="h2d", timeout=20) as gate:
                opt.step()
                opt.zero_grad()  # issues every upload the step left due (held at the gate)
                gate.wait_held(1)
                reader(model, out)
            opt.synchronize()
        finally:
            opt.close()
    found = dev.sanitizer_violations(clear=True)
    assert found, "a read of parameters whose uploads are in flight must be reported"
    assert {v["kind"] for v in found} == {"access-in-flight"}, found
    assert {(v["op"], v["access"], v["side"], v["direction"]) for v in found} == {(op, "read", "destination", "h2d")}
    assert all("compute stream" in v["op_stream"] and v["stream"] for v in found), found


@pytest.mark.parametrize("read", list(READS))
def test_with_the_protection_on_the_same_read_is_ordered_and_stepped(make_fake_device: Any, read: str) -> None:
    """The default (``overlap_uploads=False``): the read is ordered after the uploads -- no violation, and the
    values read are the stepped ones (those of the masters)."""
    dev = make_fake_device(link="slow")
    reader, _ = READS[read]
    with dev:
        model, opt = _trained(dev)
        try:
            out = [p.detach().clone() for p in model.parameters()] if read == "ema" else []
            opt.step()
            opt.zero_grad()
            reader(model, out)
            assert dev.sanitizer_violations() == []
            assert not any(torch.isnan(t).any() for t in out), "no poison was read"
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _reference_step(), strict=True))
        finally:
            opt.close()


def _reference_step() -> list[torch.Tensor]:
    """The parameters after the same step with torch.optim.SGD alone."""
    model = WORK.build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    WORK.loss(model, WORK.make_batch(0, torch.device("cpu"))).backward()
    opt.step()
    return [p.detach() for p in model.parameters()]


def test_host_gradients_read_right_after_backward_while_the_worker_sums_into_them_are_reported(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hazard 2 with its protection switched off: the second micro-step's gradients are summed into the host
    gradients by the worker after backward returned; Lightning-style clipping over ``param_groups`` reads them
    meanwhile. The protection (Note [Gradients are final when backward returns]: backward's end waits for the
    worker) has no switch of its own; the test turns it off by not queueing its autograd callback."""
    monkeypatch.setattr(offcore_torch.OffloadOptimizer, "_hook_backward_end", lambda self: None)
    dev = make_fake_device(link="slow")
    with dev:
        model, opt = _trained(dev)  # micro-step 1
        try:
            opt.zero_grad(set_to_none=False)  # drains the worker: the host gradients stay, zeroed
            with dev.gate(direction="d2h", timeout=20) as gate:
                WORK.loss(model, WORK.make_batch(1, torch.device("cpu"))).backward()  # micro-step 2
                gate.wait_held(1)  # the worker waits for this copy before it sums
                grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
                assert grads, "the host gradients of micro-step 1 are the optimizer's .grad"
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            opt.zero_grad()
        finally:
            opt.close()
    found = dev.sanitizer_violations(clear=True)
    assert found, "reading host gradients the worker still writes must be reported"
    assert {v["kind"] for v in found} == {"access-in-flight"}, found
    assert all(v["side"] == "destination" and "OffloadOptimizer's worker" in v["message"] for v in found), found
    assert {(v["op"], v["access"]) for v in found} == {
        ("aten._foreach_norm.Scalar", "read"),  # the total norm
        ("aten._foreach_mul_.Tensor", "write"),  # the clipping
    }, found
