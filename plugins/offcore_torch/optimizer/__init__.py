"""Optimizer states and gradients on the host: :class:`offcore_torch.OffloadOptimizer`.

- :mod:`.optimizer`: ``OffloadOptimizer`` and ``OffloadGradScaler``;
- :mod:`.clip`: :func:`~offcore_torch.clip_grad_norm_` over the host gradients;
- :mod:`.deepspeed_config`: :func:`~offcore_torch.from_deepspeed_config`.

The public names are imported from ``offcore_torch``; this package imports nothing itself.
"""
