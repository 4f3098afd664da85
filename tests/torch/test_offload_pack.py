"""What pack offloads: storage dedupe and exact restore, parameters, sizes, marks and scopes."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import Probe, sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch_test_devices import is_fake_device  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
def test_tensor_and_views_offload_one_storage_and_come_back_as_views_of_one_restore(dev: Any, prefetch: str) -> None:
    Probe.seen.clear()
    with dev:
        x = torch.randn(64, 96, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1, prefetch=prefetch) as handle:
            a = x.exp()
            views = (a, a[1:, ::2], a.t(), a[3:40].view(37 * 2, 48), a[5])
            expected = [(v.shape, v.stride(), v.storage_offset(), v.dtype, v.device, v.clone()) for v in views]
            out = Probe.apply(*views)
            settle(dev)  # the D2H copy landed and offcore dropped its device reference
        storage_bytes = a.untyped_storage().nbytes()
        del a, views  # the last references: the device copy dies, backward needs the host copy
        out.backward()

    (restored,) = Probe.seen
    base_ptr = restored[0].untyped_storage().data_ptr()
    for got, (shape, stride, offset, dtype, device, values) in zip(restored, expected, strict=True):
        assert got.untyped_storage().data_ptr() == base_ptr, "views came back on different storages"
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype) == (shape, stride, offset, dtype)
        assert got.device == device
        assert torch.equal(got, values)
    stats = handle.stats()
    assert stats.offloaded_storages == 1, stats
    assert stats.offloaded_bytes == storage_bytes
    assert stats.reloaded_bytes == storage_bytes, "the restore should have come back from the host copy"
    assert stats.freed_device_bytes == storage_bytes


def test_parameters_and_their_views_are_never_offloaded(dev: Any) -> None:
    with dev:
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(dev.torch_device)
        x = torch.randn(32, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = model(x).square().mean()
        loss.backward()
    stats = handle.stats()
    # each Linear saves weight.t(), a view of its parameter: identified by storage, kept on the device
    assert stats.kept.get("parameter", 0) == 2, stats.kept
    assert stats.kept.get("leaf", 0) == 1, stats.kept  # x: a leaf that requires grad
    # offloaded: relu's output (also the second Linear's input) and the second Linear's output
    assert stats.offloaded_storages == 2
    assert stats.offloaded_bytes == 2 * 32 * 64 * 4


def test_parameters_used_functionally_are_recognised_by_their_module(dev: Any) -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 64))
            self.register_buffer("scale", torch.full((64,), 0.5))

        def forward(self, x: Any) -> Any:
            w = self.weight.detach()  # not a leaf requiring grad: only its storage says "parameter"
            return (x @ w * self.scale).sum() + (x @ self.weight).sum()

    with dev:
        model = Functional().to(dev.torch_device)
        x = torch.randn(32, 64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = model(x)
        loss.backward()
    kept = handle.stats().kept
    assert kept.get("parameter", 0) >= 3, kept  # detached weight, buffer, weight


def test_min_bytes_compares_storage_bytes(dev: Any) -> None:
    with dev:
        x = torch.randn(16, 16, device=dev.torch_device, requires_grad=True)  # 1 KiB
        big = torch.randn(256, 256, device=dev.torch_device, requires_grad=True)  # 256 KiB
        with offcore_torch.offload_activations(dev, min_bytes="64KiB") as handle:
            loss = x.exp().sin().sum() + big.exp().sin().sum()
        loss.backward()
    stats = handle.stats()
    assert stats.offloaded_bytes == 256 * 1024  # exp's output saved by sin and exp: one storage
    assert stats.kept["small"] >= 2


def test_mark_overrides_size_and_can_forbid(dev: Any) -> None:
    with dev:
        x = torch.randn(16, 16, device=dev.torch_device, requires_grad=True)
        big = torch.randn(256, 256, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes="64KiB") as handle:
            # marks apply to later saves: `* 2` saves nothing, sin() saves its input
            small = offcore_torch.mark(x * 2, offload=True)
            large = offcore_torch.mark(big * 2, offload=False)
            loss = small.sin().sum() + large.sin().sum()
        loss.backward()
    stats = handle.stats()
    assert stats.offloaded_bytes == 16 * 16 * 4
    assert stats.kept["marked"] >= 1
    with pytest.raises(offcore.ConfigurationError, match="True or False"):
        offcore_torch.mark(x, offload="yes")  # type: ignore[arg-type]


def test_no_offload_region_and_excluded_module(dev: Any) -> None:
    with dev:
        body = nn.Sequential(nn.Linear(64, 256), nn.Tanh()).to(dev.torch_device)
        head = nn.Sequential(nn.Linear(256, 256), nn.Tanh()).to(dev.torch_device)
        x = torch.randn(128, 64, device=dev.torch_device)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            h = body(x)
            with offcore_torch.no_offload():
                loss = head(h).sum()
        loss.backward()
        assert handle.stats().kept["no_offload"] >= 1

        with offcore_torch.offload_activations(dev, min_bytes=1, exclude=head) as excluded:
            loss = head(body(x)).sum()
        loss.backward()
        assert excluded.stats().kept["excluded"] >= 1
        assert excluded.stats().offloaded_storages == handle.stats().offloaded_storages


def test_modules_restricts_offloading_to_their_forward(dev: Any) -> None:
    with dev:
        first = nn.Sequential(nn.Linear(64, 256), nn.Tanh()).to(dev.torch_device)
        second = nn.Sequential(nn.Linear(256, 256), nn.Tanh()).to(dev.torch_device)
        x = torch.randn(128, 64, device=dev.torch_device)
        with offcore_torch.offload_activations(dev, min_bytes=1, modules=[second]) as handle:
            h = first(x)
            loss = second(h).sum()
        loss.backward()
    stats = handle.stats()
    assert stats.kept["outside_modules"] >= 1  # tanh's output in `first`
    assert stats.offloaded_storages >= 1  # second's input h and its tanh output


def test_a_region_whose_tensors_all_live_elsewhere_warns_once_with_the_fix(backend: Any, make_fake_device: Any) -> None:
    """A forward outside ``with dev:`` (or under another device) offloaded nothing and said nothing (0 bytes in
    its stats): Note [A region whose tensors live elsewhere says so]."""
    if not is_fake_device(backend):
        pytest.skip("tensors outside the device's memory in a forward exist only on the fake device")
    dev = sanitized_device(backend, make_fake_device)
    other = make_fake_device()
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))  # host memory, not the device's
    x = torch.randn(16, 64)

    def forward(active: Any) -> Any:
        with active, offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            loss = model(x).sum()
        loss.backward()
        return handle.stats()

    with pytest.warns(offcore.OffcoreWarning, match=r"offloaded nothing: \d+ saved tensor\(s\) were not in") as caught:
        stats = forward(contextlib.nullcontext())
    assert "with dev:" in str(caught[0].message) and stats.offloaded_tensors == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        forward(other)
        with dev:  # on the device: offloaded, no warning
            adopted = dev.adopt(nn.Linear(64, 64))
            with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
                loss = adopted(torch.randn(16, 64)).exp().sum()
            loss.backward()
        assert handle.stats().offloaded_tensors > 0
    settle(dev)


def test_a_region_whose_forward_runs_on_another_thread_warns(dev: Any) -> None:
    """Saved-tensor hooks belong to the thread that entered the region: a forward on a worker thread offloaded
    nothing, silently."""
    with dev:
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(dev.torch_device)
    out: dict[str, Any] = {}

    def forward() -> None:
        with dev:
            out["loss"] = model(torch.randn(8, 64, device=dev.torch_device)).sum()

    with pytest.warns(offcore.OffcoreWarning, match="the forward ran on thread 'worker'"):
        with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            worker = threading.Thread(target=forward, name="worker")
            worker.start()
            worker.join()
    out.pop("loss").backward()
    assert handle.stats().offloaded_tensors == 0
    settle(dev)


def test_tensors_not_on_the_device_are_kept(backend: Any, make_fake_device: Any) -> None:
    if not is_fake_device(backend):
        pytest.skip("mixing host and device tensors in one op works only on the fake device")
    dev = sanitized_device(backend, make_fake_device)
    host = torch.randn(128, 128)  # created outside `with dev:`: host memory, not the device's
    with dev:
        w = torch.randn(128, 128, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=1) as handle:
            loss = (host * w.exp()).sum()  # mul saves host and exp's output
    loss.backward()
    stats = handle.stats()
    assert stats.kept["not_on_device"] == 1
    assert stats.offloaded_storages == 1  # exp's output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_bytes": "-1"}, "min_bytes"),
        ({"prefetch": "eager"}, "prefetch mode"),
        ({"fallback": "drop"}, "fallback"),
        ({"watermark": 1.5}, "watermark"),
        ({"watermark": 0.9, "hysteresis": 0.2}, "exceeds 1"),
        ({"host_budget": 0}, "host_budget"),
        ({"margin": "soon"}, "margin"),
        ({"modules": "layer1"}, "nn.Module"),
        ({"modules": []}, "modules"),
        ({"schedule": object()}, "Scheduler"),
        ({"trace": "yes"}, "trace"),
    ],
)
def test_bad_policy_values_raise_configuration_errors(dev: Any, options: dict[str, Any], message: str) -> None:
    with pytest.raises(offcore.ConfigurationError, match=message):
        offcore_torch.offload_activations(dev, **options)


def test_unknown_policy_options_are_refused_with_the_known_ones(dev: Any) -> None:
    with pytest.raises(offcore.ConfigurationError, match=r"unknown offload option 'foo'.*min_bytes.*trace"):
        offcore_torch.offload_activations(dev, foo=1)
    with pytest.raises(offcore.ConfigurationError, match=r"options 'min_byte', 'prefech'"):
        offcore_torch.offload_activations(dev, prefech="deadline", min_byte=0)


def test_a_device_name_instead_of_a_device_is_refused() -> None:
    with pytest.raises(offcore.ConfigurationError, match="offcore.device"):
        offcore_torch.offload_activations("cpu")
