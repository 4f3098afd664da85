"""Device memory accounting for torch: every tensor created while the fake device is active.

Two implementations with the same figures (``offcore.device("cpu", accounting=...)``):
``"allocator"`` (the default where it builds) counts below dispatch, in torch's CPU allocator;
``"dispatch"`` (the reference, and the fallback) counts in a Python ``TorchDispatchMode``.

# Note [Counting device memory with allocations]
# A Python dispatch mode runs Python on every operator: a mode that only calls the operator
# already costs ~5 us per operator, 1.5-1.9 x a small training step on the CPU
# (benchmarks/fake_device_overhead.py), so the reference below cannot be cheap. The
# ``"allocator"`` accounting counts where CUDA's own ``memory_allocated`` counts, in the
# allocator: ``_alloc_hook.cpp`` (built once per machine with ``torch.utils.cpp_extension``,
# cached under ``~/.cache/torch_extensions``) wraps torch's CPU allocator
# (``c10::SetCPUAllocator``). While a thread has a fake device active (and not suspended) the
# hook charges the allocations operators make on that thread to the device's *ledger*
# (bytes, peak, count, capacity; C++), and the allocation's deleter credits it when the
# memory is really freed -- when its storage dies, from any thread -- so views never count
# twice and a storage shared by several tensors is freed with the last of them. Nothing runs
# per operator; a counted allocation costs a hash-map insert and erase. The arena keeps the
# device tier's figures in the same ledger (``MemoryArena.use_ledger``), so adopted tensors
# and ``allocate(..)`` buffers share capacity and peak with the hooked allocations, and
# ``arena.tier_of(storage)`` asks the hook whether it counts the storage's data pointer.
# Over capacity the hook raises the device's out-of-memory error (built by a Python callable
# under the GIL, raised through torch as a ``python_error``) and allocates nothing. With the
# sanitizer on, every counted allocation is poisoned (0xFF) before torch writes it: the
# outputs of ``empty``-family operators hold poison, as the reference poisons them (an
# operator that writes its whole output overwrites the poison, so nothing else changes).
# What is not device memory, as on CUDA (all told apart by thread-local state, no Python;
# operator boundaries from a thread-local RecordFunction callback were tried and cost
# ~0.55 us per operator, 10 % of the benchmark's TinyGPT step):
# - a Python number wrapped as a one-element tensor to pass it to an operator (``x * 2``):
#   made under torch's NoTracerDispatchMode with Python dispatch enabled (``torch.tensor``
#   disables it); on CUDA it stays on the host;
# - tensors Python-level code makes outside operators while holding the GIL
#   (``torch.get_rng_state()``, ``UntypedStorage(n)``): inside an operator called from
#   Python the GIL is released, or (``torch.tensor(data)``, kernels below autograd) the
#   ADInplaceOrView dispatch key is excluded;
# - an operator's dtype cast of such a number (``x.mul_(2)`` on a float tensor casts ``2``
#   to a 4-byte tensor): an allocation of at most 16 bytes made while a *fresh* wrapped number
#   of the thread is alive (made since the thread's last counted allocation of more than 16
#   bytes: a number autograd saves for backward stops being fresh) is *pending*: counted in
#   ``allocated_bytes`` but left out of the peak until the fresh numbers die (the operators
#   using them returned) or the figures are read, when what is still alive (an output, not a
#   cast) enters the peak. So a small output can be missing from the peak for the moments
#   between its operator and the next commit (at most 16 bytes per such tensor).
# Differences from the reference, each closer to CUDA's allocator: an operator's internal
# temporaries (a workspace, a contiguous copy) count towards the peak while they live;
# an ``UntypedStorage.resize_`` inside an operator is seen. Work on threads where no fake
# device is active (the device's copy workers, torch's intra-op pool) is not counted, as in the
# reference. ``UntypedStorage.resize_`` called directly from Python (not an operator; the
# reference sees only operators): a shrink frees the memory, which the hook credits at once and
# the reference when an operator next outputs the storage (``alias.set_(storage)``); a growth
# is made holding the GIL outside operators, so the hook leaves it on the host while the
# reference counts it when an operator next outputs the storage. Grow device storages with an
# operator (``alias.resize_(n)``, as offload_parameters does). Pinned by
# tests/backends/test_cpu_accounting.py, which compares the two.

# Note [Adopted storages are the hook's]
# ``dev.adopt(model)`` counts memory torch allocated before (a model built on the host). With the
# allocator accounting the arena charges the ledger and hands each storage to the hook
# (``_alloc_hook.cpp`` ``adopt``): its DataPtr gets the tracking deleter and its allocator becomes
# the hook, exactly as if it had been allocated inside ``with dev:``. So ``resize_(0)`` (FSDP-style
# parameter streaming) credits the ledger when the memory is really freed and an operator's
# ``resize_`` that grows it again inside ``with dev:`` is counted -- a weak reference to the
# storage (the reference's way) would keep its adoption-time size until the storage dies. Memory
# torch did not allocate (not resizable: ``from_numpy``, DLPack) stays with the arena's weak
# reference. An emptied storage holds no allocation in either accounting (``device_allocations``
# drops, as CUDA's allocator's count); only ``holds()`` differs: the hook does not know an empty
# storage (no memory), the reference still counts it as the device's.

# Note [Counting device memory with storages]
# (The ``"dispatch"`` reference accounting.) On CUDA, ``torch.cuda.memory_allocated`` counts the live bytes of every tensor on the
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
import functools
import hashlib
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offcore.errors import ConfigurationError
from offcore.kinds import Tier
from offcore_cpu.arena import MemoryArena
from offcore_cpu.errors import out_of_memory
from offcore_cpu.torch_buffers import TORCH_OPS

__all__ = ["StorageTracker", "Accounting", "allocator_hook", "resolve_accounting"]

Accounting = Literal["allocator", "dispatch"]
ACCOUNTING_ENV = "OFFCORE_CPU_ACCOUNTING"  # "allocator" / "dispatch": what accounting="auto" picks
BUILD_TIMEOUT_ENV = "OFFCORE_CPU_HOOK_BUILD_TIMEOUT"  # seconds the hook's build (or its lock) may take
BUILD_TIMEOUT_S = 300.0

_log = logging.getLogger(__name__)
_HOOK_PREFIX = "offcore_cpu_alloc_hook"
_HOOK_SOURCE = Path(__file__).with_name("_alloc_hook.cpp")
_hook_lock = threading.Lock()
_hook: Any = None
_hook_error: str | None = None


def allocator_hook() -> Any:
    """The allocator hook's extension module, built on first use and installed; None where it cannot be built.

    Note [Counting device memory with allocations]. The reason it could not be built is
    :func:`allocator_hook_error`; the first failure in a process warns once (``RuntimeWarning``)
    and ``accounting="auto"`` uses the dispatch reference. The build (or a wait for another
    process's build) is given up after ``$OFFCORE_CPU_HOOK_BUILD_TIMEOUT`` seconds (300);
    Note [Building the allocator hook].

        >>> hook = allocator_hook()
        >>> hook is None or hook.installed()
        True
    """
    global _hook, _hook_error
    with _hook_lock:
        if _hook is None and _hook_error is None:
            try:
                module = _build_within(_build_timeout())
                module.install()
                _hook = module
            except Exception as exc:  # no compiler, no ninja, no headers, a stuck build lock: use the reference
                _hook_error = f"{type(exc).__name__}: {exc}".strip()
                _log.info("offcore: the fake device's allocator hook is unavailable (%s)", _hook_error)
                warnings.warn(
                    f"offcore: the CPU fake device's allocator hook is unavailable ({_hook_error}); "
                    "accounting='auto' counts device memory with the dispatch-mode reference (slower). "
                    f"Set {ACCOUNTING_ENV}=dispatch to skip the build.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return _hook


# Note [Building the allocator hook]
# ``torch.utils.cpp_extension.load`` compiles ``_alloc_hook.cpp`` once per machine (~40 s; later
# processes, the spawned ranks of distributed tests included, find the build in
# ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions`` and only run a no-op ninja) under a
# lock file in the build directory. The name carries a hash of the source, its path and torch's
# version (``_hook_name``): one shared name made a checkout and a tox environment's installed
# copy rebuild over each other and load each other's (older) module. A build that crashed (killed, out of memory) leaves the
# lock behind and every later ``load`` waits on it forever. So the load runs on a daemon thread
# and the caller waits for it at most ``$OFFCORE_CPU_HOOK_BUILD_TIMEOUT`` seconds (300); a
# lock older than that is stale and removed first (no build takes that long). Past the
# deadline the hook is unavailable (one warning, ``"auto"`` uses the reference); the abandoned
# thread may still finish loading the module, which is never installed. The pytest plugin
# (``plugins/pytest_offcore``) loads it once at session start with a progress message, so no
# test's own timeout absorbs the first build.
def _build_timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "")
    try:
        timeout = float(raw) if raw else BUILD_TIMEOUT_S
    except ValueError:
        raise ConfigurationError(f"${BUILD_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if timeout <= 0:
        raise ConfigurationError(f"${BUILD_TIMEOUT_ENV} must be positive, got {raw!r}")
    return timeout


@functools.lru_cache(maxsize=1)
def _hook_name() -> str:
    """The extension's name, one per source text, source path and torch version.

    The build cache is per name: checkouts, tox environments (which install a copy of the source)
    and versions of the hook sharing one name would rebuild over each other (~40 s each time)
    and could load each other's module.
    """
    key = b"\0".join([_HOOK_SOURCE.read_bytes(), str(_HOOK_SOURCE.resolve()).encode(), torch.__version__.encode()])
    return f"{_HOOK_PREFIX}_{hashlib.sha256(key).hexdigest()[:12]}"


def _load_hook() -> Any:
    """Compile (or find the cached build of) ``_alloc_hook.cpp`` and import it."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name=_hook_name(), sources=[str(_HOOK_SOURCE)], extra_cflags=["-O2"], verbose=False)


def _build_lock() -> Path | None:
    """torch's lock file for the hook's build directory (None when torch does not say where it is)."""
    try:
        from torch.utils import cpp_extension

        return Path(cpp_extension._get_build_directory(_hook_name(), verbose=False)) / "lock"
    except Exception:  # a private helper: a torch without it just skips the stale-lock check
        return None


def _build_within(timeout: float) -> Any:
    """:func:`_load_hook` on a daemon thread, given up after ``timeout`` seconds (Note [Building the allocator hook])."""
    lock = _build_lock()
    if lock is not None:
        with contextlib.suppress(OSError):
            age = time.time() - lock.stat().st_mtime
            if age > timeout:
                _log.warning("offcore: removing a stale build lock of the allocator hook (%.0f s old): %s", age, lock)
                lock.unlink()
    done = threading.Event()
    result: dict[str, Any] = {}

    def build() -> None:
        try:
            result["module"] = _load_hook()
        except BaseException as exc:  # handed to the waiting caller
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=build, name="offcore-alloc-hook-build", daemon=True).start()
    if not done.wait(timeout):
        where = f" (or for torch's build lock {lock}, which a crashed build leaves behind: delete it)" if lock else ""
        raise TimeoutError(f"gave up after {timeout:g} s waiting for the build{where}")
    if "error" in result:
        raise result["error"]
    return result["module"]


def allocator_hook_error() -> str | None:
    """Why :func:`allocator_hook` returned None (None when it built or was never tried)."""
    return _hook_error


def resolve_accounting(requested: str) -> Accounting:
    """The accounting a fake device uses for ``accounting=requested`` (``"auto"``, ``"allocator"``, ``"dispatch"``).

    ``"auto"``: ``$OFFCORE_CPU_ACCOUNTING`` if set, else the allocator hook where it builds,
    else the dispatch-mode reference. ``"allocator"`` where the hook cannot be built is a
    :class:`~offcore.ConfigurationError` naming the reason.
    """
    if requested == "auto":
        requested = os.environ.get(ACCOUNTING_ENV, "") or "auto"
        if requested == "auto":
            return "allocator" if allocator_hook() is not None else "dispatch"
    if requested == "dispatch":
        return "dispatch"
    if requested == "allocator":
        if allocator_hook() is None:
            raise ConfigurationError(
                "accounting='allocator' needs the fake device's allocator hook, which could not be built "
                f"({allocator_hook_error()}); it needs a C++ compiler and torch's headers. Use accounting='dispatch'."
            )
        return "allocator"
    raise ConfigurationError(
        f"accounting must be 'auto', 'allocator' or 'dispatch' (${ACCOUNTING_ENV} too), got {requested!r}"
    )


_aten = torch.ops.aten
# Operators whose outputs hold uninitialised memory; the sanitizer poisons them.
_UNINITIALISED = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided}

_LIFT_FRESH = _aten.lift_fresh.default  # Note [Fresh tensors from Python data]

_DISABLE_DISPATCH = getattr(torch._C, "_DisableTorchDispatch", contextlib.nullcontext)
# how many dispatch modes are active on this thread (a torch without the counter: assume some)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
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

    def __init__(self, arena: MemoryArena, *, poison_uninitialised: bool, accounting: str = "auto") -> None:
        self.arena = arena
        self.poison_uninitialised = poison_uninitialised
        self.accounting: Accounting = resolve_accounting(accounting)
        self._local = threading.local()  # .depth, .mode, .suspended
        self.ledger: Any = None  # the allocator hook's ledger ("allocator" accounting)
        self.hook: Any = None  # the allocator hook's module ("allocator" accounting)
        if self.accounting == "allocator":
            hook = self.hook = allocator_hook()
            # No reference to the arena or the ledger in the callable: the ledger (C++) holds it.
            oom = functools.partial(_hook_out_of_memory, arena.device_name, arena.capacity, arena.error_class)
            self.ledger = hook.Ledger(arena.capacity, poison_uninitialised, oom)
            arena.use_ledger(
                self.ledger,
                functools.partial(_hooked_storage, hook.owns, self.ledger),
                functools.partial(_take_over_storage, hook.adopt, self.ledger),
                functools.partial(hook.owns, self.ledger),
                (
                    functools.partial(_mark_host, hook.mark_host, self.ledger),
                    functools.partial(hook.unmark_host, self.ledger),
                ),
            )

    def hooked_empty(self, nbytes: int) -> Any:
        """A ``uint8`` buffer of ``nbytes`` counted by the allocator hook, or None where it would not be.

        Note [Device buffers counted by the hook]: ``FakeDevice.allocate(n, DEVICE)`` used to
        suspend the hook, allocate, and register the storage in the arena (a lock, a weak
        reference and a dict entry per buffer). Where the calling thread's hook counts on this
        tracker's ledger (inside ``with dev:``, "allocator" accounting, not suspended), the
        hook itself does exactly that bookkeeping in C++ for a plain ``torch.empty``: the same
        ledger (bytes, peak, count, capacity), the same out-of-memory error raised before
        anything is allocated, freed when the storage dies, and ``tier_of`` answers DEVICE
        through the hook's ``owns``. No Python dispatch mode sees it, as before. None (the
        caller takes the registering path): no hook, another ledger current, or 0 bytes (no
        data pointer the hook could know).
        """
        ledger = self.ledger
        if ledger is None or nbytes <= 0 or _hook is None or _hook.get_current() is not ledger:
            return None
        if not _DISPATCH_MODES():  # no mode could see it: the guard would cost more than the allocation
            return torch.empty(nbytes, dtype=torch.uint8)
        with _DISABLE_DISPATCH():
            return torch.empty(nbytes, dtype=torch.uint8)

    # -- activation (re-entrant, per thread) -----------------------------------------------
    def activate(self) -> None:
        """Start counting on the calling thread (nestable: the mode is entered once per thread)."""
        if getattr(self._local, "depth", 0) == 0 and self.ledger is None:
            self._local.mode = _DeviceMemoryMode(self)
            self._local.mode.__enter__()
        self._local.depth = getattr(self._local, "depth", 0) + 1
        _active_stack().append(self)
        _sync_hook()

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
        _sync_hook()
        if self._local.depth == 0 and self.ledger is None:
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

    __slots__ = ("_local", "_guard", "_ledger")

    def __init__(self, local: threading.local) -> None:
        self._local = local
        self._guard: Any = None
        self._ledger: Any = None

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
        if _hook is not None:  # the allocator hook counts nothing inside either
            self._ledger = _hook.get_current()
            if self._ledger is not None:
                _hook.set_current(None)

    def __exit__(self, *exc: object) -> None:
        guard, self._guard = self._guard, None
        ledger, self._ledger = self._ledger, None
        try:
            if ledger is not None:
                _hook.set_current(ledger)
            guard.__exit__(*exc)
        finally:
            self._local.suspended -= 1


def _sync_hook() -> None:
    """Point the allocator hook of this thread at the innermost active tracker's ledger (or at none)."""
    if _hook is None:
        return
    stack = _active_stack()
    ledger = stack[-1].ledger if stack else None
    _hook.set_current(ledger)


def _hooked_storage(owns: Any, ledger: Any, owner: Any) -> bool:
    """``MemoryArena`` probe: does the allocator hook count ``owner`` (a storage) on ``ledger``'s device?"""
    if not isinstance(owner, torch.UntypedStorage):
        return False
    try:
        return bool(owns(ledger, owner.data_ptr()))
    except (RuntimeError, NotImplementedError):  # meta storages and the like
        return False


def _mark_host(mark: Any, ledger: Any, owner: Any) -> int:
    """``MemoryArena`` host mark: the data pointer the hook now knows the host storage ``owner`` by (0: none).

    Note [Host buffers the hook knows] (_alloc_hook.cpp)."""
    if not isinstance(owner, torch.UntypedStorage):
        return 0
    try:
        return int(mark(ledger, owner))
    except (RuntimeError, NotImplementedError, TypeError):  # meta storages and the like
        return 0


def _take_over_storage(adopt: Any, ledger: Any, owner: Any) -> bool:
    """``MemoryArena`` hand-over: the hook counts ``owner`` (an adopted storage) from now on.

    Note [Adopted storages are the hook's]."""
    if not isinstance(owner, torch.UntypedStorage):
        return False
    try:
        return bool(adopt(ledger, owner))
    except (RuntimeError, NotImplementedError, TypeError):  # meta storages and the like: the arena's weakref
        return False


def _hook_out_of_memory(
    device_name: str, capacity: int, error_class: Any, requested: int, allocated: int
) -> BaseException:
    """The exception the allocator hook raises when ``requested`` more bytes do not fit."""
    return out_of_memory(device_name, requested, allocated, capacity, error_class=error_class)


def _active_stack() -> list[StorageTracker]:
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack  # type: ignore[no-any-return]
