"""Device memory accounting for torch: every tensor created while the fake device is active.

# Note [Counting device memory with storages]
# On CUDA, ``torch.cuda.memory_allocated`` counts the live bytes of every tensor on the
# device, whoever created it. The fake device gets the same figure with the technique
# of ``torch.distributed._tools.mem_tracker``: while the device is active (``with dev:``)
# a TorchDispatchMode sees every operator's outputs; an output storage that is neither
# already counted nor one of the operator's input storages (a view, an in-place result)
# is new device memory, counted in the MemoryArena with ``storage.nbytes()`` bytes.
# The arena holds a weakref to the ``UntypedStorage``: torch keeps one Python object
# per storage for as long as any tensor uses it (``t.untyped_storage() is
# t[1:].untyped_storage()``), so the weakref's callback fires exactly when the memory
# is freed, and views never count twice. Storages that existed before activation are
# host memory unless adopted (``dev.adopt``), as a CPU tensor is not on the GPU until
# ``.to('cuda')``. Host buffers (``allocate(.., PINNED/PAGEABLE)``) are made with the
# mode suspended and registered as host, so they never count as device memory.
# The mode is thread-local (dispatch modes are per thread): work on the fake device's
# worker threads (copies) is not observed, and creates no storages anyway. Only the
# innermost active fake device of a thread counts new storages.
# ``torch.tensor(data)`` (and ``as_tensor``/``asarray`` of Python data, ``torch.Tensor([..])``)
# builds its tensor with dispatch excluded and then calls ``aten.lift_fresh``, which returns
# its argument: the output storage is one of the inputs, which would read as "not new".
# Note [Fresh tensors from Python data] makes the tracker count it anyway.
# Not seen: tensors made without dispatch (``no_dispatch``) and ``UntypedStorage.resize_``
# called directly; not counted: tensors over memory torch did not allocate
# (``torch.from_numpy``, ``as_tensor`` / ``asarray`` of a numpy array, ``frombuffer``,
# DLPack). Adopt such tensors explicitly.

# Note [Fresh tensors from Python data]
# ``aten.lift_fresh(t)`` is called on a tensor the Python frontend has just made outside
# dispatch (so the mode never saw its allocation); it returns ``t`` itself. Its storage is
# new device memory when torch's allocator made it (a resizable storage: ``torch.tensor``,
# ``as_tensor``/``asarray`` of lists and scalars), not when the tensor wraps foreign memory
# (not resizable: ``from_numpy``, ``as_tensor(ndarray)``, ``frombuffer``, DLPack) -- a
# binding's host buffers wrapped with ``torch.from_numpy`` must stay host memory.
# ``aten.lift_fresh_copy`` (used instead under functionalization) returns a new storage,
# which the general rule already counts.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offcore.kinds import Tier
from offcore_cpu.arena import MemoryArena
from offcore_cpu.torch_buffers import TORCH_OPS

__all__ = ["StorageTracker"]

_aten = torch.ops.aten
# Operators whose outputs hold uninitialised memory; the sanitizer poisons them.
_UNINITIALISED = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided}

_LIFT_FRESH = _aten.lift_fresh.default  # Note [Fresh tensors from Python data]

_DISABLE_DISPATCH = getattr(torch._C, "_DisableTorchDispatch", contextlib.nullcontext)
_ACTIVE = threading.local()  # .stack: the StorageTrackers active on this thread, innermost last


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results (tensors, nested lists/tuples/dicts).

    A plain walk: ``torch.utils._pytree.tree_flatten`` costs ~100 us per operator here.
    """
    if isinstance(tree, torch.Tensor):
        return [tree]
    found: list[torch.Tensor] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            pending.extend(node)
        elif isinstance(node, dict):
            pending.extend(node.values())
    return found


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The CPU storage of ``tensor``; None for meta/fake tensors and tensor subclasses without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage if storage.device.type == "cpu" else None


class _DeviceMemoryMode(TorchDispatchMode):
    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._tracker.observe(func, args, kwargs, out)
        return out


class StorageTracker:
    """Feeds the storages of tensors created while active into ``arena`` as device memory.

    >>> import torch
    >>> from offcore_cpu.arena import MemoryArena
    >>> arena = MemoryArena("cpu:0", capacity=1 << 20)
    >>> tracker = StorageTracker(arena, poison_uninitialised=False)
    >>> tracker.activate()
    >>> x = torch.zeros(256)                 # 1 KiB of float32
    >>> tracker.deactivate()
    >>> arena.allocated()
    1024
    """

    def __init__(self, arena: MemoryArena, *, poison_uninitialised: bool) -> None:
        self.arena = arena
        self.poison_uninitialised = poison_uninitialised
        self._local = threading.local()  # .depth, .mode, .suspended

    # -- activation (re-entrant, per thread) -----------------------------------------------
    def activate(self) -> None:
        """Start counting on the calling thread (nestable: the mode is entered once per thread)."""
        if getattr(self._local, "depth", 0) == 0:
            self._local.mode = _DeviceMemoryMode(self)
            self._local.mode.__enter__()
        self._local.depth = getattr(self._local, "depth", 0) + 1
        _active_stack().append(self)

    def deactivate(self) -> None:
        """Undo the matching :meth:`activate` on the calling thread."""
        if getattr(self._local, "depth", 0) == 0:
            return
        stack = _active_stack()
        for i in range(len(stack) - 1, -1, -1):  # our innermost entry (normally the last one)
            if stack[i] is self:
                del stack[i]
                break
        self._local.depth -= 1
        if self._local.depth == 0:
            mode, self._local.mode = self._local.mode, None
            mode.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        """True when this tracker is the innermost active one on the calling thread."""
        stack = _active_stack()
        return bool(stack) and stack[-1] is self

    def suspended(self) -> _Suspension:
        """Operators run inside are not counted (the device's own host allocations, poisoning).

        They also bypass Python dispatch modes altogether (``torch._C._DisableTorchDispatch``):
        the device accounts for its own buffers explicitly, and going through the tracking
        mode costs tens of microseconds per operator. (A small class, not a generator
        context manager: the device enters it for every allocation and copy.)
        """
        return _Suspension(self._local)

    # -- observation ---------------------------------------------------------------------
    def observe(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Count the new storages among ``out`` (called by the dispatch mode after each operator)."""
        if getattr(self._local, "suspended", 0) or not self.active:
            return
        outputs = _tensors(out)
        unknown: dict[int, torch.UntypedStorage] = {}
        for tensor in outputs:
            storage = _storage(tensor)
            if storage is None or id(storage) in unknown:
                continue
            tier = self.arena.tier_of(storage)
            if tier is Tier.DEVICE:
                self.arena.resize(storage, storage.nbytes())  # resize_ and friends
            elif tier is None:
                unknown[id(storage)] = storage
        if not unknown:
            return
        if func is _LIFT_FRESH:  # its input is the fresh tensor: Note [Fresh tensors from Python data]
            for key, storage in list(unknown.items()):
                if not storage.resizable():  # torch.from_numpy and friends: foreign (host) memory
                    del unknown[key]
        else:
            for tensor in _tensors((args, kwargs)):  # a view or in-place result of a foreign tensor is not new
                storage = _storage(tensor)
                if storage is not None:
                    unknown.pop(id(storage), None)
        if not unknown:
            return
        self.arena.register_many([(s, s.nbytes()) for s in unknown.values()], Tier.DEVICE)  # may raise OOM
        if self.poison_uninitialised and func.overloadpacket in _UNINITIALISED:
            with self.suspended():
                for tensor in outputs:
                    TORCH_OPS.poison(tensor)


class _Suspension:
    """``with tracker.suspended():`` — counts the nesting per thread and disables Python dispatch."""

    __slots__ = ("_local", "_guard")

    def __init__(self, local: threading.local) -> None:
        self._local = local
        self._guard: Any = None

    def __enter__(self) -> None:
        local = self._local
        local.suspended = getattr(local, "suspended", 0) + 1
        try:
            guard = _DISABLE_DISPATCH()
            guard.__enter__()
        except BaseException:
            local.suspended -= 1
            raise
        self._guard = guard

    def __exit__(self, *exc: object) -> None:
        guard, self._guard = self._guard, None
        try:
            guard.__exit__(*exc)
        finally:
            self._local.suspended -= 1


def _active_stack() -> list[StorageTracker]:
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack  # type: ignore[no-any-return]
