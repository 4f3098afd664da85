"""How good is the planner? Gap to the exact optimum and to the analytic bound, and a GPU-like case.

Part 1, generated instances: random layer stacks (seeded), budgets of 75 / 50 / 35 / 25 %
of the keep-all activation peak (on top of the resident bytes). For each: the greedy
planner's simulated step time, the exact optimum over the same plan space (exhaustive,
best-first with bound pruning), and the instance's analytic lower bound (MILP).
Targets: greedy ≤ 1.10 × exact; greedy ≤ 1.15 × lower bound.

Part 2, a GPU-like cost model: a LLaMA-7B-shaped stack (hidden 4096, 32 heads, FFN 11008,
32 layers, bf16, fused causal attention, batch 1) at sequence 4K and 32K on H200-class
compute (790 TFLOP/s bf16 dense peak × an achieved fraction, 45 % by default) with
PCIe Gen5 at 53 GB/s D2H and 35 GB/s H2D. Full recompute (per-block checkpointing) sets
the device budget; the planner's hybrid must fit the same budget. Target: hybrid ≥ 20 %
faster than full recompute.

    .venv/bin/python benchmarks/planner_gap.py [--instances 8] [--layers 8] [--json out.json]

Everything here is the simulator's prediction (a cost model), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from offcore.errors import CapacityExceededError
from offcore.sim import (
    LayerProfile,
    Plan,
    StepProfile,
    exhaustive_plan,
    instance_lower_bound,
    plan,
    simulate,
    transformer_step_profile,
)

FRACTIONS = (0.75, 0.50, 0.35, 0.25)
H200_BF16_PEAK = 790e12
MB = 10**6


def generated_instance(seed: int, n: int) -> StepProfile:
    """A random stack: mixed compute, bytes and recompute costs, link from tight to loose."""
    rng = random.Random(seed)
    mean_bytes = rng.uniform(100, 400) * MB
    layers = []
    for i in range(n):
        forward = rng.uniform(1e-3, 8e-3)
        saved = int(mean_bytes * rng.uniform(0.5, 1.5))
        layers.append(
            LayerProfile(
                f"l{i}",
                forward,
                forward * rng.uniform(1.6, 2.6),
                saved,
                recompute_s=forward * rng.uniform(0.4, 1.1),
                working_bytes=int(saved * rng.uniform(0.0, 0.05)),
                input_bytes=int(saved * rng.uniform(0.02, 0.08)),
            )
        )
    # bandwidth such that moving one average layer takes 0.5–3 × an average forward
    ratio = rng.uniform(0.5, 3.0)
    bandwidth = mean_bytes / (4.5e-3 * ratio)
    return StepProfile(
        layers,
        param_bytes=2 * 10**9,
        d2h_bandwidth=bandwidth,
        h2d_bandwidth=bandwidth * rng.uniform(0.6, 1.0),
        latency_s=1e-5,
    )


def budget_for(profile: StepProfile, fraction: float) -> int:
    keep_all = simulate(profile, Plan.keep_all(profile.n_layers), record_events=False)
    return profile.static_bytes + int(fraction * keep_all.activation_peak_bytes)


def gap_rows(instances: int, layers: int, exact: bool) -> list[dict[str, Any]]:
    rows = []
    for seed in range(instances):
        profile = generated_instance(seed, layers)
        for fraction in FRACTIONS:
            budget = budget_for(profile, fraction)
            row: dict[str, Any] = {"instance": seed, "layers": layers, "budget_fraction": fraction}
            started = time.perf_counter()
            try:
                greedy = plan(profile, budget, method="greedy", microbatches=(1,), lower_bound=False)
            except CapacityExceededError as error:
                row["status"] = "no plan fits"
                row["note"] = str(error).split(":")[1].split(" with plan")[0].strip()
                rows.append(row)
                continue
            row["greedy_s"] = greedy.predicted.step_time_s
            row["greedy_plan"] = greedy.plan.describe()
            row["greedy_seconds"] = time.perf_counter() - started
            if exact:
                started = time.perf_counter()
                best = exhaustive_plan(profile, budget, microbatches=(1,), lower_bound=False, exact_max_layers=layers)
                row["exact_s"] = best.predicted.step_time_s
                row["exact_plan"] = best.plan.describe()
                row["exact_seconds"] = time.perf_counter() - started
                row["greedy_over_exact"] = row["greedy_s"] / row["exact_s"]
            bound = instance_lower_bound(profile, budget, checkpoint_intervals=(1, 2, 4))
            row["lower_bound_s"] = bound
            row["greedy_over_bound"] = row["greedy_s"] / bound
            if exact:
                row["exact_over_bound"] = row["exact_s"] / bound
            row["keep_all_s"] = greedy.keep_all.step_time_s
            row["status"] = "ok"
            rows.append(row)
    return rows


def llama_profile(seq: int, fraction: float, granularity: str) -> StepProfile:
    return transformer_step_profile(
        layers=32,
        batch=1,
        seq=seq,
        hidden=4096,
        heads=32,
        ffn=11008,
        vocab=32000,
        dtype_bytes=2,
        flops_per_s=H200_BF16_PEAK * fraction,
        attention="flash",
        mlp="swiglu",
        causal=True,
        d2h_bandwidth=53e9,
        h2d_bandwidth=35e9,
        latency_s=1e-5,
        duplex=True,
        granularity=granularity,  # type: ignore[arg-type]
    )


def gpu_rows(fractions: list[float]) -> list[dict[str, Any]]:
    rows = []
    for fraction in fractions:
        for seq in (4096, 32768):
            for granularity in ("block", "half"):
                profile = llama_profile(seq, fraction, granularity)
                n = profile.n_layers
                per_block = 1 if granularity == "block" else 2
                full = simulate(profile, Plan.uniform(n, "recompute", checkpoint_interval=per_block))
                keep_all = simulate(profile, Plan.keep_all(n), record_events=False)
                started = time.perf_counter()
                hybrid = plan(
                    profile,
                    full.peak_bytes,
                    method="greedy",
                    microbatches=(1,),
                    checkpoint_intervals=(1, 2) if per_block == 2 else (1, 2, 4),
                    lower_bound_time_limit_s=30.0,
                )
                seconds = time.perf_counter() - started
                rows.append(
                    {
                        "seq": seq,
                        "granularity": granularity,
                        "achieved_fraction": fraction,
                        "flops_per_s": H200_BF16_PEAK * fraction,
                        "keep_all_s": keep_all.step_time_s,
                        "keep_all_peak_bytes": keep_all.peak_bytes,
                        "full_recompute_s": full.step_time_s,
                        "full_recompute_peak_bytes": full.peak_bytes,
                        "hybrid_s": hybrid.predicted.step_time_s,
                        "hybrid_peak_bytes": hybrid.predicted.peak_bytes,
                        "hybrid_exposed_wait_s": hybrid.predicted.exposed_wait_s,
                        "hybrid_recompute_s": hybrid.predicted.recompute_s,
                        "hybrid_counts": {a: hybrid.plan.count(a) for a in ("keep", "offload", "recompute")},
                        "hybrid_plan": hybrid.plan.describe(),
                        "hybrid_faster_by": 1 - hybrid.predicted.step_time_s / full.step_time_s,
                        "lower_bound_s": hybrid.lower_bound_s,
                        "best_possible_faster_by": None
                        if hybrid.lower_bound_s is None
                        else 1 - hybrid.lower_bound_s / full.step_time_s,
                        "planner_seconds": seconds,
                    }
                )
    return rows


def fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:9.2f}"


def print_gap(rows: list[dict[str, Any]], exact: bool) -> dict[str, Any]:
    print("\n## Planner vs exact optimum and lower bound (generated instances, simulated step time)\n")
    header = "| inst | budget | greedy ms | exact ms | LB ms | greedy/exact | greedy/LB | exact/LB |"
    print(header)
    print("|" + "---|" * 8)
    for row in rows:
        if row["status"] != "ok":
            print(f"| {row['instance']} | {row['budget_fraction']:.0%} | no plan fits ({row['note']}) | | | | | |")
            continue
        print(
            f"| {row['instance']} | {row['budget_fraction']:.0%} | {fmt_ms(row['greedy_s'])} | "
            f"{fmt_ms(row.get('exact_s'))} | {fmt_ms(row['lower_bound_s'])} | "
            f"{row.get('greedy_over_exact', float('nan')):.4f} | {row['greedy_over_bound']:.4f} | "
            f"{row.get('exact_over_bound', float('nan')):.4f} |"
        )
    summary: dict[str, Any] = {}
    ok = [r for r in rows if r["status"] == "ok"]
    print()
    for fraction in FRACTIONS:
        group = [r for r in ok if r["budget_fraction"] == fraction]
        total = len([r for r in rows if r["budget_fraction"] == fraction])
        if not group:
            print(f"- budget {fraction:.0%}: no instance feasible ({total} tried)")
            continue
        item = {
            "feasible": len(group),
            "tried": total,
            "greedy_over_bound_max": max(r["greedy_over_bound"] for r in group),
            "greedy_over_bound_mean": statistics.fmean(r["greedy_over_bound"] for r in group),
        }
        line = (
            f"- budget {fraction:.0%}: {len(group)}/{total} feasible; greedy/LB max {item['greedy_over_bound_max']:.3f}"
            f" mean {item['greedy_over_bound_mean']:.3f}"
        )
        if exact:
            item["greedy_over_exact_max"] = max(r["greedy_over_exact"] for r in group)
            item["exact_over_bound_max"] = max(r["exact_over_bound"] for r in group)
            line += f"; greedy/exact max {item['greedy_over_exact_max']:.4f}; exact/LB max {item['exact_over_bound_max']:.3f}"
        summary[f"{fraction:.2f}"] = item
        print(line)
    return summary


def print_gpu(rows: list[dict[str, Any]]) -> None:
    print("\n## LLaMA-7B-shaped stack, H200-class compute, PCIe Gen5 53/35 GB/s (simulated)\n")
    print(
        "| seq | units | achieved | keep-all ms (peak GB) | full recompute ms (peak GB) | "
        "planned hybrid ms (peak GB) | keep/offload/recompute | hybrid faster by | bound ms | no plan faster by more than |"
    )
    print("|" + "---|" * 10)
    for row in rows:
        counts = row["hybrid_counts"]
        print(
            f"| {row['seq'] // 1024}K | {row['granularity']} | {row['achieved_fraction']:.0%} | "
            f"{row['keep_all_s'] * 1e3:.1f} ({row['keep_all_peak_bytes'] / 1e9:.1f}) | "
            f"{row['full_recompute_s'] * 1e3:.1f} ({row['full_recompute_peak_bytes'] / 1e9:.1f}) | "
            f"{row['hybrid_s'] * 1e3:.1f} ({row['hybrid_peak_bytes'] / 1e9:.1f}) | "
            f"{counts['keep']}/{counts['offload']}/{counts['recompute']} | {row['hybrid_faster_by']:.1%} | "
            f"{fmt_ms(row['lower_bound_s'])} | "
            f"{'—' if row['best_possible_faster_by'] is None else format(row['best_possible_faster_by'], '.1%')} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=8, help="generated instances (default 8)")
    parser.add_argument("--layers", type=int, default=8, help="layers per generated instance (default 8)")
    parser.add_argument("--no-exact", action="store_true", help="skip the exhaustive optimum (for large --layers)")
    parser.add_argument(
        "--achieved-fraction",
        type=float,
        default=0.45,
        help="achieved share of the 790 TFLOP/s peak for the GPU-like case (default 0.45)",
    )
    parser.add_argument(
        "--sensitivity", action="store_true", help="also run the GPU-like case at 35 %% and 55 %% of peak"
    )
    parser.add_argument("--skip-gpu", action="store_true", help="only the generated instances")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    exact = not args.no_exact
    rows = gap_rows(args.instances, args.layers, exact)
    summary = print_gap(rows, exact)
    report: dict[str, Any] = {"generated": rows, "generated_summary": summary}
    if not args.skip_gpu:
        fractions = [args.achieved_fraction]
        if args.sensitivity:
            fractions += [0.35, 0.55]
        gpu = gpu_rows(fractions)
        print_gpu(gpu)
        report["gpu_like"] = gpu
    report["wall_seconds"] = time.perf_counter() - started
    report["command"] = " ".join(["benchmarks/planner_gap.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n(wall time {report['wall_seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
