"""OffloadOptimizer(tier="nvme"): optimizer states in an NvmeTier, stepped with offcore.nvme.pipelined
(Note [Optimizer states on NVMe]).

- bit-identical training vs the host reference (AdamW, SGD momentum; overlap; bf16 + fp32 masters);
- the states are on disk between steps, not in memory; state_dict() gathers them from disk;
- exact resume in a fresh process (6 steps = 3 + save + load + 3);
- an injected read or write error during the step: a clear StorageError, nothing lost, and calling
  step() again after the fault is gone gives the numbers of an uninterrupted run;
- the files go when the optimizer is closed or dropped;
- fp32 masters of bf16 parameters live in the same objects on disk (Note [Masters on NVMe]): host
  memory (the ledger, the pinned pool) lower by their bytes, resume exact with them;
- ``nvme=`` (a path or an NvmeSpec), or the device's shared tier (``offcore_torch.nvme_tier``):
  keys of one optimizer never collide with another's, and go when it is dropped, the tier stays.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import assert_equivalent, assert_same, place, run  # noqa: E402

from offcore.errors import ConfigurationError, StorageError  # noqa: E402
from offcore.kinds import Kind, Tier  # noqa: E402
from offcore.nvme import NvmeSpec  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=3, d_out=8, batch_size=8)


def _files(path: Path) -> list[str]:
    """The tier's object files (not the owner marker of its directory: Note [Stale directories: an owner lock])."""
    return [str(p) for p in path.rglob("*") if p.is_file() and p.name != ".offcore-owner"]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "sgd_nesterov"])
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_matches_host_reference(make_fake_device: Any, tmp_path: Path, optimizer: str, overlap: bool) -> None:
    options = dict(optimizer=optimizer, accumulation=2, overlap=overlap)
    want = run(MLP, device=make_fake_device(), offload=False, **options)
    got = run(
        MLP, device=make_fake_device(link="slow"), options={"tier": "nvme", "nvme_path": str(tmp_path)}, **options
    )
    assert_equivalent(got, want)
    assert _files(tmp_path) == []  # closed: the files are gone


def test_bf16_with_fp32_masters_and_verify(make_fake_device: Any, tmp_path: Path) -> None:
    options = dict(dtype=torch.bfloat16, master_weights=True)
    want = run(MLP, device=make_fake_device(), offload=False, **options)
    nvme = {"tier": "nvme", "nvme_path": str(tmp_path), "verify": True}
    got = run(MLP, device=make_fake_device(), options=nvme, **options)
    assert_equivalent(got, want)


def test_states_live_on_disk_between_steps(make_fake_device: Any, tmp_path: Path) -> None:
    dev = make_fake_device()
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, tier="nvme", nvme_path=str(tmp_path)
        )
        for step in range(2):
            MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
            opt.step()
            opt.zero_grad()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        in_memory = [k for st in opt.state.values() for k, v in st.items() if v.numel() > 1]
        assert in_memory == []  # only AdamW's scalar step counts stay in memory
        assert opt.ledger.bytes(Tier.NVME, Kind.OPTIMIZER_STATE) >= 2 * params
        assert len(_files(tmp_path)) == len(list(model.parameters()))
        sd = opt.state_dict()
        assert all(set(v) == {"step", "exp_avg", "exp_avg_sq"} for v in sd["state"].values())
        assert opt._state_pool.used_bytes == 0  # no bounce buffer held between steps
        del opt
        gc.collect()
        assert _files(tmp_path) == []  # dropped: the files are gone


def test_bad_arguments(make_fake_device: Any, tmp_path: Path) -> None:
    dev = make_fake_device()
    model = place(MLP.build(0), dev)
    with pytest.raises(ConfigurationError, match="nvme_path"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, tier="nvme")
    with pytest.raises(ConfigurationError, match="tier must be"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, tier="disk")
    with pytest.raises(ConfigurationError, match="need tier='nvme'"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, nvme_path=str(tmp_path))
    with pytest.raises(ConfigurationError, match="need tier='nvme'"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, nvme_masters=True)
    with pytest.raises(ConfigurationError, match="once"):
        offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, tier="nvme", nvme=str(tmp_path), nvme_path=str(tmp_path)
        )
    with pytest.raises(ConfigurationError, match="of this optimizer's own"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, tier="nvme", verify=True)
    with pytest.raises(ConfigurationError, match="path or an offcore.nvme.NvmeSpec"):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, tier="nvme", nvme=42)


def _failing(real: Any, calls: list[int], fail_at: int) -> Any:
    def op(fd: int, buffers: Any, offset: int) -> int:
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(errno.EIO, "injected I/O error")
        return real(fd, buffers, offset)

    return op


@pytest.mark.parametrize("which", ["preadv", "pwritev"])
@pytest.mark.parametrize("groups", ["one", "per_parameter"])
def test_io_error_in_the_step_loses_nothing(
    make_fake_device: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str, groups: str
) -> None:
    """Step 2 meets an I/O error; the fault goes; step() again; the run ends as an uninterrupted one."""
    if groups == "per_parameter":  # several groups: the error comes part way through the pipeline
        monkeypatch.setattr(offcore_torch.optimizer.nvme_states, "_NVME_GROUP_BYTES", 1)
    want = run(MLP, device=make_fake_device(), offload=False, steps=4)
    dev = make_fake_device()
    losses, grads = [], []
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            device=dev,
            tier="nvme",
            nvme_path=str(tmp_path),
            lr=1e-2,
            weight_decay=0.1,
        )
        try:
            for step in range(4):
                loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                loss.backward()
                losses.append(loss.detach().clone())
                if step == 2:
                    calls = [0]
                    with pytest.MonkeyPatch.context() as fault, pytest.raises(StorageError, match="injected") as info:
                        fault.setattr(os, which, _failing(getattr(os, which), calls, fail_at=3))
                        opt.step()
                    notes = " ".join(getattr(info.value, "__notes__", []))
                    assert "call opt.step() again" in notes, notes
                    if which == "pwritev":
                        assert "stay in host memory" in notes, notes
                opt.step()
                grads.append([g.clone() for g in opt.host_grads()])
                opt.zero_grad()
            opt.synchronize()
            params = [p.detach().clone() for p in model.parameters()]
            state = opt.state_dict()
        finally:
            opt.close()
    assert_same(losses, want.losses, "losses")
    assert_same(grads, want.grads, "grads")
    assert_same(params, want.params, "params")
    assert_same(state, want.state, "optimizer state")
    assert _files(tmp_path) == []


_RESUME = textwrap.dedent(
    """
    import json, sys, torch, offcore, offcore_torch
    from offcore_torch.models import mlp_workload
    first, last, ckpt, out, disk, mode = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7]
    work = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=8)
    dev = offcore.device("cpu", capacity="1GiB", sanitize=True, h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s")
    model = work.build(0).to(torch.bfloat16)
    where = {"nvme_path": disk} if mode == "path" else {}  # "shared": the device's tier
    if mode == "shared":
        offcore_torch.nvme_tier(dev, disk)
    with dev:
        dev.adopt(model)
        if first > 0:
            saved = torch.load(ckpt, weights_only=True)
            model.load_state_dict(saved["model"])
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, master_weights=True,
                                             accumulation_steps=2, fused=True, lr=1e-2, weight_decay=0.1,
                                             tier="nvme", **where)
        assert all(s.nvme_master and s.state_buf is None for s in opt._slots)  # the masters are on disk
        if first > 0:
            opt.load_state_dict(saved["optim"])
        losses = []
        for step in range(first, last):
            for micro in range(2):
                batch = tuple(b.to(torch.bfloat16) for b in work.make_batch(2 * step + micro, torch.device("cpu")))
                loss = work.loss(model, batch)
                loss.backward()
                losses.append(loss.float().item())
            opt.step()
            opt.zero_grad()
            assert all(s.nvme_master and s.state_buf is None for s in opt._slots)
        opt.synchronize()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out)
        opt.close()
    json.dump(losses, open(out + ".json", "w"))
    """
)


@pytest.mark.slow  # docs/testing.md, "Test budget": three fresh processes per mode (~30 s each); fast: test_optimizer_state.py's fresh-process resume, and NVMe resume in test_resume_combinations.py
@pytest.mark.parametrize("mode", ["path", "shared"])
def test_exact_resume_from_nvme_in_a_fresh_process(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    disk = tmp_path / "nvme"
    disk.mkdir(mode=0o700)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(first: int, last: int, ckpt: str, out: str) -> None:
        subprocess.run(
            [sys.executable, str(script), str(first), str(last), ckpt, out, str(disk), mode],
            check=True,
            env=env,
            timeout=300,
        )

    straight, half, resumed = (str(tmp_path / n) for n in ("straight.pt", "half.pt", "resumed.pt"))
    train(0, 6, "", straight)
    train(0, 3, "", half)
    train(3, 6, half, resumed)
    a, b = torch.load(straight, weights_only=True), torch.load(resumed, weights_only=True)
    assert_same(b, a, "checkpoint after 6 steps")
    losses = json.loads(Path(half + ".json").read_text()) + json.loads(Path(resumed + ".json").read_text())
    assert losses == json.loads(Path(straight + ".json").read_text())
    assert _files(disk) == []


def _bf16_opt(dev: Any, model: torch.nn.Module, **options: Any) -> Any:
    return offcore_torch.OffloadOptimizer(
        model.parameters(), torch.optim.AdamW, device=dev, master_weights=True, lr=1e-2, tier="nvme", **options
    )


def _train(model: torch.nn.Module, opt: Any, steps: int = 2) -> None:
    for step in range(steps):
        batch = tuple(b.to(torch.bfloat16) for b in MLP.make_batch(step, torch.device("cpu")))
        MLP.loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def test_masters_on_nvme_lower_host_memory(make_fake_device: Any, tmp_path: Path) -> None:
    dev = make_fake_device()
    with dev:
        model = place(MLP.build(0).to(torch.bfloat16), dev)
        masters = sum(p.numel() * 4 for p in model.parameters())
        stages = sum(p.numel() * p.element_size() for p in model.parameters())
        measured = {}
        for on_disk in (False, True):
            opt = _bf16_opt(dev, model, nvme=str(tmp_path), nvme_masters=on_disk)
            try:
                _train(model, opt)
                assert all(s.nvme_master is on_disk for s in opt._slots)
                measured[on_disk] = (
                    opt.ledger.bytes(Tier.PINNED, Kind.PARAMETER),
                    opt._pool.used_bytes,
                    opt.ledger.bytes(Tier.NVME, Kind.OPTIMIZER_STATE),
                )
                if on_disk:  # parked: no memory behind them; a read of master() comes from disk
                    assert all(s.master.stride() == (0,) * s.master.dim() for s in opt._slots)
                    assert opt._state_pool.used_bytes == 0
                    sd = opt.state_dict()[offcore_torch.optimizer.optimizer.MASTER_WEIGHTS_KEY]
                    for i, p in enumerate(model.parameters()):
                        assert torch.equal(opt.master(p), sd[i])
                        assert torch.equal(opt.master(p).to(torch.bfloat16), p.detach())
            finally:
                opt.close()
    (host_off, pool_off, disk_off), (host_on, pool_on, disk_on) = measured[False], measured[True]
    assert host_off == masters + stages and host_on == stages  # the ledger: masters off the host
    assert pool_off - pool_on >= masters  # the pinned pool holds that much less
    assert disk_on >= disk_off + masters  # ... and the disk that much more
    assert _files(tmp_path) == []


def test_shared_device_tier_keys_are_per_optimizer(make_fake_device: Any, tmp_path: Path) -> None:
    dev = make_fake_device()
    tier = offcore_torch.nvme_tier(dev, str(tmp_path), budget="64MiB")
    try:
        with dev:
            a_model = place(MLP.build(0).to(torch.bfloat16), dev)
            b_model = place(MLP.build(1).to(torch.bfloat16), dev)
            a, b = _bf16_opt(dev, a_model), _bf16_opt(dev, b_model)
            assert a._nvme is tier and b._nvme is tier
            _train(a_model, a)
            _train(b_model, b)
            n = len(list(a_model.parameters()))
            assert len(list(tier.keys())) == 2 * n  # one object per parameter and optimizer: no collision
            a.close()
            assert len(list(tier.keys())) == n and not tier.closed  # a's keys went, the tier stays
            del b
            gc.collect()
            assert list(tier.keys()) == [] and not tier.closed
            assert _files(tmp_path) == []
    finally:
        offcore_torch.nvme_tier(dev, None)


def test_nvme_spec_budget_and_verify(make_fake_device: Any, tmp_path: Path) -> None:
    want = run(MLP, device=make_fake_device(), offload=False, dtype=torch.bfloat16, master_weights=True)
    spec = NvmeSpec(str(tmp_path), budget="8MiB", verify=True)
    got = run(
        MLP,
        device=make_fake_device(link="slow"),
        dtype=torch.bfloat16,
        master_weights=True,
        options={"tier": "nvme", "nvme": spec},
    )
    assert_equivalent(got, want)


def test_master_on_nvme_refreshed_after_model_load_keeps_the_states(make_fake_device: Any, tmp_path: Path) -> None:
    """Megatron's resume bug with the master on disk: the loaded weights win, the states on disk survive."""
    dev = make_fake_device()
    with dev:
        model = place(MLP.build(0).to(torch.bfloat16), dev)
        opt = _bf16_opt(dev, model, nvme=str(tmp_path))
        try:
            _train(model, opt, steps=2)
            loaded = MLP.build(1).to(torch.bfloat16).state_dict()
            model.load_state_dict(loaded)  # a foreign write after the masters were made
            for group in opt.param_groups:  # a step that leaves the parameters where they are
                group["lr"] = 0.0
            batch = tuple(b.to(torch.bfloat16) for b in MLP.make_batch(2, torch.device("cpu")))
            MLP.loss(model, batch).backward()
            opt.step()  # the refresh reads each master's object, loads the device value, writes it back
            opt.synchronize()
            sd = opt.state_dict()
            masters = sd[offcore_torch.optimizer.optimizer.MASTER_WEIGHTS_KEY]
            for i, (name, p) in enumerate(model.named_parameters()):
                assert torch.equal(p.detach(), loaded[name]), name  # not the stale masters of step 2
                assert torch.equal(masters[i], loaded[name].float()), name
                assert float(sd["state"][i]["step"]) == 3.0  # the states on disk went on, not restarted
            assert all(s.nvme_master and s.state_buf is None for s in opt._slots)
        finally:
            opt.close()
