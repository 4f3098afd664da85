"""The CUDA adapter (offcore_cuda) on a machine without a GPU.

Here: registration through the entry point, the unavailability reasons (this
machine's torch is a CPU-only build), option and device-index checks, and the
CUDA-specific logic (cudaHostRegister pinning, memory figures, ``cuda:1``) with
``torch.cuda`` replaced by a CPU stand-in. On a GPU the conformance suite
(test_conformance_cuda.py) runs the same checks against the hardware.
"""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_accelerator  # noqa: E402
import offcore_cuda.device as cuda_device  # noqa: E402
from fake_accelerator import FakeAcceleratorModule, GiB  # noqa: E402
from offcore_cuda.device import CudaDevice  # noqa: E402

import offcore  # noqa: E402
from offcore import Availability, Capability, Tier  # noqa: E402

CPU_ONLY = getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None


# --------------------------------------------------------------------------- registration


def test_entry_point_names_the_plugin_module() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="offcore.backends")}
    assert points.get("cuda") == "offcore_cuda"


def test_registered_lazily_with_a_description() -> None:
    info = next(i for i in offcore.backends() if i.name == "cuda")
    assert info.target == "offcore_cuda.device:CudaDevice"
    assert "torch.cuda" in info.description
    assert offcore.get_backend_class("cuda") is CudaDevice


def test_plugin_import_does_not_import_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        import offcore_cuda
        names = []
        offcore_cuda.offcore_register_backends(register=lambda name, target, **kw: names.append((name, target)))
        assert names == [("cuda", "offcore_cuda.device:CudaDevice")], names
        assert "torch" not in sys.modules, "registering the cuda backend imported torch"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- availability here


@pytest.mark.skipif(not CPU_ONLY, reason="this check is about a CPU-only torch build")
def test_cpu_only_torch_is_reported_precisely() -> None:
    status = CudaDevice.availability()
    assert not status and status.device_count == 0
    assert status.reason.startswith(f"torch {torch.__version__} is a CPU-only build")
    assert "install a CUDA build" in status.reason


@pytest.mark.skipif(not CPU_ONLY, reason="this check is about a CPU-only torch build")
def test_device_raises_backend_unavailable_with_the_reason() -> None:
    with pytest.raises(offcore.BackendUnavailableError, match="CPU-only build") as caught:
        offcore.device("cuda")
    assert "backend 'cuda' is unavailable" in str(caught.value)
    with pytest.raises(offcore.BackendUnavailableError, match="CPU-only build"):
        CudaDevice(0)


def test_bad_device_spec() -> None:
    with pytest.raises(offcore.ConfigurationError, match="non-negative integer"):
        offcore.device("cuda:first")


def test_cuda_build_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    status = CudaDevice.availability()
    assert not status
    assert (
        status.reason
        == f"torch {torch.__version__} (CUDA 12.8) sees no CUDA device: no NVIDIA driver or GPU was found (check nvidia-smi)"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES='' hides every device" in CudaDevice.availability().reason


def test_cuda_build_with_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert CudaDevice.availability() == Availability(True, "", 4)


def test_availability_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    status = CudaDevice.availability()
    assert not status and "probing CUDA raised RuntimeError: CUDA driver initialization failed" in status.reason


def test_torch_that_fails_to_import_is_a_reason_not_a_crash(tmp_path: Path) -> None:
    """A broken device extension makes ``import torch`` itself raise (torch's backend autoload)."""
    fake_torch = tmp_path / "torch"
    fake_torch.mkdir()
    (fake_torch / "__init__.py").write_text(
        "raise RuntimeError('Failed to load the backend extension: torch_npu. You can disable extension "
        "auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.')\n"
    )
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from offcore_cuda.device import CudaDevice
        status = CudaDevice.availability()
        assert not status.available
        assert status.reason.startswith("torch cannot be imported (RuntimeError: Failed to load"), status.reason
        assert "set TORCH_DEVICE_BACKEND_AUTOLOAD=0" in status.reason, status.reason
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- the adapter on a stand-in torch.cuda


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeAcceleratorModule:
    """``torch.cuda`` replaced (for the adapter) by a two-device CPU stand-in."""
    module = FakeAcceleratorModule(count=2, total=80 * GiB)
    monkeypatch.setattr(CudaDevice, "device_module", classmethod(lambda cls: module))
    monkeypatch.setattr(CudaDevice, "availability", classmethod(lambda cls: Availability(True, "", 2)))
    return module


class FakeCudart:
    """``torch.cuda.cudart()``'s two host-registration calls, recorded, over a runtime with a last error.

    As in the CUDA runtime, a failing call leaves its code as the thread's last error
    until ``cudaGetLastError`` reads and resets it, and a kernel launch checks that error
    (``C10_CUDA_KERNEL_LAUNCH_CHECK``). torch's binding exposes no ``cudaGetLastError``:
    the runtime's own function is :meth:`runtime_get_last_error`, reached through ctypes.
    """

    def __init__(self, error: int = 0, unregister_error: int = 0) -> None:
        self.error = error
        self.unregister_error = unregister_error
        self.last_error = 0
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802  (CUDA's name)
        assert flags == 1, "cudaHostRegisterPortable, so every context sees the memory as pinned"
        if self.error == 0:
            self.registered[address] = size
        else:
            self.last_error = self.error
        return self.error

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.unregistered.append(address)
        if self.unregister_error:
            self.last_error = self.unregister_error
        return self.unregister_error

    def runtime_get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def launch_kernel(self) -> None:
        """What torch does after every kernel launch: C10_CUDA_CHECK(cudaGetLastError())."""
        error = self.runtime_get_last_error()
        if error:
            raise RuntimeError(f"CUDA error {error} raised by an unrelated kernel launch")


@pytest.fixture
def cudart(fake_cuda: FakeAcceleratorModule, monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """torch.cuda.cudart() replaced, and cudaGetLastError found in torch's libc10_cuda.so (by ctypes)."""
    runtime = FakeCudart()
    looked_up: list[tuple[list[str], str]] = []

    def loaded_function(paths: Any, symbol: str) -> Any:
        paths = list(paths)
        looked_up.append((paths, symbol))
        found = symbol == "cudaGetLastError" and any(path.endswith("/lib/libc10_cuda.so") for path in paths)
        return runtime.runtime_get_last_error if found else None

    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(cuda_device, "_loaded_function", loaded_function)
    runtime.looked_up = looked_up  # type: ignore[attr-defined]
    return runtime


def test_device_spec_with_an_index(fake_cuda: FakeAcceleratorModule) -> None:
    dev = offcore.device("cuda:1", host_budget="64MiB")
    assert isinstance(dev, CudaDevice) and dev.index == 1
    assert dev.torch_device == torch.device("cuda", 1)
    assert dev.capacity == 80 * GiB
    assert isinstance(dev, offcore.Backend)
    with pytest.raises(offcore.ConfigurationError, match=r"indices 0\.\.1"):
        offcore.device("cuda:2")


def test_capabilities(fake_cuda: FakeAcceleratorModule) -> None:
    caps = CudaDevice(0).capabilities
    assert caps == {Capability.TORCH, Capability.PINNED_MEMORY, Capability.DUPLEX_COPY, Capability.EVENT_TIMING}


def test_pinning_option_is_checked(fake_cuda: FakeAcceleratorModule) -> None:
    with pytest.raises(offcore.ConfigurationError, match="pinning must be one of"):
        CudaDevice(0, pinning="mlock")
    with pytest.raises(offcore.ConfigurationError, match="unknown option"):
        CudaDevice(0, h2d_bandwidth="32GiB/s")


def test_registered_blocks_are_exact_page_aligned_and_unregistered_last(cudart: FakeCudart) -> None:
    dev = CudaDevice(0, host_budget="1GiB", block_size="1MiB")
    raw = dev.allocate(5000, Tier.PINNED)
    ((address, size),) = cudart.registered.items()
    page = mmap.PAGESIZE
    assert address % page == 0 and size == 1 << 20, "one whole-page block of block_size, not one per buffer"
    assert address <= raw.data_ptr() < address + size and raw.numel() == 5000
    second = dev.allocate(3000, Tier.PINNED)
    assert len(cudart.registered) == 1, "a second buffer must come from the same registered block"
    typed = raw.view(torch.int32)
    del raw, second
    dev.close()
    del dev  # the device and its pool are gone, but `typed` still uses the block's memory
    gc.collect()
    assert cudart.unregistered == [], "memory was unregistered while a view still used it"
    typed.fill_(7)
    del typed
    gc.collect()
    assert cudart.unregistered == [address]


def test_registration_failure_is_a_capacity_error_and_leaves_no_cuda_error_behind(cudart: FakeCudart) -> None:
    """torch's binding returns cudaHostRegister's code but leaves it as the runtime's last error."""
    cudart.error = 2  # cudaErrorMemoryAllocation
    dev = CudaDevice(0, host_budget="64MiB", block_size="1MiB")
    with pytest.raises(
        offcore.CapacityExceededError, match=r"cudaHostRegister failed \(cudaError 2\).*pinning='allocator'"
    ):
        dev.allocate(100, Tier.PINNED)
    cudart.launch_kernel()  # would raise "CUDA error 2" had the adapter not cleared it
    ((paths, symbol),) = cudart.looked_up  # looked up once, in torch's own CUDA libraries first
    lib = Path(torch.__file__).parent / "lib"
    assert symbol == "cudaGetLastError" and paths[:2] == [str(lib / "libc10_cuda.so"), str(lib / "libtorch_cuda.so")]


def test_failed_unregistration_in_a_finalizer_leaves_no_cuda_error_behind(cudart: FakeCudart) -> None:
    cudart.unregister_error = 1  # cudaErrorInvalidValue
    dev = CudaDevice(0, host_budget="64MiB", block_size="1MiB")
    buffer = dev.allocate(4096, Tier.PINNED)
    del buffer
    dev.close()  # trims the idle block: its last view dies and the finalizer unregisters
    gc.collect()
    assert cudart.unregistered == list(cudart.registered)
    cudart.launch_kernel()


def test_without_cuda_get_last_error_blocks_are_pinned_by_the_allocator(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never call cudaHostRegister when a failure could not be cleared."""
    monkeypatch.setattr(cuda_device, "_loaded_function", lambda paths, symbol: None)
    pinned_by_allocator: list[int] = []
    monkeypatch.setattr(
        offcore_accelerator.TorchAcceleratorDevice,
        "_allocate_pinned_block",
        lambda self, nbytes: pinned_by_allocator.append(nbytes) or torch.empty(nbytes, dtype=torch.uint8),
    )
    dev = CudaDevice(0, host_budget="64MiB", block_size="1MiB")
    with pytest.warns(RuntimeWarning, match="cudaGetLastError .* not found.*pinning='allocator'"):
        dev.allocate(100, Tier.PINNED)
    assert dev.pinning == "allocator" and pinned_by_allocator == [1 << 20] and cudart.registered == {}


def test_cuda_get_last_error_is_found_through_a_library_s_dependencies() -> None:
    """dlsym on a loaded library's handle also searches what it links (how libc10_cuda.so reaches libcudart)."""
    libc10 = str(Path(torch.__file__).parent / "lib" / "libc10.so")
    getpid = cuda_device._loaded_function([libc10], "getpid")  # defined in libc, which libc10 links
    assert getpid is not None and getpid() == os.getpid()
    never_loaded = cuda_device._loaded_function(["/nonexistent/libcudart.so.12"], "cudaGetLastError")
    assert never_loaded is None


@pytest.mark.skipif(not CPU_ONLY, reason="checks the look-up on a CPU-only build")
def test_cuda_get_last_error_is_not_found_on_a_cpu_only_build() -> None:
    assert cuda_device.find_get_last_error(torch, object()) is None
    assert cuda_device._mapped_libraries("libcudart.so") == []
    assert any("libc10" in path for path in cuda_device._mapped_libraries("libc10"))


@pytest.mark.skipif(not CPU_ONLY, reason="checks what the allocator path does on a CPU-only build")
def test_allocator_pinning_without_cuda_is_a_clear_error(fake_cuda: FakeAcceleratorModule) -> None:
    dev = CudaDevice(0, host_budget="64MiB", block_size="1MiB", pinning="allocator")
    with pytest.raises(offcore.CapacityExceededError, match="pinning 1.00 MiB of host memory failed"):
        dev.allocate(100, Tier.PINNED)


def test_pinned_footprint_is_whole_pages_registered_or_a_power_of_two_from_the_allocator(
    fake_cuda: FakeAcceleratorModule,
) -> None:
    page = mmap.PAGESIZE
    registered = CudaDevice(0, host_budget="64MiB", block_size="96MiB")
    assert registered._pinned_footprint(96 << 20) == 96 << 20 and registered._pinned_footprint(1) == page
    assert registered.pinned_pool.block_size == 96 << 20
    allocated = CudaDevice(0, host_budget="64MiB", block_size="96MiB", pinning="allocator")
    assert allocated._pinned_footprint(96 << 20) == 128 << 20
    assert allocated.pinned_pool.block_size == 128 << 20, "blocks as large as what pinning them costs"


def test_memory_figures_are_read_for_the_right_index(fake_cuda: FakeAcceleratorModule) -> None:
    fake_cuda.allocated = [1, 2 * GiB]
    fake_cuda.peak = [1, 3 * GiB]
    fake_cuda.reserved = [1, 4 * GiB]
    dev = CudaDevice(1, capacity="40GiB")
    fake_cuda.calls.clear()
    stats = dev.memory_stats()
    assert fake_cuda.calls == {"memory_stats_as_nested_dict": 1}, "one read of torch.cuda's statistics, not four"
    assert (stats.allocated_bytes, stats.peak_allocated_bytes, stats["reserved_bytes"]) == (2 * GiB, 3 * GiB, 4 * GiB)
    assert stats.capacity_bytes == 40 * GiB and fake_cuda.fractions[1] == pytest.approx(0.5)
    assert stats["free_bytes"] == 36 * GiB
    dev.reset_peak_memory_stats()
    assert dev.memory_stats().peak_allocated_bytes == 2 * GiB
    dev.close()
    assert fake_cuda.fractions[1] == 1.0


def test_enter_makes_the_device_current(fake_cuda: FakeAcceleratorModule) -> None:
    dev = CudaDevice(1)
    with dev:
        assert fake_cuda.device_stack == [1]
    assert fake_cuda.device_stack == []


def test_close_gives_idle_registered_blocks_back(cudart: FakeCudart) -> None:
    dev = CudaDevice(0, host_budget="64MiB", block_size="1MiB")
    buffer = dev.allocate(4096, Tier.PINNED)
    del buffer
    assert cudart.unregistered == [] and dev.pinned_pool.reserved_bytes == 1 << 20  # kept for reuse
    dev.close()
    gc.collect()
    assert list(cudart.registered) == cudart.unregistered and dev.pinned_pool.reserved_bytes == 0
