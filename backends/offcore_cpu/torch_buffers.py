""":class:`~offcore_cpu.buffers.BufferOps` for torch tensors (this module imports torch).

>>> import torch
>>> raw = TORCH_OPS.empty(8)
>>> TORCH_OPS.copy(raw, torch.arange(2, dtype=torch.float32))
>>> raw.view(torch.float32).tolist()
[0.0, 1.0]
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from offcore_layout import TORCH, flat_tensor, match_layout, plain_tensor_problem

__all__ = ["TorchBuffers", "TORCH_OPS", "small_pair_checker"]

# what TorchBuffers.small_pair asks of each side, looked up once (Note [The small copy's fast path])
_TENSOR = torch.Tensor
_STRIDED = torch.strided
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_functional = torch._is_functional_tensor


class TorchBuffers:
    """Tensors on the fake device are ordinary CPU tensors; their owner is the ``UntypedStorage``."""

    family = "torch"

    def is_buffer(self, obj: object) -> bool:
        return isinstance(obj, torch.Tensor)

    def owner(self, buffer: torch.Tensor) -> torch.UntypedStorage:
        # torch keeps one Python object per storage alive while any tensor uses the storage,
        # so ``t.untyped_storage() is t[1:].untyped_storage()`` and a weakref to it dies
        # exactly when the memory is freed (see Note [Counting device memory with storages]).
        return buffer.untyped_storage()

    def owner_nbytes(self, owner: torch.UntypedStorage) -> int:
        return int(owner.nbytes())

    def nbytes(self, buffer: torch.Tensor) -> int:
        """The bytes of a copy's side; refuses what is not a plain tensor (every copy asks this first:
        Note [Raw pointers see checked tensors only])."""
        _check_plain(buffer, "a copy's buffer")
        return buffer.numel() * buffer.element_size()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    # Note [Raw pointers see checked tensors only]: ``nbytes`` checked both sides when the device took the
    # copy (copy_ and copy_many ask it for each side first), so the paths that move its bytes do not again.
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        _check_live(dst, "destination")
        _check_live(src, "source")
        if dst.requires_grad or src.requires_grad:
            with torch.no_grad():
                self._copy(dst, src)
        else:  # raw byte buffers: no autograd to switch off (no_grad costs more than the copy setup)
            self._copy(dst, src)

    def copy_plain(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """A small copy between plain contiguous buffers, as one ``memmove`` (Note [Small copies keep the GIL]):
        no torch operator runs, so the device need not suspend its accounting around it (True: copied)."""
        nbytes = dst.numel() * dst.element_size()
        if (
            nbytes <= _GIL_HELD_COPY_LIMIT
            and nbytes == src.numel() * src.element_size()
            and dst.is_contiguous()
            and src.is_contiguous()
            and not (src.is_conj() or src.is_neg())
        ):
            # _check_live of both sides, inlined for contiguous buffers (once per copy): each reaches
            # offset + nbytes bytes of its storage (copy_ checked both hold nbytes); a side whose
            # storage holds fewer is checked again by _check_live, which raises
            if nbytes and (
                dst.storage_offset() * dst.element_size() + nbytes > dst.untyped_storage().nbytes()
                or src.storage_offset() * src.element_size() + nbytes > src.untyped_storage().nbytes()
            ):
                _check_live(dst, "destination")
                _check_live(src, "source")
            _memmove_holding_gil(dst.data_ptr(), src.data_ptr(), nbytes)
            return True
        return False

    @staticmethod
    def small_pair(dst: Any, src: Any) -> tuple[int, Any, Any, int, int, int, int] | None:
        """``(nbytes, dst storage, src storage, dst address, src address, dst storage's address, src
        storage's address)`` of a fast-path copy, else None.

        Note [The small copy's fast path] (copying.py): both sides exactly ``torch.Tensor`` (no subclass),
        plain (what :func:`plain_tensor_problem` asks, for that type), contiguous, the same byte count
        of at most ``_GIL_HELD_COPY_LIMIT``, the source neither a lazy conj nor neg view, each inside
        its storage's bytes. None sends the copy down ``copy_``'s general path, which checks again and
        reports what is wrong (it refuses what this declines, or takes it the slow way).
        """
        if type(dst) is not _TENSOR or type(src) is not _TENSOR:
            return None
        if (
            dst.layout is not _STRIDED
            or src.layout is not _STRIDED
            or dst.is_nested
            or src.is_nested
            or dst.is_quantized
            or src.is_quantized
            or dst.is_meta
            or src.is_meta
            or _functorch_wrapped(dst)
            or _functorch_wrapped(src)
            or _functional(dst)
            or _functional(src)
        ):
            return None
        nbytes = dst.nbytes  # numel() * element_size()
        if (
            nbytes > _GIL_HELD_COPY_LIMIT
            or nbytes != src.nbytes
            or not dst.is_contiguous()
            or not src.is_contiguous()
            or src.is_conj()
            or src.is_neg()
        ):
            return None
        dst_storage, src_storage = dst.untyped_storage(), src.untyped_storage()
        dst_address, src_address = dst.data_ptr(), src.data_ptr()
        dst_base, src_base = dst_storage.data_ptr(), src_storage.data_ptr()
        # each inside its storage: a contiguous tensor's bytes start storage_offset * element_size (its address
        # less its storage's) into the storage
        if nbytes and (
            dst_address - dst_base + nbytes > dst_storage.nbytes()
            or src_address - src_base + nbytes > src_storage.nbytes()
        ):
            return None  # a freed or shrunk storage: the general path raises
        return nbytes, dst_storage, src_storage, dst_address, src_address, dst_base, src_base

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = dst.numel() * dst.element_size()
        if (
            nbytes <= _GIL_HELD_COPY_LIMIT
            and nbytes == src.numel() * src.element_size()
            and dst.is_contiguous()
            and src.is_contiguous()
            and not (src.is_conj() or src.is_neg())  # lazy conj/neg views need copy_ to resolve them
        ):
            # Note [Small copies keep the GIL]
            _memmove_holding_gil(dst.data_ptr(), src.data_ptr(), nbytes)
            return
        dst, src = match_layout(dst, src, TORCH)
        dst.copy_(src)

    def live(self, buffer: torch.Tensor) -> bool:
        need, have = _bytes_needed_and_held(buffer)
        return need <= have

    def poison(self, buffer: torch.Tensor) -> None:
        if not buffer.numel():
            return
        if buffer.is_contiguous() and not (buffer.is_conj() or buffer.is_neg()):
            # a byte fill: ten times faster than the typed copy below (4 MiB: ~0.2 ms instead of
            # ~2 ms), which matters because the poison of a copy's destination runs on its stream
            flat_tensor(buffer).view(torch.uint8).fill_(0xFF)
            return
        pattern = torch.full((buffer.element_size(),), 0xFF, dtype=torch.uint8).view(buffer.dtype)[0]
        buffer.copy_(pattern.expand_as(buffer))  # a same-dtype copy keeps the bits (NaN payload, -1)

    def alias(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.detach()  # a TensorImpl of its own over the same storage (no autograd history)

    def sole_owner(self, alias: torch.Tensor) -> bool:
        if _use_count is None:  # a torch without the counter: the sanitizer cannot tell
            return False
        uses, holders = _storage_holders(alias)
        return uses <= _SOLE_USES and holders <= _SOLE_HOLDERS

    def address(self, buffer: torch.Tensor) -> int:
        return int(buffer.data_ptr())

    def byte_range(self, buffer: torch.Tensor) -> tuple[int, int]:
        first = int(buffer.data_ptr())
        if buffer.numel() == 0:
            return first, first
        span = 1 + sum((size - 1) * stride for size, stride in zip(buffer.shape, buffer.stride(), strict=True))
        return first, first + span * buffer.element_size()


# Note [Who holds a storage]
# A storage's memory is freed when its StorageImpl's use count drops to zero. Every
# tensor over it holds one use, and so does its Python object (``untyped_storage()``),
# which torch keeps alive while any tensor uses the storage; a Python reference to
# that object (``entry.restored = storage``) is a holder too, counted by Python's
# reference count. The fake device holds a queued copy's device buffers through an alias
# (a tensor of its own), so "only the alias is left" is: the use count and the Python
# object's reference count are what they are for a fresh alias of a dropped tensor,
# measured once at import (:func:`_calibrate`) so the figures match this interpreter.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_holders(alias: torch.Tensor) -> tuple[int, int]:
    storage = alias.untyped_storage()
    return int(_use_count(storage._cdata)), sys.getrefcount(storage)


def _calibrate() -> tuple[int, int]:
    if _use_count is None:
        return 0, 0
    dropped = torch.empty(1, dtype=torch.uint8)
    dropped.untyped_storage()  # its Python object exists, as for every tensor the device counts
    alias = dropped.detach()
    del dropped
    return _storage_holders(alias)


_SOLE_USES, _SOLE_HOLDERS = _calibrate()


def _bytes_needed_and_held(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``tensor`` reaches, and the bytes the storage holds now."""
    numel = tensor.numel()
    if not numel:
        return 0, 0
    if tensor.is_contiguous():
        extent = tensor.storage_offset() + numel
    else:
        reach = sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        extent = tensor.storage_offset() + 1 + reach
    return extent * tensor.element_size(), tensor.untyped_storage().nbytes()


def _check_plain(tensor: torch.Tensor, side: str) -> None:
    """Refuse, before any ``data_ptr``, a tensor whose address and size are not its own bytes (a DTensor, a
    wrapper subclass, a nested or meta tensor): Note [Raw pointers see checked tensors only]."""
    problem = plain_tensor_problem(tensor)
    if problem is not None:
        from offcore.errors import ConfigurationError

        raise ConfigurationError(
            f"the fake device cannot copy {side}: {problem}. Copy plain dense tensors (a DTensor's to_local() "
            "shard; for FSDP2 models offcore_torch.distributed.FSDPOffloadOptimizer)"
        )


def _check_live(tensor: torch.Tensor, side: str) -> None:
    """Refuse a copy whose buffer's storage no longer holds its bytes (freed or shrunk after the copy was
    enqueued): a raw memmove there writes into freed memory (the process crashed), ``copy_`` reads a null
    pointer. Raises :class:`~offcore_cpu.errors.FreedStorageError`; on a stream it surfaces at the next
    synchronisation (Note [Failures on a worker stream])."""
    need, have = _bytes_needed_and_held(tensor)
    if need > have:
        from offcore_cpu.errors import FreedStorageError

        raise FreedStorageError(
            f"the copy's {side} ({tensor.dtype}{tuple(tensor.shape)}) needs {need} bytes of its storage, which "
            f"holds {have}: it was freed or resized after the copy was enqueued. Keep a copy's buffers alive "
            "until its event completed"
        )


# Note [Small copies keep the GIL]
# A fake-device copy runs on a worker thread. ``Tensor.copy_`` releases the GIL for the
# memcpy and must take it back afterwards; while the compute thread runs Python (every
# operator passes through the tracking dispatch mode) that hand-off costs the worker
# ~100 us and the compute thread a thread switch, for a memcpy of a few microseconds.
# Copies between contiguous buffers of at most _GIL_HELD_COPY_LIMIT bytes are therefore
# a plain ``memmove`` called *without* releasing the GIL (ctypes PYFUNCTYPE); the bytes
# moved are the same (every fake-device copy is a byte copy: sizes match, and layouts
# are reinterpreted as raw bytes), larger copies still release the GIL.
_GIL_HELD_COPY_LIMIT = 256 * 1024
memmove_holding_gil = _memmove_holding_gil = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)


TORCH_OPS = TorchBuffers()

# what a device's small_pair checker answers: (nbytes, dst address, src address, known), where known's bits 0
# and 1 say the destination, the source is device memory, bits 2 and 3 that it is host memory; a side with
# neither bit set is for the device to look up (SIDES_KNOWN: the values with both sides known)
SmallPair = tuple[int, int, int, int]
DEVICE_DST, DEVICE_SRC, HOST_DST, HOST_SRC = 1, 2, 4, 8


def small_pair_checker(
    on_device: Callable[[Any, int], bool], native: Any = None, ledger: Any = None
) -> Callable[[Any, Any], SmallPair | None]:
    """A device's check of a fast-path pair (Note [The small copy's fast path] in copying.py).

    ``native`` (the allocator hook's ``small_pair``, asked with ``ledger``, the device's) asks every
    question of :meth:`TorchBuffers.small_pair` of the two tensors in one call, and which side the
    hook counts as the device's memory or knows as one of its host buffers (Note [Host buffers the
    hook knows] in _alloc_hook.cpp); the checker is that call itself. Without it,
    :meth:`TorchBuffers.small_pair` and ``on_device(storage, storage address)`` per side.
    """
    if native is not None:
        return functools.partial(native, ledger, _GIL_HELD_COPY_LIMIT)
    python = TorchBuffers.small_pair

    def check(dst: Any, src: Any) -> SmallPair | None:
        pair = python(dst, src)
        if pair is None:
            return None
        nbytes, dst_storage, src_storage, dst_address, src_address, dst_base, src_base = pair
        known = (DEVICE_DST if on_device(dst_storage, dst_base) else HOST_DST) | (
            DEVICE_SRC if on_device(src_storage, src_base) else HOST_SRC
        )
        return nbytes, dst_address, src_address, known

    return check
