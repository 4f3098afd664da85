"""offcore inside the training stacks people already use: one module per stack.

Each module imports its stack when it is imported (``import offcore_torch`` never does):

- :mod:`offcore_torch.integrations.transformers`: :class:`OffloadTrainer` (``transformers.Trainer`` with
  its optimizer on the host and, optionally, activation offload around ``compute_loss``);
- :mod:`offcore_torch.integrations.accelerate`: :class:`OffloadAccelerator` (``clip_grad_norm_`` over an
  ``OffloadOptimizer``'s host gradients);
- :mod:`offcore_torch.integrations.lightning`: :class:`OffloadCallback` (Lightning's ``gradient_clip_val``
  reads final host gradients);
- :mod:`offcore_torch.integrations.torchtune`: :class:`OffloadActivations` with torchtune's signature, built
  once and entered every step, and ``get_act_offloading_ctx_manager``.

peft needs none: a LoRA model's trainable parameters go to ``OffloadOptimizer`` / ``offload_parameters``
as they are. ``docs/integrations.md`` has one runnable example per stack.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clip_in_order", "offload_optimizer_of"]


def offload_optimizer_of(optimizer: Any) -> Any:
    """The :class:`~offcore_torch.OffloadOptimizer` inside ``optimizer`` (itself, or under the wrappers the
    stacks put around it: accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), else None."""
    from offcore_torch.optimizer import OffloadOptimizer

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


def clip_in_order(optimizer: Any, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
    """``torch.nn.utils.clip_grad_norm_(parameters, ...)`` for parameters whose gradients ``optimizer`` (an
    :class:`~offcore_torch.OffloadOptimizer`) holds on the host: the norm over their host gradients in the order
    of ``parameters``, as torch sums them (the order changes the last bits of the norm), and the same scaling.

    Every parameter with a host gradient must be among ``parameters`` (the norm is global): a subset raises.
    """
    from offcore.errors import ConfigurationError

    params = list(parameters)
    optimizer.gradients_to_host()  # the copies in flight land; the host gradients are final
    with_grad = {id(m) for m in optimizer.host_grads()}
    masters = []
    for p in params:
        try:
            master = optimizer.master(p)
        except Exception:  # not one of the optimizer's parameters
            master = p
        if master.grad is not None:
            masters.append(master)
    missing = with_grad - {id(m.grad) for m in masters}
    if missing:
        raise ConfigurationError(
            f"clip_grad_norm_: {len(missing)} host gradients of the OffloadOptimizer belong to parameters not passed; "
            "the norm is global over the optimizer's parameters: pass all of them (model.parameters())"
        )
    return optimizer.run_on_host(lambda: torch_clip(masters, max_norm, norm_type))


def torch_clip(tensors: Any, max_norm: float, norm_type: float) -> Any:
    import torch

    return torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type=norm_type)
