"""The profiler turns one real step into an offcore.sim.StepProfile.

Saved bytes follow the activation plugin's storage rule exactly (unique storages on
the device, parameters and their views excluded), so they are checked to the byte;
times are only checked for being measured (positive, consistent), never against a
wall-clock figure.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_torch.compare.link import measure_link  # noqa: E402
from offcore_torch.compare.profiler import LinkMeasurement, measure_step, profile_step  # noqa: E402
from offcore_torch.layers import find_layers  # noqa: E402
from offcore_torch.models import GPTConfig, gpt_workload  # noqa: E402

from offcore.errors import ConfigurationError  # noqa: E402
from offcore.sim import Plan, StepProfile, simulate  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=3, seq_len=16, dropout=0.1)


def two_linears() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def test_saved_bytes_count_storages_on_the_device_and_never_parameters(make_fake_device: Any) -> None:
    device = make_fake_device()
    with device:
        model = two_linears()
        x = torch.randn(32, 8)
        profile = profile_step(model, lambda: model(x).sum(), device, link=False)
    # Linear saves its input (and its weight, a parameter): layer 0 saves x, layer 1 saves layer 0's output.
    assert [layer.saved_bytes for layer in profile.layers] == [32 * 8 * 4, 32 * 16 * 4]
    assert [layer.input_bytes for layer in profile.layers] == [32 * 8 * 4, 32 * 16 * 4]
    assert profile.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_tensors_not_on_the_device_are_not_counted(make_fake_device: Any) -> None:
    device = make_fake_device()
    x = torch.randn(32, 8)  # created before the device was active: host memory, not device memory
    with device:
        model = two_linears()
        profile = profile_step(model, lambda: model(x).sum(), device, link=False)
    assert profile.layers[0].saved_bytes == 0
    assert profile.layers[1].saved_bytes == 32 * 16 * 4


def test_views_of_one_storage_count_once(make_fake_device: Any) -> None:
    class Viewer(torch.nn.Module):
        def forward(self, a: Any) -> Any:
            return (a * a).sum() + (a[:, ::2] * a[:, ::2].t().t()).sum() + torch.tanh(a[1:]).sum()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.view = Viewer()

        def forward(self, x: Any) -> Any:
            return self.view(self.proj(x))

    device = make_fake_device()
    with device:
        model = Model()
        x = torch.randn(16, 8)
        measurement = measure_step(model, lambda: model(x), device, link=False)
    a_bytes = 16 * 8 * 4
    tanh_output = 15 * 8 * 4  # tanh saves its (fresh) output
    assert [layer.name for layer in measurement.profile.layers] == ["proj", "view"]
    assert measurement.profile.layers[1].saved_bytes == a_bytes + tanh_output


def test_gpt_profile_has_one_layer_per_block_and_measured_times(make_fake_device: Any) -> None:
    device = make_fake_device()
    work = gpt_workload(CONFIG, batch_size=4)
    with device:
        model = work.build(0)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = work.make_batch(0, torch.device("cpu"))
        measurement = measure_step(
            model, lambda: work.loss(model, batch), device, optimizer=optimizer, batch_size=4, link=False
        )
    profile = measurement.profile
    assert isinstance(profile, StepProfile)
    assert profile.layer_names == tuple(name for name, _ in find_layers(model)) == ("blocks.0", "blocks.1", "blocks.2")
    assert len({layer.saved_bytes for layer in profile.layers}) == 1, "identical blocks save identical bytes"
    tokens, width = 4 * CONFIG.seq_len, CONFIG.d_model
    assert profile.layers[0].saved_bytes > 10 * tokens * width * 4, "a block saves many activations"
    assert all(layer.input_bytes == tokens * width * 4 for layer in profile.layers)
    for layer in profile.layers:
        assert layer.forward_s > 0 and layer.backward_s > 0 and layer.recompute_s == layer.forward_s
    assert measurement.forward_s >= profile.forward_s and measurement.backward_s >= profile.backward_s
    assert measurement.optimizer_s > 0 and measurement.other_compute_s > 0
    assert measurement.other_saved_bytes > 0, "the head saves logits outside the blocks"
    assert profile.batch_size == 4 and measurement.layer_calls == (1, 1, 1)
    assert math.isinf(profile.d2h_bandwidth) and math.isinf(profile.h2d_bandwidth)
    assert profile.capacity_bytes == device.memory_stats().capacity_bytes
    # Note [Calibrated other bytes]: the simulated keep-all peak is the measured one (or above).
    assert simulate(profile, Plan.keep_all(3)).peak_bytes >= measurement.peak_bytes
    assert measurement.peak_bytes > measurement.resident_bytes + 3 * profile.layers[0].saved_bytes // 2
    assert StepProfile.from_json(profile.to_json()) == profile


def test_microbatch_profile_shrinks_only_the_batch_dependent_bytes(make_fake_device: Any) -> None:
    device = make_fake_device()
    work = gpt_workload(CONFIG, batch_size=4)
    with device:
        model = work.build(0)
        batch = work.make_batch(0, torch.device("cpu"))
        measurement = measure_step(model, lambda: work.loss(model, batch), device, batch_size=4, link=False)
    half = measurement.profile_for_microbatches(2)
    assert half.other_bytes < measurement.profile.other_bytes
    assert half.other_bytes >= measurement.profile.other_bytes - measurement.per_sample_other_bytes
    result, seconds = measurement.predict(Plan.keep_all(3, microbatches=2))
    assert result.peak_bytes < simulate(measurement.profile, Plan.keep_all(3)).peak_bytes
    assert seconds == pytest.approx(result.step_time_s + measurement.other_compute_s)


def test_backward_of_a_layer_whose_input_needs_no_grad(make_fake_device: Any) -> None:
    """The first layer's input (the batch) needs no gradient; its backward ends where the step's does."""
    device = make_fake_device()
    with device:
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(2)])
        x = torch.randn(128, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no full-backward-hook warnings: tensor hooks only
            profile = profile_step(model, lambda: model(x).square().mean(), device, link=False)
    assert all(layer.backward_s > 0 for layer in profile.layers)


def test_link_measurement_is_used_and_measured(make_fake_device: Any) -> None:
    device = make_fake_device(link="slow")
    given = LinkMeasurement(1e9, 2e9, 1e-5, False)
    with device:
        model = two_linears()
        x = torch.randn(8, 8)
        profile = profile_step(model, lambda: model(x).sum(), device, link=given, capacity_bytes=12345678)
        measured = measure_link(device, max_bytes="256KiB", repeats=1)
    assert (profile.d2h_bandwidth, profile.h2d_bandwidth, profile.latency_s, profile.duplex) == (1e9, 2e9, 1e-5, False)
    assert profile.capacity_bytes == 12345678
    assert 0 < measured.d2h_bandwidth < math.inf and 0 < measured.h2d_bandwidth < math.inf
    assert measured.duplex is True and measured.sizes[0] == 64 * 1024 and max(measured.sizes) <= 256 * 1024
    assert device.memory_stats().allocated_bytes < 256 * 1024, "the measurement's buffers are freed"


def test_bad_steps_and_layers_are_refused(make_fake_device: Any) -> None:
    device = make_fake_device()
    with device:
        model = two_linears()
        x = torch.randn(4, 8)
        with pytest.raises(ConfigurationError, match="scalar loss"):
            profile_step(model, lambda: model(x), device, link=False)
        square = torch.nn.Sequential(torch.nn.Linear(8, 8))
        with pytest.raises(ConfigurationError, match="ran 2 times"):
            profile_step(square, lambda: square[0](square[0](x)).sum(), device, layers=[square[0]], link=False)
        with pytest.raises(ConfigurationError, match="not a submodule"):
            profile_step(model, lambda: model(x).sum(), device, layers=[torch.nn.Linear(2, 2)], link=False)
        with pytest.raises(ConfigurationError, match="link must be"):
            profile_step(model, lambda: model(x).sum(), device, link="fast")
    # hooks were removed after each failure: a plain step runs without the profiler's bookkeeping
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_calibration_scales_times_measures_offload_overhead_and_leaves_no_trace(make_fake_device: Any) -> None:
    # Note [Profiler calibration]: the extra passes restore gradients and the RNG state, so a calibrated
    # profile leaves the model exactly as an uncalibrated one does; its figures are consistent
    device = make_fake_device()
    results, grads, rng = [], [], []
    for calibrate in (False, True):
        with device:
            workload = gpt_workload(CONFIG, batch_size=4)
            model = workload.build(0)
            batch = workload.make_batch(0, torch.device(device.torch_device))
            torch.manual_seed(7)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                results.append(
                    measure_step(
                        model,
                        lambda model=model, batch=batch, workload=workload: workload.loss(model, batch),
                        device,
                        link=False,
                        calibrate=calibrate,
                        calibration_passes=1,
                    )
                )
            grads.append([p.grad.clone() for p in model.parameters()])
            rng.append(torch.get_rng_state())
    plain, calibrated = results
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    assert torch.equal(rng[0], rng[1])
    assert 0.0 < calibrated.instrumentation_scale <= 1.0 and plain.instrumentation_scale == 1.0
    assert calibrated.offload_overhead_per_storage_s >= 0.0 and plain.offload_overhead_per_storage_s == 0.0
    assert calibrated.layer_storages == plain.layer_storages and all(c > 0 for c in calibrated.layer_storages)
    for layer, count in zip(calibrated.profile.layers, calibrated.layer_storages, strict=True):
        assert layer.offload_overhead_s == pytest.approx(calibrated.offload_overhead_per_storage_s * count)
    assert all(layer.offload_overhead_s == 0.0 for layer in plain.profile.layers)
    assert calibrated.recompute_overhead_per_storage_s >= 0.0 and plain.recompute_overhead_per_storage_s == 0.0
    for layer, count in zip(calibrated.profile.layers, calibrated.layer_storages, strict=True):
        extra = calibrated.recompute_overhead_per_storage_s * count
        assert layer.recompute_s == pytest.approx(layer.forward_s + extra)
    assert all(layer.recompute_s == layer.forward_s for layer in plain.profile.layers)
    assert calibrated.profile.reuse_in_flight and plain.profile.reuse_in_flight
    assert [lp.saved_bytes for lp in calibrated.profile.layers] == [lp.saved_bytes for lp in plain.profile.layers]
    with pytest.raises(ConfigurationError, match="calibration_passes"):
        with device:
            measure_step(
                model, lambda: workload.loss(model, batch), device, link=False, calibrate=True, calibration_passes=0
            )
