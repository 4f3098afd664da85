"""Fixtures of the PyTorch tests (helpers live in ``torch_test_devices``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

import offcore  # noqa: E402


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
