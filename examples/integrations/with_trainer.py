"""transformers.Trainer with offcore: the Trainer's own optimizer on the host, activations offloaded.

    python examples/integrations/with_trainer.py

Trains a tiny GPT-2 for 4 steps with and without offcore (a checkpoint at step 2, then a resume from it)
and checks every number is the same bit for bit. The lines marked ``# offcore`` are all the user code; the
shared set-up is in ``_scaffold.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import transformers
from _scaffold import dataset, fake_device, run_both, tiny_gpt2
from offcore_torch.integrations.transformers import OffloadTrainer  # offcore


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    dev = fake_device()
    model = dev.adopt(tiny_gpt2())
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
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-2" if resume else None)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {
        "losses": [e["loss"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    return run_both(train)


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
