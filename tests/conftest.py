"""Session-wide test settings shared by every folder of the suite."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap built by imports and collection out of the cycle collector's reach.

    With torch imported a full ``gc.collect()`` walks millions of objects (~0.2 s, more as the
    session grows); many tests collect to make freed memory observable (leak and accounting
    checks). Objects alive after collection (modules, test functions, parametrisations) are
    never garbage those tests measure, so freezing them changes no outcome and makes each
    such collect walk only what tests made since.
    """
    gc.collect()
    gc.freeze()
