"""The Ascend NPU device adapter: :class:`NpuDevice`, written against torch_npu's documented API.

- Streams and events: ``torch.npu.Stream`` / ``torch.npu.Event``; copies run inside
  ``torch.npu.stream(...)`` and return an explicit event (never ``record_stream``).
- Pinned memory: blocks from ``torch.empty(..., pin_memory=True)`` (torch_npu's host
  allocator), sub-allocated exact-size by ``offcore.HostBufferPool``. On the NPU a
  copy between device and *pageable* host memory synchronizes the stream, so a
  pageable host side is always staged through a pinned buffer (host-to-device stays
  asynchronous; device-to-pageable blocks the caller until the bytes landed). Only
  when the pinned budget is exhausted does a copy run directly (and synchronously).
- Memory figures: one read of ``torch.npu.memory_stats_as_nested_dict`` per
  ``memory_stats()`` (``allocated_bytes.all.current`` / ``.peak``, ``reserved_bytes``),
  ``mem_get_info`` and ``reset_peak_memory_stats`` -- not ``torch.accelerator.memory_*``,
  which asserts on released torch_npu builds.
- Private formats: an NPU tensor may be stored in a device-private layout (e.g. NZ,
  ``acl_format`` 29) whose bytes are tiled and padded. Until restoring them is verified
  on hardware, such tensors stay on the device: :meth:`NpuDevice.holds` says False for
  them (Note [NPU private formats stay on the device]). ``private_formats="offload"``
  opts in to moving them anyway: the binding records :meth:`NpuDevice.format_of`
  (``torch_npu.get_npu_format``) at offload and calls :meth:`NpuDevice.restore_format`
  (``torch_npu.npu_format_cast``) after reload.

**CPU-only machines with torch_npu installed.** torch >= 2.5 auto-imports installed
device extensions at ``import torch``; where torch_npu is installed but CANN or the
driver is missing, that makes ``import torch`` itself fail. Set
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` in the environment to switch the autoload off;
offcore then imports torch_npu only when the ``npu`` backend is probed, and reports
the failure as the backend's unavailability reason.

    >>> import offcore
    >>> dev = offcore.device("npu:0", host_budget="8GiB")     # doctest: +SKIP
    >>> fmt = dev.format_of(weight)                           # doctest: +SKIP
    >>> restored = dev.restore_format(reloaded, fmt)          # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, ClassVar

from offcore_accelerator import TorchAcceleratorDevice, import_torch

from offcore.errors import ConfigurationError
from offcore.protocols import Availability, Capability

__all__ = ["NpuDevice", "import_torch_npu", "PLAIN_FORMATS"]

_FORMAT_NCHW, _FORMAT_ND, _FORMAT_NCDHW = 0, 2, 30  # aclFormat values (torch_npu.Format)
PLAIN_FORMATS = frozenset({_FORMAT_NCHW, _FORMAT_ND, _FORMAT_NCDHW})
"""Formats whose bytes are torch's own layout of the tensor (unpadded, dims in order)."""
_PRIVATE_FORMAT_MODES = ("keep", "offload")

# Note [NPU private formats stay on the device]
# torch_npu keeps a format descriptor per storage. ND, NCHW and NCDHW lay the bytes out
# as torch does (torch_npu's FormatHelper: InferShapeofND / InferShapeofNCHW /
# InferShapeOfNCDHW keep the dims in order, isPadded false); the others do not: NHWC
# and NDHWC permute the dims, NC1HWC0, FRACTAL_Z, FRACTAL_NZ, NDC1HWC0 and
# FRACTAL_Z_3D tile and pad them (NZ: 16x16 tiles). Reading torch_npu against the
# binding's restore path found it probably wrong for those: ``set_(storage)`` carries
# the storage's format descriptor; the op-api copy path memcpy's NZ-tiled bytes into
# a plain storage which ``npu_format_cast`` then tiles once more; the legacy path runs
# a format cast on a uint8 view of an NZ storage. Nothing of this can be checked
# without an Ascend device, so by default (``private_formats="keep"``) a tensor whose
# storage is in any other format is reported as not held -- the activation binding
# then keeps it where it is (reason "not_on_device"), exactly as it keeps a tensor on
# another device. copy_ still accepts such tensors (they are resident). Tensors in
# the plain formats are offloaded; NCHW/NCDHW come back as ND and are recast (the
# descriptor only: base formats are byte-identical). ``private_formats="offload"``
# restores the previous, unverified behaviour for a hardware test.


def import_torch_npu() -> tuple[Any, str]:
    """``(torch_npu, "")`` or ``(None, reason)``; never raises.

    A torch_npu without its CANN runtime fails in many ways -- ImportError, OSError
    for a missing ``libascend_hal.so``, or a bare ``Exception`` -- so every exception
    is caught and turned into a reason.
    """
    try:
        import torch_npu
    except (Exception, SystemExit) as exc:
        return None, (
            f"importing torch_npu failed ({type(exc).__name__}: {exc}); install the Ascend CANN toolkit and "
            "driver and source CANN's set_env.sh, or use a torch_npu release that matches torch"
        )
    return torch_npu, ""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ValueError, ImportError):  # a module in sys.modules without a spec is installed enough
        return True


class NpuDevice(TorchAcceleratorDevice):
    """One Ascend NPU (``offcore.device("npu:1")``), an :class:`offcore.Backend`."""

    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    # DUPLEX_COPY is not claimed: simultaneous H2D and D2H are not verified on Ascend
    # hardware yet, and without the flag the scheduler assumes one shared link (safe).
    # torch_npu's Event.elapsed_time drains every task queue and synchronizes both events
    # (NPUEvent.cpp): copy timings are read between steps only
    capabilities = frozenset(
        {
            Capability.TORCH,
            Capability.PINNED_MEMORY,
            Capability.EVENT_TIMING,
            Capability.PRIVATE_FORMATS,
            Capability.TIMING_READ_SYNCHRONIZES,
        }
    )

    hardware: ClassVar[str] = "the Ascend NPU"
    extra_options: ClassVar[tuple[str, ...]] = ("private_formats",)

    @classmethod
    def device_module(cls) -> Any:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu

    @classmethod
    def _probe(cls) -> Availability:
        torch, reason = import_torch()
        if torch is None:
            return Availability(False, reason)
        if not _installed("torch_npu"):
            return Availability(
                False,
                f"torch_npu is not installed (torch {torch.__version__}); install the torch_npu release matching "
                "this torch together with the Ascend CANN toolkit (docs/backends.md)",
            )
        torch_npu, reason = import_torch_npu()
        if torch_npu is None:
            return Availability(False, reason)
        npu = getattr(torch, "npu", None)
        version = getattr(torch_npu, "__version__", "?")
        if npu is None:
            return Availability(False, f"torch_npu {version} imported but did not register torch.npu")
        count = int(npu.device_count()) if npu.is_available() else 0
        if count == 0:
            visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
            why = (
                f"ASCEND_RT_VISIBLE_DEVICES={visible!r} hides every device"
                if visible is not None
                else "no Ascend driver or device was found (check npu-smi info)"
            )
            return Availability(False, f"torch_npu {version} sees no Ascend NPU: {why}")
        return Availability(True, "", count)

    def _configure(self, private_formats: str = "keep", **_: Any) -> None:
        if private_formats not in _PRIVATE_FORMAT_MODES:
            raise ConfigurationError(
                f"private_formats must be one of {_PRIVATE_FORMAT_MODES}, got {private_formats!r} "
                "('keep': tensors in NZ and other private formats stay on the NPU; 'offload': move them and "
                "restore the format with npu_format_cast, not yet verified on hardware)"
            )
        self.private_formats = private_formats

    def _setup(self) -> None:
        super()._setup()
        import torch_npu

        self._torch_npu = torch_npu

    def holds(self, buffer: Any) -> bool:
        """True for a tensor on this NPU that offcore may move.

        With ``private_formats="keep"`` (the default) a tensor whose storage is in a
        private format (not ND, NCHW or NCDHW) is not: it stays on the device (Note [NPU
        private formats stay on the device]).
        """
        if not self._resident(buffer):
            return False
        if self.private_formats == "offload":
            return True
        return int(self._torch_npu.get_npu_format(buffer)) in PLAIN_FORMATS

    def format_of(self, tensor: Any) -> int | None:
        """``torch_npu.get_npu_format(tensor)`` for a tensor on this NPU, else None.

        >>> fmt = dev.format_of(weight)     # 29 for FRACTAL_NZ, 2 for ND   # doctest: +SKIP
        """
        if not self._resident(tensor):
            return None
        return int(self._torch_npu.get_npu_format(tensor))

    def restore_format(self, tensor: Any, fmt: int | None) -> Any:
        """``tensor`` cast back to private format ``fmt`` (``torch_npu.npu_format_cast``).

        Returns ``tensor`` itself when ``fmt`` is None, the tensor is not on this NPU,
        or it already has that format.
        """
        if fmt is None or not self._resident(tensor):
            return tensor
        if int(self._torch_npu.get_npu_format(tensor)) == fmt:
            return tensor
        return self._torch_npu.npu_format_cast(tensor, fmt)
