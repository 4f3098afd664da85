"""tools/mutation.py plants known bugs by editing exact lines of the source: every anchor must still be there.

A refactor that moves or rewrites an anchored line leaves the mutation unable to apply, and the mutation
check then reports it only when someone runs it; this test runs its ``--check-anchors`` mode (no test run,
under a second) with the fast suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutation_anchor_is_found_once() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mutation.py"), "--check-anchors"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "ANCHOR MISSING" not in done.stdout, done.stdout + done.stderr
