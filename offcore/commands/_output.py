"""Output helpers shared by the subcommands: aligned text tables and JSON.

>>> print(format_table(["name", "ok"], [["cpu", "yes"], ["cuda", "no"]]))
name  ok
----  ---
cpu   yes
cuda  no
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, TextIO

from offcore.jsonable import finite

__all__ = ["format_table", "write_json", "format_rate"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces, with a dashed rule under the headers."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def write_json(data: Any, stream: TextIO) -> None:
    """Indented JSON (non-finite floats as ``null``) and a newline."""
    stream.write(json.dumps(finite(data), indent=2, sort_keys=False))
    stream.write("\n")


def format_rate(bytes_per_second: float | None) -> str:
    """GiB/s with two decimals, or ``-`` when not measured."""
    if bytes_per_second is None or not math.isfinite(bytes_per_second):
        return "-"
    return f"{bytes_per_second / 2**30:.2f}"
