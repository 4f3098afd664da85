"""Fixtures shared by the backend tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

import offcore


@pytest.fixture
def make_device() -> Iterator[Any]:
    """Build fake devices (``offcore.device("cpu", **options)``) that are closed (worker threads
    stopped) after the test. Test modules that need other defaults define their own."""
    made: list[Any] = []

    def make(**options: Any) -> Any:
        dev = offcore.device("cpu", **options)
        made.append(dev)
        return dev

    yield make
    for dev in made:
        dev.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap built by imports and collection out of the cycle collector's reach (once a session).

    With torch imported a full ``gc.collect()`` walks millions of objects (~0.2 s, more as the
    session grows); many tests collect to make freed memory observable (leak and accounting
    checks). Objects alive after collection (modules, test functions, parametrisations) are
    never garbage those tests measure, so freezing them changes no outcome and makes each
    such collect walk only what tests made since. (In a conftest per folder, not in
    ``tests/conftest.py``: that one would put ``tests/`` on ``sys.path``, where ``tests/torch``
    passes for a ``torch`` package in the torch-free core job.)
    """
    if gc.get_freeze_count() == 0:  # the other folder's conftest froze it already
        gc.collect()
        gc.freeze()
