"""The offload policy: what to offload, when, and what to do when the host budget runs out.

All knobs are validated up front, so a typo fails at ``offload_activations(...)`` with
a :class:`~offcore.ConfigurationError` instead of mid-step; an unknown keyword is
refused with the list of known ones (:data:`KNOWN_OPTIONS`).

    >>> from offcore_torch.activations.policy import OffloadPolicy
    >>> policy = OffloadPolicy.parse(min_bytes="64KiB", watermark=0.3)
    >>> policy.min_bytes, policy.watermark, policy.prefetch
    (65536, 0.3, 'deadline')

:class:`PackRules` applies a policy to each saved tensor of one region: it says why a
tensor stays on the device (a reason, counted in ``OffloadStats.kept``) or lets the
region offload it. It also keeps the module scope the rules need (which module runs, the
parameters' storages, ``modules=`` / ``exclude=`` depths) and :func:`no_offload`'s
per-thread switch.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from offcore.errors import ConfigurationError
from offcore.inflight import DEFAULT_MAX_INFLIGHT
from offcore.nvme.spec import NvmeSpec, as_spec
from offcore.residency import PREFETCH_MODES, Watermark
from offcore.scheduler import Scheduler
from offcore.units import parse_duration, parse_size
from offcore_torch.activations.records import GROUP_MAX_BYTES
from offcore_torch.activations.storage import is_parameter_like

__all__ = ["OffloadPolicy", "PackRules", "no_offload", "PREFETCH_MODES", "FALLBACKS", "KNOWN_OPTIONS"]


class _Local(threading.local):
    """Per-thread state: ``suspended``, the depth of :func:`no_offload` blocks on this thread."""

    # a class default, read while this thread has set none: ``getattr(local, name, 0)`` on a
    # threading.local without the attribute raises and catches an AttributeError (~0.7 µs per save)
    suspended = 0


_local = _Local()
_current_autograd_node = torch._C._current_autograd_node
# read once per saved tensor (before_storage): module attributes looked up once here
_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, nn.Parameter, torch.strided

# Note [Module names are learnt once per tree]
# A region learns the names of a module tree's submodules (how offloaded storages are named)
# and the storages of its parameters and buffers (never offloaded) when it enters the tree.
# A region lives one step, so that was a walk of the whole model per step (named_modules:
# a recursive generator building a prefix string per submodule). The names are kept per tree
# root (weakly) with the ids of its submodules in walk order; each region walks the tree with
# a flat loop over ``_modules`` and reuses the names when the same submodules are found in the
# same order (else it names them again). The parameter and buffer storages are read again from
# the live submodules by every region: a parameter replaced or re-pointed (``param.data = ...``)
# between steps is seen at once.
_TREE_NAMES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], dict[int, str]]] = weakref.WeakKeyDictionary()


def _submodules(module: nn.Module) -> list[nn.Module]:
    """``module`` and each of its submodules once (the set ``named_modules()`` yields), breadth first."""
    out = [module]
    seen = {id(module)}
    index = 0
    while index < len(out):
        for sub in out[index]._modules.values():
            if sub is not None and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
        index += 1
    return out


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Inside this block (on this thread) nothing is offloaded, e.g. around an output head.

    >>> with offcore_torch.offload_activations(dev) as handle:      # doctest: +SKIP
    ...     h = model.body(x)
    ...     with offcore_torch.no_offload():
    ...         loss = model.head(h)
    """
    _local.suspended += 1
    try:
        yield
    finally:
        _local.suspended -= 1


FALLBACKS = ("pageable", "keep")
TIERS = ("host", "nvme")


def _modules(value: Any, what: str) -> tuple[nn.Module, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, nn.Module) else value
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
        raise ConfigurationError(f"{what} must be an nn.Module or a list of modules, got {type(value).__name__}")
    items = list(items)
    for item in items:
        if not isinstance(item, nn.Module):
            raise ConfigurationError(f"{what} must hold nn.Module objects, got {type(item).__name__}")
    if not items and what == "modules":
        raise ConfigurationError(
            "modules=[] would offload nothing; pass the submodules to offload, or None for the whole forward"
        )
    return tuple(items)


@dataclass(frozen=True)
class OffloadPolicy:
    """Validated settings of :func:`offcore_torch.offload_activations` (see there for meanings)."""

    min_bytes: int = 64 * 1024
    prefetch: str = "deadline"
    prefetch_budget: int = 256 * 1024**2
    max_inflight: int | None = DEFAULT_MAX_INFLIGHT  # Note [Copies in flight are capped] (offcore/inflight.py)
    margin: float = 0.0005
    host_budget: int = 4 * 1024**3
    pinned: bool = True
    fallback: str = "pageable"
    watermark: float | None = None
    hysteresis: float = 0.05
    modules: tuple[nn.Module, ...] | None = None
    exclude: tuple[nn.Module, ...] | None = None
    schedule: Scheduler | None = None
    trace: bool = False
    record: bool = False
    tier: str = "host"
    nvme: NvmeSpec | None = None
    nvme_read_ahead: int = 256 * 1024**2
    group_below: int = 64 * 1024

    @classmethod
    def parse(
        cls,
        *,
        min_bytes: int | str = "64KiB",
        prefetch: str = "deadline",
        prefetch_budget: int | str = "256MiB",
        max_inflight: int | str | None = DEFAULT_MAX_INFLIGHT,
        margin: float | str = "0.5ms",
        host_budget: int | str = "4GiB",
        pinned: bool = True,
        fallback: str = "pageable",
        watermark: float | None = None,
        hysteresis: float = 0.05,
        modules: nn.Module | Iterable[nn.Module] | None = None,
        exclude: nn.Module | Iterable[nn.Module] | None = None,
        schedule: Scheduler | None = None,
        trace: bool = False,
        record: bool = False,
        tier: str | None = None,
        nvme: NvmeSpec | str | os.PathLike[str] | None = None,
        nvme_read_ahead: int | str = "256MiB",
        group_below: int | str = "64KiB",
        **unknown: Any,
    ) -> OffloadPolicy:
        if unknown:
            raise ConfigurationError(
                f"unknown offload option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, sorted(unknown)))}; "
                f"the known options are {', '.join(KNOWN_OPTIONS)}"
            )
        if prefetch not in PREFETCH_MODES:
            raise ConfigurationError(
                f"prefetch={prefetch!r} is not a prefetch mode: use 'deadline' (start each reload by its "
                "predicted need time) or 'on_demand' (reload when backward asks)"
            )
        if fallback not in FALLBACKS:
            raise ConfigurationError(
                f"fallback={fallback!r} is not a host-budget fallback: use 'pageable' (copy to ordinary host "
                "memory) or 'keep' (leave the tensor on the device)"
            )
        for name, flag in (("pinned", pinned), ("trace", trace), ("record", record)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"{name} must be True or False, got {flag!r}")
        if watermark is not None:
            if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 < watermark < 1:
                raise ConfigurationError(
                    f"watermark={watermark!r}: give a fraction of device capacity in (0, 1), e.g. 0.2 to offload "
                    "only while less than 20% of device memory is free; or None to offload always"
                )
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
            raise ConfigurationError(f"hysteresis={hysteresis!r}: give a fraction of capacity in [0, 1)")
        if watermark is not None and watermark + hysteresis > 1:
            raise ConfigurationError(
                f"watermark + hysteresis = {watermark + hysteresis:g} exceeds 1: offloading could never stop"
            )
        if schedule is not None and not isinstance(schedule, Scheduler):
            raise ConfigurationError(
                f"schedule must be an offcore.scheduler.Scheduler (reused across steps), got {type(schedule).__name__}"
            )
        spec = as_spec(nvme)
        if tier is None:
            tier = "nvme" if spec is not None else "host"
        if tier not in TIERS:
            raise ConfigurationError(
                f"tier={tier!r}: activations go to 'host' memory (the default) or on to 'nvme' (the tier given by "
                "nvme=PATH, or the device's, set with offcore_torch.nvme_tier(device, PATH))"
            )
        if spec is not None and tier != "nvme":
            raise ConfigurationError(f"nvme={nvme!r} was given with tier={tier!r}: pass tier='nvme' (or leave it out)")
        group = parse_size(group_below, what="group_below", allow_zero=True)
        if group > GROUP_MAX_BYTES:
            raise ConfigurationError(
                f"group_below={group_below!r} is more than a group holds ({GROUP_MAX_BYTES // 1024} KiB): storages of "
                f"that size gain nothing from sharing a copy; give at most {GROUP_MAX_BYTES // 1024}KiB, or 0 to copy "
                "every storage on its own"
            )
        return cls(
            min_bytes=parse_size(min_bytes, what="min_bytes", allow_zero=True),
            prefetch=prefetch,
            prefetch_budget=parse_size(prefetch_budget, what="prefetch_budget", allow_zero=True),
            max_inflight=None
            if max_inflight is None
            else parse_size(max_inflight, what="max_inflight", allow_zero=True),
            margin=parse_duration(margin, what="prefetch margin"),  # texts: Note [Texts are read once] (units.py)
            host_budget=parse_size(host_budget, what="host_budget"),
            pinned=pinned,
            fallback=fallback,
            watermark=None if watermark is None else float(watermark),
            hysteresis=float(hysteresis),
            modules=_modules(modules, "modules"),
            exclude=_modules(exclude, "exclude"),
            schedule=schedule,
            trace=trace,
            record=record,
            tier=tier,
            nvme=spec,
            nvme_read_ahead=parse_size(nvme_read_ahead, what="nvme_read_ahead"),
            group_below=group,
        )


#: The keyword arguments :meth:`OffloadPolicy.parse` (and so ``offload_activations``) accepts.
KNOWN_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(OffloadPolicy))


# Note [One pair of global module hooks]
# Every region needs the running module (its name for each saved tensor). Registering a pair of global
# module hooks per region would change torch's global hook dictionaries at every step, and dynamo guards
# on them: a compiled model would recompile at every step, up to the recompile limit, then run eagerly.
# So one pair is registered once per process and calls the regions active now (installed ones, in order);
# a region's "handle" removes it from that list only.
_ACTIVE_RULES: list[PackRules] = []
_GLOBAL_HOOKS: list[Any] = []
_GLOBAL_LOCK = threading.Lock()


class _ActiveHandle:
    __slots__ = ("rules",)

    def __init__(self, rules: PackRules) -> None:
        self.rules = rules

    def remove(self) -> None:
        with _GLOBAL_LOCK:
            for i, rules in enumerate(_ACTIVE_RULES):
                if rules is self.rules:
                    del _ACTIVE_RULES[i]
                    break


def _enter_all(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():  # Note [The module stack under torch.compile]
        return
    for rules in tuple(_ACTIVE_RULES):
        rules._on_module_enter(module, args)


def _exit_all(module: nn.Module, args: Any, out: Any) -> None:
    if torch.compiler.is_compiling():
        return
    for rules in tuple(_ACTIVE_RULES):
        rules._on_module_exit(module, args, out)


def _track_modules(rules: PackRules) -> _ActiveHandle:
    """Make ``rules`` see every module call until the returned handle is removed."""
    with _GLOBAL_LOCK:
        if not _GLOBAL_HOOKS:
            _GLOBAL_HOOKS.append(nn.modules.module.register_module_forward_pre_hook(_enter_all))
            _GLOBAL_HOOKS.append(nn.modules.module.register_module_forward_hook(_exit_all, always_call=True))
        _ACTIVE_RULES.append(rules)
    return _ActiveHandle(rules)


class PackRules:
    """The pack decisions of one region: which saved tensors it offloads, and why the others stay.

    Three questions, asked in this order by the region's pack hook (each returns the
    reason a tensor stays on the device, or None):

    1. :meth:`before_storage`: during backward, inside :func:`no_offload`, a kind offcore
       cannot move (``during_backward``, ``no_offload``, ``unsupported``);
    2. :meth:`for_storage`: the storage itself (``empty``, ``parameter``, ``leaf``,
       ``small`` and unmarked, ``not_on_device``, ``marked`` False); a storage that
       passes and is offloaded already is shared (dedupe), whatever the scope;
    3. :meth:`for_new_storage`: offloading a new storage (``excluded``,
       ``outside_modules``, ``small``, ``watermark``); a storage marked True skips these.

        >>> import offcore, torch
        >>> dev = offcore.device("cpu")
        >>> rules = PackRules(OffloadPolicy.parse(min_bytes="1KiB"), dev)
        >>> with dev:
        ...     t = torch.randn(8)
        >>> rules.for_storage(t, 32, 0, None)
        'small'
        >>> dev.close()
    """

    __slots__ = (
        "policy",
        "device",
        "min_bytes",
        "scoped",
        "param_keys",
        "module_names",
        "module_stack",
        "scope_depth",
        "exclude_depth",
        "watermark",
        "capacity",
        "thread",
        "foreign_thread",
        "_handles",
    )

    def __init__(self, policy: OffloadPolicy, device: Any) -> None:
        self.policy = policy
        self.device = device
        self.min_bytes = policy.min_bytes
        self.scoped = policy.modules is not None
        self.param_keys: set[int] = set()
        self.module_names: dict[int, str] = {}
        self.module_stack: list[str] = []
        self.scope_depth = 0
        self.exclude_depth = 0
        self.watermark = (
            Watermark(policy.watermark, hysteresis=policy.hysteresis) if policy.watermark is not None else None
        )
        self.capacity = 0
        self.thread = 0  # the thread the region was entered on (install)
        self.foreign_thread: str | None = None  # a module called on another thread meanwhile (its name)
        self._handles: list[Any] = []

    # -- the decisions (once per saved tensor) -------------------------------------------
    def before_storage(self, tensor: torch.Tensor) -> str | None:
        if _current_autograd_node() is not None:
            return "during_backward"
        if _local.suspended:
            return "no_offload"
        cls = type(tensor)  # storage.is_offloadable_kind, inlined (once per saved tensor)
        if (
            (cls is not _TENSOR and cls is not _PARAMETER)
            or tensor.layout is not _STRIDED
            or tensor.is_quantized
            or tensor.is_nested
            or tensor.is_meta
        ):
            return "unsupported"
        return None

    def for_storage(self, tensor: torch.Tensor, nbytes: int, skey: int, marked: bool | None) -> str | None:
        if nbytes == 0:
            return "empty"
        if skey in self.param_keys:
            return "parameter"
        if is_parameter_like(tensor):  # a leaf requiring grad (or a view of one) outside any module
            return "leaf"
        if (
            marked is None
            and nbytes < self.min_bytes
            and not self.exclude_depth
            and not (self.scoped and not self.scope_depth)
        ):
            # small and unmarked: kept whatever else holds (no entry can exist for it: only a
            # storage at least min_bytes or marked True is offloaded), without asking the device
            return "small"
        if not self.device.holds(tensor):
            return "not_on_device"
        if marked is False:
            return "marked"
        return None

    def for_new_storage(self, nbytes: int, marked: bool | None) -> str | None:
        if marked is None:
            if self.exclude_depth:
                return "excluded"
            if self.scoped and not self.scope_depth:
                return "outside_modules"
            if nbytes < self.min_bytes:
                return "small"
            if self.watermark is not None and not self.under_pressure():
                return "watermark"
        return None

    def under_pressure(self) -> bool:
        """The watermark rule (offcore.residency.Watermark) on the device's own accounting."""
        stats = self.device.memory_stats()
        capacity = int(stats.get("capacity_bytes", 0) or self.capacity)
        free = int(stats.get("free_bytes", capacity - int(stats.get("allocated_bytes", 0))))
        assert self.watermark is not None
        return self.watermark.under_pressure(free=free, capacity=capacity)

    def where(self) -> str:
        """The module running now (how a storage is named), or ``"forward"``."""
        return self.module_stack[-1] if self.module_stack else "forward"

    # -- module scope --------------------------------------------------------------------
    def install(self) -> None:
        """Register the module hooks the rules need (removed by :meth:`remove`, also after a failure)."""
        policy, handles = self.policy, self._handles
        self.thread, self.foreign_thread = threading.get_ident(), None
        try:
            for module in (policy.modules or ()) + (policy.exclude or ()):
                self.note_module(module)
            handles.append(_track_modules(self))  # Note [One pair of global module hooks]
            for module in policy.modules or ():
                handles.append(module.register_forward_pre_hook(self._enter_scope))
                handles.append(module.register_forward_hook(self._exit_scope, always_call=True))
            for module in policy.exclude or ():
                handles.append(module.register_forward_pre_hook(self._enter_exclude))
                handles.append(module.register_forward_hook(self._exit_exclude, always_call=True))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_scope(self, *_: Any) -> None:
        self.scope_depth += 1

    def _exit_scope(self, *_: Any) -> None:
        self.scope_depth -= 1

    def _enter_exclude(self, *_: Any) -> None:
        self.exclude_depth += 1

    def _exit_exclude(self, *_: Any) -> None:
        self.exclude_depth -= 1

    def note_module(self, module: nn.Module) -> None:
        """Learn the storages of a module tree's parameters and buffers, and its submodules' names."""
        if id(module) in self.module_names:
            return
        names, keys = self.module_names, self.param_keys
        # one flat walk of the tree (Note [Module names are learnt once per tree]): each submodule's
        # own parameters and buffers, as module.parameters() and .buffers() would yield them
        subs = _submodules(module)
        ids = tuple(map(id, subs))
        cached = _TREE_NAMES.get(module)
        if cached is None or cached[0] != ids:
            root = type(module).__name__
            tree = {id(sub): f"{root}.{name}" if name else root for name, sub in module.named_modules()}
            _TREE_NAMES[module] = (ids, tree)
        else:
            tree = cached[1]
        if names:
            for key, name in tree.items():
                names.setdefault(key, name)
        else:
            names.update(tree)
        for sub in subs:
            for tensors in (sub._parameters, sub._buffers):
                for tensor in tensors.values():
                    if tensor is not None:
                        keys.add(tensor.untyped_storage()._cdata)  # storage_key, inlined

    def _on_module_enter(self, module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():  # Note [The module stack under torch.compile]
            return
        if threading.get_ident() != self.thread:  # saved-tensor hooks are this thread's: nothing of it is ours
            self.foreign_thread = threading.current_thread().name
            return
        name = self.module_names.get(id(module))
        if name is None:
            self.note_module(module)
            name = self.module_names[id(module)]
        self.module_stack.append(name)

    def _on_module_exit(self, module: nn.Module, _args: Any, _out: Any) -> None:
        # Note [The module stack under torch.compile]
        # These global hooks run inside every module call, so dynamo would trace them into a compiled
        # module's call (mutating a list, reading a weak dictionary of modules: a graph break or a failed
        # trace). Under tracing both return at once (a constant branch for dynamo); the saved tensors of
        # compiled code are packed when its graph runs, named after the eager module around it.
        if torch.compiler.is_compiling():
            return
        if self.module_stack and threading.get_ident() == self.thread:
            self.module_stack.pop()
