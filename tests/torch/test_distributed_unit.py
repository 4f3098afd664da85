"""offcore_torch.distributed: clear errors for what it cannot take (no process group needed)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from distributed_helpers import RankContext, RankFailed, run_ranks  # noqa: E402
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


class _Tagged:
    """A stream proxy that notes which stream an event was recorded on."""

    def __init__(self, stream: Any, tag: str, seen: list[str]) -> None:
        self._stream, self._tag, self._seen = stream, tag, seen

    def record_event(self, *args: Any, **kwargs: Any) -> Any:
        self._seen.append(self._tag)
        return self._stream.record_event(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def test_accept_gradient_orders_after_the_stream_current_at_each_call(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP2 switches streams around its hooks: each gradient's D2H must follow the stream current *then*."""
    dev = make_fake_device()
    with dev:
        model = dev.adopt(torch.nn.Linear(4, 4, bias=False))
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=1.0)
        try:
            opt.remove_gradient_hooks()
            model(torch.ones(2, 4)).sum().backward()
            assert model.weight.grad is not None  # no hook took it
            real = dev.current_stream
            seen: list[str] = []
            for tag, value in (("compute", 1.0), ("post_reduce", 2.0)):
                monkeypatch.setattr(dev, "current_stream", lambda tag=tag: _Tagged(real(), tag, seen))
                opt.accept_gradient(model.weight, torch.full((4, 4), value))
            monkeypatch.setattr(dev, "current_stream", real)
            assert "compute" in seen and "post_reduce" in seen
            assert seen.index("compute") < seen.index("post_reduce")
            assert torch.equal(opt.host_grad(model.weight), torch.full((4, 4), 3.0))  # accumulated on the host
            before = model.weight.detach().clone()
            opt.step()
            opt.synchronize()
            assert torch.equal(model.weight.detach(), before - 3.0)
        finally:
            opt.close()


def _one_rank_fails(ctx: RankContext) -> None:
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.recv(torch.zeros(1), src=1)  # never sent: only the group's teardown ends this


def _blocks(ctx: RankContext) -> None:
    import torch.distributed as dist

    dist.recv(torch.zeros(1), src=1 - ctx.rank)  # both wait for each other


def _no_ranks_left() -> bool:
    import multiprocessing

    return not [p for p in multiprocessing.active_children() if p.name.startswith("offcore-rank")]


@pytest.mark.distributed
def test_run_ranks_kills_the_group_when_a_rank_fails() -> None:
    with pytest.raises(RankFailed, match="rank 1 gives up"):
        run_ranks(_one_rank_fails, timeout=120)
    assert _no_ranks_left()


@pytest.mark.distributed
def test_run_ranks_kills_the_group_at_its_deadline() -> None:
    with pytest.raises(RankFailed, match="deadline"):
        run_ranks(_blocks, timeout=4)
    assert _no_ranks_left()
