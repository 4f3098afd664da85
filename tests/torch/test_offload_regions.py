"""A region's lifetime: where it may be left, and what a finished region still costs.

A finished region a caller keeps (to log ``stats()`` later) is not polled any more, so
keeping thousands of them costs nothing per step; a region is left on the thread that
entered it (saved-tensor hooks belong to one thread), and leaving it elsewhere is a
clear error that changes nothing.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.activations.offload import OffloadHandle  # noqa: E402
from offcore_torch.runtime import runtime_for  # noqa: E402
from offload_helpers import sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="unlimited")


def test_finished_regions_kept_by_the_caller_are_not_polled(dev: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with dev:
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(dev.torch_device)
        x = torch.randn(32, 64, device=dev.torch_device)
        kept = []
        for _ in range(200):
            with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
                loss = model(x).sum()
            loss.backward()
            kept.append(handle)
        settle(dev)
        polled: list[OffloadHandle] = []
        on_landed = OffloadHandle._on_landed

        def counting(self: OffloadHandle, entry: Any, failure: Any) -> None:
            polled.append(self)
            on_landed(self, entry, failure)

        # Note [Landings are returned, not called back]: the runtime keeps no list of regions;
        # a poll hands each landed copy to the region that started it, and to no other
        monkeypatch.setattr(OffloadHandle, "_on_landed", counting)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = model(x).sum()
        loss.backward()
        settle(dev)
        assert polled, "the active region hears of its landed copies"
        assert not set(map(id, polled)) & set(map(id, kept)), "a finished region was polled"
        assert runtime_for(dev).d2h_in_flight == 0
        assert all(h.stats().offloaded_storages > 0 for h in kept[:3]), "stats stay readable"


def test_leaving_a_region_on_another_thread_is_refused_and_changes_nothing(dev: Any) -> None:
    with dev:
        x = torch.randn(64, 64, device=dev.torch_device, requires_grad=True)
        region = offcore_torch.offload_activations(dev, min_bytes=1)
        region.__enter__()
        errors: list[BaseException] = []

        def leave() -> None:
            try:
                region.__exit__(None, None, None)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=leave)
        thread.start()
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], offcore.ConfigurationError), errors
        assert "thread that entered" in str(errors[0])
        assert region.active, "the region is still active on its own thread"
        loss = x.exp().sum()
        region.__exit__(None, None, None)
        assert not region.active
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        loss.backward()
        assert torch.equal(x.grad, x.detach().exp())
        assert region.stats().offloaded_storages > 0
    settle(dev)
