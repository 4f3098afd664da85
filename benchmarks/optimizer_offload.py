"""Optimizer offload side by side on the CPU fake device: keep-all, offcore, the synchronous scheme.

One run, interleaved, medians (issue 11):

- **keep-all** (the baseline): ``torch.optim.AdamW(fused=True)`` over the device parameters;
  gradients and optimizer state stay on the device.
- **offcore**: ``OffloadOptimizer(AdamW, fused=True, accumulation_steps=1)``: each gradient's
  D2H starts from its post-accumulate-grad hook, its host step runs on a worker as soon as it
  landed, its H2D is issued right after; the next forward waits per parameter.
- **offcore + clip** (``--clip``): ``accumulation_steps=None`` and ``clip_grad_norm_`` before
  ``step()``: the D2H copies still overlap backward, the host steps and H2D copies cannot.
- **synchronous**: the scheme FSDP2's ``CPUOffloadPolicy`` uses: after backward every gradient
  goes D2H (waited for), one host step over all parameters, every parameter H2D (waited for)
  before the next forward. Same host optimizer, same link.

Scenario (a): an emulated link sized so that gradients + parameters take ``FILL`` (0.7) of
the keep-all backward time measured in a calibration (the target's precondition: they fit
0.8 x the backward window; the run prints the fill it really had). Targets: offcore's step
<= 1.10 x keep-all and <= 0.75 x synchronous.

Scenario (b): the host step, over the same host tensors (offcore's masters), every gradient
landed first: what offcore's ``step()`` costs the user (the call until it returns, plus the time
the next forward waits for the parameters it uploads) against one bare
``torch.optim.AdamW(fused=True).step()``, on an unlimited link. Target: <= 1.15 x bare. Also
printed: the uploads separately (when the last one landed; the same copies alone, the floor of
the copies), the next forward with the uploads in flight and with nothing in flight, and
parameters/s and GB/s (fp32 AdamW touches ~28 bytes per parameter) against the machine's memory
bandwidth measured in the same run (a large ``copy_``: read + write bytes / s).

Scenario (nvme) (``--scenario nvme``, issue 13): ``OffloadOptimizer.step()`` alone (gradients
landed first; its time includes waiting for the H2D copies) with the AdamW states **on NVMe**
(``tier="nvme"``) stepped with ``offcore.nvme.pipelined`` (read group i+1 / step i / write i-1),
against the same with the pipeline replaced by the sequential loop (read, step, write per group:
the baseline of the target >= 1.5 x), and against the states in host memory (``tier="host"``: the
floor, no I/O). ``--nvme-dir`` must be on the disk to measure (``/tmp`` may be tmpfs). With
``--master-weights`` the parameters are bf16 with fp32 masters, which go to NVMe with the states
(Note [Masters on NVMe]), and one more variant keeps them in host memory; every row gives the host
bytes the optimizer holds between steps (its ledger) and the bytes on NVMe.

On the fake device the "device" is the same CPU: keep-all's AdamW and offcore's host step
cost the same arithmetic, and offcore's host steps run on a second core under backward
(use ``--threads 1``, the default, so one core computes and one steps).

Run::

    .venv/bin/python benchmarks/optimizer_offload.py --json /tmp/opt.json --trace /tmp/opt_trace.json --png /tmp/opt.png
    .venv/bin/python benchmarks/optimizer_offload.py --small --rounds 3      # a quick look
    .venv/bin/python benchmarks/optimizer_offload.py --scenario nvme --nvme-dir /var/tmp --rounds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import offcore_torch
import torch
from offcore_torch.models import mlp_workload

import offcore
from offcore.kinds import Kind, Tier
from offcore.trace import TraceRecorder

FILL = 0.7
ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "fused": True}


@dataclass
class Variant:
    name: str
    device: Any
    model: torch.nn.Module
    step: Callable[[int], None]  # one training step (forward, backward, optimizer)
    finish: Callable[[], None]  # wait for everything in flight
    close: Callable[[], None] = lambda: None
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)


def make_device(link: dict[str, Any]) -> Any:
    return offcore.device("cpu", capacity="16GiB", **link)


def build(work: Any, device: Any) -> torch.nn.Module:
    model = work.build(0)
    with device:
        device.adopt(model)
    return model


def train_step(work: Any, model: torch.nn.Module, step: int, backward: list[float] | None = None) -> None:
    batch = work.make_batch(step, torch.device("cpu"))
    loss = work.loss(model, batch)
    began = time.perf_counter()
    loss.backward()
    if backward is not None:
        backward.append(time.perf_counter() - began)


def keep_all(work: Any, link: dict[str, Any]) -> Variant:
    dev = make_device(link)
    model = build(work, dev)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    v = Variant("keep-all", dev, model, lambda s: None, lambda: None)

    def step(s: int) -> None:
        with dev:
            train_step(work, model, s, v.backward)
            opt.step()
            opt.zero_grad()

    v.step = step
    return v


def offcore_variant(
    work: Any,
    link: dict[str, Any],
    *,
    clip: bool = False,
    trace: TraceRecorder | None = None,
    overlap_uploads: bool = False,
) -> Variant:
    dev = make_device(link)
    model = build(work, dev)
    with dev:
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            device=dev,
            accumulation_steps=None if clip else 1,
            trace=trace,
            overlap_uploads=overlap_uploads,
            **ADAMW,
        )
    name = "offcore + clip" if clip else "offcore"
    name += ", overlap_uploads=True" if overlap_uploads else ""
    v = Variant(name, dev, model, lambda s: None, opt.synchronize, opt.close)
    v.optimizer = opt  # type: ignore[attr-defined]

    def step(s: int) -> None:
        with dev:
            train_step(work, model, s, v.backward)
            if clip:
                offcore_torch.clip_grad_norm_(opt, 1.0)
            opt.step()
            opt.zero_grad()

    v.step = step
    return v


def synchronous(work: Any, link: dict[str, Any]) -> Variant:
    """FSDP2 CPU offload's scheme: all grads D2H after backward, host step, all params H2D before forward."""
    dev = make_device(link)
    model = build(work, dev)
    params = list(model.parameters())
    pool = dev.host_pool(2 * sum(2 * p.numel() * p.element_size() for p in params) + 512 * 2 * len(params) + 4096)
    buffers = [(pool.acquire(p.numel() * p.element_size()), pool.acquire(p.numel() * p.element_size())) for p in params]
    masters = [m.view.view(p.dtype).view(p.shape) for (m, _), p in zip(buffers, params, strict=True)]
    grads = [g.view.view(p.dtype).view(p.shape) for (_, g), p in zip(buffers, params, strict=True)]
    d2h, h2d = dev.new_stream(), dev.new_stream()
    for m, p in zip(masters, params, strict=True):
        dev.copy_(m, p.detach(), stream=d2h).synchronize()
    for m, g in zip(masters, grads, strict=True):
        m.grad = g
    opt = torch.optim.AdamW(masters, **ADAMW)
    v = Variant("synchronous", dev, model, lambda s: None, lambda: None)

    def step(s: int) -> None:
        with dev:
            train_step(work, model, s, v.backward)
            done = [dev.copy_(g, p.grad, stream=d2h) for g, p in zip(grads, params, strict=True)]
            for event in done:
                event.synchronize()
            for p in params:
                p.grad = None
            opt.step()
            done = [dev.copy_(p.detach(), m, stream=h2d) for p, m in zip(params, masters, strict=True)]
            for event in done:
                event.synchronize()

    def close() -> None:
        for m, g in buffers:
            pool.release(m)
            pool.release(g)

    v.step = step
    v.close = close
    return v


def measure(variants: list[Variant], *, rounds: int, block: int, warmup: int) -> None:
    step = 0
    for v in variants:
        for _ in range(warmup):
            v.step(step)
            step += 1
        v.finish()
        v.times.clear()
        v.backward.clear()
    for r in range(rounds):
        # interleaved: each round runs a block of steps of every variant, in a rotated order (none always first)
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            began, cpu = time.perf_counter(), time.process_time()
            for _ in range(block):
                v.step(step)
                step += 1
            v.finish()
            v.times.append((time.perf_counter() - began) / block)
            v.cpu.append((time.process_time() - cpu) / block)


def memory_bandwidth(nbytes: int = 256 * 1024**2, repeats: int = 5) -> float:
    """Bytes per second a large copy_ moves (read + write), median of ``repeats``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - began)
    return 2 * nbytes / statistics.median(times)


def host_step_scenario(work: Any, *, rounds: int, warmup: int = 2) -> dict[str, Any]:
    """(b): what offcore's ``step()`` costs the user against a bare fused AdamW step over the same host
    tensors (offcore's masters), every gradient landed first.

    Per round, in this order: forward + backward (the gradients land; drained), the bare step,
    ``opt.step()`` timed until it returns, ``opt.zero_grad()`` timed (a training loop's order: it
    issues step()'s uploads not issued yet, Note [zero_grad() issues step()'s uploads]), the next forward timed with the time it waited for
    parameters (the optimizer's ``"wait"`` spans: the uploads it blocked on or issued itself),
    ``opt.synchronize()`` (when the last upload landed, from the device's copy log), the same forward
    again with nothing in flight, and the uploads alone (the same H2D copies, nothing else running).
    What the user pays for the step is ``step()`` + ``zero_grad()`` + the next forward's waits; nothing is left out of
    the window. The target figure is the median over rounds of that sum over the bare step run
    right before it (adjacent in time, so both see the same load).
    """
    dev = make_device({"h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0})
    model = build(work, dev)
    trace = TraceRecorder()
    cpu = torch.device("cpu")
    with dev:
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, trace=trace, **ADAMW)
        params = list(model.parameters())
        masters = [opt.master(p) for p in params]
        scratch = [torch.empty_like(p) for p in params]  # device memory the uploads-alone floor writes into
        copy_stream = dev.new_stream()
        train_step(work, model, 0)
        opt.step()
        bare = torch.optim.AdamW(masters, **ADAMW)
        bare.step()  # its state exists from here on, as offcore's does
        opt.zero_grad()
        keys = (
            "step",
            "zero_grad",
            "waits",
            "user",
            "uploads_landed",
            "forward_uploading",
            "forward_clean",
            "bare",
            "copies",
            "copies_issue",
            "floor",
        )
        t: dict[str, list[float]] = {k: [] for k in keys}
        ratios: list[float] = []  # per round: (step() + waits) / the bare step next to it
        # every other round runs with overlap_uploads=True (the uploads in flight past step(), waited for per
        # parameter by the next forward: the default before Note [Parameters read after step() are the
        # stepped ones]): the two interleaved, each with its own ratios
        on_worker: dict[str, list[float]] = {"user": [], "ratio": []}
        try:
            for r in range(2 * (warmup + rounds)):
                worker_round = r % 4 in (1, 2)  # ABBA: as many even rounds as odd ones each (parity shows)
                opt._overlap_uploads = worker_round
                train_step(work, model, r)
                opt.host_grads()  # every gradient landed and accumulated: the step alone is timed
                # the bare step right before offcore's, over the same tensors with nothing in flight: the
                # two are adjacent in time, so each round's ratio sees the same load
                b = time.perf_counter()
                bare.step()
                bare_s = time.perf_counter() - b
                batch = work.make_batch(r + 1, cpu)  # made first: the next forward starts as soon as step() returns
                n_spans = len(trace.to_dict()["traceEvents"])
                dev.clear_copy_log()
                began = time.perf_counter()
                opt.step()
                step_s = time.perf_counter() - began
                z = time.perf_counter()
                opt.zero_grad()  # where a training loop calls it: between step() and the next forward
                zero_s = time.perf_counter() - z
                fwd = time.perf_counter()
                loss = work.loss(model, batch)
                forward_s = time.perf_counter() - fwd
                del loss
                events = trace.to_dict()["traceEvents"][n_spans:]
                waits = (  # the forward's per-parameter waits (overlap_uploads=True; by default step() waited)
                    sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith("param ")) / 1e6
                )
                opt.synchronize()
                landed = max((c["end"] for c in dev.copy_log() if c["direction"] == "h2d"), default=began) - began
                fwd = time.perf_counter()
                loss = work.loss(model, batch)
                clean_s = time.perf_counter() - fwd
                del loss
                opt.zero_grad()
                c = time.perf_counter()
                done = [dev.copy_(d, m, stream=copy_stream) for d, m in zip(scratch, masters, strict=True)]
                issue_s = time.perf_counter() - c  # issuing them: the device's own cost on the caller
                for event in done:
                    event.synchronize()
                copies_s = time.perf_counter() - c
                if r >= 2 * warmup and worker_round:
                    on_worker["user"].append(step_s + zero_s + waits)
                    on_worker["ratio"].append((step_s + zero_s + waits) / bare_s)
                elif r >= 2 * warmup:
                    values = (
                        step_s,
                        zero_s,
                        waits,
                        step_s + zero_s + waits,
                        landed,
                        forward_s,
                        clean_s,
                        bare_s,
                        copies_s,
                        issue_s,
                        bare_s + issue_s,
                    )
                    for k, v in zip(keys, values, strict=True):
                        t[k].append(v)
                    ratios.append((step_s + zero_s + waits) / bare_s)
        finally:
            opt._overlap_uploads = False
        opt.close()
        del scratch
    n = sum(p.numel() for p in params)
    bw = memory_bandwidth()
    med = {k: statistics.median(v) for k, v in t.items()}
    return {
        "parameters": n,
        "rounds": rounds,
        **{f"{k}_s": v for k, v in med.items()},
        "ratio": statistics.median(ratios),
        # the floor on this device: the bare step plus issuing the same uploads with copy_ (what any
        # binding pays the fake device to start them; on a GPU that is a few microseconds per copy)
        "floor_ratio": med["floor"] / med["bare"],
        "ratio_to_floor": med["user"] / med["floor"],
        "ratio_of_medians": med["user"] / med["bare"],
        "ratio_of_fastest": min(t["user"]) / min(t["bare"]),  # load only adds time: the quiet-machine estimate
        "ratios": ratios,
        "samples_s": t,  # every round's figures, in order (the medians above are of these)
        "on_worker_user_s": statistics.median(on_worker["user"]),
        "on_worker_ratio": statistics.median(on_worker["ratio"]),
        "on_worker_ratios": on_worker["ratio"],
        "step_ratio": med["step"] / med["bare"],
        "params_per_s": n / med["user"],
        "adamw_gb_per_s": 28 * n / med["user"] / 1e9,
        "bare_gb_per_s": 28 * n / med["bare"] / 1e9,
        "memory_gb_per_s": bw / 1e9,
    }


def timeline(variant: Variant, trace: TraceRecorder, work: Any, step: int) -> TraceRecorder:
    """One more offcore step with compute spans and the device's copies added to ``trace``."""
    dev = variant.device
    variant.optimizer.trace = trace  # type: ignore[attr-defined]
    dev.clear_copy_log()
    with dev:
        batch = work.make_batch(step, torch.device("cpu"))
        began = time.perf_counter()
        loss = work.loss(variant.model, batch)
        mid = time.perf_counter()
        trace.span("compute", "forward", began, mid - began)
        loss.backward()
        end = time.perf_counter()
        trace.span("compute", "backward", mid, end - mid)
        opt = variant.optimizer  # type: ignore[attr-defined]
        opt.step()
        trace.span("compute", "opt.step()", end, time.perf_counter() - end)
        opt.zero_grad()
        began = time.perf_counter()
        loss = work.loss(variant.model, work.make_batch(step + 1, torch.device("cpu")))
        trace.span("compute", "next forward", began, time.perf_counter() - began)
        opt.synchronize()
    for copy in dev.copy_log():
        trace.span(
            copy["direction"], f"{copy['bytes']} B", copy["start"], copy["end"] - copy["start"], bytes=copy["bytes"]
        )
    return trace


def draw(trace: TraceRecorder, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = trace.to_dict()["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in data if e.get("name") == "thread_name"}
    spans = [e for e in data if e["ph"] == "X"]
    order = [t for t in ("compute", "d2h", "host", "h2d", "wait") if t in names.values()]
    colours = {"compute": "#4C72B0", "d2h": "#DD8452", "host": "#937860", "h2d": "#C44E52", "wait": "#000000"}
    fig, ax = plt.subplots(figsize=(12, 3))
    phases = {"forward": "#4C72B0", "backward": "#55A868", "opt.step()": "#8172B2", "next forward": "#64B5CD"}
    for row, track in enumerate(order):
        for e in spans:
            if names.get(e["tid"]) != track:
                continue
            colour = phases.get(e["name"], colours[track]) if track == "compute" else colours[track]
            ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 0.02))], (row - 0.4, 0.8), color=colour)
            if track == "compute":
                ax.text(e["ts"] / 1e3, row, " " + e["name"], fontsize=7, va="center", color="white")
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("offcore optimizer offload: D2H, host step and H2D under backward (fake device)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check(label: str, ok: bool, detail: str) -> dict[str, Any]:
    print(f"  {'MET   ' if ok else 'MISSED'} {label}: {detail}")
    return {"target": label, "met": ok, "detail": detail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median; default 7)")
    parser.add_argument("--block", type=int, default=3, help="steps per variant per round (default 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="width 256, depth 4, batch 128")
    parser.add_argument("--clip", action="store_true", help="also run offcore with clip_grad_norm_")
    parser.add_argument("--scenario", choices=("a", "b", "both", "nvme"), default="both")
    parser.add_argument("--nvme-dir", metavar="DIR", help="scenario nvme: a directory on the disk (default /var/tmp)")
    parser.add_argument(
        "--master-weights",
        action="store_true",
        help="scenario nvme: bf16 parameters with fp32 masters (on NVMe, and in host memory as a variant)",
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--trace", metavar="PATH", help="Chrome trace of one offcore step (scenario a)")
    parser.add_argument("--png", metavar="PATH", help="PNG timeline of the same step (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.small:
        args.width, args.depth, args.batch = 256, 4, 128
    torch.set_num_threads(args.threads)
    work = mlp_workload(d_in=args.width, width=args.width, depth=args.depth, d_out=args.width, batch_size=args.batch)
    nbytes = sum(p.numel() * p.element_size() for p in work.build(0).parameters())

    out: dict[str, Any] = {"argv": sys.argv}
    checks: list[dict[str, Any]] = []
    if args.scenario in ("a", "both"):
        checks += scenario_a(args, work, nbytes, out)
    if args.scenario in ("b", "both"):
        checks += scenario_b(args, work, out)
    if args.scenario == "nvme":
        checks += scenario_nvme(args, work, out)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**out, "checks": checks}, fh, indent=2)
    return 0


def scenario_a(args: argparse.Namespace, work: Any, nbytes: int, out: dict[str, Any]) -> list[dict[str, Any]]:
    # calibration: keep-all's backward window
    calib = keep_all(work, {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf"})
    for s in range(8):
        calib.step(s)
    t_bwd = statistics.median(calib.backward[3:])
    bandwidth = 2 * nbytes / (FILL * t_bwd)  # gradients D2H + parameters H2D
    link = {"h2d_bandwidth": bandwidth, "d2h_bandwidth": bandwidth, "latency": "10us"}
    print(
        f"# optimizer offload: MLP width {args.width} depth {args.depth} batch {args.batch}, "
        f"{nbytes / 2**20:.1f} MiB of fp32 parameters; torch {torch.__version__}, {platform.machine()}, "
        f"{args.threads} thread(s)"
    )
    print(f"calibration: keep-all backward {t_bwd * 1e3:.1f} ms -> link {bandwidth / 2**30:.2f} GiB/s each way")

    trace = TraceRecorder()
    variants = [keep_all(work, link), offcore_variant(work, link, trace=trace), synchronous(work, link)]
    # the opt-in overlap of step()'s uploads with the next forward (the default before parameters read after
    # step() had to be the stepped ones): what the default's wait costs, in the same run
    variants.append(offcore_variant(work, link, overlap_uploads=True))
    if args.clip:
        variants.append(offcore_variant(work, link, clip=True))
    measure(variants, rounds=args.rounds, block=args.block, warmup=args.warmup)
    base = statistics.median(variants[0].times)
    sync = statistics.median(variants[2].times)
    bwd = statistics.median(variants[0].backward)
    fill = 2 * nbytes / bandwidth / bwd
    print("\n(a) step time, median of interleaved blocks (baseline: keep-all)\n")
    print("| variant | step ms | x keep-all | x synchronous | CPU s/step | backward ms |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for v in variants:
        t = statistics.median(v.times)
        row = {
            "variant": v.name,
            "step_s": t,
            "vs_keep_all": t / base,
            "vs_synchronous": t / sync,
            "cpu_s": statistics.median(v.cpu),
            "backward_s": statistics.median(v.backward),
        }
        rows.append(row)
        print(
            f"| {v.name} | {t * 1e3:.1f} | {t / base:.3f} | {t / sync:.3f} | {row['cpu_s']:.3f} | "
            f"{row['backward_s'] * 1e3:.1f} |"
        )
    print(f"\nprecondition: gradients + parameters take {fill:.2f} of keep-all's backward in this run (<= 0.8)")
    off = rows[1]
    print(f"default (step() waits for its uploads) / overlap_uploads=True: {off['step_s'] / rows[3]['step_s']:.3f}")
    out["default_vs_overlap"] = off["step_s"] / rows[3]["step_s"]
    checks = [
        check("(a) precondition fill <= 0.8", fill <= 0.8, f"{fill:.2f}"),
        check("(a) offcore <= 1.10 x keep-all", off["vs_keep_all"] <= 1.10, f"{off['vs_keep_all']:.3f}"),
        check("(a) offcore <= 0.75 x synchronous", off["vs_synchronous"] <= 0.75, f"{off['vs_synchronous']:.3f}"),
    ]
    if args.trace or args.png:
        trace = timeline(variants[1], TraceRecorder(), work, 10_000)
        variants[1].optimizer.trace = None  # type: ignore[attr-defined]
        if args.trace:
            trace.write(args.trace)
            print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
        if args.png:
            draw(trace, args.png)
            print(f"timeline: {args.png}")
    for v in variants:
        v.close()
    out["a"], out["fill"] = rows, fill
    return checks


def scenario_b(args: argparse.Namespace, work: Any, out: dict[str, Any]) -> list[dict[str, Any]]:
    b = host_step_scenario(work, rounds=args.rounds, warmup=args.warmup)
    print(
        f"\n(b) host step over the same host tensors, {b['parameters'] / 1e6:.1f} M fp32 parameters, median of "
        f"{b['rounds']} rounds (baseline: bare torch.optim.AdamW(fused=True).step(); every gradient landed first)\n"
    )
    bare = b["bare_s"]
    rows = [
        ("bare fused AdamW step (the floor)", bare),
        ("offcore step() until it returns", b["step_s"]),
        ("  + zero_grad() right after it", b["zero_grad_s"]),
        ("  + the next forward's waits for parameters", b["waits_s"]),
        ("**what the user pays: step() + zero_grad() + those waits**", b["user_s"]),
        ("  the same with overlap_uploads=True (uploads past step(); interleaved rounds)", b["on_worker_user_s"]),
        ("step() start until its last upload landed", b["uploads_landed_s"]),
        ("the uploads alone (same H2D copies, nothing else running)", b["copies_s"]),
        ("  issuing them alone (copy_ returns; the fake device's cost to start them)", b["copies_issue_s"]),
        ("the floor: bare step + issuing the uploads alone", b["floor_s"]),
        ("next forward, uploads in flight", b["forward_uploading_s"]),
        ("the same forward, nothing in flight", b["forward_clean_s"]),
    ]
    print("| measure | ms | x bare |")
    print("|---|---:|---:|")
    for name, value in rows:
        print(f"| {name} | {value * 1e3:.2f} | {value / bare:.3f} |")
    print(
        f"\noffcore: {b['params_per_s'] / 1e6:.0f} M params/s, {b['adamw_gb_per_s']:.1f} GB/s at 28 B/param "
        f"(bare {b['bare_gb_per_s']:.1f} GB/s) against {b['memory_gb_per_s']:.1f} GB/s memory bandwidth "
        "(copy_, read + write) measured in this run"
    )
    out["b"] = b
    print(
        f"per-round ratio (step() + zero_grad() + waits) / the bare step run right before it: median {b['ratio']:.3f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in b['ratios'])}); ratio of the medians {b['ratio_of_medians']:.3f}; "
        f"of the fastest rounds {b['ratio_of_fastest']:.3f} (load only adds time); with overlap_uploads=True "
        f"(interleaved rounds): median {b['on_worker_ratio']:.3f}"
    )
    print(
        f"cost floor on this device (bare step + issuing the uploads alone): {b['floor_ratio']:.3f} x bare; "
        f"offcore is {b['ratio_to_floor']:.3f} x that floor"
    )
    return [
        check(
            "(b) offcore step() + zero_grad() + waits <= 1.15 x bare fused AdamW",
            b["ratio"] <= 1.15,
            f"{b['ratio']:.3f}",
        )
    ]


def _sequential(
    groups: Any,
    read: Callable[[Any], Any],
    compute: Callable[[Any], Any],
    write: Callable[[Any], Any],
    *,
    release: Any,
    lookahead: int = 1,
) -> None:
    """The baseline of the pipelined step: read, step, write each group in turn (``lookahead`` unused)."""
    for group in groups:
        read(group).synchronize()
        compute(group)
        write(group).synchronize()
        release(group)


def scenario_nvme(args: argparse.Namespace, work: Any, out: dict[str, Any]) -> list[dict[str, Any]]:
    import offcore_torch.optimizer.nvme_states as nvme_states_module

    parent = args.nvme_dir or "/var/tmp"
    directory = tempfile.mkdtemp(prefix="offcore-bench-", dir=parent)
    link = {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0}
    setups: list[tuple[str, str, bool, dict[str, Any]]] = [
        ("host memory", "host", False, {}),
        ("nvme pipelined", "nvme", False, {}),
        ("nvme sequential", "nvme", True, {}),
    ]
    dtype = torch.bfloat16 if args.master_weights else torch.float32
    if args.master_weights:  # bf16 parameters, fp32 masters: on disk by default (Note [Masters on NVMe])
        setups.append(("nvme pipelined, masters in host memory", "nvme", False, {"nvme_masters": False}))
    runs = []
    for name, tier, sequential, options in setups:
        dev = make_device(link)
        model = work.build(0).to(dtype)
        with dev:
            dev.adopt(model)
            opt = offcore_torch.OffloadOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                device=dev,
                master_weights=args.master_weights,
                **({"tier": "nvme", "nvme": directory, **options} if tier == "nvme" else {}),
                **ADAMW,
            )
        runs.append({"name": name, "dev": dev, "model": model, "opt": opt, "sequential": sequential, "times": []})
    nvme_tier = runs[1]["opt"]._nvme
    step = 0
    for r in range(args.warmup + args.rounds):
        for run in runs:  # interleaved
            dev, model, opt = run["dev"], run["model"], run["opt"]
            with dev:
                batch = tuple(b.to(dtype) for b in work.make_batch(step, torch.device("cpu")))
                work.loss(model, batch).backward()
                opt.run_on_host(lambda: None)  # the gradients landed: only the step is timed
                real = nvme_states_module.pipelined
                if run["sequential"]:
                    nvme_states_module.pipelined = _sequential  # type: ignore[assignment]
                try:
                    began = time.perf_counter()
                    opt.step()
                    opt.synchronize()
                    elapsed = time.perf_counter() - began
                finally:
                    nvme_states_module.pipelined = real
                opt.zero_grad()
            if r >= args.warmup:
                run["times"].append(elapsed)
            step += 1
    state = 2 * sum(p.numel() * 4 for p in runs[0]["model"].parameters())
    print(
        f"\n(nvme) OffloadOptimizer.step() with AdamW states ({state / 2**20:.0f} MiB) on NVMe under {parent} "
        f"({'O_DIRECT' if nvme_tier.direct else 'buffered: ' + str(nvme_tier.direct_reason)}), median of "
        f"{args.rounds} interleaved rounds (baseline: nvme sequential)\n"
    )
    print("| variant | step ms | x sequential | host bytes between steps (ledger) | on NVMe |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(runs[2]["times"])
    rows = []
    host_tiers, kinds = (Tier.PINNED, Tier.PAGEABLE), (Kind.PARAMETER, Kind.GRADIENT, Kind.OPTIMIZER_STATE)
    for run in runs:
        t = statistics.median(run["times"])
        ledger = run["opt"].ledger
        host_bytes = sum(ledger.bytes(tier, kind) for tier in host_tiers for kind in kinds)
        disk = sum(ledger.bytes(Tier.NVME, kind) for kind in kinds)
        rows.append(
            {
                "variant": run["name"],
                "step_s": t,
                "speedup_vs_sequential": base / t,
                "host_bytes": host_bytes,
                "nvme_bytes": disk,
            }
        )
        print(
            f"| {run['name']} | {t * 1e3:.1f} | {base / t:.2f} | {host_bytes / 2**20:.1f} MiB | {disk / 2**20:.1f} MiB |"
        )
    host, seq = rows[0]["step_s"], base
    ceiling = seq / max(seq - host, host)  # perfect overlap of the I/O (seq - host) with the compute (host)
    print(
        f"\nceiling of any overlap here: sequential / max(I/O, compute) = {seq * 1e3:.1f} / "
        f"max({(seq - host) * 1e3:.1f}, {host * 1e3:.1f}) = {ceiling:.2f} x (compute: the host-memory step)"
    )
    rows[1]["ceiling"] = ceiling
    reads, writes = nvme_tier.reads, nvme_tier.writes
    print(
        f"\ntier totals (pipelined variant): read {reads.bytes / 2**20:.0f} MiB at {reads.bandwidth / 2**30:.2f} GiB/s, "
        f"wrote {writes.bytes / 2**20:.0f} MiB at {writes.bandwidth / 2**30:.2f} GiB/s"
    )
    for run in runs:
        run["opt"].close()
    out["nvme"] = rows
    speedup = rows[1]["speedup_vs_sequential"]
    return [check("(nvme) pipelined >= 1.5 x sequential", speedup >= 1.5, f"{speedup:.2f}")]


if __name__ == "__main__":
    sys.exit(main())
