"""Exact resume under every kind offloaded, in combinations hypothesis draws.

Train ``STEPS`` optimizer steps straight through; and train ``SAVE_AT`` steps, save the model's, the
optimizer's and the LR scheduler's ``state_dict()`` with ``torch.save``, then on a fresh fake device build
a fresh model from another seed, load them back (``torch.load(weights_only=True)``) and train the
remaining steps. The two must agree bit for bit: every loss, every parameter, the optimizer's state and
param groups, the scheduler's state. One draw picks the model, activation offload, parameter offload
(with or without a device budget, on the host or on NVMe), the optimizer (torch's fused AdamW on the
device, or OffloadOptimizer with offloaded or device gradients, steps at ``step()`` or under backward,
its states on NVMe), the precision (bf16 parameters with fp32 masters, or fp16 with loss scaling: the
scaler's state is saved and loaded too), micro-steps, the link, whether the checkpoint is
loaded before or after offcore wraps the fresh model, and whether the save follows ``synchronize()`` or
comes right after ``step()`` (uploads possibly still in flight). A load that silently did nothing
cannot pass: the fresh model starts from other weights.
"""

from __future__ import annotations

import contextlib
import io
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
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402
from optimizer_offload_helpers import assert_same, offload_optimizer_of_kind  # noqa: E402
from torch_test_devices import fake_device, finish_device  # noqa: E402

STEPS = 4
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16-scaler": torch.float16}
SAVE_AT = 2
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
_GPT = GPTConfig(vocab_size=48, d_model=32, n_heads=2, n_layers=2, seq_len=12, dropout=0.1)
WORKLOADS: dict[str, Workload] = {
    "gpt": gpt_workload(_GPT, batch_size=2),
    "cnn": cnn_workload(width=8, image_size=8, batch_size=4),
    "mlp": mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=16),
}

CHOICES: dict[str, Any] = {
    "model": sorted(WORKLOADS),
    "activations": [None, "deadline"],
    "parameters": [None, "unbounded", "tight"],
    "optimizer": ["device", "offload", "offload-device-grads", "offload-under-backward"],
    "micro_steps": range(1, 3),
    "link": ["unlimited", "slow"],
    "precision": ["fp32", "bf16", "fp16-scaler"],
    "nvme": [False, True],
    "load_before_wrap": [False, True],
    "synchronize_before_save": [False, True],
    "scheduler": [False, True],
}
combinations = choices_strategy(CHOICES)


class _Run:
    """One training run on its own fake device (and NVMe directory); ``close()`` gives everything back."""

    def __init__(self, drawn: dict[str, Any], *, seed: int, checkpoint: bytes | None) -> None:
        self.drawn = drawn
        self.work = WORKLOADS[drawn["model"]]
        self.device = fake_device(link=drawn["link"])
        self.directory = tempfile.mkdtemp(prefix="offcore-resume-") if drawn["nvme"] else None
        self.handle: Any = None
        self.opt: Any = None
        self.losses: list[torch.Tensor] = []
        self.device.__enter__()
        if self.directory is not None:
            offcore_torch.nvme_tier(self.device, self.directory)
        dtype = _DTYPES[drawn["precision"]]
        self.model = self.device.adopt(self.work.build(seed).to(dtype))
        saved = torch.load(io.BytesIO(checkpoint), weights_only=True) if checkpoint is not None else None
        if saved is not None and drawn["load_before_wrap"]:
            self.model.load_state_dict(saved["model"])
        self._wrap()
        if saved is not None and not drawn["load_before_wrap"]:
            self.model.load_state_dict(saved["model"])  # into parameters offcore already streams or steps
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])
        self.scheduler = (
            torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.7) if drawn["scheduler"] else None
        )
        if saved is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler: Any = None
        if drawn["precision"] == "fp16-scaler":  # the first step overflows and is skipped, the scale then grows
            options = {"init_scale": 2.0**20, "backoff_factor": 2.0**-10, "growth_interval": 2}
            self.scaler = offcore_torch.OffloadGradScaler(**options)
            if saved is not None:
                self.scaler.load_state_dict(saved["scaler"])

    def _wrap(self) -> None:
        drawn, kind = self.drawn, self.drawn["optimizer"]
        tier = {"tier": "nvme"} if drawn["nvme"] else {}
        if drawn["parameters"] is not None:
            budget = "4KiB" if drawn["parameters"] == "tight" else None
            self.handle = offload_parameters(self.model, self.device, budget=budget, **tier)
        if kind == "device":
            self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)
            return
        self.opt = offload_optimizer_of_kind(
            kind,
            self.model,
            self.device,
            micro_steps=drawn["micro_steps"],
            streamed_from_nvme=self.handle is not None and drawn["nvme"],
            master_weights=drawn["precision"] != "fp32",
            **tier,
            **ADAMW,
        )

    def train(self, first: int, last: int) -> None:
        drawn, micro_steps = self.drawn, self.drawn["micro_steps"]
        for step in range(first, last):
            for micro in range(micro_steps):
                index = step * micro_steps + micro
                batch = tuple(
                    b.to(_DTYPES[drawn["precision"]]) if b.is_floating_point() else b
                    for b in self.work.make_batch(index, torch.device("cpu"))
                )
                torch.manual_seed(index)  # the same dropout masks in both runs
                region = (
                    offcore_torch.offload_activations(self.device, prefetch=drawn["activations"])
                    if drawn["activations"] is not None
                    else contextlib.nullcontext()
                )
                with region:
                    loss = self.work.loss(self.model, batch)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                self.losses.append(loss.detach().clone())
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.opt.zero_grad()

    def _settle(self) -> None:
        if self.drawn["optimizer"] != "device":
            self.opt.synchronize()

    def checkpoint(self) -> bytes:
        """The model's, optimizer's and scheduler's state, through ``torch.save`` as a user writes it."""
        if self.drawn["synchronize_before_save"]:
            self._settle()
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def result(self) -> dict[str, Any]:
        self._settle()
        return {
            "losses": self.losses,
            "params": [p.detach().clone() for p in self.model.parameters()],
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def close(self) -> None:
        try:
            if self.handle is not None:
                self.handle.remove()
            if self.drawn["optimizer"] != "device" and self.opt is not None:
                self.opt.close()
        finally:
            if self.directory is not None:
                offcore_torch.nvme_tier(self.device, None)
            self.device.__exit__(None, None, None)
            finish_device(self.device)
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)


def _straight(drawn: dict[str, Any]) -> dict[str, Any]:
    run = _Run(drawn, seed=0, checkpoint=None)
    try:
        run.train(0, STEPS)
        return run.result()
    finally:
        run.close()


def _resumed(drawn: dict[str, Any]) -> dict[str, Any]:
    first = _Run(drawn, seed=0, checkpoint=None)
    try:
        first.train(0, SAVE_AT)
        checkpoint = first.checkpoint()
        losses = first.losses
    finally:
        first.close()
    second = _Run(drawn, seed=1, checkpoint=checkpoint)  # other weights until the checkpoint is loaded
    try:
        second.train(SAVE_AT, STEPS)
        got = second.result()
    finally:
        second.close()
    got["losses"] = losses + got["losses"]
    return got


def _supported(drawn: dict[str, Any]) -> bool:
    # fp16 loss scaling: not with steps under backward (docs/optimizer-offload.md), and torch's GradScaler
    # refuses an optimizer over fp16 parameters without masters (the device optimizer)
    return not (drawn["precision"] == "fp16-scaler" and drawn["optimizer"] in ("offload-under-backward", "device"))


# a step the scaler skips (inf/NaN) never calls optimizer.step(): torch's LR schedulers warn, as without offcore
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
@derandomized(max_examples=40, examples=covering(CHOICES, valid=_supported))
@given(drawn=combinations)
def test_resume_from_a_checkpoint_is_bit_identical_to_training_straight_through(drawn: dict[str, Any]) -> None:
    assume(_supported(drawn))
    want = _straight(drawn)
    got = _resumed(drawn)
    assert_same(got["losses"], want["losses"], f"losses of {drawn}")
    assert_same(got["params"], want["params"], f"parameters of {drawn}")
    assert_same(got["optimizer"], want["optimizer"], f"optimizer state of {drawn}")
    assert got["scheduler"] == want["scheduler"], drawn
    assert got["scaler"] == want["scaler"], drawn
