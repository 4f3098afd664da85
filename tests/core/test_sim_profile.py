"""Step profiles: validation, JSON, micro-batch splitting and the transformer estimates."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from offcore import ConfigurationError
from offcore.sim import (
    LayerProfile,
    StepProfile,
    transformer_layer_flops,
    transformer_layer_profile,
    transformer_saved_bytes,
    transformer_step_profile,
    uniform_profile,
)


def test_recompute_time_defaults_to_forward_time():
    assert LayerProfile("a", 1.5, 3.0, 10).recompute_s == 1.5
    assert LayerProfile("a", 1.5, 3.0, 10, recompute_s=0.25).recompute_s == 0.25


def test_units_are_accepted_and_nonsense_is_refused():
    layer = LayerProfile("a", "2ms", "4ms", "1MiB", working_bytes="4KiB")
    assert (layer.forward_s, layer.saved_bytes, layer.working_bytes) == (0.002, 2**20, 4096)
    profile = StepProfile([layer], param_bytes="1GB", d2h_bandwidth="53GB/s", h2d_bandwidth=35e9, latency_s="10us")
    assert (profile.param_bytes, profile.d2h_bandwidth) == (10**9, 53e9)
    assert profile.latency_s == pytest.approx(1e-5)
    for bad in (
        lambda: LayerProfile("a", -1.0, 1.0, 1),
        lambda: LayerProfile("a", 1.0, 1.0, -5),
        lambda: LayerProfile("", 1.0, 1.0, 1),
        lambda: StepProfile([]),
        lambda: StepProfile([layer, layer]),
        lambda: StepProfile([layer], d2h_bandwidth="64MB/s/s"),
        lambda: StepProfile([layer], h2d_bandwidth=0),
        lambda: StepProfile([layer], duplex="yes"),
        lambda: StepProfile([layer], batch_size=0),
        lambda: StepProfile(["layer"]),
    ):
        with pytest.raises(ConfigurationError):
            bad()


def test_json_round_trip_keeps_every_field():
    profile = StepProfile(
        [
            LayerProfile("embed", 1e-3, 2e-3, 123, recompute_s=5e-4, working_bytes=7, input_bytes=3),
            LayerProfile("block", 2e-3, 4e-3, 456),
        ],
        param_bytes=1000,
        grad_bytes=1000,
        other_bytes=5,
        d2h_bandwidth="inf",
        h2d_bandwidth="35GB/s",
        latency_s=1e-5,
        duplex=False,
        capacity_bytes="80GiB",
        batch_size=4,
    )
    text = profile.to_json()
    json.loads(text)  # strict JSON: no Infinity literal
    assert "Infinity" not in text
    again = StepProfile.from_json(text)
    assert again == profile
    assert math.isinf(again.d2h_bandwidth)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ('{"layers": 3}', "layers"),
        ('{"layers": [], "bogus": 1}', "unknown step profile fields"),
        ('{"layers": [{"name": "a", "forward_s": 1, "backward_s": 1, "saved_bytes": 1, "x": 2}]}', "layer 0"),
        ('{"format": "other/9", "layers": []}', "format"),
    ],
)
def test_bad_profile_json_is_refused(text, message):
    with pytest.raises(ConfigurationError, match=message):
        StepProfile.from_json(text)


def test_split_microbatches_scales_per_sample_costs_only():
    profile = StepProfile(
        [LayerProfile("a", 4.0, 8.0, 400, recompute_s=2.0, working_bytes=40, input_bytes=4)],
        param_bytes=99,
        batch_size=8,
    )
    micro = profile.split_microbatches(4)
    layer = micro.layers[0]
    assert (layer.forward_s, layer.backward_s, layer.recompute_s) == (1.0, 2.0, 0.5)
    assert (layer.saved_bytes, layer.working_bytes, layer.input_bytes) == (100, 10, 1)
    assert (micro.param_bytes, micro.batch_size) == (99, 2)
    with pytest.raises(ConfigurationError, match="divisor"):
        profile.split_microbatches(3)


def test_with_link_changes_only_the_link():
    profile = uniform_profile(2, forward_s=1.0, backward_s=1.0, saved_bytes=1)
    assert profile.with_link(h2d_bandwidth="1GB/s").h2d_bandwidth == 1e9
    with pytest.raises(ConfigurationError):
        profile.with_link(param_bytes=3)


# --- transformer estimates -----------------------------------------------------------------------


@pytest.mark.parametrize(("b", "s", "h", "a"), [(1, 2048, 1024, 16), (4, 512, 768, 12), (2, 4096, 4096, 32)])
def test_korthikanti_per_layer_activation_estimate(b, s, h, a):
    # Korthikanti et al. 2022, eq. (1): s·b·h·(34 + 5·a·s/h) bytes (fp16, dropout, GeLU MLP, f = 4h)
    expected = s * b * h * 34 + 5 * a * s * s * b
    got = transformer_saved_bytes(
        batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, attention="eager", mlp="gelu", dropout=True
    )
    assert got == expected


def test_llama_7b_block_at_4k_with_fused_attention():
    t, h, f, a = 4096, 4096, 11008, 32
    saved = transformer_saved_bytes(batch=1, seq=t, hidden=h, heads=a, ffn=f)
    assert saved == t * ((8 * h + 3 * f) * 2 + 4 * a)
    flops = transformer_layer_flops(batch=1, seq=t, hidden=h, ffn=f)
    assert flops == 2 * t * (4 * h * h + 3 * h * f) + 4 * t * t * h * 0.5
    layer = transformer_layer_profile(batch=1, seq=t, hidden=h, heads=a, ffn=f, flops_per_s=1e15)
    assert layer.forward_s == pytest.approx(flops / 1e15)
    assert layer.backward_s == pytest.approx(2 * layer.forward_s)
    assert layer.input_bytes == t * h * 2


def test_half_granularity_splits_each_block_into_two_layers_that_add_up():
    shapes = dict(batch=2, seq=256, hidden=128, heads=4, ffn=344, flops_per_s=1e12, vocab=1000)
    block = transformer_step_profile(layers=3, **shapes)
    half = transformer_step_profile(layers=3, granularity="half", **shapes)
    assert half.layer_names[:2] == ("layer0.attn", "layer0.mlp") and half.n_layers == 6
    assert half.saved_bytes == block.saved_bytes
    assert half.forward_s == pytest.approx(block.forward_s)
    assert half.param_bytes == block.param_bytes == (3 * (4 * 128**2 + 3 * 128 * 344) + 2 * 1000 * 128) * 2
    with pytest.raises(ConfigurationError):
        transformer_step_profile(layers=3, granularity="quarter", **shapes)  # type: ignore[arg-type]


def test_transformer_arguments_are_checked():
    with pytest.raises(ConfigurationError, match="flops_per_s"):
        transformer_layer_profile(batch=1, seq=8, hidden=8, heads=2, ffn=8, flops_per_s=0)
    with pytest.raises(ConfigurationError, match="attention"):
        transformer_saved_bytes(batch=1, seq=8, hidden=8, heads=2, ffn=8, attention="sparse")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="seq"):
        transformer_saved_bytes(batch=1, seq=0, hidden=8, heads=2, ffn=8)


def test_importing_the_simulator_pulls_in_neither_torch_nor_scipy():
    code = (
        "import sys, offcore.sim, offcore.sim.planner;"
        "bad = [m for m in ('torch', 'scipy') if m in sys.modules];"
        "print(','.join(bad))"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert output.strip() == ""
