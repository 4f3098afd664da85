"""Activation copies in flight, capped or not, on a link that lags forward (fake device).

``offload_activations(max_inflight=...)`` (Note [Activation copies in flight are capped]): when
forward saves faster than the device-to-host link moves the bytes, the storages whose copies have
not landed stay on the device. This benchmark runs the same MLP forward + backward with every saved
storage offloaded over a slow link, once per cap, interleaved, and prints side by side the measured
device peak of the forward (the fake device's own accounting, over the weights), the step time
(medians), and how often and how long forward waited for copies in flight. Baselines: keep-all (no
offload) and the same forward under ``no_grad`` (nothing saved: the floor any offload can reach).

The simulator applies the same cap (``Plan.max_inflight``; Note [The simulator caps forward's
copies in flight]): the run also profiles the model once (``measure_step``, the emulated link given
as it is) and prints, per cap, the simulated forward's peak over the weights and its exposed wait
beside the measured ones (``--no-simulate`` skips it).

Run::

    .venv/bin/python benchmarks/inflight_cap.py
    .venv/bin/python benchmarks/inflight_cap.py --d2h-bandwidth 1GiB/s --steps 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import offcore_torch
import torch
from offcore_torch.compare.profiler import measure_step
from torch import nn

import offcore
from offcore.bandwidth import LinkMeasurement
from offcore.sim import Plan, simulate


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1024, help="batch rows (a saved tensor is rows x width fp32)")
    parser.add_argument("--d2h-bandwidth", default="256MiB/s", help="the emulated device-to-host link")
    parser.add_argument("--caps", nargs="+", default=["none", "256MiB", "16MiB", "4MiB", "0"])
    parser.add_argument("--steps", type=int, default=7, help="measured steps per variant (median)")
    parser.add_argument("--no-simulate", action="store_true", help="skip the simulator's prediction per cap")
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.width, args.depth, args.rows) < 1:
        parser.error("--steps, --width, --depth and --rows must be positive")
    caps: list[Any] = [
        None if c == "none" else offcore.parse_size(c, what="--caps", allow_zero=True) for c in args.caps
    ]
    torch.set_num_threads(1)
    dev = offcore.device("cpu", d2h_bandwidth=args.d2h_bandwidth, h2d_bandwidth="inf", latency=0)
    storage = args.rows * args.width * 4
    print("# Activation copies in flight on a lagging link (fake device)\n")
    print(f"Command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"MLP {args.depth} x (Linear {args.width} + GELU), {args.rows} rows: {2 * args.depth} saved storages of "
        f"{storage / 2**20:.2f} MiB; D2H link {args.d2h_bandwidth}, H2D unlimited; torch {torch.__version__}, "
        "1 intra-op thread. Baselines: keep-all, and the forward under no_grad (the floor).\n"
    )
    names = ["no_grad forward (floor)", "keep-all", *[f"max_inflight={c}" for c in args.caps]]
    results: dict[str, dict[str, list[float]]] = {n: {"peak": [], "step": [], "waits": [], "wait_s": []} for n in names}
    with dev:
        model = build(args.width, args.depth).to(dev.torch_device)
        x = torch.randn(args.rows, args.width, device=dev.torch_device)
        base = dev.memory_stats().allocated_bytes
        with torch.no_grad():  # the loss: made after the no_grad floor's peak, while offcore may hold its most
            loss_bytes = model(x).square().mean().untyped_storage().nbytes()

        def run(name: str, cap: Any) -> None:
            dev.synchronize()
            dev.reset_peak_memory_stats()
            began = time.perf_counter()
            waits = wait_s = 0.0
            if name.startswith("no_grad"):
                with torch.no_grad():
                    model(x).square().mean()
                peak = dev.memory_stats().peak_allocated_bytes
            elif name == "keep-all":
                loss = model(x).square().mean()
                peak = dev.memory_stats().peak_allocated_bytes
                loss.backward()
            else:
                with offcore_torch.offload_activations(dev, min_bytes=1, max_inflight=cap) as handle:
                    loss = model(x).square().mean()
                    # the forward's peak: read before the region's end starts backward's first reloads (Note
                    # [Prefetch from the end of forward]), which the prefetch budget bounds, not max_inflight
                    peak = dev.memory_stats().peak_allocated_bytes
                loss.backward()
                offcore_torch.synchronize(dev)
                stats = handle.stats()
                waits, wait_s = stats.inflight_waits, stats.inflight_wait_s
            elapsed = time.perf_counter() - began
            model.zero_grad(set_to_none=True)
            row = results[name]
            row["peak"].append(peak - base)
            row["step"].append(elapsed)
            row["waits"].append(waits)
            row["wait_s"].append(wait_s)

        variants = [(names[0], None), (names[1], None), *zip(names[2:], caps, strict=True)]
        measurement = None
        if not args.no_simulate:  # before the rounds, so the profile's own copies are not in them
            link = LinkMeasurement(offcore.parse_bandwidth(args.d2h_bandwidth), float("inf"), 0.0, True)
            measurement = measure_step(
                model, lambda: model(x).square().mean(), dev, layers=list(model), link=link, calibrate=True
            )
            model.zero_grad(set_to_none=True)
        for _ in range(2):  # warm-up
            for name, cap in variants:
                run(name, cap)
        for result in results.values():
            for values in result.values():
                values.clear()
        for step in range(args.steps):  # interleaved, each round in a rotated order (no variant always first)
            for name, cap in variants[step % len(variants) :] + variants[: step % len(variants)]:
                run(name, cap)
    keep = statistics.median(results["keep-all"]["step"])
    floor = statistics.median(results[names[0]]["peak"])
    print(
        "| variant | forward peak over the weights (MiB) | over the floor (MiB) | step median (ms) | x keep-all | saves that waited | waited (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        r = results[name]
        peak = statistics.median(r["peak"])
        step = statistics.median(r["step"])
        print(
            f"| {name} | {peak / 2**20:.2f} | {(peak - floor) / 2**20:.2f} | {step * 1e3:.1f} | {step / keep:.3f} | "
            f"{statistics.median(r['waits']):.0f} | {statistics.median(r['wait_s']) * 1e3:.1f} |"
        )
    if measurement is not None:
        simulated(measurement, args, caps, results, floor)
    print(
        "\nThe bound (Note [Activation copies in flight are capped]): what offcore holds for copies in flight is at "
        f"most max(cap, one storage = {storage / 2**20:.2f} MiB); the forward peak, the floor's plus that plus the "
        f"storage being saved plus the loss ({loss_bytes} bytes: the no_grad floor has freed its intermediates by "
        "the time it makes the loss, offcore may still hold its most):\n"
    )
    failed = False
    for text, cap in zip(args.caps, caps, strict=True):
        if cap is None:
            continue
        peak = max(results[f"max_inflight={text}"]["peak"])  # every step, not the median
        bound = floor + max(cap, storage) + storage + loss_bytes
        held = peak <= bound
        failed |= not held
        print(
            f"- {'held' if held else 'EXCEEDED'}: max_inflight={text}: highest forward peak {peak / 2**20:.2f} MiB "
            f"<= {bound / 2**20:.2f} MiB"
        )
    return 1 if failed else 0


def simulated(
    measurement: Any, args: argparse.Namespace, caps: list[Any], results: dict[str, Any], floor: float
) -> None:
    """Per cap, the simulator's forward (Plan.max_inflight) beside the measured one."""
    profile = measurement.profile
    print(
        "\nThe simulator, same caps (Plan.max_inflight; every layer offloaded; the profile of one calibrated step, "
        f"D2H {args.d2h_bandwidth} as emulated). Forward peak over the weights = the highest level before the "
        "last forward ends, less the profile's resident bytes:\n"
    )
    print(
        "| max_inflight | simulated forward peak (MiB) | measured (MiB) | simulated exposed wait (ms) | measured (ms) |"
    )
    print("|---|---:|---:|---:|---:|")
    for text, cap in zip(args.caps, caps, strict=True):
        result = simulate(profile, Plan(["offload"] * len(profile.layers), max_inflight=cap), record_events=True)
        end = max(e.end for e in result.events if e.kind == "forward")
        level = max(b for t, b in zip(result.memory_times, result.memory_bytes, strict=True) if t < end)
        peak = level - profile.resident_bytes
        measured = results[f"max_inflight={text}"]
        print(
            f"| {text} | {peak / 2**20:.2f} | {statistics.median(measured['peak']) / 2**20:.2f} | "
            f"{result.exposed_wait_s * 1e3:.1f} | {statistics.median(measured['wait_s']) * 1e3:.1f} |"
        )
    print(f"\n(the no_grad floor measured: {floor / 2**20:.2f} MiB)")


if __name__ == "__main__":
    raise SystemExit(main())
