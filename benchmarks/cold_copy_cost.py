"""What one small copy costs the calling thread with the CPU caches hot, and right after a compute op.

On the fake device a saved tensor's copy (at most 1 MiB, idle stream) runs inline on the thread
that computes (Note [Inline copies on an idle stream]). Inside a training step every such call
comes right after a layer's compute, which has streamed megabytes through the caches; back to
back, the same call finds its code and objects in cache. This benchmark times, interleaved, call
by call (medians): the fake device's ``copy_`` into a pinned host buffer, and a bare torch
``copy_`` of the same bytes (the memcpy alone), each once right after a ``mul_`` over a buffer
larger than the caches ("cold") and once right after the same call ("hot"). The difference
between the two columns is what the caches cost; on a GPU the compute does not run through the
host's caches, so the hot figures are the ones a GPU run's host sees.

Run::

    .venv/bin/python benchmarks/cold_copy_cost.py
    .venv/bin/python benchmarks/cold_copy_cost.py --size 64KiB --evict 64MiB
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import offcore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256KiB", help="bytes per copy (default 256KiB)")
    parser.add_argument("--evict", default="16MiB", help="the buffer a mul_ streams through before a cold call")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of 32 buffers (default 30)")
    args = parser.parse_args(argv)
    nbytes = offcore.parse_size(args.size, what="--size")
    evict = offcore.parse_size(args.evict, what="--evict")
    if args.rounds < 1 or nbytes % 4 or evict % 4:
        parser.error("--rounds must be positive; --size and --evict multiples of 4 bytes")
    torch.set_num_threads(1)
    dev = offcore.device("cpu", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    timings: dict[str, list[float]] = {"device cold": [], "device hot": [], "torch cold": [], "torch hot": []}
    clock = time.perf_counter
    with dev:
        stream = dev.new_stream()
        sources = [torch.randn(nbytes // 4).view(torch.uint8) for _ in range(32)]
        hosts = [dev.allocate(nbytes, offcore.Tier.PINNED) for _ in sources]
        big = torch.randn(evict // 4)
        for _ in range(args.rounds):
            for host, source in zip(hosts, sources, strict=True):
                big.mul_(1.0)
                began = clock()
                host.copy_(source)
                timings["torch cold"].append(clock() - began)
                began = clock()
                host.copy_(source)
                timings["torch hot"].append(clock() - began)
                big.mul_(1.0)
                began = clock()
                dev.copy_(host, source, stream=stream)
                timings["device cold"].append(clock() - began)
                began = clock()
                dev.copy_(host, source, stream=stream)
                timings["device hot"].append(clock() - began)
            stream.synchronize()
    dev.close()
    med = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
    print("# One small copy, caches hot or cold (fake device)\n")
    print(f"Command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"{args.size} per copy, device to pinned host, idle stream (inline); cold = right after a mul_ over {args.evict}"
    )
    print(f"medians of {32 * args.rounds} calls each; torch {torch.__version__}, 1 intra-op thread\n")
    print("| call | cold (us) | hot (us) | cold / hot |")
    print("|---|---:|---:|---:|")
    for name in ("device", "torch"):
        label = "fake device copy_ (bookkeeping + memcpy)" if name == "device" else "torch copy_ (the memcpy alone)"
        cold, hot = med[f"{name} cold"], med[f"{name} hot"]
        print(f"| {label} | {cold:.1f} | {hot:.1f} | {cold / hot:.2f} |")
    print(
        f"\nThe device's own bookkeeping per copy: {med['device cold'] - med['torch cold']:.1f} us cold, "
        f"{med['device hot'] - med['torch hot']:.1f} us hot."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
