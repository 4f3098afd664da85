"""offcore_torch: the PyTorch binding of offcore — activation offload with deadline prefetch.

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="1GiB", h2d_bandwidth="16GiB/s", d2h_bandwidth="16GiB/s")
    >>> with dev:
    ...     model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 1))
    ...     with offcore_torch.offload_activations(dev, min_bytes="16KiB") as handle:
    ...         loss = model(torch.randn(256, 128)).square().mean()
    ...     loss.backward()                       # may run after the block
    >>> stats = handle.stats()
    >>> stats.offloaded_bytes > 0 and stats.reloaded_bytes + stats.reused_live_bytes > 0
    True

Public API: :func:`offload_activations` (returns an :class:`OffloadHandle`),
:class:`OffloadOptimizer` (optimizer states and gradients on the host, with
:func:`clip_grad_norm_`, :class:`OffloadGradScaler` and :func:`from_deepspeed_config`;
under ``torch.distributed``: :func:`attach_ddp` and :class:`FSDPOffloadOptimizer`),
:func:`no_offload`, :func:`mark`, :func:`synchronize`, :class:`OffloadStats`,
:class:`OffloadPolicy`, :func:`offload_parameters` (parameters streamed from the host
by next use; returns a :class:`ParameterOffloadHandle`), and offcore's :class:`~offcore.scheduler.Scheduler` (pass one
as ``schedule=`` to share what prefetch learns across regions). Names load lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offcore.scheduler import Scheduler
    from offcore_torch.activations.copies import synchronize
    from offcore_torch.activations.offload import OffloadHandle, mark, offload_activations
    from offcore_torch.activations.policy import OffloadPolicy, no_offload
    from offcore_torch.activations.stats import OffloadStats
    from offcore_torch.budget import device_budget
    from offcore_torch.distributed import FSDPOffloadOptimizer, attach_ddp
    from offcore_torch.nvme import nvme_tier, nvme_tier_for
    from offcore_torch.optimizer.clip import clip_grad_norm_
    from offcore_torch.optimizer.deepspeed_config import from_deepspeed_config
    from offcore_torch.optimizer.optimizer import OffloadOptimizer
    from offcore_torch.optimizer.scaler import OffloadGradScaler
    from offcore_torch.parameters.parameters import ParameterOffloadHandle, offload_parameters
    from offcore_torch.parameters.state import ParameterOffloadStats

__all__ = [
    "FSDPOffloadOptimizer",
    "OffloadGradScaler",
    "OffloadHandle",
    "OffloadOptimizer",
    "OffloadPolicy",
    "OffloadStats",
    "ParameterOffloadHandle",
    "ParameterOffloadStats",
    "Scheduler",
    "attach_ddp",
    "clip_grad_norm_",
    "device_budget",
    "from_deepspeed_config",
    "mark",
    "nvme_tier",
    "nvme_tier_for",
    "no_offload",
    "offload_activations",
    "offload_parameters",
    "synchronize",
]

_EXPORTS = {
    "OffloadHandle": "offcore_torch.activations.offload",
    "offload_activations": "offcore_torch.activations.offload",
    "no_offload": "offcore_torch.activations.offload",
    "mark": "offcore_torch.activations.offload",
    "OffloadPolicy": "offcore_torch.activations.policy",
    "OffloadStats": "offcore_torch.activations.stats",
    "synchronize": "offcore_torch.activations.copies",
    "Scheduler": "offcore.scheduler",
    "OffloadOptimizer": "offcore_torch.optimizer.optimizer",
    "OffloadGradScaler": "offcore_torch.optimizer.scaler",
    "clip_grad_norm_": "offcore_torch.optimizer.clip",
    "from_deepspeed_config": "offcore_torch.optimizer.deepspeed_config",
    "attach_ddp": "offcore_torch.distributed",
    "FSDPOffloadOptimizer": "offcore_torch.distributed",
    "offload_parameters": "offcore_torch.parameters.parameters",
    "device_budget": "offcore_torch.budget",
    "nvme_tier": "offcore_torch.nvme",
    "nvme_tier_for": "offcore_torch.nvme",
    "ParameterOffloadHandle": "offcore_torch.parameters.parameters",
    "ParameterOffloadStats": "offcore_torch.parameters.state",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'offcore_torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
