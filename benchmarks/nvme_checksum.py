"""What ``verify=True`` costs on the NVMe tier: a CRC-32 per chunk against the read it checks.

For each block size, in rounds whose variant order is shuffled (seeded): the tier's read of
``--volume`` bytes as objects of one block each, with ``verify=False`` and ``verify=True``
(one tier each, same directory, same files written first), and ``zlib.crc32`` alone over the
same bytes in memory. Reports medians in GiB/s and the checksum's cost as a fraction of the
unverified read. The tier's reads use O_DIRECT where the filesystem has it, so they come from
the disk; elsewhere they may come from the page cache (printed), which makes the read look
faster and the checksum's share larger than on a disk.

    python benchmarks/nvme_checksum.py --dir /work/nvme-bench
    python benchmarks/nvme_checksum.py --dir /work/nvme-bench --blocks 1MiB,16MiB --volume 256MiB --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

from offcore.nvme import NvmeTier, aligned_empty
from offcore.units import format_bytes, parse_size


def _gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--blocks", default="1MiB,16MiB", help="object sizes (comma-separated)")
    parser.add_argument("--volume", default="128MiB", help="bytes read per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="offcore-crc-")
    fs = subprocess.run(["stat", "-f", "-c", "%T", base], capture_output=True, text=True, check=False).stdout.strip()
    print(f"directory {base} (filesystem: {fs or 'unknown'})")
    volume = parse_size(args.volume, what="volume")
    rng = random.Random(args.seed)
    print(f"{'block':>8}  {'read':>10}  {'read+verify':>11}  {'crc32 alone':>11}  {'verify cost':>11}")
    for block in (parse_size(b, what="block") for b in args.blocks.split(",")):
        count = max(1, volume // block)
        src = aligned_empty(block)
        src[:] = np.frombuffer(np.random.default_rng(0).bytes(block), np.uint8)
        dst = aligned_empty(block)
        tiers = {verify: NvmeTier(base, budget=2 * count * block + 2**26, verify=verify) for verify in (False, True)}
        try:
            for tier in tiers.values():
                for i in range(count):
                    tier.write(i, src).synchronize()
            times: dict[str, list[float]] = {"read": [], "verify": [], "crc": []}
            for _ in range(args.rounds):
                order = list(times)
                rng.shuffle(order)
                for variant in order:
                    began = time.perf_counter()
                    if variant == "crc":
                        for _ in range(count):
                            zlib.crc32(src)
                    else:
                        tier = tiers[variant == "verify"]
                        for i in range(count):
                            tier.read(i, dst).synchronize()
                    times[variant].append(time.perf_counter() - began)
            med = {k: statistics.median(v) for k, v in times.items()}
            total = count * block
            cost = (med["verify"] - med["read"]) / med["read"]
            print(
                f"{format_bytes(block):>8}  {_gib_s(total, med['read']):>10.2f}  {_gib_s(total, med['verify']):>11.2f}"
                f"  {_gib_s(total, med['crc']):>11.2f}  {cost:>+10.1%}"
            )
        finally:
            for tier in tiers.values():
                tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
