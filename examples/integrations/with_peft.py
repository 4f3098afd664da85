"""peft LoRA with offcore: the adapters' optimizer on the host, the frozen base streamed by ``offload_parameters``.

    python examples/integrations/with_peft.py

peft needs no integration: a LoRA model goes to ``OffloadOptimizer`` (its trainable parameters) and to
``offload_parameters`` (the whole model, frozen base included) as it is. A tiny Llama with LoRA adapters trains 4 steps
with and without offcore (a ``torch.save`` checkpoint after step 2, then a resume
from it) and every number is compared bit for bit. Lines marked ``# offcore`` are the user code; the shared
set-up is in ``_scaffold.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import offcore_torch
import peft
import torch
from _scaffold import checkpointed_loop, fake_device, run_both, tiny_llama


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    dev = fake_device()
    model = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    model = dev.adopt(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with dev:
        if use_offcore:
            streamed = offcore_torch.offload_parameters(model, dev)  # offcore
            opt = offcore_torch.OffloadOptimizer(trainable, torch.optim.AdamW, device=dev, lr=1e-2)  # offcore
        else:
            opt = torch.optim.AdamW(trainable, lr=1e-2)

        def train_step(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if use_offcore:
                return loss, offcore_torch.clip_grad_norm_(opt, 0.5).item()  # offcore
            return loss, torch.nn.utils.clip_grad_norm_(trainable, 0.5).item()

        result = checkpointed_loop(model, opt, out, resume, train_step)
        if use_offcore:
            opt.close()
            streamed.remove()
    return result


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    return run_both(train)


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
