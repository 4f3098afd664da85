"""OffloadGradScaler: fp16 loss scaling for OffloadOptimizer (moved from optimizer.py)."""

from __future__ import annotations

from typing import Any

import torch

from offcore.errors import (
    ConfigurationError,
)
from offcore_torch.optimizer.optimizer import OffloadOptimizer


class OffloadGradScaler:
    """fp16 loss scaling for :class:`OffloadOptimizer`: unscale on the host, skip the step on inf/NaN.

    The same arithmetic as ``torch.amp.GradScaler`` over the host gradients.

        >>> scaler = OffloadGradScaler()                     # doctest: +SKIP
        >>> scaler.scale(loss).backward()                    # doctest: +SKIP
        >>> scaler.step(opt); scaler.update()                # doctest: +SKIP
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._scaler = torch.amp.GradScaler(
            "cpu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    def scale(self, outputs: Any) -> Any:
        """``outputs`` multiplied by the scale (a device tensor times a Python float)."""
        if not self._scaler.is_enabled():
            return outputs
        if self._scaler._scale is None:
            self._scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        return outputs * self.get_scale()

    def get_scale(self) -> float:
        return float(self._scaler.get_scale())

    def _check(self, optimizer: OffloadOptimizer) -> None:
        if not isinstance(optimizer, OffloadOptimizer):
            raise ConfigurationError("OffloadGradScaler works with an OffloadOptimizer")
        if optimizer.stepped_any:
            raise ConfigurationError(
                "OffloadGradScaler: host steps already ran under backward (accumulation_steps / last_micro_step); "
                "unscaling needs every gradient before any step: build the optimizer with accumulation_steps=None"
            )

    def unscale_(self, optimizer: OffloadOptimizer) -> None:
        """Divide the host gradients by the scale (once per step), recording inf/NaN."""
        self._check(optimizer)
        optimizer.gradients_to_host()  # offload_gradients=False: the device gradients come over first
        optimizer.run_on_host(self._scaler.unscale_, optimizer.host_optimizer)

    def step(self, optimizer: OffloadOptimizer) -> Any:
        """Unscale (if not yet), then ``optimizer.step()`` unless a gradient held inf/NaN."""
        self._check(optimizer)
        host = optimizer.host_optimizer
        state = self._scaler._per_optimizer_states[id(host)]
        if self._scaler.is_enabled() and state["stage"].name == "READY":
            self.unscale_(optimizer)
        found = sum(v.item() for v in state["found_inf_per_device"].values()) if self._scaler.is_enabled() else 0
        if found:
            optimizer._drain()
            optimizer._end_round()
            result = None
        else:
            result = optimizer.step()
        if self._scaler.is_enabled():
            from torch.amp.grad_scaler import OptState

            state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | None = None) -> None:
        self._scaler.update(new_scale)

    def state_dict(self) -> dict[str, Any]:
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scaler.load_state_dict(state_dict)
