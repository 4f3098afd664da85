"""Which submodules of a model are its *layers*: the units the profiler measures and a plan acts on.

A plan (:class:`offcore.sim.Plan`) has one action per layer, in forward order. For a
transformer the layers are its blocks; for an ``nn.Sequential`` its children. The
profiler and the executor must agree on that list, so both call :func:`find_layers`
(or take the same explicit list).

    >>> import torch
    >>> from offcore_torch.layers import find_layers
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> [name for name, _ in find_layers(model)]
    ['0', '1', '2']
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from offcore.errors import ConfigurationError

__all__ = ["find_layers", "resolve_layers", "LAYER_CONTAINER_NAMES"]

LAYER_CONTAINER_NAMES: tuple[str, ...] = ("blocks", "layers", "h", "layer", "encoder_layers", "decoder_layers")
"""Attribute names under which models usually keep their stack of blocks (TinyGPT: ``blocks``)."""


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers as ``(qualified name, module)`` pairs, in forward order.

    The first attribute named in :data:`LAYER_CONTAINER_NAMES` that holds an
    ``nn.ModuleList`` or ``nn.Sequential`` of two or more modules gives the layers
    (``blocks.0``, ``blocks.1``, ...); otherwise an ``nn.Sequential`` model's children;
    otherwise the model's top-level children. The order of children is taken as the
    order of forward, which is true of every model in :mod:`offcore_torch.models`.

    Raises:
        ConfigurationError: the model has no submodules to act on.
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"find_layers() needs an nn.Module, got {type(model).__name__}")
    for attribute in LAYER_CONTAINER_NAMES:
        container = getattr(model, attribute, None)
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and len(container) >= 2:
            return [(f"{attribute}.{name}", module) for name, module in container.named_children()]
    children = list(model.named_children())
    if not children:
        raise ConfigurationError(
            f"{type(model).__name__} has no submodules: a plan acts on layers (submodules); "
            "pass layers=[...] explicitly or wrap the model's parts in modules"
        )
    return children


def resolve_layers(
    model: nn.Module, layers: Sequence[nn.Module] | Sequence[tuple[str, nn.Module]] | None
) -> list[tuple[str, nn.Module]]:
    """``layers`` as named pairs: ``None`` → :func:`find_layers`; modules get their names inside ``model``.

    Raises:
        ConfigurationError: an entry is not a submodule of ``model``, or one appears twice.
    """
    if layers is None:
        return find_layers(model)
    names = {id(module): name for name, module in model.named_modules() if name}
    resolved: list[tuple[str, nn.Module]] = []
    for item in layers:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], nn.Module):
            resolved.append((str(item[0]), item[1]))
            continue
        if not isinstance(item, nn.Module):
            raise ConfigurationError(
                f"layers must be nn.Module objects (or (name, module) pairs), got {type(item).__name__}"
            )
        name = names.get(id(item))
        if name is None:
            raise ConfigurationError(f"layer {type(item).__name__} is not a submodule of {type(model).__name__}")
        resolved.append((name, item))
    if not resolved:
        raise ConfigurationError("layers is empty: give at least one submodule")
    seen: set[int] = set()
    for name, module in resolved:
        if id(module) in seen:
            raise ConfigurationError(f"layer {name!r} appears twice in layers")
        seen.add(id(module))
    return resolved
