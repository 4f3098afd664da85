"""Carry a DeepSpeed ZeRO-Offload configuration over to :class:`~offcore_torch.OffloadOptimizer`.

``from_deepspeed_config(model, "ds_config.json", device=dev)`` reads the keys below and
returns an :class:`OffloadSetup` that trains like a DeepSpeed engine (``setup.backward(loss)``,
``setup.step()``). Every key it does not support is named in one
:class:`~offcore.ConfigurationError`; nothing is silently ignored.

Supported keys:

- ``zero_optimization``: ``stage`` (0-3; one device, so only the optimizer offload matters),
  ``offload_optimizer``: ``device`` (``"cpu"``, or ``"nvme"`` with ``nvme_path``: the optimizer
  states on NVMe, ``OffloadOptimizer(tier="nvme")``), ``pin_memory``;
- ``optimizer``: ``type`` (``Adam``/``AdamW``/``SGD``/``Adagrad``; DeepSpeed's ``Adam`` is AdamW
  unless ``params.adam_w_mode`` is false) and ``params`` (the torch class's arguments, plus
  ``torch_adam`` / ``adam_w_mode``);
- ``gradient_accumulation_steps``, ``gradient_clipping``, ``train_batch_size`` and
  ``train_micro_batch_size_per_gpu`` (checked against each other on one device);
- ``bf16.enabled`` (bf16 parameters, fp32 masters) and ``fp16``: ``enabled``,
  ``initial_scale_power``, ``loss_scale_window``, ``loss_scale`` (0: dynamic only).

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> config = {
    ...     "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "bf16": {"enabled": True},
    ...     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    ...     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    ... }
    >>> with dev:
    ...     setup = offcore_torch.from_deepspeed_config(torch.nn.Linear(4, 4), config, device=dev)
    ...     for micro in range(2):
    ...         setup.backward(setup.model(torch.randn(2, 4, dtype=torch.bfloat16)).float().square().mean())
    ...         stepped = setup.step()
    >>> stepped, type(setup.optimizer).__name__
    (True, 'OffloadOptimizer')
    >>> setup.close()
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from offcore.errors import ConfigurationError
from offcore_torch.optimizer.clip import clip_grad_norm_
from offcore_torch.optimizer.optimizer import OffloadOptimizer
from offcore_torch.optimizer.scaler import OffloadGradScaler

__all__ = ["from_deepspeed_config", "OffloadSetup"]

_TOP = {
    "zero_optimization",
    "optimizer",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
}
_ZERO = {"stage", "offload_optimizer"}
_OFFLOAD = {"device", "pin_memory", "nvme_path"}
_FP16 = {"enabled", "initial_scale_power", "loss_scale_window", "loss_scale"}
_BF16 = {"enabled"}
_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.AdamW,  # DeepSpeed's Adam defaults to adam_w_mode=True
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
}


@dataclass
class OffloadSetup:
    """What :func:`from_deepspeed_config` builds: the model (cast to bf16/fp16 if enabled), the
    :class:`OffloadOptimizer`, the fp16 scaler, and DeepSpeed's accumulation and clipping.

    ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (as DeepSpeed does),
    scales it for fp16, and runs backward; ``step()`` steps at each accumulation boundary
    (clipping, unscaling, the optimizer step, ``zero_grad``) and returns whether it stepped.
    """

    model: torch.nn.Module
    optimizer: OffloadOptimizer
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    scaler: OffloadGradScaler | None = None
    dtype: torch.dtype = torch.float32
    micro_steps: int = field(default=0)

    def backward(self, loss: torch.Tensor) -> None:
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        self.micro_steps += 1

    def step(self) -> bool:
        """Step at an accumulation boundary; returns whether it did."""
        if self.micro_steps % self.gradient_accumulation_steps:
            return False
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.gradient_clipping > 0:
            clip_grad_norm_(self.optimizer, self.gradient_clipping)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        return True

    def close(self) -> None:
        self.optimizer.close()


def _load(config: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    try:
        with open(config) as f:
            loaded = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"cannot read the DeepSpeed config {str(config)!r}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigurationError(f"the DeepSpeed config {str(config)!r} is not a JSON object")
    return loaded


def _section(config: dict[str, Any], key: str, where: str, problems: list[str]) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        problems.append(f"{where}{key} (expected an object, got {value!r})")
        return {}
    return value


def from_deepspeed_config(
    model: torch.nn.Module, config: str | os.PathLike[str] | dict[str, Any], *, device: Any, **options: Any
) -> OffloadSetup:
    """An :class:`OffloadSetup` for ``model`` from a DeepSpeed config (a path to JSON or a dict).

    ``options`` go to :class:`OffloadOptimizer` (e.g. ``host_budget``). Raises one
    :class:`~offcore.ConfigurationError` naming every unsupported key or value.
    """
    cfg = _load(config)
    problems: list[str] = [f"{k} (not supported)" for k in sorted(set(cfg) - _TOP)]
    zero = _section(cfg, "zero_optimization", "", problems)
    problems += [f"zero_optimization.{k} (not supported)" for k in sorted(set(zero) - _ZERO)]
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage={stage!r} (expected 0-3)")
    offload = _section(zero, "offload_optimizer", "zero_optimization.", problems)
    problems += [f"zero_optimization.offload_optimizer.{k} (not supported)" for k in sorted(set(offload) - _OFFLOAD)]
    offload_device = str(offload.get("device", "cpu")).lower()
    nvme_path = offload.get("nvme_path")
    if offload_device not in ("cpu", "nvme"):
        problems.append(f"zero_optimization.offload_optimizer.device={offload.get('device')!r} (only 'cpu' or 'nvme')")
    elif offload_device == "nvme" and not isinstance(nvme_path, str):
        problems.append(
            f"zero_optimization.offload_optimizer.device={offload.get('device')!r} needs nvme_path (a directory)"
        )
    elif offload_device == "cpu" and nvme_path is not None:
        problems.append("zero_optimization.offload_optimizer.nvme_path (only with device 'nvme')")
    pin_memory = offload.get("pin_memory", True)
    if not isinstance(pin_memory, bool):
        problems.append(f"zero_optimization.offload_optimizer.pin_memory={pin_memory!r} (expected true/false)")

    optimizer = _section(cfg, "optimizer", "", problems)
    problems += [f"optimizer.{k} (not supported)" for k in sorted(set(optimizer) - {"type", "params"})]
    kind = str(optimizer.get("type", "AdamW"))
    params = dict(_section(optimizer, "params", "optimizer.", problems))
    adam_w_mode = params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)
    cls = _OPTIMIZERS.get(kind.lower())
    if cls is None:
        problems.append(f"optimizer.type={kind!r} (supported: Adam, AdamW, SGD, Adagrad)")
    else:
        if kind.lower() == "adam" and adam_w_mode is False:
            cls = torch.optim.Adam
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        problems += [
            f"optimizer.params.{k} (not an argument of torch.optim.{cls.__name__})"
            for k in sorted(set(params) - accepted)
        ]

    gas = cfg.get("gradient_accumulation_steps", 1)
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        problems.append(f"gradient_accumulation_steps={gas!r} (expected a positive int)")
        gas = 1
    clipping = cfg.get("gradient_clipping", 0.0)
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping < 0:
        problems.append(f"gradient_clipping={clipping!r} (expected a non-negative number)")
        clipping = 0.0
    micro, total = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("train_batch_size")
    if micro is not None and total is not None and total != micro * gas:
        problems.append(
            f"train_batch_size={total!r} (one device: must equal train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps = {micro!r} x {gas})"
        )

    bf16 = _section(cfg, "bf16", "", problems)
    fp16 = _section(cfg, "fp16", "", problems)
    problems += [f"bf16.{k} (not supported)" for k in sorted(set(bf16) - _BF16)]
    problems += [f"fp16.{k} (not supported)" for k in sorted(set(fp16) - _FP16)]
    use_bf16, use_fp16 = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    if use_bf16 and use_fp16:
        problems.append("bf16.enabled and fp16.enabled (choose one)")
    if fp16.get("loss_scale", 0) not in (0, 0.0):
        problems.append(f"fp16.loss_scale={fp16['loss_scale']!r} (only 0: dynamic loss scaling)")

    if problems:
        raise ConfigurationError(
            "from_deepspeed_config: unsupported DeepSpeed settings (nothing is silently ignored): "
            + "; ".join(problems)
        )

    dtype = torch.bfloat16 if use_bf16 else torch.float16 if use_fp16 else torch.float32
    if dtype is not torch.float32:
        model = model.to(dtype)
    scaler = None
    if use_fp16:
        scaler = OffloadGradScaler(
            init_scale=2.0 ** fp16.get("initial_scale_power", 16), growth_interval=fp16.get("loss_scale_window", 1000)
        )
    overlap = clipping == 0 and scaler is None  # the host steps may start under the last micro-step's backward
    opt = OffloadOptimizer(
        model.parameters(),
        cls,  # type: ignore[arg-type]
        device=device,
        master_weights=dtype is not torch.float32,
        pin_memory=pin_memory,
        accumulation_steps=gas if overlap else None,
        **({"tier": "nvme", "nvme_path": nvme_path} if offload_device == "nvme" else {}),
        **{**params, **options},
    )
    return OffloadSetup(model, opt, gas, float(clipping), scaler, dtype)
