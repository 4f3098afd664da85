"""offload_parameters with OffloadOptimizer: parameters streamed, optimizer on the host, bit-identical.

Today the two compose through their public APIs only: the optimizer reads each parameter
once to build its host master (a fetch outside a module), uploads the stepped values into
the device parameters, and offload_parameters writes those back to its host copies at the
next forward (or ``handle.release()``). Correct, with one extra upload and write-back per parameter and step (see
docs/parameter-offload.md, "With OffloadOptimizer").
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import GPTConfig, TinyGPT, next_token_loss  # noqa: E402
from offcore_torch.parameters import offload_parameters  # noqa: E402


def _train(dev: Any, offload: bool) -> list[torch.Tensor]:
    with dev:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, dropout=0.0), seed=0)
        handle = offload_parameters(model, dev) if offload else None
        opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)
        out = []
        for step in range(3):
            tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
            loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach().clone())
            if handle is not None and step == 1:
                # what the optimizer uploaded stays until the next forward, or until release()
                handle.release()
                assert handle.stats().device_bytes == 0
        if handle is not None:
            handle.remove()
        opt.close()
        return out + [p.detach().clone() for p in model.parameters()]


def test_bit_identical_with_offload_optimizer(make_fake_device: Any) -> None:
    want = _train(make_fake_device(), False)
    got = _train(make_fake_device(link="slow"), True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
