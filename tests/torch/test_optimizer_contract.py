"""OffloadOptimizer keeps torch.optim's contracts, as the training stacks rely on them (sanitized fake device).

Each test runs a loop the way Trainer / accelerate / Lightning drive a torch optimizer, once with
``torch.optim.AdamW`` on a plain CPU copy of the model and once with ``OffloadOptimizer`` over the
same model on the fake device, and compares with ``torch.equal``:

- a parameter read right after ``step(); zero_grad()`` (an EMA update, a logged weight norm,
  ``torch.func.functional_call``) is the stepped one (Note [Parameters read after step() are the stepped
  ones]);
- when ``backward()`` returns, every gradient is in ``param_groups`` and final, and the device parameter's
  ``.grad`` reads the same values (Note [Gradients are final when backward returns]);
- ``model.zero_grad()`` / ``p.grad = None`` / ``opt.zero_grad()`` end a gradient round alike, and
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` returns torch's norm and clips what the step
  uses (Note [The host gradient is the device parameter's .grad]);
- accumulation and a state_dict round trip resume exactly.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import place  # noqa: E402

import offcore  # noqa: E402

MLP = mlp_workload(d_in=16, width=64, depth=3, d_out=8, batch_size=8)
CPU = torch.device("cpu")
KWARGS: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}


def _loss(model: torch.nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    return MLP.loss(model, MLP.make_batch(10 * step + micro, CPU))


def _pair(dev: Any, **opt_kwargs: Any) -> tuple[torch.nn.Module, Any, torch.nn.Module, Any]:
    """(plain model, torch AdamW, model on ``dev``, OffloadOptimizer): the same initial weights (inside ``with dev:``)."""
    base = MLP.build(0)
    plain = copy.deepcopy(base)
    model = place(base, dev)
    ref = torch.optim.AdamW(plain.parameters(), **KWARGS)
    opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, **opt_kwargs, **KWARGS)
    return plain, ref, model, opt


@contextlib.contextmanager
def _paired(make_fake_device: Any, **device_options: Any) -> Iterator[tuple[Any, ...]]:
    """A sanitized fake device, entered, and :func:`_pair` on it: ``(dev, plain, ref, model, opt)``; ``opt`` is
    closed at the end."""
    dev = make_fake_device(sanitize=True, **device_options)
    with dev:
        plain, ref, model, opt = _pair(dev)
        try:
            yield dev, plain, ref, model, opt
        finally:
            opt.close()


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_parameters_read_right_after_step_are_the_stepped_ones(make_fake_device: Any) -> None:
    """EMA, weight norm and functional_call right after ``opt.step(); opt.zero_grad()``, no synchronize()."""
    with _paired(make_fake_device, link="slow") as (dev, plain, ref, model, opt):
        runs: dict[str, list[Any]] = {}
        for name, net, optimizer in (("plain", plain, ref), ("offcore", model, opt)):
            ema = [p.detach().clone() for p in net.parameters()]
            seen: list[Any] = []
            for step in range(3):
                _loss(net, step).backward()
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():
                    for e, p in zip(ema, net.parameters(), strict=True):
                        e.mul_(0.9).add_(p, alpha=0.1)
                    seen.append(torch.stack([p.norm() for p in net.parameters()]))
                    params = {k: v.detach().clone() for k, v in net.named_parameters()}
                    seen.append(torch.func.functional_call(net, params, (MLP.make_batch(99, CPU)[0],)))
            runs[name] = [*ema, *seen]
        assert _equal(runs["plain"], runs["offcore"])


def test_gradients_are_present_and_final_when_backward_returns(make_fake_device: Any) -> None:
    """What Lightning's gradient clipping reads right after ``loss.backward()``: every master's ``.grad`` in
    ``param_groups``, and each device parameter's ``.grad``, hold the round's sum (copies on a slow link)."""
    with _paired(make_fake_device, link="slow") as (dev, plain, ref, model, opt):
        for step in range(3):
            for micro in range(2):
                _loss(plain, step, micro).backward()
                _loss(model, step, micro).backward()
                expected = [p.grad.clone() for p in plain.parameters()]
                masters = [p for group in opt.param_groups for p in group["params"]]
                assert all(m.grad is not None for m in masters)
                assert _equal([m.grad.clone() for m in masters], expected)
                assert _equal([p.grad for p in model.parameters()], expected)
            ref.step()
            opt.step()
            ref.zero_grad()
            opt.zero_grad()
        assert _equal(list(model.parameters()), list(plain.parameters()))


def _clear_model(net: torch.nn.Module) -> None:
    net.zero_grad()


def _clear_model_to_zero(net: torch.nn.Module) -> None:
    net.zero_grad(set_to_none=False)


def _clear_each(net: torch.nn.Module) -> None:
    for p in net.parameters():
        p.grad = None


@pytest.mark.parametrize("clear", [_clear_model, _clear_model_to_zero, _clear_each], ids=["model", "to_zero", "each"])
def test_model_zero_grad_ends_a_round_as_with_torch(make_fake_device: Any, clear: Callable[..., None]) -> None:
    """Trainer's loop: two micro-steps, ``torch.nn.utils.clip_grad_norm_(model.parameters())``, ``step()``,
    then ``model.zero_grad()`` (or ``p.grad = None``) -- never ``opt.zero_grad()``. The norms returned and
    the parameters after each step are torch's."""
    with _paired(make_fake_device) as (dev, plain, ref, model, opt):
        norms: dict[str, list[torch.Tensor]] = {"plain": [], "offcore": []}
        for name, net, optimizer in (("plain", plain, ref), ("offcore", model, opt)):
            for step in range(4):
                for micro in range(2):
                    _loss(net, step, micro).backward()
                norms[name].append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.05))
                optimizer.step()
                clear(net)
        assert _equal(norms["plain"], norms["offcore"])
        assert all(n > 0.05 for n in norms["plain"])  # every step clipped
        assert _equal(list(model.parameters()), list(plain.parameters()))


def test_gradients_kept_without_any_zero_grad_add_up_as_with_torch(make_fake_device: Any) -> None:
    """No clearing at all between steps: torch adds the next backward into the ``.grad`` the step used."""
    with _paired(make_fake_device) as (dev, plain, ref, model, opt):
        for step in range(3):
            for net, optimizer in ((plain, ref), (model, opt)):
                _loss(net, step).backward()
                optimizer.step()
        assert _equal([p.grad for p in model.parameters()], [p.grad for p in plain.parameters()])
        assert _equal(list(model.parameters()), list(plain.parameters()))


def test_clipping_over_param_groups_and_a_state_dict_round_trip(make_fake_device: Any) -> None:
    """Lightning's clipping (over ``optimizer.param_groups``' params) and a checkpoint: 2 steps, save, a new
    optimizer loads it, 2 more steps -- the same as 4 uninterrupted steps of torch's AdamW."""
    with _paired(make_fake_device) as (dev, plain, ref, model, opt), contextlib.ExitStack() as stack:
        norms: dict[str, list[torch.Tensor]] = {"plain": [], "offcore": []}
        for name, net, optimizer in (("plain", plain, ref), ("offcore", model, opt)):
            for step in range(4):
                if name == "offcore" and step == 2:
                    saved = opt.state_dict()
                    opt.close()
                    resumed = offcore_torch.OffloadOptimizer(
                        model.parameters(), torch.optim.AdamW, device=dev, **KWARGS
                    )
                    optimizer = stack.enter_context(contextlib.closing(resumed))
                    optimizer.load_state_dict(saved)
                _loss(net, step).backward()
                params = [p for group in optimizer.param_groups for p in group["params"]]
                norms[name].append(torch.nn.utils.clip_grad_norm_(params, max_norm=0.05))
                optimizer.step()
                optimizer.zero_grad()
        assert _equal(norms["plain"], norms["offcore"])
        assert _equal(list(model.parameters()), list(plain.parameters()))


def test_a_cleared_gradient_read_later_is_refused(make_fake_device: Any) -> None:
    """A ``.grad`` kept from before ``opt.zero_grad()`` no longer reads host memory the optimizer reuses."""
    with _paired(make_fake_device) as (dev, _, _, model, opt):
        _loss(model, 0).backward()
        kept = next(model.parameters()).grad
        assert kept is not None and float(kept.abs().sum()) > 0
        opt.step()
        opt.zero_grad()
        with pytest.raises(offcore.OffcoreError, match="cleared since"):
            kept.sum()


def test_clip_grad_norm_takes_a_wrapper_holding_the_optimizer(make_fake_device: Any) -> None:
    """accelerate hands its ``AcceleratedOptimizer`` around; ``offcore_torch.clip_grad_norm_`` takes what it wraps."""

    class Wrapper:  # accelerate's AcceleratedOptimizer keeps the optimizer as ``.optimizer``
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

    with _paired(make_fake_device) as (dev, plain, ref, model, opt):
        _loss(plain, 0).backward()
        _loss(model, 0).backward()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm=0.05)
        assert torch.equal(offcore_torch.clip_grad_norm_(Wrapper(opt), 0.05), expected)
        ref.step()
        opt.step()
        assert _equal(list(model.parameters()), list(plain.parameters()))


def test_grads_set_between_backward_and_step_are_what_step_uses(make_fake_device: Any) -> None:
    """``p.grad = None`` for one parameter (frozen for this step) and ``p.grad = t`` for another between
    backward and ``step()``: torch's step skips the first and steps the second with ``t``."""
    with _paired(make_fake_device) as (dev, plain, ref, model, opt):
        for step in range(3):
            for net, optimizer in ((plain, ref), (model, opt)):
                _loss(net, step).backward()
                first, second = list(net.parameters())[:2]
                first.grad = None
                second.grad = torch.full_like(second, 0.5 + step)
                optimizer.step()
                net.zero_grad()
        assert _equal(list(model.parameters()), list(plain.parameters()))


def test_autograd_grad_over_the_parameters_leaves_grad_alone(make_fake_device: Any) -> None:
    """``torch.autograd.grad(loss, model.parameters())`` between backward and clipping (a penalty term, a
    sensitivity) writes no ``.grad`` in torch. The parameters' tensor hooks run for it too, and dropped the shown
    host gradient: ``.grad`` read None, ``clip_grad_norm_(model.parameters())`` returned 0 and clipped nothing."""
    with _paired(make_fake_device) as (dev, plain, ref, model, opt):
        seen: dict[str, list[torch.Tensor]] = {"plain": [], "offcore": []}
        for name, net, optimizer in (("plain", plain, ref), ("offcore", model, opt)):
            for step in range(3):
                _loss(net, step).backward()
                seen[name].extend(torch.autograd.grad(_loss(net, step, micro=1), list(net.parameters())))
                assert all(p.grad is not None for p in net.parameters()), name
                seen[name].extend(p.grad.clone() for p in net.parameters())
                seen[name].append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.05))
                optimizer.step()
                net.zero_grad()
        assert _equal(seen["plain"], seen["offcore"])
        assert all(n > 0.05 for n in seen["plain"][-1:])  # clipped
        assert _equal(list(model.parameters()), list(plain.parameters()))


def test_a_gradient_handed_over_after_step_without_opt_zero_grad_is_refused(make_fake_device: Any) -> None:
    """Gradients handed over with ``accept_gradient`` without the optimizer's hooks (a caller's own hand-over; DDP's
    and FSDP2's are shown by attach_ddp's and FSDPOffloadOptimizer's own hooks) are not shown as ``.grad``, so ``model.zero_grad()`` cannot clear them: a gradient after ``step()`` with no
    ``opt.zero_grad()`` since is refused naming the fix, not added to the last step's sum."""
    with _paired(make_fake_device) as (dev, _, _, model, opt):
        opt.remove_gradient_hooks()
        params = list(model.parameters())

        def hand_over() -> None:
            _loss(model, 0).backward()
            for p in params:
                opt.accept_gradient(p, p.grad)
            opt.synchronize()
            model.zero_grad()

        hand_over()
        opt.step()
        opt.zero_grad()
        hand_over()  # cleared by opt.zero_grad(): taken
        opt.step()
        model.zero_grad()  # cannot reach the host gradients
        with pytest.raises(offcore.OffcoreError, match=r"call opt.zero_grad\(\) after opt.step\(\)"):
            hand_over()


@contextlib.contextmanager
def _stepped_under_backward(make_fake_device: Any) -> Iterator[tuple[torch.nn.Module, Any]]:
    """A model after the two micro-steps' backward of ``accumulation_steps=2``: every host step of the round ran
    under the last backward (Note [A gradient a host step already used is not written]); the optimizer is closed
    after the block."""
    dev = make_fake_device(sanitize=True)
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, accumulation_steps=2, **KWARGS
        )
        try:
            for micro in range(2):
                _loss(model, 0, micro).backward()
            yield model, opt
        finally:
            opt.close()


@pytest.mark.parametrize(
    "write",
    [
        lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01),
        lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, foreach=True),
        lambda model: torch.nn.utils.clip_grad_value_(model.parameters(), 0.001),
        lambda model: next(model.parameters()).grad.zero_(),
    ],
    ids=["clip_norm", "clip_norm_foreach", "clip_value", "zero_"],
)
def test_a_write_to_a_gradient_already_stepped_under_backward_is_refused(
    make_fake_device: Any, write: Callable[[torch.nn.Module], Any]
) -> None:
    """Note [A gradient a host step already used is not written]: with accumulation_steps the host steps run under
    the last backward, so a write to .grad after it (Trainer's clipping) could not change the update: refused,
    never trained on silently. Reading the gradients (a norm for logging) is still allowed."""
    with _stepped_under_backward(make_fake_device) as (model, opt):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        assert float(norm) > 0.01  # a clip to 0.01 would have changed the step
        with pytest.raises(offcore.ConfigurationError, match="accumulation_steps=None"):
            write(model)
        opt.step()
        opt.zero_grad()


def test_a_gradient_cleared_after_it_was_stepped_under_backward_is_refused(make_fake_device: Any) -> None:
    """model.zero_grad() between the last backward and step(): torch would skip those parameters, but their host
    steps already ran under backward, so step() refuses rather than differ silently."""
    with _stepped_under_backward(make_fake_device) as (model, opt):
        model.zero_grad()
        with pytest.raises(offcore.ConfigurationError, match="cleared or replaced after backward"):
            opt.step()
