"""The conformance suite on a CUDA GPU; skips with the backend's reason where there is none.

``capacity`` caps the caching allocator (``set_per_process_memory_fraction``) so the
device-filling and out-of-memory tests run on a 141 GB GPU too; the allocator hands
out large blocks in 2 MiB segments, hence ``allocation_granularity``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

pytest.importorskip("hypothesis", reason="the conformance suite needs hypothesis (pip install offcore[test])")

from offcore.testing import BackendConformance  # noqa: E402


class TestCudaConformance(BackendConformance):
    backend_spec = "cuda"
    backend_options: ClassVar[dict[str, Any]] = {"capacity": "1GiB", "host_budget": "512MiB"}
    buffer_kind = "torch"
    allocation_granularity = 2 << 20
