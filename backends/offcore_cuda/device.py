"""The CUDA device adapter: :class:`CudaDevice`.

Streams, events and memory figures come from ``torch.cuda``; copies use explicit
events (never ``record_stream``); pinned host memory is a budgeted pool of large
blocks, sub-allocated exact-size (``offcore.HostBufferPool``). The shared machinery
is :class:`offcore_accelerator.TorchAcceleratorDevice`; this module adds how
CUDA says whether it can run here and how host blocks are pinned.

    >>> import offcore
    >>> dev = offcore.device("cuda:1", host_budget="16GiB", capacity="40GiB")   # doctest: +SKIP
    >>> dev.torch_device                                                       # doctest: +SKIP
    device(type='cuda', index=1)

Options (all keyword, all checked): ``host_budget``, ``block_size``, ``capacity``,
``stage_pageable`` (see :class:`offcore_accelerator.AcceleratorOptions`) and
``pinning``:

- ``"register"`` (default): each block is ordinary host memory page-locked with
  ``cudaHostRegister`` (through ``torch.cuda.cudart()``), so a block costs exactly
  its size rounded to a page; it is unregistered when the last view of it dies.
- ``"allocator"``: blocks from ``torch.empty(..., pin_memory=True)``, i.e. PyTorch's
  caching host allocator, which rounds each request up to a power of two (a 96 MiB
  block reserves 128 MiB) and keeps freed blocks cached.

Pageable host memory: a copy whose host side is pageable is staged through a
pinned buffer (host-to-device stays asynchronous; device-to-pageable blocks the
caller until the bytes landed), as the CUDA runtime would do implicitly -- but
without making the copy stream wait on the host.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Any, ClassVar

from offcore_accelerator import TorchAcceleratorDevice, import_torch, tensor_over

from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.protocols import Availability, Capability
from offcore.units import format_bytes

__all__ = ["CudaDevice"]

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_PINNING_MODES = ("register", "allocator")


class CudaDevice(TorchAcceleratorDevice):
    """One NVIDIA GPU (``offcore.device("cuda:1")``), an :class:`offcore.Backend`."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    capabilities = frozenset(
        {Capability.TORCH, Capability.PINNED_MEMORY, Capability.DUPLEX_COPY, Capability.EVENT_TIMING}
    )
    extra_options: ClassVar[tuple[str, ...]] = ("pinning",)

    hardware: ClassVar[str] = "CUDA"

    @classmethod
    def device_module(cls) -> Any:
        import torch

        return torch.cuda

    @classmethod
    def _probe(cls) -> Availability:
        torch, reason = import_torch()
        if torch is None:
            return Availability(False, reason)
        version = torch.__version__
        if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
            return Availability(
                False,
                f"torch {version} is a CPU-only build (compiled without CUDA); install a CUDA build of torch "
                "(docs/backends.md, 'Choosing a torch build')",
            )
        runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # is_available() warns about old drivers; we report instead
            count = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = (
                f"CUDA_VISIBLE_DEVICES={visible!r} hides every device"
                if visible is not None
                else "no NVIDIA driver or GPU was found (check nvidia-smi)"
            )
            return Availability(False, f"torch {version} ({runtime}) sees no CUDA device: {why}")
        return Availability(True, "", count)

    def _configure(self, pinning: str = "register", **_: Any) -> None:
        if pinning not in _PINNING_MODES:
            raise ConfigurationError(f"pinning must be one of {_PINNING_MODES}, got {pinning!r}")
        self.pinning = pinning

    def _allocate_pinned_block(self, nbytes: int) -> Any:
        """A pinned block of exactly ``nbytes`` (page-locked with ``cudaHostRegister``)."""
        if self.pinning == "allocator":
            return super()._allocate_pinned_block(nbytes)
        page = mmap.PAGESIZE
        span = -(-nbytes // page) * page
        # Register only whole pages inside our own allocation, so no page is shared with
        # another allocation (registering one page twice fails).
        backing = self._torch.empty(span + page, dtype=self._torch.uint8)
        start = -(-backing.data_ptr() // page) * page
        cudart = self._torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(start, span, _CUDA_HOST_REGISTER_PORTABLE))
        if error != 0:
            raise CapacityExceededError(
                f"page-locking {format_bytes(span)} of host memory with cudaHostRegister failed (cudaError {error}); "
                "lower host_budget, or pass pinning='allocator'"
            )

        def unregister() -> None:
            cudart.cudaHostUnregister(start)

        return tensor_over(start, nbytes, on_free=unregister, keepalive=backing)
