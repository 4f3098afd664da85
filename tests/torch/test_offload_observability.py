"""Stats, Chrome trace and profiler ranges of an offload region."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def one_step(dev: Any, **policy: Any) -> Any:
    torch.manual_seed(0)
    with dev:
        model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 1)).to(dev.torch_device)
        x = torch.randn(128, 128, device=dev.torch_device)
        with offcore_torch.offload_activations(dev, min_bytes=1, **policy) as handle:
            loss = model(x).square().mean()
            settle(dev)  # copies landed and device copies released: backward reloads from the host
        loss.backward()
    return handle


def test_stats_are_json_ready_and_consistent(dev: Any) -> None:
    stats = one_step(dev).stats()
    data = json.loads(json.dumps(stats.as_dict()))
    assert set(data) >= {
        "offloaded_bytes",
        "reloaded_bytes",
        "freed_device_bytes",
        "held_elsewhere_bytes",
        "peak_device_bytes",
        "peak_pinned_bytes",
        "peak_pageable_bytes",
        "exposed_wait_s",
        "waits",
        "stalls",
        "d2h_bandwidth",
        "h2d_bandwidth",
        "fallbacks",
    }
    assert stats.offloaded_bytes > 0
    assert stats.freed_device_bytes + stats.held_elsewhere_bytes <= stats.offloaded_bytes
    assert stats.peak_pinned_bytes >= max(1, stats.offloaded_bytes // stats.offloaded_storages)
    assert stats.peak_device_bytes > 0
    assert stats.exposed_wait_s == pytest.approx(sum(stats.waits.values()))
    assert stats.saved_tensors == stats.offloaded_tensors + sum(stats.kept.values())
    assert stats.offloaded_tensors >= stats.offloaded_storages  # views share their storage's copy
    assert "offloaded" in str(stats)


def test_trace_has_compute_copy_and_wait_tracks(dev: Any, tmp_path: Path) -> None:
    handle = one_step(dev, trace=True, prefetch="on_demand")  # on-demand: every reload is a wait
    path = tmp_path / "step.json"
    handle.write_trace(path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    by_track = {name: [e for e in spans if tracks[e["tid"]] == name] for name in ("compute", "d2h", "h2d", "wait")}
    assert {e["name"] for e in by_track["compute"]} >= {"forward", "backward 0"}
    for name in ("d2h", "h2d", "wait"):
        assert by_track[name], f"no {name} spans"
    for e in spans:
        assert e["ts"] >= 0 and e["dur"] >= 0
    d2h_bytes = sum(e["args"]["bytes"] for e in by_track["d2h"])
    assert d2h_bytes == handle.stats().offloaded_bytes


def test_write_trace_needs_trace_enabled(dev: Any, tmp_path: Path) -> None:
    handle = one_step(dev)
    with pytest.raises(offcore.ConfigurationError, match="trace=True"):
        handle.write_trace(tmp_path / "x.json")


def test_profiler_sees_offcore_ranges(dev: Any) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        one_step(dev, prefetch="on_demand")
    names = {event.name for event in prof.events()}
    assert {"offcore::d2h", "offcore::h2d", "offcore::wait"} <= names
