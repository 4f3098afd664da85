"""peft LoRA with offcore: the adapters' optimizer on the host, the frozen base streamed by ``offload_parameters``.

    python examples/integrations/with_peft.py

peft needs no integration: a LoRA model goes to ``OffloadOptimizer`` (its trainable parameters) and to
``offload_parameters`` (the whole model, frozen base included) as it is. A tiny Llama with LoRA adapters trains 4 steps
with and without offcore (a ``torch.save`` checkpoint after step 2, then a resume
from it) and every number is compared bit for bit. Lines marked ``# offcore`` are the user code.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import offcore_torch
import peft
import torch
import transformers

import offcore


def batches(n: int = 4, seq: int = 16, vocab: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (4, seq), generator=g) for _ in range(n)]


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    dev = offcore.device("cpu", capacity="512MiB", h2d_bandwidth="16GiB/s", d2h_bandwidth="16GiB/s", sanitize=True)
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
    model = transformers.LlamaForCausalLM(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model = dev.adopt(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    with dev:
        if use_offcore:
            streamed = offcore_torch.offload_parameters(model, dev)  # offcore
            opt = offcore_torch.OffloadOptimizer(trainable, torch.optim.AdamW, device=dev, lr=1e-2)  # offcore
        else:
            opt = torch.optim.AdamW(trainable, lr=1e-2)
        start = 0
        if resume:
            ckpt = torch.load(f"{out}/ckpt.pt", weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optim"])
            start = 2
        for step, ids in enumerate(batches()):
            if step < start:
                continue
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if use_offcore:
                norms.append(offcore_torch.clip_grad_norm_(opt, 0.5).item())  # offcore
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(trainable, 0.5).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1 and not resume:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{out}/ckpt.pt")
        params = {n: p.clone() for n, p in model.state_dict().items()}
        if use_offcore:
            opt.close()
            streamed.remove()
    return {"losses": losses, "grad_norms": norms, "params": params}


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
