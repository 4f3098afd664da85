"""What the sanitizer's operator check costs per torch operator (``check_ops``, Note [Operators checked
against copies in flight] in ``backends/offcore_cpu/sanitizer.py``).

Every variant runs the same small operators inside ``with dev:`` on a sanitized fake device, on a
thread of its own (the checking mode is per thread), interleaved round-robin (the order rotates
every round), so machine noise hits them alike; the table shows the median CPU time of the
sampling thread per operator (``time.thread_time``: time the thread waits for a core does not
count) and the difference to ``check_ops=False``:

- **off**: ``check_ops=False`` (the sanitizer poisons, no mode);
- **an empty mode (floor)**: ``check_ops=False`` plus a ``TorchDispatchMode`` that only calls the
  operator: what any Python dispatch mode costs;
- **on, none in flight**: the mode's call alone (its fast path: no copy in flight);
- **on, a copy in flight elsewhere**: a gated copy on other buffers: each tensor argument costs a
  storage look-up that misses;
- **on, same storage, other bytes**: the operator's tensors share the storage of a gated copy
  (a hit, then a byte-range test that finds no overlap; nothing is reported).

Operators: ``x.add_(1.0)`` (one tensor argument), ``torch.mul(a, b)`` (two), and
``torch._foreach_add_(xs, 1.0)`` over 16 tensors (counted as one operator). Run::

    .venv/bin/python benchmarks/op_check_overhead.py
    .venv/bin/python benchmarks/op_check_overhead.py --rounds 30 --ops 2000 --json /tmp/op_check.json

Timings on a shared machine are noisy: compare variants of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import offcore

FAST = {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0, "jitter": 0, "capacity": "256MiB"}
VARIANTS = (
    "off",
    "an empty mode (floor)",
    "on, none in flight",
    "on, a copy in flight elsewhere",
    "on, same storage, other bytes",
)


def _operators(base: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The timed operators over tensors viewing ``base`` (1 KiB floats each)."""
    x, a, b = base[0:256], base[256:512], base[512:768]
    xs = [base[768 + 16 * i : 768 + 16 * (i + 1)] for i in range(16)]
    return {
        "x.add_(1.0)": lambda: x.add_(1.0),
        "torch.mul(a, b)": lambda: torch.mul(a, b),
        "_foreach_add_(16 tensors)": lambda: torch._foreach_add_(xs, 1.0),
    }


@contextlib.contextmanager
def _variant(name: str, off: Any, on: Any) -> Iterator[torch.Tensor]:
    """Enter the variant's device (and hold a copy in flight where it says so); yields the operators' storage."""
    dev = off if name in ("off", "an empty mode (floor)") else on
    with dev:
        base = torch.zeros(1024 + 256)  # the operators use the first 1024 floats
        if name == "an empty mode (floor)":
            with _Mode():
                yield base
            return
        if name in ("off", "on, none in flight"):
            yield base
            return
        stream = dev.new_stream()
        if name == "on, a copy in flight elsewhere":
            dst, src = torch.zeros(256), torch.ones(256)
        else:
            dst, src = base[1024:], torch.ones(256)  # same storage, bytes the operators never touch
        with dev.gate(stream) as gate:
            dev.copy_(dst, src, stream=stream)
            gate.wait_held(1)
            yield base
        stream.synchronize()


def _sample(name: str, off: Any, on: Any, ops: int, out: dict[str, float]) -> None:
    with _variant(name, off, on) as base:
        for label, op in _operators(base).items():
            op()  # warm
            began = time.thread_time()  # CPU time of this thread: other processes' load does not count
            for _ in range(ops):
                op()
            out[label] = (time.thread_time() - began) / ops


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=1000, help="operators per sample")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    off = offcore.device("cpu", sanitize=True, check_ops=False, **FAST)
    with _Mode():  # made under a mode: the checking mode is pushed only where `with on:` runs
        on = offcore.device("cpu", sanitize=True, check_ops=True, **FAST)
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS[round_ % len(VARIANTS) :] + VARIANTS[: round_ % len(VARIANTS)]
        for name in order:
            result: dict[str, float] = {}
            thread = threading.Thread(target=_sample, args=(name, off, on, args.ops, result))
            thread.start()
            thread.join()
            for label, seconds in result.items():
                samples[name].setdefault(label, []).append(seconds)
    assert on.sanitizer_violations() == [], "the benchmark's operators never touch the copy's bytes"
    off.close()
    on.close()
    table: dict[str, Any] = {}
    print(f"{'operator':28s} {'variant':34s} {'us/op':>8s} {'+us/op vs off':>14s}")
    for label in samples["off"]:
        base = statistics.median(samples["off"][label])
        for name in VARIANTS:
            median = statistics.median(samples[name][label])
            table.setdefault(label, {})[name] = {"us_per_op": median * 1e6, "extra_us": (median - base) * 1e6}
            print(f"{label:28s} {name:34s} {median * 1e6:8.2f} {(median - base) * 1e6:+14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "ops": args.ops, "table": table}, f, indent=2)
    return table


class _Mode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    main()
