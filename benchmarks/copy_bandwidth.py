"""Copy bandwidth of the CPU fake device against its link model.

The fake device promises that a copy of ``n`` bytes takes ``latency + n / bandwidth``
of real wall time, so that a 256 MiB copy at 32 GiB/s takes 7.8125 ms. This script
measures it (median of several runs, timed with the device's own events) for D2H and
H2D, then sweeps sizes from 1 MiB to 256 MiB, and checks both directions at once with a
duplex link and with one shared link.

The emulation cannot copy faster than the host copies memory. The script therefore
also measures the host's plain memcpy of each size (the *floor*) and marks every
figure whose emulated time is below it as memcpy-bound: there the device is as fast
as this machine allows, and the 10 % target cannot be met by any emulation.

    python benchmarks/copy_bandwidth.py                           # 32, 8 and 4 GiB/s
    python benchmarks/copy_bandwidth.py --bandwidths 32GiB/s --json copy_bandwidth.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from offcore_cpu.buffers import ops_for

import offcore
from offcore import Tier
from offcore.units import format_bandwidth, format_bytes, parse_bandwidth, parse_duration, parse_size

MiB = 1 << 20
TARGET = 0.10  # relative error the issue asks for


def _median_ms(run: Callable[[], float], repeats: int) -> float:
    run()  # warm-up: page faults, thread start
    return statistics.median(run() for _ in range(repeats))


def host_memcpy_ms(dev: Any, nbytes: int, repeats: int) -> float:
    """Median milliseconds of a plain framework copy of ``nbytes`` (no emulation).

    Timed on a helper thread, as the device's copies run on worker threads (torch's
    intra-op threads behave differently on the main thread of a busy machine).
    """
    src, dst = _filled(dev, nbytes, Tier.PINNED), _filled(dev, nbytes, Tier.PINNED)
    ops = ops_for(dst)  # the same copy routine the device's workers run
    assert ops is not None

    def timed_copy() -> float:
        start = time.perf_counter()
        ops.copy(dst, src)
        return (time.perf_counter() - start) * 1e3

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as helper:
        return _median_ms(lambda: helper.submit(timed_copy).result(), repeats)


def host_memcpy_pair_ms(dev: Any, nbytes: int, repeats: int) -> float:
    """Median milliseconds of two plain copies of ``nbytes`` run at once on two threads
    (the floor of a D2H and an H2D together: they share the host's memory bandwidth)."""
    pairs = [(_filled(dev, nbytes, Tier.PINNED), _filled(dev, nbytes, Tier.PINNED)) for _ in range(2)]
    ops = ops_for(pairs[0][0])
    assert ops is not None

    def run() -> float:
        threads = [threading.Thread(target=ops.copy, args=pair) for pair in pairs]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return (time.perf_counter() - start) * 1e3

    return _median_ms(run, repeats)


def _filled(dev: Any, nbytes: int, tier: Tier) -> Any:
    buffer = dev.allocate(nbytes, tier)
    buffer[:] = 1  # touch every page before timing
    return buffer


def copy_ms(dev: Any, direction: str, nbytes: int, repeats: int) -> float:
    """Median milliseconds of one copy on a copy stream, timed by events recorded around it."""
    device, host = _filled(dev, nbytes, Tier.DEVICE), _filled(dev, nbytes, Tier.PINNED)
    dst, src = (host, device) if direction == "d2h" else (device, host)
    stream = dev.new_stream(name=f"bench-{direction}")

    def run() -> float:
        # Enqueue behind a gate, so the events time the copy on the stream, not how fast
        # the host enqueues it and wakes the worker (as CUDA events on a busy stream do).
        gate = threading.Event()
        stream.launch_host_func(gate.wait)
        start, end = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
        start.record(stream)
        dev.copy_(dst, src, stream=stream)
        end.record(stream)
        gate.set()
        end.synchronize()
        return start.elapsed_time(end)

    result = _median_ms(run, repeats)
    stream.close()
    return result


def both_directions_ms(dev: Any, nbytes: int, repeats: int) -> float:
    """Median wall milliseconds of one D2H and one H2D started together on two streams."""
    up_dst, up_src = _filled(dev, nbytes, Tier.DEVICE), _filled(dev, nbytes, Tier.PINNED)
    down_dst, down_src = _filled(dev, nbytes, Tier.PINNED), _filled(dev, nbytes, Tier.DEVICE)
    up, down = dev.new_stream(name="bench-up"), dev.new_stream(name="bench-down")

    def run() -> float:
        start = time.perf_counter()
        done_up = dev.copy_(up_dst, up_src, stream=up)
        done_down = dev.copy_(down_dst, down_src, stream=down)
        done_up.synchronize()
        done_down.synchronize()
        return (time.perf_counter() - start) * 1e3

    result = _median_ms(run, repeats)
    up.close()
    down.close()
    return result


def _row(direction: str, nbytes: int, expected: float, measured: float, floor: float) -> dict[str, Any]:
    error = (measured - expected) / expected
    memcpy_bound = floor > expected
    return {
        "direction": direction,
        "bytes": nbytes,
        "expected_ms": expected,
        "measured_ms": measured,
        "relative_error": error,
        "within_target": abs(error) <= TARGET,
        "host_memcpy_ms": floor,
        "memcpy_bound": memcpy_bound,
    }


def _print_row(row: dict[str, Any]) -> None:
    verdict = "ok" if row["within_target"] else ("memcpy-bound" if row["memcpy_bound"] else "MISSED")
    print(
        f"  {row['direction']:<5} {format_bytes(row['bytes']):>11}  expected {row['expected_ms']:9.4f} ms  "
        f"measured {row['measured_ms']:9.4f} ms  error {row['relative_error']:+7.1%}  "
        f"host memcpy {row['host_memcpy_ms']:8.4f} ms  {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidths", default="32GiB/s,8GiB/s,4GiB/s", help="comma-separated link bandwidths")
    parser.add_argument("--latency", default="0", help="per-copy latency (default 0: expected = bytes / bandwidth)")
    parser.add_argument("--size", default="256MiB", help="size of the headline copy (default 256MiB)")
    parser.add_argument("--sweep", default="1MiB,4MiB,16MiB,64MiB,256MiB", help="comma-separated sweep sizes")
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure; the median is reported")
    parser.add_argument("--buffers", choices=["torch", "numpy"], default=None, help="buffer family (device default)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    bandwidths = [parse_bandwidth(b.strip(), what="--bandwidths") for b in args.bandwidths.split(",") if b.strip()]
    latency = parse_duration(args.latency, what="--latency")
    headline_bytes = parse_size(args.size, what="--size")
    sweep = [parse_size(s.strip(), what="--sweep") for s in args.sweep.split(",") if s.strip()]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    options: dict[str, Any] = {"capacity": max(4 * max(sweep + [headline_bytes]), 64 * MiB), "latency": latency}
    if args.buffers:
        options["buffers"] = args.buffers

    probe = offcore.device("cpu", **options)
    floors = {n: host_memcpy_ms(probe, n, args.repeats) for n in sorted({headline_bytes, *sweep})}
    pair_floor = host_memcpy_pair_ms(probe, headline_bytes, args.repeats)
    buffers = probe.options.buffers
    probe.close()
    del probe
    host_rate = headline_bytes / (floors[headline_bytes] / 1e3)
    print(f"fake device copy bandwidth ({buffers} buffers, latency {latency * 1e6:g} us, median of {args.repeats})")
    print(
        f"host memcpy of {format_bytes(headline_bytes)}: {floors[headline_bytes]:.3f} ms "
        f"({format_bandwidth(host_rate)}); two at once: {pair_floor:.3f} ms"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {os.cpu_count()} CPUs, 1-minute load average {load:.2f} (other work skews every figure)")

    results: dict[str, Any] = {
        "buffers": buffers,
        "latency_s": latency,
        "repeats": args.repeats,
        "host_memcpy_ms": {str(n): ms for n, ms in floors.items()},
        "host_memcpy_bandwidth": host_rate,
        "host_memcpy_pair_ms": pair_floor,
        "cpu_count": os.cpu_count(),
        "load_average_1min": load,
        "runs": [],
    }
    for bandwidth in bandwidths:
        dev = offcore.device("cpu", h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth, **options)
        expected = latency + headline_bytes / bandwidth
        print(
            f"\nlink {format_bandwidth(bandwidth)}: {format_bytes(headline_bytes)} copy, expected {expected * 1e3:.4f} ms"
        )
        headline = [
            _row(
                d, headline_bytes, expected * 1e3, copy_ms(dev, d, headline_bytes, args.repeats), floors[headline_bytes]
            )
            for d in ("d2h", "h2d")
        ]
        for row in headline:
            _print_row(row)
        print("  sweep:")
        rows = []
        for nbytes in sweep:
            for direction in ("d2h", "h2d"):
                expected_ms = (latency + nbytes / bandwidth) * 1e3
                row = _row(
                    direction, nbytes, expected_ms, copy_ms(dev, direction, nbytes, args.repeats), floors[nbytes]
                )
                rows.append(row)
                _print_row(row)
        dev.close()
        concurrent = []
        for duplex in (True, False):
            link = offcore.device("cpu", h2d_bandwidth=bandwidth, d2h_bandwidth=bandwidth, duplex=duplex, **options)
            one = latency + headline_bytes / bandwidth
            expected_ms = (one if duplex else 2 * one) * 1e3
            measured = both_directions_ms(link, headline_bytes, args.repeats)
            link.close()
            row = _row("both", headline_bytes, expected_ms, measured, pair_floor)
            row["duplex"] = duplex
            concurrent.append(row)
            print(f"  D2H and H2D at once, {'duplex link' if duplex else 'shared link'}:", end="")
            _print_row(row)
        results["runs"].append(
            {"bandwidth": bandwidth, "headline": headline, "sweep": rows, "both_directions": concurrent}
        )

    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
