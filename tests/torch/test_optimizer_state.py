"""OffloadOptimizer's state: torch's format, LR schedulers, exact resume in a fresh process, GradScaler,
and Hugging Face models built from small configs."""

from __future__ import annotations

import io
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
from offcore_torch.models import Workload, mlp_workload  # noqa: E402
from optimizer_offload_helpers import HostReference, assert_equivalent, assert_same, place, run  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=8)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_state_dict_is_torch_format(make_fake_device: Any, tmp_path: Path) -> None:
    dev = make_fake_device()
    model = MLP.build(0).to(torch.bfloat16)
    with dev:
        place(model, dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, master_weights=True, fused=True, lr=1e-3
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(2):
            MLP.loss(model, tuple(b.to(torch.bfloat16) for b in MLP.make_batch(step, torch.device("cpu")))).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-4)  # the scheduler drives the real groups
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert_same(loaded, sd)
        assert set(loaded) == {"state", "param_groups", offcore_torch.optimizer.optimizer.MASTER_WEIGHTS_KEY}
        assert loaded[offcore_torch.optimizer.optimizer.MASTER_WEIGHTS_KEY][0].dtype == torch.float32
        # a plain torch optimizer over fp32 host copies takes it unchanged
        plain = torch.optim.AdamW([p.detach().float().clone() for p in model.parameters()], fused=True, lr=1e-3)
        plain.load_state_dict(loaded)
        assert_same(plain.state_dict()["state"], sd["state"])
        # and torch.distributed.checkpoint saves and loads it (no process group: one process)
        dcp = pytest.importorskip("torch.distributed.checkpoint")
        dcp.save({"optim": sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        target = {"optim": opt.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        assert_same(target["optim"], sd)
        opt.load_state_dict(target["optim"])
        assert_same(opt.state_dict(), sd)
        opt.close()


def test_stale_master_is_refreshed_after_model_load(make_fake_device: Any) -> None:
    """Megatron's resume bug: masters built before model.load_state_dict must not overwrite the loaded weights."""
    dev = make_fake_device()
    model, other = MLP.build(0), MLP.build(1)
    with dev:
        place(model, dev)
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.0)
        model.load_state_dict(other.state_dict())  # after the optimizer copied the old weights
        MLP.loss(model, MLP.make_batch(0, torch.device("cpu"))).backward()
        opt.step()  # lr 0: the parameters must stay the loaded ones
        opt.synchronize()
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(p, q)
        opt.close()


_RESUME = textwrap.dedent(
    """
    import json, sys, torch, offcore, offcore_torch
    from offcore_torch.models import mlp_workload
    first, last, ckpt, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    work = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=8)
    dev = offcore.device("cpu", capacity="1GiB", sanitize=True, h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s")
    model = work.build(0).to(torch.bfloat16)
    with dev:
        dev.adopt(model)
        if first > 0:
            saved = torch.load(ckpt, weights_only=True)
            model.load_state_dict(saved["model"])
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, master_weights=True,
                                             accumulation_steps=2, fused=True, lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        if first > 0:
            opt.load_state_dict(saved["optim"])
            sched.load_state_dict(saved["sched"])
        losses = []
        for step in range(first, last):
            for micro in range(2):
                batch = tuple(b.to(torch.bfloat16) for b in work.make_batch(2 * step + micro, torch.device("cpu")))
                loss = work.loss(model, batch)
                loss.backward()
                losses.append(loss.float().item())
            opt.step()
            sched.step()
            opt.zero_grad()
        opt.synchronize()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, out)
        opt.close()
    json.dump(losses, open(out + ".json", "w"))
    """
)


def test_exact_resume_in_a_fresh_process(tmp_path: Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(first: int, last: int, ckpt: str, out: str) -> None:
        subprocess.run(
            [sys.executable, str(script), str(first), str(last), ckpt, out], check=True, env=env, timeout=300
        )

    straight, half, resumed = (str(tmp_path / n) for n in ("straight.pt", "half.pt", "resumed.pt"))
    train(0, 6, "", straight)
    train(0, 3, "", half)
    train(3, 6, half, resumed)
    a, b = torch.load(straight, weights_only=True), torch.load(resumed, weights_only=True)
    assert_same(b, a, "checkpoint after 6 steps")
    losses = json.loads(Path(half + ".json").read_text()) + json.loads(Path(resumed + ".json").read_text())
    assert losses == json.loads(Path(straight + ".json").read_text())


@pytest.mark.parametrize("offload_gradients", [True, False], ids=["offloaded-grads", "device-grads"])
def test_grad_scaler_fp16_skips_inf_steps(make_fake_device: Any, offload_gradients: bool) -> None:
    """fp16 device params, fp32 masters: unscale on the host, skip on inf/NaN, as torch.amp.GradScaler does.

    With ``offload_gradients=False`` the gradients reach the host at unscale_ (Note [Device gradients are
    read on the host once per round]): before, unscale_ saw none, found no inf, and the step ran on
    gradients still multiplied by the scale."""

    def train(offload: bool) -> tuple[list[float], list[torch.Tensor], dict[str, Any]]:
        dev = make_fake_device()
        model = MLP.build(0).to(torch.float16)
        scales: list[float] = []
        with dev:
            place(model, dev)
            if offload:
                opt: Any = offcore_torch.OffloadOptimizer(
                    model.parameters(),
                    torch.optim.AdamW,
                    device=dev,
                    master_weights=True,
                    offload_gradients=offload_gradients,
                    lr=1e-2,
                )
                scaler: Any = offcore_torch.OffloadGradScaler(init_scale=2.0**30, growth_interval=2)
            else:
                opt = HostReference(model, torch.optim.AdamW, {"lr": 1e-2}, master_weights=True)
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=2)
            for step in range(6):
                batch = tuple(b.to(torch.float16) for b in MLP.make_batch(step, torch.device("cpu")))
                scaler.scale(MLP.loss(model, batch)).backward()
                if offload:
                    scaler.step(opt)
                else:
                    opt.accumulate()
                    scaler.step(opt.opt)
                    with torch.no_grad():
                        for p, m in zip(opt.params, opt.masters, strict=True):
                            p.copy_(m)
                scaler.update()
                scales.append(scaler.get_scale())
                opt.zero_grad()
            if offload:
                opt.synchronize()
                state = opt.state_dict()
                state.pop(offcore_torch.optimizer.optimizer.MASTER_WEIGHTS_KEY)
                opt.close()
            else:
                state = opt.opt.state_dict()
            return scales, [p.detach().clone() for p in model.parameters()], state

    got, want = train(True), train(False)
    assert got[0][0] < 2.0**30  # the first steps overflowed and were skipped
    assert_same(got, want)


from hf_models import small_causal_lm, transformers  # noqa: E402


def _hf_workload(name: str) -> Workload:
    assert transformers is not None

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return small_causal_lm(name)

    def make_batch(step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return (torch.randint(0, 64, (2, 16), generator=gen).to(device),)

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return model(input_ids=batch[0], labels=batch[0]).loss

    return Workload(name, build, make_batch, loss)


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models(make_fake_device: Any, name: str) -> None:
    work = _hf_workload(name)
    options = dict(optimizer="adamw_fused", accumulation=2, overlap=True, steps=3)
    want = run(work, device=make_fake_device(), offload=False, **options)
    got = run(work, device=make_fake_device(link="slow"), **options)
    assert_equivalent(got, want)


def test_add_param_group_and_per_group_options(make_fake_device: Any) -> None:
    """Two groups (the second added later, its own lr) step exactly as torch's optimizer on host copies."""

    def train(offload: bool) -> list[torch.Tensor]:
        dev = make_fake_device(link="slow")
        model = MLP.build(0)
        first, rest = list(model.layers[0].parameters()), [p for m in model.layers[1:] for p in m.parameters()]
        with dev:
            place(model, dev)
            if offload:
                opt: Any = offcore_torch.OffloadOptimizer(first, torch.optim.SGD, device=dev, lr=0.1, momentum=0.9)
                opt.add_param_group({"params": rest, "lr": 0.01})
            else:
                ref = HostReference(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, master_weights=False)
                masters = ref.masters
                ref.opt = torch.optim.SGD(masters[: len(first)], lr=0.1, momentum=0.9)
                ref.opt.add_param_group({"params": masters[len(first) :], "lr": 0.01})
            for step in range(3):
                MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
                if offload:
                    opt.step()
                    opt.zero_grad()
                else:
                    ref.accumulate()
                    ref.step()
                    ref.zero_grad()
            if offload:
                assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
                opt.close()
        return [p.detach().clone() for p in model.parameters()]

    assert_same(train(True), train(False))


@pytest.mark.parametrize("upload_budget", [None, 1], ids=["all-uploads", "budget-held-back"])
def test_model_state_dict_right_after_step_reads_the_stepped_values(make_fake_device: Any, upload_budget: Any) -> None:
    """Note [A checkpoint reads landed parameters]: no torn or stale parameter in a checkpoint taken right after step()."""
    dev = make_fake_device(h2d_bandwidth="32MiB/s", d2h_bandwidth="1GB/s", latency="2ms", sanitize=True)
    model = MLP.build(0)
    with dev:
        place(model, dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2, upload_budget=upload_budget
        )
        for step in range(2):
            MLP.loss(model, MLP.make_batch(step, torch.device("cpu"))).backward()
            opt.step()
            opt.zero_grad()
            saved = {name: t.detach().clone() for name, t in model.state_dict().items()}  # no synchronize first
            for p, (name, value) in zip(model.parameters(), saved.items(), strict=True):
                assert torch.equal(value, opt.master(p).to(value.dtype)), f"{name} after step {step}"
        opt.close()
