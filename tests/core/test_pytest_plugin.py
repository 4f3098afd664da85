"""The pytest_offcore plugin: backend selection, skip-or-fail, fixtures, marker and class attributes.

Each scenario runs pytest in a subprocess (``pytester``) with entry-point loading off
and two hand-registered backends, so the outer run's registry is untouched.
"""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import offcore
from offcore import Availability

class _Fake:
    capabilities = frozenset()
    def __init__(self, index=0, **options):
        self.index = index
        self.options = options
    def synchronize(self):
        pass

class Good(_Fake):
    name = "good"
    @classmethod
    def availability(cls):
        return Availability(True, "", 1)

class Bad(_Fake):
    name = "bad"
    @classmethod
    def availability(cls):
        return Availability(False, "no widget attached to this host", 0)

class Plugin:
    @offcore.hookimpl
    def offcore_register_backends(self, register):
        register("good", Good)
        register("bad", Bad)

offcore.register_plugin(Plugin(), name="fixture-plugin")
"""

TESTS = """
import sys
import pytest

def test_plain(backend, backend_name):
    assert type(backend).name == backend_name
    assert backend.options == {}

def test_name_only(backend_name):
    assert backend_name in ("good", "bad")

@pytest.mark.offcore_backend("good", capacity="1MiB")
def test_marker(backend):
    assert backend.options == {"capacity": "1MiB"}

@pytest.mark.offcore_backend("bad")
def test_marker_without_fixture():
    pass

class TestPinned:
    backend_spec = "good"
    backend_options = {"capacity": "2MiB"}
    def test_pinned(self, backend, backend_name):
        assert backend_name == "good" and backend.options == {"capacity": "2MiB"}

def test_plugin_imported_no_torch():
    assert "torch" not in sys.modules
"""


def _outcomes(output: str) -> dict[str, str]:
    """Map 'test id' -> 'PASSED' / 'SKIPPED' / 'FAILED' from ``-rA`` / ``-v`` output."""
    found: dict[str, str] = {}
    for status, nodeid in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", output, flags=re.M):
        found[nodeid.split("::", 1)[1]] = status
    for nodeid, status in re.findall(r"^\S+?::(\S+) (PASSED|SKIPPED|FAILED|ERROR)", output, flags=re.M):
        found.setdefault(nodeid, status)
    return found


@pytest.fixture
def scenario(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("OFFCORE_BACKEND_AUTOLOAD", "0")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_scenario=TESTS)
    return pytester


def test_default_selects_every_registered_backend_and_skips_unavailable(scenario: pytest.Pytester) -> None:
    result = scenario.runpytest_subprocess("-p", "no:cacheprovider", "-v", "-rs")
    out = result.stdout.str()
    found = _outcomes(out)
    assert found["test_plain[good]"] == "PASSED"
    assert found["test_plain[bad]"] == "SKIPPED"
    assert found["test_name_only[good]"] == "PASSED"
    assert found["test_marker[good]"] == "PASSED"
    assert found["test_marker_without_fixture"] == "SKIPPED"
    assert found["TestPinned::test_pinned[good]"] == "PASSED"
    assert found["test_plugin_imported_no_torch"] == "PASSED"
    assert "no widget attached to this host" in out, "the skip must carry the registry's reason"
    assert "offcore backends (all registered" in out
    assert result.ret == 0


def test_require_backend_turns_skips_into_failures(scenario: pytest.Pytester) -> None:
    result = scenario.runpytest_subprocess(
        "-p", "no:cacheprovider", "-v", "-rA", "--offcore-backend=good,bad", "--offcore-require-backend"
    )
    out = result.stdout.str()
    found = _outcomes(out)
    assert found["test_plain[good]"] == "PASSED"
    assert found["test_plain[bad]"] in ("FAILED", "ERROR")
    assert found["test_marker_without_fixture"] in ("FAILED", "ERROR")
    assert "no widget attached to this host" in out and "--offcore-require-backend" in out
    assert result.ret == 1


def test_selection_restricts_parametrisation_and_pinned_classes(scenario: pytest.Pytester) -> None:
    result = scenario.runpytest_subprocess("-p", "no:cacheprovider", "-v", "-rs", "--offcore-backend", "bad")
    out = result.stdout.str()
    found = _outcomes(out)
    assert "test_plain[good]" not in found
    assert found["test_plain[bad]"] == "SKIPPED"
    assert found["test_marker[good]"] == "SKIPPED"
    assert found["TestPinned::test_pinned[good]"] == "SKIPPED"
    assert "not selected (--offcore-backend=bad)" in out
    assert result.ret == 0


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--offcore-backend=nosuch", "unknown backend 'nosuch'; registered backends: bad, good"),
        ("--offcore-backend=good,nope:1", "unknown backend 'nope:1'; registered backends: bad, good"),
        ("--offcore-backend=", "names no backend; give one or more of: bad, good"),
        ("--offcore-backend=,", "names no backend"),
        ("--offcore-backend=good:x", "must be a non-negative integer"),
    ],
)
def test_an_unknown_or_empty_backend_name_is_a_usage_error(
    scenario: pytest.Pytester, option: str, message: str
) -> None:
    result = scenario.runpytest_subprocess("-p", "no:cacheprovider", "-v", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    err = result.stderr.str()
    assert "ERROR: --offcore-backend" in err and message in err, err
    assert "passed" not in result.stdout.str() and "skipped" not in result.stdout.str()


def test_a_backend_with_an_index_is_accepted(scenario: pytest.Pytester) -> None:
    result = scenario.runpytest_subprocess(
        "-p", "no:cacheprovider", "-v", "--offcore-backend=good:0", "-k", "test_marker and not without"
    )
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1, deselected=5)
