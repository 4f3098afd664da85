"""``transformers.Trainer`` with offcore: the optimizer on the host, activation offload around ``compute_loss``.

    >>> from offcore_torch.integrations.transformers import OffloadTrainer     # doctest: +SKIP
    >>> trainer = OffloadTrainer(model=model, args=args, train_dataset=ds,     # doctest: +SKIP
    ...                          offcore_device=dev, offload_activations=True)
    >>> with dev:                                                              # doctest: +SKIP
    ...     trainer.train()

:class:`OffloadTrainer` builds the optimizer the ``Trainer`` would build (``args.optim``, its param groups
with and without weight decay, its arguments) as an :class:`~offcore_torch.OffloadOptimizer` over the same
class, so training is bit-identical to the same ``Trainer`` without offcore: losses, ``grad_norm`` in the
logs, parameters, checkpoints and resume (the ``Trainer``'s ``model.zero_grad()`` and its clipping over
``model.parameters()`` reach the host gradients). A stock ``Trainer`` given
``optimizers=(OffloadOptimizer(...), None)`` trains bit-identically too. With
``offload_activations`` every training forward runs inside :func:`offcore_torch.offload_activations`
(backward may run after it). :class:`OffloadTrainerMixin`
adds the same to another ``Trainer`` subclass (``class MyTrainer(OffloadTrainerMixin, SFTTrainer)``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import transformers

import offcore_torch
from offcore.errors import ConfigurationError

__all__ = ["OffloadTrainer", "OffloadTrainerMixin"]


class OffloadTrainerMixin:
    """offcore for a ``transformers.Trainer`` subclass: put it first among the bases.

    Keyword arguments (the others go to the ``Trainer``):

    - ``offcore_device``: the offcore device the model trains on (required).
    - ``offload_optimizer``: ``True`` (default) builds the ``Trainer``'s own optimizer as an
      :class:`~offcore_torch.OffloadOptimizer`; a dict also passes these arguments to it
      (``master_weights=True`` ...); ``False`` keeps the ``Trainer``'s optimizer.
    - ``offload_activations``: ``False`` (default), ``True``, or a dict of
      :func:`offcore_torch.offload_activations` arguments (``min_bytes="64KiB"`` ...).
    """

    def __init__(
        self,
        *args: Any,
        offcore_device: Any = None,
        offload_optimizer: bool | dict[str, Any] = True,
        offload_activations: bool | dict[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        if offcore_device is None:
            raise ConfigurationError(
                f"{type(self).__name__} needs offcore_device=: the offcore device the model trains on "
                "(e.g. offcore.device('cuda'))"
            )
        self.offcore_device = offcore_device
        self._offcore_optimizer = _options(offload_optimizer, "offload_optimizer")
        self._offcore_activations = _options(offload_activations, "offload_activations")
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model: Any = None) -> Any:
        """The ``Trainer``'s optimizer, as an :class:`~offcore_torch.OffloadOptimizer` over the same class."""
        this: Any = self
        if this.optimizer is not None or self._offcore_optimizer is None:
            return super().create_optimizer(model)  # type: ignore[misc]
        given = this.optimizer_cls_and_kwargs
        cls, kwargs = given if given is not None else this.get_optimizer_cls_and_kwargs(this.args, this.model)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigurationError(
                f"{type(self).__name__}: the optimizer {cls!r} (args.optim={this.args.optim!r}) is not a "
                "torch.optim.Optimizer class, which OffloadOptimizer needs; pick a torch optimizer "
                "(optim='adamw_torch', 'adamw_torch_fused', 'sgd', ...) or pass offload_optimizer=False"
            )
        device, extra = self.offcore_device, self._offcore_optimizer

        class Build(torch.optim.Optimizer):  # a class (the Trainer calls any other callable as a factory)
            def __new__(klass, groups: Any, **optimizer_kwargs: Any) -> Any:  # noqa: N804 - returns another class
                return offcore_torch.OffloadOptimizer(groups, cls, device=device, **extra, **optimizer_kwargs)

        this.optimizer_cls_and_kwargs = (Build, dict(kwargs))
        try:
            return super().create_optimizer(model)  # type: ignore[misc]
        finally:
            this.optimizer_cls_and_kwargs = given

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The ``Trainer``'s context (autocast), plus activation offload for training forwards."""
        stack = super().compute_loss_context_manager()  # type: ignore[misc]
        if self._offcore_activations is not None and torch.is_grad_enabled():
            stack.enter_context(offcore_torch.offload_activations(self.offcore_device, **self._offcore_activations))
        return stack


def _options(value: bool | dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        return dict(value)
    raise ConfigurationError(f"{name} must be True, False or a dict of arguments, got {value!r}")


class OffloadTrainer(OffloadTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with offcore (:class:`OffloadTrainerMixin`'s arguments)."""
