"""A hardware check in one call, inside a time budget: suites, copy-bandwidth sweep, step time.

Run it on a machine with the backend (defaults: at most ``--budget-s 240`` seconds)::

    python benchmarks/hw_check.py --backend cuda --out hw-report

It writes ``hw_check.json`` and ``hw_check.md`` to ``--out`` after every phase, every
sweep size, every step-time variant and every few seconds of the suites (a temporary
file renamed over the old one), so a run that crashes, is killed or runs out of time
leaves the figures measured so far; ``"finished": false`` in the JSON marks such a run.
It prints one line per phase with its elapsed time (``phase sweep: ok, 21.4 s ...``).

Phases (``--phases``, default ``suites,sweep,steps``), each sized by an estimate before
it starts; what would not fit the time left (``--budget-s``) is cut and the report says
what and why:

1. **suites**: ``pytest tests/backends tests/torch --offcore-backend=B
   --offcore-require-backend`` in a subprocess with a per-test time-out
   (``--test-timeout``); outcomes stream into the report as tests finish. A test stuck
   past its time-out is recorded and pytest restarts without the tests already done.
   The phase gets the time the later phases' estimates leave (at most ``--suite-timeout``).
2. **sweep** (``--sizes``, 1 MiB - 4 GiB by default): device-event timings of a raw
   ``Tensor.copy_`` baseline on a side stream (pinned and pageable host memory) and of
   offcore's own ``copy_`` from its pinned pool; one direction at a time and both at
   once; median of ``--repeats``. Pinned copies are timed back to back (enough copies
   to move >= 64 MiB) behind a GPU spin kernel (``torch.cuda._sleep``) when the backend
   has one, so the start event fires only once every copy is queued: the host's work
   inside ``copy_`` is not timed. Pageable copies (host-synchronous) are timed one at a
   time with the start event recorded right before the copy. Every host buffer is
   written before it is read (a never-written buffer reads the kernel's zero page). The
   pool's idle blocks go back between sizes (``HostBufferPool.trim``).
3. **steps**: step time of a GPT-style model at two sequence lengths: keep-all (the
   baseline), ``torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=B)``,
   offcore (deadline prefetch, host budget sized to the run from the bytes keep-all's
   forward saved) and, on CUDA only, torchtune's ``OffloadActivations`` when it can be
   imported. Ratio to keep-all (median step), peak device memory, exposed wait,
   offcore's fallbacks (storages that did not fit its host budget) and its in-training
   copy throughput as a fraction of the sweep's raw pinned figure.

4. **optimizer**: a few training steps of an MLP (fp32, AdamW fused) with the optimizer on the
   device (torch's own: the reference for speed and memory), ``offcore_torch.OffloadOptimizer``
   (gradients D2H from their hooks, host steps under backward, ``accumulation_steps=1``), the same
   AdamW on host copies without offload (offcore must match it bit for bit), and, on CUDA when
   it imports, torchao's ``CPUOffloadOptimizer``. Median step time, device peak, and the largest
   difference of the final parameters to the device optimizer (reported: CPU and GPU AdamW kernels
   round differently) and to the host optimizer (must be 0).

``--backend cpu`` runs the same script on the fake device with small sizes and models,
which is how the script itself is tested without hardware. The cuda and npu paths are
written against torch's documented API and have **not yet been verified on hardware**.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the budget counts from here (importing torch included)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import offcore  # noqa: E402
from offcore.units import format_bytes, parse_size  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
PHASES = ("suites", "sweep", "steps", "optimizer")
FINAL_MARGIN_S = 5.0  # kept back from the budget for the last report write and close()
WATCHDOG_EXIT = 70  # _hw_check_pytest ended a stuck test
NOT_VERIFIED = "not yet verified on hardware"


# --------------------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"[hw_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def device_module(dev: Any) -> Any:
    """The torch device module behind ``dev`` (``torch.cuda`` / ``torch.npu`` / a stand-in); None for the fake device."""
    getter = getattr(type(dev), "device_module", None)
    return getter() if callable(getter) else None


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM (``/proc/meminfo``; sysconf elsewhere)."""
    try:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as None (strict JSON) and unknown objects as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def bandwidth(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds if seconds and seconds > 0 else None


# --------------------------------------------------------------------------- budget, report


class Budget:
    """Seconds left of ``total_s`` since ``started`` (a ``perf_counter`` time)."""

    def __init__(self, total_s: float, started: float) -> None:
        self.total_s = total_s
        self.started = started

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.total_s - FINAL_MARGIN_S - self.elapsed()


class Report:
    """The report dict, written as JSON and Markdown whenever a figure lands."""

    def __init__(self, out: Path, data: dict[str, Any], budget: Budget) -> None:
        self.out = out
        self.data = data
        self.budget = budget

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.budget.elapsed(), 2)
        # the Markdown first, the JSON last: a reader that sees a state in the JSON (and a kill after it)
        # finds the Markdown of that state already in place, with no temporary file of it pending
        write_atomic(self.out / "hw_check.md", markdown(self.data))
        write_atomic(self.out / "hw_check.json", json.dumps(json_safe(self.data), indent=2, allow_nan=False))


@contextlib.contextmanager
def phase(report: Report, name: str, estimate_s: float, allotted_s: float) -> Iterator[dict[str, Any]]:
    """Record a phase (status, seconds, estimate, allotment), write the report, print one line when it ends.

    The body sets ``info["status"]`` ("ok", "cut", "skipped") and ``info["note"]``; an
    exception marks the phase failed (with its traceback) and does not stop later phases.
    """
    info: dict[str, Any] = {"status": "running", "estimate_s": round(estimate_s, 1),
                            "allotted_s": round(allotted_s, 1), "note": ""}  # fmt: skip
    report.data["phases"][name] = info
    report.write()
    started = time.perf_counter()
    try:
        yield info
        if info["status"] == "running":
            info["status"] = "ok"
    except Exception as exc:  # a phase that fails must not cost the figures of the others
        info["status"] = "failed"
        info["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        info["traceback"] = traceback.format_exc()[-3000:]
        log(f"{name} failed:\n{info['traceback']}")
    finally:
        info["seconds"] = round(time.perf_counter() - started, 2)
        report.write()
        note = f" -- {info['note']}" if info["note"] else ""
        print(f"phase {name}: {info['status']}, {info['seconds']:.1f} s (estimate {estimate_s:.0f} s, "
              f"allotted {allotted_s:.0f} s){note}", flush=True)  # fmt: skip


# --------------------------------------------------------------------------- 1. suites


@dataclass
class SuiteRun:
    """Outcomes of the suite phase, gathered from the plugin's progress lines across pytest restarts."""

    command: str
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)  # node id -> (outcome, message)
    collected: int | None = None
    running: str | None = None
    restarts: int = 0
    status: str = "running"
    note: str = ""
    returncodes: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    offset: int = 0  # bytes of the progress file read so far
    log_tail: str = ""
    started: float = field(default_factory=time.perf_counter)

    def summary(self) -> dict[str, Any]:
        counts = {k: 0 for k in ("passed", "failed", "errors", "skipped", "xfailed", "xpassed", "timeouts", "crashed")}
        key = {"error": "errors", "timeout": "timeouts"}
        for outcome, _ in self.outcomes.values():
            name = key.get(outcome, outcome)
            counts[name] = counts.get(name, 0) + 1
        done = len(self.outcomes)
        problems = [
            {"nodeid": nodeid, "outcome": outcome, "message": message}
            for nodeid, (outcome, message) in self.outcomes.items()
            if outcome in ("failed", "error", "timeout", "crashed", "xpassed")
        ]
        return {
            "command": self.command,
            "status": self.status,
            "note": self.note,
            "collected": self.collected,
            "done": done,
            "not_run": max(0, self.collected - done) if self.collected is not None else None,
            "running": self.running,
            **counts,
            "restarts": self.restarts,
            "returncodes": self.returncodes,
            "pids": self.pids,
            "seconds": round(time.perf_counter() - self.started, 2),
            "problems": problems[:60],
            "log_tail": self.log_tail,
        }

    @property
    def green(self) -> bool:
        s = self.summary()
        bad = s["failed"] + s["errors"] + s["timeouts"] + s["crashed"] + s["xpassed"]
        return self.status == "complete" and bad == 0 and s["not_run"] == 0


def _read_progress(path: Path, offset: int, run: SuiteRun, base_collected: int) -> int:
    """Apply the complete progress lines after ``offset``; returns the new offset."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return offset
    end = chunk.rfind(b"\n") + 1  # a line being written stays for the next read
    for raw in chunk[:end].splitlines():
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        kind = event.get("event")
        if kind == "collected":
            run.collected = base_collected + int(event.get("count", 0))
            run.pids.append(int(event.get("pid", 0)))
        elif kind == "start":
            run.running = event.get("nodeid")
        elif kind == "done":
            run.outcomes[event["nodeid"]] = (event.get("outcome", "?"), str(event.get("message", ""))[-600:])
            if run.running == event["nodeid"]:
                run.running = None
    return offset + end


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the pytest process and its children (it runs in its own session)."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_suites(report: Report, backend: str, out: Path, paths: Sequence[str], test_timeout: float,
               allotted_s: float, max_restarts: int = 20, resume: SuiteRun | None = None) -> SuiteRun:  # fmt: skip
    """Run the suites in pytest subprocesses until done, or the allotment is spent; report as tests finish.

    ``resume``: a run that was cut, continued without the tests it finished.
    """
    progress, deselect, log_path = out / "suites.progress.jsonl", out / "suites.deselect.txt", out / "suites.log"
    if resume is None:
        for path in (progress, deselect):
            path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-p", "_hw_check_pytest",
           f"--offcore-backend={backend}", "--offcore-require-backend",
           f"--ignore={REPO / 'tests' / 'torch' / 'test_hw_check.py'}"]  # fmt: skip  # not this script's own tests
    env = dict(os.environ, HW_CHECK_PROGRESS=str(progress), HW_CHECK_DESELECT=str(deselect),
               HW_CHECK_TEST_TIMEOUT=str(test_timeout), HW_CHECK_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))  # fmt: skip
    run = resume or SuiteRun(command=shlex.join(cmd[1:]))
    if resume is not None:
        run.status, run.note, run.running = "running", "", None
        deselect.write_text("".join(f"{nodeid}\n" for nodeid in run.outcomes))
    deadline = time.perf_counter() + allotted_s
    report.data["suites"] = run.summary()
    with open(log_path, "ab") as log_file:
        while True:
            base = len(run.outcomes)
            log_file.write(f"\n===== {shlex.join(cmd)} (done before: {base})\n".encode())
            log_file.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            last_write, written = 0.0, None
            while proc.poll() is None:
                time.sleep(0.25)
                run.offset = _read_progress(progress, run.offset, run, base)
                if time.perf_counter() > deadline:
                    _kill_group(proc)
                    run.status, run.note = "cut", f"allotment of {allotted_s:.0f} s spent"
                    break
                now = (len(run.outcomes), run.running, run.collected)
                if now != written and time.perf_counter() - last_write > 1.0:  # progress, at most once a second
                    report.data["suites"] = run.summary()
                    report.write()
                    last_write, written = time.perf_counter(), now
            run.offset = _read_progress(progress, run.offset, run, base)
            rc = proc.wait()
            run.returncodes.append(rc)
            if run.status == "cut":
                break
            unfinished = run.running
            if unfinished is not None and unfinished not in run.outcomes:
                # the process died inside this test (crash, or the watchdog's record was lost)
                run.outcomes[unfinished] = ("crashed", f"pytest exited with {rc} while this test ran")
            run.running = None
            remaining = None if run.collected is None else run.collected - len(run.outcomes)
            if rc in (0, 1) or remaining == 0:
                run.status = "complete"
                break
            if rc in (2, 3, 4, 5) or remaining is None:  # interrupted, internal/usage error, nothing collected
                run.status, run.note = "error", f"pytest exited with {rc} ({remaining} tests left)"
                break
            if run.restarts >= max_restarts:
                run.status, run.note = "error", f"gave up after {run.restarts} restarts"
                break
            if time.perf_counter() > deadline - 5.0:
                run.status, run.note = "cut", f"allotment of {allotted_s:.0f} s spent"
                break
            run.restarts += 1
            deselect.write_text("".join(f"{nodeid}\n" for nodeid in run.outcomes))
            log(f"suites: pytest exited with {rc}; restarting without the {len(run.outcomes)} tests done")
    if run.status != "complete" or run.returncodes[-1:] not in ([0], [1]):
        with contextlib.suppress(OSError):
            run.log_tail = log_path.read_bytes()[-3000:].decode(errors="replace")
    report.data["suites"] = run.summary()
    return run


def suite_status(run: SuiteRun) -> tuple[str, str]:
    """(phase status, one-line note) of a suite run."""
    s = run.summary()
    note = (f"{s['passed']} passed, {s['failed']} failed, {s['errors']} errors, {s['timeouts']} timed out, "
            f"{s['crashed']} crashed, {s['skipped']} skipped, {s['not_run']} not run")  # fmt: skip
    return ("ok" if run.status == "complete" else run.status), note


# --------------------------------------------------------------------------- 2. bandwidth sweep


class Gate:
    """Holds streams behind a GPU spin kernel while copies are queued, so timing starts with the copies.

    On an idle stream a start event completes at once, and the host's work inside
    ``copy_`` before the copy is launched would be timed too. ``torch.cuda._sleep(cycles)``
    (calibrated here against timing events) keeps the stream busy while the host queues
    the copies; ``held`` says whether it lasted long enough (else the gate doubles).
    Backends without a spin kernel (NPU, the fake device) time back-to-back copies only.
    """

    def __init__(self, dev: Any, mod: Any) -> None:
        self.mod = mod
        self.sleep = getattr(mod, "_sleep", None) if mod is not None else None
        self.cycles_per_s: float | None = None
        self.seconds = 0.002
        if self.sleep is None:
            return
        try:
            stream = dev.new_stream()
            with mod.stream(stream):
                self.sleep(1000)  # load the kernel
            start, end = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
            cycles = 10_000_000
            start.record(stream)
            with mod.stream(stream):
                self.sleep(cycles)
            end.record(stream)
            end.synchronize()
            seconds = float(start.elapsed_time(end)) / 1e3
            self.cycles_per_s = cycles / seconds if seconds > 0 else None
        except Exception as exc:  # no gate: back-to-back timing still amortises the launch
            log(f"spin-kernel gate unavailable ({type(exc).__name__}: {exc})")
            self.cycles_per_s = None

    @property
    def available(self) -> bool:
        return self.cycles_per_s is not None

    def hold(self, streams: Sequence[Any]) -> None:
        if self.cycles_per_s is None:
            return
        cycles = int(self.seconds * self.cycles_per_s)
        for stream in streams:
            with self.mod.stream(stream):
                self.sleep(cycles)

    def prepare(self, host_s: float) -> None:
        """Make the gate outlast ``host_s`` of queueing (with room to spare), up to 0.1 s."""
        self.seconds = min(0.1, max(self.seconds, 1.5 * host_s))

    def queued(self, host_s: float) -> bool:
        """Whether the gate outlasted ``host_s`` of queueing (if not, the next gate is longer)."""
        if self.cycles_per_s is None:
            return False
        held = host_s < 0.8 * self.seconds
        if not held:
            self.seconds = min(0.1, max(2 * self.seconds, 2 * host_s))
        return held


def time_copies(dev: Any, gate: Gate | None, streams: Sequence[Any], enqueue: Callable[[], None],
                count: int) -> tuple[list[float], bool]:  # fmt: skip
    """Device seconds per copy on each of ``streams`` for ``count`` back-to-back calls of ``enqueue``.

    Returns (seconds per copy per stream, whether a gate held the streams until all were queued).
    """
    events = [(dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)) for _ in streams]
    if gate is not None:
        gate.hold(streams)
    for (start, _), stream in zip(events, streams, strict=True):
        start.record(stream)  # right before the copies (behind the gate, when there is one)
    queued = time.perf_counter()
    for _ in range(count):
        enqueue()
    host_s = time.perf_counter() - queued
    for (_, end), stream in zip(events, streams, strict=True):
        end.record(stream)
    for _, end in events:
        end.synchronize()
    held = gate.queued(host_s) if gate is not None else False
    return [float(start.elapsed_time(end)) / 1e3 / count for start, end in events], held


@dataclass
class SweepModel:
    """Seconds a sweep size is expected to take: a priori rates, corrected by the sizes measured."""

    pinned_bw: float
    pageable_bw: float
    fill_bw: float
    pin_bw: float
    raw: bool  # a raw torch baseline is measured (not on the fake device)
    repeats: int
    measured: list[tuple[int, float]] = field(default_factory=list)  # (size, seconds)

    def prior(self, size: int) -> float:
        count = copies_per_timing(size)
        pinned_timings = (4 if self.raw else 2) + 1  # one direction each (raw, offcore) + both at once
        pinned = self.repeats * (pinned_timings + 1) * count * size / self.pinned_bw
        pageable = self.repeats * 2 * size / self.pageable_bw if self.raw else 0.0
        prepare = 3 * size / self.fill_bw + 2 * size / self.pin_bw
        return 0.05 + pinned + pageable + prepare

    def estimate(self, size: int) -> float:
        if not self.measured:
            return self.prior(size)
        last_size, last_s = self.measured[-1]
        factor = min(10.0, max(0.3, last_s / self.prior(last_size)))
        return 1.2 * factor * self.prior(size)


def copies_per_timing(size: int) -> int:
    """Back-to-back copies per timing: enough to move >= 64 MiB, at most 64."""
    return max(1, min(64, -(-64 * MiB // size)))


def sweep(report: Report, dev: Any, mod: Any, sizes: list[int], repeats: int, model: SweepModel,
          deadline: float) -> str:  # fmt: skip
    """Measure every size that fits; returns a note on what was cut."""
    rows: list[dict[str, Any]] = report.data.setdefault("sweep", [])
    if not sizes:
        return "no sizes"
    pool = dev.host_pool(max(sizes) * 2 + 64 * MiB, pinned=True)
    streams = dev.new_stream(), dev.new_stream()
    gate = Gate(dev, mod)
    report.data["sweep_method"] = {
        "gate": "torch.cuda._sleep spin kernel" if gate.available else "none (back-to-back copies only)",
        "copies_per_timing": {format_bytes(s): copies_per_timing(s) for s in sizes},
        "repeats": repeats,
    }
    cut = []
    for size in sizes:
        estimate = model.estimate(size)
        left = deadline - time.perf_counter()
        reason = None
        if estimate > left:
            reason = f"would not fit: estimate {estimate:.1f} s, {left:.1f} s left"
        else:
            reason = memory_shortfall(dev, size)
        if reason is not None:
            log(f"sweep {format_bytes(size)} skipped: {reason}")
            rows.append({"bytes": size, "status": "skipped", "note": reason})
            cut.append(format_bytes(size))
            report.write()
            continue
        log(f"sweep {format_bytes(size)} (estimate {estimate:.1f} s)")
        started = time.perf_counter()
        try:
            row = sweep_one(dev, mod, gate, pool, streams, size, repeats)
        except Exception as exc:  # e.g. out of memory at one size: keep the others
            row = {"bytes": size, "status": "failed", "note": f"{type(exc).__name__}: {str(exc)[:300]}"}
            cut.append(format_bytes(size))
        gc.collect()
        row["pool_freed_bytes"] = pool.trim()  # idle blocks back before the next size (issue 16, item 1)
        row["pool_reserved_after_trim"] = pool.reserved_bytes
        with contextlib.suppress(Exception):
            row["host_pinned_after_trim"] = dev.memory_stats().get("pinned_bytes")
        row["seconds"] = round(time.perf_counter() - started, 3)
        row["estimate_s"] = round(estimate, 2)
        if row.get("status") == "ok":
            model.measured.append((size, row["seconds"]))
        rows.append(row)
        report.write()
    return f"cut: {', '.join(cut)}" if cut else ""


def memory_shortfall(dev: Any, size: int) -> str | None:
    """Why two device buffers and three host buffers of ``size`` would not fit, or None."""
    _, available = host_memory()
    if 3 * size > 0.8 * available:
        return f"host memory: needs {format_bytes(3 * size)}, {format_bytes(available)} available"
    try:
        free = dev.memory_stats().get("free_bytes")
    except Exception:
        free = None
    if free is not None and 2 * size + 64 * MiB > int(free):
        return f"device memory: needs {format_bytes(2 * size)}, {format_bytes(int(free))} free"
    return None


def sweep_one(dev: Any, mod: Any, gate: Gate, pool: Any, streams: tuple[Any, Any], size: int,
              repeats: int) -> dict[str, Any]:  # fmt: skip
    """Bandwidths (bytes/s) of one size: raw torch baseline, offcore, both directions at once."""
    with dev:
        device_in = dev.allocate(size, offcore.Tier.DEVICE)
        device_out = dev.allocate(size, offcore.Tier.DEVICE)
        device_in.fill_(0)
        device_out.fill_(0x3C)
    pinned_in = pool.acquire(size)
    try:
        pinned_out = pool.acquire(size)
    except BaseException:
        pool.release(pinned_in)
        raise
    try:
        return _measure_size(dev, mod, gate, streams, size, repeats, device_in, device_out, pinned_in, pinned_out)
    finally:  # a size that failed half-way must not keep its pool blocks from trim()
        with contextlib.suppress(Exception):
            dev.synchronize()
        pool.release(pinned_in)
        pool.release(pinned_out)


def _measure_size(dev: Any, mod: Any, gate: Gate, streams: tuple[Any, Any], size: int, repeats: int,
                  device_in: Any, device_out: Any, pinned_in: Any, pinned_out: Any) -> dict[str, Any]:  # fmt: skip
    s_h2d, s_d2h = streams
    pageable = torch.empty(size, dtype=torch.uint8)
    # written before they are read: a never-written page is the kernel's shared zero page,
    # which reads from cache and flatters the pageable baseline (issue 16, item 5)
    pageable.fill_(0xA5)
    pinned_in.view.fill_(0x5A)
    pinned_out.view.fill_(0)
    count = copies_per_timing(size)
    row: dict[str, Any] = {"bytes": size, "status": "ok", "copies_per_timing": count}
    held_all: list[bool] = []

    def median_bw(enqueue: Callable[[], None], stream: Any, n: int = count, gated: bool = True) -> float | None:
        queued = time.perf_counter()
        enqueue()  # one untimed copy first: first-use costs (lazy set-up, first touch) are not the link's
        if gated:
            gate.prepare(n * (time.perf_counter() - queued))
        stream.synchronize()
        seconds = []
        for _ in range(repeats):
            (per_copy,), held = time_copies(dev, gate if gated else None, (stream,), enqueue, n)
            seconds.append(per_copy)
            if gated:
                held_all.append(held)
        return bandwidth(size, statistics.median(seconds))

    def raw(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Callable[[], None]:
        def go() -> None:
            with mod.stream(stream):
                dst.copy_(src, non_blocking=True)

        return go

    if mod is not None:  # raw torch baseline: copy_ on a side stream, no offcore involved
        row["raw_pinned_h2d"] = median_bw(raw(device_in, pinned_in.view, s_h2d), s_h2d)
        row["raw_pinned_d2h"] = median_bw(raw(pinned_out.view, device_out, s_d2h), s_d2h)
        # pageable copies block the host, so a gate cannot hold them: one copy per timing, the
        # start event recorded right before it
        row["raw_pageable_h2d"] = median_bw(raw(device_in, pageable, s_h2d), s_h2d, n=1, gated=False)
        row["raw_pageable_d2h"] = median_bw(raw(pageable, device_out, s_d2h), s_d2h, n=1, gated=False)
    row["offcore_h2d"] = median_bw(lambda: dev.copy_(device_in, pinned_in.view, stream=s_h2d), s_h2d)
    row["offcore_d2h"] = median_bw(lambda: dev.copy_(pinned_out.view, device_out, stream=s_d2h), s_d2h)

    def both() -> None:
        dev.copy_(device_in, pinned_in.view, stream=s_h2d)
        dev.copy_(pinned_out.view, device_out, stream=s_d2h)

    both_h2d, both_d2h = [], []  # both directions at once, each timed on its own stream
    queued = time.perf_counter()
    both()
    gate.prepare(count * (time.perf_counter() - queued))
    dev.synchronize()
    for _ in range(repeats):
        (h2d, d2h), held = time_copies(dev, gate, (s_h2d, s_d2h), both, count)
        both_h2d.append(h2d)
        both_d2h.append(d2h)
        held_all.append(held)
    row["offcore_both_h2d"] = bandwidth(size, statistics.median(both_h2d))
    row["offcore_both_d2h"] = bandwidth(size, statistics.median(both_d2h))
    row["gate_held"] = f"{sum(held_all)}/{len(held_all)}" if gate.available else "no gate"
    return row  # the buffers die with the caller's frame, so its trim() frees their blocks


# --------------------------------------------------------------------------- 3. step time


VARIANT_ORDER = ("keep-all", "offcore (deadline)", "save_on_cpu", "torchtune OffloadActivations")


@dataclass
class StepPlan:
    cfg: dict[str, Any]
    batch: int
    seqs: list[int]
    steps: int
    warmup: int
    dtype: torch.dtype
    min_bytes: str
    flops_per_s: float  # a priori compute rate
    copy_bw: float  # a priori host<->device rate of offloaded bytes
    pin_bw: float  # a priori rate of pinning host memory (first step of an offloading variant)
    first_step_s: float  # a priori one-off cost of a model's first step (kernel loading, allocator warm-up)

    def tokens(self, seq: int) -> int:
        return self.batch * seq

    def flops(self, seq: int) -> float:
        d, layers, vocab = self.cfg["d_model"], self.cfg["n_layers"], self.cfg["vocab_size"]
        params = 12 * layers * d * d + vocab * d  # tied embeddings
        return 6.0 * params * self.tokens(seq) + 12.0 * layers * self.batch * seq * seq * d

    def saved_bytes(self, seq: int) -> float:
        """A priori bytes autograd saves per step (~40 per layer, token and channel at 2-byte dtypes)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = 20 * elem * self.cfg["n_layers"] * self.cfg["d_model"] + 3 * elem * self.cfg["vocab_size"]
        return float(self.tokens(seq) * per_token)

    def prior(self, seq: int, variant: str, steps: int | None = None) -> float:
        """A priori seconds of one variant at ``seq`` (warm-up and timed steps)."""
        n = (self.steps if steps is None else steps) + self.warmup
        compute = self.flops(seq) / self.flops_per_s + 0.01
        copies = 2 * self.saved_bytes(seq) / self.copy_bw
        pin = self.saved_bytes(seq) / self.pin_bw
        if variant == "keep-all":
            return n * compute + self.first_step_s
        if variant == "save_on_cpu":  # synchronous copies
            return n * (compute + copies) + pin + self.first_step_s
        return n * max(compute, copies) * 1.3 + pin + self.first_step_s


def step_plan(backend: str, quick: bool, seqs: list[int] | None) -> StepPlan:
    if quick or backend == "cpu":
        cfg = {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 128, "dropout": 0.0}
        plan = StepPlan(cfg, 2, [32, 64], 2, 1, torch.float32, "4KiB", 2e9, 2e9, 2e9, 0.2)
    else:
        cfg = {"d_model": 2048, "n_heads": 16, "n_layers": 8, "vocab_size": 32000, "dropout": 0.0}
        plan = StepPlan(cfg, 4, [2048, 8192], 4, 2, torch.bfloat16, "1MiB", 150e12, 20e9, 5e9, 2.0)
    if seqs:
        plan.seqs = seqs
    return plan


@contextlib.contextmanager
def torchtune_offload() -> Iterator[Any]:
    from torchtune.training import OffloadActivations  # type: ignore[import-not-found]

    with OffloadActivations(use_streams=True) as ctx:
        yield ctx


def variant_makers(dev: Any, backend: str, plan: StepPlan, host_budget: int) -> dict[str, Any]:
    """Name -> context-manager factory, or a string saying why the variant does not apply here."""
    import offcore_torch

    pin = backend in ("cuda", "npu")
    variants: dict[str, Any] = {"keep-all": contextlib.nullcontext}
    variants["offcore (deadline)"] = lambda: offcore_torch.offload_activations(
        dev, min_bytes=plan.min_bytes, prefetch="deadline", host_budget=host_budget
    )
    if pin:  # device_type: without it save_on_cpu checks torch.cuda and pins nothing on an NPU (item 6)
        variants["save_on_cpu"] = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=backend)
    else:
        variants["save_on_cpu"] = lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)
    if backend != "cuda":
        variants["torchtune OffloadActivations"] = (
            "n/a: torchtune's OffloadActivations is CUDA-only (torch.cuda streams)"
        )
    else:
        try:
            import torchtune.training  # noqa: F401  # type: ignore[import-not-found]

            variants["torchtune OffloadActivations"] = torchtune_offload
        except Exception as exc:  # optional; say why it is missing
            variants["torchtune OffloadActivations"] = f"n/a: torchtune not importable ({type(exc).__name__}: {exc})"
    return variants


def applicable_variants(backend: str) -> list[str]:
    """The variants that can run on ``backend`` here (torchtune's only on CUDA, when installed)."""
    names = list(VARIANT_ORDER[:3])
    if backend == "cuda" and importlib.util.find_spec("torchtune") is not None:
        names.append(VARIANT_ORDER[3])
    return names


def free_host_caches(dev: Any, backend: str) -> None:
    """Give back pinned memory the last variant left cached (offcore's pools, torch's caching host allocator)."""
    import offcore_torch
    from offcore_torch.runtime import runtime_for

    offcore_torch.synchronize(dev)
    for pool in runtime_for(dev).pools:
        pool.trim()
    gc.collect()
    if backend == "cuda":
        empty = getattr(torch._C, "_host_emptyCache", None)  # torch's pinned-memory cache (private API)
        if empty is not None:
            empty()
        torch.cuda.empty_cache()


class SavedBytes:
    """Unique storage bytes autograd saves in a forward, parameters excluded (what offloading could move)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params:
            self.seen[ptr] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def run_variant(dev: Any, work: Any, plan: StepPlan, make: Callable[[], Any], deadline: float,
                measure_saved: bool) -> dict[str, Any]:  # fmt: skip
    tdev = torch.device(dev.torch_device)
    times: list[float] = []
    peaks: list[int] = []
    result: dict[str, Any] = {"status": "ok", "steps_run": 0}
    handle_stats: list[Any] = []
    saved: SavedBytes | None = None
    last_step = 0.0
    with dev:
        model = work.build(0).to(tdev, dtype=plan.dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        try:
            for step in range(plan.warmup + plan.steps):
                if step and time.perf_counter() + 1.1 * last_step > deadline:
                    result["status"] = "cut"
                    result["note"] = f"time allotment spent after {step} steps ({plan.warmup} warm-up)"
                    break
                batch_t = work.make_batch(step, tdev)
                dev.synchronize()
                dev.reset_peak_memory_stats()
                count = measure_saved and step == 0
                if count:
                    saved = SavedBytes(model)
                start = time.perf_counter()
                with make() as handle:
                    hooks = (
                        torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
                        if count and saved is not None
                        else contextlib.nullcontext()
                    )
                    with hooks:
                        loss = work.loss(model, batch_t)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                dev.synchronize()
                last_step = time.perf_counter() - start
                result["steps_run"] = step + 1
                if step >= plan.warmup:
                    times.append(last_step)
                    peaks.append(dev.memory_stats().peak_allocated_bytes)
                    if handle is not None and hasattr(handle, "stats"):
                        handle_stats.append(handle.stats())
                del loss, batch_t
        except Exception as exc:  # an OOM in one variant must not stop the others
            result["status"] = "failed"
            result["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            del model, opt
    result["step_s"] = statistics.median(times) if times else None
    result["step_times_s"] = [round(t, 4) for t in times]
    result["peak_bytes"] = max(peaks) if peaks else None
    if saved is not None:
        result["saved_bytes"] = saved.total
    if handle_stats:
        result["exposed_wait_s"] = statistics.median(float(s.exposed_wait_s) for s in handle_stats)
        result["d2h_bandwidth"] = statistics.median(float(s.d2h_bandwidth or 0.0) for s in handle_stats) or None
        result["h2d_bandwidth"] = statistics.median(float(s.h2d_bandwidth or 0.0) for s in handle_stats) or None
        result["fallbacks"] = max(int(s.fallbacks) for s in handle_stats)
        result["offloaded_bytes"] = max(int(s.offloaded_bytes) for s in handle_stats)
        result["peak_pinned_bytes"] = max(int(s.peak_pinned_bytes) for s in handle_stats)
    if result["status"] == "ok" and not times:
        result["status"] = "cut"
    return result


def step_times(report: Report, dev: Any, backend: str, plan: StepPlan, deadline: float,
               host_limit: int) -> str:  # fmt: skip
    """Every (sequence length, variant) that fits, each given its share of the time left."""
    from offcore_torch.models import GPTConfig, gpt_workload

    results: list[dict[str, Any]] = report.data.setdefault("step_time", [])
    corrections: dict[str, float] = {}  # measured / a priori seconds, per variant (from the last seq)
    cut: list[str] = []
    applicable = applicable_variants(backend)
    units = [(seq, name) for seq in plan.seqs for name in applicable]

    def estimate(seq: int, name: str) -> float:
        factor = corrections.get(name, corrections.get("keep-all", 1.0))
        return factor * plan.prior(seq, name)

    for seq in plan.seqs:
        cfg = GPTConfig(seq_len=seq, **plan.cfg)
        work = gpt_workload(cfg, batch_size=plan.batch)
        res: dict[str, Any] = {"seq_len": seq, "batch": plan.batch, "dtype": str(plan.dtype).replace("torch.", ""),
                               "config": cfg.__dict__, "variants": {}}  # fmt: skip
        results.append(res)
        saved_estimate = int(plan.saved_bytes(seq))
        host_budget = min(host_limit, int(saved_estimate * 1.25) + 256 * MiB)
        for name in VARIANT_ORDER:
            if name in applicable:
                units.pop(0)
            if name == "offcore (deadline)":
                measured = res["variants"].get("keep-all", {}).get("saved_bytes")
                # size the host budget to what this run saves (item 3), within the machine's RAM
                host_budget = min(host_limit, int((measured or saved_estimate) * 1.25) + 256 * MiB)
            make = variant_makers(dev, backend, plan, host_budget)[name]
            if isinstance(make, str):
                res["variants"][name] = {"status": make}
                report.write()
                continue
            left = deadline - time.perf_counter()
            mine = estimate(seq, name)
            rest = sum(estimate(s, n) for s, n in units)
            allotment = left - rest if mine + rest <= left else left * mine / (mine + rest)
            minimum = estimate(seq, name) * (plan.warmup + 1) / (plan.warmup + plan.steps)
            if minimum > allotment:
                note = (
                    f"skipped: would not fit (estimate {minimum:.1f} s for one timed step, {allotment:.1f} s allotted)"
                )
                res["variants"][name] = {"status": note}
                cut.append(f"{name} @ {seq}")
                report.write()
                continue
            log(f"step time seq={seq} {name} (estimate {mine:.1f} s, allotted {allotment:.1f} s)")
            started = time.perf_counter()
            v = run_variant(dev, work, plan, make, time.perf_counter() + allotment, name == "keep-all")
            v["seconds"] = round(time.perf_counter() - started, 2)
            v["estimate_s"] = round(mine, 2)
            if name == "offcore (deadline)":
                v["host_budget"] = host_budget
            if v["status"] == "cut":
                cut.append(f"{name} @ {seq} ({v['steps_run']} steps)")
            if v["steps_run"]:
                per_step = v["seconds"] / v["steps_run"]
                corrections[name] = min(20.0, max(0.05, per_step * (plan.warmup + plan.steps) / plan.prior(seq, name)))
            res["variants"][name] = v
            with contextlib.suppress(Exception):
                free_host_caches(dev, backend)
            report.write()
        keep = res["variants"].get("keep-all", {}).get("step_s")
        for row in res["variants"].values():
            row["ratio_to_keep_all"] = row["step_s"] / keep if keep and row.get("step_s") else None
        report.write()
    return f"cut: {'; '.join(cut)}" if cut else ""


# --------------------------------------------------------------------------- 4. optimizer


class HostOptimizer:
    """The same optimizer class on host copies of the parameters, no offload: what offcore must reproduce."""

    def __init__(self, params: list[torch.nn.Parameter], cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.params = params
        self.masters = [p.detach().to("cpu", copy=True) for p in params]
        self.opt = cls(self.masters, **kwargs)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is not None:
                m.grad = p.grad.to("cpu", copy=True)
                p.grad = None
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def optimizer_variants(dev: Any, backend: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name -> (model -> optimizer), or a string saying why the variant does not apply here."""
    import offcore_torch

    variants: dict[str, Any] = {
        "device AdamW": lambda m: torch.optim.AdamW(m.parameters(), **kwargs),
        "offcore OffloadOptimizer": lambda m: offcore_torch.OffloadOptimizer(
            m.parameters(), torch.optim.AdamW, device=dev, accumulation_steps=1, **kwargs
        ),
        "host AdamW (no offload)": lambda m: HostOptimizer(list(m.parameters()), torch.optim.AdamW, **kwargs),
    }
    if backend != "cuda":
        variants["torchao CPUOffloadOptimizer"] = "n/a: torchao's CPUOffloadOptimizer is CUDA-only"
    else:
        try:
            from torchao.optim import CPUOffloadOptimizer  # type: ignore[import-not-found]

            variants["torchao CPUOffloadOptimizer"] = lambda m: CPUOffloadOptimizer(
                m.parameters(), torch.optim.AdamW, offload_gradients=True, **kwargs
            )
        except Exception as exc:  # optional; say why it is missing
            variants["torchao CPUOffloadOptimizer"] = f"n/a: torchao not importable ({type(exc).__name__}: {exc})"
    return variants


def optimizer_check(report: Report, dev: Any, backend: str, quick: bool, deadline: float) -> str:
    """Step time, device peak and final-parameter differences of the optimizer variants (returns a note)."""
    from offcore_torch.models import mlp_workload

    width, depth, batch, steps, warmup = (64, 2, 16, 3, 1) if quick else (2048, 8, 512, 5, 2)
    work = mlp_workload(d_in=width, width=width, depth=depth, d_out=width, batch_size=batch)
    kwargs = {"lr": 1e-3, "weight_decay": 0.01, "fused": True}
    tdev = torch.device(dev.torch_device)
    res: dict[str, Any] = {"model": f"MLP width {width} depth {depth} batch {batch}, fp32", "steps": steps,
                           "warmup": warmup, "optimizer": "AdamW(fused=True, lr=1e-3, weight_decay=0.01)",
                           "variants": {}}  # fmt: skip
    report.data["optimizer"] = res
    finals: dict[str, list[torch.Tensor]] = {}
    cut: list[str] = []
    for name, make in optimizer_variants(dev, backend, kwargs).items():
        if isinstance(make, str):
            res["variants"][name] = {"status": make}
            report.write()
            continue
        if time.perf_counter() > deadline:
            res["variants"][name] = {"status": "skipped: the phase's time is spent"}
            cut.append(name)
            continue
        row: dict[str, Any] = {"status": "ok", "steps_run": 0}
        times: list[float] = []
        peaks: list[int] = []
        log(f"optimizer: {name}")
        with dev:
            model = work.build(0)
            model = dev.adopt(model) if backend == "cpu" else model.to(tdev)
            opt = None
            try:
                opt = make(model)
                for step in range(warmup + steps):
                    if step and time.perf_counter() > deadline:
                        row["status"], row["note"] = "cut", f"time spent after {step} steps"
                        cut.append(name)
                        break
                    batch_t = work.make_batch(step, tdev)
                    dev.synchronize()
                    dev.reset_peak_memory_stats()
                    began = time.perf_counter()
                    work.loss(model, batch_t).backward()
                    opt.step()
                    opt.zero_grad()
                    if hasattr(opt, "synchronize"):
                        opt.synchronize()
                    dev.synchronize()
                    row["steps_run"] = step + 1
                    if step >= warmup:
                        times.append(time.perf_counter() - began)
                        peaks.append(dev.memory_stats().peak_allocated_bytes)
                    del batch_t
                if row["steps_run"] == warmup + steps:
                    finals[name] = [p.detach().to("cpu", copy=True) for p in model.parameters()]
            except Exception as exc:  # one variant failing must not cost the others
                row["status"], row["note"] = "failed", f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                close = getattr(opt, "close", None)
                if close is not None:
                    with contextlib.suppress(Exception):
                        close()
                del model, opt
        row["step_s"] = statistics.median(times) if times else None
        row["peak_bytes"] = max(peaks) if peaks else None
        res["variants"][name] = row
        with contextlib.suppress(Exception):
            free_host_caches(dev, backend)
        report.write()

    def max_diff(a: str, b: str) -> float | None:
        if a not in finals or b not in finals:
            return None
        return max(float((x.double() - y.double()).abs().max()) for x, y in zip(finals[a], finals[b], strict=True))

    base = res["variants"].get("device AdamW", {}).get("step_s")
    for name, row in res["variants"].items():
        row["ratio_to_device"] = row["step_s"] / base if base and row.get("step_s") else None
        row["max_diff_to_device"] = max_diff(name, "device AdamW")
        row["max_diff_to_host"] = max_diff(name, "host AdamW (no offload)")
    off = "offcore OffloadOptimizer"
    res["bit_identical_to_host"] = (
        all(torch.equal(x, y) for x, y in zip(finals[off], finals["host AdamW (no offload)"], strict=True))
        if off in finals and "host AdamW (no offload)" in finals
        else None
    )
    report.write()
    if res["bit_identical_to_host"] is False:
        return f"not bit-identical to the host AdamW (max difference {res['variants'][off]['max_diff_to_host']})"
    return f"cut: {'; '.join(cut)}" if cut else ""


# --------------------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    gbs = lambda v: "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v / 1e9:.1f}"  # noqa: E731
    done = "" if report.get("finished") else " -- **unfinished** (partial figures)"
    lines = [f"# offcore hardware check: {report['backend']} ({report['device_name']}){done}", "",
             f"{report['date']}, torch {report['torch']}, python {report['python']}, "
             f"{report.get('elapsed_s', 0):.0f} s of a {report['budget_s']:.0f} s budget. "
             f"The {report['backend']} paths are {report['hardware_note']}.", ""]  # fmt: skip
    if report.get("phases"):
        lines += ["| phase | status | seconds | estimate | allotted | note |", "|---|---|---|---|---|---|"]
        for name, p in report["phases"].items():
            seconds = f"{p['seconds']:.1f}" if "seconds" in p else "-"
            lines.append(f"| {name} | {p['status']} | {seconds} | {p['estimate_s']:.0f} | {p['allotted_s']:.0f} | "
                         f"{p.get('note', '')} |")  # fmt: skip
        lines.append("")
    s = report.get("suites")
    if s:
        lines += ["## Suites", "", f"`{s['command']}`: **{s['status']}** -- {s['passed']} passed, {s['failed']} failed, "
                  f"{s['errors']} errors, {s['timeouts']} timed out, {s['crashed']} crashed, {s['skipped']} skipped, "
                  f"{s['xfailed']} xfailed, {s['xpassed']} xpassed; {s['done']} of {s['collected']} done, "
                  f"{s['restarts']} restarts, {s['seconds']:.0f} s{' (' + s['note'] + ')' if s['note'] else ''}", ""]  # fmt: skip
        if s.get("running"):
            lines += [f"Running when this was written: `{s['running']}`", ""]
        for p in s.get("problems", [])[:20]:
            message = " ".join(p["message"].split())[-200:]
            lines.append(f"- {p['outcome']}: `{p['nodeid']}` {message}")
        lines.append("")
    if report.get("sweep"):
        method = report.get("sweep_method", {})
        lines += ["## Copy bandwidth (GB/s, median)", "",
                  f"Device events around back-to-back copies (gate: {method.get('gate', '?')}); pageable copies "
                  "one at a time.", "",
                  "| size | raw pinned H2D | raw pinned D2H | raw pageable H2D | raw pageable D2H | offcore H2D | "
                  "offcore D2H | both: H2D | both: D2H | gate held | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in report["sweep"]:
            if r.get("status") != "ok":
                lines.append(f"| {format_bytes(r['bytes'])} | {r.get('status')}: {r.get('note', '')} ||||||||||")
                continue
            lines.append(f"| {format_bytes(r['bytes'])} | {gbs(r.get('raw_pinned_h2d'))} | {gbs(r.get('raw_pinned_d2h'))} | "
                         f"{gbs(r.get('raw_pageable_h2d'))} | {gbs(r.get('raw_pageable_d2h'))} | {gbs(r.get('offcore_h2d'))} | "
                         f"{gbs(r.get('offcore_d2h'))} | {gbs(r.get('offcore_both_h2d'))} | {gbs(r.get('offcore_both_d2h'))} | "
                         f"{r.get('gate_held', '-')} | {r.get('seconds', 0):.1f} |")  # fmt: skip
        lines.append("")
    if report.get("setup_error"):
        lines += ["## Setup failed", "", f"`{report['setup_error']}`", ""]
    for res in report.get("step_time", []):
        lines += [f"## Step time, GPT-style, seq {res['seq_len']}, batch {res['batch']}, {res['dtype']} "
                  "(baseline: keep-all)", "",
                  "| variant | status | steps | step (ms) | ratio | peak device | saved / offloaded | host budget | "
                  "fallbacks | exposed wait (ms) | copy D2H / H2D GB/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, v in res["variants"].items():
            if "steps_run" not in v:
                lines.append(f"| {name} | {v['status']} |||||||||")
                continue
            ms = f"{v['step_s'] * 1e3:.1f}" if v.get("step_s") else "-"
            ratio = f"{v['ratio_to_keep_all']:.3f}" if v.get("ratio_to_keep_all") else "-"
            peak = format_bytes(v["peak_bytes"]) if v.get("peak_bytes") is not None else "-"
            moved = v.get("saved_bytes", v.get("offloaded_bytes"))
            moved_s = format_bytes(moved) if moved is not None else "-"
            budget = format_bytes(v["host_budget"]) if v.get("host_budget") else "-"
            fallbacks = v.get("fallbacks", "-")
            wait = f"{v['exposed_wait_s'] * 1e3:.2f}" if v.get("exposed_wait_s") is not None else "-"
            bw = f"{gbs(v.get('d2h_bandwidth'))} / {gbs(v.get('h2d_bandwidth'))}" if v.get("d2h_bandwidth") else "-"
            status = v["status"] + (f" ({v['note']})" if v.get("note") else "")
            lines.append(f"| {name} | {status} | {v['steps_run']} | {ms} | {ratio} | {peak} | {moved_s} | {budget} | "
                         f"{fallbacks} | {wait} | {bw} |")  # fmt: skip
        lines += ["", "offcore's copy figures come from its runtime's own copy timings; the adapter records their "
                  "start event right before the transfer (`copy_(..., start_event=...)`), after its host-side work.", ""]  # fmt: skip
    opt = report.get("optimizer")
    if opt:
        same = {True: "yes", False: "**NO**", None: "not measured"}[opt.get("bit_identical_to_host")]
        lines += [f"## Optimizer offload, {opt['model']}, {opt['optimizer']} (baseline: device AdamW)", "",
                  f"offcore bit-identical to the same AdamW on host copies: {same}.", "",
                  "| variant | status | steps | step (ms) | ratio | peak device | max diff to device | "
                  "max diff to host |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, v in opt["variants"].items():
            if "steps_run" not in v:
                lines.append(f"| {name} | {v['status']} |||||||")
                continue
            ms = f"{v['step_s'] * 1e3:.1f}" if v.get("step_s") else "-"
            ratio = f"{v['ratio_to_device']:.3f}" if v.get("ratio_to_device") else "-"
            peak = format_bytes(v["peak_bytes"]) if v.get("peak_bytes") is not None else "-"
            fmt = lambda d: "-" if d is None else f"{d:.3g}"  # noqa: E731
            status = v["status"] + (f" ({v['note']})" if v.get("note") else "")
            lines.append(f"| {name} | {status} | {v['steps_run']} | {ms} | {ratio} | {peak} | "
                         f"{fmt(v.get('max_diff_to_device'))} | {fmt(v.get('max_diff_to_host'))} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", help="cuda, npu or cpu (fake device, for testing the script)")
    parser.add_argument("--out", default="hw-report", help="output folder for hw_check.json / hw_check.md")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of the whole run (seconds)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="phases to run, in order (suites,sweep,steps,optimizer)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes and models (script self-test)")
    parser.add_argument("--skip-suites", action="store_true", help="do not run the pytest suites")
    parser.add_argument("--suites", default="tests/backends tests/torch", help="pytest paths of the suite phase")
    parser.add_argument("--suite-timeout", type=float, default=None,
                        help="most seconds the suites may take (default: what the later phases leave)")  # fmt: skip
    parser.add_argument("--test-timeout", type=float, default=30.0, help="seconds allowed per test")
    parser.add_argument("--sizes", default=None, help="comma-separated sweep sizes (default 1MiB..4GiB)")
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths of the step-time phase")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host-limit", default=None,
                        help="most pinned host bytes offcore's step-time pool may hold (default: half the RAM)")  # fmt: skip
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    if args.skip_suites:
        phases = [p for p in phases if p != "suites"]
    args.phase_list = phases
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # run as a script, the budget counts from the first line (importing torch included)
    budget = Budget(args.budget_s, START if argv is None else time.perf_counter())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = args.quick or args.backend == "cpu"
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    elif quick:
        sizes = [1 * MiB, 4 * MiB]
    else:
        sizes = [1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB, 4 * GiB]
    plan = step_plan(args.backend, args.quick, [int(s) for s in args.seqs.split(",")] if args.seqs else None)
    total_ram, _ = host_memory()
    host_limit = parse_size(args.host_limit) if args.host_limit else total_ram // 2

    report = Report(out, {
        "backend": args.backend, "device_name": "?", "finished": False, "budget_s": args.budget_s,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
        "python": platform.python_version(), "host_ram_bytes": total_ram,
        "hardware_note": "the fake device" if args.backend == "cpu" else NOT_VERIFIED,
        "argv": sys.argv[1:] if argv is None else argv, "phases": {},
    }, budget)  # fmt: skip
    report.write()

    started = time.perf_counter()
    options: dict[str, Any] = {}
    if args.backend == "cpu":
        options = {"capacity": "4GiB", "h2d_bandwidth": "16GiB/s", "d2h_bandwidth": "16GiB/s"}
    try:
        dev = offcore.device(args.backend, **options)
    except Exception as exc:  # no device, no figures: say why in the report, not only in a traceback
        report.data["setup_error"] = f"{type(exc).__name__}: {exc}"
        report.data["finished"] = True
        report.write()
        print(f"phase setup: failed, {budget.elapsed():.1f} s -- {report.data['setup_error']}", flush=True)
        return 1
    mod = device_module(dev)
    report.data["device_name"] = mod.get_device_name(dev.index) if mod is not None else "offcore CPU fake device"
    report.data["setup_s"] = round(time.perf_counter() - started, 2)
    print(f"phase setup: ok, {budget.elapsed():.1f} s since start (import, device)", flush=True)
    report.write()

    raw = mod is not None
    sweep_model = SweepModel(pinned_bw=20e9 if raw else 2e9, pageable_bw=4e9 if raw else 2e9, fill_bw=3e9,
                             pin_bw=4e9, raw=raw, repeats=args.repeats)  # fmt: skip
    estimates = {
        "suites": args.suite_timeout if args.suite_timeout is not None else 120.0,
        "sweep": sum(sweep_model.estimate(s) for s in sizes),
        "steps": sum(plan.prior(seq, name) for seq in plan.seqs for name in applicable_variants(args.backend)),
        "optimizer": 10.0 if quick else 45.0,
    }
    suites_ok = True
    suite_run: SuiteRun | None = None
    for index, name in enumerate(args.phase_list):
        later = sum(estimates[p] for p in args.phase_list[index + 1 :])
        left = budget.left()
        if name == "suites":
            allotted = min(estimates["suites"], left - later)
        else:
            allotted = left - later if later < left else left * estimates[name] / (estimates[name] + later)
        allotted = max(0.0, allotted)
        deadline = time.perf_counter() + allotted
        with phase(report, name, estimates[name], allotted) as info:
            if name == "suites":
                if allotted < min(5.0, estimates["suites"]):  # too short to start pytest and run a test
                    info["status"], info["note"] = "skipped", f"would not fit ({allotted:.0f} s allotted)"
                    suites_ok = False
                    continue
                suite_run = run_suites(report, args.backend, out, shlex.split(args.suites), args.test_timeout,
                                       allotted)  # fmt: skip
                suites_ok = suite_run.green
                info["status"], info["note"] = suite_status(suite_run)
            elif name == "sweep":
                note = sweep(report, dev, mod, sizes, args.repeats, sweep_model, deadline)
                if note:
                    info["status"], info["note"] = "cut", note
            elif name == "optimizer":
                note = optimizer_check(report, dev, args.backend, quick, deadline)
                if note:
                    info["status"], info["note"] = ("failed" if note.startswith("not bit-identical") else "cut"), note
            elif name == "steps":
                note = step_times(report, dev, args.backend, plan, deadline, host_limit)
                if note:
                    info["status"], info["note"] = "cut", note
                raw_d2h = max((r.get("raw_pinned_d2h") or 0.0) for r in report.data.get("sweep", [{}]) or [{}])
                for res in report.data.get("step_time", []):
                    v = res["variants"].get("offcore (deadline)", {})
                    if raw_d2h and v.get("d2h_bandwidth"):
                        v["d2h_fraction_of_raw"] = v["d2h_bandwidth"] / raw_d2h

    left = budget.left()
    if suite_run is not None and suite_run.status == "cut" and left >= 10.0:
        # the later phases left time over (their estimates are conservative): the suites go on
        with phase(report, "suites (resumed)", 0.0, left) as info:
            suite_run = run_suites(report, args.backend, out, shlex.split(args.suites), args.test_timeout, left,
                                   resume=suite_run)  # fmt: skip
            suites_ok = suite_run.green
            info["status"], info["note"] = suite_status(suite_run)

    report.data["finished"] = True
    report.write()
    close = getattr(dev, "close", None)
    if close is not None:
        close()
    print(markdown(report.data))
    print(f"hw_check total: {budget.elapsed():.1f} s of a {args.budget_s:.0f} s budget; report in {out}/", flush=True)
    failed = any(p["status"] == "failed" for p in report.data["phases"].values())
    return 0 if suites_ok and not failed else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
