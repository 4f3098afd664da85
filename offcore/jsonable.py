"""JSON that strict parsers accept: non-finite floats become ``null``.

``json.dumps`` writes ``Infinity`` and ``NaN``, which browsers, Perfetto and ``jq``
reject; reports carry unlimited bandwidths and unknown figures as such floats::

    >>> finite({"bandwidth": float("inf"), "sizes": [1.5, float("nan")]})
    {'bandwidth': None, 'sizes': [1.5, None]}
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite"]


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples, recursively) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
