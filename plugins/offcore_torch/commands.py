"""The PyTorch binding's contribution to the ``offcore`` command line (a pluggy plugin).

Registered under the entry-point group ``offcore.plugins``; adds ``offcore compare``.
Importing this module imports neither torch nor the offload machinery: the command
imports them when it runs.
"""

from __future__ import annotations

from typing import Any

import offcore


@offcore.hookimpl
def offcore_register_commands(subparsers: Any) -> None:
    from offcore_torch.compare import compare_command

    compare_command.register(subparsers)
