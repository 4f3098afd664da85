"""A plain PyTorch loop with offcore: optimizer states and gradients on the host, activations offloaded.

    python examples/integrations/plain_loop.py

A tiny Llama trains 4 steps with and without offcore (a ``torch.save`` checkpoint after step 2, then a resume
from it) and every number is compared bit for bit. Lines marked ``# offcore`` are the user code; the set-up
every example shares (fake device, model, data, checkpointed loop) is in ``_scaffold.py``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import offcore_torch
import torch
from _scaffold import checkpointed_loop, fake_device, run_both, tiny_llama


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    dev = fake_device()
    model = dev.adopt(tiny_llama())
    with dev:
        if use_offcore:
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)  # offcore
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train_step(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
            region = offcore_torch.offload_activations(dev) if use_offcore else contextlib.nullcontext()  # offcore
            with region:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if use_offcore:
                return loss, offcore_torch.clip_grad_norm_(opt, 0.5).item()  # offcore
            return loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()

        return checkpointed_loop(model, opt, out, resume, train_step)


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    return run_both(train)


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
