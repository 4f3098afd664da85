"""The backend conformance suite: one set of tests every device adapter must pass.

Subclass :class:`BackendConformance` in a test module (the class name must start
with ``Test``) and say which backend to build::

    # tests/backends/test_conformance_cpu.py
    from offcore.testing import BackendConformance

    class TestCpu(BackendConformance):
        backend_spec = "cpu"
        backend_options = {"capacity": "256MiB", "sanitize": True}

With ``backend_spec = None`` (the default) the class runs on every backend chosen
with ``--offcore-backend`` (the ``pytest_offcore`` plugin's ``backend`` fixture), so
``pytest --offcore-backend=cuda --offcore-require-backend`` runs the very same tests
on a GPU.

Buffers are handled through a :class:`~offcore.testing.buffers.BufferKit`: torch
tensors when the backend advertises :attr:`Capability.TORCH`, numpy arrays
otherwise, or what ``buffer_kind`` says. A numpy variant needs no torch at all.

Class attributes a subclass may set:

- ``backend_spec``: backend name (``"cpu"``, ``"cuda:1"``), or ``None`` for the selected backends.
- ``backend_options``: keyword options for :func:`offcore.device`.
- ``buffer_kind``: ``"torch"``, ``"numpy"`` or ``None`` (from the capabilities).
- ``hypothesis_examples``: examples for the randomised copy test;
  ``hypothesis_derandomize``: draw the same examples on every run.
- ``max_fill_bytes``: the device-filling capacity test runs only when the device's
  capacity is at most this (so it never fills a real 141 GB GPU).
- ``allocation_granularity``: the device allocator's rounding (sizes used in the
  memory-statistics tests are multiples of it).
"""

from __future__ import annotations

import gc
import math
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offcore.errors import CapacityExceededError
from offcore.kinds import Tier
from offcore.pool import HostBuffer
from offcore.protocols import OPTIONAL_MEMBERS, Availability, Backend, Capability, Event, MemoryStats, Stream
from offcore.testing.buffers import BufferKit, buffer_kit_for

__all__ = ["BackendConformance", "LAYOUTS", "TIER_PAIRS", "out_of_memory_errors"]

Shape = tuple[int, ...]

MiB = 1 << 20

LAYOUTS: tuple[str, ...] = ("contiguous", "transposed", "strided", "offset")
"""How a buffer sits in the memory it was carved from (see :func:`_apply_layout`)."""

HOST_TIERS: tuple[Tier, ...] = (Tier.PINNED, Tier.PAGEABLE)
TIER_PAIRS: tuple[tuple[Tier, Tier], ...] = tuple(
    (src, dst) for src in (Tier.DEVICE, *HOST_TIERS) for dst in (Tier.DEVICE, *HOST_TIERS)
)
"""Every (source tier, destination tier): H2D, D2H, D2D and H2H, pinned and pageable."""

_PAIR_IDS = [f"{src.value}-to-{dst.value}" for src, dst in TIER_PAIRS]


def out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """The errors a full device may raise: offcore's, and torch's when torch is already imported."""
    errors: list[type[BaseException]] = [CapacityExceededError]
    torch = sys.modules.get("torch")
    if torch is not None:
        for owner in (torch, getattr(torch, "cuda", None)):
            error = getattr(owner, "OutOfMemoryError", None)
            if isinstance(error, type) and error not in errors:
                errors.append(error)
    return tuple(errors)


# --------------------------------------------------------------------------- layouts


def _layout_fits(layout: str, shape: Shape) -> bool:
    if layout == "transposed":
        return len(shape) >= 2
    if layout in ("strided", "offset"):
        return len(shape) >= 1
    return True


def _base_shape(layout: str, shape: Shape) -> Shape:
    """Shape of the memory a ``layout`` view of ``shape`` is carved from."""
    if layout == "contiguous":
        return shape
    if layout == "transposed":
        return (*shape[:-2], shape[-1], shape[-2])
    if layout == "strided":
        return (*shape[:-1], 2 * shape[-1])
    if layout == "offset":
        return (shape[0] + 1, *shape[1:])
    raise ValueError(f"unknown layout {layout!r}")


def _apply_layout(layout: str, base: Any, swap_last_axes: Callable[[Any], Any]) -> Any:
    """The view of ``base`` that ``layout`` names; works on torch tensors and numpy arrays alike."""
    if layout == "contiguous":
        return base
    if layout == "transposed":
        return swap_last_axes(base)
    if layout == "strided":
        return base[..., ::2]
    if layout == "offset":
        return base[1:]
    raise ValueError(f"unknown layout {layout!r}")


def _reference_dtype(itemsize: int) -> np.dtype:
    """An unsigned integer dtype of ``itemsize`` bytes: moves bit patterns of any dtype in numpy."""
    return np.dtype(f"u{itemsize}")


def _flipped(data: np.ndarray, dtype: str) -> np.ndarray:
    """Bytes that differ from ``data`` in every element (valid bools stay valid)."""
    return (1 - data).astype(np.uint8) if dtype == "bool" else data ^ np.uint8(0xFF)


# --------------------------------------------------------------------------- helpers


class _Buffers:
    """Allocation and copy helpers bound to one backend and one buffer kit."""

    def __init__(self, backend: Any, kit: BufferKit, rng: np.random.Generator) -> None:
        self.backend = backend
        self.kit = kit
        self.rng = rng

    def empty(self, tier: Tier, dtype: str, shape: Shape) -> Any:
        nbytes = self.kit.nbytes_of(dtype, shape)
        return self.kit.typed(self.backend.allocate(max(nbytes, 1), tier), dtype, shape)

    def filled(self, tier: Tier, dtype: str, shape: Shape) -> Any:
        buffer = self.empty(tier, dtype, shape)
        self.kit.write(buffer, self.kit.random_bytes(self.rng, dtype, math.prod(shape)))
        return buffer

    def copy_stream(self) -> Any:
        """A new stream ordered after everything enqueued so far on the current stream.

        The suite fills buffers through the framework (on the current stream), so
        copy streams must wait for it, as a real producer/consumer would.
        """
        stream = self.backend.new_stream()
        stream.wait_stream(self.backend.current_stream())
        return stream

    def check_copy(
        self,
        *,
        src_tier: Tier,
        dst_tier: Tier,
        dtype: str,
        shape: Shape,
        src_layout: str = "contiguous",
        dst_layout: str = "contiguous",
    ) -> None:
        """Copy a random ``src`` into ``dst`` through the backend and check every byte.

        Checks that the destination view holds the source's exact bit patterns, that
        the bytes of the destination's memory outside the view are untouched, and
        that the source is unchanged.
        """
        kit = self.kit
        label = (
            f"{dtype}{list(shape)} {src_tier.value}({src_layout}) -> {dst_tier.value}({dst_layout}) "
            f"on {type(self.backend).__name__}"
        )
        src_base = self.filled(src_tier, dtype, _base_shape(src_layout, shape))
        src = _apply_layout(src_layout, src_base, kit.swap_last_axes)
        dst_base_shape = _base_shape(dst_layout, shape)
        dst_base = self.filled(dst_tier, dtype, dst_base_shape)
        dst = _apply_layout(dst_layout, dst_base, kit.swap_last_axes)
        assert tuple(src.shape) == tuple(dst.shape) == shape, label

        expected_view = kit.read(src)
        kit.write(dst, _flipped(expected_view, dtype))  # so an untouched destination cannot pass
        src_before = kit.read(src_base)
        reference = _reference_dtype(kit.itemsize(dtype))
        expected_base = kit.read(dst_base).view(reference).reshape(dst_base_shape)
        _apply_layout(dst_layout, expected_base, lambda a: np.swapaxes(a, -1, -2))[...] = expected_view.view(
            reference
        ).reshape(shape)

        event = self.backend.copy_(dst, src, stream=self.copy_stream())
        assert isinstance(event, Event), f"copy_ must return an Event, got {type(event).__name__} ({label})"
        event.synchronize()
        assert event.query(), f"event still pending after synchronize() ({label})"

        np.testing.assert_array_equal(kit.read(dst), expected_view, err_msg=f"destination differs: {label}")
        np.testing.assert_array_equal(
            kit.read(dst_base),
            expected_base.reshape(-1).view(np.uint8),
            err_msg=f"bytes outside the destination view changed: {label}",
        )
        np.testing.assert_array_equal(kit.read(src_base), src_before, err_msg=f"source changed: {label}")


@contextmanager
def _active(backend: Any) -> Iterator[Any]:
    """``with backend:`` and a collection, so memory figures count only live buffers."""
    with backend:
        gc.collect()
        backend.synchronize()
        yield backend


def _shapes() -> st.SearchStrategy[Shape]:
    return st.lists(st.integers(min_value=1, max_value=9), min_size=0, max_size=4).map(tuple)


# --------------------------------------------------------------------------- the suite


class BackendConformance:
    """Abstract conformance tests for one backend; subclass as ``Test...`` to run them."""

    backend_spec: ClassVar[str | None] = None
    backend_options: ClassVar[dict[str, Any]] = {}
    buffer_kind: ClassVar[str | None] = None
    hypothesis_examples: ClassVar[int] = 40
    hypothesis_derandomize: ClassVar[bool] = False
    max_fill_bytes: ClassVar[int] = 1 << 30
    allocation_granularity: ClassVar[int] = 512

    # ------------------------------------------------------------------ fixtures

    @pytest.fixture(autouse=True)
    def _buffer_framework(self) -> None:
        """Skip cleanly (before the backend is built) when the buffer framework is missing."""
        if self.buffer_kind == "torch":
            pytest.importorskip("torch", reason="this conformance variant moves torch tensors")

    @pytest.fixture
    def kit(self, backend: Any) -> BufferKit:
        """The buffer kit matching ``backend`` (or ``buffer_kind``)."""
        return buffer_kit_for(backend, self.buffer_kind)

    @pytest.fixture
    def buffers(self, backend: Any, kit: BufferKit) -> _Buffers:
        return _Buffers(backend, kit, np.random.default_rng(20240601))

    # ------------------------------------------------------------------ identity and capabilities

    def test_availability_never_raises_and_says_available(self, backend: Any) -> None:
        status = type(backend).availability()
        assert isinstance(status, Availability)
        assert status.available and bool(status), f"a constructed backend reports unavailable: {status.reason}"
        assert status.device_count >= 1

    def test_registered_under_its_name(self, backend: Any, backend_name: str) -> None:
        assert type(backend).name == backend_name.partition(":")[0]

    def test_satisfies_the_protocols(self, backend: Any) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.current_stream(), Stream)
        assert isinstance(backend.new_stream(), Stream)
        assert isinstance(backend.new_event(), Event)
        assert isinstance(backend.new_event(enable_timing=True), Event)

    def test_capabilities_are_consistent(self, backend: Any, kit: BufferKit) -> None:
        capabilities = backend.capabilities
        assert isinstance(capabilities, frozenset)
        assert all(isinstance(c, Capability) for c in capabilities), capabilities
        assert (Capability.TORCH if kit.kind == "torch" else Capability.NUMPY) in capabilities, (
            f"the suite moves {kit.kind} buffers but the backend does not advertise them: {sorted(capabilities)}"
        )
        if Capability.TORCH in capabilities:
            torch = pytest.importorskip("torch")
            assert isinstance(backend.torch_device, torch.device)
        for tier in (Tier.DEVICE, *HOST_TIERS):
            raw = backend.allocate(4096, tier)
            assert kit.is_raw(raw), f"allocate(..., {tier.value}) must return a 1-D uint8 buffer, got {raw!r}"
            assert kit.nbytes(raw) == 4096
            assert backend.holds(raw) is (tier is Tier.DEVICE), f"holds() is wrong for a {tier.value} buffer"
            if kit.kind == "torch" and tier is Tier.DEVICE:
                assert raw.device.type == backend.torch_device.type

    def test_advertised_capabilities_bring_their_members(self, backend: Any, kit: BufferKit) -> None:
        capabilities = backend.capabilities
        for member, capability in OPTIONAL_MEMBERS.items():
            if capability is not None and capability in capabilities:
                assert callable(getattr(backend, member, None)) or member == "torch_device", (
                    f"{type(backend).__name__} advertises {capability.name} but has no {member}()"
                )
        if Capability.SANITIZER in capabilities:
            host = backend.allocate(64, Tier.PINNED)
            kit.write(host, np.zeros(64, np.uint8))
            backend.poison(host)
            assert (kit.read(host) == 0xFF).all(), "poison() must overwrite every byte with 0xFF"
        if Capability.PRIVATE_FORMATS in capabilities:
            raw = backend.allocate(64, Tier.DEVICE)
            kit.write(raw, np.arange(64, dtype=np.uint8))
            restored = backend.restore_format(raw, backend.format_of(raw))
            np.testing.assert_array_equal(kit.read(restored), np.arange(64, dtype=np.uint8))

    # ------------------------------------------------------------------ exact copies

    @pytest.mark.parametrize(("src_tier", "dst_tier"), TIER_PAIRS, ids=_PAIR_IDS)
    def test_copy_is_exact_for_every_dtype(
        self, buffers: _Buffers, kit: BufferKit, src_tier: Tier, dst_tier: Tier
    ) -> None:
        for dtype in kit.dtypes:
            buffers.check_copy(src_tier=src_tier, dst_tier=dst_tier, dtype=dtype, shape=(3, 5, 7))

    @pytest.mark.parametrize(
        ("src_tier", "dst_tier"),
        [
            (Tier.PINNED, Tier.DEVICE),
            (Tier.DEVICE, Tier.PINNED),
            (Tier.DEVICE, Tier.DEVICE),
            (Tier.PINNED, Tier.PAGEABLE),
        ],
        ids=["h2d", "d2h", "d2d", "h2h"],
    )
    @pytest.mark.parametrize("layout", LAYOUTS[1:])
    def test_copy_is_exact_for_non_contiguous_views(
        self, buffers: _Buffers, kit: BufferKit, src_tier: Tier, dst_tier: Tier, layout: str
    ) -> None:
        for dtype in ("float32", "int64", "bool", "uint8"):
            buffers.check_copy(src_tier=src_tier, dst_tier=dst_tier, dtype=dtype, shape=(6, 10), src_layout=layout)
            buffers.check_copy(src_tier=src_tier, dst_tier=dst_tier, dtype=dtype, shape=(6, 10), dst_layout=layout)

    def test_copy_is_exact_for_random_shapes_and_layouts(self, buffers: _Buffers, kit: BufferKit) -> None:
        @settings(
            max_examples=self.hypothesis_examples,
            derandomize=self.hypothesis_derandomize,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            shape = data.draw(_shapes(), label="shape")
            dtype = data.draw(st.sampled_from(kit.dtypes), label="dtype")
            src_tier, dst_tier = data.draw(st.sampled_from(TIER_PAIRS), label="tiers")
            fitting = [layout for layout in LAYOUTS if _layout_fits(layout, shape)]
            src_layout = data.draw(st.sampled_from(fitting), label="src_layout")
            dst_layout = data.draw(st.sampled_from(fitting), label="dst_layout")
            buffers.check_copy(
                src_tier=src_tier,
                dst_tier=dst_tier,
                dtype=dtype,
                shape=shape,
                src_layout=src_layout,
                dst_layout=dst_layout,
            )

        check()

    def test_copy_on_the_current_stream(self, backend: Any, buffers: _Buffers, kit: BufferKit) -> None:
        src = buffers.filled(Tier.PINNED, "float32", (128,))
        dst = buffers.empty(Tier.DEVICE, "float32", (128,))
        backend.copy_(dst, src, stream=backend.current_stream())
        backend.current_stream().synchronize()
        np.testing.assert_array_equal(kit.read(dst), kit.read(src))

    # ------------------------------------------------------------------ ordering on one stream

    def test_one_stream_runs_copies_in_order_last_write_wins(
        self, backend: Any, buffers: _Buffers, kit: BufferKit
    ) -> None:
        shape = (256, 256)
        sources = [buffers.filled(Tier.PINNED, "float32", shape) for _ in range(12)]
        dst = buffers.empty(Tier.DEVICE, "float32", shape)
        stream = buffers.copy_stream()
        events = [backend.copy_(dst, src, stream=stream) for src in sources]
        events[-1].synchronize()
        assert all(event.query() for event in events), "an earlier copy's event is pending after a later one completed"
        np.testing.assert_array_equal(kit.read(dst), kit.read(sources[-1]), err_msg="the last queued copy must win")

    def test_one_stream_orders_dependent_copies(self, backend: Any, buffers: _Buffers, kit: BufferKit) -> None:
        shape = (512, 256)
        origin = buffers.filled(Tier.PINNED, "float32", shape)
        first = buffers.empty(Tier.DEVICE, "float32", shape)
        second = buffers.empty(Tier.DEVICE, "float32", shape)
        back = buffers.empty(Tier.PAGEABLE, "float32", shape)
        stream = buffers.copy_stream()
        backend.copy_(first, origin, stream=stream)
        backend.copy_(second, first, stream=stream)
        done = backend.copy_(back, second, stream=stream)
        done.synchronize()
        np.testing.assert_array_equal(kit.read(back), kit.read(origin))

    # ------------------------------------------------------------------ cross-stream waits

    @pytest.mark.parametrize("how", ["wait_event", "event_wait", "record_event", "event_record", "wait_stream"])
    def test_cross_stream_wait_orders_the_consumer(
        self, backend: Any, buffers: _Buffers, kit: BufferKit, how: str
    ) -> None:
        shape = (1024, 1024)  # 4 MiB: long enough on an emulated link for a missing wait to show
        origin = buffers.filled(Tier.PINNED, "float32", shape)
        staged = buffers.empty(Tier.DEVICE, "float32", shape)
        landed = buffers.filled(Tier.PINNED, "float32", shape)
        producer = buffers.copy_stream()
        consumer = backend.new_stream()
        produced = backend.copy_(staged, origin, stream=producer)
        if how == "wait_event":
            consumer.wait_event(produced)
        elif how == "event_wait":
            produced.wait(consumer)
        elif how == "record_event":
            consumer.wait_event(producer.record_event())
        elif how == "event_record":
            marker = backend.new_event()
            marker.record(producer)
            consumer.wait_event(marker)
        else:
            consumer.wait_stream(producer)
        done = backend.copy_(landed, staged, stream=consumer)
        done.synchronize()
        assert produced.query(), "the consumer finished before the copy it waited for"
        np.testing.assert_array_equal(kit.read(landed), kit.read(origin))

    # ------------------------------------------------------------------ events

    def test_unrecorded_event_counts_as_complete(self, backend: Any) -> None:
        event = backend.new_event()
        assert event.query() is True
        event.synchronize()

    def test_stream_and_backend_synchronize_complete_all_work(
        self, backend: Any, buffers: _Buffers, kit: BufferKit
    ) -> None:
        shape = (512, 512)
        pairs = [(buffers.filled(Tier.PINNED, "float32", shape), buffers.empty(Tier.DEVICE, "float32", shape))]
        pairs.append((buffers.filled(Tier.DEVICE, "float32", shape), buffers.empty(Tier.PINNED, "float32", shape)))
        streams = [buffers.copy_stream(), buffers.copy_stream()]
        events = [backend.copy_(dst, src, stream=s) for (src, dst), s in zip(pairs, streams, strict=True)]
        streams[0].synchronize()
        assert streams[0].query() and events[0].query()
        backend.synchronize()
        assert all(s.query() for s in streams) and all(e.query() for e in events)
        for src, dst in pairs:
            np.testing.assert_array_equal(kit.read(dst), kit.read(src))

    def test_recorded_event_captures_the_work_enqueued_before_it(
        self, backend: Any, buffers: _Buffers, kit: BufferKit
    ) -> None:
        shape = (256, 256)
        stream = buffers.copy_stream()
        marker = stream.record_event()
        assert isinstance(marker, Event)
        for _ in range(2):  # an event may be recorded again
            src = buffers.filled(Tier.PINNED, "float32", shape)
            dst = buffers.empty(Tier.DEVICE, "float32", shape)
            backend.copy_(dst, src, stream=stream)
            marker.record(stream)
            marker.synchronize()
            assert marker.query()
            np.testing.assert_array_equal(kit.read(dst), kit.read(src))

    def test_event_timing(self, backend: Any, buffers: _Buffers) -> None:
        if Capability.EVENT_TIMING not in backend.capabilities:
            pytest.skip(f"{type(backend).__name__} does not advertise event timing")
        stream = buffers.copy_stream()
        start = backend.new_event(enable_timing=True)
        end = backend.new_event(enable_timing=True)
        start.record(stream)
        backend.copy_(
            buffers.empty(Tier.DEVICE, "float32", (1024, 256)),
            buffers.filled(Tier.PINNED, "float32", (1024, 256)),
            stream=stream,
        )
        end.record(stream)
        end.synchronize()
        elapsed = start.elapsed_time(end)
        assert isinstance(elapsed, float) and math.isfinite(elapsed) and elapsed >= 0.0, elapsed

    def test_a_start_event_times_the_copy_alone(self, backend: Any, buffers: _Buffers) -> None:
        if Capability.EVENT_TIMING not in backend.capabilities:
            pytest.skip(f"{type(backend).__name__} does not advertise event timing")
        stream = buffers.copy_stream()
        start = backend.new_event(enable_timing=True)
        src = buffers.filled(Tier.PINNED, "float32", (1024, 256))
        dst = buffers.empty(Tier.DEVICE, "float32", (1024, 256))
        end = backend.new_event(enable_timing=True)
        backend.copy_(dst, src, stream=stream, start_event=start)
        end.record(stream)
        end.synchronize()
        assert start.query(), "copy_ recorded the start event on the stream"
        elapsed = start.elapsed_time(end)
        assert isinstance(elapsed, float) and math.isfinite(elapsed) and elapsed >= 0.0, elapsed
        np.testing.assert_array_equal(buffers.kit.read(dst), buffers.kit.read(src))

    def test_elapsed_time_needs_timing_events(self, backend: Any) -> None:
        stream = backend.new_stream()
        start, end = backend.new_event(), backend.new_event()
        start.record(stream)
        end.record(stream)
        end.synchronize()
        with pytest.raises(Exception, match="(?i)timing"):
            start.elapsed_time(end)

    # ------------------------------------------------------------------ capacity

    def test_allocation_beyond_capacity_raises_a_clear_out_of_memory_error(self, backend: Any) -> None:
        capacity = backend.memory_stats().capacity_bytes
        assert capacity > 0
        request = capacity + 64 * MiB
        with pytest.raises(out_of_memory_errors()) as caught:
            backend.allocate(request, Tier.DEVICE)
        message = str(caught.value)
        assert re.search(r"(?i)memory|capacity", message) and re.search(r"\d", message), (
            f"the out-of-memory message should say how much was asked and what is available: {message!r}"
        )
        assert _small_allocation_still_works(backend)

    def test_filling_the_device_raises_and_freeing_makes_room(self, backend: Any) -> None:
        capacity = backend.memory_stats().capacity_bytes
        if capacity > self.max_fill_bytes:
            pytest.skip(f"capacity {capacity} bytes is above max_fill_bytes={self.max_fill_bytes}")
        granularity = self.allocation_granularity
        with _active(backend):
            room = capacity - backend.memory_stats().allocated_bytes
            half = room // 2 // granularity * granularity
            assert half >= 2 * granularity, f"too little free device memory to test ({room} bytes)"
            first = backend.allocate(half, Tier.DEVICE)
            second = backend.allocate(half, Tier.DEVICE)
            with pytest.raises(out_of_memory_errors()):
                backend.allocate(half, Tier.DEVICE)
            del first
            gc.collect()
            third = backend.allocate(half, Tier.DEVICE)
            del second, third
            gc.collect()

    # ------------------------------------------------------------------ memory statistics

    def test_memory_stats_count_device_allocations(self, backend: Any) -> None:
        nbytes = 4 * MiB
        assert nbytes % self.allocation_granularity == 0
        with _active(backend):
            stats = backend.memory_stats()
            assert isinstance(stats, MemoryStats)
            before = stats.allocated_bytes
            buffer = backend.allocate(nbytes, Tier.DEVICE)
            assert backend.memory_stats().allocated_bytes - before == nbytes
            host = backend.allocate(nbytes, Tier.PINNED)
            assert backend.memory_stats().allocated_bytes - before == nbytes, "host buffers are not device memory"
            assert backend.memory_stats().peak_allocated_bytes >= before + nbytes
            del buffer, host
            gc.collect()
            assert backend.memory_stats().allocated_bytes == before, "freeing a buffer must lower allocated_bytes"

    def test_peak_and_reset(self, backend: Any) -> None:
        nbytes = 8 * MiB
        with _active(backend):
            before = backend.memory_stats().allocated_bytes
            buffer = backend.allocate(nbytes, Tier.DEVICE)
            del buffer
            gc.collect()
            stats = backend.memory_stats()
            assert stats.allocated_bytes == before
            assert stats.peak_allocated_bytes >= before + nbytes
            backend.reset_peak_memory_stats()
            stats = backend.memory_stats()
            assert stats.peak_allocated_bytes == stats.allocated_bytes == before

    def test_host_work_is_not_device_memory(self, backend: Any, kit: BufferKit) -> None:
        """The optional ``host_work()`` (used when present): buffers the framework makes on the host
        inside ``with backend:`` and it are not device memory, during it or after; a device allocation
        inside still is. Without it, host buffers must not count as device memory to begin with."""
        nbytes = 4 * MiB
        host_work = getattr(backend, "host_work", None)  # optional, no capability: used when present
        with _active(backend):
            before = backend.memory_stats().allocated_bytes
            if host_work is None:
                host = kit.host_array(nbytes)
                if backend.memory_stats().allocated_bytes != before:
                    pytest.fail(
                        f"{type(backend).__name__} counts host buffers made inside `with device:` as device "
                        "memory: it needs host_work() (offcore.protocols.OPTIONAL_MEMBERS)"
                    )
                return
            with host_work():
                host = kit.host_array(nbytes)
                with host_work():  # re-entrant
                    inner = kit.host_array(nbytes)
                assert backend.memory_stats().allocated_bytes == before, "host_work(): host buffers counted"
                device = backend.allocate(nbytes, Tier.DEVICE)
                assert backend.memory_stats().allocated_bytes - before == nbytes, (
                    "host_work(): a device allocation inside must still count"
                )
            del device
            gc.collect()
            assert backend.memory_stats().allocated_bytes == before, "host_work(): its buffers must never count"
            assert kit.nbytes(host) == kit.nbytes(inner) == nbytes

    # ------------------------------------------------------------------ host buffer pool

    @pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
    def test_host_pool_budget_is_enforced(self, backend: Any, pinned: bool) -> None:
        pool = backend.host_pool(MiB, pinned=pinned)
        held = [pool.acquire(MiB // 2), pool.acquire(MiB // 2)]
        with pytest.raises(CapacityExceededError, match="budget") as caught:
            pool.acquire(1)
        assert "MiB" in str(caught.value) or re.search(r"\d", str(caught.value))
        pool.release(held.pop())
        held.append(pool.acquire(MiB // 2))  # room again once a buffer came back
        for buffer in held:
            pool.release(buffer)
        assert pool.used_bytes == 0

    @pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
    def test_host_pool_gives_exact_sizes_and_reuses_memory(self, backend: Any, kit: BufferKit, pinned: bool) -> None:
        pool = backend.host_pool(4 * MiB, pinned=pinned)
        odd = pool.acquire(1000)
        assert isinstance(odd, HostBuffer)
        assert odd.nbytes == 1000 and kit.nbytes(odd.view) == 1000 and kit.is_raw(odd.view)
        assert not backend.holds(odd.view)
        first = pool.acquire(MiB)
        address = kit.data_ptr(first.view)
        pool.release(first)
        again = pool.acquire(MiB)
        assert kit.data_ptr(again.view) == address, "a released buffer of the same size must be reused"
        pool.release(again)
        pool.release(odd)
        assert pool.used_bytes == 0

    def test_host_pool_buffers_are_copy_endpoints(self, backend: Any, buffers: _Buffers, kit: BufferKit) -> None:
        pool = backend.host_pool(4 * MiB, pinned=True)
        shape = (300, 7)
        staging = pool.acquire(kit.nbytes_of("float32", shape))
        host = kit.typed(staging.view, "float32", shape)
        kit.write(host, kit.random_bytes(buffers.rng, "float32", math.prod(shape)))
        device = buffers.empty(Tier.DEVICE, "float32", shape)
        back = pool.acquire(kit.nbytes_of("float32", shape))
        back_view = kit.typed(back.view, "float32", shape)
        stream = buffers.copy_stream()
        backend.copy_(device, host, stream=stream)
        backend.copy_(back_view, device, stream=stream).synchronize()
        np.testing.assert_array_equal(kit.read(back_view), kit.read(host))
        pool.release(staging)
        pool.release(back)

    # ------------------------------------------------------------------ copy_many (optional)

    def test_copy_many_copies_every_pair_in_order_and_its_event_covers_them(
        self, backend: Any, buffers: _Buffers, kit: BufferKit
    ) -> None:
        """Device storages to slices of one pinned pool buffer and back (how a binding batches small
        copies), then two pairs writing one destination: the later source wins."""
        many = getattr(backend, "copy_many", None)
        if many is None:
            pytest.skip("the backend has no copy_many (an optional member)")
        shapes: list[Shape] = [(64,), (3, 5), (128, 3), (1,)]
        sizes = [kit.nbytes_of("float32", shape) for shape in shapes]
        offsets = [64 * ((sum(sizes[:i]) + 63) // 64 + i) for i in range(len(shapes))]  # aligned slices, with gaps
        pool = backend.host_pool(4 * MiB, pinned=True)
        staging = pool.acquire(offsets[-1] + sizes[-1])
        slices = [
            kit.typed(staging.view[offset : offset + size], "float32", shape)
            for offset, size, shape in zip(offsets, sizes, shapes, strict=True)
        ]
        sources = [buffers.filled(Tier.DEVICE, "float32", shape) for shape in shapes]
        back = [buffers.empty(Tier.DEVICE, "float32", shape) for shape in shapes]
        stream = buffers.copy_stream()
        down = many(list(zip(slices, sources, strict=True)), stream=stream)
        up = many(list(zip(back, slices, strict=True)), stream=stream)
        up.synchronize()
        assert down.query(), "the first batch's event is pending after a later batch on its stream completed"
        for got, want, shape in zip(back, sources, shapes, strict=True):
            np.testing.assert_array_equal(kit.read(got), kit.read(want), err_msg=f"pair of shape {shape}")
        first, second = (buffers.filled(Tier.PINNED, "float32", (256,)) for _ in range(2))
        target = buffers.empty(Tier.DEVICE, "float32", (256,))
        many([(target, first), (target, second)], stream=stream).synchronize()
        np.testing.assert_array_equal(kit.read(target), kit.read(second), err_msg="the later pair must win")
        pool.release(staging)


def _small_allocation_still_works(backend: Any) -> bool:
    """A device that refused an allocation still serves a small one afterwards."""
    buffer = backend.allocate(MiB, Tier.DEVICE)
    ok = buffer is not None
    del buffer
    gc.collect()
    return ok
