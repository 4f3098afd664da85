"""Bad arguments to the binding's entry points are clear offcore errors, never accepted silently.

A device name where a device object belongs, ``"no"`` for a flag (truthy: it would do the
opposite of what was meant), a trace that is not a recorder, a non-leaf parameter,
``load_state_dict(None)``: each once surfaced as an ``AttributeError`` / ``TypeError`` from
deep inside, mid-step, or not at all. And a closed optimizer refuses to step (it stepped
nothing, silently) and has given its pinned memory back.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="unlimited")


def _model(dev: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    with dev:
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).to(dev.torch_device)


ENTRY_POINTS: dict[str, Callable[[Any, torch.nn.Module], Any]] = {
    "OffloadOptimizer": lambda d, m: offcore_torch.OffloadOptimizer(m.parameters(), torch.optim.AdamW, device=d),
    "offload_activations": lambda d, m: offcore_torch.offload_activations(d),
    "offload_parameters": lambda d, m: offcore_torch.offload_parameters(m, d),
    "device_budget": lambda d, m: offcore_torch.device_budget(d, "1MiB"),
    "nvme_tier": lambda d, m: offcore_torch.nvme_tier(d, tempfile.gettempdir()),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("given", ["cpu", None])
def test_a_device_name_or_none_is_refused_by_every_entry_point(dev: Any, entry: str, given: Any) -> None:
    with pytest.raises(offcore.ConfigurationError, match=r"offcore device object.*offcore\.device\("):
        ENTRY_POINTS[entry](given, _model(dev))


@pytest.mark.parametrize(
    ("argument", "value"),
    [("master_weights", "yes"), ("offload_gradients", 2), ("pin_memory", "no"), ("verify", "yes"), ("trace", "x")],
)
def test_optimizer_arguments_of_the_wrong_type_are_refused(dev: Any, argument: str, value: Any) -> None:
    model = _model(dev)
    with pytest.raises(offcore.ConfigurationError, match=argument):
        offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, **{argument: value})


@pytest.mark.parametrize(("argument", "value"), [("buffers", "yes"), ("pinned", "no")])
def test_offload_parameters_flags_of_the_wrong_type_are_refused(dev: Any, argument: str, value: Any) -> None:
    model = _model(dev)
    with pytest.raises(offcore.ConfigurationError, match=argument):
        offcore_torch.offload_parameters(model, dev, **{argument: value})
    assert not hasattr(model, "_offcore_parameter_handle")


def test_nvme_tier_verify_must_be_a_bool(dev: Any, tmp_path: Any) -> None:
    with pytest.raises(offcore.ConfigurationError, match="verify"):
        offcore_torch.nvme_tier(dev, tmp_path, verify="yes")
    assert offcore_torch.nvme_tier_for(dev) is None


def test_a_non_leaf_parameter_is_refused(dev: Any) -> None:
    with dev:
        computed = torch.randn(4, 4, device=dev.torch_device, requires_grad=True) * 2
    with pytest.raises(offcore.ConfigurationError, match="not a leaf tensor"):
        offcore_torch.OffloadOptimizer([computed], torch.optim.AdamW, device=dev)


def test_load_state_dict_of_none_is_refused(dev: Any) -> None:
    with offcore_torch.OffloadOptimizer(_model(dev).parameters(), torch.optim.AdamW, device=dev) as opt:
        with pytest.raises(offcore.ConfigurationError, match="state dict"):
            opt.load_state_dict(None)  # type: ignore[arg-type]


def test_a_closed_optimizer_refuses_to_step_and_has_given_its_pinned_memory_back(dev: Any) -> None:
    model = _model(dev)
    with dev:
        x = torch.randn(2, 16, device=dev.torch_device)
    pinned_before = int(dev.memory_stats().get("pinned_bytes", 0) or 0)
    opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=0.1)
    with dev:
        model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    if is_fake_device(dev):
        assert int(dev.memory_stats()["pinned_bytes"]) > pinned_before
    opt.close()
    if is_fake_device(dev):  # the docs: close() gives the host memory back (not when the object is deleted)
        assert int(dev.memory_stats()["pinned_bytes"]) == pinned_before
    before = [p.detach().clone() for p in model.parameters()]
    with dev:
        model(x).sum().backward()
    with pytest.raises(offcore.IllegalTransitionError, match="after close"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for call in (opt.state_dict, lambda: opt.load_state_dict({})):
        with pytest.raises(offcore.IllegalTransitionError, match="after close"):
            call()
    opt.close()  # twice is fine


def test_a_region_on_a_closed_device_says_the_device_is_closed(make_fake_device: Any) -> None:
    """A sanitized device closed between steps: the next region warned per saved tensor about an internal
    stream ("create a new one with dev.new_stream()") and left a sanitizer record for every copy."""
    dev = make_fake_device(link="unlimited")
    with dev:
        model = dev.adopt(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)))
        x = torch.randn(8, 32)
        with offcore_torch.offload_activations(dev, min_bytes=0):
            loss = model(x).sum()
        loss.backward()
    offcore_torch.synchronize(dev)
    dev.close()
    with pytest.raises(offcore.ConfigurationError, match=r"which is closed \(dev.close\(\) ran\)"):
        with dev, offcore_torch.offload_activations(dev, min_bytes=0):
            model(x).sum()
    assert dev.copies_in_flight == 0
