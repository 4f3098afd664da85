"""offcore inside the training stacks people already use: one module per stack.

Each module imports its stack when it is imported (``import offcore_torch`` never does):

- :mod:`offcore_torch.integrations.transformers`: :class:`OffloadTrainer` (``transformers.Trainer`` with
  its own optimizer built on the host and activation offload around ``compute_loss``);
- :mod:`offcore_torch.integrations.torchtune`: :class:`OffloadActivations` with torchtune's signature, built
  once and entered every step, and ``get_act_offloading_ctx_manager``.

accelerate, Lightning and peft need none: ``accelerator.prepare`` and ``configure_optimizers`` take an
``OffloadOptimizer`` as they take a torch optimizer (their clipping over ``model.parameters()`` or the
optimizer's groups reads the host gradients), and a LoRA model goes to ``OffloadOptimizer`` /
``offload_parameters`` as it is. :func:`offload_optimizer_of` finds an ``OffloadOptimizer`` inside their
wrappers. ``docs/integrations.md`` has one runnable example per stack.
"""

from __future__ import annotations

from typing import Any

__all__ = ["offload_optimizer_of"]


def offload_optimizer_of(optimizer: Any) -> Any:
    """The :class:`~offcore_torch.OffloadOptimizer` inside ``optimizer`` (itself, or under the wrappers the
    stacks put around it: accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), else None."""
    from offcore_torch.optimizer.optimizer import OffloadOptimizer

    for _ in range(8):
        if optimizer is None:
            return None
        # Lightning's wrapper subclasses the optimizer's class and shares its __dict__: the one it wraps is
        # under ``_optimizer``; accelerate's keeps it under ``optimizer``
        inner = optimizer.__dict__.get("_optimizer", getattr(optimizer, "optimizer", None))
        if isinstance(optimizer, OffloadOptimizer) and not isinstance(inner, OffloadOptimizer):
            return optimizer
        optimizer = inner
    return None
