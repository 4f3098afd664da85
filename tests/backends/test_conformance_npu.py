"""The conformance suite on an Ascend NPU; skips with the backend's reason where there is none.

``capacity`` caps torch_npu's caching allocator (``torch.npu.set_per_process_memory_fraction``)
so the device-filling and out-of-memory tests run on a 64 GB NPU too; the allocator
hands out large blocks in 2 MiB segments, hence ``allocation_granularity``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

pytest.importorskip("hypothesis", reason="the conformance suite needs hypothesis (pip install offcore[test])")

from offcore.testing import BackendConformance  # noqa: E402


class TestNpuConformance(BackendConformance):
    backend_spec = "npu"
    backend_options: ClassVar[dict[str, Any]] = {"capacity": "1GiB", "host_budget": "512MiB"}
    buffer_kind = "torch"
    allocation_granularity = 2 << 20
