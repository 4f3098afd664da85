"""What the fake device needs to know about a buffer family (numpy arrays, torch tensors).

One small interface, :class:`BufferOps`, with one implementation per family: numpy
here, torch in :mod:`offcore_cpu.torch_buffers` (imported only when a torch tensor is
seen or a device is created with ``buffers="torch"``), so the fake device runs with
numpy alone.

    >>> import numpy as np
    >>> ops = NUMPY_OPS
    >>> raw = ops.empty(8)
    >>> ops.copy(raw, np.arange(2, dtype=np.float32))   # typed source into a raw buffer
    >>> raw.view(np.float32).tolist()
    [0.0, 1.0]
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import numpy as np
from offcore_layout import NUMPY, describe, match_layout

__all__ = ["BufferOps", "NumpyBuffers", "NUMPY_OPS", "ops_for", "describe"]


class BufferOps(Protocol):
    """The operations the fake device performs on buffers of one family."""

    family: str

    def is_buffer(self, obj: Any) -> bool:
        """True when ``obj`` belongs to this family."""

    def owner(self, buffer: Any) -> Any:
        """The object that owns ``buffer``'s memory (a storage, a root array); weak-referenceable."""

    def owner_nbytes(self, owner: Any) -> int:
        """Bytes held by ``owner``."""

    def nbytes(self, buffer: Any) -> int:
        """Bytes addressed by ``buffer`` (a view: only its elements)."""

    def empty(self, nbytes: int) -> Any:
        """A new raw, one-dimensional uint8 buffer (contents undefined)."""

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` for buffers of equal byte size (layouts: :func:`offcore_layout.match_layout`)."""

    def copy_plain(self, dst: Any, src: Any) -> bool:
        """:meth:`copy` when it needs no operator the device would count (True: done), else False (not copied)."""

    def poison(self, buffer: Any) -> None:
        """Overwrite every byte of ``buffer`` with 0xFF (NaN for floating point, -1 for integers)."""

    def live(self, buffer: Any) -> bool:
        """Whether ``buffer``'s memory still holds all its bytes (a torch storage can be freed or shrunk under
        its tensors with ``resize_``; writing there would write into freed memory)."""

    def alias(self, buffer: Any) -> Any:
        """A new view of exactly ``buffer``'s elements that the fake device holds while a copy uses it.

        Holding the alias instead of the caller's object lets :meth:`sole_owner` tell when
        every other reference to the memory is gone (Note [Use after free] in sanitizer.py).
        """

    def sole_owner(self, alias: Any) -> bool:
        """True when ``alias`` (from :meth:`alias`) is the last reference to its memory: the program freed it."""

    def byte_range(self, buffer: Any) -> tuple[int, int]:
        """``(first, end)`` addresses of the bytes ``buffer`` spans (``first == end`` when empty)."""

    def address(self, buffer: Any) -> int:
        """The address of ``buffer``'s first element (what ``dev.copy_log()`` records per side)."""


class NumpyBuffers:
    """:class:`BufferOps` for ``numpy.ndarray``."""

    family = "numpy"

    def is_buffer(self, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    def owner(self, buffer: np.ndarray) -> np.ndarray:
        root = buffer
        while isinstance(root.base, np.ndarray):
            root = root.base
        return root

    def owner_nbytes(self, owner: np.ndarray) -> int:
        return int(owner.nbytes)

    def nbytes(self, buffer: np.ndarray) -> int:
        return int(buffer.nbytes)

    def empty(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst, src = match_layout(dst, src, NUMPY)
        np.copyto(dst, src, casting="no")

    def copy_plain(self, dst: np.ndarray, src: np.ndarray) -> bool:
        self.copy(dst, src)  # numpy runs no torch operator: nothing to count
        return True

    def live(self, buffer: np.ndarray) -> bool:
        return True  # an array's memory lives as long as the array

    def poison(self, buffer: np.ndarray) -> None:
        if not buffer.size:
            return
        if buffer.flags.c_contiguous:
            buffer.reshape(-1).view(np.uint8).fill(0xFF)  # a byte fill (memset)
            return
        buffer[...] = np.frombuffer(b"\xff" * buffer.dtype.itemsize, dtype=buffer.dtype)[0]

    def alias(self, buffer: np.ndarray) -> np.ndarray:
        return buffer.view()

    def sole_owner(self, alias: np.ndarray) -> bool:
        # only arrays that own their memory (np.empty, allocate): memory borrowed from another
        # object (frombuffer, a memoryview) may be held through that object instead
        return _numpy_holders(alias) <= _NUMPY_SOLE_HOLDERS

    def address(self, buffer: np.ndarray) -> int:
        return int(buffer.__array_interface__["data"][0])

    def byte_range(self, buffer: np.ndarray) -> tuple[int, int]:
        first = end = int(buffer.__array_interface__["data"][0])
        if buffer.size == 0:
            return first, end
        for size, stride in zip(buffer.shape, buffer.strides, strict=True):
            if stride < 0:
                first += (size - 1) * stride
            else:
                end += (size - 1) * stride
        return first, end + buffer.itemsize


def _numpy_holders(alias: np.ndarray) -> int:
    """References to the array owning ``alias``'s memory (a large number when no array owns it)."""
    owner = alias.base
    while isinstance(owner, np.ndarray) and isinstance(owner.base, np.ndarray):
        owner = owner.base
    if not isinstance(owner, np.ndarray) or owner.base is not None:
        return sys.maxsize
    return sys.getrefcount(owner)


def _calibrate_numpy() -> int:
    """What :func:`_numpy_holders` counts when the alias is the only reference (this interpreter's baseline)."""
    owner = np.empty(1, dtype=np.uint8)
    alias = owner.view()
    del owner
    return _numpy_holders(alias)


_NUMPY_SOLE_HOLDERS = _calibrate_numpy()
NUMPY_OPS = NumpyBuffers()


def ops_for(buffer: Any) -> BufferOps | None:
    """The family of ``buffer``, or None for anything that is not a numpy array or torch tensor.

    torch is never imported here: a tensor can only exist once torch has been imported.
    """
    global _torch_tensor, _torch_ops
    tensor = _torch_tensor
    if tensor is not None and isinstance(buffer, tensor):  # the torch binding's case first (a few per copy)
        return _torch_ops
    if isinstance(buffer, np.ndarray):
        return NUMPY_OPS
    if _torch_tensor is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        from offcore_cpu.torch_buffers import TORCH_OPS

        _torch_tensor, _torch_ops = torch.Tensor, TORCH_OPS
    if isinstance(buffer, _torch_tensor):
        return _torch_ops
    return None


_torch_tensor: Any = None  # torch.Tensor once torch has been imported (looked up once)
_torch_ops: Any = None
