"""What :func:`~offcore.sim.simulator.simulate` returns: the step's figures (:class:`SimResult`) and its timeline (:class:`TimelineEvent`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from offcore.sim.formulas import utilization
from offcore.sim.plan import Plan


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one stream, e.g. ``TimelineEvent("h2d", "h2d:layer3", 0.1, 0.2, "h2d", "layer3")``."""

    stream: str
    """``"compute"``, ``"d2h"``, ``"h2d"`` or ``"host"`` (the host optimizer worker)."""
    name: str
    start: float
    end: float
    kind: str
    """``forward``, ``backward``, ``recompute``, ``wait``, ``d2h`` or ``h2d``."""
    layer: str

    @property
    def duration(self) -> float:
        """``end − start`` in seconds."""
        return self.end - self.start


@dataclass(frozen=True)
class SimResult:
    """What one simulated step predicts.

    Times in seconds, sizes in bytes. ``utilization`` is
    ``T_compute / (T_compute + T_exposed_wait)`` with recompute counted as compute.

    >>> from offcore.sim.profile import uniform_profile
    >>> from offcore.sim.simulator import simulate
    >>> r = simulate(uniform_profile(3, forward_s=1.0, backward_s=2.0, saved_bytes=10), Plan.keep_all(3))
    >>> r.step_time_s, r.peak_bytes, r.utilization, r.oom
    (9.0, 30, 1.0, False)
    """

    plan: Plan
    step_time_s: float
    forward_s: float
    backward_s: float
    recompute_s: float
    overhead_s: float
    exposed_wait_s: float
    wait_by_layer: Mapping[str, float]
    static_bytes: int
    peak_bytes: int
    peak_time_s: float
    memory_times: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    d2h_busy_s: float
    h2d_busy_s: float
    d2h_bytes: int
    h2d_bytes: int
    capacity_bytes: int | None
    events: tuple[TimelineEvent, ...] = field(default=(), repr=False)
    reused_bytes: int = 0
    """Offloaded bytes used in place instead of reloaded (Note [Reuse of device copies still in flight])."""
    schedule_log: tuple[tuple[Any, ...], ...] = field(default=(), repr=False)
    """The events the simulated step fed its :class:`~offcore.residency.ResidencyScheduler`
    (``simulate(..., record_schedule=True)``; the same names and arguments as a real step's
    ``OffloadHandle.schedule_log``)."""
    schedule_actions: tuple[Any, ...] = field(default=(), repr=False)
    """The scheduler's actions (``record_schedule=True``), as ``OffloadHandle.schedule_actions``."""
    host_step_s: float = 0.0
    """Seconds the host optimizer worker is busy (``Plan.optimizer == "offload"``)."""
    parameter_schedule_log: tuple[tuple[Any, ...], ...] = field(default=(), repr=False)
    """The events the parameter-streaming round fed its own :class:`~offcore.residency.ResidencyScheduler`
    (``Plan.parameters == "stream"``, ``record_schedule=True``; the events
    ``offcore_torch.offload_parameters`` feeds its scheduler)."""
    parameter_schedule_actions: tuple[Any, ...] = field(default=(), repr=False)
    """That scheduler's actions (``record_schedule=True``)."""
    parameter_schedule_settings: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """That scheduler's settings (:meth:`~offcore.residency.ResidencyScheduler.settings`: the keywords of
    :func:`offcore.sim.replay.replay`)."""
    parameter_h2d_copies: int = 0
    """H2D copies of the streamed parameters (``Plan.parameters == "stream"``): one per tensor
    (``LayerProfile.param_copies``, ``StepProfile.outside_param_copies``), as
    ``offload_parameters(...).stats().h2d_copies`` counts them (Note [Parameter copies pay one latency each])."""
    optimizer_host_bytes: int = 0
    """Host bytes of the host optimizer (``Plan.optimizer == "offload"``): the fp32 masters and the
    gradients (``param_bytes`` each), and its states (``optimizer_state_bytes``) or, on the NVMe tier,
    the most that three consecutive groups' states hold in the bounce buffers at once."""
    nvme_read_bytes: int = 0
    """Bytes read from the NVMe tier (the optimizer states, activations staged back)."""
    nvme_write_bytes: int = 0
    """Bytes written to the NVMe tier."""
    worst_peak_bytes: int = 0
    """The highest device peak the runtime can reach under the plan's prefetch budget, whatever its
    copies' timing (Note [The worst peak within the prefetch budget]); ``peak_bytes`` without offload."""

    @property
    def compute_s(self) -> float:
        """Time the compute stream is busy: forward + backward + recompute (+ offload and micro-step overhead)."""
        return self.forward_s + self.backward_s + self.recompute_s + self.overhead_s

    @property
    def utilization(self) -> float:
        """``U = T_compute / (T_compute + T_exposed_transfer)``."""
        return utilization(self.compute_s, self.exposed_wait_s)

    @property
    def oom(self) -> bool:
        """True when the peak exceeds the profile's device capacity."""
        return self.capacity_bytes is not None and self.peak_bytes > self.capacity_bytes

    @property
    def activation_peak_bytes(self) -> int:
        """Peak minus the resident bytes (parameters, gradients, other)."""
        return self.peak_bytes - self.static_bytes

    def bytes_time_above(self, threshold: float) -> float:
        """Integral over the step of ``max(0, device bytes − threshold)`` (byte-seconds)."""
        total = 0.0
        times, values = self.memory_times, self.memory_bytes
        for index in range(len(times) - 1):
            excess = values[index] - threshold
            if excess > 0:
                total += excess * (times[index + 1] - times[index])
        return total

    def memory_at(self, t: float) -> int:
        """Device bytes at time ``t`` (after the events at ``t``)."""
        value = self.static_bytes
        for time, level in zip(self.memory_times, self.memory_bytes, strict=True):
            if time > t:
                break
            value = level
        return value

    def summary(self) -> dict[str, Any]:
        """Scalar figures as a JSON-ready dict (no events, no series)."""
        return {
            "plan": self.plan.describe(),
            "strategy": self.plan.strategy,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "exposed_wait_s": self.exposed_wait_s,
            "utilization": self.utilization,
            "peak_bytes": self.peak_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "d2h_bytes": self.d2h_bytes,
            "h2d_bytes": self.h2d_bytes,
            "reused_bytes": self.reused_bytes,
            "d2h_busy_s": self.d2h_busy_s,
            "h2d_busy_s": self.h2d_busy_s,
            "oom": self.oom,
            "optimizer_host_bytes": self.optimizer_host_bytes,
            "nvme_read_bytes": self.nvme_read_bytes,
            "nvme_write_bytes": self.nvme_write_bytes,
            "worst_peak_bytes": self.worst_peak_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready: summary, plan, waits, memory series and events."""
        data = self.summary()
        data.update(
            plan=self.plan.to_dict(),
            wait_by_layer=dict(self.wait_by_layer),
            memory=[[t, b] for t, b in zip(self.memory_times, self.memory_bytes, strict=True)],
            events=[[e.stream, e.name, e.start, e.end, e.kind, e.layer] for e in self.events],
        )
        return data

    def to_chrome_trace(self, *, pid: int = 1, process_name: str = "offcore simulation") -> dict[str, Any]:
        """A Chrome-trace / Perfetto JSON object: one thread per stream and a memory counter.

        >>> from offcore.sim.profile import uniform_profile
        >>> from offcore.sim.simulator import simulate
        >>> r = simulate(uniform_profile(1, forward_s=1.0, backward_s=1.0, saved_bytes=1), Plan.keep_all(1))
        >>> sorted({e["ph"] for e in r.to_chrome_trace()["traceEvents"]})
        ['C', 'M', 'X']
        """
        tids = {"compute": 1, "d2h": 2, "h2d": 3, "host": 4}
        trace: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process_name}},
        ]
        for stream, tid in tids.items():
            trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": stream}})
        for event in self.events:
            trace.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tids.get(event.stream, 9),
                    "name": event.name,
                    "cat": event.kind,
                    "ts": event.start * 1e6,
                    "dur": max(0.0, event.duration) * 1e6,
                    "args": {"layer": event.layer},
                }
            )
        for time, level in zip(self.memory_times, self.memory_bytes, strict=True):
            trace.append({"ph": "C", "pid": pid, "name": "device bytes", "ts": time * 1e6, "args": {"bytes": level}})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}
