"""The conformance suite on the CPU fake device: sanitizer on, an emulated link, torch and numpy buffers.

The numpy variant needs no torch, so ``tox -e core`` runs it too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

pytest.importorskip("hypothesis", reason="the conformance suite needs hypothesis (pip install offcore[test])")

from offcore.testing import BackendConformance  # noqa: E402

SANITIZED_LINK: dict[str, Any] = {
    "capacity": "64MiB",
    "h2d_bandwidth": "16GiB/s",
    "d2h_bandwidth": "16GiB/s",
    "latency": "20us",
    "sanitize": True,
}


class TestCpuTorchSanitized(BackendConformance):
    backend_spec = "cpu"
    backend_options: ClassVar[dict[str, Any]] = {**SANITIZED_LINK, "buffers": "torch", "duplex": False}
    buffer_kind = "torch"


class TestCpuNumpySanitized(BackendConformance):
    backend_spec = "cpu"
    backend_options: ClassVar[dict[str, Any]] = {**SANITIZED_LINK, "buffers": "numpy"}
    buffer_kind = "numpy"


# Without the sanitizer, small copies on an idle stream run inline on the calling thread and
# only their time is emulated (Note [Inline copies on an idle stream]); the suite must hold there too.
INLINE_LINK: dict[str, Any] = {**SANITIZED_LINK, "sanitize": False}


class TestCpuTorchInline(BackendConformance):
    backend_spec = "cpu"
    backend_options: ClassVar[dict[str, Any]] = {**INLINE_LINK, "buffers": "torch", "duplex": False}
    buffer_kind = "torch"


class TestCpuNumpyInline(BackendConformance):
    backend_spec = "cpu"
    backend_options: ClassVar[dict[str, Any]] = {**INLINE_LINK, "buffers": "numpy"}
    buffer_kind = "numpy"
