"""offload_parameters: bit-identical to keeping every parameter on the device, in the hard cases.

Every run trains several AdamW steps twice on sanitized fake devices (slow link: copies are
still in flight when compute would read them), once keeping everything on the device and
once with parameters streamed from the host, and compares losses, gradients, parameters and
buffers bit for bit.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from offcore_torch.models import GPTConfig, SmallCNN, TinyGPT, next_token_loss  # noqa: E402
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402
from offcore_torch.parameters.tensors import OffloadedParameter  # noqa: E402
from offload_helpers import BadBatch, backward_raises_after  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import offcore  # noqa: E402

LossFn = Callable[[nn.Module, int], torch.Tensor]


@dataclass
class Run:
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: list[torch.Tensor] = field(default_factory=list)
    stats: Any = None  # before handle.remove()
    removed_stats: Any = None  # after it (remove() writes back every device copy that changed)


def train(
    dev: Any,
    build: Callable[[], nn.Module],
    loss_fn: LossFn,
    *,
    offload: bool,
    steps: int = 3,
    between: Callable[[nn.Module, int], torch.Tensor | None] | None = None,
    **options: Any,
) -> Run:
    run = Run()
    with dev:
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        handle = offload_parameters(model, dev, **options) if offload else None
        torch.manual_seed(1)
        for step in range(steps):
            loss = loss_fn(model, step)
            loss.backward()
            run.grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            run.losses.append(loss.detach().clone())
            if between is not None:
                out = between(model, step)
                if out is not None:
                    run.extra.append(out.detach().clone())
        if handle is not None:
            run.stats = handle.stats()
            handle.remove()
            run.removed_stats = handle.stats()
        run.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def assert_identical(got: Run, want: Run) -> None:
    assert len(got.losses) == len(want.losses)
    for step, (a, b) in enumerate(zip(got.losses, want.losses, strict=True)):
        assert torch.equal(a, b), f"loss of step {step}: {a.item()!r} != {b.item()!r}"
    for step, (ga, gb) in enumerate(zip(got.grads, want.grads, strict=True)):
        for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
            assert (a is None) == (b is None), f"step {step} grad {i}: one is None"
            assert a is None or torch.equal(a, b), f"step {step}: gradient {i} differs"
    assert got.state.keys() == want.state.keys()
    for key in want.state:
        assert torch.equal(got.state[key], want.state[key]), f"{key} differs after training"
    for i, (a, b) in enumerate(zip(got.extra, want.extra, strict=True)):
        assert torch.equal(a, b), f"extra output {i} differs"


def compare(make_fake_device: Any, build: Callable[[], nn.Module], loss_fn: LossFn, **kwargs: Any) -> Run:
    want = train(make_fake_device(), build, loss_fn, offload=False, **kwargs)
    got = train(make_fake_device(link="slow"), build, loss_fn, offload=True, **kwargs)
    assert_identical(got, want)
    return got


# ---------------------------------------------------------------------------- models
def _tokens(step: int, vocab: int = 64, batch: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _gpt(checkpoint_blocks: bool = False, dropout: float = 0.1) -> Callable[[], nn.Module]:
    cfg = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, dropout=dropout)
    return lambda: TinyGPT(cfg, seed=0, checkpoint_blocks=checkpoint_blocks)


def _gpt_loss(model: nn.Module, step: int) -> torch.Tensor:
    idx, targets = _tokens(step)
    return next_token_loss(model(idx), targets)


def _regression(step: int, d_in: int = 32, d_out: int = 8, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_out, generator=gen)


class Twice(nn.Module):
    """One Linear called twice in one forward (its parameters are needed twice in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 48)
        self.mid = nn.Linear(48, 48)
        self.out = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.mid(x))
        x = torch.tanh(self.mid(x))
        return self.out(x)


class Shared(nn.Module):
    """A submodule registered under two names (and a third module in between)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 48)
        self.block = nn.Sequential(nn.Linear(48, 48), nn.GELU())
        self.other = nn.Linear(48, 48)
        self.again = self.block
        self.out = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.again(self.other(self.block(self.inp(x)))))


class Reentrant(nn.Module):
    """Blocks recomputed by the reentrant torch.utils.checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 48)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(48, 48), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.out(x)


def _mse(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _regression(step)
    return F.mse_loss(model(x), y)


def _cnn_loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    images = torch.randn(8, 3, 16, 16, generator=gen)
    labels = torch.randint(0, 10, (8,), generator=gen)
    return F.cross_entropy(model(images), labels)


# ---------------------------------------------------------------------------- the hard cases
def test_tinygpt_tied_embedding_and_head(make_fake_device: Any) -> None:
    run = compare(make_fake_device, _gpt(), _gpt_loss)
    assert run.stats.h2d_copies > 0 and run.stats.host_bytes["parameter"] > 0


def test_module_called_twice(make_fake_device: Any) -> None:
    compare(make_fake_device, Twice, _mse)


def test_shared_submodule(make_fake_device: Any) -> None:
    compare(make_fake_device, Shared, _mse)


def test_weight_used_outside_its_module(make_fake_device: Any) -> None:
    def loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = _regression(step)
        return F.mse_loss(model(x), y) + 1e-3 * model.out.weight.square().sum() + model.inp.bias.abs().sum()

    run = compare(make_fake_device, Twice, loss)
    assert run.stats.outside_fetches > 0


def test_batchnorm_buffers_updated_in_forward(make_fake_device: Any) -> None:
    run = compare(make_fake_device, lambda: SmallCNN(3, 8, 10, seed=0), _cnn_loss, buffers=True)
    assert run.stats.host_bytes["buffer"] > 0
    # the running statistics were written back: when a step frees the module's device copy, or at the
    # latest by remove() (whether a step frees it depends on how prefetches interleave with the step)
    assert run.removed_stats.d2h_copies > 0


def test_batchnorm_buffers_left_on_device(make_fake_device: Any) -> None:
    run = compare(make_fake_device, lambda: SmallCNN(3, 8, 10, seed=0), _cnn_loss)
    assert run.stats.host_bytes["buffer"] == 0


def test_checkpoint_non_reentrant_recomputation(make_fake_device: Any) -> None:
    compare(make_fake_device, _gpt(checkpoint_blocks=True, dropout=0.0), _gpt_loss)


def test_checkpoint_reentrant_recomputation(make_fake_device: Any) -> None:
    compare(make_fake_device, Reentrant, _mse)


def test_no_grad_eval_steps_and_eval_train(make_fake_device: Any) -> None:
    def evaluate(model: nn.Module, step: int) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            out = _gpt_loss(model, 100 + step)
        if step == 1:  # an eval-mode step with gradients (dropout off), then back to training
            _gpt_loss(model, 200).backward()
            model.zero_grad()
        model.train()
        return out

    run = compare(make_fake_device, _gpt(), _gpt_loss, steps=4, between=evaluate)
    assert run.stats.steps >= 8


def test_cnn_eval_mode_uses_running_statistics(make_fake_device: Any) -> None:
    def evaluate(model: nn.Module, step: int) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            out = _cnn_loss(model, 50 + step)
        model.train()
        return out

    compare(make_fake_device, lambda: SmallCNN(3, 8, 10, seed=0), _cnn_loss, buffers=True, between=evaluate)


from hf_models import small_causal_lm, transformers  # noqa: E402


def _hf(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return small_causal_lm(name)

    return build


def _hf_loss(model: nn.Module, step: int) -> torch.Tensor:
    idx, _ = _tokens(step)
    return model(input_ids=idx, labels=idx, use_cache=False).loss


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models(make_fake_device: Any, name: str) -> None:
    compare(make_fake_device, _hf(name), _hf_loss, buffers=True)


# ---------------------------------------------------------------------------- memory
def _wide_mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)], nn.Linear(256, 8))


def _peak_of_step(dev: Any, model: nn.Module, step: int) -> int:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step))
    model.zero_grad(set_to_none=True)
    dev.reset_peak_memory_stats()
    model(x).square().mean().backward()
    return dev.memory_stats().peak_allocated_bytes


def test_device_peak_is_budget_plus_one_module(make_fake_device: Any) -> None:
    """Forward + backward on the device's own accounting: keep-all holds every parameter, offload at most
    the budget ahead of use plus the module in use."""
    dev_keep, dev_off = make_fake_device(), make_fake_device(link="slow")
    with dev_keep:
        torch.manual_seed(0)
        model = _wide_mlp()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        keep = max(_peak_of_step(dev_keep, model, s) for s in range(3))
    with dev_off:
        torch.manual_seed(0)
        model = _wide_mlp()
        largest = 256 * 256 * 4 + 256 * 4
        handle = offload_parameters(model, dev_off, budget=largest)
        peaks = [_peak_of_step(dev_off, model, s) for s in range(3)]
        stats = handle.stats()
        assert stats.peak_device_bytes <= handle.budget + handle.largest_module_bytes
        # keep-all's peak holds every parameter; offload's at most the budget and the module in use
        assert max(peaks) <= keep - params + handle.budget + handle.largest_module_bytes
        assert max(peaks) < keep - params // 2
        handle.remove()


def test_budget_as_fraction_and_bytes(make_fake_device: Any) -> None:
    dev = make_fake_device(capacity="64MiB")
    with dev:
        model = _wide_mlp()
        handle = offload_parameters(model, dev, budget=0.01)
        assert handle.budget == int(0.01 * 64 * 1024**2)
        handle.remove()
        handle = offload_parameters(model, dev, budget="1MiB")
        assert handle.budget == 1024**2
        handle.remove()


# ---------------------------------------------------------------------------- leaks, errors, remove
class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.fail and i == 2:
                raise RuntimeError("boom")
        return x


def test_no_leak_after_an_exception_mid_forward(make_fake_device: Any) -> None:
    def steps(dev: Any, offload: bool, fail: bool) -> list[torch.Tensor]:
        with dev:
            torch.manual_seed(0)
            model = Faulty()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            handle = offload_parameters(model, dev) if offload else None
            out = []
            for step in range(3):
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
                if fail and step == 1:
                    assert handle is not None
                    handle.release()  # the next step's copies, started at the end of backward, go too
                    before = dev.memory_stats().allocated_bytes
                    model.fail = True
                    with pytest.raises(RuntimeError, match="boom"):
                        model(x).sum().backward()
                    model.fail = False
                    gc.collect()
                    assert dev.memory_stats().allocated_bytes == before  # nothing of the failed step stays
                    assert handle.stats().device_bytes == 0
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach().clone())
            if handle is not None:
                handle.remove()
            out += [p.detach().clone() for p in model.parameters()]
            return out

    want = steps(make_fake_device(), False, False)
    got = steps(make_fake_device(link="slow"), True, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_no_leak_after_an_exception_mid_backward(make_fake_device: Any) -> None:
    """Note [A backward that raised leaves its task behind]: the copies a backward that raised had fetched
    were kept for its end, which never came -- device memory held until remove()."""

    def steps(dev: Any, offload: bool, fail: bool) -> list[torch.Tensor]:
        with dev:
            model = _gpt(dropout=0.0)()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            handle = offload_parameters(model, dev) if offload else None
            out = []
            for step in range(3):
                if fail and step == 1:
                    assert handle is not None
                    with backward_raises_after(model.blocks[0]), pytest.raises(BadBatch):
                        _gpt_loss(model, 1000).backward()  # the head's and the tied embedding's copies fetched
                    opt.zero_grad()
                    gc.collect()
                loss = _gpt_loss(model, step)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach().clone())
                if fail and step == 1:
                    assert handle is not None
                    handle.release()
                    assert handle.stats().device_bytes == 0  # was the tied embedding's copy, kept for good
            if handle is not None:
                handle.remove()
            out += [p.detach().clone() for p in model.parameters()]
            return out

    want = steps(make_fake_device(), False, False)
    got = steps(make_fake_device(link="slow"), True, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_remove_restores_everything_bit_identically(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = TinyGPT(GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16), seed=0)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        params = list(model.parameters())
        allocated = dev.memory_stats().allocated_bytes
        handle = offload_parameters(model, dev, buffers=True)
        assert all(type(p) is OffloadedParameter for p in model.parameters())
        assert dev.memory_stats().allocated_bytes < allocated
        with torch.no_grad():
            _gpt_loss(model, 0)
        handle.remove()
        assert dev.memory_stats().allocated_bytes == allocated
        assert list(model.parameters()) == params and all(type(p) is nn.Parameter for p in params)
        assert model.lm_head.weight is model.tok_emb.weight
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key


def test_state_dict_and_load_state_dict_while_offloaded(make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        model = Twice()
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        handle = offload_parameters(model, dev)
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert all(torch.equal(got[k], want[k]) for k in want)
        new = {k: v + 1 for k, v in want.items()}
        model.load_state_dict(new)
        handle.release()  # the changed copies are written back to the host, then freed
        assert handle.stats().device_bytes == 0
        handle.remove()
        assert all(torch.equal(model.state_dict()[k], new[k]) for k in new)


def test_clear_errors(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with pytest.raises(offcore.ConfigurationError, match="nn.Module"):
        offload_parameters("model", dev)  # type: ignore[arg-type]
    meta_model = nn.Linear(4, 4, device="meta")
    with pytest.raises(offcore.ConfigurationError, match="neither in the device's memory nor on the host"):
        offload_parameters(meta_model, dev)
    assert type(meta_model.weight) is nn.Parameter
    with dev:
        model = nn.Linear(16, 16)
        with pytest.raises(offcore.ConfigurationError, match="prefetch"):
            offload_parameters(model, dev, prefetch="sometimes")
        with pytest.raises(offcore.ConfigurationError):
            offload_parameters(model, dev, budget="lots")
        handle = offload_parameters(model, dev)
        with pytest.raises(offcore.ConfigurationError, match="already"):
            offload_parameters(model, dev)
        with pytest.raises(offcore.ConfigurationError, match="remove"):
            model.weight.data = torch.zeros(16, 16)
        handle.remove()


def test_with_activation_offload(make_fake_device: Any) -> None:
    """Parameters streamed and saved activations offloaded in the same steps: still bit-identical."""
    import offcore_torch

    def train_both(dev: Any, offload: bool) -> list[torch.Tensor]:
        with dev:
            torch.manual_seed(0)
            model = _gpt(dropout=0.0)()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            handle = offload_parameters(model, dev) if offload else None
            out = []
            for step in range(3):
                if offload:
                    with offcore_torch.offload_activations(dev, min_bytes="1KiB") as region:
                        loss = _gpt_loss(model, step)
                else:
                    loss = _gpt_loss(model, step)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach().clone())
            if handle is not None:
                assert region.stats().offloaded_bytes > 0
                handle.remove()
            return out + [p.detach().clone() for p in model.parameters()]

    want = train_both(make_fake_device(), False)
    got = train_both(make_fake_device(link="slow"), True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_model_built_on_the_host_never_fits_the_device_whole(make_fake_device: Any) -> None:
    """A model larger than the device, built on the host: its parameters go straight to pinned memory and
    train as the same model built on the device would."""
    dev = make_fake_device(capacity="3MiB", link="slow")
    torch.manual_seed(0)
    model = _wide_mlp()  # host memory, 2.1 MiB of parameters: with gradients it could not train on 3 MiB
    reference = _wide_mlp()
    reference.load_state_dict(model.state_dict())
    with dev:
        handle = offload_parameters(model, dev, budget="300KiB")
        assert dev.memory_stats().allocated_bytes == 0
        assert dev.memory_stats().peak_allocated_bytes <= handle.largest_module_bytes
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
        loss = model(x).square().mean()
        loss.backward()
    want = reference(x).square().mean()
    want.backward()
    assert torch.equal(loss, want)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with dev:
        for p in model.parameters():
            p.grad = None
        handle.remove()  # everything back on the device: fits without the gradients
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
