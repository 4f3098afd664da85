"""The ``offcore`` command line: ``offcore <subcommand> ...``.

Subcommands live one per module in :mod:`offcore.commands` and are found there
automatically (see that package for how to add one)::

    $ offcore backends                 # which backends exist here, and why not
    $ offcore backends --probe --json  # plus measured copy bandwidth per direction

    >>> from offcore.cli import main
    >>> main(["backends", "--json"])     # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType

from offcore import __version__
from offcore.commands import discover
from offcore.errors import OffcoreError

__all__ = ["main", "build_parser"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def build_parser(commands: Iterable[ModuleType] | None = None) -> argparse.ArgumentParser:
    """The argument parser, with one subparser per command module (default: every module in offcore.commands)."""
    parser = argparse.ArgumentParser(
        prog="offcore",
        description=(
            "Offload saved activations between device and host memory, scheduled by next use "
            "(parameters, gradients, optimizer states and NVMe are planned)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"offcore {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in discover() if commands is None else commands:
        module.register(subparsers)
    if commands is None:  # plugins add theirs (``offcore compare`` comes from the PyTorch binding)
        from offcore.registry import plugin_manager

        plugin_manager().hook.offcore_register_commands(subparsers=subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 failure, 2 bad usage or configuration)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(run(args) or EXIT_OK)
    except OffcoreError as exc:
        print(f"offcore {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"offcore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
