"""The third-party backend of docs/backends.md is real: an entry point registers it and the shipped suite passes.

``third_party_backend/project`` is the example laid out as its own project (pyproject.toml,
``offcore_numpydev.py``, ``tests/test_conformance.py``). The docs show those files verbatim
(checked here), so they cannot drift from what runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from offcore.protocols import Backend, Event, Stream

ROOT = Path(__file__).resolve().parents[2]
PROJECT = Path(__file__).parent / "third_party_backend" / "project"
DOC = ROOT / "docs" / "backends.md"
FILES = ["pyproject.toml", "offcore_numpydev.py", "tests/test_conformance.py"]


def _section(text: str, title: str) -> str:
    start = text.index(f"\n### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start : end if end != -1 else len(text)]


def documented_files() -> dict[str, str]:
    """``{path: content}`` of each code block in the section that a ``<!-- file: PATH -->`` line precedes."""
    section = _section(DOC.read_text(), "Writing your own backend")
    blocks = re.findall(r"<!-- file: (\S+) -->\n```[a-z]*\n(.*?)```\n", section, re.S)
    return dict(blocks)


def test_the_docs_show_the_example_files_verbatim() -> None:
    shown = documented_files()
    assert sorted(shown) == sorted(FILES), f"docs/backends.md shows {sorted(shown)}"
    for path in FILES:
        assert shown[path] == (PROJECT / path).read_text(), (
            f"the block for {path} in docs/backends.md differs from {(PROJECT / path).relative_to(ROOT)}; "
            "copy the file into the docs"
        )


def _public_methods(cls: type) -> set[str]:
    return {
        n for n in dir(cls) if callable(getattr(cls, n)) and (not n.startswith("_") or n in ("__enter__", "__exit__"))
    }


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) or isinstance(v, classmethod)}
    return {n for n in names if not n.startswith("_") or n in ("__enter__", "__exit__")}


def test_the_example_implements_the_protocol_and_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    # so the suite passing on it shows the suite needs nothing outside the protocol
    monkeypatch.syspath_prepend(str(PROJECT))
    import offcore_numpydev

    device = offcore_numpydev.NumpyDevice()
    assert isinstance(device, Backend)
    assert _public_methods(offcore_numpydev.NumpyDevice) == _members(Backend) - {"name", "capabilities"}
    marker = offcore_numpydev.Marker
    assert isinstance(marker(), Stream) and isinstance(marker(), Event)
    assert _public_methods(marker) == _members(Stream) | _members(Event)


def _entry_points(pyproject: Path) -> str:
    """``entry_points.txt`` for the ``[project.entry-points]`` tables of ``pyproject``."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    groups = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    return "".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
        for group, entries in groups.items()
    )


def test_an_entry_point_registers_it_and_the_shipped_suite_passes(tmp_path: Path) -> None:
    """As after ``pip install``: the project on the path, its dist-info holding the entry points of its pyproject."""
    pytest.importorskip("hypothesis", reason="the conformance suite needs hypothesis (pip install offcore[test])")
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project)
    site = tmp_path / "site"
    dist_info = site / "offcore_numpydev-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: offcore-numpydev\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(_entry_points(project / "pyproject.toml"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFCORE_BACKEND_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(project), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "tests", "--offcore-backend=numpydev", "--offcore-require-backend"]
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider", "-q", "-rs"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 30, out
    assert not re.search(r"\d+ (failed|errors?)\b", out), out

    # the entry point is what registered it: without the dist-info the backend is unknown
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(project), os.environ.get("PYTHONPATH")]))
    alone = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert alone.returncode != 0 and "unknown backend 'numpydev'" in alone.stdout + alone.stderr
