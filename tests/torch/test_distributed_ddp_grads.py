"""DDP + OffloadOptimizer (``attach_ddp``) keeps torch's gradient contracts, on 2 real ranks.

After each backward the parameters' ``.grad`` show DDP's reduced gradients (their host copies), so the user's
own code -- ``torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)``, ``model.zero_grad()``,
``ddp.zero_grad(set_to_none=...)``, reading ``.grad`` -- gives the same bits as plain DDP without offcore (the same
AdamW on host copies of the parameters, reading ``.grad`` at each step): losses, ``.grad`` after every backward,
the clip norms, ``.grad`` after clipping, the optimizer state and the parameters. Only the "clip" case clears with
``opt.zero_grad()``; the others clear through the model only, or keep ``.grad`` across steps.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distributed_helpers import RankContext, fingerprint, run_ranks, skip_reason, tinygpt, wrap  # noqa: E402
from optimizer_offload_helpers import assert_same  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.torch]

ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
STEPS = 3
CLIP = 0.05  # small enough that clipping scales every step
# case -> (micro-steps per step, no_sync on all but the last, how the loop clears after step(), DDP options)
CASES: dict[str, tuple[int, bool, str, dict[str, Any]]] = {
    "clip": (1, False, "opt.zero_grad()", {}),
    "no_sync": (2, True, "ddp.zero_grad(set_to_none=True)", {}),
    "no_sync_zeros": (2, True, "ddp.zero_grad(set_to_none=False)", {}),
    "no_sync_bucket_copies": (2, True, "model.zero_grad()", {"gradient_as_bucket_view": False}),
    "sync_every_micro_step": (2, False, "model.zero_grad()", {}),
    # torch.autograd.grad over the parameters between backward and clipping: no .grad written
    "autograd_grad_between": (1, False, "model.zero_grad()", {}),
    # step 0's .grad is kept into step 1 (DDP's bucket rebuild at the 2nd forward copies it into the bucket) and
    # step 1's into step 2 (added to on the device)
    "cleared_every_third_step": (1, False, "model.zero_grad() every third step", {}),
    # the last micro-step under no_sync() too: nothing reduced before step()
    "no_sync_only": (1, True, "model.zero_grad()", {}),
}


class PlainDDPOptimizer:
    """AdamW on host copies of the parameters, no offcore: each step reads the parameters' ``.grad`` (None: skipped,
    as torch's optimizers skip it) and leaves them as they are; the updated copies go back to the parameters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().cpu().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **ADAMW)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().cpu().clone()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def zero_grad(self) -> None:
        """torch.optim.Optimizer.zero_grad() over the parameters: their ``.grad`` set to None."""
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()


def _grads(model: torch.nn.Module) -> list[bytes | None]:
    """The bits of each parameter's ``.grad`` as torch operators read them (``clone``), None where cleared."""
    return [None if p.grad is None else fingerprint([p.grad.clone()])[0] for p in model.parameters()]


def _clear(ddp: Any, model: torch.nn.Module, opt: Any, how: str, step: int) -> None:
    if how == "opt.zero_grad()":
        opt.zero_grad()
    elif how == "model.zero_grad()":
        model.zero_grad()
    elif how == "ddp.zero_grad(set_to_none=True)":
        ddp.zero_grad(set_to_none=True)
    elif how == "ddp.zero_grad(set_to_none=False)":
        ddp.zero_grad(set_to_none=False)
    elif how == "model.zero_grad() every third step":
        if step % 3 == 2:
            model.zero_grad()
    else:
        raise ValueError(how)


def _train(ctx: RankContext, case: str, offload: bool) -> dict[str, Any]:
    import offcore_torch

    micro_steps, quiet, how, options = CASES[case]
    device = ctx.make_device()
    out: dict[str, Any] = {"losses": [], "grads": [], "norms": [], "clipped": []}
    model, loss_fn, batch = tinygpt(checkpoint=False)
    with device:
        model = ctx.place(model, device)
        if offload:
            ddp = wrap(ctx, model, "ddp", **{"gradient_as_bucket_view": True, **options})
            opt: Any = offcore_torch.OffloadOptimizer(ddp.parameters(), torch.optim.AdamW, device=device, **ADAMW)
            offcore_torch.attach_ddp(ddp, opt)
        else:
            ddp = wrap(ctx, model, "ddp", **options)
            opt = PlainDDPOptimizer(ddp)
        try:
            for step in range(STEPS):
                for micro in range(micro_steps):
                    last = micro == micro_steps - 1 and case != "no_sync_only"
                    with ddp.no_sync() if quiet and not last else contextlib.nullcontext():
                        data = tuple(t.to(device.torch_device) for t in batch(step * micro_steps + micro, ctx.rank))
                        torch.manual_seed(1000 * ctx.rank + 10 * step + micro)  # dropout
                        loss = loss_fn(ddp, data)
                        loss.backward()
                    out["losses"].append(loss.detach().cpu())
                    out["grads"].append(_grads(model))
                if case == "autograd_grad_between":
                    extra = torch.autograd.grad(loss_fn(model, data), list(model.parameters()))
                    out["extra"] = fingerprint(extra)
                    out["grads"].append(_grads(model))
                out["norms"].append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP).detach().cpu().clone())
                out["clipped"].append(_grads(model))
                opt.step()
                _clear(ddp, model, opt, how, step)
            if offload:
                opt.synchronize()
            out["state"] = opt.state_dict()
            out["params"] = fingerprint(list(model.parameters()))
            out["after"] = _grads(model)
            del data, loss
        finally:
            if offload:
                opt.close()  # attach_ddp's handoff is left to go with the DDP module
    kept = weakref.ref(next(model.parameters()))
    del model, ddp, opt
    gc.collect()
    out["freed"] = kept() is None
    device.synchronize()
    if ctx.kind == "cpu":
        device.check_sanitizer()
    return out


def _all_cases(ctx: RankContext) -> dict[tuple[str, bool], dict[str, Any]]:
    """Every case on this rank; an OffcoreError (both ranks raise it at the same point) is kept as the case's result,
    so the other cases still run."""
    import offcore

    results: dict[tuple[str, bool], dict[str, Any]] = {}
    for case in CASES:
        for offload in (False, True):
            try:
                results[(case, offload)] = _train(ctx, case, offload)
            except offcore.OffcoreError:
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


@pytest.mark.parametrize("case", [case for case in CASES if case != "no_sync_only"])
def test_ddp_gradients_keep_torch_contracts_bit_for_bit(backend_name: str, case: str) -> None:
    """Every number the user's loop sees matches plain DDP's; clipping through ``ddp.parameters()`` scaled every
    step (on the old code ``.grad`` was None after backward: the norm was 0 and nothing was clipped, and a gradient
    after ``step()`` cleared by the model was refused)."""
    results = _results(backend_name)
    for rank, result in enumerate(results):
        got, want = result[(case, True)], result[(case, False)]
        where = f"rank {rank} {case}"
        assert "error" not in got, f"{where} raised:\n{got['error']}"
        assert got["grads"] == want["grads"], f"{where}: .grad after backward differs from plain DDP's"
        assert_same(got["norms"], want["norms"], f"{where} clip norms")
        assert_same(got["losses"], want["losses"], f"{where} losses")
        assert got["clipped"] == want["clipped"], f"{where}: .grad after clip_grad_norm_ differs from plain DDP's"
        assert_same(got["state"], want["state"], f"{where} optimizer state")
        assert got["params"] == want["params"], f"{where}: parameters differ"
        assert got["after"] == want["after"], f"{where}: .grad after the last step differs"
        assert got.get("extra") == want.get("extra"), f"{where}: torch.autograd.grad's result differs"
        assert got["freed"] and want["freed"], f"{where}: the model outlived the run"
        assert all(float(n) > CLIP for n in got["norms"]), f"{where}: clipping never scaled ({got['norms']})"
        assert all(g is not None for grads in got["grads"] for g in grads), f"{where}: a .grad was None"
    assert results[0][(case, True)]["params"] == results[1][(case, True)]["params"], "replicas differ"


def test_a_step_after_only_no_sync_backwards_is_refused(backend_name: str) -> None:
    """A ``step()`` whose micro-steps all ran under ``no_sync()``: plain DDP steps each rank's unreduced local sum
    (the replicas drift apart); the host has no reduced gradient, so offcore refuses it on every rank, naming the fix
    (on the old code the step skipped every parameter silently)."""
    results = _results(backend_name)
    for rank, result in enumerate(results):
        said = result[("no_sync_only", True)].get("error", "")
        assert "did not reduce" in said and "outside no_sync()" in said, f"rank {rank}: {said or 'no error'}"
        assert "error" not in result[("no_sync_only", False)]


# -- find_unused_parameters=True: parameters some or all ranks leave out of a forward -----------------------------

# case -> (who leaves the middle layer out: "all" ranks on even steps, "one" rank per step; clear after step(),
# gradient_as_bucket_view of the offloaded run)
UNUSED_CASES: dict[str, tuple[str, bool, bool]] = {
    "all_ranks_cleared": ("all", True, True),
    "all_ranks_kept": ("all", False, False),
    "one_rank_cleared": ("one", True, False),
    "one_rank_kept": ("one", False, True),
}


class _Branchy(torch.nn.Module):
    """Three linear layers; the middle one is skipped when ``skip`` is true (DDP needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(h if skip else self.b(h)).square().mean()


def _train_unused(ctx: RankContext, case: str, offload: bool) -> dict[str, Any]:
    import offcore_torch

    who, clear, bucket_view = UNUSED_CASES[case]
    device = ctx.make_device()
    out: dict[str, Any] = {"grads": [], "norms": []}
    with device:
        model = ctx.place(_Branchy(), device)
        if offload:
            ddp = wrap(ctx, model, "ddp", find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
            opt: Any = offcore_torch.OffloadOptimizer(ddp.parameters(), torch.optim.AdamW, device=device, **ADAMW)
            offcore_torch.attach_ddp(ddp, opt)
        else:
            ddp = wrap(ctx, model, "ddp", find_unused_parameters=True)
            opt = PlainDDPOptimizer(ddp)
        try:
            for step in range(4):
                # "all": no rank uses b at step 0 (the first backward) and 2; "one": rank (step % 2) skips it
                skip = step % 2 == 0 if who == "all" else step % 2 == ctx.rank
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2 * step + ctx.rank))
                ddp(x.to(device.torch_device), skip).backward()
                out["grads"].append(_grads(model))
                out["norms"].append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP).detach().cpu().clone())
                opt.step()
                if clear:
                    model.zero_grad()
            if offload:
                opt.synchronize()
            out["params"] = fingerprint(list(model.parameters()))
        finally:
            if offload:
                opt.close()
    device.synchronize()
    if ctx.kind == "cpu":
        device.check_sanitizer()
    return out


def _all_unused_cases(ctx: RankContext) -> dict[tuple[str, bool], dict[str, Any]]:
    import offcore

    results: dict[tuple[str, bool], dict[str, Any]] = {}
    for case in UNUSED_CASES:
        for offload in (False, True):
            try:
                results[(case, offload)] = _train_unused(ctx, case, offload)
            except offcore.OffcoreError:
                results[(case, offload)] = {"error": traceback.format_exc()}
    return results


_UNUSED_RESULTS: dict[str, list[Any]] = {}


@pytest.mark.parametrize("case", list(UNUSED_CASES))
def test_ddp_parameters_left_out_of_a_forward_match_plain_ddp(backend_name: str, case: str) -> None:
    """A parameter no rank used keeps its ``.grad`` as plain DDP leaves it (None after a clear: not stepped; the last
    one when kept), one some rank used gets the reduced gradient, bit for bit (on the old code the zeroed bucket
    slice of a parameter no rank used was stepped, moving it by weight decay, and a later one was refused)."""
    reason = skip_reason(backend_name)
    if reason is not None:
        pytest.skip(reason)
    if backend_name not in _UNUSED_RESULTS:
        _UNUSED_RESULTS[backend_name] = run_ranks(_all_unused_cases, backend_name=backend_name)
    for rank, result in enumerate(_UNUSED_RESULTS[backend_name]):
        got, want = result[(case, True)], result[(case, False)]
        where = f"rank {rank} {case}"
        assert "error" not in got, f"{where} raised:\n{got['error']}"
        assert got["grads"] == want["grads"], f"{where}: .grad after backward differs from plain DDP's"
        assert_same(got["norms"], want["norms"], f"{where} clip norms")
        assert got["params"] == want["params"], f"{where}: parameters differ"
    if UNUSED_CASES[case][0] == "all":  # the first backward left b's .grad None: nothing to step
        assert want["grads"][0][2] is None and want["grads"][0][3] is None
