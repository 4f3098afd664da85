"""How large a model trains on a fixed device, and what streaming parameters costs (issue 12).

Part 1, **scale** (CPU fake device, fixed capacity, sanitizer off): the widest GPT-style model
(:class:`offcore_torch.models.TinyGPT`, depth fixed, width grown in steps of ``--quantum``)
for which one training step (forward, backward, optimizer update) runs at all, per variant:

- **keep-all** (the baseline): the model on the device, ``torch.optim.AdamW`` on the device;
- **params**: ``offload_parameters`` (the model built on the host goes straight to pinned
  memory); AdamW still on the device (its step fetches every parameter);
- **params + activations**: also ``offload_activations`` around forward;
- **params + activations + OffloadOptimizer (public API)**: ``OffloadOptimizer(...,
  params_on_host=False)`` composed through the public APIs only (its upload after the step
  brings every parameter to the device at once);
- **all kinds (OffloadOptimizer)**: parameters, activations, gradients and optimizer state off
  the device with the real ``OffloadOptimizer`` working on the handle's host copies (found on
  the parameters): gradients D2H as backward makes them, the host step updates the host
  copies in place, no upload after it, the next forward streams them (Note [Parameters on the
  host with offload_parameters] in plugins/offcore_torch/optimizer/optimizer.py);
- **all kinds (host-step stand-in, floor)**: the same with a bare host AdamW over
  ``handle.host_tensor`` (gradients D2H synchronously, ``handle.host_updated()``): what the
  composition cannot beat, kept as a labelled floor.

A width "fits" when the step raises no out-of-memory error; the search doubles the width,
then bisects. Reported: width, parameter count, the ratio to keep-all's count (target for
all four kinds: >= 10x), and the device's peak during the step.

Part 2, **step time** (``--time``): keep-all against parameter offload at one width, the
emulated H2D link sized so each block's parameters copy in ``--fill`` (0.8) of that block's
measured forward time (calibrated in the same run: the fastest of 8 forwards); a step is forward + backward (the
optimizer update is the same for both and left out). Interleaved rounds, medians, ratio to
keep-all (target <= 1.15; also the median of each round's ratio to the keep-all round before it,
which load drifting over the run moves less, and the process CPU per step), the same with ``persist_below`` (parameters under 64 KiB -- biases,
LayerNorms -- stay on the device, as ZeRO-3's persistence threshold), the cost floor:
parameter offload over an unlimited link, and ``prefetch="asap"`` on the sized link (the copies
start as soon as the default budget has room instead of at their planned deadline: how much of the
gap is the schedule's exposed waits rather than offcore's CPU).

Run::

    .venv/bin/python benchmarks/scale.py                    # both parts
    .venv/bin/python benchmarks/scale.py --part scale --capacity 32MiB --json /tmp/scale.json
    .venv/bin/python benchmarks/scale.py --part time --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import offcore_torch
import torch
from offcore_torch.models import GPTConfig, TinyGPT, next_token_loss
from offcore_torch.parameters.parameters import offload_parameters
from offcore_torch.runtime import runtime_for

import offcore
from offcore.errors import CapacityExceededError
from offcore.units import format_bytes, parse_size

PUBLIC = "params+activations+OffloadOptimizer (public API)"
ALL_KINDS = "all kinds (OffloadOptimizer)"
STAND_IN = "all kinds (host-step stand-in, floor)"
VARIANTS = ("keep-all", "params", "params+activations", PUBLIC, ALL_KINDS, STAND_IN)


def config(width: int, args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, d_model=width, n_heads=args.heads, n_layers=args.depth, seq_len=args.seq, dropout=0.0
    )


def batch(step: int, cfg: GPTConfig, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class HostStep:
    """Gradients D2H as backward makes them, AdamW over the handle's host copies (no H2D after the step)."""

    def __init__(self, model: torch.nn.Module, handle: Any, dev: Any) -> None:
        self.dev, self.handle = dev, handle
        self.runtime = runtime_for(dev)
        self.params = list(model.parameters())
        self.host = [handle.host_tensor(p) for p in self.params]
        self.grads = [torch.zeros_like(h) for h in self.host]  # host memory: made outside 'with dev:'
        for h, g in zip(self.host, self.grads, strict=True):
            h.grad = g
        self.opt = torch.optim.AdamW(self.host, lr=1e-3)
        self.hooks = [p.register_post_accumulate_grad_hook(self._land) for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def _land(self, param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        d2h = self.runtime.d2h_stream
        d2h.wait_stream(self.dev.current_stream())
        self.dev.copy_(self.grads[self.index[id(param)]], grad, stream=d2h).synchronize()
        param.grad = None

    def step(self) -> None:  # outside 'with dev:': the optimizer's state is host memory
        self.opt.step()
        self.handle.host_updated()

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (CapacityExceededError, torch.OutOfMemoryError)) or "out of memory" in str(exc).lower()


def try_step(variant: str, width: int, args: argparse.Namespace) -> tuple[bool, int, int]:
    """(fits, parameter count, device peak bytes) of one training step of ``variant`` at ``width``."""
    cfg = config(width, args)
    dev = offcore.device("cpu", capacity=args.capacity, h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    torch.manual_seed(0)
    model = TinyGPT(cfg, seed=0)  # on the host
    count = sum(p.numel() for p in model.parameters())
    handle: Any = None
    extra: Any = None
    try:
        with dev:
            if variant == "keep-all":
                dev.adopt(model)  # as .to(device)
            else:
                handle = offload_parameters(model, dev, budget=args.budget)
            if variant in (PUBLIC, ALL_KINDS):
                extra = offcore_torch.OffloadOptimizer(
                    model.parameters(),
                    torch.optim.AdamW,
                    device=dev,
                    lr=1e-3,
                    params_on_host=None if variant == ALL_KINDS else False,
                )
                opt: Any = extra
            elif variant != STAND_IN:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if variant == STAND_IN:
            extra = HostStep(model, handle, dev)
        dev.reset_peak_memory_stats()
        with dev:
            idx, targets = batch(0, cfg, args.batch)
            if "activations" in variant or variant.startswith("all"):
                with offcore_torch.offload_activations(dev, min_bytes="16KiB"):
                    loss = next_token_loss(model(idx), targets)
            else:
                loss = next_token_loss(model(idx), targets)
            loss.backward()
            del loss
            if variant != STAND_IN:
                opt.step()
                opt.zero_grad()
        if variant == STAND_IN:
            extra.step()
        offcore_torch.synchronize(dev)
        return True, count, dev.memory_stats().peak_allocated_bytes
    except Exception as exc:  # out of memory: does not fit
        if not _is_oom(exc):
            raise
        return False, count, dev.memory_stats().peak_allocated_bytes
    finally:
        if isinstance(extra, HostStep):
            extra.close()
        elif extra is not None:
            extra.close()
        if handle is not None:
            handle.discard()  # not remove(): the model need not fit on the device
        dev.close()


def largest(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    q = args.quantum
    fits: dict[int, tuple[bool, int, int]] = {}

    def fit(width: int) -> bool:
        if width not in fits:
            fits[width] = try_step(variant, width, args)
            print(f"  {variant:50s} width {width:5d}: {'fits' if fits[width][0] else 'OOM'}", file=sys.stderr)
        return fits[width][0]

    lo, hi = 0, q
    while fit(hi):
        lo, hi = hi, hi * 2
        if hi > args.max_width:
            break
    while hi - lo > q:
        mid = (lo + hi) // 2 // q * q
        if mid in (lo, hi):
            break
        if fit(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return {"variant": variant, "width": 0, "parameters": 0, "peak_bytes": 0}
    _, count, peak = fits[lo]
    return {"variant": variant, "width": lo, "parameters": count, "peak_bytes": peak}


def scale_table(rows: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """The scale rows (variant, width, parameters, ratio, peak) as fixed-width text or a Markdown table."""
    if markdown:
        # a blank line first: a Markdown table does not interrupt the caption line printed before it
        lines = ["", "| variant | width | parameters | x keep-all | device peak |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {r['variant']} | {r['width']} | {r['parameters']:,d} | {r['ratio']:.1f} | {format_bytes(r['peak_bytes'])} |"
            for r in rows
        ]
        return "\n".join(lines)
    lines = [f"{'variant':52s} {'width':>6s} {'parameters':>12s} {'x keep-all':>10s} {'device peak':>12s}"]
    lines += [
        f"{r['variant']:52s} {r['width']:6d} {r['parameters']:12,d} {r['ratio']:10.1f} {format_bytes(r['peak_bytes']):>12s}"
        for r in rows
    ]
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """The step-time rows as fixed-width text or a Markdown table."""
    lines = []
    if markdown:
        lines += [
            "",
            "| variant | step (ms) | x keep-all | paired x | CPU (ms) | prefetch hits | stalls | unplanned | wait (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for row in rows:
        med = row["median_s"]
        if markdown:
            copies = (
                f"{row['prefetch_hits']} | {row['stalls']} | {row['unplanned']} | {row['exposed_wait_s'] * 1e3:.1f}"
                if "stalls" in row
                else "- | - | - | -"
            )
            lines.append(
                f"| {row['variant']} | {med * 1e3:.2f} | {row['ratio']:.3f} | {row['paired_ratio']:.3f} | "
                f"{row['cpu_s'] * 1e3:.1f} | {copies} |"
            )
            continue
        extra = (
            f"  hits {row['prefetch_hits']} stalls {row['stalls']} unplanned {row['unplanned']} "
            f"wait {row['exposed_wait_s'] * 1e3:.1f} ms"
            if "stalls" in row
            else ""
        )
        lines.append(
            f"{row['variant']:34s} {med * 1e3:8.2f} ms  {row['ratio']:.3f} x keep-all (paired {row['paired_ratio']:.3f} x)  "
            f"cpu {row['cpu_s'] * 1e3:7.1f} ms{extra}"
        )
    return "\n".join(lines)


def part_scale(args: argparse.Namespace) -> dict[str, Any]:
    rows = [largest(v, args) for v in args.variants]
    base = rows[0]["parameters"] or 1
    print(
        f"\nscale: capacity {args.capacity}, depth {args.depth}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}"
    )
    for row in rows:
        row["ratio"] = row["parameters"] / base
    print(scale_table(rows, markdown=args.markdown))
    target = next((r for r in rows if r["variant"] == ALL_KINDS), None)
    if target is not None:
        ok = target["ratio"] >= 10
        print(f"target all kinds >= 10 x keep-all's parameters: {'MET' if ok else 'NOT MET'} ({target['ratio']:.1f} x)")
    return {"rows": rows}


# ------------------------------------------------------------------------------ step time
def part_time(args: argparse.Namespace) -> dict[str, Any]:
    cfg = config(args.time_width, args)
    # calibrate in this run: keep-all's forward time, per block (the blocks hold all but the embeddings); the
    # fastest of 8 forwards: a loaded host only slows a forward down, and a link sized from a slowed one is
    # a fill well above --fill once the load eases (on a quiet host fastest and median agree)
    dev0 = offcore.device("cpu", capacity="8GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    torch.manual_seed(0)
    with dev0:
        model0 = TinyGPT(cfg, seed=0)
        times = []
        for s in range(args.warmup + 8):
            idx, targets = batch(s, cfg, args.time_batch)
            began = time.perf_counter()
            loss = next_token_loss(model0(idx), targets)
            times.append(time.perf_counter() - began)
            loss.backward()
            model0.zero_grad(set_to_none=True)
    block_bytes = sum(p.numel() * p.element_size() for p in model0.blocks[0].parameters())
    block_forward = min(times[args.warmup :]) / cfg.n_layers
    bandwidth = block_bytes / (args.fill * block_forward)
    dev0.close()

    def make(variant: str) -> tuple[Callable[[int], None], Any, Any]:
        limited = variant in ("params", "persist", "asap")
        link = {"h2d_bandwidth": bandwidth, "d2h_bandwidth": bandwidth} if limited else {}
        if not limited:
            link = {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf"}
        dev = offcore.device("cpu", capacity="8GiB", latency="10us", **link)
        torch.manual_seed(0)
        with dev:
            model = TinyGPT(cfg, seed=0)
            persist = args.persist_below if variant == "persist" else 0
            prefetch = "asap" if variant == "asap" else "deadline"
            handle = (
                offload_parameters(model, dev, persist_below=persist, prefetch=prefetch)
                if variant != "keep-all"
                else None
            )

        def step(s: int) -> None:
            with dev:
                idx, targets = batch(s, cfg, args.time_batch)
                next_token_loss(model(idx), targets).backward()
                model.zero_grad(set_to_none=True)

        return step, handle, dev

    variants = {
        "keep-all": make("keep-all"),
        "params": make("params"),
        f"params, persist_below={args.persist_below}": make("persist"),
        "params, unlimited link": make("floor"),
        "params, prefetch=asap": make("asap"),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # process CPU seconds per step (all threads)
    n = 0
    for step, _, _ in variants.values():
        for _ in range(args.warmup):
            step(n)
            n += 1
    names = list(variants)
    for r in range(args.rounds):
        turn = r % len(names)  # a rotated order each round: no variant always first or after another
        for name in names[turn:] + names[:turn]:
            step = variants[name][0]
            began, began_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                step(n)
                n += 1
            results[name].append((time.perf_counter() - began) / args.block)
            cpu[name].append((time.process_time() - began_cpu) / args.block)
    base = statistics.median(results["keep-all"])
    # each round's ratio to the keep-all block run just before it: load that drifts over the run moves both
    paired = {
        name: statistics.median(v / k for v, k in zip(values, results["keep-all"], strict=True))
        for name, values in results.items()
    }
    print(
        f"\nstep time (forward + backward): width {args.time_width}, depth {args.depth}, batch {args.time_batch}, "
        f"block forward {block_forward * 1e3:.2f} ms, block parameters {format_bytes(block_bytes)}, "
        f"H2D link {format_bytes(int(bandwidth))}/s (fill {args.fill})"
    )
    rows = []
    for name, values in results.items():
        med = statistics.median(values)
        row = {
            "variant": name,
            "median_s": med,
            "ratio": med / base,
            "paired_ratio": paired[name],
            "cpu_s": statistics.median(cpu[name]),
            "samples": values,
        }
        handle = variants[name][1]
        if handle is not None:
            st = handle.stats()
            row.update(
                prefetch_hits=st.prefetch_hits,
                stalls=st.stalls,
                unplanned=st.unplanned,
                exposed_wait_s=st.exposed_wait_s,
            )
        rows.append(row)
    print(time_table(rows, markdown=args.markdown))
    for row in rows[1:3]:
        ratio = row["ratio"]
        print(f"target {row['variant']} <= 1.15 x keep-all: {'MET' if ratio <= 1.15 else 'NOT MET'} ({ratio:.3f} x)")
    print(f"load average while it ran: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for _, handle, dev in variants.values():
        if handle is not None:
            handle.remove()
        dev.close()
    return {"bandwidth": bandwidth, "block_forward_s": block_forward, "block_bytes": block_bytes, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("scale", "time", "both"), default="both")
    parser.add_argument("--capacity", default="32MiB")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--quantum", type=int, default=32, help="width step (default 32)")
    parser.add_argument("--max-width", type=int, default=4096)
    parser.add_argument("--budget", default=None, help="offload_parameters budget (default: 2 x largest module)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--time-width", type=int, default=384)
    parser.add_argument("--time-batch", type=int, default=8)
    parser.add_argument("--fill", type=float, default=0.8)
    parser.add_argument(
        "--persist-below",
        default="64KiB",
        help="the persist_below of the third step-time row (biases and norms stay on the device; default 64KiB)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.budget is not None:
        args.budget = parse_size(args.budget, what="budget")
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"machine": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__}
    if args.part in ("scale", "both"):
        out["scale"] = part_scale(args)
    if args.part in ("time", "both"):
        out["time"] = part_time(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
