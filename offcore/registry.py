"""The backend registry: entry points, pluggy, lazy imports, availability.

    >>> import offcore
    >>> [info.name for info in offcore.backends()]          # doctest: +SKIP
    ['cpu', 'cuda', 'npu']
    >>> dev = offcore.device("cpu", capacity="2GiB")         # doctest: +SKIP

Environment switches (as pytest and tox have):

- ``OFFCORE_BACKEND_AUTOLOAD=0``: load no entry points; register plugins by hand with
  :func:`register_plugin`.
- ``OFFCORE_BACKEND_BLOCK=name,name``: skip these entry points (by entry-point name).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from offcore import hookspecs
from offcore.errors import BackendUnavailableError, ConfigurationError
from offcore.protocols import Availability

__all__ = [
    "BackendInfo",
    "backends",
    "get_backend_class",
    "device",
    "plugin_manager",
    "register_plugin",
    "reset_registry",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "offcore.backends"
PLUGIN_ENTRY_POINT_GROUP = "offcore.plugins"

_INSTALL_HINTS = {
    "cuda": "install a CUDA build of torch (see the README's 'Choosing a torch build') on a machine with an NVIDIA GPU",
    "npu": "install torch_npu with the Ascend CANN toolkit on a machine with an Ascend NPU",
    "cpu": "install offcore with its torch extra (pip install 'offcore[torch]') or numpy",
}


@dataclass
class BackendInfo:
    """What the registry knows about one backend."""

    name: str
    target: Any
    description: str = ""
    plugin: str = ""
    load_error: str = ""
    _cls: Any = field(default=None, repr=False)

    def load(self) -> Any:
        """Import and return the backend class (raises BackendUnavailableError)."""
        if self._cls is not None:
            return self._cls
        if self.load_error:
            raise BackendUnavailableError(f"backend {self.name!r} could not be loaded: {self.load_error}")
        target = self.target
        if isinstance(target, str):
            module_name, _, attr = target.partition(":")
            try:
                module = importlib.import_module(module_name)
                target = getattr(module, attr) if attr else module
            except Exception as exc:  # any failure: a broken runtime must not break offcore
                self.load_error = f"importing {self.target!r} failed: {type(exc).__name__}: {exc}"
                raise BackendUnavailableError(
                    f"backend {self.name!r} could not be loaded: {self.load_error}. "
                    f"Hint: {_INSTALL_HINTS.get(self.name, 'check the adapter package is installed')}"
                ) from exc
        self._cls = target
        return target

    def availability(self) -> Availability:
        """Whether the backend can run here; never raises."""
        try:
            cls = self.load()
        except BackendUnavailableError as exc:
            return Availability(False, str(exc), 0)
        try:
            result = cls.availability()
        except Exception as exc:
            return Availability(False, f"availability check raised {type(exc).__name__}: {exc}", 0)
        return result


class _Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, BackendInfo] = {}
        self.broken_plugins: dict[str, str] = {}
        self._loaded = False
        self._lock = threading.RLock()

    def _collect(self) -> None:
        self.infos.clear()
        # registration order (get_plugins() is a set): when two plugins claim one name, the
        # first registered keeps it on every run, and the built-ins load before late hand-registered ones
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # a blocked name
                continue
            impl = getattr(plugin, "offcore_register_backends", None)
            if impl is None:
                continue

            def register(bname: str, target: Any, *, description: str = "", _plugin: str = name) -> None:
                if not isinstance(bname, str) or not bname.isidentifier():
                    raise ConfigurationError(f"plugin {_plugin!r} registered an invalid backend name {bname!r}")
                if bname in self.infos and self.infos[bname].plugin != _plugin:
                    raise ConfigurationError(
                        f"backend {bname!r} is registered by both {self.infos[bname].plugin!r} and {_plugin!r}; "
                        "block one of them with OFFCORE_BACKEND_BLOCK"
                    )
                self.infos[bname] = BackendInfo(bname, target, description, _plugin)

            try:
                impl(register=register)
            except Exception as exc:
                self.broken_plugins[name] = f"offcore_register_backends raised {type(exc).__name__}: {exc}"

    def ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if os.environ.get("OFFCORE_BACKEND_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off"):
                blocked = {n.strip() for n in os.environ.get("OFFCORE_BACKEND_BLOCK", "").split(",") if n.strip()}
                entry_points = [
                    *metadata.entry_points(group=ENTRY_POINT_GROUP),
                    *metadata.entry_points(group=PLUGIN_ENTRY_POINT_GROUP),
                ]
                for ep in entry_points:
                    if ep.name in blocked or self.pm.has_plugin(ep.name) or self.pm.is_blocked(ep.name):
                        continue
                    try:
                        plugin = ep.load()
                    except Exception as exc:
                        self.broken_plugins[ep.name] = (
                            f"importing entry point {ep.value!r} failed: {type(exc).__name__}: {exc}"
                        )
                        continue
                    try:
                        self.pm.register(plugin, name=ep.name)
                    except Exception as exc:  # e.g. a hookimpl whose arguments match no hookspec
                        self.broken_plugins[ep.name] = f"registering entry point {ep.value!r} failed: {exc}"
            self._drop_unknown_hooks()
            self._collect()

    def _drop_unknown_hooks(self) -> None:
        """``check_pending()``, unregistering (and listing as broken) each plugin it rejects.

        One plugin with a misspelt ``offcore_*`` hook must not take the others down.
        """
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.pm.get_name(exc.plugin) or repr(exc.plugin)
                self.pm.unregister(exc.plugin)
                self.broken_plugins[name] = f"{exc}; check the hook names against offcore.hookspecs"

    def register_plugin(self, plugin: object, name: str | None = None) -> None:
        with self._lock:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
            if self._loaded:
                self._collect()


_REGISTRY = _Registry()
_REGISTRY_LOCK = threading.Lock()


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager (entry points loaded)."""
    _REGISTRY.ensure_loaded()
    return _REGISTRY.pm


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object by hand (tests, or with ``OFFCORE_BACKEND_AUTOLOAD=0``)."""
    _REGISTRY.register_plugin(plugin, name)


def reset_registry() -> None:
    """Forget every plugin; the next use reloads entry points (for tests)."""
    global _REGISTRY
    with _REGISTRY_LOCK:
        _REGISTRY = _Registry()


def backends() -> list[BackendInfo]:
    """Every registered backend, available or not, sorted by name."""
    _REGISTRY.ensure_loaded()
    return [_REGISTRY.infos[n] for n in sorted(_REGISTRY.infos)]


def broken_plugins() -> dict[str, str]:
    """Entry points that failed to import or register, with the reason."""
    _REGISTRY.ensure_loaded()
    return dict(_REGISTRY.broken_plugins)


def _info(name: str) -> BackendInfo:
    _REGISTRY.ensure_loaded()
    info = _REGISTRY.infos.get(name)
    if info is None:
        known = ", ".join(sorted(_REGISTRY.infos)) or "none"
        broken = _REGISTRY.broken_plugins.get(name)
        extra = f" (its plugin failed: {broken})" if broken else ""
        raise BackendUnavailableError(
            f"no backend named {name!r} is registered{extra}; registered backends: {known}. "
            f"Hint: {_INSTALL_HINTS.get(name, 'install the adapter package that provides it')}"
        )
    return info


def get_backend_class(name: str) -> Any:
    """The backend class registered as ``name`` (imported on first use)."""
    return _info(name).load()


def parse_device_spec(spec: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", 0)``."""
    if not isinstance(spec, str) or not spec:
        raise ConfigurationError(f"a device is named like 'cpu', 'cuda' or 'cuda:1', not {spec!r}")
    name, sep, index = spec.partition(":")
    if not name:
        raise ConfigurationError(f"device {spec!r} has no backend name: write e.g. 'cuda:1'")
    if not sep:
        return name, 0
    if not (index.isascii() and index.isdigit()):  # '²'.isdigit() is True, int('²') raises
        raise ConfigurationError(f"device index in {spec!r} must be a non-negative integer, e.g. 'cuda:1'")
    return name, int(index)


def device(spec: str = "cpu", /, **options: Any) -> Any:
    """Create a device of backend ``spec`` (``"cpu"``, ``"cuda:1"``, ``"npu"``).

    Keyword options go to the backend (for the fake device: ``capacity``,
    ``h2d_bandwidth``, ``d2h_bandwidth``, ``latency``, ``duplex``, ``sanitize``).
    Raises :class:`~offcore.BackendUnavailableError` with the backend's reason when
    it cannot run here.

        >>> dev = offcore.device("cpu", capacity="4GiB", h2d_bandwidth="32GiB/s")  # doctest: +SKIP
    """
    name, index = parse_device_spec(spec)
    info = _info(name)
    status = info.availability()
    if not status.available:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {status.reason}")
    if status.device_count and index >= status.device_count:
        raise ConfigurationError(
            f"{spec!r}: backend {name!r} has {status.device_count} device(s), indices 0..{status.device_count - 1}"
        )
    _REGISTRY.pm.hook.offcore_configure_backend(name=name, options=options)
    cls: Callable[..., Any] = info.load()
    return cls(index=index, **options)
