"""The helpers of the combination suites: covering examples, the strategy from the same choices, draws by mode."""

from __future__ import annotations

from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given  # noqa: E402
from hypothesis_draws import choices_strategy, covering, derandomized, full_draws  # noqa: E402

CHOICES: dict[str, Any] = {
    "model": ["cnn", "gpt", "gpt-checkpointed", "mlp", "tiny"],
    "precision": ["fp32", "bf16", "fp16"],
    "optimizer": ["device", "host", "under-backward"],
    "nvme": [False, True],
    "step": range(0, 10),
}


def _supported(drawn: dict[str, Any]) -> bool:
    return not (drawn["precision"] == "fp16" and drawn["optimizer"] in ("device", "under-backward"))


def test_covering_takes_every_value_of_every_dimension_in_valid_combinations_only() -> None:
    chosen = covering(CHOICES, valid=_supported)
    assert all(_supported(c) for c in chosen)
    for name, values in CHOICES.items():
        wanted = {0, 5, 9} if name == "step" else set(values)  # a range: first, middle, last
        assert {c[name] for c in chosen} == wanted, name
    assert len(chosen) <= len(CHOICES["model"]) + 2  # a few, not a product
    assert covering(CHOICES, valid=_supported) == chosen  # the same on every run


def test_covering_refuses_a_value_no_valid_combination_takes() -> None:
    with pytest.raises(ValueError, match="precision"):
        covering(CHOICES, valid=lambda drawn: drawn["precision"] != "fp16")


def test_choices_strategy_draws_only_the_listed_values() -> None:
    seen: list[dict[str, Any]] = []

    @derandomized(max_examples=5, fast=5)
    @given(drawn=choices_strategy(CHOICES))
    def record(drawn: dict[str, Any]) -> None:
        seen.append(drawn)

    record()
    assert seen
    for drawn in seen:
        assert set(drawn) == set(CHOICES)
        assert all(drawn[name] in values for name, values in CHOICES.items())


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_the_default_run_makes_the_examples_and_few_draws_full_draws_all(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv("OFFCORE_DRAWS", mode)
    monkeypatch.delenv("OFFCORE_HUNT", raising=False)
    examples = covering(CHOICES, valid=_supported)
    seen: list[dict[str, Any]] = []

    @derandomized(max_examples=40, fast=2, examples=examples)
    @given(drawn=choices_strategy(CHOICES))
    def record(drawn: dict[str, Any]) -> None:
        seen.append(drawn)

    record()
    assert seen[: len(examples)] == examples, "the covering examples run first, in order"
    drawn = len(seen) - len(examples)
    assert drawn == 2 if mode == "fast" else drawn >= 30, drawn  # full: all 40 unless hypothesis runs dry
    assert full_draws() is (mode == "full")
    assert any(mark.name == "draws" for mark in getattr(record, "pytestmark", []))


def test_a_mistyped_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFCORE_DRAWS", "all")
    with pytest.raises(ValueError, match="OFFCORE_DRAWS='all'"):
        full_draws()
