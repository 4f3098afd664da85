"""transformers.Trainer with offcore: the Trainer's own optimizer on the host, activations offloaded.

    python examples/integrations/trainer.py

Trains a tiny GPT-2 for 4 steps with and without offcore (a checkpoint at step 2, then a resume from it)
and checks every number is the same bit for bit. The lines marked ``# offcore`` are all the user code.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import torch
import transformers
from offcore_torch.integrations.transformers import OffloadTrainer  # offcore

import offcore


def dataset(n: int = 16, seq: int = 16, vocab: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g)), "labels": ids} for _ in range(n)]


def train(use_offcore: bool, out: str, resume: str | None = None) -> dict[str, Any]:
    dev = offcore.device("cpu", capacity="512MiB", h2d_bandwidth="16GiB/s", d2h_bandwidth="16GiB/s", sanitize=True)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = dev.adopt(transformers.GPT2LMHeadModel(cfg))
    args = transformers.TrainingArguments(
        out,
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        logging_steps=1,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if use_offcore:
        trainer = OffloadTrainer(model=model, args=args, train_dataset=dataset(), offcore_device=dev, offload_activations=True)  # fmt: skip # offcore
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
    with dev:
        trainer.train(resume_from_checkpoint=resume)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def run() -> dict[bool, Any]:
    """Both runs, a resume of each from its step-2 checkpoint; returns {name: (without, with)}."""
    results: dict[bool, Any] = {}
    for use in (False, True):
        with tempfile.TemporaryDirectory() as out:
            full = train(use, out)
            resumed = train(use, out, resume=f"{out}/checkpoint-2")
        results[use] = (full, resumed)
    return results


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
