"""Where the NVMe tier lives: a path and a byte budget, given once per device or per call.

Every binding that can place objects on disk (``OffloadOptimizer(tier="nvme")``, ``offload_parameters``,
``offload_activations``) takes the same :class:`NvmeSpec`; the PyTorch binding's
``offcore_torch.nvme_tier(device, ...)`` sets one per device, shared by every binding on it (one
budget on that disk, one set of I/O threads).

    >>> import tempfile
    >>> from offcore.nvme.spec import NvmeSpec, as_spec
    >>> spec = as_spec(tempfile.mkdtemp())            # a path alone: the disk's free space as the budget
    >>> tier = spec.open()
    >>> tier.budget > 0
    True
    >>> tier.close()
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offcore.errors import ConfigurationError
from offcore.units import parse_size

if TYPE_CHECKING:
    from offcore.ledger import Ledger
    from offcore.nvme.tier import NvmeTier
    from offcore.trace import TraceRecorder

__all__ = ["NvmeSpec", "as_spec"]


@dataclass(frozen=True)
class NvmeSpec:
    """A directory on the NVMe disk (offcore makes a private 0700 directory under it) and a byte budget.

    ``budget`` None means the free space of that filesystem when the tier opens; ``verify`` (default
    True) keeps per-block checksums checked on every read.

        >>> NvmeSpec("/mnt/nvme", budget="64GiB").budget
        '64GiB'
    """

    path: str
    budget: int | str | None = None
    verify: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.verify, bool):
            raise ConfigurationError(f"NvmeSpec verify must be True or False, got {self.verify!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ConfigurationError(f"an NVMe tier needs a directory path, got {self.path!r}")
        if self.budget is not None:
            parse_size(self.budget, what="NVMe tier budget")  # fail at construction, not at first write

    def budget_bytes(self) -> int:
        """The budget in bytes (the free space under ``path`` when none was given)."""
        if self.budget is not None:
            return parse_size(self.budget, what="NVMe tier budget")
        try:
            return shutil.disk_usage(self.path).free
        except OSError as exc:
            raise ConfigurationError(
                f"NVMe tier path {self.path!r} cannot be read ({exc}); name an existing directory"
            ) from exc

    def open(self, *, ledger: Ledger | None = None, trace: TraceRecorder | None = None) -> NvmeTier:
        """A new :class:`~offcore.nvme.tier.NvmeTier` under ``path`` (close it when done); its copies are
        counted in ``ledger`` and drawn in ``trace`` when given."""
        from offcore.nvme.tier import NvmeTier

        return NvmeTier(self.path, budget=self.budget_bytes(), verify=self.verify, ledger=ledger, trace=trace)


def as_spec(value: NvmeSpec | str | os.PathLike[str] | None) -> NvmeSpec | None:
    """``value`` as an :class:`NvmeSpec`: a spec as is, a path with the disk's free space as budget, None as None."""
    if value is None or isinstance(value, NvmeSpec):
        return value
    if isinstance(value, (str, os.PathLike)):
        return NvmeSpec(os.fspath(value))
    raise ConfigurationError(
        f"nvme= takes a directory path or an offcore.nvme.NvmeSpec(path, budget=...), got {type(value).__name__}"
    )
