"""The test tree mirrors the package layout without packages: every test module's basename is unique.

pytest imports these files by basename (rootdir import mode, no ``__init__.py``), so two
``test_x.py`` in different folders fail collection in a clean checkout ("import file mismatch")
while a warm local cache may hide it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (rename one of each): {clashes}"
