"""Training loops for the OffloadOptimizer tests: offloaded, and the host reference without offload.

The reference runs the same optimizer class with the same arguments on host copies of the
parameters (fp32 masters for bf16/fp16 device parameters when ``master_weights``), with
gradients accumulated on the host in the master dtype, exactly as OffloadOptimizer
promises to; it never touches offcore.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import offcore_torch
import torch
from offcore_torch.models import Workload

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
}


@dataclass
class Trace:
    """What one run produced, step by step."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[list[torch.Tensor]] = field(default_factory=list)  # host (master-dtype) grads before each step
    params: list[torch.Tensor] = field(default_factory=list)  # device params after the last step
    masters: list[torch.Tensor] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    norms: list[torch.Tensor] = field(default_factory=list)


def master_dtype(param: torch.Tensor, master_weights: bool) -> torch.dtype:
    return torch.float32 if master_weights and param.dtype in (torch.bfloat16, torch.float16) else param.dtype


class HostReference:
    """The same optimizer on host copies, no offload: the numbers OffloadOptimizer must reproduce."""

    def __init__(
        self,
        model: torch.nn.Module,
        cls: type[torch.optim.Optimizer],
        kwargs: dict[str, Any],
        *,
        master_weights: bool,
        sum_on_device: bool = False,
    ) -> None:
        # sum_on_device: the micro-steps' gradients are summed in .grad (the parameter's dtype) and reach
        # the masters at the step, as OffloadOptimizer(offload_gradients=False) promises
        self.sum_on_device = sum_on_device
        self.params = [p for p in model.parameters()]
        self.masters = [p.detach().to(master_dtype(p, master_weights)).clone() for p in self.params]
        self.opt = cls(self.masters, **kwargs)

    def accumulate(self, *, last: bool = True) -> None:
        if self.sum_on_device and not last:
            return  # autograd sums into .grad until the step
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.to(m.dtype).clone()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    def step(self, *, scaler: Any = None) -> None:
        """One step over the masters (through ``scaler.step`` when given: fp16 loss scaling), copied back."""
        if scaler is not None:
            scaler.step(self.opt)
        else:
            self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


def offload_optimizer_of_kind(
    kind: str, model: torch.nn.Module, device: Any, *, micro_steps: int, streamed_from_nvme: bool, **options: Any
) -> offcore_torch.OffloadOptimizer:
    """The combination suites' OffloadOptimizer (AdamW) of one drawn kind: ``"offload"`` (gradients offloaded,
    steps at ``step()``), ``"offload-device-grads"`` (``offload_gradients=False``) or ``"offload-under-backward"``
    (``accumulation_steps=micro_steps``). ``streamed_from_nvme``: offload_parameters streams the parameters from
    NVMe, so there is no host copy to step in place and the optimizer keeps masters of its own."""
    return offcore_torch.OffloadOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        device=device,
        offload_gradients=kind != "offload-device-grads",
        accumulation_steps=micro_steps if kind == "offload-under-backward" else None,
        params_on_host=False if streamed_from_nvme else None,
        **options,
    )


def place(model: torch.nn.Module, device: Any) -> torch.nn.Module:
    """The model on ``device``: adopted by the fake device (counted as its memory), moved elsewhere."""
    if getattr(device, "name", None) == "cpu":
        return device.adopt(model)
    return model.to(device.torch_device)


def run(
    work: Workload,
    *,
    device: Any,
    optimizer: str = "adamw",
    steps: int = 5,
    accumulation: int = 1,
    dtype: torch.dtype = torch.float32,
    master_weights: bool = False,
    offload: bool = True,
    overlap: bool = False,
    clip: float | None = None,
    offload_gradients: bool = True,
    seed: int = 0,
    build: Callable[[int], torch.nn.Module] | None = None,
    options: dict[str, Any] | None = None,
    zero_grad_before_backward: bool = False,
    set_to_none: bool = True,
) -> Trace:
    """``steps`` optimizer steps of ``accumulation`` micro-steps each; offloaded or the host reference.

    ``options``: more OffloadOptimizer keywords (``upload_budget``, ``tier``...).
    ``zero_grad_before_backward``: ``zero_grad()`` between the first micro-step's forward and its
    backward (PyTorch's quickstart order) instead of after ``step()``: the forward after ``step()`` is
    the first to need the parameters (Note [Who issues step()'s uploads])."""
    cls, kwargs = OPTIMIZERS[optimizer]
    trace = Trace()
    model = (build or work.build)(seed).to(dtype)
    with device:
        model = place(model, device)
        if offload:
            opt: Any = offcore_torch.OffloadOptimizer(
                model.parameters(),
                cls,
                device=device,
                master_weights=master_weights,
                offload_gradients=offload_gradients,
                accumulation_steps=accumulation if overlap else None,
                **(options or {}),
                **kwargs,
            )
        else:
            opt = HostReference(model, cls, kwargs, master_weights=master_weights, sum_on_device=not offload_gradients)
        try:
            for step in range(steps):
                for micro in range(accumulation):
                    batch = work.make_batch(step * accumulation + micro, torch.device("cpu"))
                    batch = tuple(b.to(dtype) if b.is_floating_point() else b for b in batch)
                    loss = work.loss(model, batch)
                    if zero_grad_before_backward and micro == 0:
                        opt.zero_grad(set_to_none=set_to_none)
                    loss.backward()
                    trace.losses.append(loss.detach().clone())
                    if not offload:
                        opt.accumulate(last=micro == accumulation - 1)
                if clip is not None:
                    if offload:
                        trace.norms.append(offcore_torch.clip_grad_norm_(opt, clip))
                    else:
                        trace.norms.append(torch.nn.utils.clip_grad_norm_(opt.masters, clip))
                if offload:
                    opt.step()
                    trace.grads.append([g.clone() for g in opt.host_grads()])
                else:
                    trace.grads.append([m.grad.clone() for m in opt.masters if m.grad is not None])
                    opt.step()
                if not zero_grad_before_backward:
                    opt.zero_grad(set_to_none=set_to_none)
            if offload:
                opt.synchronize()
                trace.masters = [opt.master(p).clone() for p in model.parameters()]
            else:
                trace.masters = [m.clone() for m in opt.masters]
            trace.params = [p.detach().clone() for p in model.parameters()]
            trace.state = copy.deepcopy(opt.opt.state_dict() if not offload else opt.state_dict())
        finally:
            if offload:
                opt.close()
    return trace


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical nested structures of tensors / numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), (
            f"{where}: differ by {(a.double() - b.double()).abs().max().item()}"
        )
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_equivalent(got: Trace, want: Trace) -> None:
    assert_same(got.losses, want.losses, "losses")
    assert_same(got.grads, want.grads, "grads")
    assert_same(got.norms, want.norms, "clip norms")
    assert_same(got.params, want.params, "params")
    assert_same(got.masters, want.masters, "masters")
    state = {k: v for k, v in got.state.items() if k != offcore_torch.optimizer.optimizer.MASTER_WEIGHTS_KEY}
    assert_same(state, want.state, "optimizer state")
