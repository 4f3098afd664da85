"""offcore_torch.distributed: clear errors for what it cannot take (no process group needed)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.distributed import FSDPOffloadOptimizer, attach_ddp  # noqa: E402

import offcore  # noqa: E402

pytestmark = pytest.mark.torch


def test_attach_ddp_needs_a_ddp_module_and_an_offload_optimizer(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with dev:
        model = dev.adopt(torch.nn.Linear(4, 4))
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1)
        try:
            with pytest.raises(offcore.ConfigurationError, match="DistributedDataParallel"):
                attach_ddp(model, opt)  # type: ignore[arg-type]
        finally:
            opt.close()


def test_fsdp_offload_optimizer_refuses_unsharded_parameters(make_fake_device: Any) -> None:
    dev = make_fake_device()
    with dev:
        model = dev.adopt(torch.nn.Linear(4, 4))
        with pytest.raises(offcore.ConfigurationError, match="not sharded"):
            FSDPOffloadOptimizer(model, torch.optim.AdamW, device=dev, lr=1e-3)


def test_exports() -> None:
    assert offcore_torch.attach_ddp is attach_ddp
    assert offcore_torch.FSDPOffloadOptimizer is FSDPOffloadOptimizer
