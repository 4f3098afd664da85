"""The NVMe storage tier: round trips, budget, private files, no clobbering, cleanup, handles, the ledger."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import offcore
from offcore.kinds import Kind, Tier
from offcore.ledger import Ledger
from offcore.nvme import ALIGNMENT, NvmeTier, aligned_empty
from offcore.nvme.files import OWNER_FILE
from offcore.pool import HostBufferPool


def data_files(directory: str) -> list[str]:
    """The tier's object files in ``directory`` (not its owner marker, Note [Stale directories: an owner lock])."""
    return [name for name in os.listdir(directory) if name != OWNER_FILE]


CHUNK = 2 * ALIGNMENT  # small chunks so modest objects span several requests

DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
    np.clongdouble,
    np.dtype("datetime64[ns]"),
    np.dtype("timedelta64[s]"),
    np.dtype("S5"),
    np.dtype("U3"),
    np.dtype("V7"),
    np.dtype([("a", np.int8), ("b", np.float64)]),
]
SIZES = [0, 1, 3, 511, 4097, CHUNK - 1, CHUNK, 2 * CHUNK + 7]


def _random(dtype: Any, n: int, seed: int = 0) -> np.ndarray:
    """``n`` elements of ``dtype`` with random bytes (every bit pattern, NaNs included)."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1
    if dtype.kind == "U":
        raw = np.random.default_rng(seed).integers(32, 0x2FFF, n * 3, dtype=np.uint32).view(np.uint8)
    return raw.view(dtype)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(params=[None, False], ids=["auto-direct", "buffered"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    with NvmeTier(tmp_path / "nvme", budget="64MiB", chunk_size=CHUNK, direct=request.param, verify=True) as t:
        yield t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_odd_sizes_bit_exact(tier: NvmeTier, dtype: Any) -> None:
    originals = {n: _random(dtype, n, seed=n) for n in SIZES}
    handles = [tier.write(("x", n), a) for n, a in originals.items()]  # all in flight together
    for h in handles:
        h.synchronize()
    outs = {n: np.empty_like(a) for n, a in originals.items()}
    for h in [tier.read(("x", n), outs[n]) for n in SIZES]:
        h.synchronize()
    for n in SIZES:
        assert _same_bytes(outs[n], originals[n]), (dtype, n)


def test_multidimensional_arrays_and_memoryviews(tier: NvmeTier) -> None:
    a = np.arange(6 * 7 * 5, dtype=np.float32).reshape(6, 7, 5)
    tier.write("a", a).synchronize()
    out = np.zeros_like(a)
    tier.read("a", out).synchronize()
    assert _same_bytes(out, a)
    tier.write("b", memoryview(b"hello world")).synchronize()
    back = bytearray(11)
    tier.read("b", memoryview(back)).synchronize()
    assert bytes(back) == b"hello world"


def test_aligned_and_pool_buffers_move_in_place(tmp_path: Path) -> None:
    pool = HostBufferPool(aligned_empty, budget="1MiB", block_size="1MiB", alignment=ALIGNMENT)
    with NvmeTier(tmp_path, budget="4MiB", chunk_size=CHUNK) as tier:
        src = pool.acquire(3 * ALIGNMENT)
        assert src.view.ctypes.data % ALIGNMENT == 0
        src.view[:] = np.arange(src.nbytes) % 251
        tier.write("p", src.view).synchronize()
        dst = pool.acquire(3 * ALIGNMENT)
        tier.read("p", dst.view).synchronize()
        assert (dst.view == src.view).all()
        pool.release(src)
        pool.release(dst)


def test_rewrite_in_place_grow_and_shrink(tier: NvmeTier) -> None:
    for n in (100, 3 * CHUNK + 1, 5, 0, 7000):
        a = _random(np.uint8, n, seed=n)
        tier.write("k", a).synchronize()
        out = np.empty(n, np.uint8)
        tier.read("k", out).synchronize()
        assert _same_bytes(out, a)
        assert tier.nbytes("k") == n
    assert len(data_files(tier.directory)) == 1  # rewritten in place: one file


def test_bad_buffers_and_sizes_are_configuration_errors(tier: NvmeTier) -> None:
    with pytest.raises(offcore.ConfigurationError, match="contiguous"):
        tier.write("s", np.arange(10)[::2])
    with pytest.raises(offcore.ConfigurationError, match="Python objects"):
        tier.write("o", np.array([object()]))
    tier.write("k", np.arange(4)).synchronize()
    with pytest.raises(offcore.ConfigurationError, match="exactly"):
        tier.read("k", np.empty(5, np.int64))
    ro = np.empty(4, np.int64)
    ro.flags.writeable = False
    with pytest.raises(offcore.ConfigurationError, match="read-only"):
        tier.read("k", ro)
    with pytest.raises(offcore.IllegalTransitionError, match="not on the NVMe tier"):
        tier.read("nope", np.empty(1))
    with pytest.raises(offcore.ConfigurationError):
        NvmeTier(tier.directory, budget="1MiB", chunk_size=1000)


def test_budget_exceeded_is_refused_before_any_io(tmp_path: Path) -> None:
    with NvmeTier(tmp_path, budget=3 * ALIGNMENT, direct=False) as tier:
        tier.write("a", np.zeros(2 * ALIGNMENT, np.uint8)).synchronize()
        with pytest.raises(offcore.CapacityExceededError, match="NVMe tier budget") as info:
            tier.write("b", np.zeros(2 * ALIGNMENT, np.uint8))
        assert isinstance(info.value, MemoryError)
        assert "b" not in tier and tier.used_bytes == 2 * ALIGNMENT
        assert sorted(data_files(tier.directory)) == ["00000000.blk"]
        tier.write("a", np.zeros(3 * ALIGNMENT, np.uint8)).synchronize()  # a rewrite counts its old size back
        assert tier.used_bytes == 3 * ALIGNMENT == tier.peak_used_bytes
        tier.delete("a")
        assert tier.used_bytes == 0 and data_files(tier.directory) == []


def test_direct_files_count_padded_bytes(tmp_path: Path) -> None:
    with NvmeTier(tmp_path, budget="1MiB", direct=True) as tier:
        tier.write("a", np.zeros(10, np.uint8)).synchronize()
        assert tier.used_bytes == ALIGNMENT
        assert os.path.getsize(os.path.join(tier.directory, "00000000.blk")) == ALIGNMENT


def test_directory_0700_and_files_0600(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    with NvmeTier(root, budget="1MiB") as tier:
        tier.write("a", np.ones(3)).synchronize()
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
        (name,) = data_files(tier.directory)
        assert stat.S_IMODE(os.stat(os.path.join(tier.directory, name)).st_mode) == 0o600
        assert os.path.dirname(tier.directory) == str(root)


def test_unsafe_directories_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(offcore.UnsafeStoragePathError, match="symlink"):
        NvmeTier(link, budget="1MiB")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(offcore.UnsafeStoragePathError, match="chmod go-w"):
        NvmeTier(shared, budget="1MiB")
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(offcore.UnsafeStoragePathError, match="not a directory"):
        NvmeTier(afile, budget="1MiB")
    assert os.listdir(real) == [] and os.listdir(shared) == []


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to give a directory away")
def test_someone_elses_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4321, -1)
    with pytest.raises(offcore.UnsafeStoragePathError, match="uid 4321"):
        NvmeTier(theirs, budget="1MiB")


def test_planted_symlink_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    with NvmeTier(tmp_path / "nvme", budget="1MiB", direct=False) as tier:
        # at the name of the next file
        os.symlink(victim, os.path.join(tier.directory, "00000000.blk"))
        with pytest.raises(offcore.StorageError, match="00000000.blk"):
            tier.write("a", np.ones(4))
        assert "a" not in tier
        # in place of an existing file, between writes
        tier.write("b", np.ones(4)).synchronize()
        path = os.path.join(tier.directory, "00000001.blk")
        os.unlink(path)
        os.symlink(victim, path)
        with pytest.raises(offcore.StorageError):
            tier.write("b", np.zeros(4))
        with pytest.raises(offcore.StorageError):
            tier.read("b", np.empty(4))
    assert victim.read_bytes() == b"precious"


def test_two_tiers_on_one_directory_do_not_clobber(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with NvmeTier(root, budget="1MiB") as one, NvmeTier(root, budget="1MiB") as two:
        assert one.directory != two.directory
        one.write("k", np.full(100, 1.0)).synchronize()
        two.write("k", np.full(100, 2.0)).synchronize()
        a, b = np.empty(100), np.empty(100)
        one.read("k", a).synchronize()
        two.read("k", b).synchronize()
        assert (a == 1.0).all() and (b == 2.0).all()
        two.close()
        one.read("k", a).synchronize()
        assert (a == 1.0).all()


def test_another_process_on_the_same_directory_does_not_clobber(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with NvmeTier(root, budget="1MiB") as mine:
        mine.write("k", np.full(1000, 7, np.int64)).synchronize()
        code = f"""
            import numpy as np
            from offcore.nvme import NvmeTier
            with NvmeTier({str(root)!r}, budget="1MiB") as t:
                t.write("k", np.full(1000, 9, np.int64)).synchronize()
                out = np.empty(1000, np.int64); t.read("k", out).synchronize()
                assert (out == 9).all()
        """
        subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True)
        out = np.empty(1000, np.int64)
        mine.read("k", out).synchronize()
        assert (out == 7).all()
        assert os.listdir(root) == [os.path.basename(mine.directory)]  # the other one cleaned up after itself


def test_files_removed_on_close(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, budget="1MiB")
    tier.write("a", np.ones(1000)).synchronize()
    directory = tier.directory
    tier.close()
    tier.close()  # idempotent
    assert not os.path.exists(directory) and os.listdir(tmp_path) == []
    with pytest.raises(offcore.IllegalTransitionError, match="closed"):
        tier.write("a", np.ones(3))


def test_files_removed_on_exception_and_on_garbage_collection(tmp_path: Path) -> None:
    directory = ""
    with pytest.raises(KeyError):
        with NvmeTier(tmp_path, budget="1MiB") as tier:
            directory = tier.directory
            tier.write("a", np.ones(1000)).synchronize()
            raise KeyError("boom")
    assert not os.path.exists(directory)
    tier = NvmeTier(tmp_path, budget="1MiB")
    tier.write("a", np.ones(1000)).synchronize()
    directory = tier.directory
    del tier
    gc.collect()
    assert not os.path.exists(directory)


def test_files_removed_at_interpreter_exit(tmp_path: Path) -> None:
    code = f"""
        import numpy as np
        from offcore.nvme import NvmeTier
        tier = NvmeTier({str(tmp_path)!r}, budget="1MiB")
        handle = tier.write("a", np.ones(100_000))   # still in flight at exit, perhaps
        print(tier.directory, flush=True)
        keep = [tier]   # referenced until the very end: only the exit hook can clean up
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, capture_output=True, text=True)
    directory = out.stdout.strip()
    assert directory.startswith(str(tmp_path)) and not os.path.exists(directory)
    assert os.listdir(tmp_path) == []


def test_close_waits_for_writes_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = os.pwritev

    def gated(fd: int, buffers: Any, offset: int) -> int:
        gate.wait()
        return real(fd, buffers, offset)

    tier = NvmeTier(tmp_path, budget="1MiB", direct=False)
    monkeypatch.setattr(os, "pwritev", gated)
    handle = tier.write("a", np.ones(1000))
    assert handle.query() is False and not handle.done
    with pytest.raises(offcore.IllegalTransitionError, match="in flight"):
        tier.write("a", np.ones(1000))
    with pytest.raises(offcore.IllegalTransitionError, match="in flight"):
        tier.read("a", np.empty(1000))
    assert "a" not in tier
    closer = threading.Thread(target=tier.close)
    closer.start()
    gate.set()
    closer.join()
    assert handle.query() is True and handle.seconds >= 0
    assert not os.path.exists(tier.directory)


def test_ledger_counts_bytes_on_nvme_per_kind(tmp_path: Path) -> None:
    ledger = Ledger()
    with NvmeTier(tmp_path, budget="1MiB", ledger=ledger) as tier:
        tier.write("m", np.ones(100, np.float32)).synchronize()
        tier.write("p", np.ones(10, np.float64), kind=Kind.PARAMETER).synchronize()
        assert ledger.bytes(Tier.NVME, Kind.OPTIMIZER_STATE) == 400
        assert ledger.bytes(Tier.NVME, Kind.PARAMETER) == 80
        tier.write("m", np.ones(50, np.float32)).synchronize()
        assert ledger.bytes(Tier.NVME, Kind.OPTIMIZER_STATE) == 200
        tier.delete("p")
        assert ledger.bytes(Tier.NVME, Kind.PARAMETER) == 0
        assert tier.writes.bytes == 680 and tier.writes.copies == 3
        tier.read("m", np.empty(50, np.float32)).synchronize()
        assert tier.reads.bytes == 200 and tier.read_link.samples == 1 and tier.write_link.samples == 3
    assert ledger.bytes(Tier.NVME) == 0


def test_o_direct_fallback_when_the_filesystem_refuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")  # what tmpfs said before Linux 6.6
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    with NvmeTier(tmp_path / "a", budget="1MiB") as tier:
        assert tier.direct is False and "EINVAL" in tier.direct_reason
        a = _random(np.float64, 1001)
        tier.write("a", a).synchronize()
        out = np.empty_like(a)
        tier.read("a", out).synchronize()
        assert _same_bytes(out, a)
    with pytest.raises(offcore.ConfigurationError, match="O_DIRECT was required"):
        NvmeTier(tmp_path / "b", budget="1MiB", direct=True)
    assert os.listdir(tmp_path / "b") == []


def test_o_direct_fallback_when_aligned_writes_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int, data: Any, offset: int) -> int:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)  # only the probe uses pwrite
    with NvmeTier(tmp_path, budget="1MiB") as tier:
        assert tier.direct is False and "aligned O_DIRECT write failed" in tier.direct_reason
        tier.write("a", np.ones(3)).synchronize()


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "nvme.md").read_text()
    example = doc.split("## Example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/nvme.md", "exec"), {})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "3200000"
    assert lines[1].split() == ["0.040000003", "4000000", "True"]
