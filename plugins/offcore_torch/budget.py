"""``offcore_torch.device_budget(device, budget)``: one device budget for every binding on a device.

Once set, every :class:`offcore.residency.ResidencyScheduler` a binding makes on that device
(activation regions of :func:`offcore_torch.offload_activations`, the parameter handle of
:func:`offcore_torch.offload_parameters`) shares one :class:`offcore.budget.DeviceBudget`: the
bytes copied onto the device ahead of their use, across kinds, stay within it, and when it is
full the copy needed furthest in the future is evicted, whichever binding made it (Note [One
device budget across kinds] in offcore/budget.py). ``OffloadOptimizer`` keeps optimizer states
on the host and gradients on the device only while their D2H is in flight, so it holds nothing
ahead of use to budget.

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> budget = offcore_torch.device_budget(dev, "4MiB")      # or a fraction: 0.1 of the capacity
    >>> with dev:
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ...     handle = offcore_torch.offload_parameters(model, dev)
    ...     with offcore_torch.offload_activations(dev):
    ...         loss = model(torch.randn(8, 64)).square().mean()
    ...     loss.backward()
    >>> budget.stats().peak_bytes <= budget.capacity_bytes
    True
    >>> handle.remove(); offcore_torch.device_budget(dev, None)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from offcore.budget import DeviceBudget
from offcore.errors import ConfigurationError
from offcore.units import parse_size
from offcore_torch.runtime import check_device

__all__ = ["device_budget", "shared_budget_for"]

_LOCK = threading.Lock()
_BUDGETS: dict[int, DeviceBudget] = {}


def _parse(device: Any, budget: int | str | float) -> int:
    if isinstance(budget, float) and not isinstance(budget, bool) and 0.0 < budget <= 1.0:
        capacity = int(getattr(device, "capacity", 0) or 0)
        if capacity <= 0:
            raise ConfigurationError("a device budget as a fraction needs a device with a known capacity")
        return int(budget * capacity)
    return parse_size(budget, what="device budget", allow_zero=True)


def device_budget(device: Any, budget: int | str | float | None) -> DeviceBudget | None:
    """Share one budget of ``budget`` bytes (or a fraction of the device's capacity) among every binding
    made on ``device`` from now on; None removes it. Returns the :class:`~offcore.budget.DeviceBudget`
    (``stats()`` per kind). Set it before the bindings are made.

        >>> budget = device_budget(dev, 0.25)                # doctest: +SKIP
    """
    check_device(device, "device_budget", methods=False)
    key = id(device)
    with _LOCK:
        if budget is None:
            _BUDGETS.pop(key, None)
            return None
        shared = DeviceBudget(_parse(device, budget), name=str(getattr(device, "name", "")))
        _BUDGETS[key] = shared
    try:  # the budget goes with the device
        weakref.finalize(device, _BUDGETS.pop, key, None)
    except TypeError:
        pass
    return shared


def shared_budget_for(device: Any) -> DeviceBudget | None:
    """The budget set by :func:`device_budget` for ``device`` (None when there is none)."""
    return _BUDGETS.get(id(device))
