"""What the CPU fake device's memory accounting costs: a keep-all step inside ``with dev:`` vs plain torch.

Inside ``with dev:`` the fake device counts every new tensor storage as device memory
(``backends/offcore_cpu/tracking.py``, Note [Counting device memory with allocations]); its
cost dilutes every ratio measured on the fake device, and slows every test suite run on it.
This benchmark runs the same training step (forward, loss, backward, ``optimizer.step()``,
keep-all: no offload) side by side in one run, for each workload:

- **plain torch** (the baseline): no fake device, no dispatch mode.
- **empty dispatch mode** (the cost floor of accounting in a Python ``TorchDispatchMode``):
  a mode whose ``__torch_dispatch__`` only calls the operator.
- **fake device**: ``with dev:`` with ``sanitize=False`` and the default accounting (torch's
  CPU allocator hooked, ``accounting="allocator"``, where the hook builds).
- **fake device + sanitizer**: the same with ``sanitize=True`` and ``check_ops=False`` (also poisons
  uninitialised outputs).
- **fake device + sanitizer + operator check**: ``sanitize=True`` with its default ``check_ops=True``
  (a Python dispatch mode checking every operator against the copies in flight).
- **fake device, dispatch accounting**: ``accounting="dispatch"``, the Python dispatch-mode
  reference (what every ``with dev:`` cost before the allocator hook).

Every variant has its own model and optimizer (built inside ``with dev:`` for the fake
device ones, so their parameters are device memory). Samples of ``--steps`` steps of each
variant are interleaved round-robin (the order rotates every round) after a warm-up, so
machine noise hits them alike; the table shows medians per step in wall time and in
process CPU time, the ratio to plain torch, and the overhead per aten operator
(``(variant - plain) / operators per step``; the operators are counted once per workload).

Workloads: ``TinyGPT`` (``offcore_torch.models``, default config: d_model 64, 2 layers,
seq 32, batch 4) and ``SmallCNN`` (16x16 images, batch 8): small steps of a few hundred
operators each, where a per-operator cost shows most. Target: fake device <= 1.10 x plain.

Run::

    .venv/bin/python benchmarks/fake_device_overhead.py
    .venv/bin/python benchmarks/fake_device_overhead.py --rounds 40 --steps 5 --json /tmp/fake_device.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from offcore_torch.models import Workload, cnn_workload, gpt_workload
from torch.utils._python_dispatch import TorchDispatchMode

import offcore

TARGET = 1.10


class _EmptyMode(TorchDispatchMode):
    """The cost floor of any Python dispatch mode: call the operator, nothing else."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _CountingMode(TorchDispatchMode):
    """Counts the aten operators a step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Variant:
    """One way of running the step: ``context()`` wraps it, ``step()`` runs one."""

    name: str
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    step: Callable[[], None] = field(default=lambda: None)
    wall: list[float] = field(default_factory=list)  # seconds per step, one entry per sample
    cpu: list[float] = field(default_factory=list)
    closer: Callable[[], None] = field(default=lambda: None)


def _make_step(work: Workload, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> Callable[[], None]:
    """Build the model and optimizer inside ``context`` and return one keep-all training step."""
    with context():
        model = work.build(0)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [work.make_batch(i, torch.device("cpu")) for i in range(4)]
    counter = iter(range(1 << 62))

    def step() -> None:
        batch = batches[next(counter) % len(batches)]
        with context():
            loss = work.loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def _variants(work: Workload) -> list[Variant]:
    variants = [
        Variant("plain torch", contextlib.nullcontext),
        Variant("empty dispatch mode", _EmptyMode),
    ]
    for name, sanitize, accounting, check_ops in (
        ("fake device", False, "auto", False),
        ("fake device + sanitizer", True, "auto", False),
        ("fake device + sanitizer + operator check", True, "auto", True),
        ("fake device, dispatch accounting", False, "dispatch", False),
    ):
        # made under a mode: the operator check's mode (Note [One checking mode per thread, at the bottom of
        # its stack]) is pushed by `with dev:` alone, so the other variants run without it
        with _EmptyMode():
            dev = offcore.device(
                "cpu", capacity="4GiB", sanitize=sanitize, seed=0, accounting=accounting, check_ops=check_ops
            )
        label = f"{name} ({dev.accounting})" if accounting == "auto" else name
        variants.append(Variant(label, lambda dev=dev: dev, closer=dev.close))
    for variant in variants:
        variant.step = _make_step(work, variant.context)
    return variants


def _operators_per_step(work: Workload) -> int:
    step = _make_step(work, contextlib.nullcontext)
    step()
    mode = _CountingMode()
    with mode:
        step()
    return mode.count


def _sample(variant: Variant, steps: int) -> None:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        variant.step()
    variant.wall.append((time.perf_counter() - wall0) / steps)
    variant.cpu.append((time.process_time() - cpu0) / steps)


def run_workload(work: Workload, *, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Interleaved samples of every variant of ``work``; medians, ratios, overhead per operator."""
    ops = _operators_per_step(work)
    variants = _variants(work)
    try:
        for variant in variants:
            for _ in range(warmup):
                variant.step()
        for r in range(rounds):
            shift = r % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                _sample(variant, steps)
    finally:
        for variant in variants:
            variant.closer()
    base_wall = statistics.median(variants[0].wall)
    base_cpu = statistics.median(variants[0].cpu)
    rows = []
    for variant in variants:
        wall, cpu = statistics.median(variant.wall), statistics.median(variant.cpu)
        rows.append(
            {
                "variant": variant.name,
                "wall_ms": wall * 1e3,
                "cpu_ms": cpu * 1e3,
                "wall_ratio": wall / base_wall,
                "cpu_ratio": cpu / base_cpu,
                "wall_us_per_op": (wall - base_wall) / ops * 1e6,
                "cpu_us_per_op": (cpu - base_cpu) / ops * 1e6,
            }
        )
    return {"workload": work.name, "operators_per_step": ops, "rounds": rounds, "steps": steps, "rows": rows}


def _print(result: dict[str, Any]) -> None:
    print(f"\n## {result['workload']}: {result['operators_per_step']} aten operators per step\n")
    print("| variant | wall ms/step | x plain | us/op | CPU ms/step | x plain | us/op |")
    print("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(
            f"| {row['variant']} | {row['wall_ms']:.3f} | {row['wall_ratio']:.3f} | {row['wall_us_per_op']:+.2f} "
            f"| {row['cpu_ms']:.3f} | {row['cpu_ratio']:.3f} | {row['cpu_us_per_op']:+.2f} |"
        )
    fake = next(row for row in result["rows"] if row["variant"].startswith("fake device ("))
    verdict = "MET" if fake["wall_ratio"] <= TARGET else "MISSED"
    print(
        f"\n{fake['variant']}: {fake['wall_ratio']:.3f} x plain torch in wall time, {fake['cpu_ratio']:.3f} x in CPU "
        f"time (medians): target <= {TARGET} (wall) {verdict}"
    )


def _workloads(names: list[str]) -> Iterator[Workload]:
    for name in names:
        if name == "gpt":
            yield gpt_workload()
        elif name == "cnn":
            yield cnn_workload()
        else:
            raise SystemExit(f"unknown workload {name!r}: expected gpt or cnn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="gpt,cnn", help="comma-separated: gpt, cnn (default: both)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved samples per variant (default 30)")
    parser.add_argument("--steps", type=int, default=3, help="steps per sample (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("# Cost of the CPU fake device's memory accounting (keep-all training step)\n")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"torch threads {args.threads}, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "Baseline: plain torch, same model, same batches. Samples interleaved round-robin, "
        f"{args.rounds} samples of {args.steps} steps per variant, medians per step."
    )
    results = []
    for work in _workloads([w.strip() for w in args.workloads.split(",") if w.strip()]):
        result = run_workload(work, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
        _print(result)
        results.append(result)
    if args.json:
        meta = {"torch": torch.__version__, "python": platform.python_version(), "threads": args.threads}
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "target": TARGET, "workloads": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
