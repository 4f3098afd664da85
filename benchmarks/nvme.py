"""The NVMe tier's throughput next to the filesystem's raw sequential throughput, and the pipelined optimizer step.

Part 1, for blocks of 1–64 MiB: the tier writes and reads ``--volume`` bytes as objects of
one block each (from and into page-aligned host buffers, as the pinned pool hands out),
next to two raw baselines over the same bytes in one file: ``raw dd`` (one thread,
sequential requests of one block: ``dd bs=B oflag=direct``, queue depth 1) and ``raw qdN``
(requests of the tier's chunk size, ``--threads`` in flight on a bare thread pool: the same
queue depth and request size as the tier, without its bookkeeping). Every variant uses
O_DIRECT when the tier does (else all are buffered, and the files' pages are dropped before
every read), overwrites files written in the warm-up, and runs in every round, in an order
shuffled per round and operation (seeded); medians are reported with the ratio tier / the better raw baseline
(target ≥ 0.80 for blocks ≥ 1 MiB). ``--tier-configs`` adds tier settings (chunk size,
threads) to the same rounds, for tuning. Optional engines run in the same
rounds when importable: ``io_uring`` (the ``liburing`` package: one ring, queue depth
``--threads * 2``, same chunking) and ``kvikio`` (its POSIX thread pool on host memory).

Part 2: an Adam step (numpy) over ``--groups`` groups of state on the tier: sequential
(read, step, write, one group at a time) vs :func:`offcore.nvme.pipelined` (target ≥ 1.5 ×
faster) vs states in host memory (the floor: compute alone).

Part 3: the CPU time per object of the tier next to a bare thread pool's ``pwritev`` /
``preadv`` (4 KiB objects, buffered, in memory): what each object costs beyond its bytes.

The tier runs with ``verify=False`` here (the raw baselines checksum nothing);
``benchmarks/nvme_checksum.py`` measures what the default ``verify=True`` adds.

Say where it ran: the filesystem type of ``--dir`` is printed (use a disk-backed directory;
/tmp may be tmpfs, i.e. memory).

    python benchmarks/nvme.py --dir /work/nvme-bench
    python benchmarks/nvme.py --dir /work/nvme-bench --blocks 1MiB,4MiB --volume 128MiB --rounds 5 --json nvme.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from offcore.nvme import ALIGNMENT, NvmeTier, aligned_empty, pipelined
from offcore.units import format_bytes, parse_size

MiB = 1 << 20
TARGET_RAW = 0.80
TARGET_PIPELINE = 1.5


def filesystem_of(path: str) -> str:
    """``ext4 on /dev/vda`` and the like (from ``df -T``)."""
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        device, fstype = out.split()[:2]
        return f"{fstype} on {device}"
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return "unknown filesystem"


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _arena(block: int, count: int) -> list[np.ndarray]:
    """``count`` page-aligned buffers of ``block`` bytes cut from one allocation (as a pinned pool's slab hands
    them out): every variant's memory comes from the same kind of allocation, so none is faster for it."""
    arena = aligned_empty(block * count)
    arena[:] = 1
    return [arena[i * block : (i + 1) * block] for i in range(count)]


class Raw:
    """dd-like: one file, sequential single-threaded pwrite/pread of ``block`` bytes."""

    name = "raw dd"

    def __init__(self, directory: str, block: int, count: int, direct: bool) -> None:
        self.path = os.path.join(directory, "raw.dd")
        self.block, self.count, self.direct = block, count, direct
        self.bufs = _arena(block, count)
        self.flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)

    def write(self) -> None:
        fd = os.open(self.path, self.flags, 0o600)
        try:
            for i, buf in enumerate(self.bufs):
                os.pwrite(fd, buf, i * self.block)
        finally:
            os.close(fd)

    def read(self) -> None:
        if not self.direct:
            _drop_cache(self.path)
        fd = os.open(self.path, self.flags, 0o600)
        try:
            for i, buf in enumerate(self.bufs):
                os.preadv(fd, [buf], i * self.block)
        finally:
            os.close(fd)


class RawQueued:
    """The same bytes through one file as ``min(chunk, block)`` requests, ``threads`` in flight (a bare thread pool
    of ``os.pwritev`` / ``os.preadv``, no tier bookkeeping): the raw baseline at the tier's queue depth."""

    def __init__(self, directory: str, block: int, count: int, direct: bool, threads: int, chunk: int) -> None:
        self.name = f"raw qd{threads}"
        self.path = os.path.join(directory, f"raw.qd{threads}")
        self.direct = direct
        self.request = min(chunk, block)
        self.buf = _arena(block * count, 1)[0]
        self.offsets = list(range(0, block * count, self.request))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-qd")
        self.flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)

    def _run(self, call: Callable[[int, list[memoryview], int], int]) -> None:
        fd = os.open(self.path, self.flags, 0o600)
        view = memoryview(self.buf)
        try:
            futures = [self.pool.submit(call, fd, [view[o : o + self.request]], o) for o in self.offsets]
            for f in futures:
                f.result()
        finally:
            os.close(fd)

    def write(self) -> None:
        self._run(os.pwritev)

    def read(self) -> None:
        if not self.direct:
            _drop_cache(self.path)
        self._run(os.preadv)

    def close(self) -> None:
        self.pool.shutdown()


class Tier:
    """The offcore tier: ``count`` objects of ``block`` bytes, all submitted, then synchronized."""

    def __init__(
        self, directory: str, block: int, count: int, direct: bool, threads: int, chunk: int, label: str = ""
    ) -> None:
        self.name = "offcore tier" + label
        self.tier = NvmeTier(
            directory, budget=block * count + MiB, direct=direct, threads=threads, chunk_size=chunk, verify=False
        )
        self.bufs = _arena(block, count)

    def write(self) -> None:
        for h in [self.tier.write(i, b) for i, b in enumerate(self.bufs)]:
            h.synchronize()

    def read(self) -> None:
        if not self.tier.direct:
            for name in os.listdir(self.tier.directory):
                _drop_cache(os.path.join(self.tier.directory, name))
        for h in [self.tier.read(i, b) for i, b in enumerate(self.bufs)]:
            h.synchronize()

    def close(self) -> None:
        self.tier.close()


class Uring:
    """io_uring through the ``liburing`` package: one ring, chunked requests, ``depth`` in flight."""

    name = "io_uring"

    def __init__(self, directory: str, block: int, count: int, direct: bool, depth: int, chunk: int) -> None:
        import liburing  # optional: only where it is installed

        self.L = liburing
        self.ring = liburing.Ring()
        liburing.io_uring_queue_init(max(depth, 2), self.ring)
        self.cqe = liburing.Cqe()
        self.depth, self.chunk = depth, chunk
        self.bufs = [aligned_empty(block) for _ in range(count)]
        self.paths = [os.path.join(directory, f"uring.{i}") for i in range(count)]
        self.flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.direct = direct

    def _run(self, write: bool) -> None:
        L = self.L
        fds = [os.open(p, self.flags, 0o600) for p in self.paths]
        pending = [
            (fd, buf, off) for fd, buf in zip(fds, self.bufs, strict=True) for off in range(0, buf.nbytes, self.chunk)
        ]
        keep: dict[int, Any] = {}
        inflight = 0
        try:
            while pending or inflight:
                while pending and inflight < self.depth:
                    fd, buf, off = pending.pop(0)
                    iov = L.Iovec([memoryview(buf[off : off + self.chunk])])
                    sqe = L.io_uring_get_sqe(self.ring)
                    (L.io_uring_prep_writev if write else L.io_uring_prep_readv)(sqe, fd, iov, off)
                    L.io_uring_sqe_set_data64(sqe, id(iov))
                    keep[id(iov)] = iov
                    inflight += 1
                L.io_uring_submit(self.ring)
                L.io_uring_wait_cqe(self.ring, self.cqe)
                cqe = self.cqe[0]
                if cqe.res < 0:
                    raise OSError(-cqe.res, os.strerror(-cqe.res))
                keep.pop(L.io_uring_cqe_get_data64(cqe), None)
                L.io_uring_cqe_seen(self.ring, cqe)
                inflight -= 1
        finally:
            for fd in fds:
                os.close(fd)

    def write(self) -> None:
        self._run(True)

    def read(self) -> None:
        if not self.direct:
            for p in self.paths:
                _drop_cache(p)
        self._run(False)

    def close(self) -> None:
        self.L.io_uring_queue_exit(self.ring)


class Kvikio:
    """KvikIO's CuFile on host buffers (its POSIX thread pool when there is no GPUDirect Storage)."""

    name = "kvikio"

    def __init__(self, directory: str, block: int, count: int, direct: bool) -> None:
        import kvikio  # optional

        self.kvikio = kvikio
        self.bufs = [aligned_empty(block) for _ in range(count)]
        self.paths = [os.path.join(directory, f"kvikio.{i}") for i in range(count)]
        self.write()  # fails here on a machine without libcuda.so.1

    def write(self) -> None:
        files = [self.kvikio.CuFile(p, "w") for p in self.paths]
        for f, fut in [(f, f.pwrite(b)) for f, b in zip(files, self.bufs, strict=True)]:
            fut.get()
            f.close()

    def read(self) -> None:
        files = [self.kvikio.CuFile(p, "r") for p in self.paths]
        for f, fut in [(f, f.pread(b)) for f, b in zip(files, self.bufs, strict=True)]:
            fut.get()
            f.close()

    def close(self) -> None:
        pass


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(args: argparse.Namespace, direct: bool) -> list[dict[str, Any]]:
    rows = []
    for block in [parse_size(b) for b in args.blocks.split(",")]:
        count = max(1, args.volume // block)
        work = os.path.join(args.dir, f"block-{block}")
        os.makedirs(work, mode=0o700, exist_ok=True)
        variants: list[Any] = [
            Raw(work, block, count, direct),
            RawQueued(work, block, count, direct, args.threads, args.chunk),
        ]
        variants.append(Tier(work, block, count, direct, args.threads, args.chunk))
        for n, config in enumerate(args.tier_configs):  # extra tier settings measured in the same rounds (tuning)
            chunk, threads = config
            label = f" #{n + 2} {format_bytes(chunk)}x{threads}"
            variants.append(Tier(work, block, count, direct, threads, chunk, label=label))
        skipped: dict[str, str] = {}
        engines: list[tuple[str, Callable[[], Any]]] = [
            ("io_uring", lambda w=work, b=block, c=count: Uring(w, b, c, direct, 2 * args.threads, args.chunk)),
            ("kvikio", lambda w=work, b=block, c=count: Kvikio(w, b, c, direct)),
        ]
        for name, make in engines:
            if name in args.engines:
                try:
                    variants.append(make())
                except Exception as exc:  # noqa: BLE001 - report why an optional engine cannot run
                    skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        times: dict[tuple[str, str], list[float]] = {}
        for v in variants:  # warm-up: files created and allocated
            v.write()
            v.read()
        shuffle = random.Random(block)
        for _ in range(args.rounds):
            for op in ("write", "read"):
                order = list(variants)
                shuffle.shuffle(order)  # a fresh order per round and op: no variant always after another's writes
                for v in order:
                    times.setdefault((v.name, op), []).append(_timed(getattr(v, op)))
        nbytes = block * count
        row: dict[str, Any] = {"block": block, "count": count, "bytes": nbytes, "skipped": skipped}
        for (name, op), ts in times.items():
            row[f"{name} {op} GB/s"] = nbytes / statistics.median(ts) / 1e9
        raw_qd = next(v.name for v in variants if isinstance(v, RawQueued))
        for op in ("write", "read"):
            best = max(row[f"raw dd {op} GB/s"], row[f"{raw_qd} {op} GB/s"])
            row[f"raw best {op} GB/s"] = best
            row[f"tier/raw dd {op}"] = row[f"offcore tier {op} GB/s"] / row[f"raw dd {op} GB/s"]
            row[f"tier/{raw_qd} {op}"] = row[f"offcore tier {op} GB/s"] / row[f"{raw_qd} {op} GB/s"]
            row[f"tier/raw {op}"] = row[f"offcore tier {op} GB/s"] / best  # the target's ratio: vs the better raw
        rows.append(row)
        for v in variants:
            if hasattr(v, "close"):
                v.close()
        shutil.rmtree(work, ignore_errors=True)
        names = [v.name for v in variants]
        print(f"\nblock {format_bytes(block)} x {count} ({format_bytes(nbytes)}), medians of {args.rounds} rounds:")
        for op in ("write", "read"):
            figures = "  ".join(f"{n} {row[f'{n} {op} GB/s']:6.2f}" for n in names)
            ratio = row[f"tier/raw {op}"]
            ok = "meets" if ratio >= TARGET_RAW else "BELOW"
            print(
                f"  {op:5s} GB/s: {figures}   tier / best raw {ratio:.2f} ({ok} {TARGET_RAW:.2f}); "
                f"tier / raw dd {row[f'tier/raw dd {op}']:.2f}, tier / {raw_qd} {row[f'tier/{raw_qd} {op}']:.2f}"
            )
        for name, why in skipped.items():
            print(f"  {name} not run: {why}")
    return rows


class AdamOnTier:
    """Adam moments of ``groups`` groups on the tier, stepped through aligned host buffers."""

    def __init__(self, tier: NvmeTier | None, groups: int, n: int, lookahead: int = 1) -> None:
        rng = np.random.default_rng(0)
        self.tier, self.groups, self.n = tier, groups, n
        self.params = [rng.standard_normal(n).astype(np.float32) for _ in range(groups)]
        self.grads = [rng.standard_normal(n).astype(np.float32) for _ in range(groups)]
        self.resident = [np.zeros((2, n), np.float32) for _ in range(groups)] if tier is None else []
        self.lookahead = lookahead
        self.free = [aligned_empty(2 * n * 4).view(np.float32).reshape(2, n) for _ in range(lookahead + 2)]
        self.host: dict[int, np.ndarray] = {}
        self.t = 0
        if tier is not None:
            for g in range(groups):
                tier.write(g, np.zeros((2, n), np.float32)).synchronize()

    def read(self, g: int) -> Any:
        assert self.tier is not None
        self.host[g] = self.free.pop()
        return self.tier.read(g, self.host[g])

    def compute(self, g: int) -> None:
        m, v = self.host[g] if self.tier is not None else self.resident[g]
        grad, b1, b2 = self.grads[g], np.float32(0.9), np.float32(0.999)
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * np.square(grad)
        denom = np.sqrt(v / (1 - b2 ** (self.t + 1))) + np.float32(1e-8)
        self.params[g] -= np.float32(1e-3) / (1 - b1 ** (self.t + 1)) * m / denom

    def write(self, g: int) -> Any:
        assert self.tier is not None
        return self.tier.write(g, self.host[g])

    def release(self, g: int) -> None:
        self.free.append(self.host.pop(g))

    def sequential(self) -> None:
        for g in range(self.groups):
            self.read(g).synchronize()
            self.compute(g)
            self.write(g).synchronize()
            self.release(g)
        self.t += 1

    def pipelined(self) -> None:
        pipelined(
            range(self.groups), self.read, self.compute, self.write, release=self.release, lookahead=self.lookahead
        )
        self.t += 1

    def io_only(self) -> None:
        """The pipelined step's transfers without its compute: the I/O floor."""
        pipelined(
            range(self.groups), self.read, lambda g: None, self.write, release=self.release, lookahead=self.lookahead
        )

    def in_host(self) -> None:
        for g in range(self.groups):
            self.compute(g)
        self.t += 1


def optimizer_step(args: argparse.Namespace, direct: bool) -> dict[str, Any]:
    n = args.group_params
    work = os.path.join(args.dir, "step")
    os.makedirs(work, mode=0o700, exist_ok=True)
    budget = args.groups * 2 * n * 4 + MiB

    def open_tier() -> NvmeTier:
        return NvmeTier(work, budget=budget, direct=direct, threads=args.threads, chunk_size=args.chunk, verify=False)

    deep = args.lookahead
    with open_tier() as t1, open_tier() as t2, open_tier() as t3, open_tier() as t4:
        seq, pipe, host = (
            AdamOnTier(t1, args.groups, n),
            AdamOnTier(t2, args.groups, n),
            AdamOnTier(None, args.groups, n),
        )
        io = AdamOnTier(t3, args.groups, n, lookahead=deep)
        variants = {
            "sequential": seq.sequential,
            "pipelined": pipe.pipelined,
            "host memory": host.in_host,
            "I/O only": io.io_only,
        }
        piped = [pipe]
        if deep > 1:
            ahead = AdamOnTier(t4, args.groups, n, lookahead=deep)
            variants[f"pipelined k={deep}"] = ahead.pipelined
            piped.append(ahead)
        for fn in variants.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                start = time.process_time()
                times[name].append(_timed(fn))
                cpu[name].append(time.process_time() - start)
        same = all(a.tobytes() == b.tobytes() for p in piped for a, b in zip(seq.params, p.params, strict=True))
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    state = args.groups * 2 * n * 4
    print(
        f"\nAdam step, {args.groups} groups x {format_bytes(2 * n * 4)} of state ({format_bytes(state)} on the tier),"
    )
    print(f"medians of {args.rounds} rounds (baseline: sequential):")
    for k, v in med.items():
        print(
            f"  {k:14s} {v * 1e3:8.1f} ms   {med['sequential'] / v:5.2f} x sequential   "
            f"CPU {med_cpu[k] * 1e3:6.1f} ms of this process ({med_cpu[k] / v:.2f} cores)"
        )
    print(f"  (load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: an overlap needs a free core)")
    floor = max(med["host memory"], med["I/O only"])
    best = med["sequential"] / floor
    print(f"  floor of any overlap: max(host memory, I/O only) = {floor * 1e3:.1f} ms: at most {best:.2f} x sequential")
    speedup = med["sequential"] / min(v for k, v in med.items() if k.startswith("pipelined"))
    print(
        f"  pipelined / sequential speed-up {speedup:.2f} ({'meets' if speedup >= TARGET_PIPELINE else 'BELOW'} ",
        end="",
    )
    print(f"{TARGET_PIPELINE}); pipelined params bit-identical to sequential: {same}")
    return {
        "ms": {k: v * 1e3 for k, v in med.items()},
        "cpu_ms": {k: v * 1e3 for k, v in med_cpu.items()},
        "speedup": speedup,
        "best_possible_speedup": best,
        "bit_identical": same,
        "state_bytes": state,
    }


def _configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        chunk, _, threads = item.partition(":")
        out.append((parse_size(chunk), int(threads or 8)))
    return out


def per_object_cost(args: argparse.Namespace) -> dict[str, float]:
    """CPU time per object of the tier vs a bare thread pool's ``pwritev`` / ``preadv``: 4 KiB objects, buffered, in
    memory (``/dev/shm`` where it exists) so that the disk costs nothing and only the per-object work is left."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else args.dir
    work = os.path.join(base, f"offcore-nvme-bench-{os.getpid()}")
    os.makedirs(work, mode=0o700, exist_ok=True)
    count, block = 2000, 4096
    bufs = _arena(block, count)
    out: dict[str, float] = {}
    try:
        with NvmeTier(work, budget=2 * count * block, direct=False, threads=args.threads, verify=False) as tier:
            pool = ThreadPoolExecutor(args.threads)
            fd = os.open(os.path.join(work, "raw"), os.O_RDWR | os.O_CREAT, 0o600)

            def bare(call: Callable[[int, list[memoryview], int], int]) -> None:
                for f in [pool.submit(call, fd, [memoryview(b)], i * block) for i, b in enumerate(bufs)]:
                    f.result()

            def tier_write() -> None:
                for h in [tier.write(i, b) for i, b in enumerate(bufs)]:
                    h.synchronize()

            def tier_read() -> None:
                for h in [tier.read(i, b) for i, b in enumerate(bufs)]:
                    h.synchronize()

            variants = {
                "bare pool write": lambda: bare(os.pwritev),
                "tier write": tier_write,
                "bare pool read": lambda: bare(os.preadv),
                "tier read": tier_read,
            }
            samples: dict[str, list[float]] = {k: [] for k in variants}
            for fn in variants.values():
                fn()  # warm-up: files created, threads started
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    start = time.process_time()
                    fn()
                    samples[name].append((time.process_time() - start) / count)
            os.close(fd)
            pool.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nCPU per object ({count} objects of {format_bytes(block)}, buffered in {base}, medians of {args.rounds}):")
    for name, values in samples.items():
        out[name] = statistics.median(values) * 1e6
        print(f"  {name:16s} {out[name]:6.1f} us")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.expanduser("~/.cache/offcore-nvme-bench"), help="where to write")
    parser.add_argument("--blocks", default="1MiB,4MiB,16MiB,64MiB", help="comma-separated block sizes")
    parser.add_argument("--volume", type=parse_size, default=parse_size("256MiB"), help="bytes per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=8, help="tier threads per direction")
    parser.add_argument("--chunk", type=parse_size, default=parse_size("4MiB"), help="tier request size")
    parser.add_argument(
        "--tier-configs",
        type=_configs,
        default=[],
        help="extra tier settings in the same rounds, CHUNK:THREADS,... (e.g. 1MiB:8,8MiB:4) for tuning; "
        "the default's own settings again measure the noise between two identical variants",
    )
    parser.add_argument("--direct", choices=["auto", "on", "off"], default="auto", help="O_DIRECT for every variant")
    parser.add_argument("--engines", default="io_uring,kvikio", help="optional engines to try (if importable)")
    parser.add_argument("--groups", type=int, default=8, help="optimizer-state groups (part 2)")
    parser.add_argument(
        "--lookahead", type=int, default=2, help="part 2: also time pipelined(lookahead=K) reads K groups ahead"
    )
    parser.add_argument("--group-params", type=int, default=2_000_000, help="parameters per group (part 2)")
    parser.add_argument(
        "--skip", choices=["throughput", "step", "overhead"], action="append", default=[], help="skip a part"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.chunk % ALIGNMENT:
        parser.error(f"--chunk must be a multiple of {ALIGNMENT}")
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    with NvmeTier(args.dir, budget=MiB, direct={"auto": None, "on": True, "off": False}[args.direct]) as probe:
        direct, reason = probe.direct, probe.direct_reason
    load = os.getloadavg()
    where = filesystem_of(args.dir)
    print(f"directory {args.dir}: {where}; {'O_DIRECT' if direct else 'buffered (' + reason + ')'}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs, load {load[0]:.2f}")
    results: dict[str, Any] = {"dir": args.dir, "filesystem": where, "direct": direct, "load": load}
    if "throughput" not in args.skip:
        results["throughput"] = throughput(args, direct)
    if "step" not in args.skip:
        results["step"] = optimizer_step(args, direct)
    if "overhead" not in args.skip:
        results["per_object_cpu_us"] = per_object_cost(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
