"""The sanitizer's operator check: torch operators on the host against the copies in flight (imports torch).

Note [Operators checked against copies in flight] in :mod:`offcore_cpu.sanitizer` says what
is checked and why. This module holds the dispatch mode and keeps one of it on the dispatch
stack of each thread that created or entered a sanitized fake device with ``check_ops``.

# Note [One checking mode per thread, at the bottom of its stack]
# Dispatch modes are per thread and must be popped in the order they were pushed (a mode's
# ``__exit__`` pops the top of the stack, whatever it is). The device pushes its mode:
# - when it is created, only on a thread with no dispatch mode active: the mode sits at the
#   bottom, so modes a test or torch enters later (``FakeTensorMode``, a ``TorchDispatchMode``
#   of the user's, the dispatch accounting's) nest above it and pop themselves in order;
#   ``close()`` (or the device's collection) on that thread pops it again when it is on top;
# - on ``with dev:`` (any thread), popped by the matching exit: nested as a with-statement.
# One mode per thread serves every device (the index of copies in flight is global), counted
# by references: it is pushed by the first holder and popped by the last, when it is on top
# (else it stays, inert while no copy is in flight, and the next release on top pops it).
# It returns ``ignore_compile_internals() == True``, so ``torch.compile`` still compiles with it
# on the stack (turned off while compiling; compiled kernels are not operators it sees).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from offcore_cpu.sanitizer import _OPS_INDEX, flights_on

__all__ = ["OpCheckMode", "acquire", "release", "check"]

_aten = torch.ops.aten
_FACTORY = re.compile(r"(new_.*|.*_like)$")  # read their tensor arguments' metadata only (as torch's CSAN)
# in-place operators that change a tensor's metadata or storage, never its bytes
_METADATA_ONLY = {
    _aten.set_,
    _aten.resize_,
    _aten.resize_as_,
    _aten.detach_,
    _aten.as_strided_,
}
_INPLACE_VIEW = getattr(torch.Tag, "inplace_view", None)

# per operator overload: None (nothing to check) or its tensor arguments as (position or None, name, written)
_PLANS: dict[Any, tuple[tuple[int | None, str, bool], ...] | None] = {}


def _plan(func: Any) -> tuple[tuple[int | None, str, bool], ...] | None:
    schema = func._schema
    base = schema.name.split("::")[-1]
    if (
        func.overloadpacket in _METADATA_ONLY
        or _FACTORY.match(base)
        or (_INPLACE_VIEW is not None and _INPLACE_VIEW in func.tags)
    ):
        return None
    entries: list[tuple[int | None, str, bool]] = []
    for position, argument in enumerate(schema.arguments):
        if "Tensor" not in str(argument.type):
            continue
        alias = argument.alias_info
        if alias is not None and not alias.is_write:
            continue  # a view: the result aliases it, no byte is read
        entries.append((None if argument.kwarg_only else position, argument.name, bool(alias and alias.is_write)))
    return tuple(entries) or None


def _describe(tensor: torch.Tensor, first: int, end: int) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = ", ".join(map(str, tensor.shape))
    try:
        base = int(tensor.untyped_storage().data_ptr())
    except Exception:
        base = first
    return f"{dtype}[{shape}], bytes {first - base}..{end - base} of its storage"


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    first = int(tensor.data_ptr())
    if tensor.numel() == 0:
        return first, first
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return first, first + span * tensor.element_size()


def _check_tensor(func: Any, name: str, tensor: torch.Tensor, write: bool) -> None:
    try:
        key = int(tensor.untyped_storage()._cdata)
    except Exception:  # sparse, wrapper subclasses, fake tensors without storage: no bytes of ours
        return
    if key not in _OPS_INDEX:
        return
    hits = flights_on(key)
    if not hits:
        return
    first, end = _byte_range(tensor)
    if first == end:
        return
    for flight, side in hits:
        if side == "src" and not write:
            continue  # both read
        lo, hi = flight.ranges[side]
        if first < hi and lo < end and flight.sanitizer is not None:
            flight.sanitizer.report_access(
                flight,
                side,
                str(func),
                f"argument {name!r}",
                _describe(tensor, first, end),
                write,
                f"the compute stream (thread {threading.current_thread().name!r})",
            )


def check(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Report the accesses of ``func(*args, **kwargs)`` that race with copies in flight (before it runs)."""
    try:
        plan = _PLANS[func]
    except KeyError:
        plan = _PLANS[func] = _plan(func)
    if plan is None:
        return
    for position, name, write in plan:
        value = args[position] if position is not None and position < len(args) else kwargs.get(name)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            _check_tensor(func, name, value, write)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    _check_tensor(func, name, item, write)


class OpCheckMode(TorchDispatchMode):
    """Checks every operator against the copies in flight (Note [Operators checked against copies in flight])."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _OPS_INDEX:  # nothing in flight: only this call is paid
            check(func, args, kwargs or {})
        return func(*args, **kwargs) if kwargs else func(*args)


_LOCAL = threading.local()  # .mode (pushed on this thread, or None), .refs


def acquire(*, at_creation: bool) -> bool:
    """Hold the calling thread's checking mode (Note [One checking mode per thread, ...]); False: not held.

    ``at_creation``: only where no dispatch mode is active (or this thread's mode is already held).
    """
    refs = getattr(_LOCAL, "refs", 0)
    mode = getattr(_LOCAL, "mode", None)
    if mode is None:
        if at_creation and torch._C._len_torch_dispatch_stack():
            return False
        mode = OpCheckMode()
        mode.__enter__()
        _LOCAL.mode = mode
    _LOCAL.refs = refs + 1
    return True


def release() -> None:
    """Drop one hold of the calling thread's mode; the last one pops it when it is on top of the stack."""
    refs = getattr(_LOCAL, "refs", 0)
    if refs <= 0:
        return
    _LOCAL.refs = refs = refs - 1
    mode = getattr(_LOCAL, "mode", None)
    if refs == 0 and mode is not None and _get_current_dispatch_mode() is mode:
        mode.__exit__(None, None, None)
        _LOCAL.mode = None


def held() -> bool:
    """True when the calling thread's operators are checked."""
    return getattr(_LOCAL, "mode", None) is not None
