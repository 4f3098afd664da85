"""The one-call hardware check, end to end on the fake device (its cuda/npu paths need hardware).

What runs here: every phase of ``benchmarks/hw_check.py`` on ``--backend cpu`` (the
suites on a small stand-in suite with passing, failing, hanging and stuck tests), the
sweep sizes that crashed before (issue 16, item 1), the time budget, a run killed
part-way, and the torch-module paths of the sweep (raw baseline, spin-kernel gate) and
of the step variants on stand-ins.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "hw_check.py"
MiB, GiB = 1 << 20, 1 << 30

pytestmark = pytest.mark.offcore_backend("cpu")

STAND_IN_SUITE = """
import signal, time, pytest

def test_a_passes():
    pass

def test_b_fails():
    assert 1 == 2, "expected failure"

def test_c_skips():
    pytest.skip("not here")

@pytest.mark.xfail(reason="known")
def test_d_xfails():
    assert False

def test_e_hangs():  # SIGALRM fails it at the per-test time-out; the run goes on
    time.sleep(60)

def test_f_stuck():  # no signal gets through: the watchdog ends pytest, hw_check resumes
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)

def test_g_passes_after_the_restart():
    pass
"""


def load_hw_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hw_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hw_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hw_check() -> ModuleType:
    return load_hw_check()


def suite_dir(tmp_path: Path, source: str) -> Path:
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "test_stand_in.py").write_text(textwrap.dedent(source))
    return folder


def read_report(out: Path) -> dict[str, Any]:
    return json.loads((out / "hw_check.json").read_text())  # strict: no NaN/Infinity in the file


def test_every_phase_on_the_fake_device(
    hw_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--backend", "cpu", "--quick", "--repeats", "2", "--out", str(out), "--test-timeout", "1.5",
            "--suites", str(suite_dir(tmp_path, STAND_IN_SUITE))]  # fmt: skip
    rc = hw_check.main(argv)
    assert rc == 1, "a failing, a hanging and a stuck test: not green"
    report = read_report(out)
    assert report["finished"] is True and report["elapsed_s"] < report["budget_s"]
    assert list(report["phases"]) == ["suites", "sweep", "steps", "optimizer"]
    assert all(p["status"] == "ok" and p["seconds"] > 0 for p in report["phases"].values()), report["phases"]

    suites = report["suites"]
    assert suites["status"] == "complete" and suites["collected"] == 7 and suites["done"] == 7
    expected = {"passed": 2, "failed": 1, "skipped": 1, "xfailed": 1, "timeouts": 2, "errors": 0, "crashed": 0}
    assert {k: suites[k] for k in expected} == expected
    assert suites["restarts"] == 1 and suites["returncodes"] == [70, 0], "the stuck test ended pytest; it resumed"
    problems = {p["nodeid"].split("::")[1]: p for p in suites["problems"]}
    assert set(problems) == {"test_b_fails", "test_e_hangs", "test_f_stuck"}
    assert "TestTimedOut" in problems["test_e_hangs"]["message"]
    assert "SIGALRM does not reach" in problems["test_f_stuck"]["message"]

    assert [row["bytes"] for row in report["sweep"]] == [1 * MiB, 4 * MiB]
    for row in report["sweep"]:
        assert row["status"] == "ok" and row["offcore_h2d"] > 0 and row["offcore_d2h"] > 0
        assert row["pool_reserved_after_trim"] == 0 and row["host_pinned_after_trim"] == 0
    for result in report["step_time"]:
        variants = result["variants"]
        assert {"keep-all", "save_on_cpu", "offcore (deadline)"} <= set(variants)
        assert "CUDA-only" in variants["torchtune OffloadActivations"]["status"]
        ran = {k: v for k, v in variants.items() if "steps_run" in v}
        assert all(v["status"] == "ok" for v in ran.values()), variants
        assert variants["keep-all"]["ratio_to_keep_all"] == 1.0 and variants["keep-all"]["saved_bytes"] > 0
        offcore_row = variants["offcore (deadline)"]
        assert offcore_row["fallbacks"] == 0 and offcore_row["host_budget"] >= variants["keep-all"]["saved_bytes"]

    opt = report["optimizer"]
    assert opt["bit_identical_to_host"] is True
    variants = opt["variants"]
    assert "CUDA-only" in variants["torchao CPUOffloadOptimizer"]["status"]
    for name in ("device AdamW", "offcore OffloadOptimizer", "host AdamW (no offload)"):
        assert variants[name]["status"] == "ok" and variants[name]["step_s"] > 0, variants[name]
        assert variants[name]["peak_bytes"] > 0
    assert variants["offcore OffloadOptimizer"]["max_diff_to_host"] == 0.0
    assert variants["offcore OffloadOptimizer"]["max_diff_to_device"] is not None
    # no optimizer state on the device: offcore's peak is below the device optimizer's
    assert variants["offcore OffloadOptimizer"]["peak_bytes"] < variants["device AdamW"]["peak_bytes"]

    printed = capsys.readouterr().out
    for name in ("setup", "suites", "sweep", "steps", "optimizer"):
        assert f"phase {name}: " in printed, printed
    assert "hw_check total:" in printed
    md = (out / "hw_check.md").read_text()
    assert "## Suites" in md and "## Copy bandwidth" in md and "## Step time" in md and "unfinished" not in md
    assert "## Optimizer offload" in md


@pytest.mark.slow  # docs/testing.md, "Test budget": sweeps 64 MiB to 1 GiB (~70 s); the sweep and its pool give-back run fast in test_every_phase_on_the_fake_device
def test_the_sweep_sizes_that_crashed_now_run(hw_check: ModuleType, tmp_path: Path) -> None:
    """Issue 16, item 1: 64 MiB, 256 MiB, 1 GiB raised 'host pool budget exhausted' and wrote nothing."""
    _, available = hw_check.host_memory()
    if available < 10 * GiB:
        pytest.skip(f"needs ~6 GiB of host memory free ({available >> 20} MiB available)")
    out = tmp_path / "out"
    rc = hw_check.main(["--backend", "cpu", "--phases", "sweep", "--sizes", "64MiB,256MiB,1GiB", "--repeats", "1",
                        "--out", str(out)])  # fmt: skip
    assert rc == 0
    rows = read_report(out)["sweep"]
    assert [(r["bytes"], r["status"]) for r in rows] == [(64 * MiB, "ok"), (256 * MiB, "ok"), (1 * GiB, "ok")]
    assert [r["pool_freed_bytes"] for r in rows] == [128 * MiB, 512 * MiB, 2 * GiB], "each size's blocks go back"
    assert all(r["pool_reserved_after_trim"] == 0 and r["host_pinned_after_trim"] == 0 for r in rows)


def test_the_budget_cuts_what_would_not_fit(hw_check: ModuleType, tmp_path: Path) -> None:
    """A suite that would take a minute gets what the later phases leave; the run stays in its budget."""
    out = tmp_path / "out"
    sleepy = "import time\n\ndef test_sleeps():\n    time.sleep(60)\n"
    started = time.perf_counter()
    rc = hw_check.main(["--backend", "cpu", "--budget-s", "14", "--phases", "suites,sweep", "--test-timeout", "100",
                        "--suites", str(suite_dir(tmp_path, sleepy)), "--out", str(out)])  # fmt: skip
    elapsed = time.perf_counter() - started
    assert rc == 1 and elapsed < 14, elapsed
    report = read_report(out)
    suites = report["phases"]["suites"]
    assert suites["status"] == "cut" and suites["allotted_s"] < 9 and suites["seconds"] < suites["allotted_s"] + 4
    assert report["suites"]["not_run"] == 1 and report["suites"]["running"].endswith("test_sleeps")
    # the sweep gets what is left: its sizes run or are skipped by their estimate, never past the budget
    assert report["phases"]["sweep"]["status"] in ("ok", "cut") and report["finished"] is True
    assert report["sweep"] and all(r["status"] in ("ok", "skipped") for r in report["sweep"])


@pytest.mark.slow  # docs/testing.md, "Test budget": two pytest runs and a sweep (~20 s); a suite resumed after pytest ended runs fast in test_every_phase_on_the_fake_device
def test_suites_cut_by_their_allotment_resume_with_the_time_left_over(hw_check: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out"
    slow = "import time\n\n" + "".join(f"def test_{i}():\n    time.sleep(1.5)\n\n" for i in range(3))
    rc = hw_check.main(["--backend", "cpu", "--phases", "suites,sweep", "--suite-timeout", "2.5", "--repeats", "1",
                        "--suites", str(suite_dir(tmp_path, slow)), "--out", str(out)])  # fmt: skip
    report = read_report(out)
    assert list(report["phases"]) == ["suites", "sweep", "suites (resumed)"]
    assert report["phases"]["suites"]["status"] == "cut" and report["phases"]["suites (resumed)"]["status"] == "ok"
    suites = report["suites"]
    assert suites["status"] == "complete" and suites["passed"] == 3 and suites["collected"] == 3 and rc == 0
    assert len(suites["returncodes"]) == 2, "the cut pytest, then one that ran the tests not done"


def test_sweep_sizes_and_step_variants_that_would_not_fit_are_skipped(hw_check: ModuleType, tmp_path: Path) -> None:
    import offcore

    dev = offcore.device("cpu", capacity="1GiB")
    report = hw_check.Report(tmp_path, {"backend": "cpu", "device_name": "fake", "date": "-", "torch": "-",
                                        "python": "-", "budget_s": 1, "hardware_note": "-", "phases": {}},
                             hw_check.Budget(1, time.perf_counter()))  # fmt: skip
    model = hw_check.SweepModel(2e9, 2e9, 2e9, 2e9, raw=False, repeats=1)
    note = hw_check.sweep(report, dev, None, [1 * MiB, 4 * GiB], 1, model, time.perf_counter() + 2.0)
    rows = report.data["sweep"]
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "skipped" and "would not fit" in rows[1]["note"]
    assert note == "cut: 4.00 GiB"
    plan = hw_check.step_plan("cpu", True, [32])
    note = hw_check.step_times(report, dev, "cpu", plan, time.perf_counter() + 0.05, 1 << 30)
    variants = report.data["step_time"][0]["variants"]
    assert all("would not fit" in v["status"] for k, v in variants.items() if "torchtune" not in k), variants
    assert note.startswith("cut: keep-all @ 32")
    assert read_report(tmp_path)["step_time"][0]["seq_len"] == 32  # written as it went
    dev.close()


def test_a_size_that_fails_half_way_gives_its_pool_blocks_back(hw_check: ModuleType, tmp_path: Path) -> None:
    import offcore

    dev = offcore.device("cpu", fail_copy=1)  # the first copy_ raises at submission
    report = hw_check.Report(tmp_path, {"backend": "cpu", "device_name": "fake", "date": "-", "torch": "-",
                                        "python": "-", "budget_s": 60, "hardware_note": "-", "phases": {}},
                             hw_check.Budget(60, time.perf_counter()))  # fmt: skip
    model = hw_check.SweepModel(2e9, 2e9, 2e9, 2e9, raw=False, repeats=1)
    note = hw_check.sweep(report, dev, None, [1 * MiB, 4 * MiB], 1, model, time.perf_counter() + 30)
    rows = report.data["sweep"]
    assert rows[0]["status"] == "failed" and "InjectedFault" in rows[0]["note"] and rows[1]["status"] == "ok"
    assert all(r["pool_reserved_after_trim"] == 0 and r["host_pinned_after_trim"] == 0 for r in rows)
    assert note == "cut: 1.00 MiB"
    dev.close()


@pytest.mark.slow  # docs/testing.md, "Test budget": a subprocess killed part way (~16 s); the report written as it goes is checked fast by test_sweep_sizes_and_step_variants_that_would_not_fit_are_skipped
def test_a_run_killed_part_way_leaves_valid_partial_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sleepy = "import time\n\ndef test_sleeps():\n    time.sleep(60)\n"
    cmd = [sys.executable, str(SCRIPT), "--backend", "cpu", "--phases", "sweep,suites", "--repeats", "1",
           "--test-timeout", "100", "--suites", str(suite_dir(tmp_path, sleepy)), "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    report: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the sweep was reported and a suite test runs
            with contextlib.suppress(FileNotFoundError, ValueError):
                report = read_report(out)
                if report["phases"].get("sweep", {}).get("status") == "ok" and report.get("suites", {}).get("running"):
                    break
            assert proc.poll() is None, "hw_check ended before it could be killed"
            time.sleep(0.1)
        else:
            pytest.fail(f"the sweep was never reported: {report}")
        os.killpg(proc.pid, signal.SIGKILL)  # the way a time-out kills it: no handler runs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    report = read_report(out)  # valid JSON, never half a file
    assert report["finished"] is False
    assert report["phases"]["sweep"]["status"] == "ok" and report["phases"]["suites"]["status"] == "running"
    assert [r["status"] for r in report["sweep"]] == ["ok", "ok"] and report["sweep"][0]["offcore_h2d"] > 0
    assert "unfinished" in (out / "hw_check.md").read_text()
    assert not list(out.glob(".*.tmp")), "no temporary file left behind"
    # the orphaned pytest notices its parent is gone and exits (no test left holding the device)
    pytest_pid = report["suites"]["pids"][0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pytest_pid):
        time.sleep(0.1)
    assert not _alive(pytest_pid), "pytest outlived the killed hw_check"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


# ----------------------------------------------------------------- torch-module paths on stand-ins


class Clock:
    """Device time of a stand-in: copies take ``nbytes / rate``, a spin kernel its cycles / Hz."""

    def __init__(self) -> None:
        self.streams: dict[int, float] = {}
        self.copies: list[tuple[str, int]] = []
        self.sleeps: list[int] = []


class StandInEvent:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.at = clock, 0.0

    def record(self, stream: Any) -> None:
        self.at = self.clock.streams.get(id(stream), 0.0)

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: StandInEvent) -> float:
        return (end.at - self.at) * 1e3


class StandInModule:
    """The ``torch.cuda`` surface hw_check's sweep uses, with a device clock per stream."""

    def __init__(self, clock: Clock, rate: float, hz: float = 1e9) -> None:
        self.clock, self.rate, self.hz = clock, rate, hz
        self.current: Any = None

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Any:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def _sleep(self, cycles: int) -> None:
        self.clock.sleeps.append(cycles)
        self.clock.streams[id(self.current)] = self.clock.streams.get(id(self.current), 0.0) + cycles / self.hz

    def get_device_name(self, index: int) -> str:
        return "stand-in"


class StandInStream:
    def synchronize(self) -> None:
        pass


class StandInDevice:
    """Just enough of an offcore device for the sweep: CPU tensors as device memory, copies on the clock."""

    index = 0
    module: StandInModule

    @classmethod
    def device_module(cls) -> StandInModule:
        return cls.module

    def __init__(self) -> None:
        import offcore

        self.offcore = offcore
        self.pools: list[Any] = []

    def __enter__(self) -> StandInDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def new_stream(self) -> StandInStream:
        return StandInStream()

    def new_event(self, *, enable_timing: bool = False) -> StandInEvent:
        return StandInEvent(self.module.clock)

    def allocate(self, nbytes: int, tier: Any) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_pool(self, budget: int, *, pinned: bool = True) -> Any:
        from offcore.pool import HostBufferPool

        pool = HostBufferPool(lambda n: torch.empty(n, dtype=torch.uint8), budget=budget, block_size="1MiB")
        self.pools.append(pool)
        return pool

    def copy_(self, dst: Any, src: Any, *, stream: Any) -> StandInEvent:
        dst.copy_(src)
        self._advance(stream, dst.numel(), "offcore")
        return self.new_event()

    def _advance(self, stream: Any, nbytes: int, kind: str) -> None:
        clock = self.module.clock
        clock.copies.append((kind, nbytes))
        clock.streams[id(stream)] = clock.streams.get(id(stream), 0.0) + nbytes / self.module.rate

    def synchronize(self) -> None:
        pass

    def memory_stats(self) -> dict[str, int]:
        return {"free_bytes": 1 << 40}


def test_sweep_times_raw_and_offcore_copies_behind_a_spin_kernel(
    hw_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cuda path of the sweep on a stand-in module: the raw baseline is timed, every host buffer is
    written before it is read (item 5), copies are queued behind a calibrated gate (item 4)."""
    clock = Clock()
    rate = 10e9
    StandInDevice.module = StandInModule(clock, rate)
    dev = StandInDevice()
    assert hw_check.device_module(dev) is StandInDevice.module
    raw_copies: list[int] = []
    real_copy = torch.Tensor.copy_

    def counted_copy(self: Any, src: Any, non_blocking: bool = False) -> Any:
        current = StandInDevice.module.current
        if current is not None:  # a raw baseline copy inside mod.stream(...)
            assert non_blocking
            raw_copies.append(self.numel())
            dev._advance(current, self.numel(), "raw")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    gate = hw_check.Gate(dev, StandInDevice.module)
    assert gate.available and gate.cycles_per_s == pytest.approx(1e9)
    pool = dev.host_pool(8 * MiB)
    streams = dev.new_stream(), dev.new_stream()
    row = hw_check.sweep_one(dev, StandInDevice.module, gate, pool, streams, 1 * MiB, 3)
    monkeypatch.undo()
    for key in ("raw_pinned_h2d", "raw_pinned_d2h", "raw_pageable_h2d", "raw_pageable_d2h", "offcore_h2d",
                "offcore_d2h", "offcore_both_h2d", "offcore_both_d2h"):  # fmt: skip
        assert row[key] == pytest.approx(rate, rel=1e-6), (key, row)  # gate time excluded: the link's rate
    assert row["copies_per_timing"] == 64 and row["gate_held"].endswith("/15")
    # pinned copies: 64 back to back per timing (+1 warm-up), pageable ones one at a time
    assert raw_copies.count(1 * MiB) == 2 * (1 + 3 * 64) + 2 * (1 + 3)
    assert clock.sleeps and all(c > 0 for c in clock.sleeps)
    assert pool.used_bytes == 0


def test_pageable_baseline_reads_written_memory(hw_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16, item 5: the pageable source is filled before the first copy reads it."""
    clock = Clock()
    StandInDevice.module = StandInModule(clock, 1e9)
    dev = StandInDevice()
    sources: list[int] = []
    real_copy = torch.Tensor.copy_

    def watch(self: Any, src: Any, non_blocking: bool = False) -> Any:
        if StandInDevice.module.current is not None and not src.is_pinned():
            sources.append(int(src.min()))
        if StandInDevice.module.current is not None:
            dev._advance(StandInDevice.module.current, self.numel(), "raw")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", watch)
    gate = hw_check.Gate(dev, StandInDevice.module)
    hw_check.sweep_one(
        dev, StandInDevice.module, gate, dev.host_pool(8 * MiB), (StandInStream(), StandInStream()), 4096, 1
    )
    monkeypatch.undo()
    assert sources and min(sources) > 0, "every host source was written (no zero page) before it was read"


@pytest.mark.parametrize("backend", ["cuda", "npu"])
def test_save_on_cpu_pins_for_the_backend_it_runs_on(
    hw_check: ModuleType, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 16, item 6: without device_type save_on_cpu asks torch.cuda whether to pin, so on an NPU it pins
    nothing; torchtune's OffloadActivations is CUDA-only and the report says so."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", lambda **kw: calls.append(kw) or contextlib.nullcontext())
    plan = hw_check.step_plan(backend, True, None)
    makers = hw_check.variant_makers(object(), backend, plan, 1 << 30)
    makers["save_on_cpu"]()
    assert calls == [{"pin_memory": True, "device_type": backend}]
    torchtune = makers["torchtune OffloadActivations"]
    if backend == "npu":
        assert isinstance(torchtune, str) and "CUDA-only" in torchtune
    else:
        assert callable(torchtune) or "not importable" in torchtune
