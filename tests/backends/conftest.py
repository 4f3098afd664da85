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


class CheckedDevices:
    """Builds fake devices with instant copies and 64 MiB by default (``defaults`` and then each call's options
    override them); :meth:`close_all` closes them and fails the test if any left a sanitizer violation."""

    FAST: dict[str, Any] = {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0, "jitter": 0}

    def __init__(self, **defaults: Any) -> None:
        self.defaults = {"capacity": "64MiB", **self.FAST, **defaults}
        self.made: list[Any] = []

    def __call__(self, **options: Any) -> Any:
        dev = offcore.device("cpu", **{**self.defaults, **options})
        self.made.append(dev)
        return dev

    def close_all(self) -> None:
        leftover = []
        for dev in self.made:
            dev.close()  # opens every gate first: never hangs
            leftover += dev.sanitizer_violations()
        self.made.clear()
        assert leftover == [], "a test left violations it did not expect (tests that plant one clear it)"


@pytest.fixture
def make_checked_device() -> Iterator[CheckedDevices]:
    """Fake devices (:class:`CheckedDevices`, no options but instant copies and 64 MiB) closed after the test,
    which fails if one of them has a sanitizer violation left. A module that needs other defaults wraps it."""
    devices = CheckedDevices()
    yield devices
    devices.close_all()


def pytest_collection_finish(session: pytest.Session) -> None:
    freeze_collected_heap()  # gc.collect() in leak and accounting checks walks only what tests made
