"""Test helpers shipped with offcore: the backend conformance suite (the fsspec pattern).

A backend adapter's test module reuses the whole suite in a few lines::

    from offcore.testing import BackendConformance

    class TestMyDevice(BackendConformance):
        backend_spec = "mydev"
        backend_options = {"capacity": "256MiB"}

Importing this package needs pytest, hypothesis and numpy, never torch; the
``pytest_offcore`` plugin (installed with offcore) provides the ``backend`` and
``backend_name`` fixtures the suite runs on.
"""

from __future__ import annotations

from offcore.testing.buffers import BufferKit, NumpyKit, TorchKit, buffer_kit, buffer_kit_for
from offcore.testing.conformance import LAYOUTS, TIER_PAIRS, BackendConformance, out_of_memory_errors

__all__ = [
    "LAYOUTS",
    "TIER_PAIRS",
    "BackendConformance",
    "BufferKit",
    "NumpyKit",
    "TorchKit",
    "buffer_kit",
    "buffer_kit_for",
    "out_of_memory_errors",
]
