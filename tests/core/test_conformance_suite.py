"""The conformance suite itself: it passes on a correct backend and fails on a broken one.

Runs ``offcore.testing.BackendConformance`` in a pytest subprocess against the
synchronous numpy reference backend (``reference_backend.py``) and against a copy of
it that ignores strides, so the suite is shown to be able to fail.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import offcore
import reference_backend
from offcore.testing import BackendConformance

offcore.register_plugin(reference_backend.Plugin(), name="reference-plugin")

class TestReference(BackendConformance):
    backend_spec = "reference"
    buffer_kind = "numpy"
    hypothesis_examples = 15
    max_fill_bytes = 64 << 20

class TestBrokenStrides(BackendConformance):
    backend_spec = "broken_strides"
    hypothesis_examples = 20
    hypothesis_derandomize = True
"""


def test_suite_passes_on_a_correct_backend_and_catches_a_broken_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = str(Path(__file__).parent)
    monkeypatch.setenv("OFFCORE_BACKEND_AUTOLOAD", "0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "-q")
    out = result.stdout.str()
    outcomes = dict(
        (nodeid.split("::", 1)[1], status)
        for status, nodeid in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", out, re.M)
    )
    reference = {k: v for k, v in outcomes.items() if k.startswith("TestReference::")}
    broken = {k: v for k, v in outcomes.items() if k.startswith("TestBrokenStrides::")}
    assert len(reference) >= 30, out
    assert set(reference.values()) == {"PASSED"}, {k: v for k, v in reference.items() if v != "PASSED"}

    def status(test: str) -> str:
        return broken[f"TestBrokenStrides::{test}"]

    # ignoring strides is invisible to contiguous copies and to 'offset' views ...
    assert status("test_copy_is_exact_for_every_dtype[broken_strides-pinned-to-device]") == "PASSED"
    assert status("test_copy_is_exact_for_non_contiguous_views[broken_strides-offset-h2d]") == "PASSED"
    # ... and caught for every transposed or strided source, in every direction
    for layout in ("transposed", "strided"):
        for direction in ("h2d", "d2h", "d2d", "h2h"):
            assert (
                status(f"test_copy_is_exact_for_non_contiguous_views[broken_strides-{layout}-{direction}]") == "FAILED"
            )
    assert status("test_copy_is_exact_for_random_shapes_and_layouts[broken_strides]") == "FAILED"
    assert result.ret == 1
