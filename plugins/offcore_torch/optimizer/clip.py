"""Gradient clipping over the host gradients of an :class:`~offcore_torch.OffloadOptimizer`.

The gradients are already on the host (they left the device as backward made them), so
the global norm is computed there, by ``torch.nn.utils.clip_grad_norm_`` itself, over the
accumulated host gradients: the same norm and the same scaled gradients, bit for bit, as
clipping the same gradients without offload, and no round trip to the device.

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> with dev:
    ...     model = torch.nn.Linear(8, 8)
    ...     opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1)
    ...     model(torch.randn(4, 8)).square().sum().backward()
    ...     norm = offcore_torch.clip_grad_norm_(opt, max_norm=1.0)
    ...     opt.step()
    >>> bool(norm > 0)
    True
    >>> opt.close()

What it costs: clipping needs the norm over *every* gradient before *any* step, so with
clipping the host steps cannot start under backward (``accumulation_steps`` /
``last_micro_step`` raise); the D2H copies and the accumulation still overlap backward,
and the steps and H2D copies run after it (``benchmarks/optimizer_offload.py --clip``).
"""

from __future__ import annotations

from typing import Any

import torch

from offcore.errors import ConfigurationError
from offcore_torch.optimizer.optimizer import OffloadOptimizer

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    optimizer: OffloadOptimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the host gradients of ``optimizer`` to a global norm of ``max_norm`` (torch's semantics).

    Returns the total norm (a host tensor), as ``torch.nn.utils.clip_grad_norm_`` does. Call it
    between the last backward and ``optimizer.step()``. A stack's wrapper around the optimizer
    (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) is taken too.
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` gives the same norm and clips the same gradients (each parameter's ``.grad`` shows its host gradient).
    """
    if type(optimizer).__name__ == "FSDPOffloadOptimizer":
        raise ConfigurationError(
            "offcore_torch.clip_grad_norm_ clips one process's host gradients; an FSDPOffloadOptimizer's are "
            "shards of a global norm: use opt.clip_grad_norm_(max_norm) or offcore_torch.distributed.clip_grad_norm_"
        )
    from offcore_torch.integrations import offload_optimizer_of

    optimizer = offload_optimizer_of(optimizer) or optimizer  # accelerate's / Lightning's wrappers
    if not isinstance(optimizer, OffloadOptimizer):
        raise ConfigurationError(
            f"offcore_torch.clip_grad_norm_ takes an OffloadOptimizer, got {type(optimizer).__name__}; "
            "for other optimizers use torch.nn.utils.clip_grad_norm_"
        )
    if optimizer.stepped_any:
        raise ConfigurationError(
            "clip_grad_norm_ needs every gradient before any host step, but host steps of this round already ran "
            "under backward (accumulation_steps= / last_micro_step()); build the optimizer with "
            "accumulation_steps=None to clip"
        )

    optimizer.gradients_to_host()  # offload_gradients=False: the device gradients come over first

    def clip() -> Any:
        masters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(
            masters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
        )

    return optimizer.run_on_host(clip)
