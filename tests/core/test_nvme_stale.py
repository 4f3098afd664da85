"""Directories of tiers whose process died without cleaning up (SIGKILL) are removed by the next tier there,
and nothing else is (Note [Stale directories: an owner lock] in offcore/nvme/files.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from offcore.nvme import NvmeTier
from offcore.nvme.files import OWNER_FILE, remove_stale_directories

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from offcore.nvme import NvmeTier

    tier = NvmeTier(sys.argv[1], budget="1MiB")
    tier.write("state", np.arange(1000, dtype=np.float32)).synchronize()
    print(tier.directory, flush=True)
    sys.stdin.read()  # until the parent kills it (or closes stdin)
    """
)


class Child:
    """A process with a live tier under ``root``; ``directory`` is known once it printed it (no sleeps)."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.directory = self.proc.stdout.readline().strip()
        assert self.directory, "the child did not open its tier"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.returncode == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Child]:
    c = Child(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def test_a_sigkilled_process_directory_is_removed_by_the_next_tier(tmp_path: Path, child: Child) -> None:
    assert os.path.isdir(child.directory) and len(os.listdir(child.directory)) == 2  # its object and its marker
    with NvmeTier(tmp_path, budget="1MiB") as alive_check:  # its owner lives: left alone
        assert alive_check.removed_stale == [] and os.path.isdir(child.directory)
    child.kill()
    assert os.path.isdir(child.directory)  # SIGKILL ran no cleanup
    with NvmeTier(tmp_path, budget="1MiB") as tier:
        assert tier.removed_stale == [child.directory]
        assert not os.path.exists(child.directory)
        assert os.listdir(tmp_path) == [os.path.basename(tier.directory)]
        tier.write("x", np.ones(10)).synchronize()  # the new tier works


def _fake_dead_directory(root: Path, name: str = "offcore-999999-abcdefgh", marker: str | None = None) -> Path:
    """What a dead process leaves: a tier directory with a marker nobody holds a lock on."""
    directory = root / name
    directory.mkdir(mode=0o700)
    (directory / "00000000.blk").write_bytes(b"x" * 4096)
    text = "offcore NVMe tier\npid 999999\nstart 1\n" if marker is None else marker
    (directory / OWNER_FILE).write_text(text)
    return directory


def test_only_offcore_directories_with_a_free_owner_lock_are_removed(tmp_path: Path) -> None:
    dead = _fake_dead_directory(tmp_path)
    no_marker = tmp_path / "offcore-12-nomarker"
    no_marker.mkdir(mode=0o700)
    (no_marker / "00000000.blk").write_bytes(b"keep")
    wrong_name = _fake_dead_directory(tmp_path, name="mine-12-abc")
    foreign_marker = _fake_dead_directory(tmp_path, name="offcore-13-foreign", marker="not offcore's\n")
    a_file = tmp_path / "offcore-14-afile"
    a_file.write_text("keep")
    with NvmeTier(tmp_path, budget="1MiB") as live:  # this process's own live tier: never taken for dead
        assert live.removed_stale == [str(dead)] and not dead.exists()
        again = _fake_dead_directory(tmp_path)
        assert remove_stale_directories(tmp_path) == [str(again)]  # the function alone does the same
        for kept in (no_marker, wrong_name, foreign_marker, a_file, Path(live.directory)):
            assert kept.exists(), kept
        assert remove_stale_directories(tmp_path) == []


def test_symlinks_are_never_followed_nor_removed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    target = _fake_dead_directory(elsewhere)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    link = root / "offcore-999998-linked"
    link.symlink_to(target)
    marker_link_dir = root / "offcore-999997-markerlink"
    marker_link_dir.mkdir(mode=0o700)
    (marker_link_dir / OWNER_FILE).symlink_to(target / OWNER_FILE)
    with NvmeTier(root, budget="1MiB") as tier:
        assert tier.removed_stale == []
    assert link.is_symlink() and target.exists() and (target / "00000000.blk").exists()
    assert marker_link_dir.exists()


def test_a_closed_tier_leaves_nothing_and_its_lock_is_released(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, budget="1MiB")
    directory = tier.directory
    tier.close()
    assert not os.path.exists(directory) and os.listdir(tmp_path) == []
    from offcore.nvme import files

    assert directory not in files._owner_locks
