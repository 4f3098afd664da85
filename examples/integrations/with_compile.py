"""torch.compile with offcore: a model compiled whole (``fullgraph=True``) with activation offload and
``OffloadOptimizer``.

    python examples/integrations/with_compile.py [aot_eager|inductor]

offcore's hooks stay out of the compiled graph (no graph break, no recompile after the first step): the
activation region's saved tensors are packed when the compiled graph runs, and the optimizer's waits for its
uploads happen at the compiled module's call. A tiny Llama trains 4 steps with and without offcore (a
checkpoint after step 2, then a resume) and every number is compared bit for bit. Lines marked ``# offcore``
are the user code.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from typing import Any

import offcore_torch
import torch
import transformers

import offcore


def batches(n: int = 4, seq: int = 16, vocab: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (4, seq), generator=g) for _ in range(n)]


def train(use_offcore: bool, out: str, resume: bool = False, backend: str = "aot_eager") -> dict[str, Any]:
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
    model = dev.adopt(transformers.LlamaForCausalLM(cfg))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    losses = []
    with dev:
        if use_offcore:
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)  # offcore
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        start = 0
        if resume:
            ckpt = torch.load(f"{out}/ckpt.pt", weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optim"])
            start = 2
        for step, ids in enumerate(batches()):
            if step < start:
                continue
            region = offcore_torch.offload_activations(dev) if use_offcore else contextlib.nullcontext()  # offcore
            with region:
                loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1 and not resume:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{out}/ckpt.pt")
        params = {n: p.clone() for n, p in model.state_dict().items()}
    return {"losses": losses, "params": params}


def run(backend: str = "aot_eager") -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    results: dict[bool, Any] = {}
    for use in (False, True):
        with tempfile.TemporaryDirectory() as out:
            results[use] = (train(use, out, backend=backend), train(use, out, resume=True, backend=backend))
    return results


if __name__ == "__main__":
    from _compare import report

    # inductor's CPU kernels for the embedding's backward sum in a thread-dependent order: without offcore two
    # runs on 2 threads differ already; on one thread the comparison is meaningful
    torch.set_num_threads(1)
    sys.exit(report(run(sys.argv[1] if len(sys.argv) > 1 else "aot_eager")))
