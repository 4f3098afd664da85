"""torchtune's recipe shape with offcore: a context built once at set-up, entered every step.

    >>> from offcore_torch.integrations.torchtune import OffloadActivations           # doctest: +SKIP
    >>> ctx = OffloadActivations(device=dev)  # doctest: +SKIP
    >>> for batch in loader:                                                        # doctest: +SKIP
    ...     with ctx:
    ...         logits = model(batch)
    ...     loss_fn(logits, labels).backward()

A torchtune recipe builds ``training.get_act_offloading_ctx_manager(model, enabled)`` (an
``OffloadActivations``) once and enters it around each forward; offcore's :func:`offcore_torch.offload_activations`
returns one region per call. :class:`OffloadActivations` takes torchtune's arguments and opens a fresh region
each time it is entered (:attr:`handle` is the last one), so it replaces torchtune's class, or
``get_act_offloading_ctx_manager``, in a recipe. torchtune is not imported: this module needs only torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import offcore_torch
from offcore.errors import ConfigurationError

__all__ = ["OffloadActivations", "get_act_offloading_ctx_manager"]


class OffloadActivations:
    """torchtune's ``OffloadActivations(use_pin_memory, use_streams, max_fwd_stash_size, min_offload_size)``,
    backed by :func:`offcore_torch.offload_activations`; enter it once per forward, as often as you like.

    - ``use_pin_memory``: host copies in pinned memory (offcore's ``pinned=``).
    - ``use_streams``: copies on their own streams, reloads prefetched by deadline (``prefetch="deadline"``);
      ``False``: reloaded when backward reads them (``prefetch="on_demand"``).
    - ``max_fwd_stash_size``: accepted for torchtune's signature; offcore keeps what backward needs soon on
      the device by its own schedule.
    - ``min_offload_size``: tensors smaller than this many bytes stay on the device (``min_bytes=``).
    - ``device``: the offcore device (required); ``**policy``: any other ``offload_activations`` argument.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        max_fwd_stash_size: int = 5,
        min_offload_size: int = 1024,
        *,
        device: Any = None,
        **policy: Any,
    ) -> None:
        if device is None:
            raise ConfigurationError(
                "OffloadActivations needs device=: the offcore device the model runs on "
                "(OffloadActivations(device=offcore.device('cuda')))"
            )
        if max_fwd_stash_size < 0:
            raise ConfigurationError(f"max_fwd_stash_size must be >= 0, got {max_fwd_stash_size}")
        self.device = device
        self.policy: dict[str, Any] = {
            "pinned": bool(use_pin_memory),
            "prefetch": "deadline" if use_streams else "on_demand",
            "min_bytes": int(min_offload_size),
            **policy,
        }
        self.handle: Any = None
        self._active: list[Any] = []

    def __enter__(self) -> OffloadActivations:
        handle = offcore_torch.offload_activations(self.device, **self.policy)
        handle.__enter__()
        self._active.append(handle)
        self.handle = handle
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active.pop().__exit__(*exc)

    def stats(self) -> Any:
        """The last region's :class:`offcore_torch.OffloadStats`."""
        if self.handle is None:
            raise ConfigurationError("OffloadActivations.stats(): not entered yet")
        return self.handle.stats()


def get_act_offloading_ctx_manager(
    model: torch.nn.Module, enable_activation_offloading: bool, *, device: Any = None
) -> Any:
    """torchtune's ``training.get_act_offloading_ctx_manager``: :class:`OffloadActivations` when enabled, else a
    ``contextlib.nullcontext`` (``model`` is taken for the signature)."""
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    return OffloadActivations(device=device)
