"""The hypothesis settings the combination suites share (docs/testing.md, "Combinations drawn by hypothesis").

Derandomized, so CI runs the same draws every time; no deadline (a draw trains a model); a failure prints
the ``@reproduce_failure`` blob that replays it.

    >>> @derandomized(max_examples=60)          # doctest: +SKIP
    ... @given(drawn=combinations)
    ... def test_something(drawn): ...
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def derandomized(*, max_examples: int) -> settings:
    """``settings`` for a suite of ``max_examples`` derandomized draws."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
