"""Plugin hooks (pluggy). These docstrings are the reference for plugin authors.

A backend plugin is a module (or object) with functions marked ``@offcore.hookimpl``,
registered under the entry-point group ``offcore.backends`` in its package metadata::

    # pyproject.toml of a third-party adapter
    [project.entry-points."offcore.backends"]
    mydev = "offcore_mydev"

    # offcore_mydev/__init__.py
    import offcore

    @offcore.hookimpl
    def offcore_register_backends(register):
        register("mydev", "offcore_mydev.backend:MyDevBackend")

The built-in ``cpu``, ``cuda`` and ``npu`` backends register exactly this way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["hookspec", "hookimpl", "PROJECT"]

PROJECT = "offcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def offcore_register_backends(register: Callable[..., None]) -> None:
    """Register device backends.

    Call ``register(name, target, *, description="")`` once per backend. ``target`` is
    the backend class or a lazy ``"module:Class"`` string; the class is imported only
    when the backend is first used or probed, so a backend whose runtime is missing
    (no CUDA, no CANN) costs nothing at ``import offcore`` and never breaks another
    backend. The class implements :class:`offcore.protocols.Backend`; its
    ``availability()`` classmethod says whether it can run here and why not.
    """


@hookspec
def offcore_register_commands(subparsers: Any) -> None:
    """Add subcommands to the ``offcore`` command line.

    ``subparsers`` is the ``argparse`` sub-parser action; add a parser with
    ``subparsers.add_parser(name, ...)`` and ``set_defaults(run=fn)`` where ``fn(args)``
    returns the exit status. Framework bindings use this to add commands the core
    cannot run itself (``offcore compare`` comes from the PyTorch binding). Plugins
    providing only commands register under the entry-point group ``offcore.plugins``.
    Keep module-level imports light: the parser is built on every ``offcore`` call.
    """


@hookspec
def offcore_configure_backend(name: str, options: dict[str, Any]) -> None:
    """Inspect or amend the keyword options before backend ``name`` is instantiated.

    Called by :func:`offcore.device` with the options dict, which hooks may modify in
    place (e.g. a site plugin that caps every device's capacity).
    """
