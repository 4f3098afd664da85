"""accelerate with an :class:`~offcore_torch.OffloadOptimizer`: ``clip_grad_norm_`` over its host gradients.

    >>> from offcore_torch.integrations.accelerate import OffloadAccelerator        # doctest: +SKIP
    >>> accelerator = OffloadAccelerator()                                          # doctest: +SKIP
    >>> model, opt, loader = accelerator.prepare(model, OffloadOptimizer(...), loader)  # doctest: +SKIP

``accelerator.prepare`` takes an ``OffloadOptimizer`` as it is; ``Accelerator.clip_grad_norm_`` would read
the device parameters' ``.grad``, which the optimizer moved to the host. :class:`OffloadAccelerator`'s
``clip_grad_norm_(model.parameters(), max_norm)`` clips the host gradients instead, summing the norm in the
order of the parameters given, as torch does: the same norm and the same clipped gradients, bit for bit.
"""

from __future__ import annotations

from typing import Any

import accelerate

from offcore_torch.integrations import clip_in_order, offload_optimizer_of

__all__ = ["OffloadAccelerator"]


class OffloadAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``clip_grad_norm_`` clips the host gradients of a prepared
    :class:`~offcore_torch.OffloadOptimizer` (other parameters are clipped as accelerate clips them)."""

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        ids = {id(p) for p in params}
        for prepared in self._optimizers:
            opt = offload_optimizer_of(prepared)
            if opt is not None and any(id(p) in ids for p in _device_params(opt)):
                self.unscale_gradients()
                return clip_in_order(opt, params, max_norm, norm_type)
        return super().clip_grad_norm_(params, max_norm, norm_type)


def _device_params(opt: Any) -> list[Any]:
    return [slot.param for slot in opt._slots]
