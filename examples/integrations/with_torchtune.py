"""torchtune's recipe shape with offcore: the activation-offloading context built once at set-up, entered every
step.

    python examples/integrations/with_torchtune.py

torchtune's recipes call ``training.get_act_offloading_ctx_manager(model, enable_activation_offloading)`` once
and enter what it returns around each forward; ``offcore_torch.integrations.torchtune`` has the same function
(and ``OffloadActivations`` with torchtune's signature), so a recipe swaps one import. This example runs that
shape on a tiny Llama (torchtune itself is not needed: the recipe's step is written out) with and without
offcore, for 4 steps with a checkpoint after step 2 and a resume, and compares every number bit for bit. Lines
marked ``# offcore`` are the user code; the shared set-up is in ``_scaffold.py``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import offcore_torch
import torch
from _scaffold import checkpointed_loop, fake_device, run_both, tiny_llama
from offcore_torch.integrations.torchtune import get_act_offloading_ctx_manager  # offcore


class Recipe:
    """torchtune's shape: ``setup`` builds the model, the optimizer and the activation context; ``train`` loops."""

    def __init__(self, use_offcore: bool, out: str) -> None:
        self.use_offcore, self.out = use_offcore, out
        self.dev = fake_device()

    def setup(self) -> None:
        self.model = self.dev.adopt(tiny_llama())
        if self.use_offcore:
            self.opt = offcore_torch.OffloadOptimizer(self.model.parameters(), torch.optim.AdamW, device=self.dev, lr=1e-2)  # fmt: skip # offcore
            self.ctx = get_act_offloading_ctx_manager(self.model, True, device=self.dev)  # offcore
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
            self.ctx = contextlib.nullcontext()  # torchtune: get_act_offloading_ctx_manager(model, False)

    def train_step(self, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        with self.ctx:  # the same context, entered every step
            logits = self.model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return loss, torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=0.5).item()  # as its recipes

    def train(self, resume: bool) -> dict[str, Any]:
        return checkpointed_loop(self.model, self.opt, self.out, resume, self.train_step)


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    recipe = Recipe(use_offcore, out)
    with recipe.dev:
        recipe.setup()
        return recipe.train(resume)


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    return run_both(train)


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
