"""Subcommands of the ``offcore`` command line, one module each.

To add a core subcommand, drop a module here (``offcore/commands/backends.py``) with::

    def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser("compare", help="...", description="...")
        parser.add_argument(...)
        parser.set_defaults(run=run)
        return parser

    def run(args: argparse.Namespace) -> int:
        ...                     # return the exit status; raise OffcoreError for user errors

:func:`discover` finds it; nothing else needs editing. Keep module-level imports
light (no torch, matplotlib, ...): every subcommand module is imported to build the
parser, so import heavy libraries inside ``run``. Shared output helpers (tables,
JSON) are in :mod:`offcore.commands._output`. Commands that need a framework come
from plugins through the ``offcore_register_commands`` hook (``offcore compare`` is
the PyTorch binding's).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["discover"]


def discover() -> list[ModuleType]:
    """Every subcommand module of this package (names not starting with ``_``), sorted by name."""
    modules = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if callable(getattr(module, "register", None)):
            modules.append(module)
    return modules
