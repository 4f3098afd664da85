"""Optimizer states and gradients on the host: :class:`offcore_torch.OffloadOptimizer`.

- :mod:`.optimizer`: ``OffloadOptimizer`` (construction, ``step()``, the worker, lifecycle, the hooks; its Notes),
  with its methods in mixins: :mod:`.gradients` (``_Gradients``), :mod:`.rounds` (``_HostRounds``: host steps,
  rounds through the core scheduler), :mod:`.nvme_states` (``_NvmeStates``), :mod:`.state_dicts` (``_StateDicts``);
- :mod:`.slots`: the per-parameter records (``_Slot``), constants and helpers;
- :mod:`.scaler`: ``OffloadGradScaler``;
- :mod:`.clip`: :func:`~offcore_torch.clip_grad_norm_` over the host gradients;
- :mod:`.deepspeed_config`: :func:`~offcore_torch.from_deepspeed_config`.

The public names are imported from ``offcore_torch``; this package imports nothing itself.
"""
