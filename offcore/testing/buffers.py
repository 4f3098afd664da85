"""Buffer kits: the handful of tensor operations the conformance suite needs.

A backend moves either torch tensors or numpy arrays (see
:class:`offcore.Capability`). The conformance tests never touch either library
directly; they go through a :class:`BufferKit`, so one suite checks both kinds of
backend and the numpy variant runs where torch is not installed.

Reading and writing go through the *framework* (``tensor.copy_``, numpy
assignment), never through the backend's ``copy_``, so a test that fills a buffer
and reads back a copy checks the backend against an independent path.

    >>> import numpy as np
    >>> kit = buffer_kit("numpy")
    >>> raw = np.zeros(24, np.uint8)
    >>> view = kit.typed(raw, "float32", (2, 3))
    >>> kit.write(view, kit.random_bytes(np.random.default_rng(0), "float32", 6))
    >>> kit.read(view).nbytes
    24
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from offcore.errors import ConfigurationError
from offcore.protocols import Capability

__all__ = ["BufferKit", "NumpyKit", "TorchKit", "buffer_kit", "buffer_kit_for"]

Shape = tuple[int, ...]


class BufferKit(abc.ABC):
    """Framework operations on buffers of one kind (``"torch"`` or ``"numpy"``)."""

    kind: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]]
    """Dtype names this kit can make, by their torch/numpy spelling."""

    @abc.abstractmethod
    def itemsize(self, dtype: str) -> int:
        """Bytes per element of ``dtype``."""

    @abc.abstractmethod
    def typed(self, raw: Any, dtype: str, shape: Shape) -> Any:
        """View the first bytes of a raw 1-D ``uint8`` buffer as a contiguous ``dtype`` array of ``shape``."""

    @abc.abstractmethod
    def write(self, buffer: Any, data: np.ndarray) -> None:
        """Write ``data`` (``uint8`` bytes, elements in row-major logical order) into ``buffer``."""

    @abc.abstractmethod
    def read(self, buffer: Any) -> np.ndarray:
        """The bytes of ``buffer``'s elements in row-major logical order (a fresh ``uint8`` array)."""

    @abc.abstractmethod
    def swap_last_axes(self, buffer: Any) -> Any:
        """A transposed (non-contiguous) view: the last two axes swapped."""

    @abc.abstractmethod
    def is_contiguous(self, buffer: Any) -> bool:
        """True when ``buffer`` is a row-major contiguous array."""

    @abc.abstractmethod
    def data_ptr(self, buffer: Any) -> int:
        """Address of ``buffer``'s first element."""

    @abc.abstractmethod
    def is_raw(self, buffer: Any) -> bool:
        """True when ``buffer`` is a 1-D ``uint8`` buffer of this kind."""

    @abc.abstractmethod
    def nbytes(self, buffer: Any) -> int:
        """Bytes covered by ``buffer``'s elements."""

    def nbytes_of(self, dtype: str, shape: Shape) -> int:
        """Bytes of a ``dtype`` array of ``shape``."""
        return self.itemsize(dtype) * math.prod(shape)

    def host_array(self, nbytes: int) -> Any:
        """A ``uint8`` buffer of ``nbytes`` made by the framework itself on the host (``numpy.empty``,
        ``torch.empty`` on the CPU), as host-side arithmetic makes its temporaries; not a backend allocation."""
        raise NotImplementedError(f"{type(self).__name__} does not make host arrays")

    def random_bytes(self, rng: np.random.Generator, dtype: str, count: int) -> np.ndarray:
        """Random bit patterns for ``count`` elements (NaN payloads, -0.0 and subnormals included).

        ``bool`` elements get 0 or 1, the only valid bool bytes.
        """
        data = rng.integers(0, 256, size=count * self.itemsize(dtype), dtype=np.uint8)
        if dtype == "bool":
            data &= 1
        return data


class NumpyKit(BufferKit):
    """Buffers are ``numpy.ndarray``."""

    kind = "numpy"
    dtypes = ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool", "complex64")

    def itemsize(self, dtype: str) -> int:
        return np.dtype(dtype).itemsize

    def typed(self, raw: Any, dtype: str, shape: Shape) -> Any:
        return raw[: self.nbytes_of(dtype, shape)].view(np.dtype(dtype)).reshape(shape)

    def write(self, buffer: Any, data: np.ndarray) -> None:
        buffer[...] = data.view(buffer.dtype).reshape(buffer.shape)

    def read(self, buffer: Any) -> np.ndarray:
        return np.array(buffer, copy=True, order="C").reshape(-1).view(np.uint8)

    def swap_last_axes(self, buffer: Any) -> Any:
        return np.swapaxes(buffer, -1, -2)

    def is_contiguous(self, buffer: Any) -> bool:
        return bool(buffer.flags["C_CONTIGUOUS"])

    def data_ptr(self, buffer: Any) -> int:
        return int(buffer.__array_interface__["data"][0])

    def is_raw(self, buffer: Any) -> bool:
        return isinstance(buffer, np.ndarray) and buffer.ndim == 1 and buffer.dtype == np.uint8

    def nbytes(self, buffer: Any) -> int:
        return int(buffer.nbytes)

    def host_array(self, nbytes: int) -> Any:
        return np.ones(nbytes, np.uint8)


class TorchKit(BufferKit):
    """Buffers are ``torch.Tensor`` (on any torch device); torch is imported on construction."""

    kind = "torch"
    dtypes = (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
    )

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def _dtype(self, dtype: str) -> Any:
        return getattr(self.torch, dtype)

    def itemsize(self, dtype: str) -> int:
        return int(self._dtype(dtype).itemsize)

    def typed(self, raw: Any, dtype: str, shape: Shape) -> Any:
        return raw[: self.nbytes_of(dtype, shape)].view(self._dtype(dtype)).view(shape)

    def write(self, buffer: Any, data: np.ndarray) -> None:
        source = self.torch.from_numpy(np.ascontiguousarray(data)).view(buffer.dtype).view(buffer.shape)
        buffer.copy_(source)

    def read(self, buffer: Any) -> np.ndarray:
        # clone into a fresh contiguous tensor: ``contiguous()`` keeps a stride of 2 on a
        # one-element view, which ``view(uint8)`` then refuses
        flat = buffer.detach().to("cpu").reshape(-1).clone(memory_format=self.torch.contiguous_format)
        return flat.view(self.torch.uint8).numpy().copy()

    def swap_last_axes(self, buffer: Any) -> Any:
        return buffer.transpose(-1, -2)

    def is_contiguous(self, buffer: Any) -> bool:
        return bool(buffer.is_contiguous())

    def data_ptr(self, buffer: Any) -> int:
        return int(buffer.data_ptr())

    def is_raw(self, buffer: Any) -> bool:
        return isinstance(buffer, self.torch.Tensor) and buffer.dim() == 1 and buffer.dtype == self.torch.uint8

    def nbytes(self, buffer: Any) -> int:
        return int(buffer.numel() * buffer.element_size())

    def host_array(self, nbytes: int) -> Any:
        return self.torch.ones(nbytes, dtype=self.torch.uint8, device="cpu")


_KITS: dict[str, type[BufferKit]] = {"numpy": NumpyKit, "torch": TorchKit}


def buffer_kit(kind: str) -> BufferKit:
    """The kit for ``kind`` (``"torch"`` or ``"numpy"``)."""
    try:
        return _KITS[kind]()
    except KeyError:
        raise ConfigurationError(f"unknown buffer kind {kind!r}; use one of {sorted(_KITS)}") from None


def buffer_kit_for(backend: Any, kind: str | None = None) -> BufferKit:
    """The kit for ``backend``: ``kind`` when given, else torch if the backend moves torch tensors, else numpy."""
    if kind is None:
        capabilities: Sequence[Capability] = getattr(backend, "capabilities", frozenset())
        kind = "torch" if Capability.TORCH in capabilities else "numpy"
    return buffer_kit(kind)
