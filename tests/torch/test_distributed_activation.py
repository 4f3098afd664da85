"""Activation offload under DDP and FSDP2 on 2 real ranks: bit-identical to the same run without offload.

Each rank has its own sanitized fake device (its own accelerator on hardware); the models
are TinyGPT and a small Hugging Face GPT-2, both with activation checkpointing and dropout.
One spawn runs every case (rank start-up dominates); each test checks its part.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distributed_helpers import (  # noqa: E402
    RankContext,
    fingerprint,
    hf_gpt2,
    local_params,
    run_ranks,
    skip_reason,
    tinygpt,
    wrap,
)

pytestmark = [pytest.mark.distributed, pytest.mark.torch]

MODELS = {"tinygpt": tinygpt, "gpt2": hf_gpt2}
ENGINES = ("ddp", "fsdp")
STEPS = 3


def _train(ctx: RankContext, engine: str, model_name: str, offload: bool) -> dict[str, Any]:
    import offcore_torch

    device = ctx.make_device()
    try:
        model, loss_fn, batch = MODELS[model_name](checkpoint=True)
        torch.manual_seed(1000 + ctx.rank)  # dropout: the same stream in both variants
        with device:
            model = wrap(ctx, ctx.place(model, device), engine)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses, stats = [], []
            for step in range(STEPS):
                data = tuple(t.to(device.torch_device) for t in batch(step, ctx.rank))
                if offload:
                    with offcore_torch.offload_activations(device, min_bytes=0) as handle:
                        loss = loss_fn(model, data)
                else:
                    loss = loss_fn(model, data)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().cpu())
                if offload:
                    stats.append(handle.stats().offloaded_bytes)
            params = fingerprint(local_params(model))
        device.synchronize()
        if ctx.kind == "cpu":
            device.check_sanitizer()
        return {"losses": losses, "params": params, "offloaded": stats}
    finally:
        if hasattr(device, "close"):
            device.close()


def _all_cases(ctx: RankContext) -> dict[tuple[str, str, bool], dict[str, Any]]:
    return {
        (engine, name, offload): _train(ctx, engine, name, offload)
        for engine in ENGINES
        for name in MODELS
        for offload in (False, True)
    }


_RESULTS: dict[str, list[Any]] = {}


def _results(backend_name: str) -> list[Any]:
    reason = skip_reason(backend_name)
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("transformers")
    if backend_name not in _RESULTS:
        _RESULTS[backend_name] = run_ranks(_all_cases, backend_name=backend_name)
    return _RESULTS[backend_name]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_activation_offload_is_bit_identical(backend_name: str, engine: str, model_name: str) -> None:
    ranks = _results(backend_name)
    for rank, result in enumerate(ranks):
        plain, offloaded = result[(engine, model_name, False)], result[(engine, model_name, True)]
        assert all(n > 0 for n in offloaded["offloaded"]), f"rank {rank}: nothing was offloaded"
        for step, (a, b) in enumerate(zip(plain["losses"], offloaded["losses"], strict=True)):
            assert torch.equal(a, b), f"rank {rank} {engine} {model_name} step {step}: loss {a} != {b}"
        assert plain["params"] == offloaded["params"], f"rank {rank} {engine} {model_name}: parameters differ"
    # the ranks saw different data, and the engine kept their parameters in sync
    assert not torch.equal(
        ranks[0][(engine, model_name, True)]["losses"][0], ranks[1][(engine, model_name, True)]["losses"][0]
    )
    if engine == "ddp":
        assert ranks[0][(engine, model_name, True)]["params"] == ranks[1][(engine, model_name, True)]["params"]
