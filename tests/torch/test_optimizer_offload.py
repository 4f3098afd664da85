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


def test_clipping_matches_torch(make_fake_device: Any) -> None:
    options = dict(optimizer="adamw_fused", accumulation=2, clip=0.05)
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
