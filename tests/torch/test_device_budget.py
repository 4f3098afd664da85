"""One device budget across kinds (offcore_torch.device_budget): parameters, activations and the
optimizer under one budget train bit-identically, and the device peak respects the budget."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.models import GPTConfig, TinyGPT, next_token_loss  # noqa: E402
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import FixedScheduler, settle  # noqa: E402

from offcore.budget import DeviceBudget, _Reservation  # noqa: E402
from offcore.errors import ConfigurationError  # noqa: E402
from offcore.kinds import Kind  # noqa: E402


def _model() -> torch.nn.Module:
    return TinyGPT(GPTConfig(vocab_size=64, d_model=64, n_heads=2, n_layers=3, seq_len=32, dropout=0.0), seed=0)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(step))
    return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _train(dev: Any, *, budget: Any = None, offload: bool = True, prefetch: str = "deadline") -> dict[str, Any]:
    shared = offcore_torch.device_budget(dev, budget) if budget is not None else None
    try:
        with dev:
            torch.manual_seed(0)
            model = _model()
            handle = offload_parameters(model, dev, prefetch=prefetch) if offload else None
            # One gradient's D2H at a time (a cap below one gradient): the gradients held on the device are then
            # the same in every run, whatever the machine's load (see _check_within_budget).
            opt = offcore_torch.OffloadOptimizer(
                model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2, max_inflight_gradients=1
            )
            losses, peaks = [], []
            for step in range(4):
                dev.reset_peak_memory_stats()
                if offload:
                    with offcore_torch.offload_activations(dev, min_bytes="1KiB", prefetch=prefetch):
                        loss = _loss(model, step)
                else:
                    loss = _loss(model, step)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().clone())
                del loss
                offcore_torch.synchronize(dev)
                peaks.append(dev.memory_stats().peak_allocated_bytes)
            opt.synchronize()  # the keep-all reference's last upload has landed
            largest = handle.largest_module_bytes if handle is not None else 0
            largest_gradient = max(p.numel() * p.element_size() for p in model.parameters())
            if handle is not None:
                handle.remove()
            params = [p.detach().clone() for p in model.parameters()]
            opt.close()
        return {
            "values": losses + params,
            "peak": max(peaks[1:]),
            "largest": largest,
            "largest_gradient": largest_gradient,
            "shared": shared,
        }
    finally:
        offcore_torch.device_budget(dev, None)


def _check_within_budget(got: dict[str, Any], floor: dict[str, Any], budget: int) -> None:
    """What one device budget promises: the reservations never over it, all given back, and the measured
    device peak within the bound below."""
    stats = got["shared"].stats()
    assert stats.peak_bytes <= budget  # the reservations never went over
    assert stats.by_kind["parameter"]["admitted"] > 0 and stats.by_kind["activation"]["admitted"] > 0
    assert stats.used_bytes == 0  # every reservation given back
    # Note [One device budget across kinds]: the measured peak is at most the peak without any copy
    # ahead of use (the on-demand run), plus the budget (copies ahead of use, across kinds), plus the
    # slack: copies evicted for another owner's request and not freed yet, and gradients held for their D2H.
    # - A parameter copy evicted for an activation prefetch is freed inside the eviction (Note [A parameter
    #   copy evicted for another owner is freed at once] in parameters.py). What remains is an activation
    #   copy evicted for a parameter's request, freed at the region's next trigger: less than one module's
    #   parameters plus one saved tensor, which the largest module's bytes cover (the saved tensors here are
    #   32 KiB, the largest module 65 KiB).
    # - Gradients are outside the budget (Note [In-flight gradients are capped] in optimizer.py): how many are
    #   held depends on how far the D2H lags backward, so on the machine's load. With the default cap
    #   (64 MiB: all of them here) the on-demand peak itself ranged over 531-762 KB in 12 runs under load, and a
    #   CI run went 31 KiB over the bound without any budget overshoot. _train lets one gradient's D2H run at
    #   a time; either run's peak may fall with or without it: one largest gradient.
    # Measured with it (3 busy processes on 2 cores, 30 runs): on-demand peak 528.7-530.7 KB, the budgeted
    # run's peak 1.3-68.6 KB over it, the bound 230.4 KB over it.
    bound = floor["peak"] + budget + got["largest"] + got["largest_gradient"]
    assert got["peak"] <= bound, (
        f"measured device peak {got['peak']} > {bound} (on-demand peak + budget + one module + one gradient)"
    )


def test_one_budget_bit_identical_and_peak_within_budget(make_fake_device: Any) -> None:
    want = _train(make_fake_device(), offload=False)["values"]
    floor = _train(make_fake_device(link="slow"), prefetch="on_demand")  # nothing copied ahead of use
    budget = 96 * 1024
    got = _train(make_fake_device(link="slow"), budget=budget)
    assert all(torch.equal(a, b) for a, b in zip(got["values"], want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(floor["values"], want, strict=True))
    _check_within_budget(got, floor, budget)


def test_the_budget_checks_fail_when_the_budget_is_ignored(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above are not vacuous: with every request admitted and nothing evicted (the budget
    ignored), they fail -- always on the reservations; the measured peak then went over the bound in half
    the runs (peaks of 0.66-0.99 MB against a bound of about 0.76 MB, 8 runs), so it is not what this asserts."""
    floor = _train(make_fake_device(link="slow"), prefetch="on_demand")
    budget = 96 * 1024

    def admit_all(self: Any, owner: Any, kind: Any, key: int, nbytes: int, *, next_use: float = math.inf) -> bool:
        with self._lock:
            if (id(owner), key) not in self._reservations:
                self._reservations[(id(owner), key)] = _Reservation(id(owner), kind, key, nbytes, next_use)
                self.used_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                self._counters[kind]["admitted"] += 1
            return True

    monkeypatch.setattr(DeviceBudget, "admit", admit_all)
    ignored = _train(make_fake_device(link="slow"), budget=budget)
    with pytest.raises(AssertionError):
        _check_within_budget(ignored, floor, budget)


def test_budget_as_a_fraction_and_the_error_naming_the_smallest_budget(make_fake_device: Any) -> None:
    dev = make_fake_device(capacity="8MiB")
    shared = offcore_torch.device_budget(dev, 0.5)
    assert shared is not None and shared.capacity_bytes == 4 * 1024 * 1024
    offcore_torch.device_budget(dev, "1KiB")
    try:
        with dev:
            model = _model()
            with pytest.raises(ConfigurationError, match="smallest budget that can work is"):
                offload_parameters(model, dev)
            assert getattr(model, "_offcore_parameter_handle", None) is None
    finally:
        offcore_torch.device_budget(dev, None)
    with pytest.raises(ConfigurationError, match="fraction needs a device"):
        offcore_torch.device_budget(object(), 0.5)


class _Owner:
    """Another binding of the device, as the shared budget sees it (a parameter handle's scheduler, say)."""

    def __init__(self) -> None:
        self.evicted: list[int] = []

    def evict(self, key: int) -> None:
        self.evicted.append(key)


def test_an_evicted_prefetch_still_in_flight_is_waited_for_before_backward_reads_it(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (a wrong gradient 1 run in 4-8 under one budget with parameter streaming): the shared
    budget evicts an activation's prefetch for another owner while its H2D is still in flight; the
    evicted copy is dropped, but its buffer stays alive until the copy lands, and backward's use of the
    saved tensor found it alive and read it without waiting for the copy (poison under the sanitizer).
    The interleaving is forced: a gate holds the prefetch in flight until the compute stream waits for it
    (as on a GPU, where a stream's wait does not block the host)."""
    dev = make_fake_device(link="slow")
    n = 4096  # floats: 16 KiB per saved tensor
    shared = offcore_torch.device_budget(dev, n * 4)  # room for one saved tensor ahead of its use
    other = _Owner()
    shared.attach(other, other.evict)
    runtime = runtime_for(dev)

    def forward(x: torch.Tensor, hold: Any) -> torch.Tensor:
        c = torch.sin(x * 1.0)  # saves x * 1.0: offloaded, used last
        b = torch.sin(c)  # saves c: offloaded, prefetched at the end of forward, evicted in flight
        a = torch.sin(offcore_torch.mark(b * 1.0, offload=False))  # saves b * 1.0, kept: backward's first use
        hold()
        return a.sum()

    try:
        with dev:
            x = torch.linspace(-1.0, 1.0, n).requires_grad_()
            forward(x, lambda: None).backward()
            want = x.grad.clone()
            x.grad = None
            compute = type(dev.current_stream())
            with dev.gate(runtime.h2d_stream) as gate:
                original = compute.wait_event

                def wait_event(stream: Any, event: Any) -> None:
                    if not event.query():
                        gate.open()  # compute waits for a copy the gate holds: it may land now
                    original(stream, event)

                monkeypatch.setattr(compute, "wait_event", wait_event)

                def hold() -> None:
                    # the other owner holds the whole budget while the D2H copies land, so no device copy
                    # is held on landing: the end of forward prefetches the first offloaded tensor
                    assert shared.admit(other, Kind.PARAMETER, 0, n * 4, next_use=-math.inf)
                    settle(dev)
                    shared.release(other, 0)

                # group_below=0: each saved tensor its own object (in one group, c and x * 1.0 would share a prefetch)
                policy = {"min_bytes": "1KiB", "group_below": 0, "schedule": FixedScheduler(eager=True)}
                with offcore_torch.offload_activations(dev, **policy) as handle:
                    loss = forward(x, hold)
                gate.wait_held(1)  # the prefetch of c is in flight
                # needed now: the other owner's request evicts the in-flight prefetch (Note [One device budget
                # across kinds]); the EVICT reaches the activation binding at backward's first use
                assert shared.admit(other, Kind.PARAMETER, 1, n * 4, next_use=-math.inf)
                assert shared.stats().by_kind["activation"]["evicted"] == 1 and other.evicted == []
                assert len(gate.held()) == 1 and gate.closed
                loss.backward()
                shared.release(other, 1)
            settle(dev)
        assert torch.equal(x.grad, want), "backward read an evicted prefetch's buffer before its copy landed"
        assert handle.stats().offloaded_storages == 2
    finally:
        offcore_torch.device_budget(dev, None)
