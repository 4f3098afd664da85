"""Simulator vs measurement on the CPU fake device: is each strategy's predicted step time within 15 %?

For every strategy of ``offcore compare`` (baseline, accumulate, checkpoint, offload,
hybrid, planned) this runs the built-in TinyGPT on the fake device with the PCIe-like
link ``offcore compare`` chooses, and a capacity large enough for every strategy to run
(the planner and the accumulate choice still plan under ``--budget-fraction`` of the
keep-all peak, so "planned" is a real plan). It prints, per strategy, the measured
median step time next to the simulator's prediction from the profiled step, the
relative error, and the measured vs predicted device peak.

    .venv/bin/python benchmarks/sim_vs_measured.py                       # the compare default workload
    .venv/bin/python benchmarks/sim_vs_measured.py --d-model 128 --seq-len 128 --iters 5 --json out.json

Not a test: the figures depend on the machine and on what else runs on it. On a shared
2-core host the activation plugin's per-tensor Python work and the fake link's copy
threads compete with compute for the CPU, which the simulator does not model (it
charges copies to the link only); the report says so next to the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from offcore.comparison import Gates  # noqa: E402
from offcore.units import format_bytes  # noqa: E402

TARGET = 0.15


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--budget-fraction", type=float, default=0.7, help="plan under this share of the keep-all peak")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    from offcore_torch.compare import CompareSettings, run_compare

    settings = CompareSettings(
        batch=args.batch,
        seq_len=args.seq_len,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        warmup=args.warmup,
        iters=args.iters,
        capacity=64 * 2**30,  # every strategy runs; the plans still target the budget fraction
        budget_fraction=args.budget_fraction,
        threads=args.threads,
        observe=False,
    )
    comparison = run_compare(settings, gates=Gates(), log=lambda line: print(line, file=sys.stderr))
    rows = []
    print(
        f"{'strategy':<11} {'plan':<34} {'measured ms':>11} {'predicted ms':>12} {'error':>7} {'within 15%':>10} "
        f"{'peak':>10} {'pred peak':>10} {'wait ms':>8} {'pred wait':>9}"
    )
    for result in comparison.results:
        if not result.ok:
            print(f"{result.name:<11} {result.status}: {result.error}")
            continue
        error = result.prediction_error
        within = error is not None and abs(error) <= TARGET
        rows.append(
            {
                "strategy": result.name,
                "plan": result.plan,
                "measured_s": result.step_s,
                "step_times_s": result.step_times_s,
                "predicted_s": result.predicted_step_s,
                "error": error,
                "within_target": within,
                "peak_bytes": result.peak_device_bytes,
                "predicted_peak_bytes": result.predicted_peak_bytes,
                "exposed_wait_s": result.exposed_wait_s,
                "predicted_wait_s": result.predicted_wait_s,
            }
        )
        print(
            f"{result.name:<11} {result.plan:<34} {result.step_s * 1e3:>11.1f} {result.predicted_step_s * 1e3:>12.1f} "
            f"{error:>+7.0%} {'yes' if within else 'NO':>10} {format_bytes(result.peak_device_bytes or 0):>10} "
            f"{format_bytes(result.predicted_peak_bytes or 0):>10} {result.exposed_wait_s * 1e3:>8.1f} "
            f"{(result.predicted_wait_s or 0) * 1e3:>9.1f}"
        )
    hits = sum(row["within_target"] for row in rows)
    print(f"\n{hits} of {len(rows)} strategies within {TARGET:.0%} of the prediction")
    print("notes: " + "; ".join(comparison.notes))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"settings": comparison.workload, "device": comparison.device, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
