"""A hardware check in one call: suites, copy-bandwidth sweep, side-by-side step time.

Run on a machine with the backend (under 6 minutes on one GPU)::

    python benchmarks/hw_check.py --backend cuda --out hw-report

It writes ``hw_check.json`` and ``hw_check.md`` to ``--out`` with three parts:

1. **Suites**: the conformance, equivalence and peak-memory suites with the backend
   required (``pytest tests/backends tests/torch --offcore-backend=B
   --offcore-require-backend``); pass/fail/skip counts.
2. **Copy-bandwidth sweep** (1 MiB – 4 GiB by default): a raw ``Tensor.copy_``
   baseline on a side stream (pinned and pageable host memory) and offcore's own
   ``copy_`` from its pinned pool; one direction at a time and both at once. Each
   figure is the median of ``--repeats`` copies timed with device events.
3. **Step time side by side** on a GPT-style model at two sequence lengths:
   keep-all (the baseline), ``torch.autograd.graph.save_on_cpu(pin_memory=True)``,
   offcore (deadline prefetch), and torchtune's ``OffloadActivations`` when it can be
   imported. Step-time ratio to keep-all (median of several steps), peak device
   memory (the backend's ``max_memory_allocated``), exposed wait, and offcore's
   in-training copy throughput as a fraction of the sweep's raw pinned figure.

``--backend cpu`` runs the same script on the fake device with small sizes, which is
how the script itself is tested without hardware (``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import offcore
from offcore.units import format_bytes, parse_size

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- helpers


def device_module(backend: str) -> Any:
    """``torch.cuda`` / ``torch.npu``; None for the fake device."""
    return getattr(torch, backend, None) if backend in ("cuda", "npu") else None


def log(message: str) -> None:
    print(f"[hw_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(dev: Any, stream: Any, fn: Callable[[], None]) -> float:
    """Seconds ``fn``'s work on ``stream`` took, measured with the backend's timing events."""
    start, end = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


# --------------------------------------------------------------------------- 1. suites


def run_suites(backend: str, out: Path, timeout_s: int) -> dict[str, Any]:
    junit = out / "suites.xml"
    cmd = [
        sys.executable, "-m", "pytest", "tests/backends", "tests/torch", "-q", "-p", "no:cacheprovider",
        f"--offcore-backend={backend}", "--offcore-require-backend", f"--junitxml={junit}",
    ]  # fmt: skip
    log("suites: " + " ".join(cmd[1:]))
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        tail, rc = (proc.stdout + proc.stderr)[-4000:], proc.returncode
    except subprocess.TimeoutExpired as exc:
        tail, rc = f"timed out after {timeout_s}s\n{(exc.stdout or b'')[-4000:]!r}", -1
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": time.perf_counter() - started,
            **counts, "tail": tail}  # fmt: skip


# --------------------------------------------------------------------------- 2. bandwidth sweep


def sweep(dev: Any, backend: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    mod = device_module(backend)
    pool = dev.host_pool(max(sizes) * 2 + 64 * MiB, pinned=True)
    streams = dev.new_stream(), dev.new_stream()
    rows = []
    for size in sizes:
        log(f"sweep {format_bytes(size)}")
        rows.append(sweep_one(dev, mod, pool, streams, size, repeats))
    pool.trim()
    return rows


def sweep_one(dev: Any, mod: Any, pool: Any, streams: tuple[Any, Any], size: int, repeats: int) -> dict[str, Any]:
    """Bandwidths (bytes/s) of one size: raw torch baseline, offcore, both directions at once."""
    s_h2d, s_d2h = streams
    with dev:
        device_in = dev.allocate(size, offcore.Tier.DEVICE)
        device_out = dev.allocate(size, offcore.Tier.DEVICE)
    pinned_in, pinned_out = pool.acquire(size), pool.acquire(size)
    pageable = torch.empty(size, dtype=torch.uint8)
    row: dict[str, Any] = {"bytes": size}

    def median_bw(fn: Callable[[], None], stream: Any) -> float:
        seconds = statistics.median(timed(dev, stream, fn) for _ in range(repeats))
        return size / seconds if seconds > 0 else float("inf")

    def raw(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Callable[[], None]:
        def go() -> None:
            with mod.stream(stream):
                dst.copy_(src, non_blocking=True)

        return go

    if mod is not None:  # raw torch baseline: copy_ on a side stream, no offcore involved
        row["raw_pinned_h2d"] = median_bw(raw(device_in, pinned_in.view, s_h2d), s_h2d)
        row["raw_pinned_d2h"] = median_bw(raw(pinned_out.view, device_out, s_d2h), s_d2h)
        row["raw_pageable_h2d"] = median_bw(raw(device_in, pageable, s_h2d), s_h2d)
        row["raw_pageable_d2h"] = median_bw(raw(pageable, device_out, s_d2h), s_d2h)
    row["offcore_h2d"] = median_bw(lambda: dev.copy_(device_in, pinned_in.view, stream=s_h2d), s_h2d)
    row["offcore_d2h"] = median_bw(lambda: dev.copy_(pinned_out.view, device_out, stream=s_d2h), s_d2h)

    both_h2d, both_d2h = [], []  # both directions at once, each timed on its own stream
    for _ in range(repeats):
        events = [dev.new_event(enable_timing=True) for _ in range(4)]
        events[0].record(s_h2d)
        events[2].record(s_d2h)
        dev.copy_(device_in, pinned_in.view, stream=s_h2d)
        dev.copy_(pinned_out.view, device_out, stream=s_d2h)
        events[1].record(s_h2d)
        events[3].record(s_d2h)
        events[1].synchronize()
        events[3].synchronize()
        both_h2d.append(events[0].elapsed_time(events[1]) / 1e3)
        both_d2h.append(events[2].elapsed_time(events[3]) / 1e3)
    row["offcore_both_h2d"] = size / statistics.median(both_h2d) if statistics.median(both_h2d) else float("inf")
    row["offcore_both_d2h"] = size / statistics.median(both_d2h) if statistics.median(both_d2h) else float("inf")
    pool.release(pinned_in)
    pool.release(pinned_out)
    return row


# --------------------------------------------------------------------------- 3. step time


@contextlib.contextmanager
def torchtune_offload(model: torch.nn.Module) -> Iterator[Any]:
    from torchtune.training import OffloadActivations  # type: ignore[import-not-found]

    with OffloadActivations(use_streams=True) as ctx:
        yield ctx


def step_variants(
    dev: Any, backend: str, min_bytes: str
) -> dict[str, Callable[[], contextlib.AbstractContextManager[Any]]]:
    import offcore_torch

    pin = backend != "cpu"
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "keep-all": contextlib.nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin),
        "offcore (deadline)": lambda: offcore_torch.offload_activations(dev, min_bytes=min_bytes, prefetch="deadline"),
    }
    try:
        import torchtune.training  # noqa: F401  # type: ignore[import-not-found]

        variants["torchtune OffloadActivations"] = lambda: torchtune_offload(None)  # type: ignore[arg-type]
    except Exception as exc:  # torchtune is optional; say why it is missing
        log(f"torchtune not importable ({type(exc).__name__}: {exc}); skipping its column")
    return variants


def step_time(dev: Any, backend: str, seq_len: int, cfg_kwargs: dict[str, Any], batch: int, steps: int,
              warmup: int, min_bytes: str = "1MiB") -> dict[str, Any]:  # fmt: skip
    from offcore_torch.models import GPTConfig, gpt_workload

    cfg = GPTConfig(seq_len=seq_len, **cfg_kwargs)
    work = gpt_workload(cfg, batch_size=batch)
    tdev = torch.device(dev.torch_device)
    dtype = torch.bfloat16 if backend != "cpu" else torch.float32
    results: dict[str, Any] = {"seq_len": seq_len, "batch": batch, "config": cfg.__dict__, "variants": {}}
    for name, make in step_variants(dev, backend, min_bytes).items():
        log(f"step time seq={seq_len} {name}")
        with dev:
            model = work.build(0).to(tdev, dtype=dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            times, peaks, waits, d2h, h2d = [], [], [], [], []
            status = "ok"
            try:
                for step in range(warmup + steps):
                    batch_t = work.make_batch(step, tdev)
                    dev.synchronize()
                    dev.reset_peak_memory_stats()
                    start = time.perf_counter()
                    with make() as handle:
                        loss = work.loss(model, batch_t)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    dev.synchronize()
                    elapsed = time.perf_counter() - start
                    if step >= warmup:
                        times.append(elapsed)
                        peaks.append(dev.memory_stats().peak_allocated_bytes)
                        if handle is not None and hasattr(handle, "stats"):
                            st = handle.stats()
                            waits.append(float(st.exposed_wait_s))
                            d2h.append(float(getattr(st, "d2h_bandwidth", 0.0) or 0.0))
                            h2d.append(float(getattr(st, "h2d_bandwidth", 0.0) or 0.0))
                    del loss, batch_t
            except Exception as exc:  # an OOM in one variant must not stop the others
                status = f"{type(exc).__name__}: {str(exc)[:200]}"
            del model, opt
        results["variants"][name] = {
            "status": status,
            "step_s": statistics.median(times) if times else None,
            "peak_bytes": max(peaks) if peaks else None,
            "exposed_wait_s": statistics.median(waits) if waits else None,
            "d2h_bandwidth": statistics.median(d2h) if d2h else None,
            "h2d_bandwidth": statistics.median(h2d) if h2d else None,
        }
    keep = results["variants"].get("keep-all", {}).get("step_s")
    for row in results["variants"].values():
        row["ratio_to_keep_all"] = row["step_s"] / keep if keep and row["step_s"] else None
    return results


# --------------------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    gbs = lambda v: "n/a" if v in (None, float("inf")) else f"{v / 1e9:.1f}"  # noqa: E731
    lines = [f"# offcore hardware check: {report['backend']} ({report['device_name']})", "",
             f"{report['date']}, torch {report['torch']}, python {report['python']}", ""]  # fmt: skip
    s = report.get("suites")
    if s:
        lines += [
            "## Suites",
            "",
            f"`{s['command']}`: {s['passed']} passed, {s['failures']} failed, "
            f"{s['errors']} errors, {s['skipped']} skipped (rc {s['returncode']}, {s['seconds']:.0f} s)",
            "",
        ]
    lines += ["## Copy bandwidth (GB/s, median)", "",
              "| size | raw pinned H2D | raw pinned D2H | raw pageable H2D | raw pageable D2H | offcore H2D | "
              "offcore D2H | both: H2D | both: D2H |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["sweep"]:
        lines.append(f"| {format_bytes(r['bytes'])} | {gbs(r.get('raw_pinned_h2d'))} | {gbs(r.get('raw_pinned_d2h'))} | "
                     f"{gbs(r.get('raw_pageable_h2d'))} | {gbs(r.get('raw_pageable_d2h'))} | {gbs(r['offcore_h2d'])} | "
                     f"{gbs(r['offcore_d2h'])} | {gbs(r['offcore_both_h2d'])} | {gbs(r['offcore_both_d2h'])} |")  # fmt: skip
    for res in report["step_time"]:
        lines += ["", f"## Step time, GPT-style, seq {res['seq_len']}, batch {res['batch']} (baseline: keep-all)", "",
                  "| variant | status | step (ms) | ratio | peak device | exposed wait (ms) | copy D2H / H2D GB/s |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, v in res["variants"].items():
            ms = f"{v['step_s'] * 1e3:.1f}" if v["step_s"] else "-"
            ratio = f"{v['ratio_to_keep_all']:.3f}" if v["ratio_to_keep_all"] else "-"
            peak = format_bytes(v["peak_bytes"]) if v["peak_bytes"] is not None else "-"
            wait = f"{v['exposed_wait_s'] * 1e3:.2f}" if v["exposed_wait_s"] is not None else "-"
            bw = f"{gbs(v['d2h_bandwidth'])} / {gbs(v['h2d_bandwidth'])}" if v["d2h_bandwidth"] else "-"
            lines.append(f"| {name} | {v['status']} | {ms} | {ratio} | {peak} | {wait} | {bw} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", help="cuda, npu or cpu (fake device, for testing the script)")
    parser.add_argument("--out", default="hw-report", help="output folder for hw_check.json / hw_check.md")
    parser.add_argument("--quick", action="store_true", help="small sizes and models (script self-test)")
    parser.add_argument("--skip-suites", action="store_true", help="do not run the pytest suites")
    parser.add_argument("--suite-timeout", type=int, default=170, help="seconds allowed for the suites")
    parser.add_argument("--sizes", default=None, help="comma-separated sweep sizes (default 1MiB..4GiB)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    elif args.quick:
        sizes = [1 * MiB, 4 * MiB]
    else:
        sizes = [1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB, 4 * GiB]
    options: dict[str, Any] = {}
    if args.backend == "cpu":
        options = {"capacity": "4GiB", "h2d_bandwidth": "16GiB/s", "d2h_bandwidth": "16GiB/s"}
    dev = offcore.device(args.backend, **options)
    mod = device_module(args.backend)
    report: dict[str, Any] = {
        "backend": args.backend,
        "device_name": mod.get_device_name(dev.index) if mod is not None else "offcore CPU fake device",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if not args.skip_suites:
        report["suites"] = run_suites(args.backend, out, args.suite_timeout)
    report["sweep"] = sweep(dev, args.backend, sizes, args.repeats)
    if args.quick:
        cfg, batch, seqs, steps, warmup = (
            {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 128},
            2,
            [32, 64],
            2,
            1,
        )
    else:
        cfg, batch, seqs, steps, warmup = {"d_model": 2048, "n_heads": 16, "n_layers": 8, "vocab_size": 32000,
                                           "dropout": 0.0}, 4, [2048, 8192], 5, 2  # fmt: skip
    min_bytes = "4KiB" if args.quick else "1MiB"  # the quick model's tensors are small
    report["step_time"] = [step_time(dev, args.backend, s, cfg, batch, steps, warmup, min_bytes) for s in seqs]
    raw = max((r.get("raw_pinned_d2h") or 0.0) for r in report["sweep"])
    for res in report["step_time"]:
        v = res["variants"].get("offcore (deadline)", {})
        if raw and v.get("d2h_bandwidth"):
            v["d2h_fraction_of_raw"] = v["d2h_bandwidth"] / raw
    (out / "hw_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "hw_check.md").write_text(markdown(report))
    print(markdown(report))
    close = getattr(dev, "close", None)
    if close is not None:
        close()
    suites = report.get("suites")
    return 0 if not suites or (suites["failures"] == 0 and suites["errors"] == 0 and suites["returncode"] == 0) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
