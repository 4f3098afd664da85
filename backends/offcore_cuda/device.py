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
  its size rounded to a page; it is unregistered when the last view of it dies. A
  failed call's error is cleared from the runtime (Note [A failed cudaHostRegister
  leaves the last error set]); where that cannot be done, blocks are pinned as with
  ``"allocator"``.
- ``"allocator"``: blocks from ``torch.empty(..., pin_memory=True)``, i.e. PyTorch's
  caching host allocator, which rounds each request up to a power of two (a 96 MiB
  block reserves 128 MiB) and keeps freed blocks cached.

Pageable host memory: a copy whose host side is pageable is staged through a
pinned buffer (host-to-device stays asynchronous; device-to-pageable blocks the
caller until the bytes landed), as the CUDA runtime would do implicitly -- but
without making the copy stream wait on the host.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from offcore_accelerator import TorchAcceleratorDevice, import_torch, tensor_over

from offcore.errors import CapacityExceededError, ConfigurationError
from offcore.protocols import Availability, Capability
from offcore.units import format_bytes

__all__ = ["CudaDevice"]

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_PINNING_MODES = ("register", "allocator")


# Note [A failed cudaHostRegister leaves the last error set]
# The CUDA runtime records every failing call as the calling thread's "last error"
# until cudaGetLastError() reads and resets it. torch's binding of cudaHostRegister /
# cudaHostUnregister (torch/csrc/cuda/shared/cudart.cpp) wraps the call in
# C10_CUDA_ERROR_HANDLED, which is the bare expression: it returns the code and
# leaves the last error set. The next kernel launch on that thread then fails its
# C10_CUDA_KERNEL_LAUNCH_CHECK (= C10_CUDA_CHECK(cudaGetLastError())) with *our*
# error, in unrelated code. So after a failed register or unregister the adapter
# calls cudaGetLastError on the same thread. torch.cuda.cudart() does not bind it
# (it binds cudaGetErrorString, cudaProfilerStart/Stop, cudaHostRegister/Unregister,
# cudaStreamCreate/Destroy and cudaMemGetInfo), so it is looked up with ctypes in
# the runtime torch already loaded: dlsym on torch's own libc10_cuda.so /
# libtorch_cuda.so searches their dependencies, i.e. the very libcudart whose error
# state torch's checks read; RTLD_NOLOAD never loads a second copy. When it cannot be
# found, the adapter does not call cudaHostRegister at all and pins through torch's
# caching host allocator instead (whose C10_CUDA_CHECK clears the error itself).


def _loaded_function(paths: Iterable[str], symbol: str) -> Callable[[], int] | None:
    """``symbol`` (no arguments, returns an int) from the first already-loaded library of ``paths``.

    Looked up in that library and its dependencies; a library that is not loaded yet
    is skipped, never loaded.
    """
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for path in paths:
        try:
            function = getattr(ctypes.CDLL(path, mode=mode), symbol)
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        function.argtypes = []
        return function
    return None


def _mapped_libraries(prefix: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose file name starts with ``prefix``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(prefix) and fields[5] not in found:
            found.append(fields[5])
    return found


def find_get_last_error(torch: Any, cudart: Any) -> Callable[[], int] | None:
    """The runtime's ``cudaGetLastError`` (``hipGetLastError`` on ROCm) as torch uses it, or None.

    See Note [A failed cudaHostRegister leaves the last error set].
    """
    bound = getattr(cudart, "cudaGetLastError", None)  # should a later torch bind it
    if callable(bound):
        return bound
    hip = bool(getattr(torch.version, "hip", None))
    lib = Path(torch.__file__).parent / "lib"
    own = ("libc10_hip.so", "libtorch_hip.so") if hip else ("libc10_cuda.so", "libtorch_cuda.so")
    runtime = "libamdhip64.so" if hip else "libcudart.so"
    paths = [str(lib / name) for name in own] + _mapped_libraries(runtime)
    return _loaded_function(paths, "hipGetLastError" if hip else "cudaGetLastError")


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

    def _last_error_reset(self) -> Callable[[], int] | None:
        """cudaGetLastError for clearing our own failures, looked up once (None: not found)."""
        if not hasattr(self, "_get_last_error"):
            self._get_last_error = find_get_last_error(self._torch, self._torch.cuda.cudart())
        return self._get_last_error

    def _pinned_footprint(self, nbytes: int) -> int:
        """Whole pages with ``cudaHostRegister``; a power of two through the caching host allocator."""
        if self.pinning == "register":
            return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        return super()._pinned_footprint(nbytes)

    def _allocate_pinned_block(self, nbytes: int) -> Any:
        """A pinned block of exactly ``nbytes`` (page-locked with ``cudaHostRegister``)."""
        if self.pinning == "register" and self._last_error_reset() is None:
            warnings.warn(
                "offcore cuda: cudaGetLastError of the CUDA runtime torch uses was not found, so a failed "
                "cudaHostRegister could not be cleared; pinning through torch's caching host allocator instead "
                "(pinning='allocator')",
                RuntimeWarning,
                stacklevel=2,
            )
            self.pinning = "allocator"
        if self.pinning == "allocator":
            return super()._allocate_pinned_block(nbytes)
        page = mmap.PAGESIZE
        span = -(-nbytes // page) * page
        # Register only whole pages inside our own allocation, so no page is shared with
        # another allocation (registering one page twice fails).
        backing = self._torch.empty(span + page, dtype=self._torch.uint8)
        start = -(-backing.data_ptr() // page) * page
        cudart = self._torch.cuda.cudart()
        reset = self._get_last_error
        error = int(cudart.cudaHostRegister(start, span, _CUDA_HOST_REGISTER_PORTABLE))
        if error != 0:
            reset()  # Note [A failed cudaHostRegister leaves the last error set]
            raise CapacityExceededError(
                f"page-locking {format_bytes(span)} of host memory with cudaHostRegister failed (cudaError {error}); "
                "lower host_budget, or pass pinning='allocator'"
            )

        def unregister() -> None:
            # runs where the last view died, on any thread: clear the error on that thread
            if int(cudart.cudaHostUnregister(start)) != 0:
                reset()

        return tensor_over(start, nbytes, on_free=unregister, keepalive=backing)
