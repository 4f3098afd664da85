"""examples/numpy_mlp.py: a numpy training loop bound to the core scheduler trains bit-identically, without torch.

The example runs as a subprocess (as a user runs it) on a small model, with the fake
device's sanitizer on, so a missing wait or an early free would give NaNs or a recorded
violation. A wrapper checks that nothing on its path imported torch.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "numpy_mlp.py"
STEPS, LAYERS, WIDTH, BATCH = 3, 3, 128, 256
ACT_BYTES = WIDTH * BATCH * 4  # float32

# runs the example as __main__, then fails if torch was imported on the way
WRAPPER = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    code = exit.code
else:
    code = 0
if "torch" in sys.modules:
    print("TORCH IMPORTED", file=sys.stderr)
    code = 3
sys.exit(code)
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WRAPPER, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_numpy_example_trains_bit_identically_without_torch() -> None:
    proc = _run(
        "--steps", str(STEPS), "--layers", str(LAYERS), "--width", str(WIDTH), "--batch", str(BATCH), "--sanitize"
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr}"
    assert "TORCH IMPORTED" not in proc.stderr
    assert "bit-identical: losses and weights match" in out

    plain = re.search(r"final loss without offload: (\S+)", out)
    offloaded = re.search(r"final loss with offload: +(\S+)", out)
    assert plain and offloaded and plain.group(1) == offloaded.group(1)

    moved = re.search(r"bytes moved: d2h (\d+) h2d (\d+)", out)
    assert moved
    d2h, h2d = int(moved.group(1)), int(moved.group(2))
    assert d2h == STEPS * LAYERS * ACT_BYTES  # every saved activation went to the host once
    assert h2d % ACT_BYTES == 0  # whole activations came back

    peaks = re.search(r"peak device bytes: without offload (\d+) with offload (\d+)", out)
    assert peaks and int(peaks.group(2)) <= int(peaks.group(1))

    uses = re.search(r"prefetch hits (\d+) late prefetches (\d+) stalls (\d+) still on device (\d+)", out)
    assert uses
    hits, late, stalls, kept = map(int, uses.groups())
    assert hits + late + stalls + kept == STEPS * LAYERS  # every use of a saved activation is accounted once
    # each use that did not find its device copy reloaded it (an evicted prefetch moved bytes too)
    assert (hits + late + stalls) * ACT_BYTES <= h2d


def test_numpy_example_exits_nonzero_when_training_differs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    spec = importlib.util.spec_from_file_location("numpy_mlp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up
    spec.loader.exec_module(example)
    train = example.train_offloaded

    def diverging(dev, binding, params, data, lr):
        losses = train(dev, binding, params, data, lr)
        params[0][0][0, 0] += 1.0  # one weight off: the comparison must catch it
        return losses

    monkeypatch.setattr(example, "train_offloaded", diverging)
    code = example.main(["--steps", "1", "--layers", "2", "--width", "64", "--batch", "64"])
    assert code == 1
    assert "MISMATCH" in capsys.readouterr().err
