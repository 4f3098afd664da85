"""OffloadOptimizer: bit-identical to the same optimizer on host copies without offload (issue 11).

Losses, host gradients, device parameters, masters and optimizer states after 5 steps, on
the sanitized fake device, over optimizers, accumulation, overlap, dtypes and models.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_torch.models import GPTConfig, cnn_workload, gpt_workload, mlp_workload  # noqa: E402
from optimizer_offload_helpers import assert_equivalent, run  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=8)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "sgd_nesterov", "adagrad"])
@pytest.mark.parametrize(
    "accumulation,overlap",
    [(1, False), (1, True), (4, False), (4, True)],
    ids=["step", "overlap", "accum4", "accum4-overlap"],
)
def test_mlp_matches_host_reference(make_fake_device: Any, optimizer: str, accumulation: int, overlap: bool) -> None:
    options = dict(optimizer=optimizer, accumulation=accumulation, overlap=overlap)
    want = run(MLP, device=make_fake_device(), offload=False, **options)
    got = run(MLP, device=make_fake_device(link="slow"), **options)
    assert_equivalent(got, want)


@pytest.mark.parametrize("overlap", [False, True])
def test_bf16_params_with_fp32_masters(make_fake_device: Any, overlap: bool) -> None:
    options = dict(optimizer="adamw_fused", accumulation=4, overlap=overlap, dtype=torch.bfloat16, master_weights=True)
    want = run(MLP, device=make_fake_device(), offload=False, **options)
    got = run(MLP, device=make_fake_device(link="slow"), **options)
    assert got.masters[0].dtype == torch.float32 and got.params[0].dtype == torch.bfloat16
    assert_equivalent(got, want)


def test_gradients_kept_on_device_until_step(make_fake_device: Any) -> None:
    options = dict(optimizer="adamw", accumulation=4, offload_gradients=False)
    want = run(MLP, device=make_fake_device(), offload=False, **options)
    got = run(MLP, device=make_fake_device(link="slow"), **options)
    assert_equivalent(got, want)


@pytest.mark.parametrize("offload_gradients", [True, False], ids=["offloaded-grads", "device-grads"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16-masters"])
def test_clipping_matches_torch(make_fake_device: Any, offload_gradients: bool, dtype: str) -> None:
    """With ``offload_gradients=False`` clip_grad_norm_ brings the device gradients over first and step()
    uses the clipped ones (before: it clipped nothing and stepped unclipped gradients)."""
    options: dict[str, Any] = dict(
        optimizer="adamw_fused", accumulation=2, clip=0.05, offload_gradients=offload_gradients
    )
    if dtype == "bf16-masters":
        options.update(dtype=torch.bfloat16, master_weights=True)
    want = run(MLP, device=make_fake_device(), offload=False, **options)
    got = run(MLP, device=make_fake_device(link="slow"), **options)
    assert len(got.norms) == 5 and all(n > 0.05 for n in got.norms)  # it really clipped
    assert_equivalent(got, want)


def test_tiny_gpt(make_fake_device: Any) -> None:
    work = gpt_workload(
        GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, dropout=0.0), batch_size=2
    )
    options = dict(optimizer="adamw_fused", accumulation=2, overlap=True, dtype=torch.bfloat16, master_weights=True)
    want = run(work, device=make_fake_device(), offload=False, **options)
    got = run(work, device=make_fake_device(link="slow"), **options)
    assert_equivalent(got, want)


def test_cnn(make_fake_device: Any) -> None:
    work = cnn_workload(width=8, image_size=8, batch_size=4)
    options = dict(optimizer="sgd_nesterov", accumulation=2, overlap=True)
    want = run(work, device=make_fake_device(), offload=False, **options)
    got = run(work, device=make_fake_device(link="slow"), **options)
    assert_equivalent(got, want)


def test_device_gradients_read_once_per_round(make_fake_device: Any) -> None:
    """offload_gradients=False (Note [Device gradients are read on the host once per round]): host_grads()
    before step() shows this round's device gradients; step() uses what clip_grad_norm_ left, and
    host_grads() after it reads that, not the device's unclipped sum again; a backward between a read
    and step() is refused; one after step() without zero_grad() sums into the same .grad, as torch does."""
    import offcore_torch

    from offcore.errors import ConfigurationError

    dev = make_fake_device()
    model = MLP.build(0)
    with dev:
        dev.adopt(model)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.SGD, device=dev, lr=0.1, offload_gradients=False
        )
        try:
            batch = MLP.make_batch(0, torch.device("cpu"))
            MLP.loss(model, batch).backward()
            device_grads = [p.grad.clone() for p in model.parameters()]
            host = opt.host_grads()
            assert all(torch.equal(h, d) for h, d in zip(host, device_grads, strict=True))
            offcore_torch.clip_grad_norm_(opt, 1e-3)
            clipped = [h.clone() for h in opt.host_grads()]
            assert not torch.equal(clipped[0], device_grads[0])
            before = [opt.master(p).clone() for p in model.parameters()]
            opt.step()
            after_step = opt.host_grads()  # what the step used: still the clipped gradients
            assert all(torch.equal(a, c) for a, c in zip(after_step, clipped, strict=True))
            for b, p, c in zip(before, model.parameters(), clipped, strict=True):
                assert torch.equal(opt.master(p), b - 0.1 * c)  # SGD: one step of the clipped gradient

            # a backward after step() without zero_grad(): the device sums into .grad, the next read follows it
            MLP.loss(model, MLP.make_batch(1, torch.device("cpu"))).backward()
            summed = [p.grad.clone() for p in model.parameters()]
            assert all(torch.equal(h, s) for h, s in zip(opt.host_grads(), summed, strict=True))

            # a backward between a read and step(): refused, nothing stepped
            MLP.loss(model, MLP.make_batch(2, torch.device("cpu"))).backward()
            masters = [opt.master(p).clone() for p in model.parameters()]
            with pytest.raises(ConfigurationError, match="a backward ran in between"):
                opt.step()
            assert all(torch.equal(opt.master(p), m) for p, m in zip(model.parameters(), masters, strict=True))
            opt.zero_grad()  # starts over: the next round reads its own gradients
            MLP.loss(model, MLP.make_batch(3, torch.device("cpu"))).backward()
            opt.step()
        finally:
            opt.close()


def test_steps_under_backward_need_offloaded_gradients(make_fake_device: Any) -> None:
    """accumulation_steps= / last_micro_step() with offload_gradients=False could step nothing under
    backward: refused, instead of silently ignored."""
    import offcore_torch

    from offcore.errors import ConfigurationError

    dev = make_fake_device()
    model = MLP.build(0)
    with dev:
        dev.adopt(model)
        with pytest.raises(ConfigurationError, match="drop accumulation_steps=2 or keep offload_gradients=True"):
            offcore_torch.OffloadOptimizer(
                model.parameters(), torch.optim.SGD, device=dev, lr=0.1, offload_gradients=False, accumulation_steps=2
            )
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.SGD, device=dev, lr=0.1, offload_gradients=False
        )
        try:
            with pytest.raises(ConfigurationError, match="last_micro_step"), opt.last_micro_step():
                pass
        finally:
            opt.close()


def test_zero_grad_restarts_the_count_of_accumulation_steps(make_fake_device: Any) -> None:
    """accumulation_steps=3 (Note [Host step rounds]): a micro-step abandoned after the first one, then
    zero_grad() and the round retried from the start. The count restarts with the gradients: the host step
    runs over the three retried micro-steps, as SGD over their sum; before, the retry's second micro-step was
    counted third, stepped over two micro-steps, and the third was refused."""
    import offcore_torch

    dev = make_fake_device()
    model = MLP.build(0)
    with dev:
        dev.adopt(model)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.SGD, device=dev, lr=0.1, accumulation_steps=3
        )
        try:
            MLP.loss(model, MLP.make_batch(100, torch.device("cpu"))).backward()  # the round that is given up
            opt.zero_grad()
            before = [opt.master(p).clone() for p in model.parameters()]
            summed: list[torch.Tensor] = []
            for micro in range(3):
                with dev.host_work():
                    reference = MLP.build(0)
                    reference.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
                    MLP.loss(reference, MLP.make_batch(micro, torch.device("cpu"))).backward()
                    grads = [p.grad.clone() for p in reference.parameters()]
                    summed = grads if not summed else [s + g for s, g in zip(summed, grads, strict=True)]
                MLP.loss(model, MLP.make_batch(micro, torch.device("cpu"))).backward()
            opt.step()
            for b, p, g in zip(before, model.parameters(), summed, strict=True):
                assert torch.equal(opt.master(p), b.add(g, alpha=-0.1))  # SGD's own arithmetic
        finally:
            opt.close()
