"""from_deepspeed_config: a DeepSpeed ZeRO-Offload config carried over, unsupported keys named at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import HostReference, assert_same, place  # noqa: E402

import offcore  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=8)
CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def test_config_file_trains_like_the_host_reference(make_fake_device: Any, tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))

    def train(offload: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dev = make_fake_device(link="slow")
        model = MLP.build(0)
        losses: list[torch.Tensor] = []
        with dev:
            if offload:
                setup = offcore_torch.from_deepspeed_config(place(model, dev), path, device=dev)
                assert isinstance(setup.optimizer, offcore_torch.OffloadOptimizer)
                assert setup.model.layers[0][0].weight.dtype == torch.bfloat16
                assert type(setup.optimizer.host_optimizer) is torch.optim.AdamW  # DeepSpeed's Adam: adam_w_mode
            else:
                model = place(model.to(torch.bfloat16), dev)
                params = CONFIG["optimizer"]["params"]
                ref = HostReference(model, torch.optim.AdamW, dict(params), master_weights=True)
            for step in range(6):
                batch = tuple(b.to(torch.bfloat16) for b in MLP.make_batch(step, torch.device("cpu")))
                loss = MLP.loss(model, batch)
                losses.append(loss.detach())
                if offload:
                    setup.backward(loss)
                    assert setup.step() == (step % 2 == 1)
                else:
                    (loss / 2).backward()
                    ref.accumulate()
                    if step % 2 == 1:
                        torch.nn.utils.clip_grad_norm_(ref.masters, 0.5)
                        ref.step()
                        ref.zero_grad()
            if offload:
                setup.optimizer.synchronize()
                setup.close()
        return losses, [p.detach().clone() for p in model.parameters()]

    assert_same(train(True), train(False))


def test_every_unsupported_key_is_named_in_one_error(make_fake_device: Any) -> None:
    config = {
        **CONFIG,
        "scheduler": {"type": "WarmupLR"},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme"}},
        "fp16": {"enabled": True, "hysteresis": 2},
    }
    with pytest.raises(offcore.ConfigurationError) as info:
        offcore_torch.from_deepspeed_config(torch.nn.Linear(2, 2), config, device=make_fake_device())
    message = str(info.value)
    for name in ("scheduler", "Lamb", "offload_param", "'nvme'", "fp16.hysteresis", "bf16.enabled and fp16.enabled"):
        assert name in message, name


def test_unknown_optimizer_params_and_bad_files(make_fake_device: Any, tmp_path: Path) -> None:
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}}
    with pytest.raises(offcore.ConfigurationError, match="optimizer.params.betas"):
        offcore_torch.from_deepspeed_config(torch.nn.Linear(2, 2), config, device=make_fake_device())
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(offcore.ConfigurationError, match="cannot read"):
        offcore_torch.from_deepspeed_config(torch.nn.Linear(2, 2), tmp_path / "bad.json", device=make_fake_device())


def test_nvme_offload_trains_like_cpu_offload(make_fake_device: Any, tmp_path: Path) -> None:
    def train(zero: dict[str, Any]) -> list[Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
        dev = make_fake_device()
        with dev:
            dev.adopt(model)
            config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
            setup = offcore_torch.from_deepspeed_config(model, config, device=dev)
            for step in range(3):
                setup.backward(model(torch.full((4, 8), float(step))).square().mean())
                setup.step()
            setup.optimizer.synchronize()
            assert (setup.optimizer._nvme is not None) == (zero["offload_optimizer"]["device"] == "nvme")
            setup.close()
        return [p.detach().clone() for p in model.parameters()]

    nvme = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    assert_same(train(nvme), train({"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    with pytest.raises(offcore.ConfigurationError, match="needs nvme_path"):
        offcore_torch.from_deepspeed_config(
            torch.nn.Linear(2, 2),
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            device=make_fake_device(),
        )
