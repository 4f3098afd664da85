"""The user documentation stays what a new user can read: a short README, no internal issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: keep it to 200 (measurements go to docs/)"


def test_no_internal_issue_numbers_in_user_docs() -> None:
    pattern = re.compile(r"\b[Ii]ssues? ?-?#?\d+|\(#\d+\)")
    found = []
    for path in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if pattern.search(line):
                found.append(f"{path.name}:{number}: {line.strip()[:100]}")
    assert not found, "internal issue numbers in user documentation:\n" + "\n".join(found)
