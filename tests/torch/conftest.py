"""Fixtures of the PyTorch tests (helpers live in ``torch_test_devices``).

Every device a fixture hands out is checked: a fake device must run its sanitizer
(:func:`torch_test_devices.assert_sanitized`), and at teardown its gates are opened, its
copies waited for, and any buffer it saw freed or released while a copy still used it
fails the test (:func:`torch_test_devices.finish_device`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch_test_devices import assert_sanitized, fake_device, finish_device  # noqa: E402

import offcore  # noqa: E402
from offcore.testing.heap import freeze_collected_heap  # noqa: E402

# The models here are tiny: one intra-op thread computes them as fast as two, and leaves a
# core to the fake device's copy threads (which the tests want running concurrently).
torch.set_num_threads(1)


@pytest.fixture
def make_fake_device() -> Iterator[Callable[..., Any]]:
    """``make_fake_device(**kwargs)`` builds a :func:`torch_test_devices.fake_device`; all are checked and closed after the test."""
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        device = fake_device(**kwargs)
        made.append(device)
        return device

    yield make
    errors: list[BaseException] = []
    for device in made:
        try:
            finish_device(device)
        except BaseException as exc:  # every device is closed even when one fails
            errors.append(exc)
    if errors:
        raise errors[0]


def _plugin_provides_backend_name() -> bool:
    try:
        import pytest_offcore
    except ImportError:
        return False
    return hasattr(pytest_offcore, "backend_name")


if not _plugin_provides_backend_name():  # pragma: no cover - pytest_offcore ships in this repository

    @pytest.fixture(params=["cpu"])
    def backend_name(request: pytest.FixtureRequest) -> str:
        return str(request.param)


@pytest.fixture
def backend(backend_name: str) -> Iterator[Any]:
    """The backend under test (pytest_offcore's ``backend_name``); the CPU fake device runs its sanitizer."""
    options = {"sanitize": True} if backend_name.split(":")[0] == "cpu" else {}
    device = assert_sanitized(offcore.device(backend_name, **options))
    yield device
    finish_device(device)


def pytest_collection_finish(session: pytest.Session) -> None:
    freeze_collected_heap()  # gc.collect() in leak and accounting checks walks only what tests made
