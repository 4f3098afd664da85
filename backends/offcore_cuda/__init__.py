"""offcore's CUDA backend: registers ``cuda`` through the ``offcore.backends`` entry point.

Importing this package imports neither torch nor CUDA; the adapter class
(:class:`offcore_cuda.device.CudaDevice`) is loaded on first use.

    >>> import offcore
    >>> dev = offcore.device("cuda:0", host_budget="8GiB")   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import offcore

__all__ = ["offcore_register_backends"]


@offcore.hookimpl
def offcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "cuda",
        "offcore_cuda.device:CudaDevice",
        description="NVIDIA GPUs through torch.cuda (streams, events, pinned host pool)",
    )
