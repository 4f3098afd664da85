"""Fixtures of the PyTorch tests (helpers live in ``torch_test_devices``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch_test_devices import fake_device  # noqa: E402

import offcore  # noqa: E402

# The models here are tiny: one intra-op thread computes them as fast as two, and leaves a
# core to the fake device's copy threads (which the tests want running concurrently).
torch.set_num_threads(1)


@pytest.fixture
def make_fake_device() -> Iterator[Callable[..., Any]]:
    """``make_fake_device(**kwargs)`` builds a :func:`torch_test_devices.fake_device`; all are closed after the test."""
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        device = fake_device(**kwargs)
        made.append(device)
        return device

    yield make
    for device in made:
        device.synchronize()
        device.close()


def _plugin_provides_backend() -> bool:
    try:
        import pytest_offcore
    except ImportError:
        return False
    return hasattr(pytest_offcore, "backend")


if not _plugin_provides_backend():  # until pytest_offcore ships its ``backend`` fixture

    @pytest.fixture(params=["cpu"])
    def backend(request: pytest.FixtureRequest) -> Any:
        return offcore.device(request.param, sanitize=True)
