#!/usr/bin/env python
"""Mutation check: plant known bugs in a temporary copy of the source and make sure the tests catch each one.

Each mutation below replaces exact text in one or more files of a *copy* of the working
tree (``git ls-files --cached --others --exclude-standard``, so uncommitted work is
included; the working tree itself is never touched), runs the tests that should catch
it against that copy, and reports how many failed. A mutation the tests do not catch
(every test passes) is a SURVIVOR: the run ends with exit status 1 and says so. A
mutation whose anchor text is no longer found (the code moved on) is an error too, so
the list cannot silently rot. A run that hangs past ``--timeout`` is reported as such
(caught, but not cleanly: a hang is a bug in the tests).

Before the mutations, the same tests run once on the unmutated copy; they must pass, or
the counts would mean nothing.

    .venv/bin/python tools/mutation.py                 # every mutation (about 10-15 minutes on 2 cores)
    .venv/bin/python tools/mutation.py --list          # names and what each plants
    .venv/bin/python tools/mutation.py --check-anchors # does every mutation still apply? (seconds)
    .venv/bin/python tools/mutation.py -k wait -k sanitizer   # those whose name contains a word
    .venv/bin/python tools/mutation.py --markdown out.md      # the table as Markdown too

See docs/testing.md ("Mutation check").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Tests of the activation-offload plugin, without the slowest (the fault sweep: four
# parametrised runs of ~16 s that fail a copy at every position, redundant for the races
# below) and without tests owned by work in progress elsewhere (hardware check, soak).
TORCH = [
    "tests/torch",
    "--deselect",
    "tests/torch/test_offload_faults.py::test_every_failed_copy_is_recovered_or_refused_and_nothing_leaks",
    "--ignore",
    "tests/torch/test_hw_check.py",
    "--ignore",
    "tests/torch/test_soak_benchmark.py",
]
DEVICE = [
    "tests/backends/test_cpu_device.py",
    "tests/backends/test_cpu_faults.py",
    "tests/backends/test_cpu_sanitizer.py",
    "tests/backends/test_conformance_cpu.py",
    "tests/torch/test_race_canaries.py",
]


@dataclass
class Mutation:
    name: str
    plants: str
    edits: list[tuple[str, str, str]]  # (file, exact text found once, replacement)
    tests: list[str] = field(default_factory=lambda: list(TORCH))
    known_gap: str = ""  # non-empty: expected to survive, and why (reported, never a failure)


MUTATIONS: list[Mutation] = [
    Mutation(
        "offload-noop",
        "offloading disabled: every saved tensor is kept on the device",
        [
            (
                "plugins/offcore_torch/activations/pack.py",
                "        reason = rules.before_storage(tensor)\n",
                '        return self._keep(tensor, key, "mutation: offload is a no-op")\n',
            )
        ],
    ),
    Mutation(
        "counted-not-moved",
        "bytes counted as offloaded, nothing moved: the tensor stays on the device but the stats say offloaded",
        [
            (
                "plugins/offcore_torch/activations/pack.py",
                "        meta = TensorMeta.of(tensor)\n        try:\n            entry = self._offload(storage, nbytes, skey, tensor, key, meta)\n",
                "        meta = TensorMeta.of(tensor)\n        self._stats.offloaded_bytes += nbytes\n"
                "        self._stats.offloaded_storages += 1\n"
                '        return self._keep(tensor, key, "mutation: counted, not moved")\n'
                "        try:\n            entry = self._offload(storage, nbytes, skey, tensor, key, meta)\n",
            )
        ],
    ),
    Mutation(
        "version-checks-off",
        "saved-tensor version checks off (offloaded and kept)",
        [
            (
                "plugins/offcore_torch/activations/unpack.py",
                "        if current != packed.version:\n",
                "        if False:\n",
            ),
            (
                "plugins/offcore_torch/activations/unpack.py",
                "            if packed.tensor._version != packed.version:\n",
                "            if False:\n",
            ),
        ],
    ),
    Mutation(
        "d2h-not-queried",
        "device copy released without querying its D2H event (ManagedObject's guard still on)",
        [
            (
                "plugins/offcore_torch/runtime.py",
                "                    if not event.query():\n                        return\n",
                "                    pass\n",
            )
        ],
    ),
    Mutation(
        "early-free",
        "the same with ManagedObject's guard removed: a true early free of the D2H copy's source",
        [
            (
                "plugins/offcore_torch/runtime.py",
                "                    if not event.query():\n                        return\n",
                "                    pass\n",
            ),
            (
                "offcore/objects.py",
                "        if self.d2h_event is None or not self.d2h_event.query():\n",
                "        if False:\n",
            ),
        ],
    ),
    Mutation(
        "never-freed",
        "device copy never freed: offcore keeps its device references after the D2H landed",
        [
            (
                "plugins/offcore_torch/activations/landings.py",
                "        for item in entry.live_items() if items is None else items:\n"
                "            empty = empties.get(item.meta.dtype)\n"
                "            if empty is None:\n"
                "                self._release_keeper(item)\n"
                "            else:  # _release_keeper, inlined (once per offloaded storage)\n"
                "                item.keeper.data = empty\n"
                "        entry.src = None\n",
                "",
            )
        ],
    ),
    Mutation(
        "no-compute-wait",
        "compute not waiting for a prefetched H2D copy",
        [
            (
                "plugins/offcore_torch/activations/unpack.py",
                "                    compute.wait_event(event)\n",
                "                    pass\n",
            ),
        ],
    ),
    Mutation(
        "host-released-in-flight",
        "a dropped graph returns its host buffers while their prefetch is still in flight",
        [
            (
                "plugins/offcore_torch/activations/landings.py",
                "        if state is not _PREFETCHING and state is not _OFFLOADING:\n",
                "        if state is not _OFFLOADING:\n",
            )
        ],
    ),
    Mutation(
        "plugin-no-cross-stream-wait",
        "offcore's copy streams no longer wait for the compute stream before a copy",
        [
            (
                "plugins/offcore_torch/activations/pack.py",
                "            stream.wait_event(device.current_stream().record_event())\n",
                "            pass\n",
            ),
            (
                "plugins/offcore_torch/activations/pack.py",
                "            stream.wait_event(device.current_stream().record_event(order))\n",
                "            pass\n",
            ),
        ],
        known_gap=(
            "the fake device's compute stream is the calling thread: an operator has finished before copy_ is "
            "called, so a copy can never overtake the compute that produced its source; only hardware shows it"
        ),
    ),
    Mutation(
        "sanitizer-switch-off",
        "the sanitizer forced off inside the fake device (the option still says on)",
        [("backends/offcore_cpu/sanitizer.py", "        self.enabled = enabled\n", "        self.enabled = False\n")],
        tests=list(DEVICE) + ["tests/torch/test_offload_prefetch.py"],
    ),
    Mutation(
        "op-check-off",
        "the sanitizer's operator check sees no copy in flight (the mode runs, reports nothing)",
        [
            (
                "backends/offcore_cpu/op_check.py",
                "        if _OPS_INDEX:  # nothing in flight: only this call is paid\n",
                "        if False:\n",
            )
        ],
        tests=["tests/backends/test_cpu_op_check.py", "tests/torch/test_sanitizer_hazards.py"],
    ),
    Mutation(
        "sanitize-option-ignored",
        "sanitize=True ignored when the fake device parses its options",
        [
            (
                "backends/offcore_cpu/options.py",
                '            sanitize=_flag(sanitize, "sanitize"),\n',
                "            sanitize=False,\n",
            )
        ],
        tests=["tests/torch/test_race_canaries.py", "tests/torch/test_offload_safety.py"],
    ),
    Mutation(
        "wait-event-noop",
        "the fake stream's wait_event made a no-op",
        [
            (
                "backends/offcore_cpu/streams.py",
                '        """Later work on this stream starts only after ``event`` completes (the host does not block)."""\n',
                '        """Later work on this stream starts only after ``event`` completes (the host does not block)."""\n'
                "        return\n",
            )
        ],
        tests=list(DEVICE),
    ),
    Mutation(
        "uaf-check-off",
        "the sanitizer's use-after-free check of device buffers off",
        [
            (
                "backends/offcore_cpu/sanitizer.py",
                '        """Record (once per side) a device side of ``flight`` that only the device still holds."""\n',
                '        """Record (once per side) a device side of ``flight`` that only the device still holds."""\n'
                "        return\n",
            )
        ],
        tests=list(DEVICE),
    ),
    Mutation(
        "release-check-off",
        "the sanitizer's check of host buffers released while a copy uses them off",
        [
            (
                "backends/offcore_cpu/sanitizer.py",
                '        """``buffer`` was released (back to its pool, or poisoned as unused): flag the copies in flight on it."""\n',
                '        """``buffer`` was released (back to its pool, or poisoned as unused): flag the copies in flight on it."""\n'
                "        return\n",
            )
        ],
        tests=list(DEVICE),
    ),
    Mutation(
        "order-check-off",
        "the sanitizer's cross-stream ordering check off",
        [
            (
                "backends/offcore_cpu/copying.py",
                "        for earlier, side in order.copy(sid, ranges, number, stream.name, direction):\n",
                "        for earlier, side in order.copy(sid, ranges, number, stream.name, direction)[:0]:\n",
            )
        ],
        tests=list(DEVICE),
    ),
    Mutation(
        "copy-holds-source",
        "the fake device's queued copy keeps its caller's buffers alive again (as before the use-after-free check)",
        [
            (
                "backends/offcore_cpu/copying.py",
                "            del dst, src  # the work item must not keep the caller's buffers alive\n"
                "            run = functools.partial(self._run_flight, flight, jitter, state, time.perf_counter(), started)\n",
                "            run = functools.partial(\n"
                "                self._run_flight, flight, jitter, state, time.perf_counter(), started, (dst, src)\n"
                "            )\n",
            ),
            (
                "backends/offcore_cpu/copying.py",
                "    def _run_flight(self, flight: Flight, jitter: float, state: Any, enqueued: float, started: Any = None) -> float:\n",
                "    def _run_flight(\n"
                "        self, flight: Flight, jitter: float, state: Any, enqueued: float, started: Any = None, keep: Any = None\n"
                "    ) -> float:\n",
            ),
        ],
        tests=list(DEVICE),
    ),
]


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # caught | SURVIVED | TIMEOUT | ANCHOR MISSING | known gap | gap closed
    failed: int = 0
    passed: int = 0
    errors: int = 0
    seconds: float = 0.0
    detail: str = ""


def source_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line and (ROOT / line).is_file()]


def make_copy(files: list[str]) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="offcore-mutation-"))
    for name in files:
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return tree


def apply(tree: Path, mutation: Mutation) -> str | None:
    """Apply the mutation's edits to ``tree``; the reason when an anchor is not found exactly once."""
    for name, old, new in mutation.edits:
        path = tree / name
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            return f"{name}: anchor found {count} times (expected once): {old.strip()[:80]!r}"
        path.write_text(text.replace(old, new))
    return None


def environment(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(tree), str(tree / "backends"), str(tree / "plugins")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports(tree: Path) -> None:
    """The copy, not the working tree, must be what the tests import (PYTHONPATH before the editable install)."""
    code = (
        "import offcore, offcore_cpu, offcore_torch, pytest_offcore; "
        "print('\\n'.join(m.__file__ for m in (offcore, offcore_cpu, offcore_torch, pytest_offcore)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=environment(tree), check=True, capture_output=True, text=True
    )
    for line in out.stdout.split():
        if not Path(line).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"mutation: the tests would import {line}, not the temporary copy {tree}; aborting")


_SUMMARY = re.compile(r"(\d+) (failed|passed|errors?|skipped|deselected|xfailed|xpassed)")


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, dict[str, int], float, str]:
    command = [sys.executable, "-m", "pytest", *tests, "--offcore-backend=cpu", "-q", "--tb=no", "-p", "no:randomly"]
    start = time.monotonic()
    child = subprocess.Popen(
        command, cwd=tree, env=environment(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        stdout, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, _ = child.communicate()
        return "timeout", {}, time.monotonic() - start, stdout[-2000:]
    finally:
        if child.poll() is None:  # interrupted: never leave a test run behind
            child.kill()
            child.wait()
    counts: dict[str, int] = {}
    lines = stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    for number, what in _SUMMARY.findall(last):
        counts["errors" if what.startswith("error") else what] = int(number)
    return str(child.returncode), counts, time.monotonic() - start, "\n".join(lines[-15:])


def judge(mutation: Mutation, rc: str, counts: dict[str, int]) -> str:
    caught = rc == "timeout" or counts.get("failed", 0) + counts.get("errors", 0) > 0 or rc not in ("0", "5")
    if mutation.known_gap:
        return "gap closed" if caught else "known gap"
    if rc == "timeout":
        return "TIMEOUT"
    return "caught" if caught else "SURVIVED"


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutation | what it plants | tests failed / run | verdict |", "|---|---|---:|---|"]
    for o in outcomes:
        run = o.failed + o.errors + o.passed
        figure = f"{o.failed + o.errors} / {run}" if run else "-"
        verdict = o.status + (f" ({o.mutation.known_gap})" if o.status in ("known gap", "gap closed") else "")
        if o.status == "ANCHOR MISSING":
            verdict += f": {o.detail}"
        lines.append(f"| {o.mutation.name} | {o.mutation.plants} | {figure} | {verdict} |")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a killed run stops its test run and removes its copy
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only mutations whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check-anchors", action="store_true", help="only check that every mutation still applies")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (default 900)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (faster; counts unchecked)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table to PATH")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies (their paths are printed)")
    args = parser.parse_args(argv)

    chosen = [m for m in MUTATIONS if not args.k or any(word in m.name for word in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.plants}" + (f" [known gap: {m.known_gap}]" if m.known_gap else ""))
        return 0
    if not chosen:
        print("mutation: no mutation matches", args.k, file=sys.stderr)
        return 2

    files = source_files()
    if args.check_anchors:
        missing = 0
        for mutation in chosen:
            tree = make_copy(files)
            try:
                problem = apply(tree, mutation)
            finally:
                shutil.rmtree(tree, ignore_errors=True)
            print(f"{mutation.name}: {'ok' if problem is None else 'ANCHOR MISSING -- ' + problem}")
            missing += problem is not None
        return 1 if missing else 0
    if not args.no_baseline:
        tree = make_copy(files)
        try:
            check_imports(tree)
            suites = sorted({tuple(m.tests) for m in chosen})
            for tests in suites:
                rc, counts, seconds, tail = run_tests(tree, list(tests), args.timeout)
                print(f"baseline {' '.join(tests[:1])}...: rc {rc}, {counts} in {seconds:.0f} s", flush=True)
                if rc not in ("0",):
                    print(tail)
                    print("mutation: the unmutated tests must pass first; fix that, then rerun", file=sys.stderr)
                    return 2
        finally:
            shutil.rmtree(tree, ignore_errors=True)

    outcomes: list[Outcome] = []
    for mutation in chosen:
        tree = make_copy(files)
        try:
            problem = apply(tree, mutation)
            if problem is not None:
                outcomes.append(Outcome(mutation, "ANCHOR MISSING", detail=problem))
                print(f"{mutation.name}: ANCHOR MISSING -- {problem}", flush=True)
                continue
            check_imports(tree)
            rc, counts, seconds, tail = run_tests(tree, mutation.tests, args.timeout)
            status = judge(mutation, rc, counts)
            outcome = Outcome(
                mutation,
                status,
                failed=counts.get("failed", 0),
                passed=counts.get("passed", 0),
                errors=counts.get("errors", 0),
                seconds=seconds,
                detail=tail,
            )
            outcomes.append(outcome)
            print(
                f"{mutation.name}: {status} -- {outcome.failed} failed, {outcome.errors} errors, "
                f"{outcome.passed} passed in {seconds:.0f} s",
                flush=True,
            )
            if status in ("SURVIVED", "gap closed"):
                print(tail)
        finally:
            if args.keep:
                print(f"  kept {tree}")
            else:
                shutil.rmtree(tree, ignore_errors=True)

    text = table(outcomes)
    print()
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    bad = [o for o in outcomes if o.status in ("SURVIVED", "ANCHOR MISSING", "TIMEOUT")]
    if bad:
        print(
            "\nmutation: FAILED -- "
            + ", ".join(f"{o.mutation.name} {o.status}" for o in bad)
            + ": the tests must catch every planted bug (cleanly, without hanging)",
            file=sys.stderr,
        )
        return 1
    print("\nmutation: every planted bug was caught")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
