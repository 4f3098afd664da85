"""torchtune's recipe shape with offcore: the activation-offloading context built once at set-up, entered every
step.

    python examples/integrations/with_torchtune.py

torchtune's recipes call ``training.get_act_offloading_ctx_manager(model, enable_activation_offloading)`` once
and enter what it returns around each forward; ``offcore_torch.integrations.torchtune`` has the same function
(and ``OffloadActivations`` with torchtune's signature), so a recipe swaps one import. This example runs that
shape on a tiny Llama (torchtune itself is not needed: the recipe's loop is written out) with and without
offcore, for 4 steps with a checkpoint after step 2 and a resume, and compares every number bit for bit. Lines
marked ``# offcore`` are the user code.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from typing import Any

import offcore_torch
import torch
import transformers
from offcore_torch.integrations.torchtune import get_act_offloading_ctx_manager  # offcore

import offcore


class Recipe:
    """torchtune's shape: ``setup`` builds the model, the optimizer and the activation context; ``train`` loops."""

    def __init__(self, use_offcore: bool, out: str) -> None:
        self.use_offcore, self.out = use_offcore, out
        self.dev = offcore.device(
            "cpu", capacity="512MiB", h2d_bandwidth="16GiB/s", d2h_bandwidth="16GiB/s", sanitize=True
        )

    def setup(self, resume: bool) -> None:
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
        self.model = self.dev.adopt(transformers.LlamaForCausalLM(cfg))
        if self.use_offcore:
            self.opt = offcore_torch.OffloadOptimizer(self.model.parameters(), torch.optim.AdamW, device=self.dev, lr=1e-2)  # fmt: skip # offcore
            self.ctx = get_act_offloading_ctx_manager(self.model, True, device=self.dev)  # offcore
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
            self.ctx = contextlib.nullcontext()  # torchtune: get_act_offloading_ctx_manager(model, False)
        self.start = 0
        if resume:
            ckpt = torch.load(f"{self.out}/ckpt.pt", weights_only=True)
            self.model.load_state_dict(ckpt["model"])
            self.opt.load_state_dict(ckpt["optim"])
            self.start = 2

    def train(self) -> dict[str, Any]:
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(4)]
        losses, norms = [], []
        for step, ids in enumerate(batches):
            if step < self.start:
                continue
            with self.ctx:  # the same context, entered every step
                logits = self.model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=0.5).item())  # as its recipes
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 1 and self.start == 0:
                torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f"{self.out}/ckpt.pt")
        return {
            "losses": losses,
            "grad_norms": norms,
            "params": {n: p.clone() for n, p in self.model.state_dict().items()},
        }


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    recipe = Recipe(use_offcore, out)
    with recipe.dev:
        recipe.setup(resume)
        return recipe.train()


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    results: dict[bool, Any] = {}
    for use in (False, True):
        with tempfile.TemporaryDirectory() as out:
            results[use] = (train(use, out), train(use, out, resume=True))
    return results


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
