"""The hypothesis settings the combination suites share (docs/testing.md, "Combinations drawn by hypothesis").

Derandomized, so CI runs the same draws every time; no deadline (a draw trains a model); a failure prints
the ``@reproduce_failure`` blob that replays it.

    >>> @derandomized(max_examples=60)          # doctest: +SKIP
    ... @given(drawn=combinations)
    ... def test_something(drawn): ...
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def derandomized(*, max_examples: int) -> settings:
    """``settings`` for a suite of ``max_examples`` derandomized draws.

    A hunt (``OFFCORE_HUNT=N`` in the environment): N random draws instead, new ones every run.
    """
    hunt = os.environ.get("OFFCORE_HUNT")
    if hunt:
        if not hunt.isdigit() or int(hunt) < 1:
            raise ValueError(f"OFFCORE_HUNT={hunt!r}: give the number of random draws per suite, e.g. OFFCORE_HUNT=300")
        max_examples = int(hunt)
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=not hunt,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
