"""Shared by the examples: the fake device, the tiny models and data, the checkpointed loop and the two runs.

What is specific to a stack (its own calls, and the lines marked ``# offcore``) stays in its example; this is
the set-up every example repeats: a CPU fake device that plays the GPU in both runs, a tiny Llama or GPT-2
built from a config (nothing is downloaded), the same 4 batches, a loop that saves a checkpoint after step 2
and resumes from it, and the runs with and without offcore.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import transformers

import offcore

STEPS = 4  # every example trains 4 steps; the checkpoint is taken after step 2, the resume trains steps 3-4
RESUME_AT = 2


def fake_device() -> Any:
    """The CPU fake device (with its sanitizer) the examples train on, with and without offcore."""
    return offcore.device("cpu", capacity="512MiB", h2d_bandwidth="16GiB/s", d2h_bandwidth="16GiB/s", sanitize=True)


def tiny_llama() -> transformers.LlamaForCausalLM:
    """A 2-layer Llama, its weights drawn after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2(dropout: bool = True) -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2, its weights drawn after ``torch.manual_seed(0)``; ``dropout=False`` turns every dropout off."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    if not dropout:
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(cfg)


def batches(n: int = STEPS, seq: int = 16, vocab: int = 64) -> list[torch.Tensor]:
    """``n`` batches of 4 random token sequences."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (4, seq), generator=g) for _ in range(n)]


def dataset(n: int = 4 * STEPS, seq: int = 16, vocab: int = 64) -> list[dict[str, torch.Tensor]]:
    """``n`` samples ``{"input_ids", "labels"}`` for the stacks that batch themselves (batch size 4)."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g)), "labels": ids} for _ in range(n)]


def checkpointed_loop(
    model: torch.nn.Module,
    opt: Any,
    out: str,
    resume: bool,
    train_step: Callable[[torch.Tensor], tuple[torch.Tensor, float | None]],
) -> dict[str, Any]:
    """Train on :func:`batches`: ``train_step(ids)`` runs forward and backward and returns the loss and the
    gradient norm (``None`` where the example logs none), then ``opt`` steps and zeroes. A ``torch.save``
    checkpoint of the model and the optimizer is written to ``out`` after step 2; ``resume=True`` loads it and
    trains the steps after it. Returns the losses, the gradient norms (if any) and the final parameters."""
    start = 0
    if resume:
        ckpt = torch.load(f"{out}/ckpt.pt", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        start = RESUME_AT
    losses, norms = [], []
    for step, ids in enumerate(batches()):
        if step < start:
            continue
        loss, norm = train_step(ids)
        if norm is not None:
            norms.append(norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == RESUME_AT - 1 and not resume:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{out}/ckpt.pt")
    result: dict[str, Any] = {"losses": losses}
    if norms:
        result["grad_norms"] = norms
    result["params"] = {n: p.clone() for n, p in model.state_dict().items()}
    return result


def run_both(train: Callable[..., dict[str, Any]], **options: Any) -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}.

    ``train(use_offcore, out, resume=..., **options)`` trains once, its checkpoints in the folder ``out``."""
    results: dict[bool, Any] = {}
    for use in (False, True):
        with tempfile.TemporaryDirectory() as out:
            results[use] = (train(use, out, **options), train(use, out, resume=True, **options))
    return results
