"""pipelined(): read i+1 / compute i / write i−1 gives the sequential loop's bits, with at most 3 groups live."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import offcore
from offcore.nvme import NvmeTier, pipelined

GROUPS = 7
SIZE = 3001  # odd: bounce buffers and padding under O_DIRECT


class AdamGroups:
    """Adam moments of GROUPS parameter groups on the tier, stepped through host buffers it counts."""

    def __init__(self, tier: NvmeTier, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.tier = tier
        self.params = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(GROUPS)]
        self.grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(GROUPS)]
        self.host: dict[int, np.ndarray] = {}
        self.live = 0
        self.peak_live = 0
        self.step_no = 0
        for g in range(GROUPS):
            tier.write(g, np.zeros((2, SIZE), np.float32)).synchronize()

    def read(self, g: int) -> Any:
        assert g not in self.host
        self.host[g] = np.empty((2, SIZE), np.float32)
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        try:
            return self.tier.read(g, self.host[g])
        except BaseException:  # read() raised at once: pipelined() never saw this group, so free it here
            self.release(g)
            raise

    def compute(self, g: int) -> None:
        b1, b2, lr, eps = np.float32(0.9), np.float32(0.999), np.float32(1e-3), np.float32(1e-8)
        m, v = self.host[g]
        grad = self.grads[g] * np.float32(1 + self.step_no)
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        t = self.step_no + 1
        mhat = m / (1 - b1**t)
        vhat = v / (1 - b2**t)
        self.params[g] -= lr * mhat / (np.sqrt(vhat) + eps)

    def write(self, g: int) -> Any:
        return self.tier.write(g, self.host[g])

    def release(self, g: int) -> None:
        del self.host[g]
        self.live -= 1

    def step_sequential(self) -> None:
        for g in range(GROUPS):
            self.read(g).synchronize()
            self.compute(g)
            self.write(g).synchronize()
            self.release(g)
        self.step_no += 1

    def step_pipelined(self) -> None:
        pipelined(range(GROUPS), self.read, self.compute, self.write, release=self.release)
        self.step_no += 1

    def states(self) -> list[bytes]:
        out = []
        for g in range(GROUPS):
            buf = np.empty((2, SIZE), np.float32)
            self.tier.read(g, buf).synchronize()
            out.append(buf.tobytes())
        return out


@pytest.mark.parametrize("direct", [None, False], ids=["auto-direct", "buffered"])
def test_pipelined_step_is_bit_identical_to_the_sequential_loop(tmp_path: Path, direct: bool | None) -> None:
    with (
        NvmeTier(tmp_path / "a", budget="4MiB", chunk_size="8KiB", direct=direct) as ta,
        NvmeTier(tmp_path / "b", budget="4MiB", chunk_size="8KiB", direct=direct) as tb,
    ):
        seq, pipe = AdamGroups(ta), AdamGroups(tb)
        for _ in range(4):
            seq.step_sequential()
            pipe.step_pipelined()
        assert [p.tobytes() for p in seq.params] == [p.tobytes() for p in pipe.params]
        assert seq.states() == pipe.states()
        assert seq.peak_live == 1 and pipe.peak_live == 3 and pipe.live == 0 and pipe.host == {}


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_few_groups(tmp_path: Path, n: int) -> None:
    calls: list[tuple[str, int]] = []

    class Done:
        def synchronize(self) -> None:
            pass

    def step(name: str) -> Any:
        return lambda g: calls.append((name, g)) or Done()

    pipelined(range(n), step("read"), step("compute"), step("write"), release=step("release"))
    for g in range(n):
        mine = [c for c, gg in calls if gg == g]
        assert mine == ["read", "compute", "write", "release"]
    assert len(calls) == 4 * n


def test_failed_compute_keeps_unwritten_groups_and_releases_the_rest(tmp_path: Path) -> None:
    with NvmeTier(tmp_path, budget="4MiB") as tier:
        groups = AdamGroups(tier)
        real = groups.compute

        def compute(g: int) -> None:
            if g == 4:
                raise FloatingPointError("boom")
            real(g)

        with pytest.raises(FloatingPointError) as info:
            pipelined(range(GROUPS), groups.read, compute, groups.write, release=groups.release)
        assert info.value.unwritten_groups == [4]  # type: ignore[attr-defined]
        assert sorted(groups.host) == [4]  # 0..3 written and released, 5 read and released, 4 kept
        assert all(g in tier for g in range(GROUPS))


def test_failed_write_keeps_that_groups_host_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(tmp_path, budget="4MiB") as tier:
        groups = AdamGroups(tier)
        real_write = groups.write
        handles: dict[int, Any] = {}

        def write(g: int) -> Any:
            if g == 2:
                handles[1].exception()  # group 1's write must not run into the failing pwritev below (a race)
                real = os.pwritev

                def fail(fd: int, buffers: Any, offset: int) -> int:
                    raise OSError(errno.ENOSPC, "No space left on device")

                monkeypatch.setattr(os, "pwritev", fail)
                try:
                    handle = real_write(g)
                    handle.exception()  # let it fail before later writes use the real pwritev again
                finally:
                    monkeypatch.setattr(os, "pwritev", real)
                return handle
            handles[g] = real_write(g)
            return handles[g]

        with pytest.raises(offcore.StorageFullError) as info:
            pipelined(range(GROUPS), groups.read, groups.compute, write, release=groups.release)
        assert info.value.unwritten_groups == [2]  # type: ignore[attr-defined]
        assert 2 not in tier and sorted(groups.host) == [2]
        kept = groups.host[2].copy()
        tier.write(2, groups.host[2]).synchronize()  # the caller writes it again: nothing lost
        back = np.empty_like(kept)
        tier.read(2, back).synchronize()
        assert back.tobytes() == kept.tobytes()


def test_failed_read_releases_its_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(tmp_path, budget="4MiB") as tier:
        groups = AdamGroups(tier)
        os.truncate(os.path.join(tier.directory, "00000003.blk"), 10)
        with pytest.raises(offcore.StorageFileTruncatedError) as info:
            pipelined(range(GROUPS), groups.read, groups.compute, groups.write, release=groups.release)
        assert info.value.unwritten_groups == []  # type: ignore[attr-defined]
        assert groups.host == {} and groups.live == 0


def test_two_hop_transfer_time_formula() -> None:
    from offcore.sim.formulas import transfer_time, two_hop_transfer_time

    mib = 2**20
    # unstaged: the hops add up; staged: the slower hop paces, the faster one shows once per chunk
    assert two_hop_transfer_time(64 * mib, 1e9, 4e9) == transfer_time(64 * mib, 1e9) + transfer_time(64 * mib, 4e9)
    staged = two_hop_transfer_time(64 * mib, 1e9, 4e9, chunk=mib)
    assert staged == pytest.approx(64 * mib / 1e9 + mib / 4e9)
    assert two_hop_transfer_time(64 * mib, 4e9, 1e9, chunk=mib) == pytest.approx(mib / 4e9 + 64 * mib / 1e9)
    assert two_hop_transfer_time(10.5, 1.0, 1.0, chunk=2.0) == 12.5  # first chunk's hop 1, then all of hop 2
    assert two_hop_transfer_time(0, 1.0, 2.0, latency=0.5) == 1.0
    with pytest.raises(offcore.ConfigurationError):
        two_hop_transfer_time(10, 1.0, 1.0, chunk=-1)


@pytest.mark.parametrize("lookahead", [2, 3])
def test_a_deeper_lookahead_gives_the_same_bits_with_lookahead_plus_two_groups_live(
    tmp_path: Path, lookahead: int
) -> None:
    with (
        NvmeTier(tmp_path / "a", budget="4MiB", chunk_size="8KiB") as ta,
        NvmeTier(tmp_path / "b", budget="4MiB", chunk_size="8KiB") as tb,
    ):
        seq, pipe = AdamGroups(ta), AdamGroups(tb)
        for _ in range(3):
            seq.step_sequential()
            pipelined(range(GROUPS), pipe.read, pipe.compute, pipe.write, release=pipe.release, lookahead=lookahead)
            pipe.step_no += 1
        assert [p.tobytes() for p in seq.params] == [p.tobytes() for p in pipe.params]
        assert seq.states() == pipe.states()
        assert pipe.peak_live == min(GROUPS, lookahead + 2) and pipe.live == 0


def test_lookahead_must_be_positive() -> None:
    from offcore.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="lookahead"):
        pipelined([1], lambda g: None, lambda g: None, lambda g: None, lookahead=0)  # type: ignore[arg-type,return-value]
