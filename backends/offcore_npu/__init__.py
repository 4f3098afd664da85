"""offcore's Ascend NPU backend: registers ``npu`` through the ``offcore.backends`` entry point.

Importing this package imports neither torch nor torch_npu; the adapter class
(:class:`offcore_npu.device.NpuDevice`) is loaded on first use, and a torch_npu that
cannot load (no CANN toolkit, no driver) makes the backend *unavailable* with the
reason instead of breaking ``import offcore``.

    >>> import offcore
    >>> dev = offcore.device("npu:0", host_budget="8GiB")    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import offcore

__all__ = ["offcore_register_backends"]


@offcore.hookimpl
def offcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "npu",
        "offcore_npu.device:NpuDevice",
        description="Huawei Ascend NPUs through torch_npu (torch.npu streams, events, pinned host pool)",
    )
