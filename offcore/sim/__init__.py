"""Cost model of a training step: profiles, plans, the timeline simulator and the planner.

Torch-free (numpy only; scipy is imported lazily, only for the MILP lower bound)::

    >>> from offcore.sim import uniform_profile, Plan, simulate
    >>> p = uniform_profile(4, forward_s=10e-3, backward_s=20e-3, saved_bytes=2**28,
    ...                     d2h_bandwidth="32GiB/s", h2d_bandwidth="32GiB/s")
    >>> simulate(p, Plan(["offload", "offload", "keep", "keep"])).peak_bytes < simulate(p, Plan.keep_all(4)).peak_bytes
    True
"""

from __future__ import annotations

from offcore.sim.bounds import instance_lower_bound, plan_lower_bound
from offcore.sim.formulas import (
    CopyWindow,
    activation_bytes,
    adam_state_bytes,
    checkpoint_peak,
    copy_lower_bound,
    copy_window,
    exposed_wait,
    prefetch_start,
    transfer_time,
    utilization,
)
from offcore.sim.plan import Action, Plan, PrefetchPolicy
from offcore.sim.planner import PlanResult, exhaustive_plan, plan, size_prefetch_budget, steady_prefetch
from offcore.sim.profile import LayerProfile, StepProfile, uniform_profile
from offcore.sim.simulator import SimResult, TimelineEvent, simulate
from offcore.sim.transformer import (
    transformer_layer_flops,
    transformer_layer_profile,
    transformer_saved_bytes,
    transformer_step_profile,
)

__all__ = [
    "Action",
    "CopyWindow",
    "LayerProfile",
    "Plan",
    "PlanResult",
    "PrefetchPolicy",
    "SimResult",
    "StepProfile",
    "TimelineEvent",
    "activation_bytes",
    "adam_state_bytes",
    "checkpoint_peak",
    "copy_lower_bound",
    "copy_window",
    "exhaustive_plan",
    "exposed_wait",
    "instance_lower_bound",
    "plan",
    "plan_lower_bound",
    "prefetch_start",
    "simulate",
    "size_prefetch_budget",
    "steady_prefetch",
    "transfer_time",
    "transformer_layer_flops",
    "transformer_layer_profile",
    "transformer_saved_bytes",
    "transformer_step_profile",
    "uniform_profile",
    "utilization",
]
