"""Byte layouts shared by the backends: how a copy between different dtypes or shapes is read.

A copy moves bytes, never values. When ``dst`` and ``src`` differ in dtype or shape (a
raw ``uint8`` host buffer and a typed, maybe strided, tensor) the bytes of the
contiguous side are reinterpreted as the other side's dtype and shape; when neither
side is contiguous the copy is refused. That rule lives here, once, for every buffer
family a backend moves: the CPU fake device (numpy arrays and torch tensors, in
``offcore_cpu.buffers`` / ``offcore_cpu.torch_buffers``) and the torch-accelerator
base of the CUDA and NPU adapters (``offcore_accelerator``).

This package sits in the backends layer below every backend (layering:
``offcore_cpu, offcore_accelerator -> offcore_layout -> offcore``, checked by
``tests/core/test_layering.py``). It imports neither numpy nor torch: it only calls
methods of the buffers it is handed, so a backend without torch still imports it.

    >>> import numpy as np
    >>> raw = np.zeros(8, np.uint8)
    >>> d, s = match_layout(raw, np.arange(2, dtype=np.float32), NUMPY)
    >>> d.dtype, d.shape, np.shares_memory(d, raw)
    (dtype('float32'), (2,), True)
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from offcore.errors import ConfigurationError

__all__ = [
    "Family",
    "NUMPY",
    "TORCH",
    "describe",
    "match_layout",
    "flat_tensor",
    "typed_prefix",
    "plain_tensor_problem",
]


class Family(Protocol):
    """The two layout primitives of one buffer family."""

    def contiguous(self, buffer: Any) -> bool:
        """True when ``buffer``'s elements are one dense run of memory in logical order."""

    def nbytes(self, buffer: Any) -> int:
        """Bytes addressed by ``buffer``'s elements."""

    def reinterpret(self, buffer: Any, dtype: Any, shape: Any) -> Any:
        """The bytes of contiguous ``buffer`` viewed as ``dtype`` of ``shape`` (same memory, no copy)."""


class _Numpy:
    def contiguous(self, buffer: Any) -> bool:
        return bool(buffer.flags.c_contiguous)

    def nbytes(self, buffer: Any) -> int:
        return int(buffer.nbytes)

    def reinterpret(self, buffer: Any, dtype: Any, shape: Any) -> Any:
        return buffer.reshape(-1).view(dtype).reshape(shape)


class _Torch:
    def contiguous(self, buffer: Any) -> bool:
        return bool(buffer.is_contiguous())

    def nbytes(self, buffer: Any) -> int:
        return int(buffer.numel() * buffer.element_size())

    def reinterpret(self, buffer: Any, dtype: Any, shape: Any) -> Any:
        flat = flat_tensor(buffer)
        if flat.dtype != dtype:
            flat = flat.view(dtype)
        return flat.view(shape)


NUMPY: Family = _Numpy()
"""Layout primitives of ``numpy.ndarray``."""
TORCH: Family = _Torch()
"""Layout primitives of ``torch.Tensor`` (any device)."""


def describe(buffer: Any) -> str:
    """A short description for error messages (``torch float32[4, 8]``, ``numpy uint8[64]``)."""
    try:
        shape: Any = list(getattr(buffer, "shape", ()))
    except Exception:  # a nested tensor has no one shape
        shape = "[nested]"
    dtype = str(getattr(buffer, "dtype", type(buffer).__name__)).replace("torch.", "")
    return f"{type(buffer).__module__.split('.')[0]} {dtype}{shape}"


def match_layout(dst: Any, src: Any, family: Family) -> tuple[Any, Any]:
    """``(dst, src)`` with equal dtype and shape, the bytes of a contiguous side reinterpreted.

    Returns the arguments themselves when dtype and shape already agree (either may then
    be any strided view). Otherwise the contiguous side is viewed as the other side's
    dtype and shape -- ``dst`` first, so a raw destination takes the source's layout.

    Raises:
        ConfigurationError: the byte counts differ, or the layouts differ and neither
            side is contiguous.
    """
    if dst.dtype == src.dtype and dst.shape == src.shape:
        return dst, src
    dst_bytes, src_bytes = family.nbytes(dst), family.nbytes(src)
    if dst_bytes != src_bytes:
        raise ConfigurationError(
            f"copy_ needs equal byte counts: dst {describe(dst)} has {dst_bytes} bytes, "
            f"src {describe(src)} has {src_bytes}"
        )
    if family.contiguous(dst):
        return family.reinterpret(dst, src.dtype, src.shape), src
    if family.contiguous(src):
        return dst, family.reinterpret(src, dst.dtype, dst.shape)
    raise ConfigurationError(
        f"cannot copy {describe(src)} into {describe(dst)}: dtypes or shapes differ and neither side is "
        "contiguous, so neither can be reinterpreted. Make one side contiguous (a raw uint8 buffer) "
        "or give both the same shape and dtype."
    )


def flat_tensor(tensor: Any) -> Any:
    """A 1-D stride-1 view of a contiguous tensor.

    ``view(-1)`` and ``reshape(-1)`` keep the stride of a one-element tensor
    (``torch.zeros(2)[::2]`` is contiguous with stride 2), which ``view(dtype)`` then refuses.
    """
    return tensor.as_strided((tensor.numel(),), (1,))


def typed_prefix(raw: Any, dtype: Any, shape: Any) -> Any:
    """The first bytes of a contiguous raw ``uint8`` tensor viewed as ``dtype`` of ``shape``."""
    nbytes = dtype.itemsize * math.prod(shape)
    return TORCH.reinterpret(flat_tensor(raw)[:nbytes], dtype, shape)


# Note [Raw pointers see checked tensors only]
# A path that moves bytes by address (a ``memmove`` through ctypes, a pool slice made with
# ``data_ptr()``, an NVMe read or write of a tensor's memory) trusts two things: that the
# address is the tensor's own memory, and that the byte count is what that memory holds.
# Neither holds for every ``torch.Tensor``: a wrapper subclass (DTensor, a user
# ``__torch_dispatch__`` class, torchao's, FakeTensor) reports the *logical* size of data
# that lives elsewhere (a DTensor's ``numel()`` is the global size; ``data_ptr()`` is 0 or the
# local shard's), a nested tensor's bytes are not ``numel * element_size`` in one run, a meta
# tensor has no memory at all. So every copy entry (the fake device's ``copy_`` and
# ``copy_many``, through ``TorchBuffers.nbytes``, and its memmove paths again; the
# torch-accelerator base's ``copy_``) and the torch binding's entry points (OffloadOptimizer,
# offload_parameters) first ask :func:`plain_tensor_problem` and refuse with a
# ConfigurationError naming the tensor and why. The byte count is then checked against the
# tensor's own storage before the memmove (``_check_live`` in offcore_cpu.torch_buffers: a
# storage freed or shrunk after the copy was enqueued). The NVMe tier takes numpy arrays and
# buffer-protocol objects only (``_as_bytes`` in offcore.nvme.tier), which no tensor is.
# tests/torch/test_tensor_subclass_fuzz.py passes each kind into each entry point.


_TORCH: Any = None  # the torch module, once a tensor was seen (this module never imports torch itself)


def _torch() -> Any:
    """The torch module (only ever needed with a tensor in hand, so torch is imported already)."""
    global _TORCH
    if _TORCH is None:
        import sys

        _TORCH = sys.modules["torch"]
    return _TORCH


def plain_tensor_problem(tensor: Any) -> str | None:
    """Why ``tensor`` cannot be moved by address (None: it can; Note [Raw pointers see checked tensors only]).

    A plain tensor is a ``torch.Tensor`` (or ``nn.Parameter``, or a subclass that overrides
    ``__torch_function__`` only) that is strided, not nested, not quantized, not a functional or
    functorch wrapper, on a device with memory (not ``meta``).
    """
    torch = _TORCH or _torch()  # every copy asks (twice): the module is looked up once
    kind = type(tensor)
    if kind is not torch.Tensor and not isinstance(tensor, torch.Tensor):
        return f"it is a {kind.__name__}, not a torch.Tensor"
    if kind is not torch.Tensor and getattr(kind, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        return (
            f"it is a {kind.__module__}.{kind.__qualname__}, a tensor subclass with its own __torch_dispatch__ "
            "(its data lives elsewhere: a DTensor's local shard, a wrapper's inner tensors)"
        )
    if tensor.layout is not torch.strided:
        return f"its layout is {tensor.layout} (only dense strided tensors are moved)"
    if tensor.is_nested:
        return "it is a nested tensor"
    if tensor.is_quantized:
        return "it is a quantized tensor"
    if tensor.is_meta:
        return "it is a meta tensor (it has no memory)"
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor) or torch._is_functional_tensor(tensor):
        return "it is a functional or functorch-wrapped tensor (torch.compile / torch.func tracing)"
    return None
