"""The conformance suite on every selected backend (``--offcore-backend``), with its default options.

``tox -e cuda`` runs exactly this with ``--offcore-backend=cuda --offcore-require-backend``.
"""

from __future__ import annotations

from offcore.testing import BackendConformance


class TestSelectedBackend(BackendConformance):
    """``backend_spec = None``: the ``backend`` fixture picks every selected backend."""
