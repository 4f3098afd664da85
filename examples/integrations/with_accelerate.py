"""accelerate with offcore: ``prepare(model, OffloadOptimizer, loader)``; ``accelerator.clip_grad_norm_`` as usual.

    python examples/integrations/with_accelerate.py

A tiny Llama trains 4 steps with and without offcore (``save_state`` after step 2, then ``load_state`` into a
fresh run that trains steps 3-4) and every number is compared bit for bit. Lines marked ``# offcore`` are the
user code; the shared set-up is in ``_scaffold.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import accelerate
import offcore_torch
import torch
from _scaffold import dataset, fake_device, run_both, tiny_llama


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    dev = fake_device()
    model = dev.adopt(tiny_llama())
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
    losses, norms = [], []
    with dev:
        accelerator = accelerate.Accelerator(cpu=True)
        if use_offcore:
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)  # offcore
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        start = 0
        if resume:
            accelerator.load_state(out)
            start = 2
        for step, batch in enumerate(loader):
            if step < start:
                continue
            loss = model(**batch).loss
            accelerator.backward(loss)
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1 and not resume:
                accelerator.save_state(out)
        params = {n: p.clone() for n, p in accelerator.unwrap_model(model).state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "params": params}


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 state: {with offcore: (full run, resumed run)}."""
    return run_both(train)


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
