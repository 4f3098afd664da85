"""Module names and parameter storages learnt once per tree (policy.py Note [Module names are learnt once per tree])."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.activations.policy import OffloadPolicy, PackRules  # noqa: E402
from offload_helpers import sanitized_device  # noqa: E402
from torch import nn  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


class _Frozen(nn.Module):
    """A weight that is not a leaf requiring grad where it is saved: only its storage says 'parameter'."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 64)
        self.weight = nn.Parameter(torch.randn(64, 64))

    def forward(self, x: Any) -> Any:
        return (self.inner(x) @ self.weight.detach()).sum()


def _step(dev: Any, model: nn.Module) -> Any:
    with dev:
        x = torch.randn(32, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = model(x)
        loss.backward()
    return handle.stats()


def test_a_parameter_replaced_or_repointed_between_steps_is_still_kept(dev: Any) -> None:
    with dev:
        model = _Frozen().to(dev.torch_device)
    first = _step(dev, model)
    assert first.kept.get("parameter", 0) >= 1, first.kept
    with dev:  # the same submodules, new parameter storages: the cached names must not hide them
        model.weight = nn.Parameter(torch.randn(64, 64, device=dev.torch_device))
        model.inner.weight.data = torch.randn(64, 64, device=dev.torch_device)
    second = _step(dev, model)
    assert second.kept.get("parameter", 0) == first.kept.get("parameter", 0), (first.kept, second.kept)
    assert second.offloaded_storages == first.offloaded_storages


def test_names_follow_the_tree_when_a_submodule_is_replaced(dev: Any) -> None:
    with dev:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).to(dev.torch_device)
    policy = OffloadPolicy.parse()
    rules = PackRules(policy, dev)
    rules.note_module(model)
    assert rules.module_names[id(model[1])] == "Sequential.1"
    again = PackRules(policy, dev)
    again.note_module(model)  # from the cache
    assert again.module_names == rules.module_names and again.param_keys == rules.param_keys
    with dev:
        model[1] = nn.Linear(8, 8).to(dev.torch_device)
    changed = PackRules(policy, dev)
    changed.note_module(model)
    assert changed.module_names[id(model[1])] == "Sequential.1"
    assert {p.untyped_storage()._cdata for p in model.parameters()} == changed.param_keys
