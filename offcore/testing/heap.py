"""Keeping a test session's long-lived heap out of the cycle collector's walks.

>>> from offcore.testing.heap import freeze_collected_heap
>>> def pytest_collection_finish(session):   # in a conftest.py
...     freeze_collected_heap()
"""

from __future__ import annotations

import gc

__all__ = ["freeze_collected_heap"]


def freeze_collected_heap() -> None:
    """Freeze the heap built by imports and collection out of the cycle collector's reach (once a session).

    With torch imported a full ``gc.collect()`` walks millions of objects (~0.2 s, more as the
    session grows); many tests collect to make freed memory observable (leak and accounting
    checks). Objects alive after collection (modules, test functions, parametrisations) are
    never garbage those tests measure, so freezing them changes no outcome and makes each
    such collect walk only what tests made since. A second call (another folder's conftest)
    does nothing. offcore's own tests call it from the conftests of ``tests/torch`` and
    ``tests/backends``, not from ``tests/conftest.py``: that one would put ``tests/`` on
    ``sys.path``, where ``tests/torch`` passes for a ``torch`` package in the torch-free core job.
    """
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
