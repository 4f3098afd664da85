"""The NVMe storage tier (torch-free): private files, asynchronous I/O from host buffers, nothing lost.

- :class:`NvmeTier`: objects in files under a directory you name, within a byte budget;
  ``write`` / ``read`` return :class:`IOHandle` s (``query()`` / ``synchronize()``).
- :func:`pipelined`: a step over groups of state, read i+1 / compute i / write i−1.
- :func:`aligned_empty`: page-aligned host buffers (pool blocks) for ``O_DIRECT`` in place.

docs/nvme.md has the guide and the measurements.

    >>> import numpy as np, tempfile
    >>> from offcore.nvme import NvmeTier
    >>> tier = NvmeTier(tempfile.mkdtemp(), budget="16MiB")
    >>> tier.write("m", np.zeros(3)).synchronize()
    >>> "m" in tier, tier.nbytes("m")
    (True, 24)
    >>> tier.close()
"""

from __future__ import annotations

from offcore.nvme.files import ALIGNMENT, aligned_empty
from offcore.nvme.pipeline import Waitable, pipelined
from offcore.nvme.spec import NvmeSpec, as_spec
from offcore.nvme.tier import IOHandle, NvmeTier

__all__ = ["ALIGNMENT", "IOHandle", "NvmeSpec", "NvmeTier", "Waitable", "aligned_empty", "as_spec", "pipelined"]
