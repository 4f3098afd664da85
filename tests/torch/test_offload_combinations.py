"""Every kind offloaded at once, in combinations hypothesis draws: bit-identical to training without offload.

The other suites compose two features at a time. Here one draw picks a model (TinyGPT with dropout,
optionally with checkpointed blocks, non-reentrant or reentrant; a CNN with in-place ops and views; an
MLP), activation offload (off, on demand or by deadline, with a minimum size), parameter offload (off or
on, with or without a device budget), the optimizer (torch's fused AdamW on the device, or
OffloadOptimizer with offloaded or device gradients, steps at ``step()`` or under backward), micro-steps
per step, the link, the precision (bf16 parameters with fp32 masters on the host for OffloadOptimizer, or
fp16 with loss scaling: OffloadGradScaler, torch's GradScaler for the reference), the
NVMe tier for every kind offloaded, one device budget shared by the kinds, buffers streamed with the
parameters, gradient clipping, ``zero_grad(set_to_none=)``, the forward under ``torch.autocast``
(bf16), a validation forward between steps (``eval()``, ``no_grad``), a smaller last batch, and a frozen
teacher (distillation: a second model, offloaded too, under ``no_grad`` in every micro-step). Three
optimizer steps on the sanitized fake device must give the same losses, parameters and optimizer
state, bit for bit, as the same training with nothing offloaded and the same optimizer: torch's on the
device, or for OffloadOptimizer the same host optimizer over host copies (fp32 masters for bf16). The draws are
derandomized, so CI runs the same examples every time; a failure prints the combination.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Any

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

import offcore_torch  # noqa: E402
from hypothesis import assume, given  # noqa: E402
from hypothesis_draws import choices_strategy, covering, derandomized  # noqa: E402
from offcore_torch.models import GPTConfig, Workload, cnn_workload, gpt_workload, mlp_workload  # noqa: E402
from offcore_torch.optimizer.slots import MASTER_WEIGHTS_KEY  # noqa: E402
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402
from optimizer_offload_helpers import HostReference, assert_same, offload_optimizer_of_kind  # noqa: E402
from torch_test_devices import fake_device, finish_device  # noqa: E402

from offcore.kinds import Kind, Tier  # noqa: E402

STEPS = 3
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
_GPT = GPTConfig(vocab_size=48, d_model=32, n_heads=2, n_layers=2, seq_len=12, dropout=0.1)
WORKLOADS: dict[str, Workload] = {
    "gpt": gpt_workload(_GPT, batch_size=2),
    "gpt-checkpointed": gpt_workload(_GPT, batch_size=2, checkpoint_blocks=True),
    "gpt-reentrant": gpt_workload(_GPT, batch_size=2, checkpoint_blocks="reentrant"),
    "cnn": cnn_workload(width=8, image_size=8, batch_size=4),
    "mlp": mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=16),  # saves 2 KiB tensors
}

CHOICES: dict[str, Any] = {
    "model": sorted(WORKLOADS),
    "activations": [None, "on_demand", "deadline"],
    "max_inflight": ["256MiB", 0],  # the default cap, or one D2H copy at a time
    "min_bytes": ["0", "1KiB"],
    "parameters": [None, "unbounded", "tight"],
    "optimizer": ["device", "offload", "offload-device-grads", "offload-under-backward"],
    "micro_steps": range(1, 3),
    "link": ["unlimited", "slow"],
    "precision": ["fp32", "bf16", "fp16-scaler"],
    "nvme": [False, True],
    "shared_budget": [None, "24KiB"],
    "buffers": [False, True],
    "clip": [None, 0.05],
    "set_to_none": [False, True],
    "autocast": [False, True],
    "evaluate": [False, True],
    "smaller_last_batch": [False, True],
    "frozen_teacher": [False, True],
}
combinations = choices_strategy(CHOICES)


def _train(drawn: dict[str, Any], *, offload: bool) -> dict[str, Any]:
    work = WORKLOADS[drawn["model"]]
    kind = drawn["optimizer"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16-scaler": torch.float16}[drawn["precision"]]
    masters = dtype is not torch.float32
    scaling = drawn["precision"] == "fp16-scaler"
    device = fake_device(link=drawn["link"] if offload else "unlimited")
    nvme = offload and drawn["nvme"]
    directory = tempfile.mkdtemp(prefix="offcore-combinations-") if nvme else None
    try:
        with device:
            if nvme:
                offcore_torch.nvme_tier(device, directory)
            if offload and drawn["shared_budget"] is not None:
                offcore_torch.device_budget(device, drawn["shared_budget"])
            tier = {"tier": "nvme"} if nvme else {}
            model = device.adopt(work.build(0).to(dtype))
            handle = None
            if offload and drawn["parameters"] is not None:
                budget = "4KiB" if drawn["parameters"] == "tight" else None
                handle = offload_parameters(model, device, budget=budget, buffers=drawn["buffers"], **tier)
            teacher, teacher_handle = None, None
            if drawn["frozen_teacher"]:  # distillation: a second, frozen model run under no_grad each micro-step
                teacher = device.adopt(work.build(1).to(dtype)).eval()
                teacher.requires_grad_(False)
                if offload and drawn["parameters"] is not None:
                    teacher_handle = offload_parameters(teacher, device, **tier)
            if kind == "device":  # torch's optimizer on the device parameters, in both runs
                opt: Any = torch.optim.AdamW(model.parameters(), **ADAMW)
            elif not offload:  # the same host optimizer, masters for bf16, nothing offloaded
                opt = HostReference(
                    model,
                    torch.optim.AdamW,
                    ADAMW,
                    master_weights=masters,
                    sum_on_device=kind == "offload-device-grads",
                )
            else:
                opt = offload_optimizer_of_kind(
                    kind,
                    model,
                    device,
                    micro_steps=drawn["micro_steps"],
                    streamed_from_nvme=handle is not None and nvme,
                    master_weights=masters,
                    **tier,
                    **ADAMW,
                )
            scaler: Any = None  # fp16: loss scaling, steps with an inf/NaN gradient skipped
            if scaling:
                # the first step overflows (every loss here * 2^20 > fp16's 65504) and is skipped, the scale
                # drops to 2^10, the next ones step and the scale grows again after two
                options = {"init_scale": 2.0**20, "backoff_factor": 2.0**-10, "growth_interval": 2}
                scaler = (
                    offcore_torch.OffloadGradScaler(**options) if offload else torch.amp.GradScaler("cpu", **options)
                )
            losses, norms, scales = [], [], []
            moved = {"activations": 0, "parameters": 0, "gradients": 0}
            for step in range(STEPS):
                for micro in range(drawn["micro_steps"]):
                    index = step * drawn["micro_steps"] + micro
                    smaller = drawn["smaller_last_batch"] and step == STEPS - 1  # an epoch's last batch
                    batch = _batch(work, index, dtype=dtype, smaller=smaller)
                    torch.manual_seed(index)  # the same dropout masks in both runs
                    region = (
                        offcore_torch.offload_activations(
                            device,
                            prefetch=drawn["activations"],
                            min_bytes=drawn["min_bytes"],
                            max_inflight=drawn["max_inflight"],
                            **tier,
                        )
                        if offload and drawn["activations"] is not None
                        else contextlib.nullcontext()
                    )
                    autocast = (
                        torch.autocast("cpu", dtype=torch.bfloat16) if drawn["autocast"] else contextlib.nullcontext()
                    )
                    with region as entered, autocast:
                        loss = work.loss(model, batch)
                        if teacher is not None:
                            with torch.no_grad():
                                teacher_loss = work.loss(teacher, batch)
                            loss = loss + 0.5 * teacher_loss
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    losses.append(loss.detach().clone())
                    if entered is not None:
                        moved["activations"] += entered.stats().offloaded_bytes
                    if isinstance(opt, HostReference):
                        opt.accumulate(last=micro == drawn["micro_steps"] - 1)
                # clipping needs every gradient before any host step: not with steps under backward
                if scaler is not None and drawn["clip"] is not None:  # clipping reads unscaled gradients
                    scaler.unscale_(opt.opt if isinstance(opt, HostReference) else opt)
                if drawn["clip"] is not None and kind != "offload-under-backward":
                    if isinstance(opt, HostReference):
                        norms.append(torch.nn.utils.clip_grad_norm_(opt.masters, drawn["clip"]))
                    elif kind == "device":
                        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), drawn["clip"]))
                    else:
                        norms.append(offcore_torch.clip_grad_norm_(opt, drawn["clip"]))
                if scaler is None:
                    opt.step()
                elif isinstance(opt, HostReference):
                    opt.step(scaler=scaler)
                else:
                    scaler.step(opt)
                if scaler is not None:
                    scaler.update()
                    scales.append(scaler.get_scale())
                opt.zero_grad(set_to_none=drawn["set_to_none"])
                if drawn["evaluate"]:  # a validation batch between steps: eval mode, no gradients
                    model.eval()
                    with torch.no_grad():
                        losses.append(work.loss(model, _batch(work, 100 + step, dtype=dtype, smaller=False)))
                    model.train()
            if isinstance(opt, HostReference):
                state = opt.opt.state_dict()["state"]
            else:
                if kind != "device":
                    opt.synchronize()
                state = opt.state_dict()
                state.pop(MASTER_WEIGHTS_KEY, None)
                state = state["state"]
            params = [p.detach().clone() for p in model.parameters()]
            if handle is not None:
                moved["parameters"] = handle.stats().h2d_copies
            if offload and kind != "device":
                moved["gradients"] = opt.ledger.bytes(Tier.PINNED, Kind.GRADIENT)
            if handle is not None:
                handle.remove()
            if teacher_handle is not None:
                moved["parameters"] = min(moved["parameters"], teacher_handle.stats().h2d_copies)
                teacher_handle.remove()
            if offload and kind != "device":
                opt.close()
        return {"losses": losses, "norms": norms, "scales": scales, "params": params, "state": state, "moved": moved}
    finally:
        offcore_torch.device_budget(device, None)
        if nvme:
            offcore_torch.nvme_tier(device, None)  # its I/O threads and files go now, not when the device is collected
        finish_device(device)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _batch(work: Workload, index: int, *, dtype: torch.dtype, smaller: bool) -> tuple[torch.Tensor, ...]:
    batch = work.make_batch(index, torch.device("cpu"))
    if smaller:
        batch = tuple(b[: max(1, len(b) // 2)].clone() for b in batch)
    return tuple(b.to(dtype) if b.is_floating_point() else b for b in batch)


def _supported(drawn: dict[str, Any]) -> bool:
    # loss scaling needs every gradient before any step (docs/optimizer-offload.md): not with steps under backward;
    # torch's GradScaler refuses fp16 gradients of an optimizer on fp16 parameters (no masters): not on the device
    if drawn["precision"] == "fp16-scaler" and drawn["optimizer"] in ("offload-under-backward", "device"):
        return False
    return not (drawn["precision"] == "fp16-scaler" and drawn["autocast"])  # bf16 autocast over fp16: torch refuses


@derandomized(max_examples=60, examples=covering(CHOICES, valid=_supported))
@given(drawn=combinations)
def test_every_combination_is_bit_identical_to_no_offload(drawn: dict[str, Any]) -> None:
    assume(_supported(drawn))
    want = _train(drawn, offload=False)
    got = _train(drawn, offload=True)
    assert_same(got["losses"], want["losses"], "losses")
    assert_same(got["norms"], want["norms"], "clip norms")
    assert_same(got["scales"], want["scales"], "loss scales")
    assert_same(got["params"], want["params"], "params")
    assert_same(got["state"], want["state"], "optimizer state")
    # what was drawn really moved (a combination that offloads nothing would pass trivially)
    moved = got["moved"]
    assert (moved["activations"] > 0) == (drawn["activations"] is not None), moved
    assert (moved["parameters"] > 0) == (drawn["parameters"] is not None), moved
    assert (moved["gradients"] > 0) == (drawn["optimizer"] != "device"), moved
