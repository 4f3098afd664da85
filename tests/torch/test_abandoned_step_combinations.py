"""A step abandoned midway under every kind offloaded, in combinations hypothesis draws.

A user's loop meets a bad batch: the forward raises, the backward raises halfway (some gradients
already made, and with OffloadOptimizer already on their way to the host), or the loss is dropped
without any backward. The loop clears the gradients (``zero_grad()``) and goes on with the next batch.
Offcore must then train exactly as if the bad batch had never been seen -- the same losses, parameters
and optimizer state, bit for bit, as a run without it -- and, once the bindings are removed, the
device's accounting must be back where it was before they were made (device and pageable bytes, and the
bytes offcore's pinned pools hand out). One draw picks the model, activation offload, parameter offload
(host or NVMe, with or without a tight budget), the optimizer (torch's fused AdamW on the device, or
OffloadOptimizer with offloaded or device gradients, steps at ``step()`` or under backward), micro-steps,
the link, how the step is abandoned, in which step and micro-step, and at which module. Steps under
backward are not drawn with a backward that raises: they step each parameter as its gradient lands, so
half a backward is half a step by design (docs/optimizer-offload.md). The draws are derandomized.
"""

from __future__ import annotations

import contextlib
import copy
import gc
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
from offload_helpers import BadBatch, memory_levels  # noqa: E402
from optimizer_offload_helpers import assert_same, offload_optimizer_of_kind  # noqa: E402
from torch_test_devices import fake_device, finish_device  # noqa: E402

STEPS = 3
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
_GPT = GPTConfig(vocab_size=48, d_model=32, n_heads=2, n_layers=2, seq_len=12, dropout=0.1)
WORKLOADS: dict[str, Workload] = {
    "gpt": gpt_workload(_GPT, batch_size=2),
    "gpt-reentrant": gpt_workload(_GPT, batch_size=2, checkpoint_blocks="reentrant"),
    "cnn": cnn_workload(width=8, image_size=8, batch_size=4),
    "mlp": mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=16),
}
BAD_BATCH = 1000  # the abandoned attempt's batch index (and dropout seed): one no good step uses

CHOICES: dict[str, Any] = {
    "model": sorted(WORKLOADS),
    "activations": [None, "on_demand", "deadline"],
    "max_inflight": ["256MiB", 0],  # the default cap, or one D2H copy at a time
    "parameters": [None, "unbounded", "tight"],
    "optimizer": ["device", "offload", "offload-device-grads", "offload-under-backward"],
    "micro_steps": range(1, 3),
    "link": ["unlimited", "slow"],
    "nvme": [False, True],
    "how": ["forward-raises", "backward-raises", "no-backward"],
    "step": range(0, STEPS),
    "micro_step": range(0, 2),
    "module": range(0, 1001),  # which leaf module raises (modulo their count)
}
abandoned = choices_strategy(CHOICES)


class _RaiseInBackward(torch.autograd.Function):
    """The identity whose backward raises: a backward that fails halfway (after the later modules' gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # not a view: the models' in-place ops may write it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise BadBatch("a bad batch: the backward raises")


def _bad_attempt(drawn: dict[str, Any], work: Workload, model: torch.nn.Module, device: Any) -> None:
    """The abandoned micro-step, then the user's cleanup (``zero_grad()`` on the caller's side)."""
    leaves = [m for m in model.modules() if not list(m.children()) and list(m.parameters(recurse=False))]
    target = leaves[drawn["module"] % len(leaves)]

    def hook(module: Any, args: Any, output: Any) -> Any:
        if drawn["how"] == "forward-raises":
            raise BadBatch("a bad batch: the forward raises")
        if drawn["how"] == "backward-raises" and isinstance(output, torch.Tensor) and output.requires_grad:
            return _RaiseInBackward.apply(output)
        return output

    removable = target.register_forward_hook(hook)
    torch.manual_seed(BAD_BATCH)
    region = (
        offcore_torch.offload_activations(
            device, prefetch=drawn["activations"], min_bytes="0", max_inflight=drawn["max_inflight"]
        )
        if drawn["activations"] is not None
        else contextlib.nullcontext()
    )
    try:
        with region:
            loss = work.loss(model, work.make_batch(BAD_BATCH, torch.device("cpu")))
        if drawn["how"] == "backward-raises":
            loss.backward()
        del loss  # "no-backward": dropped; the others do not get here
    except BadBatch:
        pass
    finally:
        removable.remove()


def _train(drawn: dict[str, Any], *, bad: bool) -> dict[str, Any]:
    work = WORKLOADS[drawn["model"]]
    kind = drawn["optimizer"]
    device = fake_device(link=drawn["link"])
    directory = tempfile.mkdtemp(prefix="offcore-abandoned-") if drawn["nvme"] else None
    try:
        with device:
            if directory is not None:
                offcore_torch.nvme_tier(device, directory)
            tier = {"tier": "nvme"} if directory is not None else {}
            model = device.adopt(work.build(0))
            # one plain forward and backward first: what the model caches on its first call is not a leak
            work.loss(model, work.make_batch(0, torch.device("cpu"))).backward()
            model.zero_grad(set_to_none=True)
            before = memory_levels(device)
            handle = None
            if drawn["parameters"] is not None:
                budget = "4KiB" if drawn["parameters"] == "tight" else None
                handle = offload_parameters(model, device, budget=budget, **tier)
            if kind == "device":
                opt: Any = torch.optim.AdamW(model.parameters(), **ADAMW)
            else:
                opt = offload_optimizer_of_kind(
                    kind,
                    model,
                    device,
                    micro_steps=drawn["micro_steps"],
                    streamed_from_nvme=handle is not None and directory is not None,
                    **tier,
                    **ADAMW,
                )
            losses = []
            for step in range(STEPS):
                for micro in range(drawn["micro_steps"]):
                    if bad and (step, micro) == (drawn["step"], drawn["micro_step"]):
                        _bad_attempt(drawn, work, model, device)
                        opt.zero_grad()  # the loop starts the step over: its earlier micro-steps again
                        del losses[len(losses) - micro :]
                        for again in range(micro):
                            _micro_step(drawn, work, model, device, step, again, losses)
                    _micro_step(drawn, work, model, device, step, micro, losses)
                opt.step()
                opt.zero_grad()
            if kind != "device":
                opt.synchronize()
            with device.host_work():  # what the test keeps is not the device's memory
                state = copy.deepcopy(opt.state_dict()["state"])
                params = [p.detach().clone() for p in model.parameters()]
            if handle is not None:
                handle.remove()
            if kind != "device":
                opt.close()
            del opt, handle
            if directory is not None:
                offcore_torch.nvme_tier(device, None)
            torch.autograd.backward(torch.zeros((), requires_grad=True))  # drops a failed backward's nodes
            gc.collect()
            offcore_torch.synchronize(device)
            after = memory_levels(device)
        return {"losses": losses, "params": params, "state": state, "before": before, "after": after}
    finally:
        finish_device(device)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _micro_step(
    drawn: dict[str, Any], work: Workload, model: Any, device: Any, step: int, micro: int, losses: list[Any]
) -> None:
    index = step * drawn["micro_steps"] + micro
    batch = work.make_batch(index, torch.device("cpu"))
    torch.manual_seed(index)  # the same dropout masks in both runs
    region = (
        offcore_torch.offload_activations(
            device, prefetch=drawn["activations"], min_bytes="0", max_inflight=drawn["max_inflight"]
        )
        if drawn["activations"] is not None
        else contextlib.nullcontext()
    )
    with region:
        loss = work.loss(model, batch)
    del batch
    loss.backward()
    with device.host_work():
        losses.append(loss.detach().clone())


def _supported(drawn: dict[str, Any]) -> bool:
    if drawn["micro_step"] >= drawn["micro_steps"]:
        return False
    return not (drawn["how"] == "backward-raises" and drawn["optimizer"] == "offload-under-backward")


@pytest.mark.filterwarnings("ignore:module forward hook with ``always_call=True`` raised")  # torch, on a failed forward
@derandomized(max_examples=30, examples=covering(CHOICES, valid=_supported))
@given(drawn=abandoned)
def test_an_abandoned_step_changes_nothing_and_leaks_nothing(drawn: dict[str, Any]) -> None:
    assume(_supported(drawn))
    want = _train(drawn, bad=False)
    got = _train(drawn, bad=True)
    assert_same(got["losses"], want["losses"], f"losses of {drawn}")
    assert_same(got["params"], want["params"], f"parameters of {drawn}")
    assert_same(got["state"], want["state"], f"optimizer state of {drawn}")
    assert got["after"] == got["before"], (got["after"], got["before"], drawn)
