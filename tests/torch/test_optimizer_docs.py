"""The example of docs/optimizer-offload.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "optimizer-offload.md").read_text()
    example = re.search(r"```python\n(.*?)```", doc, re.S)
    assert example is not None
    code = example.group(1).replace("/tmp/ckpt.pt", str(tmp_path / "ckpt.pt"))
    exec(compile(code, "docs/optimizer-offload.md", "exec"), {})
    assert (tmp_path / "ckpt.pt").exists()
