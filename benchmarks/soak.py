"""Soak: a long TinyGPT training run with activation offload on the CPU fake device.

``--steps`` steps (1000 by default) of TinyGPT training with AdamW under
``offcore_torch.offload_activations``, next to a keep-all reference run (no hooks, its
own fake device) that goes through the same sequence of steps. To soak the cleanup
paths as well as the happy one, every ``--abandon-every``-th step (4) drops its loss
without backward, and every ``--raise-every``-th step (7) raises an exception inside
forward, inside the offload region (a forward pre-hook on the middle transformer block),
which the loop catches; neither runs ``optimizer.step()``, in either run, so both runs
see the same optimizer steps. Dropout is on (p = 0.1); each step seeds torch's generator
with ``seed + step`` before forward, in both runs.

The sanitizer is a device option (``offcore.device("cpu", sanitize=True)``), fixed when
the device is made, so the offload run uses **two devices**: a sanitized one for the
first ``--sanitize-steps`` steps (100) and then a fresh unsanitized one. At the switch,
after every copy has landed, the new device adopts the parameters and the AdamW state
(``dev.adopt``: the fake device's memory is host memory, so moving is re-counting, as
``.to("cuda")`` would be) and the old device is closed (its copy threads stop). One
device for the whole run would need a switch the fake device does not have, and keeping
the sanitizer on throughout would soak only the sanitizer's copy path (every copy on a
worker thread, with jitter), never the unsanitized one (small copies inline on an idle
stream). Each device is a *phase*; levels are compared within a phase, never across.

At every ``--every``-th step (50) the run settles (``offcore_torch.synchronize``, the
device's ``synchronize()``, ``gc.collect()``) and records: device allocated bytes, bytes
in use in offcore's host pools, pinned and pageable host bytes held, the runtime's
deferred releases, ``threading.active_count()``, ``len(gc.get_objects())``, the process's
RSS (``/proc/self/statm``, after glibc's ``malloc_trim(0)`` returned the allocator's free memory), the length of the fake device's copy log (a ring bounded by
the device's ``copy_log_limit``, 4096 by default: it fills up, then stays at the limit)
and whether the parameters equal the reference's so far. A phase's checkpoints from
``--warmup`` steps (10) into it on are compared with the phase's first such checkpoint:
device, pool, pinned, pageable, deferred and threads exactly; live objects within 1 %
(the copy log's entries are tuples of plain values, which the collector stops tracking:
Note [The copy log holds no tracked objects]), and RSS within 5 % or 16 MiB (whichever is larger). At
the end the parameters and the AdamW state must be bit-identical (``torch.equal``) to
the reference's, and so must every step's loss. The report prints a table of the
checkpoints and PASS or FAIL with what was compared; the exit status is 1 on FAIL.

Run::

    .venv/bin/python benchmarks/soak.py                  # 1000 steps, a few minutes here
    .venv/bin/python benchmarks/soak.py --quick          # 60 steps, checkpoints every 10
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import offcore_torch
import torch
from offcore_torch.models import GPTConfig, Workload, gpt_workload
from offcore_torch.runtime import runtime_for

import offcore

# TinyGPT with d_model 128, seq 64, batch 16: 34 offloaded storages of 128 KiB - 2 MiB per
# step (26.5 MiB), so without the sanitizer the small copies run inline on an idle stream
# and the 2 MiB ones on the copy threads: both copy paths are soaked.
DEFAULT_WORKLOAD = {"batch": 16, "seq_len": 64, "d_model": 128, "layers": 2, "heads": 4, "vocab": 256}
DEFAULTS = {"steps": 1000, "every": 50, "sanitize_steps": 100, "warmup": 10}
QUICK = {"steps": 60, "every": 10, "sanitize_steps": 20, "warmup": 5}
EXACT = ("device", "pool_in_use", "pinned", "pageable", "deferred", "threads")
MIB = 1024**2


class InjectedForwardError(RuntimeError):
    """Raised inside forward on the steps chosen by ``--raise-every``."""


class ForwardTrap:
    """A forward pre-hook on one module that raises :class:`InjectedForwardError` while armed."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.armed = False
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed:
            raise InjectedForwardError("injected by the soak benchmark (--raise-every)")

    @contextlib.contextmanager
    def arm(self, armed: bool) -> Iterator[None]:
        self.armed = armed
        try:
            yield
        finally:
            self.armed = False


@dataclass
class Run:
    """A model, its AdamW and the fake device it lives on; the offload run changes device once."""

    name: str
    device: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trap: ForwardTrap
    policy: dict[str, Any] | None  # offload_activations policy; None: keep-all
    losses: list[float | None] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)  # per full step
    stalls: int = 0


def make_run(name: str, work: Workload, device: Any, policy: dict[str, Any] | None, lr: float) -> Run:
    with device:  # built while active: the fake device counts the parameters as device memory
        model = work.build(0).to(device.torch_device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    blocks = model.blocks  # type: ignore[attr-defined]
    return Run(name, device, model, optimizer, ForwardTrap(blocks[len(blocks) // 2]), policy)


def step_kind(step: int, args: argparse.Namespace) -> str:
    """``"raise"``, ``"abandon"`` or ``"full"`` for step ``step`` (0-based; raise wins)."""
    if args.raise_every and step % args.raise_every == args.raise_every - 1:
        return "raise"
    if args.abandon_every and step % args.abandon_every == args.abandon_every - 1:
        return "abandon"
    return "full"


def train_step(run: Run, work: Workload, step: int, kind: str, seed: int) -> None:
    device = run.device
    with device:
        batch = work.make_batch(step, torch.device(device.torch_device))
        torch.manual_seed(seed + step)  # dropout masks: the same in both runs
        region: Any = (
            offcore_torch.offload_activations(device, **run.policy)
            if run.policy is not None
            else contextlib.nullcontext()
        )
        loss = handle = None
        try:
            with run.trap.arm(kind == "raise"), region as handle:
                loss = work.loss(run.model, batch)
        except InjectedForwardError:
            assert kind == "raise"
        if kind == "raise":
            assert loss is None, "the injected exception did not fire"
        run.losses.append(None if loss is None else loss.item())
        if kind == "full":
            assert loss is not None
            loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        if handle is not None:
            stats = handle.stats()
            run.stalls += stats.stalls
            if kind == "full":
                run.offloaded.append(stats.offloaded_bytes)
        del loss, handle, region, batch  # an abandoned step's graph dies here


def switch_device(run: Run, new_device: Any) -> None:
    """Move ``run`` to ``new_device``: adopt parameters and AdamW state, close the old device."""
    old = run.device
    offcore_torch.synchronize(old)
    old.synchronize()
    state = [t for s in run.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    new_device.adopt(run.model)
    new_device.adopt(state)
    old.close()
    run.device = new_device


# --------------------------------------------------------------------------- measuring


def _release_free_heap() -> None:
    """Return the C allocator's free memory to the OS (glibc ``malloc_trim(0)``; elsewhere nothing).

    Without it RSS counts the allocator's free lists too: in the sanitized phase they moved RSS by
    10-25 MiB between two checkpoints with no trend over 100 steps (a leak grows; this oscillated), which
    is the size of the RSS check's tolerance. After the trim RSS is the memory in use.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """Resident set size now, after :func:`_release_free_heap` (Linux ``/proc/self/statm``; elsewhere the
    peak from ``resource``)."""
    _release_free_heap()
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def tensors_equal(a: Run, b: Run) -> tuple[bool, int]:
    """(whether parameters and AdamW state of ``a`` and ``b`` are bit-identical, tensors compared)."""
    params = list(zip(a.model.parameters(), b.model.parameters(), strict=True))
    pairs = list(params)
    for pa, pb in params:
        sa, sb = a.optimizer.state.get(pa, {}), b.optimizer.state.get(pb, {})
        if sa.keys() != sb.keys():
            return False, len(pairs)
        pairs += [(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k])]
    return all(torch.equal(x, y) for x, y in pairs), len(pairs)


def checkpoint(step: int, phase: int, run: Run, reference: Run, step_s: float) -> dict[str, Any]:
    device = run.device
    offcore_torch.synchronize(device)
    device.synchronize()
    gc.collect()
    stats = device.memory_stats()
    equal, _ = tensors_equal(run, reference)
    objects, copy_log = len(gc.get_objects()), len(device.copy_log())
    return {
        "step": step,
        "phase": phase,
        "device": int(stats.allocated_bytes),
        "pool_in_use": sum(pool.used_bytes for pool in runtime_for(device).pools),
        "pinned": int(stats.get("pinned_bytes", 0)),
        "pageable": int(stats.get("pageable_bytes", 0)),
        "deferred": runtime_for(device).deferred_count,
        "threads": threading.active_count(),
        "objects": objects,
        "rss": rss_bytes(),
        "copy_log": copy_log,
        "params_equal": equal,
        "step_ms": step_s * 1e3,
    }


class Progress:
    """tqdm on a terminal; otherwise a line per checkpoint (readable in a log file)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        self.total = total
        self.start = time.perf_counter()
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(self, done: int, note: str = "") -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if note:
                self.bar.set_postfix_str(note)
        elif self.enabled and note:
            elapsed = time.perf_counter() - self.start
            print(f"[soak] step {done}/{self.total} ({elapsed:.0f} s): {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- judging


@dataclass
class Check:
    label: str
    ok: bool
    detail: str


def flat_checks(rows: list[dict[str, Any]], phase: int, name: str, args: argparse.Namespace) -> list[Check]:
    """Every series of ``phase``'s compared checkpoints against its first one."""
    compared = [row for row in rows if row["phase"] == phase and row["role"] != "warm-up"]
    if len(compared) < 2:
        return [Check(f"{name}: flat", False, f"{len(compared)} checkpoint(s) after warm-up; need 2 (lower --every)")]
    first, last = compared[0], compared[-1]
    span = f"steps {first['step']}-{last['step']}, {len(compared)} checkpoints"
    checks = []
    for key in EXACT:
        values = [row[key] for row in compared]
        ok = all(v == values[0] for v in values)
        shown = offcore.format_bytes if key not in ("deferred", "threads") else str
        detail = f"{shown(values[0])} at every checkpoint" if ok else "values " + ", ".join(shown(v) for v in values)
        checks.append(Check(f"{name}: {key.replace('_', ' ')} exactly equal ({span})", ok, detail))
    growth = last["objects"] - first["objects"]
    pct = 100.0 * growth / first["objects"]
    checks.append(
        Check(
            f"{name}: live objects, growth < {args.objects_tolerance_pct:g} % ({span})",
            pct < args.objects_tolerance_pct,
            f"{first['objects']:,} -> {last['objects']:,} ({growth:+,}, {pct:+.3f} %); "
            f"max {max(row['objects'] for row in compared):,}",
        )
    )
    grown = last["rss"] - first["rss"]
    allowed = max(first["rss"] * args.rss_tolerance_pct / 100.0, args.rss_tolerance_mib * MIB)
    checks.append(
        Check(
            f"{name}: RSS growth < {args.rss_tolerance_pct:g} % or < {args.rss_tolerance_mib:g} MiB ({span})",
            grown < allowed,
            f"{offcore.format_bytes(first['rss'])} -> {offcore.format_bytes(last['rss'])} "
            f"({grown / MIB:+.2f} MiB, {100.0 * grown / first['rss']:+.2f} %); "
            f"max {offcore.format_bytes(max(row['rss'] for row in compared))}",
        )
    )
    return checks


def final_checks(run: Run, reference: Run, rows: list[dict[str, Any]], limit: int) -> list[Check]:
    equal, count = tensors_equal(run, reference)
    n_params = len(list(run.model.parameters()))
    checks = [
        Check(
            "parameters and AdamW state bit-identical to keep-all (torch.equal) after the last step",
            equal,
            f"{count} tensors ({n_params} parameters, {count - n_params} AdamW state tensors)",
        )
    ]
    mismatched = [
        i
        for i, (a, b) in enumerate(zip(run.losses, reference.losses, strict=True))
        if (a is None) != (b is None) or (a is not None and not a == b)
    ]
    done = sum(loss is not None for loss in run.losses)
    checks.append(
        Check(
            "every step's loss bit-identical to keep-all",
            not mismatched,
            f"{done} losses compared"
            + (f"; first mismatch at step {mismatched[0]} ({len(mismatched)} in all)" if mismatched else ""),
        )
    )
    unequal = [row["step"] for row in rows if not row["params_equal"]]
    checks.append(
        Check(
            "parameters equal to keep-all at every checkpoint",
            not unequal,
            f"{len(rows)} checkpoints" + (f"; first unequal after step {unequal[0]}" if unequal else ""),
        )
    )
    zero = sum(1 for b in run.offloaded if b <= 0)
    checks.append(
        Check(
            "offload active: every full step offloaded bytes",
            bool(run.offloaded) and not zero,
            f"{len(run.offloaded)} full steps, {offcore.format_bytes(min(run.offloaded, default=0))} - "
            f"{offcore.format_bytes(max(run.offloaded, default=0))} per step, {run.stalls} stalls in all",
        )
    )
    logs = [row["copy_log"] for row in rows]
    checks.append(
        Check(
            f"copy log bounded by copy_log_limit ({limit}; a ring: it fills, then stays at the limit)",
            max(logs) <= limit,
            f"lengths {min(logs)} - {max(logs)}",
        )
    )
    return checks


# --------------------------------------------------------------------------- reporting


def markdown_table(rows: list[dict[str, Any]], phase_names: dict[int, str]) -> str:
    lines = [
        "| step | device | role | allocated | pool in use | pinned | pageable | deferred | threads | objects "
        "| RSS | copy log | params = ref | ms/step |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    fmt = offcore.format_bytes
    for row in rows:
        lines.append(
            f"| {row['step']} | {phase_names[row['phase']]} | {row['role']} | {fmt(row['device'])} | "
            f"{fmt(row['pool_in_use'])} | {fmt(row['pinned'])} | {fmt(row['pageable'])} | {row['deferred']} | "
            f"{row['threads']} | {row['objects']:,} | {row['rss'] / MIB:.1f} MiB | "
            f"{row['copy_log']} | "
            f"{'yes' if row['params_equal'] else '**no**'} | {row['step_ms']:.1f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def phase_names(args: argparse.Namespace) -> dict[int, str]:
    """The phases the run has: 1 (sanitized device) for the first --sanitize-steps steps, then 2 (plain)."""
    names = {1: "sanitized"} if args.sanitize_steps else {}
    if args.sanitize_steps < args.steps:
        names[2] = "plain"
    return names


def checkpoint_plan(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """``(steps done, phase, role)`` of every checkpoint; role ``"warm-up"``, ``"baseline"`` or ``"compared"``.

    A checkpoint at ``--sanitize-steps`` is taken on the sanitized device, before the switch.
    """
    plan: list[tuple[int, int, str]] = []
    seen: set[int] = set()
    for done in [*range(args.every, args.steps + 1, args.every), args.steps]:
        if done in seen:
            continue
        seen.add(done)
        phase, start = (1, 0) if done <= args.sanitize_steps else (2, args.sanitize_steps)
        if done - start < args.warmup:
            role = "warm-up"
        else:
            role = "compared" if any(p == phase and r != "warm-up" for _, p, r in plan) else "baseline"
        plan.append((done, phase, role))
    return plan


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULTS['steps']})")
    parser.add_argument(
        "--every", type=int, default=None, help=f"checkpoint every N steps (default {DEFAULTS['every']})"
    )
    parser.add_argument(
        "--sanitize-steps",
        type=int,
        default=None,
        help=f"steps on the sanitized device before switching to an unsanitized one (default "
        f"{DEFAULTS['sanitize_steps']}; 0: no sanitized phase)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"steps into each phase before checkpoints are compared (default {DEFAULTS['warmup']})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (explicit flags win)",
    )
    parser.add_argument("--abandon-every", type=int, default=4, help="drop every Nth step's loss (default 4; 0: never)")
    parser.add_argument(
        "--raise-every", type=int, default=7, help="raise inside every Nth step's forward (default 7; 0: never)"
    )
    parser.add_argument("--min-bytes", default="16KiB", help="offload_activations min_bytes (default 16KiB)")
    parser.add_argument("--prefetch", choices=("deadline", "on_demand"), default="deadline")
    parser.add_argument("--bandwidth", default="8GiB/s", help="fake link bandwidth per direction (default 8GiB/s)")
    parser.add_argument("--latency", default="10us", help="fake link latency per copy (default 10us)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="dropout seed base (step s seeds seed + s; default 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--objects-tolerance-pct", type=float, default=1.0, help="default 1")
    parser.add_argument("--rss-tolerance-pct", type=float, default=5.0, help="default 5")
    parser.add_argument("--rss-tolerance-mib", type=float, default=16.0, help="default 16")
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    parser.add_argument("--json", metavar="PATH", help="also write checkpoints and checks as JSON")
    for name, default in DEFAULT_WORKLOAD.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"default {default}")
    args = parser.parse_args(argv)
    preset = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name, default in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be positive")
    if min(args.sanitize_steps, args.warmup, args.abandon_every, args.raise_every) < 0:
        parser.error("--sanitize-steps, --warmup, --abandon-every and --raise-every must not be negative")
    if min(getattr(args, name) for name in DEFAULT_WORKLOAD) < 1:
        parser.error("workload sizes must be positive")
    args.sanitize_steps = min(args.sanitize_steps, args.steps)
    plan = checkpoint_plan(args)
    for phase, name in phase_names(args).items():
        judged = [done for done, p, role in plan if p == phase and role != "warm-up"]
        if len(judged) < 2:
            parser.error(
                f"the {name} phase would have {len(judged)} checkpoint(s) after its warm-up ({args.warmup} steps), "
                "too few to judge flatness (2 or more): lower --every or --warmup, or change --steps / --sanitize-steps"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # the report and the progress lines interleave in order
    torch.set_num_threads(args.threads)
    config = GPTConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        seq_len=args.seq_len,
        dropout=0.1,
    )
    work = gpt_workload(config, batch_size=args.batch)
    sanitize_steps = args.sanitize_steps
    link = {"h2d_bandwidth": args.bandwidth, "d2h_bandwidth": args.bandwidth, "latency": args.latency}
    policy = {"min_bytes": args.min_bytes, "prefetch": args.prefetch}
    phases = phase_names(args)
    plan = {done: (phase, role) for done, phase, role in checkpoint_plan(args)}

    print("# Soak: activation offload on the CPU fake device\n")
    print(f"Command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"Model: TinyGPT {config}, batch {args.batch}; AdamW lr {args.lr}; torch {torch.__version__}, "
        f"{args.threads} intra-op thread(s), {platform.processor() or platform.machine()}."
    )
    print(
        f"{args.steps} steps: offload_activations({', '.join(f'{k}={v!r}' for k, v in policy.items())}) on the fake "
        f"device (link {args.bandwidth}, latency {args.latency}): "
        + {
            (True, True): f"sanitized for the first {sanitize_steps} steps (one device), then a fresh unsanitized "
            "device (another; parameters and AdamW state adopted). ",
            (True, False): "sanitized throughout. ",
            (False, True): "unsanitized throughout. ",
        }[1 in phases, 2 in phases]
        + (f"Every {args.abandon_every}th step drops its loss without backward. " if args.abandon_every else "")
        + (
            f"Every {args.raise_every}th raises inside forward (inside the region) and is caught. "
            if args.raise_every
            else ""
        )
        + "Only full steps step the optimizer. Reference: keep-all (no hooks) on its own fake device, same steps, "
        "interleaved.\n"
    )

    device = offcore.device("cpu", capacity="1GiB", sanitize=bool(sanitize_steps), seed=args.seed, **link)
    run = make_run("offload", work, device, policy, args.lr)
    limit = device.options.copy_log_limit
    del device  # the run holds it; after the switch nothing should (checked below)
    retired: weakref.ref[Any] | None = None
    reference = make_run("keep-all", work, offcore.device("cpu", capacity="1GiB", **link), None, args.lr)
    phase = 1 if sanitize_steps else 2

    rows: list[dict[str, Any]] = []
    progress = Progress(args.steps, enabled=not args.no_progress)
    since, spent = 0, 0.0
    kinds = {"full": 0, "abandon": 0, "raise": 0}
    started = time.perf_counter()
    try:
        for step in range(args.steps):
            if step == sanitize_steps and phase == 1:
                retired = weakref.ref(run.device)
                switch_device(run, offcore.device("cpu", capacity="1GiB", **link))
                phase = 2
            kind = step_kind(step, args)
            kinds[kind] += 1
            begin = time.perf_counter()
            train_step(run, work, step, kind, args.seed)
            spent += time.perf_counter() - begin
            since += 1
            train_step(reference, work, step, kind, args.seed)
            done = step + 1
            if done in plan:
                assert plan[done][0] == phase
                row = checkpoint(done, phase, run, reference, spent / since)
                row["role"] = plan[done][1]
                rows.append(row)
                since, spent = 0, 0.0
                progress.update(
                    done,
                    f"{phases[phase]}, device {offcore.format_bytes(row['device'])}, threads {row['threads']}, "
                    f"RSS {row['rss'] / MIB:.0f} MiB, params equal {row['params_equal']}",
                )
            else:
                progress.update(done)
    finally:
        progress.close()
    wall = time.perf_counter() - started

    print(
        f"Ran {args.steps} steps in {wall:.0f} s ({kinds['full']} full, {kinds['abandon']} abandoned, "
        f"{kinds['raise']} raising in forward); checkpoints every {args.every} steps, after settling "
        "(offcore_torch.synchronize, device synchronize, gc.collect()).\n"
    )
    print(markdown_table(rows, phases))
    print()
    print(
        "Columns: allocated = the offload run's device memory (parameters, AdamW state; gradients are None "
        "between steps); pool in use = bytes handed out by offcore's host pools; pinned / pageable = host bytes "
        "the device holds; deferred = releases waiting for a copy; threads = threading.active_count(); objects = "
        "len(gc.get_objects()) after gc.collect() (the copy log's entries are not among them: tuples of plain "
        "values, which the collector stops tracking); RSS from "
        "/proc/self/statm; copy log = len(dev.copy_log()), a "
        f"ring of at most copy_log_limit = {limit} copies (it fills, then stays there; it restarts with the "
        "phase-2 device); params = ref: parameters and AdamW state torch.equal to the keep-all run after the "
        "same steps; ms/step = the offload run's mean since the last checkpoint. Roles: warm-up rows are shown, "
        "not compared; each phase's later rows are compared with its baseline.\n"
    )
    checks: list[Check] = []
    for each, name in phases.items():
        checks += flat_checks(rows, each, f"{name} device", args)
    checks += final_checks(run, reference, rows, limit)
    if retired is not None:
        gc.collect()
        checks.append(
            Check(
                "the sanitized device was freed after the switch (with its runtime, pools, copy log)",
                retired() is None,
                "no reference left (weakref dead)" if retired() is None else "still referenced",
            )
        )
    for check in checks:
        print(f"- {'ok  ' if check.ok else 'FAIL'} {check.label}: {check.detail}")
    passed = all(check.ok for check in checks)
    print(f"\n**{'PASS' if passed else 'FAIL'}**: {sum(c.ok for c in checks)} of {len(checks)} checks passed.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "command": " ".join([sys.executable, *sys.argv]),
                    "args": vars(args),
                    "checkpoints": rows,
                    "checks": [c.__dict__ for c in checks],
                    "passed": passed,
                    "wall_s": wall,
                },
                handle,
                indent=2,
            )
        print(f"JSON written to {args.json}")
    run.device.close()
    reference.device.close()
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
