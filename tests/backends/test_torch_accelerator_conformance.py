"""The conformance suite's copy, stream, event and host-pool tests on the shared adapter, here.

:class:`~fake_accelerator.FakeAcceleratorDevice` runs the very code offcore_cuda and
offcore_npu run (``TorchAcceleratorDevice``) with ``torch.cuda`` replaced by a CPU
stand-in, so every copy path -- pinned, pageable (staged), host-to-host,
device-to-device, non-contiguous, every dtype, random shapes -- is checked byte for
byte without a GPU. The stand-in has no memory allocator, so the capacity and
memory-statistics tests are left to the hardware runs (test_conformance_cuda.py,
test_conformance_npu.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from fake_accelerator import FakeAcceleratorDevice, FakeAcceleratorModule  # noqa: E402

from offcore.testing import BackendConformance  # noqa: E402

_HARDWARE_ONLY = (
    "the stand-in torch.cuda has no memory allocator; this runs in test_conformance_cuda/npu.py on hardware"
)


class TestSharedAdapterOnStandIn(BackendConformance):
    buffer_kind = "torch"
    hypothesis_examples = 60

    @pytest.fixture
    def backend_name(self) -> str:
        return FakeAcceleratorDevice.name

    @pytest.fixture
    def backend(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
        monkeypatch.setattr(FakeAcceleratorDevice, "module", FakeAcceleratorModule(), raising=False)
        device = FakeAcceleratorDevice(0, host_budget="256MiB", block_size="16MiB")
        yield device
        device.close()

    def test_allocation_beyond_capacity_raises_a_clear_out_of_memory_error(self) -> None:
        pytest.skip(_HARDWARE_ONLY)

    def test_filling_the_device_raises_and_freeing_makes_room(self) -> None:
        pytest.skip(_HARDWARE_ONLY)

    def test_memory_stats_count_device_allocations(self) -> None:
        pytest.skip(_HARDWARE_ONLY)

    def test_peak_and_reset(self) -> None:
        pytest.skip(_HARDWARE_ONLY)
