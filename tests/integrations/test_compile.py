"""torch.compile with offcore: no graph break caused by offcore, no recompile after the first step, and the
same numbers as the same compiled model without offcore.

The model is compiled whole (``torch.compile(model, fullgraph=True)``: a graph break would raise) or block by
block (``model[i] = torch.compile(block, fullgraph=True)``, the recipe FSDP2 documents), with activation offload and
an ``OffloadOptimizer`` on a fake device whose slow link keeps the optimizer's uploads in flight when the next
forward starts (a missing wait reads a parameter before its upload landed: different numbers, and the
sanitizer's record).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import offcore  # noqa: E402

STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)) for _ in range(3)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(64, 1))


def train(use_offcore: bool, how: str, backend: str = "aot_eager", parameters: bool = False) -> dict[str, Any]:
    dev = offcore.device(
        "cpu", capacity="256MiB", h2d_bandwidth="1GiB/s", d2h_bandwidth="1GiB/s", latency="100us", sanitize=True
    )
    torch._dynamo.reset()
    counters.clear()
    model = dev.adopt(make_model())
    if how == "whole":
        call = torch.compile(model, backend=backend, fullgraph=True)
    else:  # each block compiled, hooks at block boundaries (torchtitan's recipe for FSDP2)
        for i in range(len(model) - 1):
            model[i] = torch.compile(model[i], backend=backend, fullgraph=True)
        call = model
    losses, graphs = [], []
    g = torch.Generator().manual_seed(1)
    with dev:
        streamed = offcore_torch.offload_parameters(model, dev) if use_offcore and parameters else None
        if use_offcore:
            opt: Any = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(STEPS):
            x = torch.randn(32, 64, generator=g)
            region = offcore_torch.offload_activations(dev, min_bytes=0) if use_offcore else contextlib.nullcontext()
            with region as handle:
                loss = call(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
            if use_offcore:
                assert handle.stats().offloaded_bytes > 0
        params = [p.clone() for p in model.state_dict().values()]
        if use_offcore:
            opt.close()
        if streamed is not None:
            assert streamed.stats().h2d_bytes > 0  # the blocks' parameters were streamed in
            streamed.remove()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert dev.sanitizer_violations() == []
    return {"losses": losses, "params": params, "graphs": graphs}


def check(how: str, backend: str, parameters: bool = False) -> None:
    bare, off = train(False, how, backend), train(True, how, backend, parameters)
    assert off["losses"] == bare["losses"]
    assert all(torch.equal(a, b) for a, b in zip(bare["params"], off["params"], strict=True))
    # compiled at the first step only: no recompile afterwards (and as many graphs as without offcore)
    assert off["graphs"] == [bare["graphs"][0]] * STEPS, (off["graphs"], bare["graphs"])


@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_compiled_model_with_offcore_is_bit_identical_without_graph_breaks_or_recompiles(how: str) -> None:
    check(how, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["whole", "blocks"])
def test_inductor(how: str) -> None:
    check(how, "inductor")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_offload_parameters_with_compiled_blocks(backend: str) -> None:
    """offload_parameters with each block compiled: the block is the unit, streamed at its boundary."""
    check("blocks", backend, parameters=True)
