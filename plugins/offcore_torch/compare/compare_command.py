"""``offcore compare``: run keep / accumulate / checkpoint / offload / hybrid / planned side by side.

The main job: one fixed workload (the built-in TinyGPT), every strategy on the same
device, one table, and a decision per strategy under a memory budget, a throughput
floor and a quality gate::

    $ offcore compare                                   # fake device where keep-all does not fit
    $ offcore compare --batch 16 --seq-len 128 --strategies baseline,checkpoint,planned
    $ offcore compare --memory-budget 12MiB --min-throughput 2000 --max-loss-delta 0

torch is imported only when the command runs (``offcore --help`` works without it).
Writes ``--out`` (default ``./offcore-report``): ``compare.json``, ``compare.md``,
``trace.json`` (measured Chrome trace, one process per strategy),
``predicted-trace.json`` (the simulator's), ``trace-<strategy>-offload.json`` (the
activation plugin's own trace), ``memory.png`` and ``timeline.png`` (with matplotlib).
``--out`` is checked (created if missing, a file written and removed) before the run, and
any ``OSError`` while writing becomes a one-line :class:`~offcore.ConfigurationError`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from offcore.comparison import STRATEGIES, Comparison, Gates
from offcore.errors import ConfigurationError
from offcore.units import parse_bandwidth, parse_duration, parse_size

__all__ = ["prepare_out", "register", "run", "settings_from_args", "write_reports"]

_DEFAULTS: dict[str, Any] = {
    "backend": "cpu",
    "dtype": "float32",
    "batch": 8,
    "seq_len": 64,
    "layers": 4,
    "d_model": 64,
    "heads": 4,
    "vocab": 256,
    "dropout": 0.0,
    "warmup": 1,
    "iters": 3,
    "seed": 0,
}


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``compare`` to the ``offcore`` command line."""
    parser = subparsers.add_parser(
        "compare",
        help="compare keep / accumulate / checkpoint / offload / hybrid / planned on a fixed workload",
        description=(
            "Run the built-in GPT-style workload under every strategy on one device and print one table "
            "(status, peaks, step time, throughput, copies, exposed wait, U, equality with the baseline, "
            "predicted vs measured) and a decision per strategy. By default the device is the CPU fake "
            "device with 70% of the measured keep-all peak as its capacity (the baseline runs out of "
            "memory) and a PCIe-like link scaled to this machine's compute speed."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    work = parser.add_argument_group("workload (fixed for every strategy)")
    work.add_argument("--dtype", default=_DEFAULTS["dtype"], help="float32, bfloat16 or float64")
    work.add_argument("--batch", type=int, default=_DEFAULTS["batch"], help="sequences per optimizer step")
    work.add_argument("--seq-len", type=int, default=_DEFAULTS["seq_len"], help="tokens per sequence")
    work.add_argument("--layers", type=int, default=_DEFAULTS["layers"], help="transformer blocks (the planned layers)")
    work.add_argument("--d-model", type=int, default=_DEFAULTS["d_model"], help="model width")
    work.add_argument("--heads", type=int, default=_DEFAULTS["heads"], help="attention heads")
    work.add_argument("--vocab", type=int, default=_DEFAULTS["vocab"], help="vocabulary size")
    work.add_argument("--dropout", type=float, default=_DEFAULTS["dropout"], help="dropout probability")
    work.add_argument("--warmup", type=int, default=_DEFAULTS["warmup"], help="untimed steps before measuring")
    work.add_argument("--iters", type=int, default=_DEFAULTS["iters"], help="timed steps (the median counts)")
    work.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="model, data and dropout seed")
    run_group = parser.add_argument_group("strategies and device")
    run_group.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated subset of {','.join(STRATEGIES)}",
    )
    run_group.add_argument("--backend", default=_DEFAULTS["backend"], help="offcore backend (cpu = the fake device)")
    run_group.add_argument(
        "--capacity", default=None, help="device capacity, e.g. 24MiB (default: 70%% of the measured keep-all peak)"
    )
    run_group.add_argument("--d2h-bandwidth", default=None, help="fake link D2H, e.g. 8MiB/s (default: PCIe-like)")
    run_group.add_argument("--h2d-bandwidth", default=None, help="fake link H2D (default: PCIe-like)")
    run_group.add_argument("--latency", default="10us", help="fake link latency per copy")
    run_group.add_argument("--sanitize", action="store_true", help="fake device sanitizer on (slower)")
    run_group.add_argument(
        "--nvme-path",
        default=None,
        help="a directory on an NVMe disk: runs the row optimizer-offload-nvme (OffloadOptimizer(tier='nvme'), "
        "its links measured there); without it that row is skipped",
    )
    run_group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on the cpu fake device, else torch's)",
    )
    run_group.add_argument(
        "--no-probe-max-batch",
        action="store_true",
        help="do not measure each strategy's max batch by real training steps (a few extra steps per strategy); "
        "show the figure extrapolated from the measured peaks instead, marked ~N",
    )
    gates = parser.add_argument_group("decision gates")
    gates.add_argument("--memory-budget", default=None, help="device bytes a strategy may peak at (default: capacity)")
    gates.add_argument("--min-throughput", type=float, default=None, help="tokens/s a strategy must reach")
    gates.add_argument(
        "--max-loss-delta", type=float, default=1e-4, help="largest |loss - reference loss| accepted (0: bit-identical)"
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out", default="offcore-report", help="directory for the JSON/Markdown reports, traces, plots"
    )
    output.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    output.add_argument("--quiet", action="store_true", help="no progress bar and no notes on stderr")
    output.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    parser.set_defaults(run=run)
    return parser


def _size(value: str | None, what: str) -> int | None:
    return None if value is None else parse_size(value, what=what)


def settings_from_args(args: argparse.Namespace) -> tuple[Any, Gates]:
    """The runner's settings and the decision gates from parsed arguments (imports torch).

    Raises:
        ConfigurationError: any bad value, with what to change.
    """
    strategies = tuple(s.strip() for s in str(args.strategies).split(",") if s.strip())
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ConfigurationError(
            f"--strategies: unknown {', '.join(unknown) or '(empty)'}; choose from {','.join(STRATEGIES)}"
        )
    from offcore.registry import backends

    known = sorted(info.name for info in backends())
    if args.backend not in known:
        raise ConfigurationError(
            f"--backend {args.backend!r} is not a registered backend; choose one of {', '.join(known)}"
        )
    try:
        from offcore_torch.compare.compare import CompareSettings
    except ImportError as exc:  # torch missing
        raise ConfigurationError(
            f"offcore compare runs PyTorch training steps and needs torch ({exc}); install it: pip install 'offcore[torch]'"
        ) from None
    d2h = None if args.d2h_bandwidth is None else parse_bandwidth(args.d2h_bandwidth, what="--d2h-bandwidth")
    h2d = None if args.h2d_bandwidth is None else parse_bandwidth(args.h2d_bandwidth, what="--h2d-bandwidth")
    settings = CompareSettings(
        backend=args.backend,
        dtype=args.dtype,
        batch=args.batch,
        seq_len=args.seq_len,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        vocab=args.vocab,
        dropout=args.dropout,
        warmup=args.warmup,
        iters=args.iters,
        seed=args.seed,
        strategies=strategies,
        capacity=_size(args.capacity, "--capacity"),
        d2h_bandwidth=d2h,
        h2d_bandwidth=h2d,
        latency_s=parse_duration(args.latency, what="--latency"),
        sanitize=bool(args.sanitize),
        threads=args.threads,
        nvme_path=args.nvme_path,
        probe_max_batch=not args.no_probe_max_batch,
        observe=True,
    )
    gates = Gates(
        memory_budget=_size(args.memory_budget, "--memory-budget"),
        min_throughput=args.min_throughput,
        max_loss_delta=args.max_loss_delta,
    )
    return settings, gates


class _Progress:
    """A tqdm bar on stderr (a plain counter when tqdm is missing; nothing with --quiet)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.bar: Any = None
        self.quiet = quiet
        if quiet:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            print(
                "offcore compare: tqdm is not installed, no progress bar (pip install 'offcore[report]')",
                file=sys.stderr,
            )
            return
        self.bar = tqdm(total=total, desc="offcore compare", unit="step", file=sys.stderr, leave=False)

    def __call__(self, steps: int, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(steps)

    def log(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _chrome_trace(comparison: Comparison, *, predicted: bool) -> dict[str, Any]:
    """One Chrome-trace process per strategy, one thread per track (times relative to the step start)."""
    events: list[dict[str, Any]] = []
    tracks = {"compute": 1, "d2h": 2, "h2d": 3, "wait": 4}
    for pid, result in enumerate(comparison.results, start=1):
        spans = result.predicted_timeline if predicted else result.timeline
        if not spans:
            continue
        label = f"{result.name} ({'predicted' if predicted else 'measured'}): {result.plan}"
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}})
        for track, tid in tracks.items():
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": track}})
        for track, name, start, end in spans:
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tracks.get(track, 5),
                    "name": name,
                    "cat": track,
                    "ts": start * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                }
            )
        series = result.predicted_memory if predicted else result.memory_series
        for time_s, nbytes in series:
            events.append(
                {"ph": "C", "pid": pid, "name": "device bytes", "ts": time_s * 1e6, "args": {"bytes": nbytes}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def prepare_out(out: str | os.PathLike[str]) -> Path:
    """Make sure ``out`` is a writable directory (created if missing), before anything runs.

    Raises:
        ConfigurationError: ``out`` is a file, cannot be created, or cannot be written to.
    """
    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise ConfigurationError(f"--out {str(out)!r} is a file, not a directory; give a directory for the reports")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"--out {str(out)!r}: cannot create the report directory ({_reason(exc)}); choose a writable directory"
        ) from None
    try:  # os.access is not enough (root, read-only mounts, /proc): write a file and remove it
        handle, probe = tempfile.mkstemp(prefix=".offcore-write-check-", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigurationError(
            f"--out {str(out)!r}: cannot write into this directory ({_reason(exc)}); choose a writable directory"
        ) from None
    return directory


def _reason(exc: OSError) -> str:
    """An OSError on one line: its strerror, else its text."""
    return " ".join(str(exc.strerror or exc).split())


def write_reports(
    comparison: Comparison,
    out: str | os.PathLike[str],
    *,
    plots: bool = True,
    plugin_traces: dict[str, list[dict[str, Any]]] | None = None,
) -> tuple[list[Path], list[str]]:
    """Write the reports into ``out``; returns (files written, notes such as skipped plots).

    Raises:
        ConfigurationError: ``out`` is not a writable directory, or a file could not be
            written (disk full, permissions...); the message names the file.
    """
    directory = prepare_out(out)
    written: list[Path] = []
    notes: list[str] = []
    current = directory

    def dump(name: str, data: Any) -> None:
        nonlocal current
        current = path = directory / name
        path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
        written.append(path)

    try:
        dump("trace.json", _chrome_trace(comparison, predicted=False))
        dump("predicted-trace.json", _chrome_trace(comparison, predicted=True))
        for name, traces in (plugin_traces or {}).items():
            for index, trace in enumerate(traces):
                suffix = f"-{index}" if len(traces) > 1 else ""
                dump(f"trace-{name}-offload{suffix}.json", trace)
        images: list[str] = []
        if plots:
            from offcore.plots import matplotlib_available, plot_memory, plot_timeline

            if matplotlib_available():
                current = directory / "memory.png"
                plot_memory(comparison.results, current, capacity=comparison.device.get("capacity_bytes"))
                current = directory / "timeline.png"
                plot_timeline(comparison.results, current)
                images = ["memory.png", "timeline.png"]
                written.extend(directory / image for image in images)
            else:
                notes.append("plots skipped: matplotlib is not installed (pip install 'offcore[report]')")
        dump("compare.json", comparison.to_json())
        dump("compare.md", comparison.markdown(images=images))
    except OSError as exc:
        raise ConfigurationError(
            f"--out {str(out)!r}: cannot write {current} ({_reason(exc)}); free space or choose another directory"
        ) from None
    return written, notes


def run(args: argparse.Namespace) -> int:
    """Run the comparison, print the table and decisions, write the reports."""
    settings, gates = settings_from_args(args)
    prepare_out(args.out)  # a bad --out fails now, not after the whole comparison ran
    from offcore_torch.compare.compare import run_compare

    total = settings.total_steps
    progress = _Progress(total, bool(args.quiet))
    try:
        comparison = run_compare(settings, gates=gates, progress=progress, log=progress.log)
    finally:
        progress.close()
    written: list[Path] = []
    notes: list[str] = []
    failure: ConfigurationError | None = None
    try:
        written, notes = write_reports(
            comparison, args.out, plots=not args.no_plots, plugin_traces=comparison.plugin_traces
        )
    except ConfigurationError as exc:  # the results are still printed below, then the error
        failure = exc
    if args.json:
        print(comparison.to_json())
    else:
        print(comparison.text())
        print()
        for line in notes:
            print(line)
        if written:
            print(f"reports: {', '.join(str(p) for p in written)}")
    if failure is not None:
        raise failure
    return 0
