"""offload_parameters with OffloadOptimizer: parameters streamed, optimizer on the host, bit-identical.

By default the optimizer finds the handle on the parameters (``params_on_host=None``) and works on
its host copies (Note [Parameters on the host with offload_parameters] in optimizer.py): the masters
are the handle's host copies (no read from the device), the host step updates them in place, no
upload after the step, and the next forward streams them in. ``params_on_host=False`` keeps the
public-API composition (one upload and one write-back per parameter per step), still bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from hf_models import small_causal_lm, transformers  # noqa: E402
from offcore_torch.models import GPTConfig, TinyGPT, mlp_workload, next_token_loss  # noqa: E402
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402
from offload_helpers import BadBatch, backward_raises_after  # noqa: E402

import offcore  # noqa: E402
from offcore.errors import ConfigurationError  # noqa: E402

OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
    "adamw-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-1, "momentum": 0.9, "nesterov": True}),
}


def _tiny_gpt() -> torch.nn.Module:
    return TinyGPT(GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, dropout=0.0), seed=0)


def _gpt2() -> torch.nn.Module:
    return small_causal_lm("gpt2")


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    tokens = _tokens(step)
    if isinstance(model, TinyGPT):
        return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
    idx = tokens[:, :-1]
    return model(input_ids=idx, labels=idx, use_cache=False).loss


def _train(
    dev: Any,
    build: Callable[[], torch.nn.Module],
    *,
    offload: bool,
    optimizer: str = "adamw",
    activations: bool = False,
    bf16: bool = False,
    params_on_host: Any = None,
    steps: int = 4,
    accumulation_steps: int | None = None,
    offload_kwargs: dict[str, Any] | None = None,
    backward_raises_at: int | None = None,
) -> list[torch.Tensor]:
    cls, kwargs = OPTIMIZERS[optimizer]
    with dev:
        torch.manual_seed(0)
        model = build()
        if bf16:
            model = model.to(torch.bfloat16)
        handle = offload_parameters(model, dev, **(offload_kwargs or {})) if offload else None
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(),
            cls,
            device=dev,
            master_weights=bf16,
            params_on_host=params_on_host,
            accumulation_steps=accumulation_steps,
            **kwargs,
        )
        out = []
        for step in range(steps):
            if step == backward_raises_at:
                _backward_that_raises(model, step)
                opt.zero_grad()  # the loop drops the bad batch and goes on
            if activations:
                with offcore_torch.offload_activations(dev, min_bytes="1KiB"):
                    loss = _loss(model, step)
            else:
                loss = _loss(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach().float().clone())
            if handle is not None and params_on_host is None:
                # nothing uploaded after the step, none written back; between steps the device holds only
                # the next step's first copies, started after the host step (within the budget)
                assert handle.stats().device_bytes <= handle.budget
                assert handle.stats().d2h_copies == 0
        opt.synchronize()  # the keep-all reference's last upload has landed
        masters = [opt.master(p).clone() for p in model.parameters()]
        states = [
            v.clone()
            for p in model.parameters()
            for _, v in sorted(opt.state[opt.master(p)].items())
            if isinstance(v, torch.Tensor)
        ]
        if handle is not None:
            handle.remove()
        opt.close()
        return out + [p.detach().clone() for p in model.parameters()] + masters + states


def _backward_that_raises(model: torch.nn.Module, step: int) -> None:
    """A bad batch whose backward raises halfway: after the head's gradients (the tied embedding's copy was
    fetched for them), before the first block's."""
    with backward_raises_after(model.blocks[len(model.blocks) // 2]), contextlib.suppress(BadBatch):
        _loss(model, 1000 + step).backward()


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("params_on_host", [None, False], ids=["host-copies", "own-masters"])
def test_a_backward_that_raised_leaves_no_stale_parameter(make_fake_device: Any, params_on_host: Any) -> None:
    """Note [A backward that raised leaves its task behind]: the copies the failed backward fetched were kept
    for its end, which never came, and the step after it read the tied embedding's pre-step copy."""
    want = _train(make_fake_device(), _tiny_gpt, offload=True, params_on_host=params_on_host)
    got = _train(make_fake_device(), _tiny_gpt, offload=True, params_on_host=params_on_host, backward_raises_at=1)
    _same(got, want)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("activations", [False, True], ids=["params", "params+activations"])
def test_bit_identical_tiny_gpt(make_fake_device: Any, optimizer: str, activations: bool) -> None:
    want = _train(make_fake_device(), _tiny_gpt, offload=False, optimizer=optimizer)
    got = _train(make_fake_device(link="slow"), _tiny_gpt, offload=True, optimizer=optimizer, activations=activations)
    _same(got, want)


def test_bit_identical_bf16_master_weights(make_fake_device: Any) -> None:
    """bf16 device parameters, fp32 masters: the master is stepped and the bf16 host copy written from it."""
    want = _train(make_fake_device(), _tiny_gpt, offload=False, bf16=True)
    got = _train(make_fake_device(link="slow"), _tiny_gpt, offload=True, bf16=True, activations=True)
    _same(got, want)


def test_public_api_composition_still_bit_identical(make_fake_device: Any) -> None:
    want = _train(make_fake_device(), _tiny_gpt, offload=False, steps=3)
    got = _train(make_fake_device(link="slow"), _tiny_gpt, offload=True, params_on_host=False, steps=3)
    _same(got, want)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_public_api_composition_with_host_steps_under_backward(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, tier: str
) -> None:
    """params_on_host=False with accumulation_steps=1: the host steps run on the worker under backward,
    but the uploads of streamed parameters are issued on the caller's thread (Note [Streamed parameters
    are written by the caller]). Issued by the worker they raced the handle's own copies: a copy into a
    storage just freed, a prefetch started twice (found by tests/torch/test_offload_combinations.py, with
    parameters on NVMe, about one run in two)."""
    import threading

    import offcore_torch.optimizer.optimizer as optimizer_module

    threads: list[threading.Thread] = []
    copy_uploads = optimizer_module.OffloadOptimizer._copy_uploads  # every upload goes through it, once

    def spy(self: Any, slots: Any, *args: Any) -> Any:
        threads.extend(threading.current_thread() for _ in slots)
        return copy_uploads(self, slots, *args)

    options: dict[str, Any] = dict(steps=3, accumulation_steps=1, bf16=True)
    want = _train(make_fake_device(), _tiny_gpt, offload=False, **options)
    monkeypatch.setattr(optimizer_module.OffloadOptimizer, "_copy_uploads", spy)
    offload_kwargs = {"nvme": str(tmp_path)} if tier == "nvme" else {}
    for _ in range(3):  # the race showed about one run in two
        got = _train(
            make_fake_device(link="slow"),
            _tiny_gpt,
            offload=True,
            params_on_host=False,
            offload_kwargs=offload_kwargs,
            **options,
        )
        _same(got, want)
    assert threads and all(t is threading.main_thread() for t in threads), {t.name for t in threads}


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-momentum"])
def test_bit_identical_hf_gpt2(make_fake_device: Any, optimizer: str) -> None:
    want = _train(make_fake_device(), _gpt2, offload=False, optimizer=optimizer, steps=3)
    got = _train(make_fake_device(link="slow"), _gpt2, offload=True, optimizer=optimizer, activations=True, steps=3)
    _same(got, want)


def test_step_holds_no_parameter_on_the_device(make_fake_device: Any) -> None:
    """Device peak, measured by the backend: the step allocates nothing beyond the budget (no upload;
    only the next step's first copies, Note [The next step starts early]); the public-API
    composition's step brings every parameter in at once."""

    def peak_of_steps(params_on_host: Any) -> tuple[int, int, int]:
        dev = make_fake_device(link="slow")
        with dev:
            torch.manual_seed(0)
            model = _tiny_gpt()
            handle = offload_parameters(model, dev)
            opt = offcore_torch.OffloadOptimizer(
                model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2, params_on_host=params_on_host
            )
            step_growth = 0
            for step in range(3):
                _loss(model, step).backward()
                opt.synchronize()
                before = dev.memory_stats().allocated_bytes
                dev.reset_peak_memory_stats()
                opt.step()
                opt.zero_grad()
                step_growth = max(step_growth, dev.memory_stats().peak_allocated_bytes - before)
            peak = handle.stats().peak_device_bytes
            budget_bound = handle.budget + 2 * handle.largest_module_bytes  # nested modules: two in use
            step_growth -= handle.budget if params_on_host is None else 0
            handle.remove()
            opt.close()
            return step_growth, peak, budget_bound

    growth, peak, bound = peak_of_steps(None)
    assert growth <= 0  # beyond the budget
    assert peak <= bound
    growth_public, _, _ = peak_of_steps(False)
    params = sum(p.numel() * p.element_size() for p in _tiny_gpt().parameters())
    assert growth_public >= params // 2  # the public-API path uploads every parameter into the device


def test_params_on_host_misuse(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with dev:
        model = _tiny_gpt()
        other = _tiny_gpt()
        with pytest.raises(ConfigurationError, match="params_on_host"):
            offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1, params_on_host=1)
        with pytest.raises(ConfigurationError, match="no parameter is offloaded"):
            offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1, params_on_host=True)
        handle = offload_parameters(model, dev)
        handle2 = offload_parameters(other, dev)
        with pytest.raises(ConfigurationError, match="another handle"):
            offcore_torch.OffloadOptimizer(
                list(model.parameters()) + list(other.parameters()),
                torch.optim.SGD,
                device=dev,
                lr=0.1,
                params_on_host=handle,
            )
        handle2.remove()
        handle.remove()


@pytest.mark.parametrize("handle", [False, True], ids=["params-on-device", "offload_parameters"])
@pytest.mark.parametrize("under_backward", [False, True], ids=["steps-at-step", "steps-under-backward"])
def test_two_offload_optimizers_over_one_model(make_fake_device: Any, handle: bool, under_backward: bool) -> None:
    """Two OffloadOptimizers on one device (the blocks with AdamW, the rest with SGD and momentum, as a user
    gives modules their own optimizer), with activation offload and a slow link: bit-identical to the same two
    torch optimizers without offload. They share the device's streams and pools and, with a handle, both step
    its host copies."""

    def train(dev: Any, offload: bool) -> list[torch.Tensor]:
        with dev:
            model = _tiny_gpt()
            params_handle = offload_parameters(model, dev) if offload and handle else None
            blocks = [p for n, p in model.named_parameters() if n.startswith("blocks")]
            rest = [p for n, p in model.named_parameters() if not n.startswith("blocks")]
            if offload:
                first: Any = offcore_torch.OffloadOptimizer(
                    blocks, torch.optim.AdamW, device=dev, lr=1e-2, accumulation_steps=1 if under_backward else None
                )
                second: Any = offcore_torch.OffloadOptimizer(rest, torch.optim.SGD, device=dev, lr=1e-1, momentum=0.9)
            else:
                first, second = torch.optim.AdamW(blocks, lr=1e-2), torch.optim.SGD(rest, lr=1e-1, momentum=0.9)
            out = []
            for step in range(3):
                if offload:
                    with offcore_torch.offload_activations(dev, min_bytes="1KiB"):
                        loss = _loss(model, step)
                else:
                    loss = _loss(model, step)
                loss.backward()
                first.step()
                second.step()
                first.zero_grad()
                second.zero_grad()
                out.append(loss.detach().clone())
            if offload:
                first.synchronize()
                second.synchronize()
            out += [p.detach().clone() for p in model.parameters()]
            if params_handle is not None:
                params_handle.remove()
            if offload:
                first.close()
                second.close()
            return out

    _same(train(make_fake_device(link="slow"), True), train(make_fake_device(), False))


def _adam_steps(opt: Any) -> list[int]:
    return [int(opt.state[m]["step"]) if m in opt.state else 0 for g in opt.param_groups for m in g["params"]]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::offcore.errors.OffcoreWarning")  # a recovered prefetch says so
def test_a_copy_refused_during_step_means_the_step_was_not_applied(make_fake_device: Any) -> None:
    """Each copy step() issues is refused at submission in turn. step() either succeeds, or raises having
    applied nothing (a retry is then the one update). It raised the next round's parameter prefetch, which
    step() starts once the update was applied, so a retry updated twice (Note [A prefetch refused at
    submission is not an error of the caller's])."""
    for nth in range(1, 40):
        dev = make_fake_device(link="slow")
        work = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=4)
        with dev:
            model = dev.adopt(work.build(0))
            handle = offload_parameters(model, dev)
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)
            for step in range(2):
                work.loss(model, work.make_batch(step, torch.device("cpu"))).backward()
                if step == 1:
                    dev.inject_copy_fault(nth, mode="submit")
                before = _adam_steps(opt)
                try:
                    opt.step()
                except offcore.OffcoreError:
                    assert _adam_steps(opt) == before, f"copy {nth} of step(): raised after applying the update"
                    opt.step()  # the retry applies it once
                assert _adam_steps(opt) == [s + 1 for s in before]
                opt.zero_grad()
            armed = dev.copy_fault_armed
            dev.inject_copy_fault(None)
            opt.close()
            handle.remove()
        if armed:  # step() issued fewer copies than nth: every one of them was tried
            break
    else:
        pytest.fail("step() issued more copies than the test tried")
    assert nth > 2, "step() issued no copy to refuse"
