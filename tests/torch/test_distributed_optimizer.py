"""OffloadOptimizer under DDP and FSDP2 on 2 real ranks: bit-identical to the same distributed run
with the same optimizer on host copies (no offload).

- DDP: gradients reach the host after DDP's all-reduce (a communication hook), with
  ``no_sync`` accumulation, reduce-every-micro-step accumulation and clipping.
- FSDP2: each rank's host optimizer steps its local shard; accumulation with
  ``set_requires_gradient_sync(False)``; clipping over the sharded gradients, against
  ``torch.nn.utils.clip_grad_norm_`` on FSDP2's DTensor gradients; ``state_dict()`` saved with
  ``torch.distributed.checkpoint`` on 2 ranks resumes bit-identically on 2 fresh ranks.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distributed_helpers import RankContext, fingerprint, local_params, run_ranks, skip_reason, tinygpt, wrap  # noqa: E402
from optimizer_offload_helpers import HostReference, assert_same  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.torch]

ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
STEPS = 4
SAVE_AFTER = 2  # the FSDP2 "plain" offloaded run saves a checkpoint after this many steps
# case -> micro-steps per step; "activations": activation offload too (offloaded runs)
CASES = {"plain": 1, "nosync": 2, "sync_accum": 2, "clip": 1, "activations": 1}
CLIP = 0.05  # small enough that clipping scales every step


class ShardReference:
    """FSDP2 + AdamW on host copies of each rank's local shards (no offcore): the numbers to match."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.to_local().detach().cpu().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **ADAMW)

    def accumulate(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            g = p.grad.to_local()
            if m.grad is None:
                m.grad = g.detach().cpu().clone()
            else:
                m.grad.add_(g.cpu())
            p.grad = None

    def step(self) -> None:
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.to_local().copy_(m)

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def _train(
    ctx: RankContext,
    engine: str,
    case: str,
    offload: bool,
    *,
    ckpt: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    import offcore_torch
    import torch.distributed.checkpoint as dcp
    from offcore_torch.distributed import FSDPOffloadOptimizer, attach_ddp, clip_grad_norm_

    accumulation = CASES[case]
    # the checkpointed run's copies are slow: the save right after step() finds its H2D copies in flight
    device = ctx.make_device(latency="2ms") if ckpt is not None else ctx.make_device()
    out: dict[str, Any] = {"losses": [], "norms": []}
    model, loss_fn, batch = tinygpt(checkpoint=False)
    with device:
        options = {"gradient_as_bucket_view": True} if engine == "ddp" and offload else {}
        model = wrap(ctx, ctx.place(model, device), engine, **options)
        opt: Any
        if not offload:
            # DDP reducing every micro-step adds each local gradient into the reduced .grad of the last one, then
            # reduces the sum (plain DDP's numbers): the reference reads .grad once, at the last micro-step
            opt = (
                HostReference(model, torch.optim.AdamW, ADAMW, master_weights=False, sum_on_device=case == "sync_accum")
                if engine == "ddp"
                else None
            )
            opt = opt or ShardReference(model)
        elif engine == "ddp":
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=device, **ADAMW)
            out["handoff"] = attach_ddp(model, opt)
        else:
            opt = FSDPOffloadOptimizer(model, torch.optim.AdamW, device=device, **ADAMW)
        first = 0
        if resume:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(state, checkpoint_id=ckpt)
            opt.load_state_dict(state["optim"])
            first = SAVE_AFTER
        try:
            for step in range(first, STEPS):
                if ckpt is not None and not resume and step == SAVE_AFTER:
                    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
                for micro in range(accumulation):
                    sync = micro == accumulation - 1 or case == "sync_accum"
                    if engine == "fsdp":
                        model.set_requires_gradient_sync(sync)
                    quiet = model.no_sync() if engine == "ddp" and not sync else contextlib.nullcontext()
                    torch.manual_seed(1000 * ctx.rank + 10 * step + micro)  # dropout, reproducible on resume
                    with quiet:
                        data = tuple(t.to(device.torch_device) for t in batch(step * accumulation + micro, ctx.rank))
                        offload_act = offload and case == "activations"
                        with (
                            offcore_torch.offload_activations(device, min_bytes=0)
                            if offload_act
                            else contextlib.nullcontext()
                        ):
                            loss = loss_fn(model, data)
                        loss.backward()
                    out["losses"].append(loss.detach().cpu())
                    if not offload and sync and not (case == "clip" and engine == "fsdp"):
                        opt.accumulate(**({"last": micro == accumulation - 1} if engine == "ddp" else {}))
                if case == "clip":
                    if offload:
                        out["norms"].append(clip_grad_norm_(opt, CLIP))
                    elif engine == "ddp":
                        out["norms"].append(torch.nn.utils.clip_grad_norm_(opt.masters, CLIP))
                    else:  # torch's own clipping of FSDP2's DTensor gradients, before they go to the host copies
                        norm = torch.nn.utils.clip_grad_norm_(opt.params, CLIP)
                        out["norms"].append(norm.full_tensor().cpu())
                        opt.accumulate()
                opt.step()
                opt.zero_grad()
            if offload:
                opt.synchronize()
                inner = opt if engine == "ddp" else opt.optimizer
                out["state"] = inner.state_dict()
                out["handed"] = out.pop("handoff").buckets_handed if engine == "ddp" else None
            else:
                out["state"] = opt.opt.state_dict()
            out["params"] = fingerprint(local_params(model))
            del data, loss
            offcore_torch.synchronize(device)  # activation offload drops landed device buffers at its next poll
            out["device_bytes"] = device.memory_stats().allocated_bytes
            out["param_bytes"] = sum(p.numel() * p.element_size() for p in local_params(model))
        finally:
            if offload:
                opt.close()
    device.synchronize()
    if ctx.kind == "cpu":
        device.check_sanitizer()
    return out


def _all_cases(ctx: RankContext, ckpt: str) -> dict[tuple[str, str, bool], dict[str, Any]]:
    return {
        (engine, case, offload): _train(
            ctx, engine, case, offload, ckpt=ckpt if (engine, case, offload) == ("fsdp", "plain", True) else None
        )
        for engine in ("ddp", "fsdp")
        for case in CASES
        for offload in (False, True)
    }


def _resumed(ctx: RankContext, ckpt: str) -> dict[str, Any]:
    return _train(ctx, "fsdp", "plain", True, ckpt=ckpt, resume=True)


_RESULTS: dict[str, tuple[list[Any], list[Any]]] = {}


def ctx_is_fake(backend_name: str) -> bool:
    return backend_name.split(":")[0] == "cpu"


def _results(backend_name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    reason = skip_reason(backend_name)
    if reason is not None:
        pytest.skip(reason)
    if backend_name not in _RESULTS:
        ckpt = str(Path(tmp_path_factory.mktemp("dcp")) / "step2")
        trained = run_ranks(_all_cases, backend_name=backend_name, ckpt=ckpt)
        resumed = run_ranks(_resumed, backend_name=backend_name, ckpt=ckpt)  # fresh processes, fresh group
        _RESULTS[backend_name] = (trained, resumed)
    return _RESULTS[backend_name]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_offload_optimizer_is_bit_identical(
    backend_name: str, tmp_path_factory: pytest.TempPathFactory, engine: str, case: str
) -> None:
    trained, _ = _results(backend_name, tmp_path_factory)
    for rank, result in enumerate(trained):
        got, want = result[(engine, case, True)], result[(engine, case, False)]
        where = f"rank {rank} {engine} {case}"
        assert len(got["losses"]) == STEPS * CASES[case]
        assert_same(got["norms"], want["norms"], f"{where} clip norms")
        assert_same(got["losses"], want["losses"], f"{where} losses")
        assert_same(got["state"], want["state"], f"{where} optimizer state")
        assert got["params"] == want["params"], f"{where}: parameters differ"
        if ctx_is_fake(backend_name):  # between steps the device holds the parameters (+ DDP's buckets), no state
            buckets = got["param_bytes"] if engine == "ddp" else 0
            assert got["device_bytes"] <= got["param_bytes"] + buckets + 64 * 1024, (where, got["device_bytes"])
        if engine == "ddp":  # every step's reduced buckets went through the communication hook
            assert got["handed"] >= STEPS * (CASES[case] if case == "sync_accum" else 1)
    if case == "clip":
        assert all(float(n) > CLIP for n in trained[0][(engine, case, True)]["norms"]), "clipping never scaled"
        assert_same(trained[0][(engine, case, True)]["norms"], trained[1][(engine, case, True)]["norms"], "norm ranks")
    if engine == "ddp":  # replicas stay identical
        assert trained[0][(engine, case, True)]["params"] == trained[1][(engine, case, True)]["params"]
    else:  # shards differ
        assert trained[0][(engine, case, True)]["params"] != trained[1][(engine, case, True)]["params"]


def test_fsdp_checkpoint_resumes_bit_identically(backend_name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    trained, resumed = _results(backend_name, tmp_path_factory)
    for rank in range(2):
        full, again = trained[rank][("fsdp", "plain", True)], resumed[rank]
        assert_same(again["losses"], full["losses"][SAVE_AFTER:], f"rank {rank} losses after resume")
        assert_same(again["state"], full["state"], f"rank {rank} optimizer state")
        assert again["params"] == full["params"], f"rank {rank}: parameters after resume differ"


def _plain_optimizer_over_fsdp(ctx: RankContext) -> str:
    """A plain OffloadOptimizer over FSDP2's DTensor parameters: the error it raises (it once killed the rank)."""
    import offcore_torch

    import offcore

    device = ctx.make_device()
    model, _, _ = tinygpt(checkpoint=False)
    with device:
        model = wrap(ctx, ctx.place(model, device), "fsdp")
        try:
            offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=device, **ADAMW)
        except offcore.ConfigurationError as exc:
            return str(exc)
    return "constructed"


@pytest.mark.slow
def test_a_plain_offload_optimizer_over_fsdp_names_fsdp_offload_optimizer(backend_name: str) -> None:
    """Each rank gets a ConfigurationError naming FSDPOffloadOptimizer (the fake device's copy of a DTensor was
    a memmove of the global size from the shard's address: SIGSEGV in the constructor)."""
    reason = skip_reason(backend_name)
    if reason is not None:
        pytest.skip(reason)
    for rank, said in enumerate(run_ranks(_plain_optimizer_over_fsdp, backend_name=backend_name)):
        assert "FSDPOffloadOptimizer" in said, f"rank {rank}: {said}"
