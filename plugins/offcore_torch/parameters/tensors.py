"""The offloaded tensors' classes (``OffloadedParameter``, ``OffloadedBuffer``) and their ``__torch_function__``.

Moved from parameters.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from offcore.errors import ConfigurationError

# functions that read no tensor data: a parameter whose storage is empty may pass through them
_METADATA = frozenset(
    {
        "untyped_storage",
        "_typed_storage",
        "data_ptr",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "get_device",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__hash__",
        "__len__",
        "_is_view",
        "__reduce_ex__",
        "__deepcopy__",
        "__setstate__",
        "_version",
    }
)


# ------------------------------------------------------------------------- tensors
def _tensors(tree: Any, keep: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts for which ``keep`` is true."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if keep(item):
                out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return out


def _offcore_tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return _tensors((args, kwargs), lambda t: getattr(t, "_offcore_slot", None) is not None)


def _torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Fetch offloaded parameters that an operator reads outside their module's announced use."""
    if torch.compiler.is_compiling():  # Note [Compiled blocks are units]: fetched at the block's eager call
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    name = getattr(func, "__name__", "")
    if not kwargs and name not in _NOT_PLAIN:
        # Note [An operator inside a module's use]: every offloaded argument is on the device and
        # landed (pinned by its module's call or fetched outside already): nothing to fetch or wait for
        for arg in args:
            if type(arg) in _OFFLOADED:
                slot = arg._offcore_slot
                if not (slot.pins or slot.outside) or slot.event is not None or slot.handle._tier is not None:
                    break
            elif isinstance(arg, (list, tuple, dict)):
                break
        else:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args)
    kwargs = kwargs or {}
    needs = True
    if name in ("__get__", "__set__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__set__" and attr == "data":
            raise ConfigurationError(
                "offload_parameters: replacing .data of an offloaded parameter or buffer would detach it from its "
                "host copy; call handle.remove() first (or copy_() into the parameter instead)"
            )
        needs = name == "__get__" and attr == "data"
    elif name in _METADATA:
        needs = False
    if needs:
        tensors = _offcore_tensors(args, kwargs)
        if tensors:
            handle = tensors[0]._offcore_slot.handle
            handle._use_outside([t._offcore_slot for t in tensors], escaped=name == "__get__")
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class OffloadedParameter(torch.nn.Parameter):
    """The class an offloaded ``nn.Parameter`` carries (the same object; see Note [Parameter storage is swapped])."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


class OffloadedBuffer(torch.Tensor):
    """The class an offloaded buffer carries while ``offload_parameters(..., buffers=True)`` is active."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


_OFFLOADED = frozenset({OffloadedParameter, OffloadedBuffer})
_NOT_PLAIN = _METADATA | {"__get__", "__set__"}  # what _torch_function's general path treats specially

# Note [An operator inside a module's use]
# Every operator on an offloaded parameter passes through ``_torch_function`` (a Python call; ~130
# per step of a small GPT, most of them inside the parameter's own module call). The general path
# collects the offloaded tensors of the arguments and asks the handle to fetch or wait for them;
# inside a module's use the storages are pinned and their copies already waited for, so that
# path does nothing. The fast path sees that from the flat positional arguments alone (each
# offloaded one pinned or fetched outside, with no copy in flight, not on the NVMe tier) and calls
# the operator at once; anything else (keyword arguments, nested lists, metadata functions,
# ``.data``) takes the general path.
