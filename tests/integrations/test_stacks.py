"""The integration modules one by one, and the stacks used without them.

The examples (test_examples.py) check whole runs; these check the pieces: clipping through accelerate's
wrapper, Lightning's wrapper unwrapped, the Trainer given an ``OffloadOptimizer`` (stock and
``OffloadTrainer``), torchtune's context entered every step.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.integrations import offload_optimizer_of  # noqa: E402

import offcore  # noqa: E402
from offcore.errors import ConfigurationError  # noqa: E402


def device() -> Any:
    return offcore.device(
        "cpu", capacity="256MiB", h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s", latency="100us", sanitize=True
    )


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )


def grads_and_norm(use: str, max_norm: float = 0.05) -> tuple[Any, list[Any]]:
    """One backward and a clip through accelerate: of a torch optimizer's device gradients, or of an
    OffloadOptimizer's host gradients (by accelerator.clip_grad_norm_, or offcore's on the prepared wrapper)."""
    accelerate = pytest.importorskip("accelerate")
    dev = device()
    model = dev.adopt(mlp())
    with dev:
        if use == "torch":
            opt: Any = torch.optim.SGD(model.parameters(), lr=1.0)
        else:
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=1.0)
        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        accelerator.backward(model(x).square().mean())
        if use == "offcore_clip":
            norm = offcore_torch.clip_grad_norm_(opt, max_norm)  # the wrapper is accepted
        else:
            norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        params = [p.clone() for p in model.state_dict().values()]
        inner = offload_optimizer_of(opt)
        if inner is not None:
            inner.close()
    return norm, params


@pytest.mark.parametrize("use", ["accelerator", "offcore_clip"])
def test_accelerate_clipping_is_torchs(use: str) -> None:
    """accelerator.clip_grad_norm_(model.parameters()) and offcore_torch.clip_grad_norm_ on the prepared wrapper."""
    norm, params = grads_and_norm("torch")
    got_norm, got = grads_and_norm(use)
    assert got_norm.item() == norm.item() and norm.item() > 0.05  # it clipped
    assert all(torch.equal(a, b) for a, b in zip(params, got, strict=True))


def test_offload_optimizer_of_unwraps_lightning() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    dev = device()
    with dev:
        model = dev.adopt(mlp())
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=1.0)
        assert offload_optimizer_of(pl.core.optimizer.LightningOptimizer(opt)) is opt
        assert offload_optimizer_of(torch.optim.SGD(model.parameters(), lr=1.0)) is None
        opt.close()


# torchtune 0.6.1's training.OffloadActivations.__init__ (torchtune needs a torchao that peft refuses, so the
# env cannot hold both: the signature is checked against torchtune when it imports, else against this copy)
TORCHTUNE_SIGNATURE = [
    ("use_pin_memory", True),
    ("use_streams", True),
    ("max_fwd_stash_size", 5),
    ("min_offload_size", 1024),
]


def test_torchtune_drop_in_has_torchtunes_signature() -> None:
    from offcore_torch.integrations.torchtune import OffloadActivations

    expected = TORCHTUNE_SIGNATURE
    try:
        from torchtune.training import OffloadActivations as Theirs

        expected = [(p.name, p.default) for p in list(inspect.signature(Theirs.__init__).parameters.values())[1:]]
    except Exception:  # torchtune (or a torchao it accepts) not installed
        pass
    ours = [(p.name, p.default) for p in list(inspect.signature(OffloadActivations.__init__).parameters.values())[1:]]
    assert ours[: len(expected)] == expected


def test_torchtune_context_is_built_once_and_entered_every_step() -> None:
    from offcore_torch.integrations.torchtune import OffloadActivations, get_act_offloading_ctx_manager

    def train(offload: bool) -> tuple[list[float], list[Any], list[int]]:
        dev = device()
        model = dev.adopt(mlp())
        losses, offloaded = [], []
        with dev:
            ctx = get_act_offloading_ctx_manager(model, offload, device=dev)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                with ctx:
                    loss = model(torch.randn(64, 32, generator=g)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if offload:
                    offloaded.append(ctx.stats().offloaded_bytes)
            return losses, [p.clone() for p in model.parameters()], offloaded

    losses, params, _ = train(False)
    got_losses, got, offloaded = train(True)
    assert got_losses == losses and all(torch.equal(a, b) for a, b in zip(params, got, strict=True))
    assert len(offloaded) == 3 and all(b > 0 for b in offloaded)  # each step's region offloaded
    with pytest.raises(ConfigurationError, match="device="):
        OffloadActivations()
    assert isinstance(get_act_offloading_ctx_manager(torch.nn.Linear(1, 1), False), contextlib.nullcontext)


def trainer_run(how: str, **extra: Any) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    import tempfile

    from offcore_torch.integrations.transformers import OffloadTrainer

    dev = device()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = dev.adopt(transformers.GPT2LMHeadModel(cfg))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids} for _ in range(12)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, optim="adamw_torch", **extra,
        )  # fmt: skip
        with dev:
            if how == "torch":
                opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
                trainer: Any = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
            elif how == "plain":  # the stock Trainer given an OffloadOptimizer
                opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)
                trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
            elif how == "stock_default":  # the Trainer's own optimizer
                trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
            elif how == "offload_trainer_default":  # the same, built on the host, activations offloaded
                trainer = OffloadTrainer(
                    model=model, args=args, train_dataset=data, offcore_device=dev, offload_activations={"min_bytes": 0}
                )
                opt = trainer.create_optimizer()
            else:
                opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)
                trainer = OffloadTrainer(
                    model=model, args=args, train_dataset=data, optimizers=(opt, None), offcore_device=dev
                )
            trainer.train()
            if how not in ("torch", "stock_default"):
                assert offload_optimizer_of(trainer.optimizer) is not None
            params = [p.clone() for p in model.state_dict().values()]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"losses": [e["loss"] for e in logs], "norms": [e["grad_norm"] for e in logs], "params": params}


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["losses"] == b["losses"]
        and a["norms"] == b["norms"]
        and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    )


@pytest.mark.slow
def test_offload_trainer_given_an_offload_optimizer() -> None:
    """OffloadTrainer with an optimizer passed in ``optimizers=`` (not rebuilt)."""
    assert same_run(trainer_run("torch"), trainer_run("offload_trainer"))


@pytest.mark.slow
def test_stock_trainer_given_an_offload_optimizer() -> None:
    """The stock Trainer clears with model.zero_grad() and clips over model.parameters(): both reach the host."""
    assert same_run(trainer_run("torch"), trainer_run("plain"))


@pytest.mark.slow
def test_offload_trainer_with_gradient_checkpointing_and_bf16() -> None:
    """OffloadTrainer (its own optimizer on the host, activations offloaded) against the stock Trainer, with
    gradient checkpointing and bf16 autocast."""
    extra = {"gradient_checkpointing": True, "bf16": True}
    assert same_run(trainer_run("stock_default", **extra), trainer_run("offload_trainer_default", **extra))
