"""Per-object cost of activation offload: CPU time per saved tensor, offcore against save_on_cpu.

One run, one table per tensor size, on a chain of ``--tensors`` ``sin`` ops (each saves its
input: N saved tensors of one size, each its own storage) through forward and backward,
on a device whose link is unlimited (no emulated copy time, no latency), so what is left
is each variant's own work per saved tensor:

- **no hooks** (the baseline): autograd saves the tensors itself.
- **hooks only (no copies)**: ``torch.autograd.graph.save_on_cpu(pin_memory=False)`` exactly as
  torch ships it. On the CPU fake device its pack is ``tensor.cpu()``, which returns the
  same tensor: nothing is copied, so the row is the cost of a bare Python saved-tensor
  hook pair. On a real accelerator (``--device cuda``) it copies, as torch ships it.
- **save_on_cpu (same copies)** (the reference of the target): save_on_cpu's algorithm
  doing the copies offcore does: pack copies every saved tensor into a fresh pageable
  host buffer, unpack allocates a device tensor and copies it back, both synchronously
  on the compute stream, through the backend's ``copy_`` (so the fake device's per-copy
  bookkeeping is paid by both).
- **torchtune OffloadActivations** where ``torchtune`` is importable: its hooks as torchtune
  ships them (pinned memory and a copy stream only where CUDA is available; on the fake
  device its copy to the CPU returns the same tensor, like torch's save_on_cpu).
- **copies only (cost floor)**: ``activation_offload.py``'s ``CopiesOnly`` with no size
  filter: offcore's copies and nothing else (at pack a device-to-host copy on a copy stream,
  ordered after compute, into a host buffer reused across steps; at unpack a host-to-device
  copy into a fresh device buffer on a second copy stream, not waited for), the tensors kept
  on the device. ``offcore``'s ``ratio to the floor`` is its cost per saved tensor over this
  row's: what offcore's own bookkeeping adds to the copies it makes.
- **offcore**: ``offload_activations(dev, min_bytes=0, prefetch="deadline")``: pack, its
  D2H copy on the copy stream, landing, prefetch, unpack, release.

The figure is process CPU time (all threads: the compute thread and the fake device's copy
workers), which is what the per-tensor work costs the thread that launches kernels and is
steadier than wall time on a shared machine; wall time is shown too. Per variant:
``(median step - median no-hooks step) / N``. Variants are interleaved round-robin (the
order rotates every repetition) after a warm-up, each on its own device; medians of
``--reps`` steps. Target (issue 14): offcore <= 2 x save_on_cpu (same copies) per saved
tensor at every size, or <= 30 µs where that is larger.

Run::

    .venv/bin/python benchmarks/hook_overhead.py
    .venv/bin/python benchmarks/hook_overhead.py --sizes 16KiB 256KiB --tensors 400 --reps 15 --json /tmp/h.json
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import offcore_torch
import torch

import offcore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from activation_offload import CopiesOnly  # noqa: E402  (the cost floor: offcore's copies alone)

DEFAULT_SIZES = ("16KiB", "64KiB", "256KiB", "1MiB")
UNLIMITED = {"capacity": "16GiB", "h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0}
TARGET_RATIO = 2.0
TARGET_FLOOR_US = 30.0
REFERENCE = "save_on_cpu (same copies)"
FLOOR = "copies only (cost floor)"


class SaveOnCpuSameCopies(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu's algorithm through the backend: a synchronous copy to pageable host memory and back."""

    def __init__(self, device: Any) -> None:
        self.device = device
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.Tensor]:
        source = tensor.detach().contiguous()
        nbytes = source.numel() * source.element_size()
        host = self.device.allocate(nbytes, offcore.Tier.PAGEABLE)
        if nbytes:
            self.device.copy_(
                host, source.view(-1).view(torch.uint8), stream=self.device.current_stream()
            ).synchronize()
        return tensor.shape, tensor.dtype, host

    def _unpack(self, packed: tuple[torch.Size, torch.dtype, torch.Tensor]) -> torch.Tensor:
        shape, dtype, host = packed
        restored = torch.empty(shape, dtype=dtype, device=self.device.torch_device)
        if host.numel():
            stream = self.device.current_stream()
            self.device.copy_(restored.view(-1).view(torch.uint8), host, stream=stream).synchronize()
        return restored


def _torchtune_hooks() -> Callable[[Any], Any] | None:
    """torchtune's ``OffloadActivations`` (a context manager of saved-tensor hooks), if importable."""
    try:
        from torchtune.training import OffloadActivations  # type: ignore[import-not-found]
    except Exception:
        return None
    cuda = torch.cuda.is_available()
    return lambda device: OffloadActivations(use_pin_memory=cuda, use_streams=cuda)


@dataclass
class Variant:
    name: str
    make_context: Callable[[Any], contextlib.AbstractContextManager[Any]]
    device: Any = None
    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    offloaded: int = 0


def variants(backend: str) -> list[Variant]:
    chosen = [
        Variant("no hooks", lambda device: contextlib.nullcontext()),
        Variant(
            "hooks only (no copies)" if backend == "cpu" else "save_on_cpu (torch)",
            lambda device: torch.autograd.graph.save_on_cpu(pin_memory=backend != "cpu"),
        ),
        Variant(REFERENCE, SaveOnCpuSameCopies),
    ]
    torchtune = _torchtune_hooks()
    if torchtune is not None:
        chosen.append(Variant("torchtune OffloadActivations", torchtune))
    chosen.append(Variant(FLOOR, lambda device: CopiesOnly(device, min_bytes="1")))
    chosen.append(
        Variant("offcore", lambda device: offcore_torch.offload_activations(device, min_bytes=0, prefetch="deadline"))
    )
    return chosen


def run_step(variant: Variant, x: torch.Tensor, tensors: int, *, record: bool) -> None:
    device = variant.device
    with device:
        device.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        context = variant.make_context(device)
        with context as entered:
            y = x * 1.0  # not a leaf: every sin below saves a fresh storage
            for _ in range(tensors):
                y = torch.sin(y)
            loss = y.sum()
        loss.backward()
        device.synchronize()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        handle = entered if entered is not None else context
        if record:
            variant.cpu_s.append(cpu)
            variant.wall_s.append(wall)
            if isinstance(handle, offcore_torch.OffloadHandle):
                variant.offloaded = handle.stats().offloaded_storages
        x.grad = None
        del loss, y


def measure_size(nbytes: int, args: argparse.Namespace) -> list[Variant]:
    chosen = variants(args.device)
    for variant in chosen:
        variant.device = offcore.device(args.device, **(UNLIMITED if args.device == "cpu" else {}))
    xs = []
    for variant in chosen:
        with variant.device:
            generator = torch.Generator().manual_seed(0)
            x = torch.randn(nbytes // 4, generator=generator).to(variant.device.torch_device).requires_grad_(True)
            xs.append(x)
    for rep in range(args.warmup + args.reps):
        order = list(range(len(chosen)))
        shift = rep % len(order)
        for i in order[shift:] + order[:shift]:
            run_step(chosen[i], xs[i], args.tensors, record=rep >= args.warmup)
    for variant in chosen:
        variant.device.close()
    return chosen


def summarise(nbytes: int, chosen: list[Variant], tensors: int) -> list[dict[str, Any]]:
    base_cpu = statistics.median(chosen[0].cpu_s)
    base_wall = statistics.median(chosen[0].wall_s)
    rows = []
    for variant in chosen:
        cpu, wall = statistics.median(variant.cpu_s), statistics.median(variant.wall_s)
        rows.append(
            {
                "size_bytes": nbytes,
                "variant": variant.name,
                "cpu_ms_per_step": cpu * 1e3,
                "wall_ms_per_step": wall * 1e3,
                "cpu_us_per_tensor": (cpu - base_cpu) / tensors * 1e6,
                "wall_us_per_tensor": (wall - base_wall) / tensors * 1e6,
                "offloaded_storages": variant.offloaded,
            }
        )
    reference = next(row for row in rows if row["variant"] == REFERENCE)["cpu_us_per_tensor"]
    floor = next(row for row in rows if row["variant"] == FLOOR)["cpu_us_per_tensor"]
    for row in rows:
        row["ratio_to_save_on_cpu"] = row["cpu_us_per_tensor"] / reference if reference > 0 else float("nan")
        row["ratio_to_floor"] = row["cpu_us_per_tensor"] / floor if floor > 0 else float("nan")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | CPU per step (ms) | wall per step (ms) | + CPU µs / saved tensor | + wall µs / saved tensor "
        "| ratio to save_on_cpu (same copies) | ratio to the cost floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['cpu_ms_per_step']:.1f} | {row['wall_ms_per_step']:.1f} | "
            f"{row['cpu_us_per_tensor']:+.1f} | {row['wall_us_per_tensor']:+.1f} | {row['ratio_to_save_on_cpu']:.2f} | "
            f"{row['ratio_to_floor']:.2f} |"
        )
    return "\n".join(lines)


def check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    offcore_row = next(row for row in rows if row["variant"] == "offcore")
    reference = next(row for row in rows if row["variant"] == REFERENCE)
    limit = max(TARGET_RATIO * reference["cpu_us_per_tensor"], TARGET_FLOOR_US)
    ok = offcore_row["cpu_us_per_tensor"] <= limit
    detail = (
        f"{offcore_row['cpu_us_per_tensor']:+.1f} µs vs limit {limit:.1f} µs "
        f"(max(2 x {reference['cpu_us_per_tensor']:+.1f}, {TARGET_FLOOR_US:.0f}))"
    )
    print(
        f"- {'MET ' if ok else 'MISSED'} offcore <= 2 x save_on_cpu (same copies) or <= 30 µs per saved tensor: {detail}"
    )
    return {"size_bytes": offcore_row["size_bytes"], "met": ok, "detail": detail}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", nargs="+", default=list(DEFAULT_SIZES), help="saved tensor sizes (default: %(default)s)"
    )
    parser.add_argument("--tensors", type=int, default=400, help="saved tensors per step (sin ops; default 400)")
    parser.add_argument("--reps", type=int, default=11, help="measured steps per variant (median; default 11)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--device", default="cpu", help="offcore backend (default: the CPU fake device)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.tensors < 1 or args.reps < 3 or args.warmup < 1:
        parser.error("--tensors must be positive, --reps at least 3 and --warmup at least 1")
    try:
        args.size_bytes = [offcore.parse_size(size, what="size") for size in args.sizes]
    except offcore.ConfigurationError as exc:
        parser.error(str(exc))
    if any(nbytes < 4 for nbytes in args.size_bytes):
        parser.error("every size must hold at least one float32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print("# CPU time per saved tensor: offcore against save_on_cpu\n")
    print(f"Command: {' '.join([sys.executable, *sys.argv])}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"Workload: a chain of {args.tensors} sin ops on float32 tensors (each saves one tensor), forward + backward; "
        f"device {args.device!r}{' (fake device, unlimited link, no latency)' if args.device == 'cpu' else ''}; "
        f"torch {torch.__version__}, {args.threads} intra-op thread(s), {platform.processor() or platform.machine()}, "
        f"load average {load:.2f}."
    )
    print(
        f"Baseline: no hooks. Figures: (median step - median no-hooks step) / {args.tensors}, medians of {args.reps} "
        f"steps after {args.warmup} warm-up, variants interleaved (rotating order); CPU = process CPU time, all threads."
    )
    if _torchtune_hooks() is None:
        print("torchtune is not importable here: its OffloadActivations row is left out.")
    results: dict[str, Any] = {"command": sys.argv, "tensors": args.tensors, "reps": args.reps, "sizes": []}
    for nbytes in args.size_bytes:
        chosen = measure_size(nbytes, args)
        rows = summarise(nbytes, chosen, args.tensors)
        print(f"\n## {offcore.format_bytes(nbytes)} per saved tensor\n")
        print(markdown(rows))
        print()
        verdict = check(rows)
        results["sizes"].append({"size_bytes": nbytes, "rows": rows, "target": verdict})
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
