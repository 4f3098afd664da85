"""offcore.comparison: the accept / tune / reject rules and the report, without torch."""

from __future__ import annotations

import json

import pytest

from offcore.comparison import STRATEGIES, Comparison, Gates, StrategyResult, decide
from offcore.errors import ConfigurationError

MiB = 2**20


def ok(
    name: str, *, step: float = 0.1, peak: int = 8 * MiB, wait: float = 0.0, delta: float = 0.0, **kw
) -> StrategyResult:
    return StrategyResult(
        name,
        status="ok",
        plan="KKKK",
        tokens_per_step=1000,
        step_times_s=[step * 1.1, step, step * 0.9],
        peak_device_bytes=peak,
        exposed_wait_s=wait,
        loss_delta=delta,
        bit_identical=delta == 0.0,
        compared_with="baseline",
        predicted_step_s=step,
        **kw,
    )


def test_figures_are_medians_and_ratios() -> None:
    r = ok("offload", step=0.2, wait=0.05)
    assert r.step_s == 0.2 and r.tokens_per_s == 5000.0
    assert r.utilization == pytest.approx(0.75)
    assert r.prediction_error == pytest.approx(0.0)
    failed = StrategyResult("baseline", status="oom", error="out of memory")
    assert failed.step_s is None and failed.tokens_per_s is None and failed.utilization is None


@pytest.mark.parametrize(
    ("result", "gates", "verdict", "reason"),
    [
        (ok("checkpoint"), Gates(memory_budget=10 * MiB), "accept", "bit-identical"),
        (StrategyResult("baseline", status="oom", error="tried 2 MiB"), Gates(), "reject", "out of device memory"),
        (StrategyResult("planned", status="skipped", error="no plan"), Gates(), "reject", "did not run"),
        (ok("offload", peak=12 * MiB), Gates(memory_budget=10 * MiB), "reject", "exceeds the memory budget"),
        (ok("accumulate", delta=1e-3), Gates(max_loss_delta=1e-4), "reject", "loss differs"),
        (ok("accumulate", delta=1e-7), Gates(max_loss_delta=1e-4), "accept", "loss within"),
        (ok("hybrid", step=0.1), Gates(min_throughput=20000), "tune", "below the floor"),
        (ok("offload", step=0.1, wait=0.02), Gates(), "tune", "waits for copies"),
    ],
)
def test_decisions(result: StrategyResult, gates: Gates, verdict: str, reason: str) -> None:
    decision = decide(result, gates)
    assert decision.verdict == verdict
    assert reason in decision.line()


def test_gates_refuse_nonsense() -> None:
    with pytest.raises(ConfigurationError, match="memory_budget"):
        Gates(memory_budget=0)
    with pytest.raises(ConfigurationError, match="min_throughput"):
        Gates(min_throughput=float("nan"))
    with pytest.raises(ConfigurationError, match="max_loss_delta"):
        Gates(max_loss_delta=-1e-9)


def comparison(baseline: StrategyResult) -> Comparison:
    results = [baseline, ok("checkpoint", step=0.12, max_batch=12), ok("offload", step=0.3, wait=0.1, max_batch=8)]
    return Comparison(
        workload={"batch": 8, "seq_len": 64},
        device={"backend": "cpu", "capacity_bytes": 10 * MiB},
        results=results,
        gates=Gates(),
        reference="reference run",
        notes=["capacity: 10 MiB"],
    )


def test_no_speedup_against_a_baseline_that_did_not_run() -> None:
    """Note [Never a speedup against a baseline that did not run]."""
    c = comparison(StrategyResult("baseline", status="oom", error="tried 4 MiB", max_batch=4))
    headers, rows = c.table()
    assert "vs base" not in headers and headers[-1] == "max batch"
    assert [row[1] for row in rows] == ["OOM", "ok", "ok"]
    text = c.text()
    assert "scale gained" in text and "3.0x the baseline's 4" in text
    assert "the baseline's speed" not in text
    assert "recommended: checkpoint" in text


def test_speedups_when_the_baseline_ran() -> None:
    c = comparison(ok("baseline", step=0.1, max_batch=6))
    headers, rows = c.table()
    assert headers[-1] == "vs base"
    assert rows[1][-1] == "0.83x" and rows[2][-1] == "0.33x"
    assert "0.83x the baseline's speed" in c.text()


def test_reports_hold_every_strategy() -> None:
    c = comparison(StrategyResult("baseline", status="oom", error="tried 4 MiB"))
    data = json.loads(c.to_json())
    assert data["format"] == "offcore.compare/1"
    assert [s["name"] for s in data["strategies"]] == ["baseline", "checkpoint", "offload"]
    assert [d["verdict"] for d in data["decisions"]] == ["reject", "accept", "tune"]
    markdown = c.markdown(images=["memory.png"])
    assert "| baseline | OOM |" in markdown and "![memory.png](memory.png)" in markdown
    assert set(STRATEGIES) >= {r.name for r in c.results}
