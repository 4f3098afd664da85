"""Faults never change a number and never poison the device.

The fake device fails a chosen copy on demand (``dev.inject_copy_fault(n, mode=...)``:
at submission, or on its stream like an asynchronous CUDA error). Whatever fails — a
copy, forward, backward, or the user with a KeyboardInterrupt — afterwards device,
pinned and pageable bytes, host-pool slices, copy threads and hooks are back where they
were, and the next step on the same device is bit-identical to a run on a fresh one.
A failed device-to-host copy keeps the device copy and a failed prefetch reloads from
the intact host copy, so even the faulted step is bit-identical, unless the one copy
that cannot be avoided (a synchronous reload) fails: then backward raises
:class:`offcore.CopyFailedError`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from hypothesis_draws import full_draws  # noqa: E402
from offcore_torch.models import GPTConfig, TinyGPT, next_token_loss  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import frozen_heap, pool_used_bytes, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, dropout=0.1)


@pytest.fixture
def fake(backend: Any) -> None:
    if not is_fake_device(backend):
        pytest.skip("fault injection is a fake-device option")


def start_copy_workers(dev: Any) -> None:
    """Start the copy streams' worker threads now (they start on first queued work, which a fault may bring)."""
    runtime = runtime_for(dev)
    for stream in (runtime.d2h_stream, runtime.h2d_stream):
        stream.launch_host_func(lambda: None)
        stream.synchronize()


def levels(dev: Any) -> dict[str, Any]:
    from offcore_torch.activations.policy import _ACTIVE_RULES

    stats = dev.memory_stats()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return {
        "device": stats.allocated_bytes,
        "pool slices": pool_used_bytes(dev),
        "pageable": int(stats.get("pageable_bytes", 0)),
        "threads": threading.active_count(),
        "saved-tensor hooks": hooks,
        "module hooks": (
            len(nn.modules.module._global_forward_pre_hooks),
            len(nn.modules.module._global_forward_hooks),
            len(_ACTIVE_RULES),  # regions the process-wide module hooks still call
        ),
    }


class Run:
    """One TinyGPT on one device, stepped with a seed per step (dropout masks are reproducible)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        with dev:
            self.model = TinyGPT(CONFIG, seed=0).to(dev.torch_device)
            gen = torch.Generator().manual_seed(1)
            self.tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=gen).to(
                dev.torch_device
            )

    def step(self, seed: int, *, offload: bool = True, **policy: Any) -> tuple[Any, list[Any]]:
        """Loss and gradients of one step (parameters unchanged: faults are judged per step)."""
        torch.manual_seed(seed)
        with self.dev:
            try:
                if offload:
                    with offcore_torch.offload_activations(self.dev, min_bytes=1, **policy):
                        loss = next_token_loss(self.model(self.tokens[:, :-1]), self.tokens[:, 1:])
                else:
                    loss = next_token_loss(self.model(self.tokens[:, :-1]), self.tokens[:, 1:])
                loss.backward()
                return loss.detach(), [p.grad.clone() for p in self.model.parameters()]
            finally:
                self.model.zero_grad(set_to_none=True)


def reference(make_fake_device: Any, seed: int) -> tuple[Any, list[Any]]:
    return Run(make_fake_device(link="slow")).step(seed, offload=False)


def assert_same(got: tuple[Any, list[Any]], want: tuple[Any, list[Any]]) -> None:
    assert torch.equal(got[0], want[0]), "loss differs"
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w), "a gradient differs"


def copies_per_step(make_fake_device: Any, **policy: Any) -> int:
    dev = make_fake_device(link="slow")
    run = Run(dev)
    run.step(0, **policy)
    settle(dev)
    return len(dev.copy_log())


@pytest.mark.draws  # every copy under OFFCORE_DRAWS=full (~15 s each), eight spread over the step by default
@pytest.mark.parametrize("group_below", [0, "64KiB"], ids=["storages", "groups"])
@pytest.mark.parametrize("mode", ["submit", "stream"])
@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
def test_every_failed_copy_is_recovered_or_refused_and_nothing_leaks(
    fake: None, make_fake_device: Any, mode: str, prefetch: str, group_below: Any
) -> None:
    """``groups``: small storages offloaded in groups (Note [Small storages are offloaded in groups]): a fault
    hits one copy of a group's ``copy_many``, whose other copies may be enqueued already."""
    policy = {"prefetch": prefetch, "group_below": group_below}
    total = copies_per_step(make_fake_device, **policy)
    assert total > 4, "the step must offload and reload several storages"
    want = [reference(make_fake_device, seed) for seed in (0, 1)]
    dev = make_fake_device(link="slow")
    run = Run(dev)
    run.step(5, **policy)  # warm-up: pools, streams and the learnt schedule exist
    settle(dev)
    start_copy_workers(dev)
    before = levels(dev)
    outcomes: dict[str, int] = {"recovered": 0, "refused": 0, "not reached": 0}
    with frozen_heap():  # each fault's settle() collects only what the steps since made
        for nth in range(1, total + 1) if full_draws() else sorted({*range(1, total + 1, -(-total // 8)), total}):
            dev.inject_copy_fault(nth, mode=mode)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                refused = False
                try:
                    got = run.step(0, **policy)
                except offcore.CopyFailedError:
                    outcomes["refused"] += 1
                    refused = True
                else:
                    assert_same(got, want[0])
                    del got  # its gradients are device memory
                    outcomes["not reached" if dev.copy_fault_armed else "recovered"] += 1
                fired = not dev.copy_fault_armed  # a step may make fewer copies (held device copies, reuse)
                dev.inject_copy_fault(None)
                # a copy whose data was no longer needed may be seen failing only now; a raised
                # error's traceback forms cycles with the step's frames
                settle(dev, collect=True)
            if fired:
                assert any(issubclass(w.category, offcore.OffcoreWarning) for w in caught) or outcomes["refused"], (
                    f"copy {nth} failed unnoticed"
                )
            if not refused:
                assert levels(dev) == before, f"after a fault in copy {nth} of {total} ({mode}), {outcomes}"
            assert_same(run.step(1, **policy), want[1])  # the next step, on the same device
            settle(dev)
            # When backward raises, torch itself keeps the graph's unexecuted nodes (and so what
            # their saved-tensor hooks packed) until the thread's next backward: checked after it.
            assert levels(dev) == before, f"after a fault in copy {nth} of {total} ({mode}), {outcomes}"
    assert outcomes["recovered"] > 0, outcomes


def test_a_failed_offload_keeps_the_tensor_and_says_so(fake: None, make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        x = torch.randn(256, 256, device=dev.torch_device, requires_grad=True)
        dev.inject_copy_fault(1, mode="stream")
        with pytest.warns(offcore.OffcoreWarning, match="device-to-host copy failed"):
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                loss = (x.exp() * 2).sum()
            settle(dev)
        stats = handle.stats()
        assert stats.copy_failures == 1 and stats.kept.get("copy_failed") == 1
        loss.backward()
        assert torch.equal(x.grad, x.detach().exp() * 2)


def test_a_group_whose_copy_failed_keeps_its_tensors_and_leaves_the_figures(fake: None, make_fake_device: Any) -> None:
    """The same for a group of small storages (Note [Small storages are offloaded in groups]): every record of the
    group is kept, and its members leave the offloaded figures."""
    dev = make_fake_device(link="slow")
    with dev:
        x = torch.randn(1024, device=dev.torch_device, requires_grad=True)  # 4 KiB storages: one group
        dev.inject_copy_fault(1, mode="stream")
        with pytest.warns(offcore.OffcoreWarning, match="device-to-host copy failed"):
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:  # the default group_below
                loss = torch.sin(torch.sin(x * 1.0)).sum()
            settle(dev)
        stats = handle.stats()
        assert stats.copy_failures == 1 and stats.kept.get("copy_failed") == 2, stats
        assert stats.offloaded_storages == stats.offloaded_bytes == 0, stats
        loss.backward()
        assert torch.equal(x.grad, torch.cos(torch.sin(x.detach())) * torch.cos(x.detach()))


def test_a_failed_synchronous_reload_raises_copy_failed_error(fake: None, make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow")
    with dev:
        x = torch.randn(256, 256, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1, prefetch="on_demand"):
            loss = x.exp().sum()
        settle(dev)  # landed: backward must reload synchronously
        dev.inject_copy_fault(1, mode="submit")
        with pytest.raises(offcore.CopyFailedError, match="could not reload saved tensor"):
            loss.backward()
        dev.inject_copy_fault(None)
        loss.backward()  # the host copy is intact: the same graph can still run
        assert torch.equal(x.grad, x.detach().exp())


class Interrupt(nn.Module):
    def __init__(self, where: str, exc: type[BaseException]) -> None:
        super().__init__()
        self.where, self.exc = where, exc

    def forward(self, h: Any) -> Any:
        if self.where == "forward":
            raise self.exc("stop")
        return _RaiseInBackward.apply(h, self.exc)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Any, exc: type[BaseException]) -> Any:
        ctx.exc = exc
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        raise ctx.exc("stop")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_or_interrupt_leaves_nothing_behind(
    backend: Any, make_fake_device: Any, where: str, exc: type[BaseException]
) -> None:
    dev = make_fake_device(link="slow") if is_fake_device(backend) else backend
    want = Run(make_fake_device(link="slow")).step(1, offload=False)
    run = Run(dev)
    run.step(5)
    settle(dev)
    if is_fake_device(backend):
        start_copy_workers(dev)
    before = levels(dev)
    stop = Interrupt(where, exc).to(dev.torch_device)
    with dev, pytest.raises(exc, match="stop"):
        with offcore_torch.offload_activations(dev, min_bytes=1):
            h = run.model(run.tokens[:, :-1])
            loss = next_token_loss(stop(h), run.tokens[:, 1:])
        loss.backward()
    run.model.zero_grad(set_to_none=True)
    del h
    if where == "backward":
        del loss
    settle(dev)
    assert levels(dev) == before
    assert_same(run.step(1), want)


def test_no_fault_injection_option_is_silently_ignored(fake: None, make_fake_device: Any) -> None:
    dev = make_fake_device(link="slow", fail_copy=1, fail_copy_mode="submit")
    with dev, pytest.warns(offcore.OffcoreWarning, match="could not be submitted"):
        x = torch.randn(256, 256, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = x.exp().sum()
    assert handle.stats().kept.get("copy_failed") == 1
    with dev:
        loss.backward()
