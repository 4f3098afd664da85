"""FSDP2 + ``FSDPOffloadOptimizer`` keeps torch's gradient contracts, on 2 real ranks.

After each backward the sharded parameters' ``.grad`` are DTensors (the parameter's mesh and placements) whose local
tensor shows the reduce-scattered shard's host copy, so the user's own code --
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (what Trainer, accelerate, Lightning and torchtune
call), ``model.zero_grad()``, reading ``.grad`` -- gives the same bits as plain FSDP2 without offcore (the same AdamW
on host copies of each rank's shard, reading ``.grad`` at each step): losses, ``.grad`` after every backward, the clip
norms, ``.grad`` after clipping, the optimizer state and the shards. Only the "clip" case clears with
``opt.zero_grad()``; the others clear through the model only, or keep ``.grad`` across steps.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distributed_helpers import RankContext, fingerprint, local_params, run_ranks, skip_reason, tinygpt, wrap  # noqa: E402
from optimizer_offload_helpers import assert_same  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.torch]

ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
STEPS = 3
CLIP = 0.05  # small enough that clipping scales every step
# case -> (micro-steps per step, gradient sync on all micro-steps (False: only the last), how the loop clears)
CASES: dict[str, tuple[int, bool, str]] = {
    "clip": (1, True, "opt.zero_grad()"),
    "model_zero_grad": (1, True, "model.zero_grad()"),
    "zeros": (1, True, "model.zero_grad(set_to_none=False)"),
    # FSDP2 adds each micro-step's reduced shard into the .grad of the last one
    "sync_every_micro_step": (2, True, "model.zero_grad()"),
    "no_sync": (2, False, "model.zero_grad()"),
    # kept into the next step: FSDP2 adds the next reduced shard into it
    "cleared_every_third_step": (1, True, "model.zero_grad() every third step"),
    # backward twice over one forward (retain_graph=True): FSDP2 adds the second reduced shard into the shown .grad
    "retain_graph": (1, True, "model.zero_grad()"),
    # a forward (under no_grad: an evaluation) between clipping and step(): step() takes the clipped gradients
    "forward_before_step": (1, True, "model.zero_grad()"),
    # torch's per-tensor norm (foreach=False), then clip_grad_value_
    "per_tensor_and_value": (1, True, "model.zero_grad()"),
    # the first parameter's .grad replaced by a tensor of the user's before step(); zeroed through the optimizer
    "replaced": (1, True, "opt.zero_grad(set_to_none=False)"),
}


class PlainFSDPOptimizer:
    """AdamW on host copies of each rank's shard, no offcore: each step reads the parameters' ``.grad`` (None:
    skipped, as torch's optimizers skip it) and leaves them as they are; the stepped copies go back to the shards."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.to_local().detach().cpu().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **ADAMW)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.to_local().detach().cpu().clone()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.to_local().copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim.Optimizer.zero_grad() over the parameters."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()


def _grads(model: torch.nn.Module) -> list[bytes | None]:
    """The bits of each parameter's local ``.grad`` as torch operators read them (``clone``), None where cleared."""
    out: list[bytes | None] = []
    for p in model.parameters():
        if p.grad is None:
            out.append(None)
        else:
            assert type(p.grad) is type(p), f".grad is a {type(p.grad).__name__}, the parameter a {type(p).__name__}"
            assert p.grad.placements == p.placements and p.grad.device_mesh == p.device_mesh
            out.append(fingerprint([p.grad.to_local().clone()])[0])
    return out


def _clear(model: torch.nn.Module, opt: Any, how: str, step: int) -> None:
    if how == "opt.zero_grad()":
        opt.zero_grad()
    elif how == "opt.zero_grad(set_to_none=False)":
        opt.zero_grad(set_to_none=False)
    elif how == "model.zero_grad()":
        model.zero_grad()
    elif how == "model.zero_grad(set_to_none=False)":
        model.zero_grad(set_to_none=False)
    elif how == "model.zero_grad() every third step":
        if step % 3 == 2:
            model.zero_grad()
    else:
        raise ValueError(how)


def _replace_first_grad(model: torch.nn.Module, value: float) -> None:
    """``p.grad = t`` for the first parameter: a DTensor of the user's, with the parameter's mesh and placements."""
    from torch.distributed.tensor import DTensor

    first = next(model.parameters())
    first.grad = DTensor.from_local(
        torch.full_like(first.to_local(), value),
        first.device_mesh,
        first.placements,
        run_check=False,
        shape=first.shape,
        stride=first.stride(),
    )


def _train(ctx: RankContext, case: str, offload: bool) -> dict[str, Any]:
    from offcore_torch.distributed import FSDPOffloadOptimizer

    micro_steps, sync_all, how = CASES[case]
    device = ctx.make_device()
    out: dict[str, Any] = {"losses": [], "grads": [], "norms": [], "clipped": []}
    model, loss_fn, batch = tinygpt(checkpoint=False)
    with device:
        model = wrap(ctx, ctx.place(model, device), "fsdp")
        opt: Any = (
            FSDPOffloadOptimizer(model, torch.optim.AdamW, device=device, **ADAMW)
            if offload
            else PlainFSDPOptimizer(model)
        )
        try:
            for step in range(STEPS):
                for micro in range(micro_steps):
                    model.set_requires_gradient_sync(sync_all or micro == micro_steps - 1)
                    data = tuple(t.to(device.torch_device) for t in batch(step * micro_steps + micro, ctx.rank))
                    torch.manual_seed(1000 * ctx.rank + 10 * step + micro)  # dropout
                    loss = loss_fn(model, data)
                    if case == "retain_graph":
                        loss.backward(retain_graph=True)
                    loss.backward()
                    out["losses"].append(loss.detach().cpu())
                    out["grads"].append(_grads(model))
                    if case == "clip":  # the whole gradients, all-gathered from the shown shards
                        full = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
                        out.setdefault("full", []).append([None if f is None else fingerprint([f])[0] for f in full])
                norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), CLIP, foreach=False if case == "per_tensor_and_value" else None
                )
                if case == "per_tensor_and_value":
                    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
                # a DTensor over DTensor gradients (a plain 0 when no parameter has a .grad)
                out["norms"].append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).cpu().clone())
                out["clipped"].append(_grads(model))
                if case == "forward_before_step":
                    with torch.no_grad():
                        out["evaluated"] = loss_fn(model, data).detach().cpu()
                    out["evaluated_grads"] = _grads(model)
                if case == "replaced":
                    _replace_first_grad(model, 1e-3 * (step + 1))
                opt.step()
                _clear(model, opt, how, step)
            if offload:
                opt.synchronize()
                out["state"] = opt.optimizer.state_dict()
            else:
                out["state"] = opt.state_dict()
            out["params"] = fingerprint(local_params(model))
            out["after"] = _grads(model)
            del data, loss, norm
        finally:
            if offload:
                opt.close()
    kept = weakref.ref(next(model.parameters()))
    del model, opt
    gc.collect()
    out["freed"] = kept() is None
    device.synchronize()
    if ctx.kind == "cpu":
        device.check_sanitizer()
    return out


def _all_cases(ctx: RankContext) -> dict[tuple[str, bool], dict[str, Any]]:
    """Every case on this rank; an error (both ranks raise it at the same point: an OffcoreError, or torch's own when
    no parameter has a ``.grad``) is kept as the case's result, so the other cases still run."""
    results: dict[tuple[str, bool], dict[str, Any]] = {}
    for case in CASES:
        for offload in (False, True):
            try:
                results[(case, offload)] = _train(ctx, case, offload)
            except Exception:
                results[(case, offload)] = {"error": traceback.format_exc()}
    return results


_RESULTS: dict[str, list[Any]] = {}


def _results(backend_name: str) -> list[Any]:
    reason = skip_reason(backend_name)
    if reason is not None:
        pytest.skip(reason)
    if backend_name not in _RESULTS:
        _RESULTS[backend_name] = run_ranks(_all_cases, backend_name=backend_name)
    return _RESULTS[backend_name]


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_gradients_keep_torch_contracts_bit_for_bit(backend_name: str, case: str) -> None:
    """Every number the user's loop sees matches plain FSDP2's; clipping through ``model.parameters()`` scaled every
    step (on the old code ``.grad`` was None after backward: the norm was 0 and nothing was clipped, and a gradient
    after ``step()`` cleared by the model was refused)."""
    results = _results(backend_name)
    for rank, result in enumerate(results):
        got, want = result[(case, True)], result[(case, False)]
        where = f"rank {rank} {case}"
        assert "error" not in want, f"{where} (plain FSDP2) raised:\n{want['error']}"
        assert "error" not in got, f"{where} raised:\n{got['error']}"
        assert got["grads"] == want["grads"], f"{where}: .grad after backward differs from plain FSDP2's"
        assert_same(got["norms"], want["norms"], f"{where} clip norms")
        assert_same(got["losses"], want["losses"], f"{where} losses")
        assert got["clipped"] == want["clipped"], f"{where}: .grad after clip_grad_norm_ differs from plain FSDP2's"
        assert_same(got["state"], want["state"], f"{where} optimizer state")
        assert got["params"] == want["params"], f"{where}: shards differ"
        assert got["after"] == want["after"], f"{where}: .grad after the last step differs"
        assert got.get("full") == want.get("full"), f"{where}: .grad.full_tensor() differs"
        assert got.get("evaluated_grads") == want.get("evaluated_grads"), f"{where}: .grad after a forward differs"
        assert got["freed"] and want["freed"], f"{where}: the model outlived the run"
        assert all(float(n) > CLIP for n in got["norms"]), f"{where}: clipping never scaled ({got['norms']})"
        assert all(g is not None for grads in got["clipped"] for g in grads), f"{where}: a .grad was None"
    assert_same(results[0][(case, True)]["norms"], results[1][(case, True)]["norms"], f"{case}: norms of the ranks")
    assert results[0][(case, True)]["params"] != results[1][(case, True)]["params"], "the shards are the same"
