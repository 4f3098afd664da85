"""The hypothesis settings the combination suites share (docs/testing.md, "Combinations drawn by hypothesis").

Derandomized, so CI runs the same draws every time; no deadline (a draw trains a model); a failure prints
the ``@reproduce_failure`` blob that replays it.

A suite lists its dimensions once, as the values each can take, and gets from them both the strategy and a
few *covering* combinations (every value of every dimension in at least one of them):

    >>> CHOICES = {"model": ["cnn", "gpt"], "nvme": [False, True], "step": range(3)}   # doctest: +SKIP
    >>> combinations = choices_strategy(CHOICES)                                          # doctest: +SKIP
    >>> @derandomized(max_examples=60, examples=covering(CHOICES, valid=supported))     # doctest: +SKIP
    ... @given(drawn=combinations)
    ... def test_something(drawn): ...

How many draws run (docs/testing.md, "Test budget"):

- default (``tox -e cpu``, a plain ``pytest``): the covering combinations (explicit examples) plus ``fast``
  derandomized draws -- every option of the suite is exercised, in a few seconds;
- ``OFFCORE_DRAWS=full`` (``tox -e slow``): the covering combinations plus all ``max_examples`` draws;
- ``OFFCORE_HUNT=N``: N random draws (new ones every run) plus the covering combinations -- a soak.

Every such suite carries the ``draws`` marker, so ``-m draws`` selects them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, example, settings
from hypothesis import strategies as st

F = TypeVar("F", bound=Callable[..., Any])

FAST_DRAWS = 2
"""Derandomized draws a suite makes by default, on top of its covering combinations."""


def full_draws() -> bool:
    """True when ``OFFCORE_DRAWS=full``: the suites make all their draws (``tox -e slow``).

    Raises:
        ValueError: ``OFFCORE_DRAWS`` is set to something else than ``full`` or ``fast``.
    """
    mode = os.environ.get("OFFCORE_DRAWS", "fast") or "fast"
    if mode not in ("fast", "full"):
        raise ValueError(f"OFFCORE_DRAWS={mode!r}: use OFFCORE_DRAWS=full (every draw) or fast (the default)")
    return mode == "full"


def derandomized(
    *, max_examples: int, fast: int = FAST_DRAWS, examples: Sequence[Mapping[str, Any]] = (), argname: str = "drawn"
) -> Callable[[F], F]:
    """Decorate a ``@given`` test: ``max_examples`` derandomized draws under ``OFFCORE_DRAWS=full``, ``fast`` otherwise.

    ``examples`` (e.g. from :func:`covering`) always run first, as explicit examples passed as ``argname``;
    with ``fast=0`` and examples, the default run makes no random draw at all. The test gets the ``draws``
    marker. A hunt (``OFFCORE_HUNT=N`` in the environment): N random draws instead, new ones every run.
    """
    hunt = os.environ.get("OFFCORE_HUNT")
    phases = tuple(Phase)
    if hunt:
        if not hunt.isdigit() or int(hunt) < 1:
            raise ValueError(f"OFFCORE_HUNT={hunt!r}: give the number of random draws per suite, e.g. OFFCORE_HUNT=300")
        draws = int(hunt)
    elif full_draws():
        draws = max_examples
    elif fast > 0 or not examples:
        draws = min(max(fast, 1), max_examples)
    else:
        draws = 1  # unused: only the explicit examples run
        phases = (Phase.explicit,)
    chosen = settings(
        max_examples=draws,
        deadline=None,
        derandomize=not hunt,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
        phases=phases,
    )

    def decorate(test: F) -> F:
        for drawn in reversed(examples):  # hypothesis runs the last-applied example first
            test = example(**{argname: dict(drawn)})(test)
        return pytest.mark.draws(chosen(test))

    return decorate


def choices_strategy(choices: Mapping[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A ``fixed_dictionaries`` strategy drawing one value per dimension, in the mapping's order.

    ``[False, True]`` draws ``st.booleans()``, a ``range`` draws ``st.integers`` over it, a list or tuple
    ``st.sampled_from`` it, and a strategy draws itself.
    """

    def one(values: Any) -> st.SearchStrategy[Any]:
        if isinstance(values, st.SearchStrategy):
            return values
        if isinstance(values, range):
            if values.step != 1 or not values:
                raise ValueError(f"{values!r}: give a non-empty range with step 1")
            return st.integers(values.start, values.stop - 1)
        values = list(values)
        if values == [False, True]:
            return st.booleans()
        return st.sampled_from(values)

    return st.fixed_dictionaries({name: one(values) for name, values in choices.items()})


def covering(
    choices: Mapping[str, Any],
    *,
    valid: Callable[[dict[str, Any]], bool] = lambda drawn: True,
    candidates: int = 400,
) -> list[dict[str, Any]]:
    """A few combinations that, together, take every value of every dimension at least once.

    A ``range`` dimension is covered by its first, middle and last value; a strategy dimension is left
    out (the suite fills it in). Only combinations ``valid`` accepts are used (the same predicate the test
    passes to ``assume``). Greedy over a fixed pool of shifted and seeded-random candidates, so the result is
    the same on every run.

    Raises:
        ValueError: no valid candidate takes some value (the dimension's value is unreachable, or
            ``candidates`` is too small).
    """
    dims: dict[str, list[Any]] = {}
    for name, values in choices.items():
        if isinstance(values, st.SearchStrategy):
            continue
        if isinstance(values, range):
            values = sorted({values[0], values[len(values) // 2], values[-1]})
        dims[name] = list(values)
    names = list(dims)
    rng = random.Random(0)
    pool: list[dict[str, Any]] = []
    widest = max((len(v) for v in dims.values()), default=1)
    for shift in range(1, 8):  # rotations first: combination i takes value i + shift * j of dimension j
        for i in range(widest):
            pool.append({n: dims[n][(i + shift * j) % len(dims[n])] for j, n in enumerate(names)})
    while len(pool) < candidates:
        pool.append({n: rng.choice(dims[n]) for n in names})
    pool = [c for c in pool if valid(dict(c))]

    def key(name: str, value: Any) -> tuple[str, str]:
        return (name, repr(value))

    uncovered = {key(n, v) for n in names for v in dims[n]}
    chosen: list[dict[str, Any]] = []
    while uncovered:
        best = max(pool, key=lambda c: len(uncovered & {key(n, v) for n, v in c.items()}), default=None)
        gained = uncovered & {key(n, v) for n, v in best.items()} if best is not None else set()
        if not gained:
            raise ValueError(f"no valid combination takes {sorted(uncovered)}: check `valid`, or raise `candidates`")
        chosen.append(best)
        uncovered -= gained
    return chosen
