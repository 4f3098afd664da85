"""``offcore_torch.nvme_tier(device, path, budget=...)``: one NVMe tier for every binding on a device.

Once set, the bindings made on ``device`` that place objects on disk and were not given their own
``nvme=`` share one :class:`offcore.nvme.NvmeTier` (one byte budget on that disk, one set of I/O
threads; keys are per binding, so they never collide). A per-call ``nvme=`` (a path or an
:class:`offcore.nvme.NvmeSpec`) opens a tier of that binding's own, closed with it.

    >>> import offcore, offcore_torch, tempfile
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> tier = offcore_torch.nvme_tier(dev, tempfile.mkdtemp(), budget="256MiB")
    >>> offcore_torch.nvme_tier_for(dev) is tier
    True
    >>> offcore_torch.nvme_tier(dev, None)          # closes it; its files are removed
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from offcore.ledger import Ledger
from offcore.nvme.spec import NvmeSpec, as_spec
from offcore.nvme.tier import NvmeTier
from offcore_torch.runtime import check_bool, check_device

__all__ = ["nvme_tier", "nvme_tier_for", "open_nvme"]

_LOCK = threading.Lock()
_TIERS: dict[int, NvmeTier] = {}


def _drop(key: int) -> None:
    with _LOCK:
        tier = _TIERS.pop(key, None)
    if tier is not None:
        tier.close()


def nvme_tier(
    device: Any,
    path: NvmeSpec | str | os.PathLike[str] | None,
    *,
    budget: int | str | None = None,
    verify: bool | None = None,
) -> NvmeTier | None:
    """Set the NVMe tier every binding on ``device`` shares (None closes and removes it).

    ``path`` is a directory you own (offcore makes a private directory under it) or an
    :class:`~offcore.nvme.NvmeSpec`; ``budget`` the bytes it may use (default: the free space).
    Set it before the bindings are made.

        >>> tier = nvme_tier(dev, "/mnt/nvme", budget="200GiB")        # doctest: +SKIP
    """
    check_device(device, "nvme_tier", methods=False)
    if verify is not None:
        check_bool(verify, "verify", "nvme_tier")
    key = id(device)
    if path is None:
        _drop(key)
        return None
    spec = as_spec(path)
    assert spec is not None
    if budget is not None or verify is not None:
        spec = NvmeSpec(
            spec.path, budget if budget is not None else spec.budget, spec.verify if verify is None else verify
        )
    tier = spec.open(ledger=Ledger())
    with _LOCK:
        old = _TIERS.pop(key, None)
        _TIERS[key] = tier
    if old is not None:
        old.close()
    try:  # the tier goes with the device
        weakref.finalize(device, _drop, key)
    except TypeError:
        pass
    return tier


def nvme_tier_for(device: Any) -> NvmeTier | None:
    """The tier set by :func:`nvme_tier` for ``device`` (None when there is none)."""
    return _TIERS.get(id(device))


def open_nvme(
    device: Any, nvme: NvmeSpec | str | os.PathLike[str] | None, *, ledger: Ledger | None = None
) -> tuple[NvmeTier | None, bool]:
    """The tier a binding uses: its own for a per-call ``nvme=`` (``owned`` True: the binding closes it),
    else the device's shared one (``owned`` False), else None.

        >>> tier, owned = open_nvme(dev, "/mnt/nvme")                 # doctest: +SKIP
    """
    spec = as_spec(nvme)
    if spec is not None:
        return spec.open(ledger=ledger), True
    return nvme_tier_for(device), False
