"""Fixtures shared by the backend tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import offcore
from offcore.testing.heap import freeze_collected_heap


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
    freeze_collected_heap()  # gc.collect() in leak and accounting checks walks only what tests made
