"""PyTorch Lightning with an :class:`~offcore_torch.OffloadOptimizer`: :class:`OffloadCallback`.

    >>> from offcore_torch.integrations.lightning import OffloadCallback                      # doctest: +SKIP
    >>> trainer = lightning.Trainer(callbacks=[OffloadCallback()], gradient_clip_val=0.5)     # doctest: +SKIP

``configure_optimizers`` returns an ``OffloadOptimizer`` as it would return a torch optimizer; Lightning steps
it, zeroes it and checkpoints it as any other. Lightning's ``gradient_clip_val`` clips the optimizer's
``param_groups`` — for an ``OffloadOptimizer`` the host masters, whose gradients are still being copied and
summed while backward's last gradients land. :class:`OffloadCallback` makes them final before Lightning reads
them (``on_before_optimizer_step``): the clipping is then torch's own over the same gradients, bit for bit.
Works with ``lightning.pytorch`` and ``pytorch_lightning``.
"""

from __future__ import annotations

from typing import Any

from offcore_torch.integrations import offload_optimizer_of

try:
    from lightning.pytorch import Callback
except ImportError:
    from pytorch_lightning import Callback

__all__ = ["OffloadCallback"]


class OffloadCallback(Callback):
    """Before each optimizer step (and before Lightning clips), the host gradients land: Lightning's
    ``gradient_clip_val`` / ``gradient_clip_algorithm`` then read final gradients."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        opt = offload_optimizer_of(optimizer)
        if opt is not None:
            opt.gradients_to_host()
