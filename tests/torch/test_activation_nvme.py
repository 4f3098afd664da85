"""Saved activations on the NVMe tier (issue 13): ``offload_activations(dev, nvme=PATH)`` / ``tier="nvme"``.

Host copies go on to disk after their device-to-host copy landed and come back (NVMe -> host ->
device) before backward uses them: training stays bit-identical to keep-all (sanitizer on), the
files go when the region's records go (also after an exception), and the pinned host bytes the
region holds at once are lower.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import GPTConfig, Workload, cnn_workload, gpt_workload, mlp_workload  # noqa: E402
from offcore_torch.testing import assert_bit_identical, run_workload  # noqa: E402
from offload_helpers import pool_used_bytes, settle  # noqa: E402

import offcore  # noqa: E402
from offcore.nvme.spec import NvmeSpec  # noqa: E402

STEPS = 3
WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt": lambda: gpt_workload(
        GPTConfig(vocab_size=128, d_model=64, n_heads=4, n_layers=2, seq_len=32, dropout=0.1), batch_size=2
    ),
    "cnn": lambda: cnn_workload(in_channels=3, width=8, n_classes=10, image_size=16, batch_size=4),
}


def files_under(path: Any) -> list[str]:
    return [os.path.join(root, name) for root, dirs, names in os.walk(path) for name in dirs + names]


def wait_for_writes(handle: Any) -> None:
    """Wait for the region's device-to-host copies (their landings start the writes), then (on their I/O
    handles) for its writes in flight, and settle them."""
    offcore_torch.synchronize(handle.device)
    spill = handle._spill
    for _, io in list(spill.writes.values()):
        io.exception()  # waits; a failed write is the region's to settle (never raises here)
    spill.poll()


@contextlib.contextmanager
def settled_offload(device: Any, **options: Any) -> Iterator[Any]:
    """``offload_activations(device, **options)`` whose spills settle after every module's forward
    (so that what goes to disk does not depend on the machine's timing)."""
    with offcore_torch.offload_activations(device, **options) as handle:
        hook = torch.nn.modules.module.register_module_forward_hook(lambda *_: wait_for_writes(handle))
        try:
            yield handle
        finally:
            hook.remove()


@pytest.mark.parametrize("link", ["unlimited", "slow"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_activations_on_nvme_train_bit_identically_and_leave_no_file(
    make_fake_device: Callable[..., Any], tmp_path: Any, name: str, link: str
) -> None:
    device = make_fake_device(link=link)
    reference = run_workload(WORKLOADS[name](), device=device, steps=STEPS)

    spilled = run_workload(
        WORKLOADS[name](),
        device=device,
        steps=STEPS,
        offload=lambda: settled_offload(device, min_bytes="1KiB", nvme=str(tmp_path), nvme_read_ahead="8KiB"),
    )

    assert_bit_identical(reference, spilled, labels=("keep-all", "activations on NVMe"))
    stats = [s for s in spilled.stats if s is not None]
    assert len(stats) == STEPS
    assert sum(s.spilled_bytes for s in stats) > 0, "nothing went to disk: the comparison would be vacuous"
    assert sum(s.nvme_read_bytes for s in stats) > 0, "nothing came back from disk"
    assert all(s.nvme_failures == 0 for s in stats)
    settle(device)
    assert files_under(tmp_path) == []  # each region's files and private directory are gone
    assert pool_used_bytes(device) == 0


def test_the_devices_tier_is_shared_and_emptied(make_fake_device: Callable[..., Any], tmp_path: Any) -> None:
    device = make_fake_device()
    reference = run_workload(WORKLOADS["gpt"](), device=device, steps=2)
    tier = offcore_torch.nvme_tier(device, tmp_path, budget="64MiB")
    assert tier is not None
    try:
        spilled = run_workload(
            WORKLOADS["gpt"](),
            device=device,
            steps=2,
            offload=lambda: settled_offload(device, min_bytes="1KiB", tier="nvme"),
        )
        assert_bit_identical(reference, spilled, labels=("keep-all", "activations on the device's NVMe tier"))
        assert sum(s.spilled_bytes for s in spilled.stats if s is not None) > 0
        settle(device)
        assert len(tier) == 0 and tier.used_bytes == 0 and not tier.closed  # files deleted, the tier stays
    finally:
        offcore_torch.nvme_tier(device, None)
    assert files_under(tmp_path) == []


def test_a_full_tier_keeps_the_host_copies(make_fake_device: Callable[..., Any], tmp_path: Any) -> None:
    device = make_fake_device()
    model, x = _deep_mlp(device)
    grads = []
    for nvme in (None, NvmeSpec(str(tmp_path), budget="4KiB")):
        with device:
            for p in model.parameters():
                p.grad = None
            with offcore_torch.offload_activations(device, min_bytes="64KiB", nvme=nvme) as handle:
                hooks = [m.register_forward_hook(lambda *_: offcore_torch.synchronize(device)) for m in model]
                loss = model(x).square().mean()  # every landing seen in forward (its write refused at once)
                for hook in hooks:
                    hook.remove()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        stats = handle.stats()
        if nvme is not None:
            assert stats.nvme_full > 0 and stats.spilled_bytes == 0 and stats.nvme_failures == 0, stats
        del loss
        settle(device)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert files_under(tmp_path) == []
    assert pool_used_bytes(device) == 0


def _deep_mlp(device: Any) -> tuple[Any, Any]:
    with device:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(8)]
        )
        x = torch.randn(256, 128)
    return model, x


def test_pinned_host_bytes_are_lower_and_retained_graphs_read_again(
    make_fake_device: Callable[..., Any], tmp_path: Any
) -> None:
    device = make_fake_device()
    model, x = _deep_mlp(device)
    grads: dict[str, list[Any]] = {}
    peaks: dict[str, int] = {}
    for mode in ("keep", "host", "nvme"):
        with device:
            for p in model.parameters():
                p.grad = None
            if mode == "keep":
                loss = model(x).square().mean()
            else:
                options: dict[str, Any] = {"min_bytes": "64KiB"}
                if mode == "nvme":
                    options.update(nvme=str(tmp_path), nvme_read_ahead="128KiB", prefetch_budget="256KiB")
                with offcore_torch.offload_activations(device, **options) as handle:
                    hooks = []
                    if mode == "nvme":  # each layer's spill settled before the next layer runs
                        hooks = [m.register_forward_hook(lambda *_: wait_for_writes(handle)) for m in model]
                    loss = model(x).square().mean()
                    for hook in hooks:
                        hook.remove()
            loss.backward(retain_graph=True)  # a retained graph: the second backward reads from disk again
            first = [p.grad.clone() for p in model.parameters()]
            loss.backward()
            grads[mode] = first + [p.grad.clone() for p in model.parameters()]
            if mode != "keep":
                stats = handle.stats()
                peaks[mode] = stats.peak_pinned_bytes
                if mode == "nvme":
                    assert stats.spilled_bytes > 0 and stats.nvme_read_bytes >= 2 * 64 * 1024
            del loss
        settle(device)
    for mode in ("host", "nvme"):
        assert all(torch.equal(a, b) for a, b in zip(grads["keep"], grads[mode], strict=True)), mode
    assert peaks["nvme"] < peaks["host"] / 2, peaks
    assert files_under(tmp_path) == []
    assert pool_used_bytes(device) == 0


def test_files_and_buffers_go_after_an_exception_in_forward(
    make_fake_device: Callable[..., Any], tmp_path: Any
) -> None:
    device = make_fake_device()
    model, x = _deep_mlp(device)
    y = None
    with device:
        with pytest.raises(RuntimeError, match="boom"):
            with offcore_torch.offload_activations(device, min_bytes="64KiB", nvme=str(tmp_path)) as handle:
                y = model(x)
                wait_for_writes(handle)
                assert any(name.endswith(".blk") for name in files_under(tmp_path))
                raise RuntimeError("boom")
        del y  # the graph, and every record of the region, goes
    settle(device, collect=True)
    assert files_under(tmp_path) == []
    assert pool_used_bytes(device) == 0


def test_nvme_options_are_checked(make_fake_device: Callable[..., Any], tmp_path: Any) -> None:
    device = make_fake_device()
    with pytest.raises(offcore.ConfigurationError, match="needs an NVMe tier"):
        offcore_torch.offload_activations(device, tier="nvme")
    with pytest.raises(offcore.ConfigurationError, match="tier='disk'"):
        offcore_torch.offload_activations(device, tier="disk")
    with pytest.raises(offcore.ConfigurationError, match="nvme= takes a directory path"):
        offcore_torch.offload_activations(device, nvme=3)
    with pytest.raises(offcore.ConfigurationError, match="pass tier='nvme'"):
        offcore_torch.offload_activations(device, tier="host", nvme=str(tmp_path))
    assert files_under(tmp_path) == []


def test_mlp_workload_with_the_nvme_tier(make_fake_device: Callable[..., Any], tmp_path: Any) -> None:
    """A plain MLP with a slow link and on-demand prefetch: every reload waits for its read."""
    device = make_fake_device(link="slow")
    work = lambda: mlp_workload(d_in=32, width=128, depth=3, d_out=16, batch_size=64)  # noqa: E731
    reference = run_workload(work(), device=device, steps=2)
    spilled = run_workload(
        work(),
        device=device,
        steps=2,
        offload=lambda: settled_offload(device, min_bytes="1KiB", prefetch="on_demand", nvme=str(tmp_path)),
    )
    assert_bit_identical(reference, spilled, labels=("keep-all", "on-demand reloads from NVMe"))
    assert all(s.nvme_read_bytes > 0 for s in spilled.stats if s is not None)
    settle(device)
    assert files_under(tmp_path) == []


def _failing_io(calls: list[int]) -> Any:
    def op(fd: int, buffers: Any, offset: int) -> int:
        calls[0] += 1
        raise OSError(errno.EIO, "injected I/O error")

    return op


def test_failed_writes_keep_the_host_copies(
    make_fake_device: Callable[..., Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write to disk fails (EIO): the host copies stay the data, one warning, the same gradients."""
    device = make_fake_device()
    model, x = _deep_mlp(device)
    grads = []
    for nvme in (None, str(tmp_path)):
        calls = [0]
        with device, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for p in model.parameters():
                p.grad = None
            with pytest.MonkeyPatch.context() as fault:
                fault.setattr(os, "pwritev", _failing_io(calls))
                with offcore_torch.offload_activations(device, min_bytes="64KiB", nvme=nvme) as handle:
                    hooks = [m.register_forward_hook(lambda *_: wait_for_writes(handle)) for m in model] if nvme else []
                    loss = model(x).square().mean()
                    for hook in hooks:
                        hook.remove()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        if nvme is not None:
            stats = handle.stats()
            assert calls[0] > 0 and stats.nvme_failures > 0 and stats.spilled_bytes == 0, stats
            assert sum("NVMe tier failed" in str(w.message) for w in caught) == 1  # once per region
        del loss
        settle(device)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert files_under(tmp_path) == []
    assert pool_used_bytes(device) == 0


def test_a_failed_read_raises_and_leaves_nothing(
    make_fake_device: Callable[..., Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads back from disk fail (EIO): backward raises CopyFailedError naming the storage; once the
    graph is dropped, its files and buffers are gone."""
    device = make_fake_device()
    model, x = _deep_mlp(device)
    with device:
        # one storage read ahead at the end of forward (before the fault): the others are read in backward
        options = {"min_bytes": "64KiB", "nvme": str(tmp_path), "nvme_read_ahead": "4KiB"}
        with offcore_torch.offload_activations(device, **options) as handle:
            hooks = [m.register_forward_hook(lambda *_: wait_for_writes(handle)) for m in model]
            loss = model(x).square().mean()
            for hook in hooks:
                hook.remove()
        assert handle.stats().spilled_bytes > 2 * 128 * 1024
        with pytest.MonkeyPatch.context() as fault:
            fault.setattr(os, "preadv", _failing_io([0]))
            with pytest.raises(offcore.CopyFailedError, match="back from the NVMe tier"):
                loss.backward()
        del loss
    settle(device, collect=True)
    assert files_under(tmp_path) == []
    assert pool_used_bytes(device) == 0
