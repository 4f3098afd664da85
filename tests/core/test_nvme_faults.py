"""The NVMe tier loses nothing: injected I/O errors, short transfers, a full filesystem, corruption, truncation."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import offcore
from offcore.nvme import ALIGNMENT, NvmeSpec, NvmeTier
from offcore.nvme.files import OWNER_FILE


def data_files(directory: str) -> list[str]:
    """The tier's object files in ``directory`` (not its owner marker, Note [Stale directories: an owner lock])."""
    return [name for name in os.listdir(directory) if name != OWNER_FILE]


CHUNK = 2 * ALIGNMENT


def _data(n: int = 5000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n)


@pytest.fixture(params=[None, False], ids=["auto-direct", "buffered"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    with NvmeTier(tmp_path / "nvme", budget="64MiB", chunk_size=CHUNK, direct=request.param) as t:
        yield t


def _failing_pwritev(code: int, *, after: int = 0) -> Any:
    """A pwritev that writes ``after`` calls' worth normally, then raises ``code``."""
    real = os.pwritev
    calls = {"n": 0}

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    return pwritev


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (errno.EIO, offcore.StorageError),
        (errno.ENOSPC, offcore.StorageFullError),
        (errno.EDQUOT, offcore.StorageFullError),
        (errno.EFBIG, offcore.StorageFullError),
    ],
)
def test_failed_write_raises_and_keeps_the_host_copy(
    tier: NvmeTier, monkeypatch: pytest.MonkeyPatch, code: int, error: type[Exception]
) -> None:
    original = _data()
    source = original.copy()
    monkeypatch.setattr(os, "pwritev", _failing_pwritev(code, after=1))  # fails part way through
    handle = tier.write("s", source)
    with pytest.raises(error) as info:
        handle.synchronize()
    assert info.value.errno == code
    message = str(info.value)
    assert tier.directory in message and "bytes" in message.lower() or "KiB" in message
    assert "host buffer" in message
    with pytest.raises(error):
        handle.query()  # a poller never mistakes "failed" for "done"
    assert handle.exception() is info.value
    assert (source == original).all()  # the tier above still holds the data
    assert "s" not in tier and tier.used_bytes == 0 and data_files(tier.directory) == []
    with pytest.raises(offcore.IllegalTransitionError, match="host copy is the valid one"):
        tier.read("s", np.empty_like(source))
    monkeypatch.undo()
    tier.write("s", source).synchronize()  # written again once the disk is fine
    out = np.empty_like(source)
    tier.read("s", out).synchronize()
    assert (out == original).all()


def test_failed_rewrite_drops_the_stale_disk_copy(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    tier.write("s", _data(seed=1)).synchronize()
    newer = _data(seed=2)
    monkeypatch.setattr(os, "pwritev", _failing_pwritev(errno.EIO))
    with pytest.raises(offcore.StorageError):
        tier.write("s", newer).synchronize()
    assert "s" not in tier  # half old, half new on disk: never readable
    assert (newer == _data(seed=2)).all()


def test_write_that_makes_no_progress_is_a_short_transfer(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: 0)
    with pytest.raises(offcore.ShortTransferError, match="stopped after 0 bytes"):
        tier.write("s", _data()).synchronize()
    assert "s" not in tier and data_files(tier.directory) == []


def _short(real: Any, *, cap: int) -> Any:
    """Report at most ``cap`` bytes moved per call (what a kernel may do): the tier must carry on.

    The whole request is still carried out (an O_DIRECT fd refuses an unaligned length),
    so the tier moves the rest again, from an unaligned offset: through a buffered fd.
    """

    def call(fd: int, buffers: Any, offset: int) -> int:
        return min(cap, real(fd, buffers, offset))

    return call


@pytest.mark.parametrize("cap", [1000, ALIGNMENT])
def test_short_counts_are_continued_not_lost(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    original = _data(3333)
    monkeypatch.setattr(os, "pwritev", _short(os.pwritev, cap=cap))
    monkeypatch.setattr(os, "preadv", _short(os.preadv, cap=cap))
    tier.write("s", original).synchronize()
    out = np.empty_like(original)
    tier.read("s", out).synchronize()
    assert out.tobytes() == original.tobytes()


def test_failed_read_raises_and_the_disk_copy_survives(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    original = _data()
    tier.write("s", original).synchronize()

    def eio(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    out = np.empty_like(original)
    with pytest.raises(offcore.StorageError, match="EIO") as info:
        tier.read("s", out).synchronize()
    assert info.value.errno == errno.EIO and tier.directory in str(info.value)
    monkeypatch.undo()
    tier.read("s", out).synchronize()
    assert (out == original).all()


def test_read_hitting_end_of_file_is_truncation(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    tier.write("s", _data()).synchronize()
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    with pytest.raises(offcore.StorageFileTruncatedError, match="end of the file"):
        tier.read("s", np.empty(5000)).synchronize()


def _file_of(tier: NvmeTier) -> str:
    (name,) = data_files(tier.directory)
    return os.path.join(tier.directory, name)


def test_truncated_file_is_detected(tier: NvmeTier) -> None:
    tier.write("s", _data()).synchronize()
    os.truncate(_file_of(tier), 40000 - 1)  # one byte of the data gone (and the padding, under O_DIRECT)
    with pytest.raises(offcore.StorageFileTruncatedError, match="truncated it") as info:
        tier.read("s", np.empty(5000))
    assert "39999 bytes" in str(info.value)


def test_missing_file_is_detected(tier: NvmeTier) -> None:
    tier.write("s", _data()).synchronize()
    os.unlink(_file_of(tier))  # the tier still holds it open: detected by its link count
    with pytest.raises(offcore.StorageFileMissingError, match="removed or replaced") as info:
        tier.read("s", np.empty(5000))
    assert info.value.errno == errno.ENOENT
    with pytest.raises(offcore.StorageFileMissingError, match="gone"):  # now also closed: open fails
        tier.read("s", np.empty(5000))


def test_missing_file_is_detected_when_files_are_not_kept_open(tmp_path: Path) -> None:
    with NvmeTier(tmp_path, budget="1MiB", max_open_files=0) as tier:
        tier.write("s", _data()).synchronize()
        assert _open_files(tier) == 0
        os.unlink(_file_of(tier))
        with pytest.raises(offcore.StorageFileMissingError, match="gone"):
            tier.read("s", np.empty(5000))


def _open_files(tier: NvmeTier) -> int:
    fds = os.listdir("/proc/self/fd")
    paths = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in fds]
    # the owner marker's lock is held while the tier lives (Note [Stale directories: an owner lock])
    return sum(1 for p in paths if p.startswith(tier.directory + os.sep) and os.path.basename(p) != OWNER_FILE)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_idle_open_files_are_bounded_and_closed(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, budget="1MiB", max_open_files=2)
    for k in range(5):
        tier.write(k, _data(100, seed=k)).synchronize()
    assert _open_files(tier) == 2
    out = np.empty(100)
    for k in range(5):
        tier.read(k, out).synchronize()
        assert (out == _data(100, seed=k)).all()
    assert _open_files(tier) == 2
    tier.delete(4)
    assert _open_files(tier) == 1
    tier.close()
    assert _open_files(tier) == 0


def test_checksum_catches_a_flipped_byte(tmp_path: Path) -> None:
    with NvmeTier(tmp_path, budget="1MiB", chunk_size=CHUNK, verify=True) as tier:
        original = _data()
        tier.write("s", original).synchronize()
        path = _file_of(tier)
        with open(path, "r+b") as f:
            f.seek(3 * CHUNK + 17)
            byte = f.read(1)
            f.seek(3 * CHUNK + 17)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(offcore.ChecksumMismatchError, match=f"bytes {3 * CHUNK}..{4 * CHUNK}") as info:
            tier.read("s", np.empty_like(original)).synchronize()
        assert path in str(info.value)
        tier.write("s", original).synchronize()  # rewriting repairs it
        out = np.empty_like(original)
        tier.read("s", out).synchronize()
        assert (out == original).all()


def test_a_block_changed_on_disk_is_caught_by_default(tmp_path: Path) -> None:
    """No verify= given: a byte changed in the file is a ChecksumMismatchError, not data (it was read back
    silently while verify defaulted to False); verify=False still opts out."""
    for verify in (None, False):
        options = {} if verify is None else {"verify": verify}
        with NvmeTier(tmp_path / str(verify), budget="1MiB", chunk_size=CHUNK, **options) as tier:
            original = _data()
            tier.write("s", original).synchronize()
            with open(_file_of(tier), "r+b") as f:
                f.seek(CHUNK + 5)
                f.write(b"\x7f")
            out = np.empty_like(original)
            if verify is None:
                assert tier.verify
                with pytest.raises(offcore.ChecksumMismatchError):
                    tier.read("s", out).synchronize()
            else:
                tier.read("s", out).synchronize()
                assert not (out == original).all()
    assert NvmeSpec(str(tmp_path)).verify


def test_a_full_filesystem_via_a_file_size_limit(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes writes past the limit fail with EFBIG (SIGXFSZ ignored), as a full disk would."""
    code = f"""
        import resource, signal
        import numpy as np
        import offcore
        from offcore.nvme import NvmeTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with NvmeTier({str(tmp_path)!r}, budget="64MiB", chunk_size="256KiB") as tier:
            small = np.arange(1000.0)
            tier.write("small", small).synchronize()
            big = np.arange(300_000.0)                     # 2.3 MiB: past the 1 MiB limit
            try:
                tier.write("big", big).synchronize()
            except offcore.StorageFullError as exc:
                assert "size limit" in str(exc) and tier.directory in str(exc), exc
                print("full", exc.errno)
            assert (big == np.arange(300_000.0)).all() and "big" not in tier
            out = np.empty_like(small); tier.read("small", out).synchronize()
            assert (out == small).all()
            print("ok", tier.used_bytes)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["full", str(errno.EFBIG), "ok", "8192"]


@pytest.mark.skipif(
    not shutil.which("unshare") or not hasattr(os, "getuid") or os.getuid() != 0,
    reason="mounting a small tmpfs needs root and unshare",
)
def test_a_small_filesystem_that_fills_up(tmp_path: Path) -> None:
    """A real 1 MiB tmpfs, mounted in a private mount namespace: ENOSPC, nothing lost, space given back."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    code = f"""
        import errno, os
        import numpy as np
        import offcore
        from offcore.nvme import NvmeTier
        with NvmeTier({str(mnt)!r}, budget="64MiB", chunk_size="64KiB") as tier:
            a = np.arange(65536.0)                          # 512 KiB: fits
            tier.write("a", a).synchronize()
            b = np.arange(131072.0)                         # 1 MiB: does not
            try:
                tier.write("b", b).synchronize()
                raise SystemExit("no error")
            except offcore.StorageFullError as exc:
                assert exc.errno == errno.ENOSPC and "full" in str(exc), exc
            assert "b" not in tier and (b == np.arange(131072.0)).all()
            tier.write("c", np.arange(32768.0)).synchronize()   # the half-written file's space came back
            out = np.empty_like(a); tier.read("a", out).synchronize()
            assert (out == a).all()
            print("ok")
    """
    script = tmp_path / "fill.py"
    script.write_text(textwrap.dedent(code))
    shell = f"mount -t tmpfs -o size=1m,mode=0700 tmpfs {mnt} && exec {sys.executable} {script}"
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True)
    if "mount" in out.stderr and out.returncode != 0 and "ok" not in out.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
