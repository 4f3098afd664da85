"""The integration tests: offcore inside transformers' Trainer, accelerate, Lightning, peft, torchtune's recipe
shape and torch.compile, each compared bit for bit with the same stack without offcore.

They run in ``tox -e integrations`` (the stacks pinned); a stack that is not installed skips its tests. The
examples they run live in ``examples/integrations`` (``docs/integrations.md`` shows them).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "integrations"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

# tiny models: one intra-op thread computes them as fast as two and leaves a core to the copy threads
torch.set_num_threads(1)
