"""The fake device's optional ``allocated_bytes()``: the same figure as ``memory_stats()["allocated_bytes"]``.

The binding's device-room probe reads it once per trigger instead of building the whole
stats dict (offcore.protocols.OPTIONAL_MEMBERS); it must never disagree with memory_stats.
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

import offcore  # noqa: E402
from offcore import Tier  # noqa: E402
from offcore.protocols import OPTIONAL_MEMBERS  # noqa: E402


@pytest.mark.parametrize("accounting", ["dispatch", "allocator"])
def test_allocated_bytes_is_memory_stats_allocated_bytes(accounting: str) -> None:
    if accounting == "allocator":
        from offcore_cpu import tracking

        if tracking.allocator_hook() is None:
            pytest.skip("the allocator hook cannot be built here")
    dev = offcore.device("cpu", capacity="1MiB", accounting=accounting)
    try:
        assert "allocated_bytes" in OPTIONAL_MEMBERS
        assert dev.allocated_bytes() == dev.memory_stats()["allocated_bytes"] == 0
        with dev:
            device_buffer = dev.allocate(4096, Tier.DEVICE)
            host_buffer = dev.allocate(8192, Tier.PAGEABLE)  # host bytes are not device bytes
            assert dev.allocated_bytes() == dev.memory_stats()["allocated_bytes"] == 4096
            produced = torch.ones(256, device=dev.torch_device)  # counted by the device's accounting
            assert dev.allocated_bytes() == dev.memory_stats()["allocated_bytes"] >= 4096 + produced.nbytes
            del device_buffer, produced
            gc.collect()
            assert dev.allocated_bytes() == dev.memory_stats()["allocated_bytes"] == 0
            del host_buffer
    finally:
        dev.close()
