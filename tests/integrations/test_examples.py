"""Every example of docs/integrations.md runs and trains bit-identically with and without offcore.

Each example trains a tiny GPT-2 or Llama for 4 steps with and without offcore, saves a checkpoint after
step 2 and resumes a fresh run from it; ``run()`` returns both, and the losses of every step, the gradient
norms the stack reports, and every parameter (of the full and of the resumed run) must be equal bit for bit.
The lines marked ``# offcore`` are what a user adds or changes: at most three per stack.
"""

from __future__ import annotations

import importlib
import pathlib
from typing import Any

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "integrations"  # on sys.path (conftest)

EXAMPLES_AND_STACKS = {
    "plain_loop": ["transformers"],
    "with_trainer": ["transformers", "accelerate"],
    "with_accelerate": ["transformers", "accelerate"],
    "with_lightning": ["transformers", "pytorch_lightning"],
    "with_peft": ["transformers", "peft"],
    "with_torchtune": ["transformers"],
    "with_compile": ["transformers"],
}


def load(name: str) -> Any:
    for stack in EXAMPLES_AND_STACKS[name]:
        pytest.importorskip(stack)
    return importlib.import_module(name)


def test_every_example_file_is_tested() -> None:
    files = {p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_")}
    assert files == set(EXAMPLES_AND_STACKS)


@pytest.mark.parametrize("name", sorted(EXAMPLES_AND_STACKS))
def test_at_most_three_lines_of_user_code(name: str) -> None:
    lines = [line for line in (EXAMPLES / f"{name}.py").read_text().splitlines() if line.rstrip().endswith("# offcore")]
    assert 1 <= len(lines) <= 3, lines


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES_AND_STACKS))
def test_example_is_bit_identical(name: str) -> None:
    from _compare import differences, same

    results = load(name).run()
    assert differences(results) == []
    (full, resumed) = results[True]
    # the resumed run continues the full one: the same last two losses and the same final parameters
    assert same(full["losses"][-len(resumed["losses"]) :], resumed["losses"])
    assert same(full["params"], resumed["params"])
    assert len(full["losses"]) == 4 and len(set(full["losses"])) > 1  # it trained


def test_examples_are_in_the_docs() -> None:
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    for name in EXAMPLES_AND_STACKS:
        assert f"examples/integrations/{name}.py" in doc, name
