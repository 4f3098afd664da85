"""The error hierarchy: one base, specific subclasses, compatible with the builtin errors callers catch."""

from __future__ import annotations

import inspect

import pytest

import offcore
import offcore.errors


def test_every_error_derives_from_offcore_error_and_is_exported() -> None:
    members = [c for _, c in inspect.getmembers(offcore.errors, inspect.isclass) if issubclass(c, Exception)]
    classes = [c for c in members if not issubclass(c, Warning)]
    assert {c.__name__ for c in classes} >= {
        "OffcoreError",
        "ConfigurationError",
        "BackendUnavailableError",
        "CapacityExceededError",
        "IllegalTransitionError",
        "SavedTensorModifiedError",
    }
    for cls in classes:
        assert issubclass(cls, offcore.OffcoreError), cls
        assert getattr(offcore, cls.__name__) is cls, f"offcore.{cls.__name__} is not exported"
        assert cls.__doc__, f"{cls.__name__} needs a docstring"
    assert set(offcore.errors.__all__) == {c.__name__ for c in members}
    assert [c.__name__ for c in members if issubclass(c, Warning)] == ["OffcoreWarning"]
    assert issubclass(offcore.OffcoreWarning, UserWarning) and offcore.OffcoreWarning.__doc__


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (offcore.ConfigurationError, ValueError),
        (offcore.BackendUnavailableError, RuntimeError),
        (offcore.CapacityExceededError, MemoryError),
        (offcore.IllegalTransitionError, RuntimeError),
        (offcore.SavedTensorModifiedError, RuntimeError),
        (offcore.CopyFailedError, RuntimeError),
        (offcore.SavedTensorHooksDisabledError, RuntimeError),
        (offcore.SavedTensorHooksDisabledError, ValueError),
    ],
)
def test_errors_are_also_the_builtin_callers_expect(cls: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(cls, builtin)
    with pytest.raises(offcore.OffcoreError):
        raise cls("x")


def test_real_errors_from_the_core_are_offcore_errors() -> None:
    with pytest.raises(offcore.OffcoreError, match="'-1'"):
        offcore.parse_size("-1")
    with pytest.raises(offcore.OffcoreError, match="registered backends"):
        offcore.device("nosuch-backend-name")
