"""The shared torch-accelerator adapter (offcore_accelerator) on a CPU stand-in module.

What runs here without hardware: option checks, stream/event plumbing, the pinned
pool and its lifetime rule, the copy paths (direct, staged pageable, host-to-host),
byte-exact reinterpretation, memory statistics and the capacity cap. What needs a
GPU/NPU (asynchronous DMA, real events) is the conformance suite's job on hardware.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fake_accelerator import FakeAcceleratorDevice, FakeAcceleratorModule, GiB  # noqa: E402
from offcore_accelerator import (  # noqa: E402
    AcceleratorOptions,
    PinnedHostPool,
    match_layout,
    tensor_over,
    typed_view,
)

import offcore  # noqa: E402
from offcore import Tier  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> FakeAcceleratorModule:
    fake = FakeAcceleratorModule(count=2, total=16 * GiB)
    monkeypatch.setattr(FakeAcceleratorDevice, "module", fake, raising=False)
    return fake


@pytest.fixture
def dev(module: FakeAcceleratorModule) -> Any:
    device = FakeAcceleratorDevice(1, host_budget="64MiB", block_size="4MiB")
    yield device
    device.close()


def _bytes(tensor: Any) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"host_budget": "-1"}, "host_budget"),
        ({"host_budget": 0}, "host_budget"),
        ({"block_size": "64MB/s"}, "block_size"),
        ({"capacity": "lots"}, "capacity"),
        ({"stage_pageable": "yes"}, "stage_pageable"),
        ({"colour": "red"}, "unknown option"),
    ],
)
def test_bad_options_are_refused_before_any_device_call(
    module: FakeAcceleratorModule, options: dict[str, Any], message: str
) -> None:
    module.available = False  # an option error must win over "unavailable": it is checked first
    with pytest.raises(offcore.ConfigurationError, match=message):
        FakeAcceleratorDevice(0, **options)


def test_fake_device_options_get_a_hint() -> None:
    with pytest.raises(offcore.ConfigurationError, match="cpu fake device") as caught:
        AcceleratorOptions.parse("cuda", h2d_bandwidth="32GiB/s")
    assert "host_budget" in str(caught.value)  # the message lists the known options


@pytest.mark.parametrize("index", [-1, True, "1", 1.0])
def test_bad_index(module: FakeAcceleratorModule, index: Any) -> None:
    with pytest.raises(offcore.ConfigurationError, match="index"):
        FakeAcceleratorDevice(index)


def test_index_beyond_the_device_count(module: FakeAcceleratorModule) -> None:
    with pytest.raises(offcore.ConfigurationError, match=r"2 fakeacc device\(s\), indices 0\.\.1"):
        FakeAcceleratorDevice(2)


def test_unavailable_backend_raises_with_its_reason(module: FakeAcceleratorModule) -> None:
    module.available = False
    with pytest.raises(offcore.BackendUnavailableError, match="switched off"):
        FakeAcceleratorDevice(0)


def test_default_host_budget_is_bounded() -> None:
    budget = AcceleratorOptions.parse("cuda").host_budget
    assert 64 * MiB <= budget <= 8 * GiB


# --------------------------------------------------------------------------- capacity cap


def test_capacity_caps_the_allocator_and_is_undone(module: FakeAcceleratorModule) -> None:
    module.fractions[1] = 0.5  # a fraction the user had set before
    device = FakeAcceleratorDevice(1, capacity="4GiB")
    assert device.capacity == 4 * GiB
    assert module.fractions[1] == pytest.approx(4 / 16)
    assert device.memory_stats().capacity_bytes == 4 * GiB
    device.close()
    assert module.fractions[1] == 0.5


def test_capacity_cap_is_undone_when_the_device_is_collected(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0, capacity=GiB)
    assert module.fractions[0] == pytest.approx(1 / 16)
    del device
    gc.collect()
    assert module.fractions[0] == 1.0


def test_capacity_above_the_hardware_is_refused(module: FakeAcceleratorModule) -> None:
    with pytest.raises(offcore.ConfigurationError, match="exceeds"):
        FakeAcceleratorDevice(0, capacity="17GiB")


def test_out_of_memory_reported_as_a_plain_runtime_error_becomes_out_of_memory_error(
    module: FakeAcceleratorModule,
) -> None:
    """Some runtimes raise RuntimeError("... out of memory ..."): the adapter raises torch.OutOfMemoryError."""
    device = FakeAcceleratorDevice(0, capacity="8MiB")
    module.oom_as_runtime_error = True
    with pytest.raises(torch.OutOfMemoryError, match=r"fakeacc:0 out of memory allocating 16\.00 MiB") as caught:
        device.allocate(16 * MiB, Tier.DEVICE)
    assert isinstance(caught.value.__cause__, RuntimeError)
    kept = device.allocate(4 * MiB, Tier.DEVICE)
    assert device.memory_stats().allocated_bytes == 4 * MiB
    del kept
    assert device.memory_stats().allocated_bytes == 0, "freed when its storage died"


def test_without_capacity_the_whole_device_and_no_cap(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0)
    assert device.capacity == 16 * GiB and module.fractions == [1.0, 1.0]


# --------------------------------------------------------------------------- streams, events, context


def test_current_stream_is_read_at_each_call(dev: Any, module: FakeAcceleratorModule) -> None:
    first = dev.current_stream()
    other = module.Stream()
    module.set_current(other)
    assert dev.current_stream() is other and first is not other


def test_new_stream_and_event_pass_their_arguments(dev: Any) -> None:
    stream = dev.new_stream(priority=-1)
    assert (stream.device, stream.priority) == (1, -1)
    assert dev.new_event(enable_timing=True).enable_timing is True
    assert dev.new_event().enable_timing is False
    with pytest.raises(offcore.ConfigurationError, match="priority"):
        dev.new_stream(priority="high")


def test_with_device_enters_the_module_device_context(dev: Any, module: FakeAcceleratorModule) -> None:
    with dev as active:
        assert active is dev and module.device_stack == [1]
        with dev:
            assert module.device_stack == [1, 1]
        assert module.device_stack == [1]
    assert module.device_stack == []


def test_satisfies_the_backend_protocol(dev: Any) -> None:
    assert isinstance(dev, offcore.Backend)
    assert isinstance(dev.new_stream(), offcore.Stream)
    assert isinstance(dev.new_event(), offcore.Event)


# --------------------------------------------------------------------------- allocation


def test_allocate_tiers(dev: Any) -> None:
    for tier in (Tier.DEVICE, Tier.PINNED, Tier.PAGEABLE):
        raw = dev.allocate(1000, tier)
        assert raw.dtype == torch.uint8 and tuple(raw.shape) == (1000,), tier
        assert dev.holds(raw) is (tier is Tier.DEVICE), tier
        assert dev._is_pinned(raw) is (tier is Tier.PINNED), tier


@pytest.mark.parametrize("nbytes", [0, -5, True, 1.5])
def test_allocate_refuses_bad_sizes(dev: Any, nbytes: Any) -> None:
    with pytest.raises(offcore.ConfigurationError, match="positive number of bytes"):
        dev.allocate(nbytes, Tier.PINNED)


def test_allocate_refuses_nvme(dev: Any) -> None:
    with pytest.raises(offcore.ConfigurationError, match="NVMe"):
        dev.allocate(1024, Tier.NVME)


def test_pinned_buffer_returns_to_the_pool_when_its_last_view_dies(dev: Any) -> None:
    pool = dev.pinned_pool
    raw = dev.allocate(4096, Tier.PINNED)
    assert pool.used_bytes == 4096
    typed = raw.view(torch.float32).view(32, 32)  # a view made from it outlives the raw buffer
    del raw
    gc.collect()
    assert pool.used_bytes == 4096, "released while a view still used the memory"
    typed.fill_(1.5)
    again = dev.allocate(4096, Tier.PINNED)
    assert again.data_ptr() != typed.data_ptr(), "the slot was handed out twice"
    del typed
    assert pool.used_bytes == 4096  # only `again` is left
    del again
    assert pool.used_bytes == 0


def test_a_finalizer_never_waits_for_the_pool(dev: Any) -> None:
    """The last view of a pinned buffer may die while the pool is busy (e.g. GC inside acquire)."""
    import threading

    holder = [dev.allocate(4096, Tier.PINNED)]
    worker = threading.Thread(target=holder.clear)  # the buffer's last reference dies in the worker
    with dev._slots.guard:  # the pool is busy
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive(), "the storage finalizer blocked on the pool's lock"
        assert dev.pinned_pool.used_bytes == 4096  # queued, not yet returned
    assert dev.memory_stats()["pinned_used_bytes"] == 0  # the next pool operation returns it


def test_pinned_buffers_are_exact_size_slices_of_few_blocks(dev: Any) -> None:
    buffers = [dev.allocate(size, Tier.PINNED) for size in (1000, 3000, 70_000, 512)]
    assert [b.numel() for b in buffers] == [1000, 3000, 70_000, 512]
    assert dev.pinned_block_sizes == [4 * MiB], "small buffers must share one block, not pin memory each"


def test_pinned_ranges_are_forgotten_with_their_blocks(dev: Any) -> None:
    raw = dev.allocate(4096, Tier.PINNED)
    inside = raw[100:]
    assert dev._is_pinned(inside) and len(dev._pinned_ranges) == 1
    assert not dev._pinned_ranges.holds(raw.untyped_storage().data_ptr() + dev.pinned_block_sizes[0])
    del raw, inside
    dev.pinned_pool.trim()
    gc.collect()
    assert len(dev._pinned_ranges) == 0


def test_pinned_budget_is_enforced(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0, host_budget="1MiB", block_size="1MiB")
    held = device.allocate(768 * 1024, Tier.PINNED)
    with pytest.raises(offcore.CapacityExceededError, match="budget"):
        device.allocate(512 * 1024, Tier.PINNED)
    del held


# --------------------------------------------------------------------------- pinned budget counts what is pinned


def test_a_non_power_of_two_block_size_is_rounded_up_to_what_the_allocator_pins(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0, host_budget="64MiB", block_size="3MiB")
    held = device.allocate(1000, Tier.PINNED)
    assert device.pinned_block_sizes == [4 * MiB], "a 3 MiB block pins 4 MiB anyway: use all of it"
    assert device.memory_stats()["pinned_reserved_bytes"] == device.pinned_bytes == 4 * MiB
    del held


def test_the_pinned_budget_counts_power_of_two_rounding(module: FakeAcceleratorModule) -> None:
    """A buffer larger than block_size gets a block of its own, which the host allocator rounds up."""
    device = FakeAcceleratorDevice(0, host_budget="12MiB", block_size="1MiB")
    big = device.allocate(5 * MiB + 1, Tier.PINNED)  # a block of 5 MiB + 512 pins 8 MiB
    assert device.pinned_pool.reserved_bytes == device.pinned_bytes == 8 * MiB
    with pytest.raises(offcore.CapacityExceededError, match="budget"):
        device.allocate(4 * MiB + 1, Tier.PINNED)  # would pin another 8 MiB: 16 MiB of a 12 MiB budget
    assert device.pinned_bytes == 8 * MiB, "nothing was pinned for the refused request"
    fits = device.allocate(3 * MiB, Tier.PINNED)  # a 3 MiB block pins 4 MiB: exactly the rest
    stats = device.memory_stats()
    assert stats["pinned_reserved_bytes"] == device.pinned_bytes == 12 * MiB == stats["pinned_budget_bytes"]
    del big, fits
    device.pinned_pool.trim()
    gc.collect()
    assert device.pinned_pool.reserved_bytes == device.pinned_bytes == 0


def test_the_last_block_is_sized_so_that_what_it_pins_fits(module: FakeAcceleratorModule) -> None:
    """Budget 3 MiB: the rest-of-budget block is 2 MiB (pins 2 MiB), not 3 MiB (would pin 4 MiB)."""
    device = FakeAcceleratorDevice(0, host_budget="3MiB", block_size="4MiB")
    first = device.allocate(MiB, Tier.PINNED)
    second = device.allocate(MiB, Tier.PINNED)
    third = device.allocate(MiB // 2, Tier.PINNED)
    assert device.pinned_block_sizes == [2 * MiB, MiB]
    assert device.pinned_bytes == device.pinned_pool.reserved_bytes == 3 * MiB
    with pytest.raises(offcore.CapacityExceededError, match="budget"):
        device.allocate(MiB, Tier.PINNED)
    del first, second, third


def test_a_standalone_pinned_pool_counts_rounding_too(dev: Any) -> None:
    pool = dev.host_pool("12MiB")
    buffer = pool.acquire(5 * MiB)
    assert pool.reserved_bytes == 8 * MiB and dev.pinned_pool.reserved_bytes == 0
    with pytest.raises(offcore.CapacityExceededError, match="budget"):
        pool.acquire(5 * MiB)
    pool.release(buffer)
    pool.trim()
    assert pool.reserved_bytes == 0


def test_pinned_pool_with_exact_footprint_is_a_plain_pool() -> None:
    import numpy as np

    pool = PinnedHostPool(lambda n: np.zeros(n, np.uint8), footprint=lambda n: n, budget=3 * MiB, block_size=2 * MiB)
    a, b = pool.acquire(2 * MiB), pool.acquire(MiB)
    assert pool.reserved_bytes == 3 * MiB
    pool.release(a)
    pool.release(b)


def test_host_pool_hands_out_pinned_or_pageable_blocks(dev: Any) -> None:
    pinned = dev.host_pool("8MiB")
    pageable = dev.host_pool("8MiB", pinned=False)
    a, b = pinned.acquire(1000), pageable.acquire(1000)
    assert dev._is_pinned(a.view) and not dev._is_pinned(b.view)
    assert a.nbytes == b.nbytes == 1000
    pinned.release(a)
    pageable.release(b)


# --------------------------------------------------------------------------- copies


def test_h2d_from_pinned_is_one_async_copy_on_the_stream(dev: Any, module: FakeAcceleratorModule) -> None:
    src = typed_view(dev.allocate(4 * 6 * 5, Tier.PINNED), torch.float32, (6, 5))
    src.copy_(torch.randn(6, 5))
    dst = dev.to_device(torch.zeros(6, 5))
    stream = dev.new_stream()
    event = dev.copy_(dst, src, stream=stream)
    assert module.stream_log == [stream], "the copy must be enqueued inside the stream context"
    assert event.stream is stream and dev.staged_copies == 0
    assert _bytes(dst) == _bytes(src)


def test_a_batch_of_pinned_copies_is_one_stream_context_and_one_event(dev: Any, module: FakeAcceleratorModule) -> None:
    """Note [A batch of pinned copies records one event]: pinned <-> device pairs, in order, one event."""
    host = dev.allocate(4 * 16 * 3, Tier.PINNED)
    slices = [typed_view(host[i * 64 : (i + 1) * 64], torch.float32, (16,)) for i in range(3)]
    for i, piece in enumerate(slices):
        piece.copy_(torch.full((16,), float(i)))
    targets = [dev.to_device(torch.zeros(16)) for _ in range(3)]
    back = [typed_view(dev.allocate(64, Tier.PINNED), torch.float32, (16,)) for _ in range(3)]
    stream = dev.new_stream()
    events = len(module.stream_log)
    made = []
    module.Event = lambda *a, **k: made.append(1) or module._make_event(*a, **k)
    up = dev.copy_many(list(zip(targets, slices, strict=True)), stream=stream)
    down = dev.copy_many(list(zip(back, targets, strict=True)), stream=stream)
    assert module.stream_log[events:] == [stream, stream], "one stream context per batch"
    assert len(made) == 2 and up.stream is stream and down.stream is stream, "one event per batch"
    assert [_bytes(b) for b in back] == [_bytes(s) for s in slices]


def test_a_batch_with_a_pageable_pair_copies_each_pair_its_own_way(dev: Any) -> None:
    pinned = typed_view(dev.allocate(64, Tier.PINNED), torch.float32, (16,))
    pinned.copy_(torch.arange(16.0))
    pageable = torch.arange(16.0) * 2
    first, second = dev.to_device(torch.zeros(16)), dev.to_device(torch.zeros(16))
    dev.copy_many([(first, pinned), (second, pageable)], stream=dev.new_stream())
    dev.synchronize()
    assert _bytes(first) == _bytes(pinned) and _bytes(second) == _bytes(pageable) and dev.staged_copies == 1
    with pytest.raises(offcore.ConfigurationError, match="at least one"):
        dev.copy_many([], stream=dev.new_stream())


def test_h2d_from_pageable_stages_and_keeps_the_buffer_until_the_event_completes(
    dev: Any, module: FakeAcceleratorModule
) -> None:
    src = torch.randn(64, 33)[:, ::2]  # pageable and non-contiguous
    dst = dev.to_device(torch.zeros(64, 17))
    stream = dev.new_stream()
    stream.hold()  # the copy is still in flight
    event = dev.copy_(dst, src, stream=stream)
    assert dev.staged_copies == 1 and not event.query()
    staged = dev.pinned_pool.used_bytes
    assert staged >= 64 * 17 * 4
    dev.copy_(dev.to_device(torch.zeros(4)), dev.to_device(torch.ones(4)), stream=stream)  # reaping runs here
    assert dev.pinned_pool.used_bytes == staged, "a staging buffer was released while its copy was in flight"
    stream.release()
    dev.synchronize()
    assert dev.pinned_pool.used_bytes == 0 and module.synchronized[-1] == 1
    assert _bytes(dst) == _bytes(src)


def test_completed_staging_buffers_are_reaped_by_the_next_copy(dev: Any) -> None:
    stream = dev.new_stream()
    dev.copy_(dev.to_device(torch.zeros(100)), torch.ones(100), stream=stream)
    used_after_first = dev.pinned_pool.used_bytes
    dev.copy_(dev.to_device(torch.zeros(100)), torch.ones(100), stream=stream)
    assert used_after_first > 0 and dev.pinned_pool.used_bytes == used_after_first  # the first came back


def test_d2h_to_pageable_stages_and_has_landed_on_return(dev: Any) -> None:
    data = torch.randn(10, 12)
    src = dev.to_device(data)
    base = torch.full((12, 10), -1.0)
    dst = base.t()  # pageable, non-contiguous
    stream = dev.new_stream()
    stream.hold()
    event = dev.copy_(dst, src, stream=stream)
    assert event.query(), "a device-to-pageable copy returns only once the bytes landed"
    assert dev.staged_copies == 1 and dev.pinned_pool.used_bytes == 0
    assert torch.equal(dst, data)


def test_without_staging_pageable_copies_go_direct(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0, stage_pageable=False)
    data = torch.randn(50)
    dst = device.to_device(torch.zeros(50))
    device.copy_(dst, data, stream=device.new_stream())
    assert (device.staged_copies, device.direct_pageable_copies) == (0, 1)
    assert device.pinned_pool.reserved_bytes == 0
    assert torch.equal(dst, data)


def test_pageable_copy_falls_back_to_direct_when_the_pool_is_full(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0, host_budget="1MiB", block_size="1MiB")
    hog = device.allocate(MiB, Tier.PINNED)
    data = torch.randn(1000)
    dst = device.to_device(torch.zeros(1000))
    device.copy_(dst, data, stream=device.new_stream())
    assert device.direct_pageable_copies == 1 and torch.equal(dst, data)
    back = torch.zeros(1000)
    assert device.copy_(back, dst, stream=device.new_stream()).query()
    assert device.direct_pageable_copies == 2 and torch.equal(back, data)
    del hog


def test_host_to_host_waits_for_the_stream_first(dev: Any) -> None:
    stream = dev.new_stream()
    stream.hold()
    earlier = stream.record_event()
    src, dst = torch.arange(10.0), torch.zeros(10)
    dev.copy_(dst, src, stream=stream)
    assert earlier.query(), "a host copy on a stream must come after the stream's earlier work"
    assert torch.equal(dst, src)


def test_device_to_device(dev: Any) -> None:
    data = torch.randn(3, 4, 5)
    src, dst = dev.to_device(data), dev.to_device(torch.zeros(3, 4, 5))
    dev.copy_(dst, src, stream=dev.new_stream())
    assert torch.equal(dst, data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_raw_host_buffer_receives_the_exact_bytes(dev: Any, dtype: Any) -> None:
    data = (torch.randn(7, 9) > 0) if dtype is torch.bool else torch.randn(7, 9).to(dtype)
    if dtype is torch.float32:
        data[0, 0], data[0, 1] = float("nan"), -0.0  # bit patterns, not values
    src = dev.to_device(data)
    raw = dev.allocate(data.numel() * data.element_size(), Tier.PINNED)
    dev.copy_(raw, src, stream=dev.new_stream()).synchronize()
    assert raw.numpy().tobytes() == _bytes(data)
    back = dev.to_device(torch.zeros_like(data))
    dev.copy_(back, raw, stream=dev.new_stream()).synchronize()
    assert _bytes(back) == _bytes(data)


def test_copy_argument_errors(dev: Any) -> None:
    stream = dev.new_stream()
    with pytest.raises(offcore.ConfigurationError, match="equal byte counts"):
        dev.copy_(torch.zeros(3), dev.to_device(torch.zeros(4)), stream=stream)
    with pytest.raises(offcore.ConfigurationError, match="contiguous"):
        dev.copy_(torch.zeros(4, 4, dtype=torch.int32).t(), torch.zeros(4, 4).t(), stream=stream)
    with pytest.raises(offcore.ConfigurationError, match="torch tensors"):
        import numpy as np

        dev.copy_(np.zeros(4), torch.zeros(4), stream=stream)
    with pytest.raises(offcore.ConfigurationError, match="meta"):
        dev.copy_(torch.zeros(4), torch.empty(4, device="meta"), stream=stream)
    with pytest.raises(offcore.ConfigurationError, match="stream"):
        dev.copy_(torch.zeros(4), torch.zeros(4), stream=None)


def test_match_layout_reinterprets_only_a_contiguous_side() -> None:
    raw = torch.zeros(24, dtype=torch.uint8)
    typed = torch.arange(6, dtype=torch.float32).view(2, 3).t()  # non-contiguous
    d, s = match_layout(raw, typed)
    assert d.dtype == torch.float32 and d.shape == s.shape and d.data_ptr() == raw.data_ptr()
    d.copy_(s)
    assert raw.view(torch.float32).tolist() == typed.reshape(-1).tolist()


# --------------------------------------------------------------------------- statistics


def test_memory_stats_come_from_the_device_module(dev: Any, module: FakeAcceleratorModule) -> None:
    module.allocated[1], module.peak[1] = 3 * MiB, 7 * MiB
    module.reserved[1], module.peak_reserved[1], module.free[1] = 10 * MiB, 12 * MiB, 5 * GiB
    module.allocated[0] = 999  # another device's figures must not leak in
    held = dev.allocate(4096, Tier.PINNED)
    stats = dev.memory_stats()
    assert isinstance(stats, offcore.MemoryStats)
    assert (stats.allocated_bytes, stats.peak_allocated_bytes, stats.capacity_bytes) == (3 * MiB, 7 * MiB, 16 * GiB)
    assert (stats["reserved_bytes"], stats["peak_reserved_bytes"]) == (10 * MiB, 12 * MiB)
    assert (stats["device_free_bytes"], stats["free_bytes"]) == (5 * GiB, 5 * GiB)
    assert (stats["pinned_used_bytes"], stats["pinned_reserved_bytes"]) == (4096, 4 * MiB)
    del held


def test_memory_stats_read_the_allocator_statistics_once(dev: Any, module: FakeAcceleratorModule) -> None:
    """torch's memory_allocated & co. each rebuild and sort the whole statistics dict: one read per call."""
    module.allocated[1], module.peak[1], module.reserved[1], module.peak_reserved[1] = 1, 2, 3, 4
    module.calls.clear()
    stats = dev.memory_stats()
    assert (stats.allocated_bytes, stats.peak_allocated_bytes) == (1, 2)
    assert (stats["reserved_bytes"], stats["peak_reserved_bytes"]) == (3, 4)
    assert module.calls == {"memory_stats_as_nested_dict": 1}, dict(module.calls)


def test_memory_stats_fall_back_to_the_flat_statistics(
    dev: Any, module: FakeAcceleratorModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device module without memory_stats_as_nested_dict: one memory_stats() read, same figures."""
    monkeypatch.delattr(FakeAcceleratorModule, "memory_stats_as_nested_dict")
    module.allocated[1], module.peak[1], module.reserved[1], module.peak_reserved[1] = 5, 6, 7, 8
    module.calls.clear()
    stats = dev.memory_stats()
    assert (stats.allocated_bytes, stats.peak_allocated_bytes, stats["reserved_bytes"]) == (5, 6, 7)
    assert stats["peak_reserved_bytes"] == 8
    assert module.calls == {"memory_stats": 1}, dict(module.calls)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
def test_memory_stats_of_an_uninitialised_allocator_are_zero(
    dev: Any, module: FakeAcceleratorModule, monkeypatch: pytest.MonkeyPatch, nested: bool
) -> None:
    """Before the first allocation torch.cuda.memory_stats_as_nested_dict returns {} (torch/cuda/memory.py)."""
    monkeypatch.setattr(module, "memory_stats_as_nested_dict", lambda device: {}, raising=False)
    if not nested:
        monkeypatch.delattr(FakeAcceleratorModule, "memory_stats_as_nested_dict")
        monkeypatch.delattr(module, "memory_stats_as_nested_dict")
        monkeypatch.setattr(module, "memory_stats", lambda device: {})
    stats = dev.memory_stats()
    assert (stats.allocated_bytes, stats.peak_allocated_bytes, stats["reserved_bytes"]) == (0, 0, 0)
    assert stats["free_bytes"] == 16 * GiB


def test_free_bytes_respects_the_capacity_cap(module: FakeAcceleratorModule) -> None:
    device = FakeAcceleratorDevice(0, capacity="1GiB")
    module.reserved[0], module.free[0] = 900 * MiB, 15 * GiB
    assert device.memory_stats()["free_bytes"] == 124 * MiB
    module.mem_get_info_raises = True  # older runtimes: derived from the reservation
    assert device.memory_stats()["device_free_bytes"] == 16 * GiB - 900 * MiB


def test_reset_peak_memory_stats(dev: Any, module: FakeAcceleratorModule) -> None:
    module.allocated[1], module.peak[1] = 2 * MiB, 9 * MiB
    held = dev.allocate(8192, Tier.PINNED)
    dropped = dev.allocate(8192, Tier.PINNED)
    del dropped
    assert dev.memory_stats()["pinned_peak_used_bytes"] == 16384
    dev.reset_peak_memory_stats()
    stats = dev.memory_stats()
    assert stats.peak_allocated_bytes == 2 * MiB and stats["pinned_peak_used_bytes"] == 8192
    del held


def test_formats_are_a_no_op_without_private_formats(dev: Any) -> None:
    tensor = dev.to_device(torch.ones(3))
    assert dev.format_of(tensor) is None
    assert dev.restore_format(tensor, None) is tensor


def test_tensor_over_frees_once_when_the_storage_dies() -> None:
    backing = torch.zeros(128, dtype=torch.uint8)
    freed: list[int] = []
    view = tensor_over(backing.data_ptr() + 64, 32, on_free=lambda: freed.append(1))[8:]
    assert view.data_ptr() == backing.data_ptr() + 72 and freed == []
    del view
    assert freed == [1]
