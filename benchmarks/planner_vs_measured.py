"""Planner vs the named strategies over a grid of capacities: is "planned" the best that runs?

For two workload shapes (the ``offcore compare`` default, and a wider one) this profiles
the step once (as ``offcore compare`` does: calibrated, the PCIe-like link, the measured
micro-step overhead), then for each capacity of a grid between 50 % and 95 % of the
keep-all peak forms every strategy's plan exactly as ``offcore compare --capacity C``
does (``offcore_torch.compare.strategies.plan_strategies``: one profile for every plan). Every
named plan's device peak is measured alone on a fresh fake device and, as ``offcore
compare`` does once the named strategies have run, "planned" is re-planned with those
measured peaks when one fits a capacity the model says it exceeds (Note [Measured peaks]
in offcore/sim/planner.py). Every distinct plan of the grid is then trained on one fake
device, all of them alive at once and **interleaved** round by round (a rotating order,
so a drift of host load hits them alike); its step time is the median over the rounds.

Targets, at every grid point:

- predicted: planned ≤ 1.02 × the best prediction among the strategies that fit, as the
  planner knew when it chose (the named strategies by their measured peaks: they ran first);
- measured: planned ≤ 1.10 × the best median among the strategies whose measured peak fits
  (those that ran at that capacity).

    .venv/bin/python benchmarks/planner_vs_measured.py --rounds 9 --json planner_vs_measured.json --plot planner.png

Not a test: the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from offcore.comparison import STRATEGIES  # noqa: E402
from offcore.units import format_bytes  # noqa: E402

PREDICTED_TARGET = 1.02
MEASURED_TARGET = 1.10
SHAPES = {
    "default": {"d_model": 64, "seq_len": 64},
    "wide": {"d_model": 128, "seq_len": 64},
}
FRACTIONS = (0.50, 0.57, 0.64, 0.71, 0.78, 0.85, 0.95)
NAMES = STRATEGIES  # every strategy offcore compare runs, in its order


def run_shape(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from offcore_torch.compare.compare import measure_microbatch_overhead, profile_workload
    from offcore_torch.compare.executor import PlanExecutor
    from offcore_torch.compare.link import measure_link
    from offcore_torch.compare.runs import _optimizer_for, _release_optimizer
    from offcore_torch.compare.settings import CompareSettings, build_workload, pcie_like_bandwidths
    from offcore_torch.compare.strategies import plan_strategies

    import offcore

    settings = CompareSettings(batch=args.batch, layers=args.layers, iters=2, observe=False, **SHAPES[shape])
    work = build_workload(settings)
    unlimited = offcore.device("cpu", capacity="1TiB", d2h_bandwidth="inf", h2d_bandwidth="inf", latency=0)
    first = profile_workload(unlimited, work, settings)
    overhead = measure_microbatch_overhead(unlimited, work, settings, lambda steps, label: None)
    layers = first.profile.layers
    d2h, h2d, _ = pcie_like_bandwidths(
        sum(lp.saved_bytes for lp in layers) / len(layers), first.profile.forward_s / len(layers)
    )
    device = offcore.device("cpu", capacity="64GiB", d2h_bandwidth=d2h, h2d_bandwidth=h2d, latency=settings.latency_s)
    with device:
        link = measure_link(device, repeats=2)
    keep_all_peak = first.peak_bytes
    torch_device = torch.device(device.torch_device)

    def own_peak(step_plan: Any) -> int:
        """The plan's device peak alone on a fresh fake device (the largest of three steps after a warm-up)."""
        alone = offcore.device(
            "cpu", capacity="64GiB", d2h_bandwidth=d2h, h2d_bandwidth=h2d, latency=settings.latency_s
        )
        alone_device = torch.device(alone.torch_device)
        # the optimizer and parameters as offcore compare sets them up for the plan (plan.optimizer,
        # plan.parameters: OffloadOptimizer, offload_parameters), not a device AdamW for every plan
        with alone:
            model, optimizer, handle = _optimizer_for(work.build(settings.seed), step_plan, alone, settings)
        peak = 0
        try:
            with PlanExecutor(model, step_plan, alone) as executor:
                for step in range(4):
                    with alone:
                        batch = work.make_batch(step, alone_device)
                    alone.synchronize()
                    alone.reset_peak_memory_stats()
                    with alone:
                        executor.forward_backward(batch, work.loss)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        alone.synchronize()
                    if step:
                        peak = max(peak, int(alone.memory_stats().peak_allocated_bytes))
        finally:
            _release_optimizer(optimizer, handle)
        del model, optimizer, handle, executor
        alone.close()
        return peak

    peaks: dict[str, int] = {}
    points = []
    distinct: dict[str, Any] = {}
    for fraction in FRACTIONS:
        capacity = int(fraction * keep_all_peak)
        profile = first.profile.with_link(**link.as_profile_fields(), capacity_bytes=capacity)
        measurement = replace(first, profile=profile, link=link)
        chosen = plan_strategies(settings, profile, measurement, capacity, overhead)
        for name, choice in chosen.items():
            if choice.plan is not None and name != "planned" and choice.plan.describe() not in peaks:
                peaks[choice.plan.describe()] = own_peak(choice.plan)
        # as offcore compare does once the named strategies ran: trust their measured peaks
        # (Note [Measured peaks]) when one fits though the model predicted it would not
        named = {n: c for n, c in chosen.items() if n != "planned" and c.plan is not None}
        surprise = any(
            peaks[c.plan.describe()] <= capacity < c.predicted_peak_bytes
            or c.predicted_peak_bytes < peaks[c.plan.describe()]
            and peaks[c.plan.describe()] > capacity - (capacity >> 4)
            for c in named.values()
        )
        planned_by = "model"
        if surprise and "planned" in chosen:
            again = plan_strategies(
                settings,
                profile,
                measurement,
                capacity,
                overhead,
                measured_peaks={c.plan: peaks[c.plan.describe()] for c in named.values()},
            )["planned"]
            before = chosen["planned"].plan
            if (again.plan is None) != (before is None) or (
                again.plan is not None and before is not None and again.plan.describe() != before.describe()
            ):
                chosen["planned"], planned_by = again, "measured peaks"
        row = {"fraction": fraction, "capacity_bytes": capacity, "planned_by": planned_by, "strategies": {}}
        for name in NAMES:
            choice = chosen.get(name)
            if choice is None or choice.plan is None:
                continue
            key = choice.plan.describe()
            distinct[key] = choice.plan
            if key not in peaks:
                peaks[key] = own_peak(choice.plan)
            row["strategies"][name] = {
                "plan": key,
                "predicted_s": choice.predicted_s,
                "predicted_peak_bytes": choice.predicted_peak_bytes,
            }
        points.append(row)
    print(
        f"[{shape}] keep-all peak {format_bytes(keep_all_peak)}, overhead {overhead * 1e3:.1f} ms, "
        f"{len(distinct)} distinct plans: {', '.join(distinct)}",
        file=sys.stderr,
    )

    state: dict[str, Any] = {}
    handles: list[tuple[Any, Any]] = []
    for key, step_plan in distinct.items():
        with device:
            model, optimizer, handle = _optimizer_for(work.build(settings.seed), step_plan, device, settings)
        handles.append((optimizer, handle))
        state[key] = (model, optimizer, PlanExecutor(model, step_plan, device).__enter__())

    def one_step(key: str, step: int) -> float:
        model, optimizer, executor = state[key]
        with device:
            batch = work.make_batch(step, torch_device)
        device.synchronize()
        torch.manual_seed(step)
        start = time.perf_counter()
        with device:
            executor.forward_backward(batch, work.loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            device.synchronize()
        return time.perf_counter() - start

    keys = list(state)
    for step in range(args.warmup):
        for key in keys:
            one_step(key, step)
    times: dict[str, list[float]] = {key: [] for key in keys}
    for round_index in range(args.rounds):
        order = keys[round_index % len(keys) :] + keys[: round_index % len(keys)]
        for key in order:
            times[key].append(one_step(key, args.warmup + round_index))
    for _, _, executor in state.values():
        executor.__exit__(None, None, None)
    for optimizer, handle in handles:
        _release_optimizer(optimizer, handle)
    state.clear()
    device.close()
    unlimited.close()

    for row in points:
        capacity = row["capacity_bytes"]
        for figures in row["strategies"].values():
            figures["measured_s"] = statistics.median(times[figures["plan"]])
            figures["measured_iqr_s"] = (
                statistics.quantiles(times[figures["plan"]], n=4)[::2] if len(times[figures["plan"]]) > 1 else []
            )
            figures["measured_peak_bytes"] = peaks[figures["plan"]]
            figures["predicted_fits"] = figures["predicted_peak_bytes"] <= capacity
            figures["measured_fits"] = figures["measured_peak_bytes"] <= capacity
        strategies = row["strategies"]
        planned = strategies.get("planned")
        # "fits" as the planner knew it when "planned" was chosen: the named strategies had run
        # (their measured peaks), planned itself by the model
        predicted_fit = [
            f["predicted_s"]
            for n, f in strategies.items()
            if (f["predicted_fits"] if n == "planned" else f["measured_fits"])
        ]
        measured_fit = [f["measured_s"] for f in strategies.values() if f["measured_fits"]]
        row["predicted_ratio"] = planned["predicted_s"] / min(predicted_fit) if planned and predicted_fit else None
        row["measured_ratio"] = (
            planned["measured_s"] / min(measured_fit) if planned and planned["measured_fits"] and measured_fit else None
        )
        row["planned_ran"] = bool(planned and planned["measured_fits"])
        row["any_ran"] = bool(measured_fit)
    return {
        "shape": shape,
        "workload": settings.workload(),
        "keep_all_peak_bytes": keep_all_peak,
        "overhead_s": overhead,
        "d2h_bandwidth": link.d2h_bandwidth,
        "h2d_bandwidth": link.h2d_bandwidth,
        "points": points,
    }


def met(row: dict[str, Any]) -> bool:
    """Both targets at one grid point; planned must run wherever another strategy does."""
    pr, mr = row["predicted_ratio"], row["measured_ratio"]
    runs = row["planned_ran"] or not row["any_ran"]
    return runs and (pr is None or pr <= PREDICTED_TARGET) and (mr is None or mr <= MEASURED_TARGET)


def print_table(result: dict[str, Any]) -> list[str]:
    lines = [
        f"\n{result['shape']}: d_model {result['workload']['d_model']}, seq {result['workload']['seq_len']}, "
        f"keep-all peak {format_bytes(result['keep_all_peak_bytes'])}, micro-step overhead "
        f"{result['overhead_s'] * 1e3:.1f} ms",
        "",
        "| capacity | planned plan | planned pred / meas ms | best other (pred, model fit) | best other (meas, ran) "
        "| pred ratio | meas ratio | planned by | targets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["points"]:
        s = row["strategies"]
        p = s.get("planned")
        others = {n: f for n, f in s.items() if n != "planned"}
        best_pred = min(((f["predicted_s"], n) for n, f in others.items() if f["predicted_fits"]), default=(None, "-"))
        best_meas = min(((f["measured_s"], n) for n, f in others.items() if f["measured_fits"]), default=(None, "-"))
        pr, mr = row["predicted_ratio"], row["measured_ratio"]
        ok = met(row)
        lines.append(
            f"| {row['fraction']:.0%} ({format_bytes(row['capacity_bytes'])}) | "
            + (
                f"`{p['plan'].split(' prefetch')[0]}` | {p['predicted_s'] * 1e3:.1f} / {p['measured_s'] * 1e3:.1f} | "
                if p
                else "- | - | "
            )
            + (f"{best_pred[1]} {best_pred[0] * 1e3:.1f} | " if best_pred[0] else "- | ")
            + (f"{best_meas[1]} {best_meas[0] * 1e3:.1f} | " if best_meas[0] else "- | ")
            + (f"{pr:.3f} | " if pr else "- | ")
            + (f"{mr:.3f} | " if mr else "- | ")
            + f"{row['planned_by']} | "
            + ("met" if ok else "**missed**")
            + " |"
        )
    for line in lines:
        print(line)
    return lines


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    palette = plt.get_cmap("tab10").colors
    colours = {name: "#000000" if name == "planned" else palette[i % len(palette)] for i, name in enumerate(NAMES)}
    for ax, result in zip(axes[0], results, strict=True):
        for name in NAMES:
            xs, measured, predicted = [], [], []
            for row in result["points"]:
                f = row["strategies"].get(name)
                if f is None or not f["measured_fits"]:
                    continue
                xs.append(row["capacity_bytes"] / 2**20)
                measured.append(f["measured_s"] * 1e3)
                predicted.append(f["predicted_s"] * 1e3 if f["predicted_fits"] else float("nan"))
            if not xs:
                continue
            width = 2.5 if name == "planned" else 1.2
            ax.plot(xs, measured, "-o", color=colours[name], lw=width, ms=3, label=f"{name} (measured)")
            ax.plot(xs, predicted, "--", color=colours[name], lw=0.9, alpha=0.7)
        ax.set_title(f"{result['shape']} (d_model {result['workload']['d_model']}); dashed: predicted, where it fits")
        ax.set_xlabel("capacity (MiB)")
        ax.set_ylabel("step time (ms, median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="default,wide", help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9, help="timed steps of every plan, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="step time vs capacity, one line per strategy (PNG)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    results = [run_shape(shape, args) for shape in args.shapes.split(",")]
    missed = 0
    for result in results:
        print_table(result)
        missed += sum(not met(row) for row in result["points"])
    print(f"\nload average while it ran: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    print(f"{missed} grid point(s) missed a target")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "results": results}, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
