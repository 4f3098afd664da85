"""On a backend where reading a copy timing is a barrier, offcore reads none while a step runs.

torch_npu's ``Event.elapsed_time`` drains every task queue and synchronizes both events,
so such a backend advertises ``Capability.TIMING_READ_SYNCHRONIZES`` and the runtime
reads its copy timings only between steps (at the next region's start, in ``stats()``,
in ``synchronize``). Here the fake device advertises it and counts the reads.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

from offcore.protocols import Capability  # noqa: E402


@pytest.mark.parametrize("barrier", [True, False])
def test_timings_are_read_only_between_steps_where_reading_is_a_barrier(
    backend: Any, make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, barrier: bool
) -> None:
    if not is_fake_device(backend):
        pytest.skip("the fake device stands in for a backend whose timing reads are barriers")
    dev = make_fake_device(link="slow")
    if barrier:
        dev.capabilities = dev.capabilities | {Capability.TIMING_READ_SYNCHRONIZES}
    assert runtime_for(dev).timings_between_steps is barrier
    reads: list[str] = []
    phase = {"now": "setup"}
    event_type = type(dev.new_event(enable_timing=True))
    elapsed_time = event_type.elapsed_time

    def counting(self: Any, end: Any) -> float:
        reads.append(phase["now"])
        return elapsed_time(self, end)

    monkeypatch.setattr(event_type, "elapsed_time", counting)
    torch.manual_seed(0)
    with dev:
        model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()).to(dev.torch_device)
        x = torch.randn(256, 256, device=dev.torch_device)
        for _ in range(2):
            phase["now"] = "step"
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                loss = model(x).square().mean()
            loss.backward()
            phase["now"] = "between"
            assert handle.stats().d2h_bandwidth > 0, "stats() reads the step's timings"
    settle(dev)
    assert reads, "timings were read"
    if barrier:
        assert "step" not in reads, "a timing was read while a step ran"
    else:
        assert "step" in reads, "without the capability timings are read as copies land (the case must show it)"
