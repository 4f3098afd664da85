"""offcore under DDP and FSDP2, 2 ranks on the CPU fake device: per-rank device peak and step time.

One run, two ranks (gloo on 127.0.0.1), each with its own fake device per variant; the
variants are interleaved step by step (round-robin, the order rotating every round), and each
figure is the median over the measured rounds of the slower rank's step:

- ``ddp/none`` (DDP's baseline) and ``fsdp/none`` (FSDP2's baseline): plain AdamW on the device.
- ``/act``: ``offload_activations`` around forward.
- ``/opt``: the optimizer on the host: DDP with ``OffloadOptimizer`` + ``attach_ddp`` (reduced
  buckets to the host from the communication hook), FSDP2 with ``FSDPOffloadOptimizer`` (local shards).
- ``/both``: activation and optimizer offload together.
- ``fsdp/cpu_offload_policy``: FSDP2's own ``CPUOffloadPolicy`` (sharded parameters, gradients
  and AdamW state on the host, the optimizer stepping on the host). On the fake device its
  host<->device copies are free (a CPU ``.to("cpu")`` is a no-op) and its sharded gradients stay
  counted as device memory, so its time is a floor for it and its peak slightly high.

Step time is conservative for offcore: each step ends when its copies have landed
(``opt.synchronize()`` / ``device.synchronize()``), so the H2D copies of the updated parameters do
not overlap the next forward as they do in training. The cost floor printed per variant is the
emulated link time of the bytes the step moved (``bytes / bandwidth``; the link is duplex). Ratios
are against the same engine's ``none`` variant.

Run::

    .venv/bin/python benchmarks/distributed.py                       # a few minutes on 2 busy cores
    .venv/bin/python benchmarks/distributed.py --small --rounds 3     # a quick look
    .venv/bin/python benchmarks/distributed.py --json /tmp/dist.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ENGINES = ("ddp", "fsdp")
MODES = ("none", "act", "opt", "both")
VARIANTS = [f"{e}/{m}" for e in ENGINES for m in MODES] + ["fsdp/cpu_offload_policy"]
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def _config(args: argparse.Namespace) -> Any:
    from offcore_torch.models import GPTConfig

    if args.small:
        return GPTConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, dropout=0.0)
    return GPTConfig(vocab_size=2048, d_model=256, n_heads=8, n_layers=4, seq_len=128, dropout=0.0)


class Variant:
    """One engine x offload combination on its own fake device (built once, stepped every round)."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int, world: int) -> None:
        import offcore_torch
        from offcore_torch.distributed import FSDPOffloadOptimizer, attach_ddp
        from offcore_torch.models import TinyGPT, next_token_loss
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        import offcore

        self.name = name
        engine, mode = name.split("/")
        self.mode = mode
        self.act = mode in ("act", "both")
        self.host_policy = mode == "cpu_offload_policy"
        bw = args.bandwidth
        self.device = offcore.device("cpu", capacity="8GiB", h2d_bandwidth=bw, d2h_bandwidth=bw, latency="10us")
        self.cfg = cfg = _config(args)
        self.batch = args.batch
        self.loss = next_token_loss
        self.offcore = offcore_torch
        model = TinyGPT(cfg, seed=0)
        build = contextlib.nullcontext() if self.host_policy else self.device
        with build:  # CPUOffloadPolicy: the sharded parameters and the optimizer live on the host
            if not self.host_policy:
                model = self.device.adopt(model)
            if engine == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
            else:
                mesh = init_device_mesh("cpu", (world,))
                options: dict[str, Any] = {"mesh": mesh}
                if self.host_policy:
                    options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
                for block in model.blocks:
                    fully_shard(block, **options)
                model = fully_shard(model, **options)
            self.model = model
            self.offloaded_opt = mode in ("opt", "both")
            if self.offloaded_opt and engine == "ddp":
                self.opt: Any = offcore_torch.OffloadOptimizer(
                    model.parameters(), torch.optim.AdamW, device=self.device, **ADAMW
                )
                attach_ddp(model, self.opt)
            elif self.offloaded_opt:
                self.opt = FSDPOffloadOptimizer(model, torch.optim.AdamW, device=self.device, **ADAMW)
            else:
                self.opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        self.rank = rank

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(7919 * step + self.rank)
        tokens = torch.randint(0, self.cfg.vocab_size, (self.batch, self.cfg.seq_len + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(self, step: int) -> float:
        """One training step; seconds until its copies landed."""
        idx, targets = self._batch(step)
        began = time.perf_counter()
        with self.device:
            if self.act:
                with self.offcore.offload_activations(self.device) as _handle:
                    loss = self.loss(self.model(idx), targets)
            else:
                loss = self.loss(self.model(idx), targets)
            loss.backward()
            if not self.host_policy:
                self.opt.step()
                self.opt.zero_grad()
        if self.host_policy:
            self.opt.step()
            self.opt.zero_grad()
        if self.offloaded_opt:
            self.opt.synchronize()
        self.device.synchronize()
        return time.perf_counter() - began

    def close(self) -> None:
        if self.offloaded_opt:
            self.opt.close()
        self.device.close()


def _link_bytes(device: Any) -> dict[str, int]:
    copies = device.ledger.snapshot()["copies"]
    return {k: int(v["bytes"]) for k, v in copies.items()}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        variants = [Variant(name, args, rank, world) for name in args.variants]
        for variant in variants:  # warm-up (FSDP2 lazy init, DDP bucket rebuild, prefetch learning)
            for step in range(args.warmup):
                variant.step(step)
            variant.device.reset_peak_memory_stats()
        before = {v.name: _link_bytes(v.device) for v in variants}
        times: dict[str, list[float]] = {v.name: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                dist.barrier()
                seconds = torch.tensor([variant.step(args.warmup + r)], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's step
                times[variant.name].append(float(seconds))
        result = {}
        for variant in variants:
            moved = _link_bytes(variant.device)
            per_step = {k: (moved.get(k, 0) - before[variant.name].get(k, 0)) / args.rounds for k in moved}
            stats = variant.device.memory_stats()
            result[variant.name] = {
                "step_s": times[variant.name],
                "peak_bytes": int(stats.peak_allocated_bytes),
                "allocated_bytes": int(stats.allocated_bytes),
                "link_bytes_per_step": per_step,
            }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        for variant in variants:
            variant.close()
        dist.destroy_process_group()
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    except BaseException:
        Path(out + f".err{rank}").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def _launch(args: argparse.Namespace, world: int = 2) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, out), daemon=True) for r in range(world)]
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                proc.start()
            running = {p.sentinel: p for p in procs}
            while running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(f"benchmark ran past --timeout {args.timeout} s; ranks killed")
                for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
                    proc = running.pop(sentinel)
                    proc.join()
                    if proc.exitcode != 0:
                        errors = "".join(p.read_text() for p in Path(tmp).glob("result.json.err*"))
                        raise SystemExit(f"a rank failed (exit {proc.exitcode}):\n{errors}")
        finally:
            for proc in procs:
                if proc.pid is not None and proc.is_alive():
                    proc.kill()
                if proc.pid is not None:
                    proc.join(timeout=30)
        return json.loads(Path(out).read_text())


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (a quick look)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7, help="measured steps per variant (interleaved)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bandwidth", default="16GiB/s", help="the fake device's link, per direction")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    from offcore.units import parse_bandwidth

    bandwidth = parse_bandwidth(args.bandwidth)
    ranks = _launch(args)
    cfg = _config(args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"2 ranks (gloo, 127.0.0.1), CPU fake device per rank, link {args.bandwidth} per direction; TinyGPT "
        f"d_model={cfg.d_model} layers={cfg.n_layers} seq={cfg.seq_len} vocab={cfg.vocab_size} batch={args.batch}/rank; "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up steps; load average {load:.2f} "
        f"on {os.cpu_count()} CPUs ({platform.machine()})"
    )
    header = (
        f"{'variant':<26}{'step ms':>9}{'x base':>8}{'floor ms':>9}"
        f"{'peak MiB r0':>12}{'peak MiB r1':>12}{'x base':>8}{'end MiB r0':>11}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for name in args.variants:
        per_rank = [r[name] for r in ranks]
        step = statistics.median(per_rank[0]["step_s"])  # the same list on both ranks (all-reduced max)
        engine = name.split("/")[0]
        base_name = f"{engine}/none"
        base = ranks[0].get(base_name)
        base_step = statistics.median(base["step_s"]) if base else float("nan")
        base_peak = max(r[base_name]["peak_bytes"] for r in ranks) if base else float("nan")
        peak = max(r["peak_bytes"] for r in per_rank)
        moved = per_rank[0]["link_bytes_per_step"]
        floor = max(moved.values(), default=0) / bandwidth  # duplex: the busier direction bounds it
        summary[name] = {
            "step_ms_median": step * 1e3,
            "step_ratio_vs_none": step / base_step,
            "floor_ms": floor * 1e3,
            "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
            "peak_ratio_vs_none": peak / base_peak,
            "end_allocated_bytes_per_rank": [r["allocated_bytes"] for r in per_rank],
            "link_bytes_per_step_rank0": moved,
            "step_s_rounds": per_rank[0]["step_s"],
        }
        print(
            f"{name:<26}{step * 1e3:9.1f}{step / base_step:8.2f}{floor * 1e3:9.2f}"
            f"{_mib(per_rank[0]['peak_bytes']):>12}{_mib(per_rank[1]['peak_bytes']):>12}{peak / base_peak:8.2f}"
            f"{_mib(per_rank[0]['allocated_bytes']):>11}"
        )
    print(
        "baseline: the same engine's 'none' (AdamW on the device). 'floor': link time of the bytes moved per step. "
        "Step times are conservative for offcore (copies waited at the end of each step)."
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load, "variants": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
