"""The conformance suite's tests on the shared adapter, here -- all of them.

:class:`~fake_accelerator.FakeAcceleratorDevice` runs the very code offcore_cuda and
offcore_npu run (``TorchAcceleratorDevice``) with ``torch.cuda`` replaced by a CPU
stand-in, so every copy path -- pinned, pageable (staged), host-to-host,
device-to-device, non-contiguous, every dtype, random shapes -- is checked byte for
byte without a GPU. The stand-in's allocator counts device memory and enforces the
memory fraction that ``capacity=`` sets, so the out-of-memory, fill-and-free and
memory-statistics tests run here too (against the adapter's capacity cap and its
one read of the allocator statistics); on hardware test_conformance_cuda/npu.py run
them against the real allocator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis", reason="the conformance suite needs hypothesis (pip install offcore[test])")

from fake_accelerator import FakeAcceleratorDevice, FakeAcceleratorModule  # noqa: E402

from offcore.testing import BackendConformance  # noqa: E402


class TestSharedAdapterOnStandIn(BackendConformance):
    buffer_kind = "torch"
    hypothesis_examples = 60

    @pytest.fixture
    def backend_name(self) -> str:
        return FakeAcceleratorDevice.name

    @pytest.fixture
    def backend(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
        monkeypatch.setattr(FakeAcceleratorDevice, "module", FakeAcceleratorModule(), raising=False)
        # capacity 64 MiB (a memory fraction of the stand-in's 16 GiB): small enough to fill
        device = FakeAcceleratorDevice(0, host_budget="256MiB", block_size="16MiB", capacity="64MiB")
        yield device
        device.close()
