"""Storage identity, whole-storage byte views and storage-exact restore.

offcore moves *storages*, not tensors: a tensor and its views share one
``torch.UntypedStorage``, which is copied once and restored once, and every saved
tensor comes back as a view of the restored storage with its original shape, stride,
storage offset and dtype.

    >>> import torch
    >>> base = torch.arange(12.0)
    >>> view = base.view(3, 4).t()
    >>> meta = TensorMeta.of(view)
    >>> copy = base.untyped_storage().clone()          # stands in for a restored storage
    >>> back = meta.view_of(copy)
    >>> back.shape == view.shape and back.stride() == view.stride() and torch.equal(back, view)
    True

# Note [Restore through the version keeper]
# A saved tensor's version counter is its family's (the tensor, its views and
# ``detach()`` aliases), and without hooks backward reads that very tensor: an in-place
# change made in backward through one unpacked tensor is seen by every other member —
# another saved view of it (whose unpack then raises), the caller's own tensor if it is
# still alive. So a restore must hand out a member of the *original* family, not a new
# tensor over the restored bytes. The record's version keeper is such a member: the
# restore takes a ``detach()`` alias of it (same counter) and points the alias at the
# restored storage (``.data`` assignment: storage and metadata swapped, version counter
# kept, not bumped). The keeper itself never holds the restored storage (it stays on the
# empty one it points at once the copy landed), so nothing has to point it back when
# backward is done with the storage: the alias autograd holds is the only reference.

# Note [Lazy conj and neg bits]
# ``z.conj()`` and ``torch._neg_view`` return views whose *data* is the original's and
# whose conj / neg bit tells every kernel to conjugate or negate on read. offcore copies
# storage bytes, so the bits are metadata it must carry itself: ``TensorMeta`` records
# ``is_conj()`` / ``is_neg()`` and the restore sets them again with the same view ops.
# Without them the restored tensor is the un-conjugated value, and gradients are wrong.

# Note [Version keepers]
# Autograd's own in-place check is off under saved-tensor hooks, so offcore checks
# version counters itself. A version counter belongs to a tensor and its views (and
# ``detach()`` aliases), not to the storage, and holding any such tensor holds the
# storage — which is exactly what offloading must stop doing. A *keeper* is a
# ``detach()`` alias of the saved tensor: it shares the version counter. Once the
# device-to-host copy has landed, ``release_storage`` points the keeper at an empty
# storage through ``.data`` assignment, which swaps the storage but keeps the
# TensorImpl's version counter and does not bump it. The keeper then costs no device
# memory and still reports every later in-place modification of the saved tensor's
# family (``keeper._version``).

# Note [Metadata ops bypass dispatch modes]
# offcore's own tensor operations on the hot path — ``detach()`` aliases, zero-byte
# tensors, ``set_`` onto a storage, ``.data`` swaps, slices of a host-pool block —
# allocate no memory and compute nothing. They run under ``torch._C._DisableTorchDispatch``
# (``internal_ops()``), so a Python dispatch mode (the CPU fake device's memory
# tracker, a user's debugging mode) neither sees nor slows them: under a tracking mode
# one such op costs tens of microseconds, and pack/unpack run once per saved tensor.
# Memory offcore really allocates goes through ``Backend.allocate``, which accounts for
# it itself. Never run an op that allocates or computes under ``internal_ops()``.
# Entering the guard costs more than the op it guards (~0.7 µs), so the hot path enters it
# only while a dispatch mode is active (``dispatch_modes()``, one C call: the fake device's
# default allocator-hook accounting installs none), and ``.data`` assignment, which is no
# op (no dispatch mode ever sees it), runs without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "internal_ops",
    "dispatch_modes",
    "TensorMeta",
    "storage_key",
    "raw_bytes",
    "version_keeper",
    "release_storage",
    "is_offloadable_kind",
    "is_parameter_like",
    "MARK_ATTRIBUTE",
]

_DISABLE_DISPATCH = getattr(torch._C, "_DisableTorchDispatch", None)
_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


internal_ops: Callable[[], contextlib.AbstractContextManager[Any]] = (
    _DISABLE_DISPATCH if _DISABLE_DISPATCH is not None else contextlib.nullcontext
)
"""A context for offcore's metadata-only ops (Note [Metadata ops bypass dispatch modes]).

``torch._C._DisableTorchDispatch`` itself where torch has it (no Python call in between:
it runs several times per saved tensor), else a no-op context.
"""


_DISPATCH_STACK = getattr(torch._C, "_len_torch_dispatch_stack", None)
dispatch_modes: Callable[[], int] = _DISPATCH_STACK if _DISPATCH_STACK is not None else (lambda: 1)
"""How many dispatch modes are active on this thread (infra modes included); a hot path enters
:func:`internal_ops` only when this is non-zero (Note [Metadata ops bypass dispatch modes])."""


MARK_ATTRIBUTE = "_offcore_offload"
"""Attribute set on a storage's Python object by :func:`offcore_torch.mark` (True/False)."""


def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity for a live storage (the address of its ``StorageImpl``).

    Valid only while the storage lives: pair it with a weak reference to the storage
    object (torch keeps one Python object per live storage) to detect reuse.
    """
    return int(storage._cdata)


def raw_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A one-dimensional ``uint8`` tensor over every byte of ``storage`` (no copy)."""
    if not dispatch_modes():
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    with internal_ops():
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


# Note [Saved tensors share their metadata]
# Every offloaded saved tensor needs its metadata (shape, stride, offset, dtype, device, conj/neg bits)
# from forward until backward. A model saves a handful of distinct ones, thousands of times per step,
# so :meth:`TensorMeta.of` returns one shared, frozen instance per distinct metadata (a bounded table,
# emptied when full): no object per saved tensor for the cyclic garbage collector to promote and scan
# at every full collection (Note [An entry's records] in records.py), and no constructor call per
# save. Sharing is safe because the instances are frozen: nothing writes to one after it is made.
_SHARED_META_MAX = 4096


@dataclass(frozen=True, slots=True)  # frozen: one instance is shared by every save with that metadata
class TensorMeta:
    """Everything needed to rebuild a saved tensor as a view of a (restored) storage (read-only).

    ``conj`` / ``neg``: the tensor's lazy conjugate and negative bits (Note [Lazy conj and neg bits]).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    conj: bool = False
    neg: bool = False

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        """``tensor``'s metadata: the instance shared by every tensor with the same (Note [Saved tensors share
        their metadata])."""
        key = (
            tensor.shape,  # a torch.Size: a tuple subclass, equal to and hashed as the plain tuple stored
            tensor.stride(),  # a tuple
            tensor.storage_offset(),
            tensor.dtype,
            tensor.device,
            tensor.is_conj(),
            tensor.is_neg(),
        )
        meta = _SHARED_META.get(key)
        if meta is None:
            if len(_SHARED_META) >= _SHARED_META_MAX:
                _SHARED_META.clear()
            # stored with a plain tuple, not the torch.Size: the garbage collector stops tracking a tuple of
            # ints at its first pass, a torch.Size (a subclass) it walks at every full collection
            key = (tuple(key[0]), *key[1:])
            meta = _SHARED_META[key] = TensorMeta(*key)
        return meta

    def view_of(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A tensor over ``storage`` with exactly this shape, stride, storage offset, dtype and conj/neg bits.

        It has a version counter of its own; :meth:`restore` shares the saved tensor's.
        """
        with internal_ops():
            return self._with_bits(self._plain(storage))

    def restore(self, keeper: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
        """The saved tensor again, over ``storage``, in the family of ``keeper`` (its version keeper).

        Note [Restore through the version keeper]: the result is a ``detach()`` alias of
        ``keeper`` pointed at ``storage``, with this metadata and conj/neg bits; ``keeper``
        is left as it is.
        """
        if dispatch_modes():
            with internal_ops():
                out = keeper.detach()
                out.data = self._plain(storage)
                return self._with_bits(out)
        out = keeper.detach()
        if self.neg or self.conj:
            out.data = self._plain(storage)
            return self._with_bits(out)
        # _plain, inlined (once per unpack): ``keeper.new()`` is an empty tensor of its dtype on its
        # device (this metadata's), without torch.empty's argument parsing
        out.data = keeper.new().set_(storage, self.offset, self.shape, self.stride)
        return out

    def _plain(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, self.offset, self.shape, self.stride)

    def _with_bits(self, out: torch.Tensor) -> torch.Tensor:
        if self.neg:
            out = torch._neg_view(out)
        if self.conj:
            out = out.conj()
        return out

    def describe(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        return f"{dims} {str(self.dtype).removeprefix('torch.')}"


_SHARED_META: dict[tuple[Any, ...], TensorMeta] = {}


def version_keeper(tensor: torch.Tensor) -> torch.Tensor:
    """A ``detach()`` alias sharing ``tensor``'s version counter (Note [Version keepers])."""
    with internal_ops():
        return tensor.detach()


def release_storage(keeper: torch.Tensor) -> None:
    """Let ``keeper`` stop holding its storage while keeping its version counter (Note [Version keepers])."""
    key = (keeper.dtype, keeper.device)
    empty = _EMPTY.get(key)
    if empty is None:
        with internal_ops():
            empty = _EMPTY[key] = torch.empty(0, dtype=keeper.dtype, device=keeper.device)
    keeper.data = empty  # no op: no dispatch mode sees it (Note [Metadata ops bypass dispatch modes])


def is_offloadable_kind(tensor: torch.Tensor) -> bool:
    """Plain dense tensors only: no sparse/quantized/nested layouts, no tensor subclasses, no meta/fake tensors."""
    cls = type(tensor)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return False
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested or tensor.is_meta:
        return False
    return True


def is_parameter_like(tensor: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter) or a view of one (``weight.t()`` saved by Linear)."""
    # Note [is_leaf, not grad_fn]: ``is_leaf`` is ``grad_fn is None`` asked in C++; reading ``grad_fn``
    # makes the node's Python object, which then lives as long as the node (one more object for
    # the cyclic garbage collector per saved tensor, until backward)
    base: Any = tensor._base
    if base is not None:
        # judged by the base: a view made with grad mode off (in a custom Function's forward)
        # requires grad and has no grad_fn, yet views an activation
        return bool(base.requires_grad and base.is_leaf)
    return tensor.requires_grad and tensor.is_leaf
