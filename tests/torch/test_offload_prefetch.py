"""Deadline prefetch: what the scheduler decides, and the copies the device saw carry it out.

Nothing asserted here depends on when threads get scheduled. The tests check the plan
(which saved tensors, in which order), and which copies were issued, on which stream, in
which order, from the fake device's own copy log (``dev.copy_log()``: each copy's number,
stream and buffers), not from offcore's counters. To make the decisions themselves
independent of timing:

- a :class:`~offload_helpers.FixedScheduler` plans from the *order* in which backward
  used the saved tensors, never from measured times (the learnt
  :class:`~offcore.scheduler.Scheduler` is checked for the order of its plan only, which
  timing cannot change);
- forward ends with every device-to-host copy landed (``settle`` inside the region), so
  every reload is a copy from the host that the plan (or an unpack) decided;
- a gate of the fake device holds the host-to-device stream's copies in flight while
  forward ends, so "the copies issued before backward started" is a fact.

Timing-dependent figures (stalls under a learnt schedule, exposed wait, bandwidth) are
measured by ``benchmarks/activation_offload.py``, not asserted here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import FixedScheduler, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

from offcore.scheduler import PrefetchPlan, Scheduler, StepObservation  # noqa: E402

WIDTH, ROWS, DEPTH = 512, 256, 6
ACTIVATION = WIDTH * ROWS * 4  # bytes of one saved activation
LINK = {"h2d_bandwidth": "8GiB/s", "d2h_bandwidth": "8GiB/s", "latency": "10us", "jitter": "20us"}


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    """A sanitized fake device with ample bandwidth (small jitter: copies stay short next to compute)."""
    if not is_fake_device(backend):
        return backend
    return make_fake_device(**LINK)


@pytest.fixture
def fake(dev: Any) -> Any:
    if not is_fake_device(dev):
        pytest.skip("the copy log, gates and emulated link are the fake device's")
    return dev


class RecordingScheduler(Scheduler):
    """The learnt scheduler, keeping every plan it made."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[PrefetchPlan] = []

    def plan(self, *args: Any, **kwargs: Any) -> PrefetchPlan:
        plan = super().plan(*args, **kwargs)
        self.plans.append(plan)
        return plan


def build(dev: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with dev:
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(WIDTH, 1)).to(dev.torch_device)
        x = torch.randn(ROWS, WIDTH, device=dev.torch_device)
    return model, x


def train(dev: Any, steps: int = 3, **policy: Any) -> list[Any]:
    model, x = build(dev)
    handles = []
    with dev:
        for _ in range(steps):
            with offcore_torch.offload_activations(dev, min_bytes=1, **policy) as handle:
                loss = model(x).square().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
            handles.append(handle)
    return [h.stats() for h in handles]


def settled_step(dev: Any, model: nn.Module, x: Any, *, hold_h2d: bool = False, **policy: Any) -> dict[str, Any]:
    """One step whose forward ends with every D2H landed; with ``hold_h2d`` the H2D copies issued by the
    end of forward are held in flight until backward starts. Returns the handle, the copies in flight
    at the end of forward (held or queued behind the held one) and the device's copy log of the step."""
    runtime = runtime_for(dev)
    dev.clear_copy_log()
    with dev:
        with dev.gate(runtime.h2d_stream) if hold_h2d else contextlib.nullcontext() as gate:
            with offcore_torch.offload_activations(dev, min_bytes=1, **policy) as handle:
                loss = model(x).square().mean()
                settle(dev)  # every D2H landed, every device copy released: each reload is decided
            in_flight = dev.copies_in_flight
            if gate is not None and in_flight:
                gate.wait_held(1)
        loss.backward()
        settle(dev)
        model.zero_grad(set_to_none=True)
    return {"handle": handle, "stats": handle.stats(), "in_flight": in_flight, "log": dev.copy_log()}


def reloads(step: dict[str, Any]) -> list[tuple[int, str, int]]:
    """The step's host-to-device copies as ``(save index, stream, bytes)`` in the order they were issued.

    The save index is found from the device's own log: the D2H copies were issued in save
    order, and a reload reads the host buffer its storage's D2H copy wrote.
    """
    log = sorted(step["log"], key=lambda entry: entry["number"])
    saved = {entry["dst"]: i for i, entry in enumerate(e for e in log if e["direction"] == "d2h")}
    return [(saved[e["src"]], e["stream"], e["bytes"]) for e in log if e["direction"] == "h2d"]


def save_keys(plan: PrefetchPlan) -> list[int]:
    """The plan's offloaded keys in save order (index i: the i-th D2H copy of the step)."""
    return sorted(plan.nbytes)


# ------------------------------------------------------------------ what the scheduler decides


def test_the_learnt_plan_reloads_in_reverse_save_order(fake: Any) -> None:
    schedule = RecordingScheduler()
    stats = train(fake, steps=3, schedule=schedule)
    assert len(schedule.plans) == 3 and schedule.steps_observed == 3
    for plan, step in zip(schedule.plans, stats, strict=True):
        assert len(plan.nbytes) == step.offloaded_storages == DEPTH + 2  # x, 6 activations, the output
        assert plan.order == sorted(plan.nbytes, reverse=True), "backward needs the last-saved tensor first"
        assert sorted(plan.nbytes.values()) == [ROWS * 4] + [ACTIVATION] * (DEPTH + 1)
        starts = [plan.latest_start[k] for k in plan.order]
        assert starts == sorted(starts), "latest starts follow the deadline order (one serial link)"


def test_prefetches_are_issued_in_plan_order_on_the_copy_stream(fake: Any) -> None:
    schedule = FixedScheduler(spacing=1.0, duration=0.5)  # each reload due one unpack ahead of its use
    model, x = build(fake)
    settled_step(fake, model, x, schedule=schedule)  # teaches the scheduler backward's order of use
    step = settled_step(fake, model, x, hold_h2d=True, schedule=schedule)
    plan = schedule.plans[-1]
    keys = save_keys(plan)
    stream = runtime_for(fake).h2d_stream.name
    # at the end of forward the plan starts exactly the reloads whose latest start precedes backward's first use
    first_use = min(plan.use_times.values())
    assert step["in_flight"] == sum(1 for k in plan.order if plan.latest_start[k] <= first_use) >= 1
    # every reload was a prefetch on the H2D stream, in the plan's order; x (held by the test, so its
    # device copy never died) is reused, not reloaded
    freed = plan.order[:-1]
    assert plan.order[-1] == keys[0], "x is saved first and used last"
    assert [(keys[i], s, n) for i, s, n in reloads(step)] == [(k, stream, plan.nbytes[k]) for k in freed]
    stats = step["stats"]
    assert stats.stalls == 0 and stats.stalled_objects == []
    assert stats.prefetch_hits == len(freed) and stats.reused_live_bytes == ACTIVATION
    assert stats.prefetched_bytes == stats.reloaded_bytes == sum(plan.nbytes[k] for k in freed)


def test_on_demand_reloads_stall_every_time(fake: Any) -> None:
    model, x = build(fake)
    step = settled_step(fake, model, x, prefetch="on_demand")
    stats = step["stats"]
    order = reloads(step)
    assert step["in_flight"] == 0, "on demand: nothing is reloaded before backward asks"
    # every storage but x (held by the test) is reloaded on the compute stream, last saved first
    assert [(i, stream) for i, stream, _ in order] == [(i, "compute") for i in range(DEPTH + 1, 0, -1)]
    assert stats.prefetched_bytes == 0 and stats.stalls == stats.offloaded_storages - 1 == DEPTH + 1
    assert len(stats.stalled_objects) == stats.stalls
    assert set(stats.waits) >= set(stats.stalled_objects)  # each stall is charged to its object


def test_prefetch_budget_is_counted_in_bytes(fake: Any) -> None:
    budget = ACTIVATION * 3 // 2  # one activation ahead, not two
    schedule = FixedScheduler(eager=True)  # every reload wants to start at the end of forward
    model, x = build(fake)
    step = settled_step(fake, model, x, hold_h2d=True, schedule=schedule, prefetch_budget=budget)
    (plan,) = schedule.plans
    # the first reload in deadline order is the output's (1 KiB), the next an activation: both fit, a third not
    assert step["in_flight"] == 2
    stats = step["stats"]
    assert 0 < stats.peak_prefetched_bytes <= budget
    # what the budget did not allow ahead of time was reloaded on demand: the device saw each reload once
    copies = reloads(step)
    stream = runtime_for(fake).h2d_stream.name
    assert sum(n for _, s, n in copies if s == stream) == stats.prefetched_bytes > 0
    assert sum(1 for _, s, _ in copies if s == "compute") == stats.stalls
    assert sorted(i for i, _, _ in copies) == list(range(1, DEPTH + 2)), "every freed storage reloaded once"


def test_zero_budget_disables_prefetch(fake: Any) -> None:
    model, x = build(fake)
    step = settled_step(fake, model, x, schedule=FixedScheduler(eager=True), prefetch_budget=0)
    stats = step["stats"]
    assert step["in_flight"] == 0
    assert {stream for _, stream, _ in reloads(step)} == {"compute"}
    assert stats.prefetched_bytes == 0 and stats.stalls == stats.offloaded_storages - 1 == DEPTH + 1


# ------------------------------------------------------------------ measured, not assumed


def test_copy_bandwidth_is_measured_not_assumed(dev: Any) -> None:
    stats = train(dev, steps=2)[-1]
    runtime = runtime_for(dev)
    assert runtime.d2h_link.samples > 0 and runtime.h2d_link.samples > 0
    assert stats.d2h_bandwidth > 0 and stats.h2d_bandwidth > 0
    if is_fake_device(dev):  # an emulated copy never beats its link (8 GiB/s): a bound, not a timing
        assert stats.d2h_bandwidth <= 1.05 * 8 * 2**30
        assert stats.h2d_bandwidth <= 1.05 * 8 * 2**30


def test_a_schedule_object_learns_across_steps(dev: Any) -> None:
    schedule = Scheduler(margin="0.2ms")
    before = runtime_for(dev).scheduler.steps_observed
    train(dev, steps=3, schedule=schedule)
    assert schedule.steps_observed == 3
    assert runtime_for(dev).scheduler.steps_observed == before  # the device default was not used
    predicted = schedule.predict(StepObservation(pack_times=dict.fromkeys(range(4 * DEPTH), 0.0)))
    assert predicted and all(t >= 0 for t in predicted.values())
