"""The ``offcore`` command line: subcommand discovery, ``offcore backends`` (table, JSON, probe), errors."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import types
from typing import Any

import pytest

import offcore
from offcore.cli import build_parser, main
from offcore.commands import discover
from offcore.commands._output import format_rate, format_table
from offcore.commands.backends import parse_option


def _cpu_available() -> bool:
    return any(i.name == "cpu" and i.availability().available for i in offcore.backends())


needs_cpu = pytest.mark.skipif(not _cpu_available(), reason="the cpu fake device is not available here")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["backends", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_subcommands_are_discovered_from_their_modules() -> None:
    names = [m.__name__.rsplit(".", 1)[1] for m in discover()]
    assert "backends" in names and all(not n.startswith("_") for n in names)


def test_a_new_subcommand_plugs_in_with_register(capsys: pytest.CaptureFixture[str]) -> None:
    hello = types.ModuleType("hello")

    def register(subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("--name", default="world")
        parser.set_defaults(run=lambda args: print(f"hello {args.name}") or 3)
        return parser

    hello.register = register  # type: ignore[attr-defined]
    parser = build_parser([hello])
    args = parser.parse_args(["hello", "--name", "offcore"])
    assert args.run(args) == 3
    assert capsys.readouterr().out == "hello offcore\n"


def test_no_subcommand_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "backends" in capsys.readouterr().err


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["frobnicate"])
    assert caught.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert offcore.__version__ in capsys.readouterr().out


def test_backends_table_lists_every_backend_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    header, rule, *rows = out.splitlines()
    assert header.split() == ["backend", "available", "devices", "capacity", "reason"]
    assert set(rule.replace(" ", "")) == {"-"}
    listed = {row.split()[0]: row for row in rows if row.strip()}
    for info in offcore.backends():
        row = listed[info.name]
        status = info.availability()
        assert row.split()[1] == ("yes" if status.available else "no")
        if not status.available:
            assert status.reason[:40] in row, "an unavailable backend shows its reason"


def test_backends_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys)
    entries = {e["name"]: e for e in data["backends"]}
    assert set(entries) == {i.name for i in offcore.backends()}
    assert isinstance(data["broken_plugins"], dict)
    for entry in entries.values():
        assert set(entry) >= {"name", "available", "reason", "device_count", "capacity_bytes", "description"}
        if entry["available"]:
            assert entry["device_count"] >= 1 and entry["capacity_bytes"] > 0
        else:
            assert entry["reason"] and entry["capacity_bytes"] is None


@needs_cpu
def test_device_options_reach_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--backend", "cpu", "-o", "capacity=96MiB", "-o", "buffers=numpy")
    (entry,) = data["backends"]
    assert entry["name"] == "cpu" and entry["capacity_bytes"] == 96 * 2**20


@needs_cpu
def test_probe_measures_every_direction(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        capsys,
        "--probe",
        "-b",
        "cpu",
        "--sizes",
        "256KiB,1MiB",
        "--repeat",
        "1",
        "-o",
        "buffers=numpy",
        "-o",
        "h2d_bandwidth=4GiB/s",
        "-o",
        "latency=0",
    )
    (entry,) = data["backends"]
    assert [p["size_bytes"] for p in entry["probe"]] == [256 * 1024, 2**20]
    for probe in entry["probe"]:
        for key in ("h2d", "d2h", "both_h2d", "both_d2h"):
            assert probe[key] is None or (probe[key] > 0 and math.isfinite(probe[key])), (key, probe)
        assert probe["timing"] in ("events", "host clock")


@needs_cpu
def test_probe_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--probe", "-b", "cpu", "--sizes", "1MiB", "--repeat", "1", "-o", "buffers=numpy"]) == 0
    out = capsys.readouterr().out
    assert "both: H2D" in out and "1.00 MiB" in out


@needs_cpu
def test_probe_larger_than_the_device_reports_the_failure(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["backends", "--probe", "-b", "cpu", "-o", "capacity=1MiB", "-o", "buffers=numpy", "--sizes", "1MiB"])
    assert status == 1
    assert "choose smaller sizes" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["backends", "--backend", "nosuch"], "registered: "),
        (["backends", "-o", "capacity"], "KEY=VALUE"),
        (["backends", "-b", "cpu", "--probe", "--sizes", "-1"], "'-1'"),
        (["backends", "-b", "cpu", "--probe", "--repeat", "0", "--sizes", "1MiB"], "repeat"),
    ],
)
def test_bad_arguments_are_clear_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    if "cpu" in argv and not _cpu_available():
        pytest.skip("the cpu fake device is not available here")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("offcore backends: error:") and message in err


@needs_cpu
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-o", "foo=1"], "unknown option"),
        (["-o", "capacity=abc"], "capacity 'abc'"),
        (["-b", "cpu", "--probe", "--sizes", "1MiB", "-o", "h2d_bandwidth=0"], "h2d_bandwidth must be positive"),
        (["--json", "-b", "cpu", "-o", "capacity=1MiB", "-o", "latency=-1"], "latency"),
    ],
)
def test_device_options_a_backend_refuses_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["backends", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("offcore backends: error: backend ") and message in captured.err
    assert "refused -o " in captured.err
    assert captured.out == "", "no listing that shows the backend as fine"


@needs_cpu
def test_a_device_that_cannot_be_created_fails_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise offcore.BackendUnavailableError("the driver went away")

    monkeypatch.setattr(offcore, "device", broken)
    assert main(["backends", "-b", "cpu"]) == 1
    assert "creating the device failed: the driver went away" in capsys.readouterr().out


def test_probing_a_backend_asked_for_by_name_that_cannot_run_fails_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``offcore backends --probe -b cuda`` without a GPU measured nothing: exit 1 and say why (it exited 0 with
    an empty table); listing it without --probe, or probing every backend, still exits 0."""
    gone = types.SimpleNamespace(
        name="gone",
        availability=lambda: offcore.Availability(False, "no device here"),
        description="an accelerator that is not here",
        plugin="test",
    )
    monkeypatch.setattr(offcore, "backends", lambda: [gone])
    assert main(["backends", "--probe", "-b", "gone"]) == 1
    out = capsys.readouterr().out
    assert "gone: probe failed: not available, nothing measured: no device here" in out
    assert main(["backends", "-b", "gone"]) == 0
    assert main(["backends", "--probe"]) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("capacity=4GiB", ("capacity", "4GiB")),
        ("duplex=false", ("duplex", False)),
        ("sanitize=True", ("sanitize", True)),
        ("latency=0", ("latency", 0)),
        (" h2d_bandwidth = 8GiB/s ", ("h2d_bandwidth", "8GiB/s")),
    ],
)
def test_parse_option(text: str, expected: tuple[str, Any]) -> None:
    assert parse_option(text) == expected


def test_output_helpers() -> None:
    table = format_table(["a", "long header"], [["xyz", 1], ["q", None]])
    assert table.splitlines() == ["a    long header", "---  -----------", "xyz  1", "q"]
    assert format_rate(2**30) == "1.00" and format_rate(None) == "-" and format_rate(math.inf) == "-"


def test_python_dash_m_offcore_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "offcore", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and "backends" in done.stdout
