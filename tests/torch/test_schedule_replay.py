"""A real step recorded on the fake device, replayed through the simulator: the same decisions.

The binding feeds its :class:`~offcore.residency.ResidencyScheduler` events with the
binding's own times (``record=True`` keeps them); :func:`offcore.sim.replay.replay` feeds
them to a new scheduler on a simulated clock. The replay must decide the same actions in
the same order (the same copies, at the same trigger points, with the same holds and
evictions), and the device's own copy log must show those prefetches issued in that order.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

from offcore.errors import ConfigurationError  # noqa: E402
from offcore.residency import ActionKind  # noqa: E402
from offcore.scheduler import Scheduler  # noqa: E402
from offcore.sim.replay import ReplayDiverged, replay  # noqa: E402

WIDTH, ROWS, DEPTH = 256, 128, 6
ACTIVATION = WIDTH * ROWS * 4


@pytest.fixture
def fake(backend: Any, make_fake_device: Any) -> Any:
    if not is_fake_device(backend):
        pytest.skip("the copy log and the emulated link are the fake device's")
    return make_fake_device(h2d_bandwidth="1GB/s", d2h_bandwidth="1GB/s", latency="50us", sanitize=True)


def model_and_input(dev: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with dev:
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(WIDTH, 1)).to(dev.torch_device)
        x = torch.randn(ROWS, WIDTH, device=dev.torch_device)
    return model, x


@pytest.mark.parametrize(
    "policy",
    [
        {},
        {"prefetch_budget": 2 * ACTIVATION},  # the budget decides
        {"prefetch_budget": 1},  # one copy at a time (the first-copy exception)
        {"prefetch": "on_demand"},
    ],
    ids=["default", "budget-2", "budget-1", "on-demand"],
)
def test_a_recorded_step_replays_to_the_same_actions(fake: Any, policy: dict[str, Any]) -> None:
    dev = fake
    model, x = model_and_input(dev)
    schedule = Scheduler()  # learnt across the steps, as a training loop's would be
    h2d_stream = runtime_for(dev).h2d_stream
    acted = False  # reloaded ahead of use, or kept a landed copy for its use
    with dev:
        for step in range(4):
            dev.clear_copy_log()
            with offcore_torch.offload_activations(
                dev, min_bytes=1, schedule=schedule, record=True, **policy
            ) as handle:
                loss = model(x).square().mean()
            # Whether a copy lands before backward needs it depends on the machine's speed, so on
            # every other step every D2H copy lands first: those steps must free device copies
            # (and, with prefetch, reload ahead of use) whatever the timing; the others replay
            # whatever timing they met.
            settled = step % 2 == 1
            if settled:
                settle(dev)
            loss.backward()
            settle(dev)
            actions = handle.schedule_actions
            if settled:
                assert any(a.kind is ActionKind.FREE for a in actions), "every landed copy's device copy is freed"
            assert replay(handle.schedule_log, **handle.schedule_settings) == actions
            prefetches = [a for a in actions if a.kind is ActionKind.PREFETCH]
            if settled:
                acted |= any(a.kind in (ActionKind.PREFETCH, ActionKind.HOLD) for a in actions)
            # the copies the device saw on the prefetch stream, in issue order, are those prefetches
            issued = sorted(
                (c for c in dev.copy_log() if c["stream"] == h2d_stream.name and c["direction"] == "h2d"),
                key=lambda c: c["number"],
            )
            assert [c["bytes"] for c in issued] == [a.nbytes for a in prefetches]
            assert handle.stats().prefetched_bytes == sum(a.nbytes for a in prefetches)
    assert acted == (policy.get("prefetch") != "on_demand")


def test_the_replay_decides_again(fake: Any) -> None:
    """A replay re-decides from the events: with no prefetch budget it must hold and prefetch nothing."""
    dev = fake
    model, x = model_and_input(dev)
    schedule = Scheduler()
    ahead = []
    with dev:
        for _ in range(3):
            with offcore_torch.offload_activations(dev, min_bytes=1, schedule=schedule, record=True) as handle:
                loss = model(x).square().mean()
            loss.backward()
            settle(dev)
            assert replay(handle.schedule_log, **handle.schedule_settings) == handle.schedule_actions
            ahead += [a for a in handle.schedule_actions if a.kind in (ActionKind.PREFETCH, ActionKind.HOLD)]
            try:
                starved = replay(handle.schedule_log, **{**handle.schedule_settings, "budget": 0})
            except ReplayDiverged:
                continue  # it decided differently so early that the recorded outcomes no longer apply
            assert not [a for a in starved if a.kind in (ActionKind.PREFETCH, ActionKind.HOLD)]
    assert ahead, "three deadline steps reload or hold something ahead of use"


def test_recording_is_off_by_default(fake: Any) -> None:
    dev = fake
    with dev:
        x = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = x.exp().sum()
        loss.backward()
    with pytest.raises(ConfigurationError, match="record=True"):
        handle.schedule_log  # noqa: B018
