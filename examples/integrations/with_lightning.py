"""PyTorch Lightning with offcore: ``configure_optimizers`` returns an ``OffloadOptimizer``; clipping by
``gradient_clip_val``.

    python examples/integrations/with_lightning.py

A tiny GPT-2 trains 2 epochs of 2 steps with and without offcore (a checkpoint after epoch 1, then a resume
from it) and every number is compared bit for bit. Lines marked ``# offcore`` are the user code; the shared
set-up is in ``_scaffold.py``.
"""

from __future__ import annotations

import glob
import sys
from typing import Any

import offcore_torch
import pytorch_lightning as pl
import torch
from _scaffold import dataset, fake_device, run_both, tiny_gpt2


class LM(pl.LightningModule):
    def __init__(self, dev: Any, use_offcore: bool) -> None:
        super().__init__()
        # no dropout: Lightning does not restore the RNG states on resume (the Trainer does)
        self.model = dev.adopt(tiny_gpt2(dropout=False))
        self.dev, self.use_offcore, self.losses, self.norms = dev, use_offcore, [], []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = pl.utilities.grad_norm(self, norm_type=2)  # what Lightning's docs log, before clipping
        self.norms.append(norms["grad_2.0_norm_total"].item())

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        if self.use_offcore:
            return offcore_torch.OffloadOptimizer(self.parameters(), torch.optim.AdamW, device=self.dev, lr=1e-2)  # fmt: skip # offcore
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(use_offcore: bool, out: str, resume: bool = False) -> dict[str, Any]:
    dev = fake_device()
    module = LM(dev, use_offcore)
    save = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(
        max_epochs=2,
        gradient_clip_val=0.5,
        callbacks=[save],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(dataset(n=8), batch_size=4)
    with dev:
        trainer.fit(module, loader, ckpt_path=sorted(glob.glob(f"{out}/epoch=0*.ckpt"))[0] if resume else None)
        params = {n: p.clone() for n, p in module.model.state_dict().items()}
    return {"losses": module.losses, "grad_norms": module.norms, "params": params}


def run() -> dict[bool, Any]:
    """Both runs, and a resume of each from its epoch-1 checkpoint: {with offcore: (full run, resumed run)}."""
    return run_both(train)


if __name__ == "__main__":
    from _compare import report

    sys.exit(report(run()))
