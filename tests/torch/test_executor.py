"""PlanExecutor: every plan gives the baseline's numbers, bit for bit (Note [Bit-identical plans]).

Each run trains TinyGPT (dropout 0.1, tied embeddings) for 3 AdamW steps on a sanitized
fake device with a slow link (copies still in flight when the next op runs), seeding
``torch.manual_seed(seed + step)`` before every step, and records losses, gradients and
final parameters. Checkpointed layers must replay the same dropout masks
(``preserve_rng_state=True``), offloaded layers must come back exactly.

Gradient accumulation (``microbatches > 1``) is compared exactly against an
accumulate-without-offload reference with the same micro-batch count, and only
loosely (``torch.allclose``, rtol 1e-5 / atol 1e-7, dropout off) against the
full-batch baseline: splitting a mean loss into weighted micro-batch losses changes
the floating-point summation order, and dropout would draw different masks per
micro-batch.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_torch.compare.executor import PlanExecutor, split_batch  # noqa: E402
from offcore_torch.compare.profiler import measure_step  # noqa: E402
from offcore_torch.models import GPTConfig, gpt_workload  # noqa: E402
from offcore_torch.testing import RunRecord, assert_bit_identical, bit_identical  # noqa: E402
from offload_helpers import copied_bytes, moved_since  # noqa: E402
from torch_test_devices import fake_device, finish_device  # noqa: E402

from offcore.errors import ConfigurationError  # noqa: E402
from offcore.sim import Plan, PrefetchPolicy  # noqa: E402

STEPS = 3
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, seq_len=16, dropout=0.1)


def train(device: Any, plan: Plan, *, config: GPTConfig = CONFIG, batch_size: int = 4, seed: int = 0) -> RunRecord:
    """Three optimizer steps of TinyGPT under ``plan``; everything recorded on the CPU."""
    work = gpt_workload(config, batch_size=batch_size)
    record = RunRecord()
    with device:
        model = work.build(seed).to(device.torch_device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with PlanExecutor(model, plan, device) as executor:
            for step in range(STEPS):
                batch = work.make_batch(step, torch.device(device.torch_device))
                torch.manual_seed(seed + step)
                outcome = executor.forward_backward(batch, work.loss)
                record.losses.append(outcome.loss.cpu())
                record.grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})
                record.stats.append(outcome.stats())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        record.params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        device.synchronize()
    return record


def slow_device(make_fake_device: Any) -> Any:
    return make_fake_device(link="slow")


PLANS = {
    "offload all": Plan.uniform(4, "offload"),
    "checkpoint all (K=1)": Plan.uniform(4, "recompute"),
    "checkpoint segments (K=2)": Plan.uniform(4, "recompute", checkpoint_interval=2),
    "hybrid": Plan(["offload", "offload", "recompute", "keep"]),
    "hybrid, segment of 3": Plan(["offload", "recompute", "recompute", "recompute"], checkpoint_interval=3),
    "on-demand reload": Plan(["offload", "keep", "offload", "keep"], prefetch=PrefetchPolicy("on_demand")),
}


@pytest.fixture(scope="module")
def baseline() -> RunRecord:
    """The keep-all run every plan is compared with (computed once)."""
    device = fake_device(link="slow")
    try:
        record = train(device, Plan.keep_all(4))
        assert copied_bytes(device) == {"d2h": 0, "h2d": 0}, "keep-all copies nothing"
        return record
    finally:
        finish_device(device)


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_is_bit_identical_to_the_baseline(name: str, baseline: RunRecord, make_fake_device: Any) -> None:
    device = slow_device(make_fake_device)
    planned = train(device, PLANS[name])
    assert_bit_identical(baseline, planned, labels=("keep-all baseline", name))
    offloads = PLANS[name].count("offload")
    regions = [s for step in planned.stats for s in step]
    assert len(regions) == (STEPS if offloads else 0), "one offload region per step, only when a layer offloads"
    assert all(s.offloaded_bytes > 0 for s in regions), "offloaded layers must really offload"
    # the device's own ledger, not offcore's counters: every offloaded byte crossed the link once each
    # way it was counted, and a plan without offloading copies nothing
    moved = copied_bytes(device)
    assert moved["d2h"] == sum(s.offloaded_bytes for s in regions)
    assert moved["h2d"] == sum(s.reloaded_bytes for s in regions)
    assert (moved["d2h"] > 0) == bool(offloads)


def test_the_plans_cap_on_copies_in_flight_reaches_the_runtime(baseline: RunRecord, make_fake_device: Any) -> None:
    """Note [The simulator caps forward's copies in flight]: PlanExecutor passes ``Plan.max_inflight``
    to offload_activations, so the runtime waits where the simulator does; gradients are unchanged."""
    capped = train(slow_device(make_fake_device), Plan.uniform(4, "offload", max_inflight=0))
    uncapped = train(slow_device(make_fake_device), Plan.uniform(4, "offload", max_inflight=None))
    assert_bit_identical(baseline, capped, labels=("keep-all baseline", "max_inflight=0"))
    assert_bit_identical(baseline, uncapped, labels=("keep-all baseline", "max_inflight=None"))
    # cap 0: every save after the first of a region waits for the copy before it (one at a time)
    assert all(s.inflight_waits > 0 for step in capped.stats for s in step)
    assert all(s.inflight_waits == 0 for step in uncapped.stats for s in step)


def test_offloaded_bytes_are_the_profiled_saved_bytes(make_fake_device: Any) -> None:
    """The executor offloads exactly what the profiler attributed to the offloaded layers (same storage rule)."""
    device = make_fake_device()
    work = gpt_workload(CONFIG, batch_size=4)
    with device:
        model = work.build(0)
        batch = work.make_batch(0, torch.device("cpu"))
        torch.manual_seed(0)
        measurement = measure_step(model, lambda: work.loss(model, batch), device, link=False, batch_size=4)
        model.zero_grad(set_to_none=True)
        plan = Plan(["keep", "offload", "keep", "offload"])
        device.synchronize()
        before = copied_bytes(device)
        with PlanExecutor(model, plan, device) as executor:
            torch.manual_seed(0)
            outcome = executor.forward_backward(batch, work.loss)
        device.synchronize()
        for handle in outcome.handles:
            handle.synchronize()
    layers = measurement.profile.layers
    expected = layers[1].saved_bytes + layers[3].saved_bytes
    assert expected > 0
    assert sum(s.offloaded_bytes for s in outcome.stats()) == expected
    assert moved_since(device, before)["d2h"] == expected, "the device copied exactly those bytes to the host"


def test_accumulation_is_exact_against_accumulation_without_offload(make_fake_device: Any) -> None:
    reference = train(slow_device(make_fake_device), Plan.keep_all(4, microbatches=2))
    device = slow_device(make_fake_device)
    planned = train(
        device,
        Plan(["offload", "recompute", "recompute", "keep"], checkpoint_interval=2, microbatches=2),
    )
    assert_bit_identical(reference, planned, labels=("accumulate, keep all", "accumulate, hybrid"))
    assert all(len(step) == 2 for step in planned.stats), "one offload region per micro-batch"
    assert copied_bytes(device)["d2h"] == sum(s.offloaded_bytes for step in planned.stats for s in step) > 0


def test_accumulation_matches_the_full_batch_up_to_summation_order(make_fake_device: Any) -> None:
    """Loose by design: the first step's gradients agree to rounding (relative norm 1e-5); later
    steps drift a little more because AdamW normalises near-zero gradient entries, turning rounding
    differences into parameter differences of up to its learning rate on those entries."""
    config = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, seq_len=16, dropout=0.0)
    full = train(make_fake_device(), Plan.keep_all(4), config=config)
    device = make_fake_device()
    accumulated = train(device, Plan.uniform(4, "offload", microbatches=2), config=config)
    assert copied_bytes(device)["d2h"] > 0, "the accumulated run really offloaded"
    for a, b in zip(full.losses, accumulated.losses, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for name, grad in full.grads[0].items():
        assert (grad - accumulated.grads[0][name]).norm() <= 1e-5 * grad.norm(), name
    for name in full.params:
        assert torch.allclose(full.params[name], accumulated.params[name], rtol=0, atol=1e-3), name


def test_recompute_lowers_the_peak_and_the_model_is_restored(make_fake_device: Any) -> None:
    device = make_fake_device()
    work = gpt_workload(CONFIG, batch_size=8)
    peaks = {}
    with device:
        model = work.build(0)
        batch = work.make_batch(0, torch.device("cpu"))
        for name, plan in (("keep", Plan.keep_all(4)), ("recompute", Plan.uniform(4, "recompute"))):
            device.synchronize()
            device.reset_peak_memory_stats()
            with PlanExecutor(model, plan, device) as executor:
                assert ("forward" in model.blocks[0].__dict__) == (name == "recompute")
                executor.forward_backward(batch, work.loss)
            peaks[name] = device.memory_stats().peak_allocated_bytes
            model.zero_grad(set_to_none=True)
    assert all("forward" not in block.__dict__ for block in model.blocks)
    assert peaks["recompute"] < peaks["keep"]


def test_segment_needs_layers_fed_in_sequence(make_fake_device: Any) -> None:
    class Skipping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: Any) -> Any:
            h = self.layers[0](x)
            return self.layers[2](self.layers[1](x) + h)  # layer 1 takes x, not layer 0's output

    device = make_fake_device()
    with device:
        model = Skipping()
        x = torch.randn(2, 4)
        with PlanExecutor(model, Plan(["recompute", "recompute", "keep"], checkpoint_interval=2), device) as run:
            with pytest.raises(ConfigurationError, match="checkpoint_interval=1"):
                run.forward_backward((x,), lambda m, b: m(*b).sum())
        with PlanExecutor(model, Plan(["recompute", "recompute", "keep"]), device) as run:
            run.forward_backward((x,), lambda m, b: m(*b).sum())  # K=1 works for any wiring


def test_bad_plans_and_batches_are_refused(make_fake_device: Any) -> None:
    device = make_fake_device()
    model = gpt_workload(CONFIG).build(0)
    with pytest.raises(ConfigurationError, match="4 layers"):
        PlanExecutor(model, Plan.keep_all(3), device)
    with pytest.raises(ConfigurationError, match="layer names"):
        PlanExecutor(model, Plan.keep_all(4, layer_names=["a", "b", "c", "d"]), device)
    with pytest.raises(ConfigurationError, match="set by the executor"):
        PlanExecutor(model, Plan.keep_all(4), device, offload={"modules": []})
    executor = PlanExecutor(model, Plan.keep_all(4), device)
    with pytest.raises(ConfigurationError, match="context manager"):
        executor.forward_backward((torch.zeros(1),), lambda m, b: b[0].sum())
    with pytest.raises(ConfigurationError, match="divisor"):
        split_batch((torch.zeros(5, 2),), 2)
    with pytest.raises(ConfigurationError, match="first dimension"):
        split_batch((torch.zeros(4, 2), torch.zeros(6)), 2)


def test_bad_offload_options_are_refused_at_construction(make_fake_device: Any) -> None:
    device = make_fake_device()
    model = gpt_workload(CONFIG).build(0)
    plan = Plan.uniform(4, "offload")
    with pytest.raises(ConfigurationError, match=r"unknown offload option 'bogus'.*min_bytes.*host_budget"):
        PlanExecutor(model, plan, device, offload={"bogus": 1})
    with pytest.raises(ConfigurationError, match="host_budget"):
        PlanExecutor(model, plan, device, offload={"host_budget": "lots"})
    with pytest.raises(ConfigurationError, match="dict"):
        PlanExecutor(model, plan, device, offload=["trace"])  # type: ignore[arg-type]
    PlanExecutor(model, plan, device, offload={"trace": True, "host_budget": "1GiB"})


def test_split_batch_parts_cover_the_batch() -> None:
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = split_batch((x, y), 3)
    assert [w for _, w in parts] == [1 / 3] * 3
    assert bit_identical(torch.cat([p[0] for p, _ in parts]), x)
    assert bit_identical(torch.cat([p[1] for p, _ in parts]), y)


@pytest.mark.parametrize("interval", [1, 2], ids=["K=1", "K=2"])
def test_a_checkpointed_step_leaves_nothing_allocated_for_the_next(make_fake_device: Any, interval: int) -> None:
    """Between steps a checkpointed model holds what keep-all holds: the executor keeps no segment
    output (which held the checkpoint's saved input through its grad_fn until the next step)."""
    device = make_fake_device(capacity="1GiB")
    config = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, seq_len=16, dropout=0.0)
    work = gpt_workload(config, batch_size=4)
    between: dict[str, int] = {}
    for name, plan in (
        ("keep", Plan.keep_all(4)),
        ("checkpoint", Plan.uniform(4, "recompute", checkpoint_interval=interval)),
    ):
        with device:
            model = work.build(0).to(device.torch_device)
            with PlanExecutor(model, plan, device) as executor:
                batch = work.make_batch(0, torch.device(device.torch_device))
                executor.forward_backward(batch, work.loss)
                del batch
                for p in model.parameters():
                    p.grad = None
                device.synchronize()
                between[name] = int(device.memory_stats().allocated_bytes)
            del model, executor
    assert between["checkpoint"] == between["keep"], between
