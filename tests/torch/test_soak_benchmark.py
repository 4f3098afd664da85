"""The soak benchmark runs end to end (``--quick``) and passes; its checks catch growth."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("soak_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # docs/testing.md, "Test budget": the soak end to end (~30 s); its step plan and checks run fast below
@pytest.mark.offcore_backend("cpu")
def test_quick_soak_passes_end_to_end() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "**PASS**" in done.stdout
    assert "FAIL" not in done.stdout.replace("PASS or FAIL", "")
    # both phases were checkpointed and compared, and the final comparison ran
    assert "| 20 | sanitized | compared |" in done.stdout
    assert "| 60 | plain | compared |" in done.stdout
    assert "parameters and AdamW state bit-identical to keep-all" in done.stdout


def test_step_kinds_and_quick_preset() -> None:
    soak = _load()
    args = soak.parse_args(["--quick", "--every", "5"])
    assert (args.steps, args.every, args.sanitize_steps, args.warmup) == (60, 5, 20, 5)  # explicit flags win
    kinds = [soak.step_kind(step, args) for step in range(28)]
    assert kinds[3] == kinds[7] == "abandon" and kinds[6] == kinds[13] == "raise"
    assert kinds[27] == "raise"  # both: raising wins
    assert kinds.count("full") == 28 - 4 - 6
    with pytest.raises(SystemExit):  # the sanitized phase would have one judged checkpoint: refused up front
        soak.parse_args(["--steps", "30", "--every", "10", "--sanitize-steps", "10", "--warmup", "5"])


def test_flat_checks_catch_growth() -> None:
    soak = _load()
    args = soak.parse_args([])
    base = {key: 0 for key in soak.EXACT} | {"phase": 2, "role": "compared", "objects": 100_000}
    rows = [{**base, "step": 50 * i, "rss": 400 * soak.MIB} for i in range(1, 4)]
    assert all(check.ok for check in soak.flat_checks(rows, 2, "plain", args))
    rows[-1] = {**rows[-1], "deferred": 1, "objects": 101_500, "rss": 430 * soak.MIB}
    failed = {check.label.split(" (")[0] for check in soak.flat_checks(rows, 2, "plain", args) if not check.ok}
    assert failed == {
        "plain: deferred exactly equal",
        "plain: live objects, growth < 1 %",
        "plain: RSS growth < 5 % or < 16 MiB",
    }
    assert not soak.flat_checks(rows[:1], 2, "plain", args)[0].ok  # one checkpoint is not a soak
