"""The Ascend NPU adapter (offcore_npu) on a machine without torch_npu or an NPU.

Here: registration, the unavailability reasons (torch_npu missing; torch_npu
present but failing to import in each way a missing CANN makes it fail), option
checks, and the NPU-specific logic (private formats, memory figures through
``torch.npu.*``) with ``torch_npu`` / ``torch.npu`` replaced by CPU stand-ins. On an
Ascend machine the conformance suite (test_conformance_npu.py) runs on hardware.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fake_accelerator import FakeAcceleratorModule, GiB  # noqa: E402
from offcore_npu.device import NpuDevice, import_torch_npu  # noqa: E402

import offcore  # noqa: E402
from offcore import Availability, Capability, Tier  # noqa: E402

TORCH_NPU_INSTALLED = importlib.util.find_spec("torch_npu") is not None


# --------------------------------------------------------------------------- registration


def test_entry_point_names_the_plugin_module() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="offcore.backends")}
    assert points.get("npu") == "offcore_npu"


def test_registered_lazily() -> None:
    info = next(i for i in offcore.backends() if i.name == "npu")
    assert info.target == "offcore_npu.device:NpuDevice"
    assert offcore.get_backend_class("npu") is NpuDevice


def test_plugin_and_adapter_import_touch_neither_torch_nor_torch_npu() -> None:
    code = textwrap.dedent(
        """
        import sys
        import offcore_npu
        import offcore_npu.device
        names = []
        offcore_npu.offcore_register_backends(register=lambda name, target, **kw: names.append((name, target)))
        assert names == [("npu", "offcore_npu.device:NpuDevice")], names
        assert "torch" not in sys.modules and "torch_npu" not in sys.modules, "import was not lazy"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- availability here


@pytest.mark.skipif(TORCH_NPU_INSTALLED, reason="checks the reason given when torch_npu is absent")
def test_missing_torch_npu_is_reported() -> None:
    status = NpuDevice.availability()
    assert not status and status.device_count == 0
    assert status.reason.startswith(f"torch_npu is not installed (torch {torch.__version__})")
    assert "CANN" in status.reason
    with pytest.raises(offcore.BackendUnavailableError, match="torch_npu is not installed"):
        offcore.device("npu")
    with pytest.raises(offcore.BackendUnavailableError, match="torch_npu is not installed"):
        NpuDevice(0)


@pytest.mark.parametrize(
    ("statement", "shown"),
    [
        ("raise Exception('libascend_hal.so: cannot open shared object file')", "Exception: libascend_hal.so"),
        ("raise ImportError('libhccl.so: cannot open shared object file')", "ImportError: libhccl.so"),
        ("raise OSError('CANN toolkit not found under /usr/local/Ascend')", "OSError: CANN toolkit not found"),
        ("raise SystemExit('set_env.sh was not sourced')", "SystemExit: set_env.sh was not sourced"),
    ],
    ids=["bare-exception", "import-error", "os-error", "system-exit"],
)
def test_any_failure_of_import_torch_npu_becomes_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, statement: str, shown: str
) -> None:
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(statement + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    importlib.invalidate_caches()
    status = NpuDevice.availability()
    assert not status and status.device_count == 0
    assert status.reason.startswith(f"importing torch_npu failed ({shown}")
    assert "CANN" in status.reason
    assert "torch_npu" not in sys.modules, "a failed import must not leave a half-imported module behind"
    module, reason = import_torch_npu()
    assert module is None and reason == status.reason


# --------------------------------------------------------------------------- stand-in torch_npu / torch.npu


class FakeTorchNpu(types.ModuleType):
    """``torch_npu``'s format calls: formats live in a side table keyed by storage."""

    FRACTAL_NZ = 29
    ND = 2

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.__version__ = "2.6.0.post3"
        self.formats: dict[int, int] = {}
        self.casts: list[int] = []

    def get_npu_format(self, tensor: Any) -> int:
        return self.formats.get(tensor.untyped_storage().data_ptr(), self.ND)

    def npu_format_cast(self, tensor: Any, acl_format: int) -> Any:
        self.casts.append(acl_format)
        out = tensor.clone()
        self.formats[out.untyped_storage().data_ptr()] = acl_format
        return out


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTorchNpu, FakeAcceleratorModule]:
    """An importable torch_npu stand-in that registers a two-device ``torch.npu``."""
    torch_npu = FakeTorchNpu()
    npu = FakeAcceleratorModule(count=2, total=64 * GiB)
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return torch_npu, npu


def test_available_when_torch_npu_sees_devices(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    assert NpuDevice.availability() == Availability(True, "", 2)


def test_torch_npu_without_a_device(
    fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, npu = fake_npu
    npu.available = False
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    status = NpuDevice.availability()
    assert (
        status.reason
        == "torch_npu 2.6.0.post3 sees no Ascend NPU: no Ascend driver or device was found (check npu-smi info)"
    )
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert "ASCEND_RT_VISIBLE_DEVICES='' hides every device" in NpuDevice.availability().reason


def test_torch_npu_that_registers_no_torch_npu(
    fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch, "npu")
    assert NpuDevice.availability().reason == "torch_npu 2.6.0.post3 imported but did not register torch.npu"


def test_availability_never_raises(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    _, npu = fake_npu

    def broken() -> int:
        raise RuntimeError("drvGetDevNum failed")

    npu.device_count = broken  # type: ignore[method-assign]
    status = NpuDevice.availability()
    assert not status and status.reason == "probing the Ascend NPU raised RuntimeError: drvGetDevNum failed"


class FormatTestNpu(NpuDevice):
    """NpuDevice whose 'device' tensors are CPU tensors it was told about."""

    def _setup(self) -> None:
        super()._setup()
        self.device_storages: set[int] = set()

    def place(self, tensor: Any) -> Any:
        self.device_storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def _resident(self, buffer: Any) -> bool:
        return isinstance(buffer, torch.Tensor) and buffer.untyped_storage().data_ptr() in self.device_storages


def test_capabilities_and_options(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    dev = NpuDevice(1, host_budget="32MiB")
    assert Capability.PRIVATE_FORMATS in dev.capabilities and Capability.DUPLEX_COPY not in dev.capabilities
    assert Capability.TIMING_READ_SYNCHRONIZES in dev.capabilities  # elapsed_time is a barrier on torch_npu
    assert dev.index == 1 and dev.capacity == 64 * GiB
    with pytest.raises(offcore.ConfigurationError, match="unknown option"):
        NpuDevice(0, pinning="register")  # a CUDA-only option
    with pytest.raises(offcore.ConfigurationError, match="indices 0..1"):
        offcore.device("npu:5")


def test_private_format_is_recorded_and_restored(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    torch_npu, _ = fake_npu
    dev = FormatTestNpu(0)
    weight = dev.place(torch.randn(32, 32))
    torch_npu.formats[weight.untyped_storage().data_ptr()] = FakeTorchNpu.FRACTAL_NZ
    fmt = dev.format_of(weight)
    assert fmt == FakeTorchNpu.FRACTAL_NZ
    assert dev.format_of(torch.randn(3)) is None, "a host tensor has no NPU format"
    reloaded = dev.place(weight.clone())  # comes back from the host in the base format
    assert torch_npu.get_npu_format(reloaded) == FakeTorchNpu.ND
    restored = dev.restore_format(reloaded, fmt)
    assert torch_npu.casts == [FakeTorchNpu.FRACTAL_NZ]
    assert torch_npu.get_npu_format(restored) == FakeTorchNpu.FRACTAL_NZ and torch.equal(restored, weight)


@pytest.mark.parametrize(
    ("fmt", "moved"),
    [(2, True), (0, True), (30, True), (29, False), (3, False), (4, False), (1, False), (27, False), (33, False)],
    ids=["ND", "NCHW", "NCDHW", "FRACTAL_NZ", "NC1HWC0", "FRACTAL_Z", "NHWC", "NDHWC", "FRACTAL_Z_3D"],
)
def test_private_formats_stay_on_the_device_by_default(
    fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule], fmt: int, moved: bool
) -> None:
    """Restoring tiled/permuted layouts is unverified on hardware: such tensors are reported as not held.

    The activation binding keeps a tensor the device does not hold where it is
    (offcore_torch.activations.offload: reason "not_on_device"), so it is never copied or restored.
    """
    torch_npu, _ = fake_npu
    dev = FormatTestNpu(0)
    assert dev.private_formats == "keep"
    tensor = dev.place(torch.randn(4, 4, 4, 4))
    torch_npu.formats[tensor.untyped_storage().data_ptr()] = fmt
    assert dev.holds(tensor) is moved
    assert dev.holds(tensor[1:]) is moved, "a view is judged by its storage's format"
    assert dev.format_of(tensor) == fmt, "the format is still reported"
    assert not dev.holds(torch.randn(3)), "a host tensor is never held"


def test_private_formats_offload_is_an_opt_in(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    torch_npu, _ = fake_npu
    dev = FormatTestNpu(0, private_formats="offload")
    weight = dev.place(torch.randn(32, 32))
    torch_npu.formats[weight.untyped_storage().data_ptr()] = FakeTorchNpu.FRACTAL_NZ
    assert dev.holds(weight) and dev.format_of(weight) == FakeTorchNpu.FRACTAL_NZ
    with pytest.raises(offcore.ConfigurationError, match=r"private_formats must be one of \('keep', 'offload'\)"):
        NpuDevice(0, private_formats="cast")


def test_a_tensor_kept_for_its_format_can_still_be_copied(
    fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule],
) -> None:
    """Not held means "do not move it", not "not on this NPU": copy_ accepts it."""
    torch_npu, _ = fake_npu
    dev = FormatTestNpu(0, host_budget="8MiB", block_size="1MiB")
    weight = dev.place(torch.randn(8, 8))
    torch_npu.formats[weight.untyped_storage().data_ptr()] = FakeTorchNpu.FRACTAL_NZ
    assert not dev.holds(weight)
    host = torch.zeros(8, 8)  # pageable (pinning needs the real torch_npu here): a direct copy
    dev.copy_(host, weight, stream=dev.new_stream()).synchronize()
    assert torch.equal(host, weight)


def test_restore_format_is_a_no_op_when_nothing_to_do(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    torch_npu, _ = fake_npu
    dev = FormatTestNpu(0)
    tensor = dev.place(torch.randn(4))
    assert dev.restore_format(tensor, None) is tensor
    assert dev.restore_format(tensor, FakeTorchNpu.ND) is tensor  # already in that format
    host = torch.randn(4)
    assert dev.restore_format(host, FakeTorchNpu.FRACTAL_NZ) is host  # not on the NPU
    assert torch_npu.casts == []


def test_memory_figures_come_from_torch_npu(fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule]) -> None:
    _, npu = fake_npu
    npu.allocated[1], npu.peak[1], npu.free[1] = 5 * GiB, 6 * GiB, 50 * GiB
    dev = NpuDevice(1, capacity="32GiB")
    npu.calls.clear()
    stats = dev.memory_stats()
    assert (stats.allocated_bytes, stats.peak_allocated_bytes, stats.capacity_bytes) == (5 * GiB, 6 * GiB, 32 * GiB)
    assert npu.calls == {"memory_stats_as_nested_dict": 1}, "one read of torch.npu's statistics, not four"
    assert npu.fractions[1] == pytest.approx(0.5)
    dev.reset_peak_memory_stats()
    assert dev.memory_stats().peak_allocated_bytes == 5 * GiB
    dev.close()
    assert npu.fractions[1] == 1.0


def test_pinned_blocks_come_from_pin_memory(
    fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks are ``torch.empty(..., pin_memory=True)``; a build that returns pageable memory is refused."""
    requests: list[dict[str, Any]] = []
    real_empty = torch.empty

    def recording_empty(*args: Any, **kwargs: Any) -> Any:
        requests.append(dict(kwargs))
        kwargs.pop("pin_memory", None)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    dev = NpuDevice(0, host_budget="8MiB", block_size="4MiB")
    with pytest.raises(offcore.BackendUnavailableError, match="returned pageable memory"):
        dev.allocate(1000, Tier.PINNED)
    assert any(r.get("pin_memory") is True for r in requests)


def test_pinned_budget_counts_the_host_allocator_s_power_of_two_rounding(
    fake_npu: tuple[FakeTorchNpu, FakeAcceleratorModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_npu's caching host allocator (ATen's CachingHostAllocatorImpl) pins a power of two per block."""
    requests: list[int] = []
    real_empty = torch.empty

    def pinned_empty(size: int, **kwargs: Any) -> Any:
        if kwargs.pop("pin_memory", False):
            requests.append(size)
        return real_empty(size, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned_empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    dev = NpuDevice(0, host_budget="12MiB", block_size="3MiB")
    small = dev.allocate(1000, Tier.PINNED)
    assert requests == [4 << 20], "block_size 3 MiB pins 4 MiB: ask for the 4 MiB"
    big = dev.allocate(5 << 20, Tier.PINNED)  # a block of its own: 5 MiB pins 8 MiB
    assert dev.memory_stats()["pinned_reserved_bytes"] == 12 << 20
    with pytest.raises(offcore.CapacityExceededError, match="budget"):
        dev.allocate(4 << 20, Tier.PINNED)
    assert requests == [4 << 20, 5 << 20]
    del small, big
