"""benchmarks/hook_overhead.py's objects report: its worker measures every variant, the report covers every row."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "hook_overhead.py"

pytestmark = [pytest.mark.torch, pytest.mark.offcore_backend("cpu")]


def _load() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("hook_overhead_benchmark", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


@pytest.mark.slow  # two devices, an optimizer and nine steps: a few seconds
def test_the_worker_runs_every_variant_on_both_backends() -> None:
    bench = _load()
    worker = bench._Worker()
    for backend in bench.BACKENDS:
        for variant in bench.SAVE_VARIANTS:
            assert worker.save_step(backend, variant, 4, 1024) >= 0.0
    assert worker.save_steps("fake", "offcore", 4, 1024, 3) >= 0.0  # the median of three steps
    answer = worker.param_step("instant", 3)
    assert set(answer) == {"bare", "user"}


def test_arguments() -> None:
    bench = _load()
    args = bench.parse_args([])
    assert args.objects == [100, 400, 1600, 12800] and args.size_bytes == 16 << 10 and not args.sizes
    assert args.saves_per_round == 2000
    with pytest.raises(SystemExit):
        bench.parse_args(["--saves-per-round", "0"])
    assert bench.parse_args(["--sizes", "16KiB", "64KiB"]).size_bytes == [16 << 10, 64 << 10]
    with pytest.raises(SystemExit):
        bench.parse_args(["--compare-with", str(ROOT / "docs")])  # not a checkout of offcore


@pytest.mark.slow
def test_objects_report_compares_two_trees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load()
    out = tmp_path / "objects.json"
    argv = ["--objects", "4", "8", "--size", "1KiB", "--rounds", "1", "--warmup", "1", "--params", "3"]
    argv += ["--saves-per-round", "8"]  # two steps of 4 saves per round, one of 8
    assert bench.main([*argv, "--compare-with", str(ROOT), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trees"] == ["after (this tree)", "before (--compare-with)"]
    assert {(row["tree"], row["objects"]) for row in result["saves"]} == {
        (tree, n) for tree in result["trees"] for n in (4, 8)
    }
    assert set(result["saves"][0]["us_per_save"]) == {
        "offcore (fake)",
        "offcore, one by one (fake)",
        "save_on_cpu hooks (fake)",
        "copies only (fake)",
        "copies only, batched (fake)",
        "offcore (instant)",
        "offcore, one by one (instant)",
        "copies only (instant)",
        "copies only, batched (instant)",
        "fake device's emulation",
        "fake device's emulation, one by one",
        "offcore over the batched copies (fake)",
        "offcore over the batched copies (instant)",
        "offcore, one by one, over its copies (fake)",
        "offcore, one by one, over its copies (instant)",
    }
    assert {(row["tree"], row["backend"]) for row in result["params"]} == {
        (tree, backend) for tree in result["trees"] for backend in ("fake", "instant")
    }
    assert "after / before" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["fake", "instant"])
def test_the_batched_floor_copies_every_saved_storage_both_ways(backend: str) -> None:
    """BatchedCopiesOnly moves each new saved storage to its host buffer and back, a batch per copy call,
    and leaves the numbers keep-all's."""
    import torch

    bench = _load()
    worker = bench._Worker()
    device = worker.devices[backend]
    with device:
        x = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(device.torch_device).requires_grad_(True)
        hooks = bench.BatchedCopiesOnly(device, batch=4)
        with hooks:
            ys = [x * 1.0]
            for _ in range(9):  # sin saves its input: 9 saved storages, two full batches and one of 1
                ys.append(torch.sin(ys[-1]))
            loss = ys[-1].sum()
        device.synchronize()
        saved = [y.detach().clone() for y in ys[:9]]
        assert len(hooks._buffers) == 9
        host = [buffer.view(torch.float32) for buffer in hooks._buffers]
        assert all(
            torch.equal(h, s) for h, s in zip(host[:8], saved[:8], strict=True)
        )  # the full batches landed, each in its buffer
        assert len(hooks._open[0]) == 1  # the ninth save's batch is still open: not copied yet
        # what its fresh buffer holds now is not the data, but may equal it (memory a test before freed): a sentinel
        host[8].fill_(float("nan"))
        loss.backward()
        device.synchronize()
        grad = x.grad.clone()
        x.grad = None
        y = x * 1.0
        for _ in range(9):
            y = torch.sin(y)
        y.sum().backward()
        assert torch.equal(x.grad, grad)  # keep-all's gradient
        batches = {id(b): b for b in hooks._seen.values()}
        assert sorted(len(b[1]) for b in batches.values()) == [1, 4, 4]
        assert torch.equal(host[8], saved[8])  # the open batch went at backward's first unpack (after the fill)
        assert all(batch[2] and batch[0] is None for batch in batches.values())  # each brought back
        # the last one brought back (the first batch: backward runs in reverse) is still held: one device
        # buffer per storage, equal to its host copy
        restored, done = hooks._reloads[-1]
        done.synchronize()
        assert [r.numel() for r in restored] == [b.numel() for b in hooks._buffers[:4]]
        assert all(torch.equal(r.view(torch.float32), h) for r, h in zip(restored, host[:4], strict=True))
