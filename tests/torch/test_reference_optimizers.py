"""PyTorch's own optimizer test database and ``test_optim.py`` checks, run against OffloadOptimizer.

The configurations come from ``torch.testing._internal.common_optimizers.optim_db`` of the
installed torch (not a hand-copied list): for every ``OptimizerInfo`` whose optimizer runs on
the CPU, every config torch's ``test_optim.py`` runs on the CPU (its ``optim_inputs_func`` through
``_get_optim_inputs_including_global_cliquey_kwargs``: the global "cliquey" flags off, then
``fused`` on where ``supports_fused_on`` has the CPU), plus the accelerators' extra configs (which
add ``capturable``). Each trains a small model (two Linear layers in two param
groups, the second with half the learning rate) for a few steps on the fake device with
``OffloadOptimizer(groups, optimizer_class, device=dev, **kwargs)`` and compares losses,
parameters and ``state_dict()`` bit for bit with the same optimizer class and kwargs run on plain
CPU tensors (the reference). A config torch itself refuses on the CPU (``capturable=True``) is
skipped with torch's message.

Then the behavioural checks of pytorch's ``test/optim/test_optim.py`` (``TestOptimRenewed``) that
apply, each naming the test it comes from. For what OffloadOptimizer deliberately does not support
(LBFGS, complex parameters, sparse gradients and parameters, ``differentiable=True``, ``capturable=True``
without ``fused``, deep copies...), the test asserts the clear :class:`offcore.errors.OffcoreError` it raises
(issue 11's nine bugs, once ``xfail(strict=True)`` here, are fixed and their tests pass).

Not ported: foreach configs (torch tests foreach only on accelerators: on the CPU it is the
for-loop's arithmetic), ``test_forloop_goes_right_direction_multigpu`` and the other multi-device
and CUDA-graph tests, memory and kernel-count tests of torch's implementations
(``test_peak_memory_foreach``, ``test_fused_*``), ``test_can_load_older_state_dict`` (torch's own
format migration), and ``TestDifferentiableOptimizer`` (``differentiable`` is refused).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import os
import re
import sys
import threading
import types
import unittest
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import pool_used_bytes, sanitized_device  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

from offcore.errors import ConfigurationError, CopyFailedError, OffcoreError  # noqa: E402


def _import_optim_db() -> Any:
    """``torch.testing._internal.common_optimizers``, imported without its side effects on this process.

    Its import pulls in torch's ``common_utils``, which needs ``expecttest`` (only for torch's own
    TestCase: a stand-in module does when it is not installed), freezes ``torch.backends`` flags
    (``disable_global_flags``), patches TorchScript's call, sets environment variables and adds
    warning filters; all are undone here, so the rest of the suite runs in this process as before.
    """
    stand_in = None
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in
    backends = torch.backends.flags_frozen.__globals__  # the module's own namespace (torch.backends is wrapped)
    flag = "__allow_nonbracketed_mutation_flag"
    allowed = backends[flag]
    script_calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():
            from torch.testing._internal import common_optimizers
    finally:
        backends[flag] = allowed
        torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = script_calls  # type: ignore[method-assign]
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)
        if stand_in is not None and sys.modules.get("expecttest") is stand_in:
            del sys.modules["expecttest"]
    return common_optimizers


try:
    common_optimizers = _import_optim_db()
except Exception as exc:  # pragma: no cover - depends on the installed torch
    pytest.skip(f"torch's optimizer test database cannot be imported: {exc!r}", allow_module_level=True)

OPTIM_DB: list[Any] = list(common_optimizers.optim_db)
STEPS = 3


# ---------------------------------------------------------------- the configurations, from optim_db
def _name(info: Any) -> str:
    return str(info.optim_cls.__name__)


def _trains_dense(info: Any) -> bool:
    """Trains a dense model: not LBFGS (refused: needs all parameters at once), not SparseAdam (sparse only)."""
    return info.supports_param_groups and not info.step_requires_closure and not info.only_supports_sparse_grads


def _configs() -> Iterator[Any]:
    """``pytest.param(info, kwargs, id=...)`` for every config torch's test_optim.py runs on the CPU
    (``_get_optim_inputs_including_global_cliquey_kwargs``: each config with its cliquey flags off, then
    each flag on: ``fused`` where the CPU has it, ``differentiable``, which test_differentiable_is_refused
    covers instead), plus the accelerators' extra configs (``capturable``) with the same flags."""
    for info in OPTIM_DB:
        if not _trains_dense(info):
            continue
        configs = common_optimizers._get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info)
        seen = {i.desc for i in info.optim_inputs_func(device="cpu")}
        flags = [
            f for f in info.supported_impls if f != "foreach" and (f != "fused" or "cpu" in info.supports_fused_on)
        ]
        for extra in info.optim_inputs_func(device="cuda"):
            if extra.desc not in seen:
                base = {**extra.kwargs, **dict.fromkeys(flags, False)}
                configs.append(types.SimpleNamespace(desc=extra.desc, kwargs=base))
                configs += [types.SimpleNamespace(desc=f"{extra.desc} & {f}", kwargs={**base, f: True}) for f in flags]
        for config in configs:
            if not config.kwargs.get("differentiable"):
                yield pytest.param(info, dict(config.kwargs), id=f"{_name(info)}-{config.desc}".replace(" ", "_"))


CONFIGS = list(_configs())
DENSE = [pytest.param(info, id=_name(info)) for info in OPTIM_DB if _trains_dense(info)]


def _default_lr(cls: type[Any]) -> Any:
    return inspect.signature(cls.__init__).parameters["lr"].default


# ---------------------------------------------------------------- the training
def build(cls: type[Any], seed: int = 0) -> torch.nn.Sequential:
    """Two Linear layers (no biases for Muon: it takes 2-D parameters only, torch's db builds those too)."""
    bias = cls is not getattr(torch.optim, "Muon", None)
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=bias), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=bias))


def groups_of(model: torch.nn.Sequential, cls: type[Any], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """torch's test_param_groups_lr: the second layer in a group of its own, at half the learning rate."""
    lr = kwargs.get("lr", _default_lr(cls))
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": lr * 0.5}]


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(5, 6, generator=generator)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = batch(step).to(next(model.parameters()).device)
    return model(x).square().mean()


class Reference:
    """``cls(**kwargs)`` on plain CPU tensors: host copies of the parameters (the parameters themselves on the
    fake device, whose tensors are CPU tensors), gradients copied to them, the step copied back; no offcore."""

    def __init__(self, groups: list[dict[str, Any]], cls: type[Any], **kwargs: Any) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_groups = []
        for group in groups:
            host = []
            for param in group["params"]:
                master = param if param.device.type == "cpu" else param.detach().cpu().clone()
                self.pairs.append((param, master))
                host.append(master)
            host_groups.append({**group, "params": host})
        self.opt = cls(host_groups, **kwargs)

    def __getattr__(self, name: str) -> Any:  # param_groups, state_dict, hooks... are the optimizer's
        return getattr(self.opt, name)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param, master in self.pairs:
            if master is not param:
                master.grad = None if param.grad is None else param.grad.cpu()
        self.opt.step()
        with torch.no_grad():
            for param, master in self.pairs:
                if master is not param:
                    param.copy_(master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none)
        for param, master in self.pairs:
            if master is not param and param.grad is not None:
                param.grad = None if set_to_none else param.grad.zero_()


def make_model(cls: type[Any], dev: Any, *, offload: bool, seed: int = 0) -> torch.nn.Sequential:
    """The model where the run trains it: adopted by the fake device when offloaded, plain CPU tensors for
    the fake device's reference; on a real accelerator, on the device either way."""
    model = build(cls, seed)
    if dev is None:
        return model
    if offload:
        return place(model, dev)
    return model if getattr(dev, "name", None) == "cpu" else model.to(dev.torch_device)


def make_opt(groups: list[dict[str, Any]], cls: type[Any], dev: Any, *, offload: bool, **kwargs: Any) -> Any:
    """OffloadOptimizer, or the reference: ``cls`` itself over CPU parameters (the fake device's are)."""
    if offload:
        return offcore_torch.OffloadOptimizer(groups, cls, device=dev, **kwargs)
    if all(p.device.type == "cpu" for g in groups for p in g["params"]):
        return cls(groups, **kwargs)
    return Reference(groups, cls, **kwargs)


def needs_plain_reference(dev: Any) -> None:
    """Checks whose reference must be a ``torch.optim.Optimizer`` itself (LR schedulers, add_param_group)."""
    if getattr(dev, "name", None) != "cpu":
        pytest.skip("the reference here is torch's optimizer over the parameters themselves: CPU tensors only")


@dataclass
class Run:
    losses: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    extra: list[Any] = field(default_factory=list)


def train(
    cls: type[Any],
    kwargs: dict[str, Any],
    dev: Any = None,
    *,
    offload: bool = True,
    steps: int = STEPS,
    per_step: Callable[[Any, torch.Tensor, Run], None] | None = None,
    on_start: Callable[[Any, Run], None] | None = None,
) -> Run:
    """``steps`` steps of ``cls(**kwargs)`` over :func:`groups_of`: OffloadOptimizer on ``dev`` (``offload``),
    or the reference. ``on_start(opt, run)`` runs before the first step, ``per_step(opt, loss, run)`` after
    each (LR schedulers)."""
    offload = offload and dev is not None
    run = Run()
    model = make_model(cls, dev, offload=offload)
    with dev if offload else contextlib.nullcontext():
        opt = make_opt(groups_of(model, cls, kwargs), cls, dev, offload=offload, **kwargs)
        try:
            if on_start is not None:
                on_start(opt, run)
            for step in range(steps):
                opt.zero_grad()
                loss = loss_of(model, step)
                loss.backward()
                opt.step()
                run.losses.append(loss.detach().cpu())
                if per_step is not None:
                    per_step(opt, loss.detach(), run)
            finish(run, opt, model, offload=offload)
        finally:
            if offload:
                opt.close()
    return run


def finish(run: Run, opt: Any, model: torch.nn.Module, *, offload: bool) -> None:
    """The run's parameters (uploads landed) and optimizer state dict."""
    if offload:
        opt.synchronize()
    run.params = [p.detach().cpu().clone() for p in model.parameters()]
    run.state = opt.state_dict()


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    return torch.equal(_bytes(got), _bytes(expected))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: Any, expected: Any, where: str = "") -> None:
    """Equal structure, equal non-tensor values, and tensors equal bit for bit (dtype and shape too)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_bits(got, expected), (where, got, expected)
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (where, sorted(got), sorted(expected))
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert type(got) is type(expected) and len(got) == len(expected), (where, got, expected)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{where}[{i}]")
    else:
        assert got == expected, (where, got, expected)


def assert_runs_equal(got: Run, expected: Run) -> None:
    assert_same(got.losses, expected.losses, "losses")
    assert_same(got.params, expected.params, "params")
    assert_same(got.state, expected.state, "state_dict")


def refused_on_cpu(cls: type[Any], kwargs: dict[str, Any]) -> str | None:
    """torch's own refusal of a ``capturable``/``fused`` config on plain CPU tensors (None: it runs)."""
    if not (kwargs.get("capturable") or kwargs.get("fused")):
        return None
    try:
        train(cls, kwargs, steps=1)
    except Exception as exc:
        return f"torch refuses {cls.__name__}({kwargs}) on the CPU: {type(exc).__name__}: {exc}"
    return None


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


# ---------------------------------------------------------------- every config of optim_db, bit for bit
@pytest.mark.parametrize(("info", "kwargs"), CONFIGS)
def test_every_optim_db_config_matches_torch_bit_for_bit(dev: Any, info: Any, kwargs: dict[str, Any]) -> None:
    """TestOptimRenewed.test_forloop_goes_right_direction / test_param_groups_lr, against the reference."""
    cls = info.optim_cls
    reason = refused_on_cpu(cls, kwargs)
    if reason is not None:
        pytest.skip(reason)
    expected = train(cls, kwargs, dev, offload=False)
    got = train(cls, kwargs, dev)
    assert_runs_equal(got, expected)
    assert pool_used_bytes(dev) == 0


def representative(info: Any) -> dict[str, Any]:
    """The behavioural checks' config of ``info``: its last CPU config (the one with the most options set)."""
    return dict(info.optim_inputs_func(device="cpu")[-1].kwargs)


# ---------------------------------------------------------------- state dicts
@pytest.mark.parametrize("info", DENSE)
def test_state_dict_round_trip_resumes_exactly(dev: Any, info: Any) -> None:
    """test_state_dict_deterministic, test_save_load_equality_with_weights_only, test_load_nontensor_step.

    ``STEPS // 2`` steps, then the optimizer's state dict through ``torch.save`` / ``torch.load(weights_only=True)``
    (equal to the reference's) and the weights into a fresh model and a fresh OffloadOptimizer that already
    took a step of its own (non-empty state), whose device parameters are then written behind its back (what
    ``model.load_state_dict`` does; a write of one's own waits for the uploads in flight first, Note [Writes to
    parameters after step()]; ``model.load_state_dict`` waits itself: test_model_load_state_dict_right_after_a_step_is_kept
    and test_writes_to_parameters_after_a_step_win_and_refresh_the_masters); the other steps: the same bits as ``STEPS``
    uninterrupted steps of the reference. The state dict also loads into plain ``cls`` (torch's format),
    and ``load_state_dict`` leaves its argument as it was."""
    cls, kwargs = info.optim_cls, representative(info)
    expected = train(cls, kwargs, dev, offload=False)
    half = STEPS // 2
    first = Run()

    def keep_checkpoint(opt: Any, loss: torch.Tensor, run: Run) -> None:
        if len(run.losses) == half:
            buffer = io.BytesIO()
            torch.save({"optim": opt.state_dict()}, buffer)
            buffer.seek(0)
            run.extra.append(torch.load(buffer, weights_only=True)["optim"])
            opt.synchronize()  # the step's uploads landed: the weights to save are the stepped ones
            run.extra.append([p.detach().cpu().clone() for p in model_params(opt)])

    first = train(cls, kwargs, dev, steps=half, per_step=keep_checkpoint)
    checkpoint, weights = first.extra
    assert_same(first.losses, expected.losses[:half], "losses before the checkpoint")
    assert_same(checkpoint, train(cls, kwargs, dev, offload=False, steps=half).state, "the checkpoint")

    plain_model = build(cls, seed=1)
    plain = cls(groups_of(plain_model, cls, kwargs), **kwargs)
    plain.load_state_dict(copy.deepcopy(checkpoint))
    assert_same(plain.state_dict(), checkpoint, "the checkpoint loaded into plain torch")

    run = Run(losses=list(first.losses))
    model = make_model(cls, dev, offload=True, seed=1)
    with dev:
        opt = make_opt(groups_of(model, cls, kwargs), cls, dev, offload=True, **kwargs)
        try:
            loss_of(model, 99).backward()  # a step of its own: the state is not empty when loading
            opt.step()
            opt.zero_grad()
            opt.synchronize()  # the step's uploads landed before the parameters are written by hand
            with torch.no_grad():
                for param, value in zip(model.parameters(), weights, strict=True):
                    param.copy_(value)  # model.load_state_dict's writes: the masters are stale
            given = copy.deepcopy(checkpoint)
            opt.load_state_dict(given)
            assert_same(given, checkpoint, "load_state_dict's argument")
            for step in range(half, STEPS):
                opt.zero_grad()
                loss = loss_of(model, step)
                loss.backward()
                opt.step()
                run.losses.append(loss.detach().cpu())
            finish(run, opt, model, offload=True)
        finally:
            opt.close()
    assert_runs_equal(run, expected)


def model_params(opt: Any) -> list[torch.Tensor]:
    """The device parameters of an OffloadOptimizer, in order."""
    return [slot.param for slot in opt._slots]


# ---------------------------------------------------------------- steps
@pytest.mark.parametrize("info", DENSE)
def test_step_with_a_closure(dev: Any, info: Any) -> None:
    """test_forloop_goes_right_direction's closure form: ``step(closure)`` calls the closure once (with grad
    enabled), returns its loss, and steps with the gradients it made; the same bits as the reference."""
    cls, kwargs = info.optim_cls, representative(info)

    def run_with_closure(offload: bool) -> Run:
        run = Run()
        model = make_model(cls, dev, offload=offload)
        with dev if offload else contextlib.nullcontext():
            opt = make_opt(groups_of(model, cls, kwargs), cls, dev, offload=offload, **kwargs)
            try:
                for step in range(STEPS):
                    calls = []

                    def closure(step: int = step, calls: list[int] = calls) -> torch.Tensor:
                        calls.append(step)
                        opt.zero_grad()
                        loss = loss_of(model, step)
                        loss.backward()
                        return loss

                    with torch.no_grad():
                        loss = opt.step(closure)
                    assert calls == [step] and loss.requires_grad
                    run.losses.append(loss.detach().cpu())
                finish(run, opt, model, offload=offload)
            finally:
                if offload:
                    opt.close()
        return run

    assert_runs_equal(run_with_closure(True), run_with_closure(False))


@pytest.mark.parametrize("info", DENSE)
def test_step_is_noop_when_params_have_no_grad(dev: Any, info: Any) -> None:
    """test_step_is_noop_when_params_have_no_grad: a step without gradients changes nothing, keeps no state."""
    cls, kwargs = info.optim_cls, representative(info)
    model = make_model(cls, dev, offload=True)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    with dev:
        opt = make_opt(groups_of(model, cls, kwargs), cls, dev, offload=True, **kwargs)
        try:
            opt.step()
            opt.step()
            opt.synchronize()
            assert_same([p.detach().cpu() for p in model.parameters()], before, "params")
            plain = cls(groups_of(build(cls), cls, kwargs), **kwargs)
            plain.step()
            assert_same(opt.state_dict(), plain.state_dict(), "state_dict")
        finally:
            opt.close()


@pytest.mark.parametrize("info", DENSE)
def test_zero_grad_keeping_zeros_then_a_step(dev: Any, info: Any) -> None:
    """torch.optim.Optimizer.zero_grad(set_to_none=False) (test_step_is_noop_for_zero_grads' set-up): the
    gradients are zeros, not None, so the next step, with no backward in between, steps every parameter with
    zero gradients (momentum and weight decay still move it): the same bits as the reference."""
    cls, kwargs = info.optim_cls, representative(info)

    def zeros_then_step(opt: Any, loss: torch.Tensor, run: Run) -> None:
        if len(run.losses) == STEPS:
            opt.zero_grad(set_to_none=False)
            opt.step()

    expected = train(cls, kwargs, dev, offload=False, per_step=zeros_then_step)
    got = train(cls, kwargs, dev, per_step=zeros_then_step)
    assert_runs_equal(got, expected)


@pytest.mark.parametrize("info", DENSE)
def test_add_param_group(dev: Any, info: Any) -> None:
    """Optimizer.add_param_group after steps (test_param_groups_lr's second group, added late): the new group's
    gradients of the earlier steps accumulated in ``.grad`` (no optimizer cleared them) and are stepped with
    the first one that follows, as torch does."""
    needs_plain_reference(dev)
    cls, kwargs = info.optim_cls, representative(info)

    def run(offload: bool) -> Run:
        result = Run()
        model = make_model(cls, dev, offload=offload)
        first, second = groups_of(model, cls, kwargs)
        with dev if offload else contextlib.nullcontext():
            opt = make_opt([first], cls, dev, offload=offload, **kwargs)
            try:
                for step in range(STEPS):
                    if step == STEPS // 2:
                        opt.add_param_group(second)
                    opt.zero_grad()
                    loss = loss_of(model, step)
                    loss.backward()
                    opt.step()
                    result.losses.append(loss.detach().cpu())
                finish(result, opt, model, offload=offload)
            finally:
                if offload:
                    opt.close()
        return result

    assert_runs_equal(run(True), run(False))


SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "ExponentialLR": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5),
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=0),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("info", DENSE)
def test_lr_schedulers(dev: Any, info: Any, scheduler: str) -> None:
    """test_param_group_with_lrscheduler_goes_right_direction: schedulers drive ``param_groups``' learning
    rates of the host optimizer; learning rates, losses, parameters and state dict equal the reference's."""
    needs_plain_reference(dev)
    cls, kwargs = info.optim_cls, representative(info)
    if isinstance(kwargs.get("lr"), torch.Tensor) or (scheduler == "OneCycleLR" and not _has_momentum(cls, kwargs)):
        kwargs = {k: v for k, v in kwargs.items() if k != "lr"}
    if scheduler == "OneCycleLR" and not _has_momentum(cls, kwargs):
        pytest.skip(f"OneCycleLR cycles momentum or betas; {cls.__name__} has neither")

    def make_scheduler(opt: Any, run: Run) -> None:
        run.extra.append(SCHEDULERS[scheduler](opt))

    def step_scheduler(opt: Any, loss: torch.Tensor, run: Run) -> None:
        sched = run.extra[0]
        sched.step(loss.item()) if scheduler == "ReduceLROnPlateau" else sched.step()
        run.extra.append([g["lr"] for g in opt.param_groups])

    expected = train(cls, kwargs, dev, offload=False, per_step=step_scheduler, on_start=make_scheduler)
    got = train(cls, kwargs, dev, per_step=step_scheduler, on_start=make_scheduler)
    assert_runs_equal(got, expected)
    assert got.extra[1:] == expected.extra[1:]
    assert got.extra[-1] != got.extra[1] or scheduler == "ReduceLROnPlateau"


def _has_momentum(cls: type[Any], kwargs: dict[str, Any]) -> bool:
    defaults = inspect.signature(cls.__init__).parameters
    return "betas" in defaults or ("momentum" in defaults and kwargs.get("momentum", 0) > 0)


# ---------------------------------------------------------------- hooks
def step_with_hooks(dev: Any, *, global_hooks: bool, **options: Any) -> tuple[list[tuple[str, Any]], Any]:
    """Three steps of an OffloadOptimizer with step hooks (torch's global ones too, with ``global_hooks``)
    registered for the first two: what the hooks saw, and the optimizer."""
    cls = torch.optim.SGD
    seen: list[tuple[str, Any]] = []
    caller = threading.current_thread()

    def saw(name: str, o: Any) -> None:
        assert threading.current_thread() is caller, (name, threading.current_thread().name)  # the caller's thread
        seen.append((name, o))

    model = make_model(cls, dev, offload=True)
    handles = []
    if global_hooks:
        handles += [
            register_optimizer_step_pre_hook(lambda o, a, k: saw("global pre", o)),
            register_optimizer_step_post_hook(lambda o, a, k: saw("global post", o)),
        ]
    try:
        with dev:
            opt = make_opt(groups_of(model, cls, {"lr": 0.1}), cls, dev, offload=True, lr=0.1, momentum=0.9, **options)
            try:
                handles.append(opt.register_step_pre_hook(lambda o, a, k: saw("pre", o)))
                handles.append(opt.register_step_post_hook(lambda o, a, k: saw("post", o)))
                for step in range(3):
                    if step == 2:
                        for handle in handles:
                            handle.remove()
                    loss_of(model, step).backward()
                    opt.step()
                    opt.zero_grad()
            finally:
                opt.close()
    finally:
        for handle in handles:
            handle.remove()
    return seen, opt


def test_step_hooks_run_once_per_step(dev: Any) -> None:
    """test_step_pre_hook, test_step_post_hook: the optimizer's own hooks run once per ``step()`` with the
    OffloadOptimizer as their optimizer, pre before post; removed hooks stop."""
    seen, opt = step_with_hooks(dev, global_hooks=False)
    assert [(name, o is opt) for name, o in seen] == [("pre", True), ("post", True)] * 2


@pytest.mark.parametrize("accumulation_steps", [None, 1], ids=["at-step", "under-backward"])
def test_global_step_hooks_run_once_per_step_in_torchs_order(dev: Any, accumulation_steps: int | None) -> None:
    """test_step_all_hooks: global pre, local pre, local post, global post, once per ``step()``, on the caller's
    thread, all with the OffloadOptimizer as the optimizer (the host optimizer's steps inside are not the user's
    steps: Note [Step hooks run once per step])."""
    seen, opt = step_with_hooks(dev, global_hooks=True, accumulation_steps=accumulation_steps)
    expected = ["global pre", "pre", "post", "global post"] * 2
    assert [(name, o is opt) for name, o in seen] == [(name, True) for name in expected]


def test_state_dict_pre_and_post_hooks(dev: Any) -> None:
    """test_state_dict_pre_hook, test_state_dict_post_hook: the pre hook sees the optimizer before, the post hook
    may change the state dict returned."""
    cls = torch.optim.Adam
    model = make_model(cls, dev, offload=True)
    seen: list[str] = []
    with dev:
        opt = make_opt(groups_of(model, cls, {}), cls, dev, offload=True)
        try:

            def post(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
                seen.append("post")
                sd["param_groups"][0]["lr"] = 1234.0
                return sd

            opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
            opt.register_state_dict_post_hook(post)
            sd = opt.state_dict()
        finally:
            opt.close()
    assert seen == ["pre", "post"] and sd["param_groups"][0]["lr"] == 1234.0


def test_load_state_dict_pre_and_post_hooks(dev: Any) -> None:
    """test_load_state_dict_pre_hook_and_prepend, test_load_state_dict_post_hook: the pre hook may replace the
    state dict loaded, the post hook runs after the load."""
    cls = torch.optim.Adam
    model = make_model(cls, dev, offload=True)
    seen: list[str] = []
    with dev:
        opt = make_opt(groups_of(model, cls, {}), cls, dev, offload=True)
        try:
            sd = opt.state_dict()

            def pre(o: Any, given: dict[str, Any]) -> dict[str, Any]:
                seen.append("pre")
                given = copy.deepcopy(given)
                given["param_groups"][0]["lr"] = 0.5
                return given

            opt.register_load_state_dict_pre_hook(pre)
            opt.register_load_state_dict_post_hook(lambda o: seen.append("post"))
            opt.load_state_dict(sd)
            lr = opt.param_groups[0]["lr"]
        finally:
            opt.close()
    assert seen == ["pre", "post"] and lr == 0.5


# ---------------------------------------------------------------- copies and printing
def test_deepcopy_is_refused_clearly(dev: Any) -> None:
    """test_deepcopy_copies_all_public_attrs: an OffloadOptimizer holds a pinned pool, a worker thread and hooks
    on the device parameters, so a deep copy (or a copy, or a pickle) is refused with a ConfigurationError that
    says to use state_dict(); the optimizer goes on working and nothing is left held."""
    cls = torch.optim.Adam
    model = make_model(cls, dev, offload=True)
    with dev:
        opt = make_opt(groups_of(model, cls, {}), cls, dev, offload=True)
        try:
            for copier in (copy.deepcopy, copy.copy, lambda o: torch.save(o, io.BytesIO())):
                with pytest.raises(ConfigurationError, match=r"state_dict\(\)"):
                    copier(opt)
            loss_of(model, 0).backward()
            opt.step()
        finally:
            opt.close()
    assert_nothing_left(dev)


def test_optimizer_can_be_printed(dev: Any) -> None:
    """test_optimizer_can_be_printed."""
    cls = torch.optim.AdamW
    model = make_model(cls, dev, offload=True)
    with dev:
        opt = make_opt(groups_of(model, cls, {}), cls, dev, offload=True)
        try:
            assert "AdamW" in repr(opt) and "4 parameters" in repr(opt)
        finally:
            opt.close()


# ---------------------------------------------------------------- writes to parameters after step()
def test_model_load_state_dict_right_after_a_step_is_kept(dev: Any) -> None:
    """test_state_dict_deterministic's resume, without a synchronize between ``step()`` and the model's
    ``load_state_dict`` (``upload_budget`` holds the uploads back, so the order is the same on every run)."""
    cls = torch.optim.SGD
    model = make_model(cls, dev, offload=True)
    saved = {name: torch.full_like(value, 0.5) for name, value in model.state_dict().items()}
    with dev:
        opt = make_opt(groups_of(model, cls, {"lr": 0.1}), cls, dev, offload=True, lr=0.1, upload_budget=1)
        try:
            loss_of(model, 0).backward()
            opt.step()
            model.load_state_dict(saved)
            opt.synchronize()
            lost = [name for name, value in model.state_dict().items() if not torch.equal(value, saved[name])]
        finally:
            opt.close()
    assert lost == []


def write_parameters(model: torch.nn.Module, how: str, value: float) -> None:
    """Write every parameter after ``step()``: the model's load_state_dict, ``p.copy_`` under no_grad, ``p.data =``."""
    if how == "load_state_dict":
        model.load_state_dict({name: torch.full_like(v, value) for name, v in model.state_dict().items()})
        return
    for param in model.parameters():
        if how == "copy_":
            with torch.no_grad():
                param.copy_(torch.full_like(param, value))
        else:
            param.data = torch.full_like(param, value)


@pytest.mark.parametrize("how", ["load_state_dict", "copy_", "data"])
@pytest.mark.parametrize("master_weights", [False, True], ids=["fp32", "bf16-masters"])
def test_writes_to_parameters_after_a_step_win_and_refresh_the_masters(
    dev: Any, how: str, master_weights: bool
) -> None:
    """Note [Writes to parameters after step()]: a write to the parameters between ``step()`` and the next forward
    (no synchronize; ``upload_budget`` holds the uploads back, so the order is the same on every run) is kept,
    and the next step starts from it: the same bits as the plain optimizer that sees the same writes."""
    cls, kwargs = torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    dtype = torch.bfloat16 if master_weights else torch.float32
    runs = []
    for offload in (False, True):
        model = make_model(cls, dev, offload=offload)
        model = model.to(dtype)
        masters = None
        with dev:
            if offload:
                opt = offcore_torch.OffloadOptimizer(
                    groups_of(model, cls, kwargs),
                    cls,
                    device=dev,
                    upload_budget=1,
                    master_weights=master_weights,
                    **kwargs,
                )
            elif master_weights:  # the reference: fp32 masters stepped by hand, as test_master_weights does
                groups = groups_of(model, cls, kwargs)
                for group in groups:
                    group["params"] = [p.detach().float().clone().requires_grad_() for p in group["params"]]
                masters = [m for group in groups for m in group["params"]]
                opt = cls(groups, **kwargs)
            else:
                opt = cls(groups_of(model, cls, kwargs), **kwargs)
            try:
                for step in range(3):
                    model(batch(step).to(dtype)).float().square().mean().backward()
                    if masters is not None:
                        for master, param in zip(masters, model.parameters(), strict=True):
                            master.grad = param.grad.float()
                    opt.step()
                    opt.zero_grad()
                    if masters is not None:
                        with torch.no_grad():
                            for master, param in zip(masters, model.parameters(), strict=True):
                                param.copy_(master)
                                param.grad = None
                    if step == 0:
                        if offload and how != "load_state_dict":
                            # an upload in flight (upload_budget lets the first through) is waited for before
                            # a write of one's own; the held-back ones are cancelled by the write
                            opt.wait_for_parameters([p for p in model.parameters() if id(p) in opt._pending_h2d])
                        write_parameters(model, how, 0.25)
                        if masters is not None:  # the masters refreshed from the written (bf16) values
                            with torch.no_grad():
                                for master, param in zip(masters, model.parameters(), strict=True):
                                    master.copy_(param)
                        if offload:
                            opt.synchronize()
                            for param in model.parameters():
                                assert torch.equal(param, torch.full_like(param, 0.25)), how  # the write won
                if offload:
                    opt.synchronize()
                runs.append([p.detach().float().clone() for p in model.parameters()])
            finally:
                if offload:
                    opt.close()
    expected, got = runs
    assert_same(got, expected)
    assert pool_used_bytes(dev) == 0


# ---------------------------------------------------------------- what OffloadOptimizer refuses
def assert_nothing_left(dev: Any) -> None:
    assert pool_used_bytes(dev) == 0
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    assert not any("offcore_torch.optimizer.optimizer" in getattr(h, "__module__", "") for h in hooks.values())


@pytest.mark.parametrize("info", [pytest.param(i, id=_name(i)) for i in OPTIM_DB if i.step_requires_closure])
def test_optimizers_needing_all_parameters_at_once_are_refused(dev: Any, info: Any) -> None:
    """LBFGS (optim_db: step_requires_closure, no param groups): its state spans every parameter."""
    model = make_model(info.optim_cls, dev, offload=True)
    with dev, pytest.raises(ConfigurationError, match=info.optim_cls.__name__):
        offcore_torch.OffloadOptimizer(model.parameters(), info.optim_cls, device=dev)
    assert_nothing_left(dev)


@pytest.mark.parametrize(
    "info", [pytest.param(i, id=_name(i)) for i in OPTIM_DB if i.supports_complex and _trains_dense(i)]
)
def test_complex_parameters_are_refused(dev: Any, info: Any) -> None:
    """test_complex / test_complex_2d: torch steps complex parameters as their view_as_real; OffloadOptimizer
    takes floating-point parameters only and says so."""
    param = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.complex64))
    with dev, pytest.raises(ConfigurationError, match="complex"):
        offcore_torch.OffloadOptimizer([param], info.optim_cls, device=dev)
    assert_nothing_left(dev)


@pytest.mark.parametrize(
    "info", [pytest.param(i, id=_name(i)) for i in OPTIM_DB if i.supports_sparse or i.only_supports_sparse_grads]
)
def test_sparse_gradients_are_refused_clearly(dev: Any, info: Any) -> None:
    """test_rosenbrock_sparse's set-up (optim_db: supports_sparse, only_supports_sparse_grads): a sparse gradient
    is refused with an OffcoreError naming it, and nothing is left held."""
    torch.manual_seed(0)
    embedding = place(torch.nn.Embedding(10, 4, sparse=True), dev)
    with dev:
        opt = offcore_torch.OffloadOptimizer(embedding.parameters(), info.optim_cls, device=dev)
        try:
            with pytest.raises(OffcoreError, match="(?i)sparse gradient") as refused:
                embedding(torch.tensor([1, 2, 2])).sum().backward()
                opt.step()
            assert not isinstance(refused.value, CopyFailedError)
        finally:
            opt.close()
    assert_nothing_left(dev)


def test_sparse_parameters_are_refused_clearly(dev: Any) -> None:
    """test_errors' SparseAdam case 'dense params required': a sparse parameter is refused with an OffcoreError
    naming it, and nothing is left held."""
    param = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=True)
    param.requires_grad_()
    with dev, pytest.raises(ConfigurationError, match="(?i)sparse"):
        offcore_torch.OffloadOptimizer([param], torch.optim.SGD, device=dev, lr=0.1)
    assert_nothing_left(dev)


@pytest.mark.parametrize(
    "info", [pytest.param(i, id=_name(i)) for i in OPTIM_DB if "differentiable" in i.supported_impls]
)
def test_differentiable_is_refused(dev: Any, info: Any) -> None:
    """optim_db's ``differentiable`` flag (supported_impls): refused, nothing left held."""
    model = make_model(info.optim_cls, dev, offload=True)
    with dev, pytest.raises(ConfigurationError, match="differentiable"):
        offcore_torch.OffloadOptimizer(model.parameters(), info.optim_cls, device=dev, differentiable=True)
    assert_nothing_left(dev)


@pytest.mark.parametrize("info", [pytest.param(i, id=_name(i)) for i in OPTIM_DB if i.has_capturable_arg])
def test_capturable_is_refused(dev: Any, info: Any) -> None:
    """optim_db's capturable configs (``has_capturable_arg``): CUDA-graph capture of a step that runs on the host
    cannot be; refused when the optimizer is made, nothing left held."""
    model = make_model(info.optim_cls, dev, offload=True)
    with dev:
        try:
            with pytest.raises(ConfigurationError, match="capturable"):
                opt = offcore_torch.OffloadOptimizer(model.parameters(), info.optim_cls, device=dev, capturable=True)
                loss_of(model, 0).backward()
                opt.step()
        finally:
            with contextlib.suppress(NameError):
                opt.close()
    assert_nothing_left(dev)


def test_named_parameters_are_accepted_as_torch_does(dev: Any) -> None:
    """torch optimizers take ``model.named_parameters()`` (``param_names`` in the state dict's groups);
    OffloadOptimizer takes them too: the same state dict as torch's, bit for bit, names included, and it
    loads into torch's optimizer over named parameters."""
    cls = torch.optim.AdamW
    dicts = []
    for offload in (False, True):
        model = make_model(cls, dev, offload=True) if offload else build(cls)  # the reference: plain CPU tensors
        with dev if offload else contextlib.nullcontext():
            named = list(model.named_parameters())
            opt = offcore_torch.OffloadOptimizer(named, cls, device=dev, lr=0.1) if offload else cls(named, lr=0.1)
            try:
                for step in range(2):
                    loss_of(model, step).backward()
                    opt.step()
                    opt.zero_grad()
                dicts.append(opt.state_dict())
                if offload:
                    opt.load_state_dict(dicts[0])  # torch's own named state dict loads
            finally:
                if offload:
                    opt.close()
    expected, got = dicts
    assert got["param_groups"] == expected["param_groups"]
    assert got["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert_same(got["state"], expected["state"])
    plain = cls(list(build(cls).named_parameters()), lr=0.1)
    plain.load_state_dict(got)
    assert_nothing_left(dev)


@pytest.mark.parametrize("info", [pytest.param(i, id=_name(i)) for i in OPTIM_DB])
def test_errors(dev: Any, info: Any) -> None:
    """test_errors: every error input of optim_db on the CPU. What torch refuses, OffloadOptimizer refuses too:
    with torch's own error (its type and message: the host optimizer validates its arguments) or, where it
    checks first, with a clear OffcoreError; torch's warnings (a duplicate parameter in a group) become an
    OffcoreError or stay the warning; either way nothing is left held."""
    enum = common_optimizers.OptimizerErrorEnum
    for case in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        given = case.optimizer_error_input
        params = given.params
        if params is None:  # torch's kwargs-only cases: any parameter does (2-D for Muon)
            params = [torch.nn.Parameter(torch.randn(2, 3))]
        error: BaseException | None = None
        with dev, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                opt = offcore_torch.OffloadOptimizer(params, info.optim_cls, device=dev, **given.kwargs)
                try:
                    if case.error_on == enum.STEP_ERROR:
                        for slot in opt._slots:
                            slot.param.grad = torch.rand_like(slot.param)
                        opt.step()
                finally:
                    opt.close()
            except Exception as exc:
                error = exc
        assert_nothing_left(dev)
        if isinstance(error, OffcoreError):
            continue  # refused clearly, before torch's own check
        if issubclass(case.error_type, Warning):
            assert error is None and any(
                issubclass(w.category, case.error_type) and re.search(case.error_regex, str(w.message)) for w in warned
            ), (given.desc, error, [str(w.message) for w in warned])
        else:
            assert isinstance(error, case.error_type), (given.desc, error)
            assert re.search(case.error_regex, str(error)), (given.desc, error)


@pytest.mark.parametrize("info", DENSE)
def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing(dev: Any, info: Any) -> None:
    """Optimizer.load_state_dict's checks: a state dict with another number of groups, or a group of another
    size, raises torch's ValueError; the optimizer is left as it was (the next steps are the reference's)."""
    cls, kwargs = info.optim_cls, representative(info)
    other = cls(list(build(cls).parameters()), **kwargs)
    fewer = other.state_dict()  # one group of four parameters (two for Muon), not two groups of two (one)
    swapped = cls(groups_of(build(cls), cls, kwargs)[::-1], **kwargs).state_dict()
    swapped["param_groups"][0]["params"] = swapped["param_groups"][0]["params"][:-1]

    def bad_loads(opt: Any, run: Run) -> None:
        if not isinstance(opt, offcore_torch.OffloadOptimizer):
            return
        with pytest.raises(ValueError, match="different number of parameter groups"):
            opt.load_state_dict(copy.deepcopy(fewer))
        with pytest.raises(ValueError, match="doesn't match the size"):
            opt.load_state_dict(copy.deepcopy(swapped))

    def bad_loads_mid_run(opt: Any, loss: torch.Tensor, run: Run) -> None:
        if len(run.losses) == STEPS // 2:
            bad_loads(opt, run)

    expected = train(cls, kwargs, dev, offload=False)
    got = train(cls, kwargs, dev, on_start=bad_loads, per_step=bad_loads_mid_run)
    assert_runs_equal(got, expected)
