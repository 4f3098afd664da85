"""Offloading never changes a number: loss, gradients and parameters stay bit-identical.

Every workload trains ``STEPS`` AdamW steps twice on the same backend, once keeping
every saved activation and once under ``offcore_torch.offload_activations`` with a
small ``min_bytes`` so that nearly every saved tensor really leaves the device. The
comparison is bitwise (``offcore_torch.testing.bit_identical``), never ``allclose``.

On the CPU fake device the sanitizer is on (freed device memory and in-flight host
buffers are poisoned, copy durations jittered), and the link is varied: unlimited,
and slow with latency so that copies are still in flight when compute reaches them.
The same file runs unchanged on CUDA / NPU through the ``backend`` fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import (  # noqa: E402
    GPTConfig,
    Workload,
    cnn_workload,
    gpt_workload,
    mlp_workload,
    view_saver_workload,
)
from offcore_torch.testing import RunRecord, assert_bit_identical, run_steps, run_workload  # noqa: E402
from torch_test_devices import device_with_link, is_fake_device  # noqa: E402

STEPS = 3
MIN_BYTES = "1KiB"
GPT_CONFIG = GPTConfig(vocab_size=128, d_model=64, n_heads=4, n_layers=2, seq_len=32, dropout=0.1)

WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": lambda: mlp_workload(d_in=32, width=128, depth=3, d_out=16, batch_size=64),
    "gpt": lambda: gpt_workload(GPT_CONFIG, batch_size=2),
    "cnn": lambda: cnn_workload(in_channels=3, width=8, n_classes=10, image_size=16, batch_size=4),
    "view_saver": lambda: view_saver_workload(d_in=32, d_out=64, batch_size=48),
}

_references: dict[tuple[str, str], RunRecord] = {}


def reference_run(backend: Any, device: Any, name: str) -> RunRecord:
    """The keep-all run of workload ``name`` (its values depend on the backend, not on the link)."""
    key = (backend.name, name)
    if key not in _references:
        _references[key] = run_workload(WORKLOADS[name](), device=device, steps=STEPS)
    return _references[key]


def check_really_offloaded(record: RunRecord, *, reloaded: bool = False) -> None:
    """Every step offloaded bytes and backward read offloaded entries back; with ``reloaded``
    backward must also have copied bytes back to the device (not only reused a storage that
    was still alive because its copy had not landed yet when backward began)."""
    for step, stats in enumerate(record.stats):
        assert stats is not None, "the offloaded run recorded no stats"
        assert stats.offloaded_bytes > 0, f"step {step} offloaded nothing: the comparison would be vacuous"
        used = stats.reloaded_bytes + stats.reused_live_bytes
        assert used > 0, f"step {step}: backward read no offloaded tensor back: {stats}"
        if reloaded:
            assert stats.reloaded_bytes > 0, f"step {step} copied nothing back to the device: {stats}"


@pytest.mark.parametrize("link", ["unlimited", "slow"])
@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_offloaded_training_is_bit_identical(
    backend: Any, make_fake_device: Callable[..., Any], name: str, prefetch: str, link: str
) -> None:
    device = device_with_link(backend, link, make_fake_device)
    reference = reference_run(backend, device, name)
    assert all(bool(torch.isfinite(loss)) for loss in reference.losses)

    offloaded = run_workload(
        WORKLOADS[name](), device=device, steps=STEPS, offload={"min_bytes": MIN_BYTES, "prefetch": prefetch}
    )

    assert_bit_identical(reference, offloaded)
    check_really_offloaded(offloaded)


@pytest.mark.parametrize("link", ["unlimited", "slow"])
def test_offload_inside_activation_checkpointing_is_bit_identical(
    backend: Any, make_fake_device: Callable[..., Any], link: str
) -> None:
    """Blocks recomputed by non-reentrant ``torch.utils.checkpoint``, everything else offloaded:
    the result equals plain keep-all training (checkpointing replays the dropout RNG)."""
    device = device_with_link(backend, link, make_fake_device)
    reference = reference_run(backend, device, "gpt")

    offloaded = run_workload(
        gpt_workload(GPT_CONFIG, batch_size=2, checkpoint_blocks=True),
        device=device,
        steps=STEPS,
        offload={"min_bytes": MIN_BYTES},
    )

    assert_bit_identical(reference, offloaded, labels=("keep-all", "checkpointed + offloaded"))
    check_really_offloaded(offloaded)


@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_storages_restored_from_host_are_bit_identical(
    backend: Any, make_fake_device: Callable[..., Any], name: str, prefetch: str
) -> None:
    """offcore's copies are synchronized at the end of forward (a group of small storages is copied then),
    so every device-to-host copy has landed and offcore has let the device copies go before backward:
    backward must copy them back."""
    device = device_with_link(backend, "slow", make_fake_device) if is_fake_device(backend) else backend
    reference = reference_run(backend, device, name)
    work = WORKLOADS[name]()

    def loss_then_synchronize(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = work.loss(model, batch)
        offcore_torch.synchronize(device)
        return loss

    offloaded = run_steps(
        work.build,
        work.make_batch,
        loss_fn=loss_then_synchronize,
        device=device,
        steps=STEPS,
        offload={"min_bytes": MIN_BYTES, "prefetch": prefetch},
    )

    assert_bit_identical(reference, offloaded)
    check_really_offloaded(offloaded, reloaded=True)
