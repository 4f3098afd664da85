"""JSON that strict parsers accept: non-finite floats become ``null``; JSON read with clear errors.

``json.dumps`` writes ``Infinity`` and ``NaN``, which browsers, Perfetto and ``jq``
reject; reports carry unlimited bandwidths and unknown figures as such floats::

    >>> finite({"bandwidth": float("inf"), "sizes": [1.5, float("nan")]})
    {'bandwidth': None, 'sizes': [1.5, None]}
"""

from __future__ import annotations

import json
import math
from typing import Any

from offcore.errors import ConfigurationError

__all__ = ["finite", "loads"]


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples, recursively) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def loads(text: Any, *, what: str) -> Any:
    """Parse JSON ``text`` (str or bytes); every failure is a :class:`~offcore.ConfigurationError` naming ``what``.

    Catches what ``json.loads`` raises besides ``JSONDecodeError``: ``TypeError`` for
    ``None`` or a dict, ``RecursionError`` for deeply nested input, ``ValueError`` for
    bytes that are not UTF-8 or integers of more than 4300 digits.

        >>> loads("None", what="plan")
        Traceback (most recent call last):
        ...
        offcore.errors.ConfigurationError: plan is not valid JSON: Expecting value: line 1 column 1 (char 0)
    """
    if not isinstance(text, (str, bytes, bytearray)):
        hint = "; for an already parsed object use from_dict" if isinstance(text, (dict, list)) else ""
        raise ConfigurationError(f"{what} must be JSON text (str or bytes), got {type(text).__name__}{hint}")
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigurationError(
            f"{what} is nested too deeply to read (a valid one nests a few levels; write it with to_json)"
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise ConfigurationError(f"{what} is not valid JSON: {exc}") from None
