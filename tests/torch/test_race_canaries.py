"""Canaries: each test plants one race the sanitizer exists to catch and checks that it is caught, every run.

A race caught only when threads happen to interleave badly is a race the suite misses
on most runs. Here the racing copy is *held in mid-flight* by a gate of the fake device
(``dev.gate``, Note [Gates] in ``offcore_cpu.gates``) while the planted bug acts, so the
producer takes "forever" next to its consumer and the outcome never depends on timing or
jitter. Each race class has a planted test (the bug, by monkeypatching the offload plugin
or by using the device directly) and a control (the same steps, correct, through the
same gate: exact numbers, no violation), so a canary cannot pass because its set-up
stopped exercising the race:

- early free of a device-to-host copy's source (the device copy dropped before its D2H
  landed): the copy delivers poison, backward reads NaN, a ``use-after-free`` violation;
- compute not waiting for a prefetched host-to-device copy: backward reads the reload's
  destination while it still holds poison (and offcore, believing the copy done, lets go
  of its buffers while it is in flight: violations too);
- a missing cross-stream wait: caught by poison and, whatever the timing, as an
  ``unordered`` violation (Note [Copies ordered by the program]); also with the fake
  stream's ``wait_event`` broken;
- a host buffer returned to its pool before its upload landed: the upload delivers
  poison, a ``released-in-flight`` violation.

Each planted test runs three times (``run``) to show it holds on every run; the fixtures
fail any test that leaves an unexpected violation behind (``torch_test_devices.finish_device``).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_cpu.streams import WorkerStream  # noqa: E402
from offcore_torch.activations.offload import OffloadHandle  # noqa: E402
from offcore_torch.activations.storage import release_storage  # noqa: E402
from offcore_torch.runtime import DeviceRuntime, runtime_for  # noqa: E402
from offload_helpers import FixedScheduler, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

from offcore.kinds import Tier  # noqa: E402
from offcore.objects import ManagedObject, State  # noqa: E402

RUNS = range(3)
WIDTH, ROWS, DEPTH = 256, 64, 3


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    if not is_fake_device(backend):
        pytest.skip("the canaries hold copies with the fake device's gates")
    return make_fake_device(link="slow")


def build(dev: Any) -> tuple[nn.Module, Any, list[Any]]:
    """An MLP, its input, and the gradients of one step without offloading (the reference)."""
    torch.manual_seed(0)
    with dev:
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
        x = torch.randn(ROWS, WIDTH)
        model(x).square().mean().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    return model, x, expected


def grads(model: nn.Module) -> list[Any]:
    return [p.grad.clone() for p in model.parameters()]


def has_nan(tensors: list[Any]) -> bool:
    return any(bool(torch.isnan(t).any()) for t in tensors)


def assert_exact(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e), "a gradient differs from the run without offloading"


def take_violations(dev: Any, kind: str) -> list[dict[str, Any]]:
    found = dev.sanitizer_violations(clear=True)
    assert all(v["kind"] == kind for v in found), found
    return found


# =========================================================== 1. early free of a D2H source


def _landed_without_asking(self: Any) -> None:
    """Planted: every device-to-host copy in flight is taken as landed without querying its event."""
    with self.lock:
        while self._d2h_in_flight:
            _event, token = self._d2h_in_flight.popleft()
            self._landed.append((token, None))  # the region drops its device references: the D2H may still read them


def _release_unguarded(self: ManagedObject) -> None:
    """Planted: ManagedObject's guard (refuse while the D2H event is pending) removed."""
    self._move(State.OFFLOADED)
    self.tier = self.host_tier or Tier.PINNED


def _step_with_d2h_held(dev: Any, model: nn.Module, x: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Forward with every device-to-host copy held in flight; the copies land only after the region; then backward."""
    runtime = runtime_for(dev)
    with dev:
        with dev.gate(runtime.d2h_stream) as gate:
            # each storage on its own (group_below=0): the loss's small storages in a group would add the group's
            # host-to-device copy of bytes the planted landing never waited for (an "unordered" violation)
            with offcore_torch.offload_activations(dev, min_bytes=1, group_below=0) as handle:
                loss = model(x).square().mean()
            assert dev.copies_in_flight >= DEPTH, "forward must have issued its D2H copies"
            held = gate.wait_held(1)  # the first D2H copy is in flight, the others queued behind it
            runtime.poll()  # offcore looks at its copies while they are certainly in flight
        settle(dev)
        loss.backward()
    assert handle.stats().offloaded_storages >= DEPTH
    return handle, held


@pytest.mark.parametrize("run", RUNS)
def test_canary_early_free_of_a_d2h_source_is_caught(dev: Any, monkeypatch: pytest.MonkeyPatch, run: int) -> None:
    model, x, expected = build(dev)
    monkeypatch.setattr(DeviceRuntime, "_poll_d2h", _landed_without_asking)
    monkeypatch.setattr(ManagedObject, "release_device_copy", _release_unguarded)
    _step_with_d2h_held(dev, model, x)
    assert has_nan(grads(model)), "backward must read the poison the early-freed sources delivered"
    found = take_violations(dev, "use-after-free")
    assert found and all((v["direction"], v["side"]) == ("d2h", "source") for v in found), found


def test_control_d2h_sources_kept_until_they_landed(dev: Any) -> None:
    model, x, expected = build(dev)
    handle, held = _step_with_d2h_held(dev, model, x)
    assert held[0]["direction"] == "d2h"
    assert_exact(grads(model), expected)
    assert dev.sanitizer_violations() == []


# =========================================================== 2. compute not waiting for a prefetch


def _await_without_waiting(self: OffloadHandle, entry: Any) -> Any:
    """Planted: the prefetched storage is handed to backward without the compute stream waiting for its copy."""
    if entry.obj.state is State.PREFETCHING:
        entry.obj.finish_prefetch(stream_waited=True)  # a lie: nobody waited
    return entry.restored


def _step_with_h2d_held(dev: Any, model: nn.Module, x: Any, await_prefetch: Any = None) -> tuple[Any, Any]:
    """Every reload is a prefetch issued at the end of forward and held in flight while backward starts."""
    runtime = runtime_for(dev)
    schedule = FixedScheduler(eager=True)
    with dev:
        with dev.gate(runtime.h2d_stream) as gate:
            with offcore_torch.offload_activations(dev, min_bytes=1, schedule=schedule) as handle:
                loss = model(x).square().mean()
                settle(dev)  # every D2H landed and freed its device copy: backward needs reloads
            assert dev.copies_in_flight >= DEPTH, "the end of forward must have issued the reloads"
            gate.wait_held(1)  # the end of forward started the reloads; the first is in flight
            if await_prefetch is not None:
                await_prefetch(gate)
            loss.backward()
        settle(dev)
    stats = handle.stats()
    assert stats.offloaded_storages >= DEPTH and stats.stalls == 0
    assert stats.prefetched_bytes == stats.reloaded_bytes > 0, "every reload was a prefetch"
    return handle, gate


@pytest.mark.parametrize("run", RUNS)
def test_canary_compute_not_waiting_for_a_prefetch_reads_poison(
    dev: Any, monkeypatch: pytest.MonkeyPatch, run: int
) -> None:
    model, x, expected = build(dev)
    monkeypatch.setattr(OffloadHandle, "_await_prefetch", _await_without_waiting)
    _step_with_h2d_held(dev, model, x)
    assert has_nan(grads(model)), "backward read reloads that had not landed: it must see poison"
    # believing the reloads done, offcore also let go of their buffers while they were in flight
    # and backward's operators read the reloads' destinations while the copies were in flight, which the
    # operator check names (Note [Operators checked against copies in flight])
    found = dev.sanitizer_violations(clear=True)
    assert {v["kind"] for v in found} == {"released-in-flight", "use-after-free", "access-in-flight"}, found
    reads = [v for v in found if v["kind"] == "access-in-flight"]
    assert all((v["access"], v["side"], v["direction"]) == ("read", "destination", "h2d") for v in reads), reads


def test_control_compute_waits_for_an_in_flight_prefetch(dev: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, expected = build(dev)
    original = OffloadHandle._await_prefetch
    seen_in_flight: list[int] = []

    def open_when_compute_waits(gate: Any) -> None:
        def await_prefetch(self: OffloadHandle, entry: Any) -> Any:
            seen_in_flight.append(len(gate.held()))
            gate.open()  # compute is about to wait for a copy that is certainly still in flight
            return original(self, entry)

        monkeypatch.setattr(OffloadHandle, "_await_prefetch", await_prefetch)

    _step_with_h2d_held(dev, model, x, open_when_compute_waits)
    assert seen_in_flight and seen_in_flight[0] == 1, "the first prefetch was held when backward asked for it"
    assert_exact(grads(model), expected)


# =========================================================== 3. a missing cross-stream wait


def _produce_and_consume(dev: Any, *, wait: bool) -> tuple[Any, Any]:
    """A long producer copy (H2D, held in flight) and a short consumer copy (D2D) of its destination."""
    producer, consumer = dev.new_stream(name="producer"), dev.new_stream(name="consumer")
    values = torch.linspace(-1.0, 1.0, 64 * 1024)
    host = dev.allocate(values.nbytes, "pinned")
    host.view(torch.float32).copy_(values)
    staged, out = dev.allocate(values.nbytes, "device"), dev.allocate(values.nbytes, "device")
    with dev.gate(producer) as gate:
        produced = dev.copy_(staged, host, stream=producer)
        gate.wait_held(1)  # the producer is in flight: its destination holds poison
        if wait:
            consumer.wait_event(produced)
        consumed = dev.copy_(out, staged, stream=consumer)
        if not wait:
            consumed.synchronize()  # not held: it completes while the producer is still in flight
        else:
            assert not consumed.query()
    consumed.synchronize()
    return out.view(torch.float32), values


@pytest.mark.parametrize("run", RUNS)
def test_canary_missing_cross_stream_wait_is_caught(dev: Any, run: int) -> None:
    got, values = _produce_and_consume(dev, wait=False)
    assert torch.isnan(got).all(), "the consumer ran while the producer was in flight: it must copy poison"
    (found,) = take_violations(dev, "unordered")
    assert (found["stream"], found["side"]) == ("consumer", "source") and "copy #1" in found["message"]


@pytest.mark.parametrize("run", RUNS)
def test_canary_a_broken_wait_event_is_caught(dev: Any, monkeypatch: pytest.MonkeyPatch, run: int) -> None:
    """The program waits, but the fake stream's ``wait_event`` does nothing: caught when the copy is enqueued."""
    producer, consumer = dev.new_stream(name="producer"), dev.new_stream(name="consumer")
    staged, out = dev.allocate(4096, "device"), dev.allocate(4096, "device")
    host = dev.allocate(4096, "pinned")
    monkeypatch.setattr(WorkerStream, "wait_event", lambda self, event: None)
    with dev.gate(producer) as gate:
        produced = dev.copy_(staged, host, stream=producer)
        consumer.wait_event(produced)
        dev.copy_(out, staged, stream=consumer)
        (found,) = take_violations(dev, "unordered")  # found at enqueue: no timing involved
        gate.open()
    dev.synchronize()
    assert found["stream"] == "consumer"


def test_control_the_cross_stream_wait_orders_the_consumer(dev: Any) -> None:
    got, values = _produce_and_consume(dev, wait=True)
    assert torch.equal(got, values)
    assert dev.sanitizer_violations() == []


# =========================================================== 4. host buffer reused before its upload landed


def _start_prefetch_and_return_the_host_buffer(original: Any) -> Any:
    def start_prefetch(self: OffloadHandle, entry: Any) -> bool:
        """Planted: the host buffer goes back to the pool as soon as its upload is issued."""
        started = original(self, entry)
        if started and entry.host is not None:
            self._pool().release(entry.host)  # may be handed out again while the upload reads it
            entry.host = None
        return started

    return start_prefetch


@pytest.mark.parametrize("run", RUNS)
def test_canary_host_buffer_returned_before_its_upload_landed_is_caught(
    dev: Any, monkeypatch: pytest.MonkeyPatch, run: int
) -> None:
    model, x, expected = build(dev)
    monkeypatch.setattr(
        OffloadHandle, "_start_prefetch", _start_prefetch_and_return_the_host_buffer(OffloadHandle._start_prefetch)
    )

    def open_before_backward(gate: Any) -> None:
        gate.open()  # the buffers went back while their uploads were held; backward waits properly

    _step_with_h2d_held(dev, model, x, open_before_backward)
    assert has_nan(grads(model)), "uploads from released buffers must deliver poison"
    found = take_violations(dev, "released-in-flight")
    assert found and all((v["direction"], v["side"]) == ("h2d", "source") for v in found), found


def test_control_host_buffers_return_after_their_upload(dev: Any) -> None:
    model, x, expected = build(dev)
    _step_with_h2d_held(dev, model, x, lambda gate: gate.open())
    assert_exact(grads(model), expected)
    assert dev.sanitizer_violations() == []


def test_a_graph_dropped_during_its_prefetches_keeps_their_host_buffers_until_they_land(dev: Any) -> None:
    """The plugin's own release path under a held upload: dropping the graph defers the host buffers."""
    model, x, expected = build(dev)
    runtime = runtime_for(dev)
    with dev:
        with dev.gate(runtime.h2d_stream) as gate:
            with offcore_torch.offload_activations(dev, min_bytes=1, schedule=FixedScheduler(eager=True)) as handle:
                loss = model(x).square().mean()
                settle(dev)
            assert dev.copies_in_flight >= DEPTH, "the end of forward must have issued the reloads"
            gate.wait_held(1)
            del loss  # the step is abandoned while every reload reads its host buffer
            assert runtime.deferred_count >= DEPTH, "the host buffers wait for their uploads"
        settle(dev)
    assert dev.sanitizer_violations() == [], "a host buffer went back to the pool while its upload read it"
    assert handle.stats().prefetched_bytes > 0 and sum(pool.used_bytes for pool in runtime.pools) == 0


def test_canary_helpers_really_plant_and_release(dev: Any) -> None:
    """The planted pieces touch what they claim: release_storage drops a keeper's storage."""
    with dev:
        t = torch.randn(16)
    keeper = t.detach()
    release_storage(keeper)
    assert keeper.untyped_storage().nbytes() == 0 and t.untyped_storage().nbytes() == 64
