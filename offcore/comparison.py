"""Results of ``offcore compare``: one row per strategy, the budget decision, the report (no torch).

The compare workflow (seed 004): fix the workload, run the baseline, run each
candidate strategy on the same workload, decide under a memory budget, a throughput
floor and a quality gate, and explain the peak. The runner (``offcore_torch.compare.compare``)
fills :class:`StrategyResult` objects; this module turns them into the table, the
accept / tune / reject decisions and the JSON / Markdown reports.

    >>> r = StrategyResult("checkpoint", status="ok", tokens_per_step=512, step_times_s=[0.2, 0.3, 0.25],
    ...                    peak_device_bytes=900, bit_identical=True, loss_delta=0.0)
    >>> r.step_s, r.tokens_per_s
    (0.25, 2048.0)
    >>> decide(r, Gates(memory_budget=1000)).verdict
    'accept'

# Note [Never a speedup against a baseline that did not run]
# When the keep-all baseline runs out of memory, nothing is faster or slower than it:
# the report gives the *scale gained* instead (the memory headroom each strategy leaves
# and the largest batch it fits, predicted by the simulator from the profile), and the
# speedup column stays empty. Only a baseline with status "ok" is a time reference.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from offcore.errors import ConfigurationError
from offcore.jsonable import finite
from offcore.units import format_bandwidth, format_bytes

__all__ = [
    "STRATEGIES",
    "StrategyResult",
    "Gates",
    "Decision",
    "decide",
    "Comparison",
]

STRATEGIES: tuple[str, ...] = (
    "baseline",
    "accumulate",
    "checkpoint",
    "offload",
    "hybrid",
    "optimizer-offload",
    "optimizer+activation-offload",
    "param-stream",
    "optimizer-offload-nvme",
    "planned",
)
"""The strategies ``offcore compare`` knows, in the order it runs and prints them."""

LEGEND = (
    "step ms: median of the timed steps; wait ms: compute time spent waiting for reloads; "
    "U = compute / (compute + wait); pred ms: the simulator's step time on the profile every plan was chosen on; "
    "err: measured / predicted - 1; max batch: the largest batch that fits the capacity, measured by real steps "
    "(~N: extrapolated from the measured peaks; N (sim): the simulator's, for a strategy that did not run)"
)


def _max_batch_cell(r: StrategyResult) -> str:
    """The table's max batch: plain when measured, ``~N`` extrapolated, ``N (sim)`` simulated."""
    if r.max_batch is None or (not r.max_batch and r.max_batch_source != "measured"):
        return "-"
    if r.max_batch_source == "extrapolated":
        return f"~{r.max_batch}"
    if r.max_batch_source == "simulated":
        return f"{r.max_batch} (sim)"
    return str(r.max_batch)


def _source(r: StrategyResult) -> str:
    """`` (measured)``-style label of a max batch (empty when unknown)."""
    return f" ({r.max_batch_source})" if r.max_batch_source and r.max_batch is not None else ""


EXPOSED_WAIT_TUNE_FRACTION = 0.10
"""A strategy whose copies leave more than this share of its step waiting is marked *tune*."""


@dataclass
class StrategyResult:
    """What one strategy did on the fixed workload (times in seconds, sizes in bytes).

    ``status`` is ``"ok"``, ``"oom"`` (out of device memory: ``error`` says where) or
    ``"skipped"`` (``error`` says why). Measured figures are medians over the timed
    iterations (step time) or maxima (peaks); ``predicted_*`` come from the simulator
    on the profile every strategy was planned on (for "planned", the planner's own figure);
    ``reprofiled_step_s`` is the prediction from a step profiled right before this
    strategy ran (the host load of that moment). ``bit_identical`` compares every loss, gradient and final
    parameter with ``compared_with``; ``loss_delta`` is the largest absolute loss
    difference and ``grad_rel_diff`` the largest relative gradient difference (norm).
    ``max_batch`` is the largest batch that fits the capacity and ``max_batch_source`` says
    how it was found: ``"measured"`` (real training steps at that batch ran and one
    micro-batch count more ran out of memory; ``max_batch_probes`` lists the probed
    ``[batch, fits]``), ``"extrapolated"`` (from the measured peaks, linear in the batch;
    also kept in ``extrapolated_max_batch``) or ``"simulated"`` (a strategy that did not run,
    not probed); ``predicted_max_batch`` is the simulator's answer for the same plan.
    """

    name: str
    status: str = "ok"
    error: str = ""
    plan: str = ""
    plan_dict: dict[str, Any] | None = None
    why: str = ""
    tokens_per_step: int = 0
    step_times_s: list[float] = field(default_factory=list)
    peak_device_bytes: int | None = None
    peak_pinned_bytes: int = 0
    peak_pageable_bytes: int = 0
    copied_bytes: int = 0
    exposed_wait_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    loss_delta: float | None = None
    grad_rel_diff: float | None = None
    bit_identical: bool | None = None
    compared_with: str = ""
    equality_note: str = ""
    predicted_step_s: float | None = None
    reprofiled_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_wait_s: float | None = None
    max_batch: int | None = None
    max_batch_source: str = ""
    extrapolated_max_batch: int | None = None
    max_batch_probes: list[list[Any]] = field(default_factory=list)
    predicted_max_batch: int | None = None
    memory_series: list[tuple[float, int]] = field(default_factory=list)
    predicted_memory: list[tuple[float, int]] = field(default_factory=list)
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)
    predicted_timeline: list[tuple[str, str, float, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every step ran."""
        return self.status == "ok"

    @property
    def step_s(self) -> float | None:
        """Median measured step time."""
        return statistics.median(self.step_times_s) if self.ok and self.step_times_s else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second at the median step time."""
        step = self.step_s
        return self.tokens_per_step / step if step else None

    @property
    def utilization(self) -> float | None:
        """``U = T_compute / (T_compute + T_exposed_wait)`` with ``T_compute = step − wait``."""
        step = self.step_s
        if not step:
            return None
        return max(0.0, step - self.exposed_wait_s) / step

    @property
    def prediction_error(self) -> float | None:
        """``measured / predicted − 1`` of the step time."""
        step = self.step_s
        if not step or not self.predicted_step_s:
            return None
        return step / self.predicted_step_s - 1.0

    def summary(self) -> dict[str, Any]:
        """Scalar figures (no series), JSON-ready."""
        data = {k: v for k, v in asdict(self).items() if k not in _SERIES}
        data.update(
            step_s=self.step_s,
            tokens_per_s=self.tokens_per_s,
            utilization=self.utilization,
            prediction_error=self.prediction_error,
        )
        return data


_SERIES = ("memory_series", "predicted_memory", "timeline", "predicted_timeline")


@dataclass(frozen=True)
class Gates:
    """The budget decision's thresholds.

    - ``memory_budget``: device bytes a strategy may peak at (default: the capacity).
    - ``min_throughput``: tokens per second a strategy must reach (``None``: no floor).
    - ``max_loss_delta``: the largest absolute loss difference from the reference
      accepted (0 demands bit-identical losses).

    >>> Gates(max_loss_delta=-1)
    Traceback (most recent call last):
    ...
    offcore.errors.ConfigurationError: max_loss_delta must be a number >= 0, got -1
    """

    memory_budget: int | None = None
    min_throughput: float | None = None
    max_loss_delta: float = 1e-4

    def __post_init__(self) -> None:
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int) or self.memory_budget <= 0):
            raise ConfigurationError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        if self.min_throughput is not None and not (
            isinstance(self.min_throughput, (int, float))
            and math.isfinite(self.min_throughput)
            and self.min_throughput >= 0
        ):
            raise ConfigurationError(f"min_throughput must be tokens/s >= 0, got {self.min_throughput!r}")
        if not (
            isinstance(self.max_loss_delta, (int, float))
            and math.isfinite(self.max_loss_delta)
            and self.max_loss_delta >= 0
        ):
            raise ConfigurationError(f"max_loss_delta must be a number >= 0, got {self.max_loss_delta!r}")


@dataclass(frozen=True)
class Decision:
    """``verdict`` is ``accept``, ``tune`` or ``reject``; ``reasons`` say why (one line each)."""

    strategy: str
    verdict: str
    reasons: tuple[str, ...]

    def line(self) -> str:
        """``strategy: verdict — reason; reason``."""
        return f"{self.strategy}: {self.verdict} — {'; '.join(self.reasons)}"


def decide(result: StrategyResult, gates: Gates) -> Decision:
    """Accept, tune or reject one strategy.

    - **reject**: it did not run (out of memory, skipped); its peak exceeds the memory
      budget; or its loss moved more than ``max_loss_delta`` from the reference.
    - **tune**: it passes those gates but is below ``min_throughput``, or more than
      10 % of its step is exposed copy wait (the copies are not hidden: prefetch
      budget, bandwidth or fewer offloaded layers would help).
    - **accept**: everything passes.
    """
    reasons: list[str] = []
    if result.status == "oom":
        return Decision(result.name, "reject", (f"out of device memory ({result.error})",))
    if not result.ok:
        return Decision(result.name, "reject", (f"did not run: {result.error}",))
    hard: list[str] = []
    peak = result.peak_device_bytes or 0
    if gates.memory_budget is not None and peak > gates.memory_budget:
        hard.append(f"peak {format_bytes(peak)} exceeds the memory budget {format_bytes(gates.memory_budget)}")
    delta = result.loss_delta
    if delta is None or delta > gates.max_loss_delta:
        shown = "unknown" if delta is None else f"{delta:.3g}"
        hard.append(
            f"loss differs from the {result.compared_with or 'reference'} by {shown} > {gates.max_loss_delta:g}"
        )
    if hard:
        return Decision(result.name, "reject", tuple(hard))
    soft: list[str] = []
    rate = result.tokens_per_s or 0.0
    if gates.min_throughput is not None and rate < gates.min_throughput:
        soft.append(f"{rate:,.0f} tokens/s is below the floor of {gates.min_throughput:,.0f}")
    step = result.step_s or 0.0
    if step and result.exposed_wait_s > EXPOSED_WAIT_TUNE_FRACTION * step:
        soft.append(
            f"{result.exposed_wait_s / step:.0%} of the step waits for copies (prefetch earlier, offload fewer layers, "
            "or a faster link)"
        )
    if soft:
        return Decision(result.name, "tune", tuple(soft))
    if gates.memory_budget is not None:
        reasons.append(f"peak {format_bytes(peak)} within {format_bytes(gates.memory_budget)}")
    reasons.append(f"{rate:,.0f} tokens/s")
    reasons.append("bit-identical" if result.bit_identical else f"loss within {gates.max_loss_delta:g}")
    return Decision(result.name, "accept", tuple(reasons))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


@dataclass
class Comparison:
    """The whole run: workload, device, reference, one result per strategy, decisions.

    ``notes`` are the lines printed before the table (what was chosen and why);
    ``plugin_traces`` the activation plugin's own Chrome traces of the observed step,
    per strategy (not part of :meth:`to_dict`).
    """

    workload: dict[str, Any]
    device: dict[str, Any]
    results: list[StrategyResult]
    gates: Gates
    reference: str = ""
    notes: list[str] = field(default_factory=list)
    profile: dict[str, Any] | None = None
    plugin_traces: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def result(self, name: str) -> StrategyResult | None:
        """The result of strategy ``name``, if it was run."""
        return next((r for r in self.results if r.name == name), None)

    @property
    def decisions(self) -> list[Decision]:
        """One decision per strategy, in table order."""
        return [decide(result, self.gates) for result in self.results]

    @property
    def baseline_ran(self) -> bool:
        """True when the keep-all baseline completed (only then are speedups meaningful)."""
        baseline = self.result("baseline")
        return baseline is not None and baseline.ok

    def table(self) -> tuple[list[str], list[list[str]]]:
        """Headers and rows of the one table ``offcore compare`` prints."""
        baseline = self.result("baseline")
        base_step = baseline.step_s if baseline is not None and baseline.ok else None
        headers = [
            "strategy",
            "status",
            "peak dev",
            "pinned",
            "pageable",
            "step ms",
            "tok/s",
            "copied",
            "wait ms",
            "U",
            "equal",
            "pred ms",
            "err",
            "vs base" if base_step else "max batch",
        ]
        rows = []
        for r in self.results:
            if r.ok:
                if r.bit_identical:
                    equal = "yes"
                elif r.loss_delta is None:
                    equal = "no"
                else:
                    equal = f"no (Δloss {r.loss_delta:.0e}, Δgrad {r.grad_rel_diff or 0:.0e})"
                err = r.prediction_error
                last = f"{base_step / r.step_s:.2f}x" if base_step and r.step_s else _max_batch_cell(r)
                rows.append(
                    [
                        r.name,
                        "ok",
                        _bytes(r.peak_device_bytes),
                        _bytes(r.peak_pinned_bytes),
                        _bytes(r.peak_pageable_bytes),
                        _ms(r.step_s),
                        f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
                        _bytes(r.copied_bytes),
                        _ms(r.exposed_wait_s),
                        f"{r.utilization:.0%}" if r.utilization is not None else "-",
                        equal,
                        _ms(r.predicted_step_s),
                        "-" if err is None else f"{err:+.0%}",
                        last,
                    ]
                )
            else:
                status = "OOM" if r.status == "oom" else r.status
                rows.append(
                    [r.name, status, "-", "-", "-", "-", "-", "-", "-", "-", "-", _ms(r.predicted_step_s), "-"]
                    + ([_max_batch_cell(r)] if not base_step else ["-"])
                )
        return headers, rows

    def scale_lines(self) -> list[str]:
        """Note [Never a speedup against a baseline that did not run]: the scale gained, or the speedups."""
        lines: list[str] = []
        baseline = self.result("baseline")
        capacity = self.device.get("capacity_bytes")
        if baseline is not None and not baseline.ok:
            lines.append(
                "The baseline ran out of memory, so no strategy is compared with it in time; scale gained instead "
                f"(capacity {_bytes(capacity)}):"
            )
            base_batch = baseline.max_batch
            for r in self.results:
                if not r.ok or r.name == "baseline":
                    continue
                headroom = capacity - (r.peak_device_bytes or 0) if capacity else None
                gained = (
                    f", {r.max_batch / base_batch:.1f}x the baseline's {base_batch}"
                    if r.max_batch and base_batch
                    else ""
                )
                lines.append(
                    f"  {r.name}: runs batch {self.workload.get('batch')} with {_bytes(headroom)} headroom; "
                    f"fits up to batch {r.max_batch or '-'}{_source(r)}{gained} "
                    f"(simulator: {r.predicted_max_batch or '-'})"
                )
            if base_batch is not None:
                lines.append(
                    f"  baseline (keep all): fits up to batch {base_batch or 0}{_source(baseline)} "
                    f"(simulator: {baseline.predicted_max_batch or '-'})"
                )
            sources = {r.max_batch_source for r in self.results if r.max_batch is not None}
            if "measured" in sources:
                lines.append(
                    "  (max batch measured: real training steps ran at that batch and ran out of memory one "
                    "micro-batch count above it)"
                )
            if "extrapolated" in sources:
                lines.append(
                    "  (max batch ~extrapolated: from the measured peaks, the bytes above the resident state growing "
                    "linearly with the batch; the baseline's from the reference run)"
                )
        elif baseline is not None and baseline.ok and baseline.step_s:
            for r in self.results:
                if r.ok and r.name != "baseline" and r.step_s:
                    lines.append(
                        f"  {r.name}: {baseline.step_s / r.step_s:.2f}x the baseline's speed, peak "
                        f"{_bytes(r.peak_device_bytes)} vs {_bytes(baseline.peak_device_bytes)}"
                    )
        return lines

    def recommendation(self) -> str:
        """The accepted strategy with the highest throughput, or what to do when none is accepted."""
        accepted = [
            r for r, d in zip(self.results, self.decisions, strict=True) if d.verdict == "accept" and r.tokens_per_s
        ]
        if accepted:
            best = max(accepted, key=lambda r: r.tokens_per_s or 0.0)
            return f"recommended: {best.name} ({best.plan}) at {best.tokens_per_s:,.0f} tokens/s"
        tuned = [r.name for r, d in zip(self.results, self.decisions, strict=True) if d.verdict == "tune"]
        if tuned:
            return f"no strategy accepted as is; tune {', '.join(tuned)} (see the reasons above)"
        return "no strategy passes the gates: raise the memory budget, lower the batch or sequence, or relax the gates"

    # -- reports -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (series included)."""
        return {
            "format": "offcore.compare/1",
            "workload": self.workload,
            "device": self.device,
            "reference": self.reference,
            "gates": asdict(self.gates),
            "notes": list(self.notes),
            "profile": self.profile,
            "strategies": [{**r.summary(), **{name: getattr(r, name) for name in _SERIES}} for r in self.results],
            "decisions": [
                {"strategy": d.strategy, "verdict": d.verdict, "reasons": list(d.reasons)} for d in self.decisions
            ],
            "scale": self.scale_lines(),
            "recommendation": self.recommendation(),
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON (non-finite numbers as ``null``)."""
        return json.dumps(finite(self.to_dict()), indent=2)

    def text(self) -> str:
        """The printed report: notes, the table, decisions, scale and recommendation."""
        from offcore.commands._output import format_table

        headers, rows = self.table()
        parts = [*self.notes, "", format_table(headers, rows), ""]
        parts.append(f"equal: bit-identical losses, gradients and parameters vs the {self.reference}")
        parts.append(LEGEND)
        parts.append("")
        parts.append("decisions " + self._gate_text() + ":")
        parts.extend(f"  {d.line()}" for d in self.decisions)
        scale = self.scale_lines()
        if scale:
            parts.append("")
            parts.extend(scale)
        parts.append("")
        parts.append(self.recommendation())
        return "\n".join(parts)

    def _gate_text(self) -> str:
        g = self.gates
        budget = _bytes(g.memory_budget) if g.memory_budget else "capacity"
        floor = f"{g.min_throughput:,.0f} tokens/s" if g.min_throughput else "none"
        return f"(memory budget {budget}, min throughput {floor}, max loss delta {g.max_loss_delta:g})"

    def markdown(self, *, images: Sequence[str] = ()) -> str:
        """A Markdown report: workload, device, the table, decisions, scale, plots."""
        headers, rows = self.table()
        lines = ["# offcore compare", ""]
        lines.append("## Workload")
        lines.append("")
        lines.extend(f"- {key}: `{value}`" for key, value in self.workload.items())
        lines.append("")
        lines.append("## Device")
        lines.append("")
        lines.extend(f"- {key}: `{_device_value(key, value)}`" for key, value in self.device.items())
        if self.notes:
            lines.append("")
            lines.extend(f"> {note}" if note else ">" for note in self.notes)
        lines.append("")
        lines.append("## Strategies")
        lines.append("")
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "|".join("---" for _ in headers) + "|")
        lines.extend("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows)
        lines.append("")
        lines.append(f"`equal`: bit-identical losses, gradients and parameters vs the {self.reference}. {LEGEND}")
        lines.append("")
        lines.append("| strategy | plan | how it was chosen |")
        lines.append("|---|---|---|")
        lines.extend(f"| {r.name} | `{r.plan}` | {r.why} |" for r in self.results)
        lines.append("")
        lines.append("## Decisions " + self._gate_text())
        lines.append("")
        lines.extend(f"- **{d.strategy}: {d.verdict}** — {'; '.join(d.reasons)}" for d in self.decisions)
        scale = self.scale_lines()
        if scale:
            lines.append("")
            lines.extend(scale)
        lines.append("")
        lines.append(f"**{self.recommendation()}**")
        for image in images:
            lines.append("")
            lines.append(f"![{image}]({image})")
        lines.append("")
        return "\n".join(lines)


def _device_value(key: str, value: Any) -> str:
    """Human units for the device facts (bytes, bandwidths, latency)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if key.endswith("_bytes"):
            return format_bytes(int(value))
        if key.endswith("_bandwidth"):
            return format_bandwidth(float(value)) if math.isfinite(value) else "unlimited"
        if key.endswith("_s"):
            return f"{value * 1e6:.0f} us"
    return str(value)
