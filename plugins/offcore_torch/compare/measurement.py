"""What one profiled step measured (:class:`StepMeasurement`): the simulator's profile and what runs outside its layers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from offcore.bandwidth import LinkMeasurement
from offcore.sim import Plan, StepProfile, simulate


# ------------------------------------------------------------------------ the step
@dataclass(frozen=True)
class StepMeasurement:
    """Everything one profiled step measured; :attr:`profile` is the simulator's input.

    Times in seconds, sizes in bytes.

    - ``profile``: one :class:`~offcore.sim.LayerProfile` per layer, the link, the
      capacity; ``other_bytes`` is *calibrated* so that the simulated keep-all peak
      equals the measured ``peak_bytes`` (it holds what the layers do not: optimizer
      state, the batch, the output head's and the loss's saved tensors and transients).
    - ``forward_s`` / ``backward_s`` / ``optimizer_s``: the whole step's phases;
      ``other_forward_s`` / ``other_backward_s``: the parts outside the layers.
    - ``param_bytes``; ``resident_bytes``: device bytes allocated when the step began;
      ``other_saved_bytes``: saved outside any layer; ``peak_bytes``: the peak of forward
      and backward (what a plan changes); ``optimizer_peak_bytes``: the peak during the
      optimizer step (parameters, gradients, optimizer state and its temporaries; no plan
      changes it — a device must hold ``max(simulated peak, optimizer_peak_bytes)``, see
      :meth:`predicted_peak`).
    - ``layer_calls``: how often each layer ran in forward (1 expected).
    - ``instrumentation_scale``: the factor applied to the instrumented forward and
      backward times (plain / instrumented, ≤ 1; 1 without calibration);
      ``offload_overhead_per_storage_s``: the offloading runtime's host time per saved
      storage (0 without calibration); ``recompute_overhead_per_storage_s``: what
      ``torch.utils.checkpoint`` adds to a recompute beyond the forward, per saved
      storage (in each layer's ``recompute_s``); ``layer_storages``: saved storages per layer.
    - ``optimizer_state_bytes``: the device bytes of the optimizer's state (AdamW: 2 × the
      fp32 parameters), part of ``profile.other_bytes``; ``host_step_s_per_byte``: one timed
      step of the same optimizer class and arguments over host copies of the parameters,
      per parameter byte (Note [The host step is timed on host copies]); both 0 without an
      optimizer. Also in ``profile`` (:class:`~offcore.sim.StepProfile`).
    """

    profile: StepProfile
    forward_s: float
    backward_s: float
    optimizer_s: float
    other_forward_s: float
    other_backward_s: float
    param_bytes: int
    resident_bytes: int
    other_saved_bytes: int
    peak_bytes: int
    optimizer_peak_bytes: int
    calibration_bytes: int
    link: LinkMeasurement | None = None
    layer_calls: tuple[int, ...] = field(default=())
    instrumentation_scale: float = 1.0
    offload_overhead_per_storage_s: float = 0.0
    recompute_overhead_per_storage_s: float = 0.0
    layer_storages: tuple[int, ...] = field(default=())
    optimizer_state_bytes: int = 0
    host_step_s_per_byte: float = 0.0

    @property
    def step_s(self) -> float:
        """Forward + backward + optimizer as measured."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def other_compute_s(self) -> float:
        """Compute outside the profiled layers (embedding, head, loss, optimizer): add it to simulated step times."""
        return self.other_forward_s + self.other_backward_s + self.optimizer_s

    @property
    def per_sample_other_bytes(self) -> int:
        """The part of ``profile.other_bytes`` that scales with the batch (saved outside layers + calibration)."""
        return self.other_saved_bytes + self.calibration_bytes

    def profile_for_microbatches(self, microbatches: int) -> StepProfile:
        """The profile to predict a plan with ``microbatches`` > 1 on.

        :meth:`StepProfile.split_microbatches` scales only the layers. Two resident
        terms change too: the output head's saved tensors shrink with the micro-batch
        (batch-dependent *other* bytes divided by ``microbatches``), and the gradients
        of earlier micro-batches stay on the device while later ones run
        (``grad_bytes`` = the parameter bytes).
        """
        if microbatches == 1:
            return self.profile
        fixed = self.profile.other_bytes - self.per_sample_other_bytes
        head = min(-(-self.per_sample_other_bytes // microbatches), self.profile.head_bytes)
        early = self.profile.head_forward_bytes
        return replace(
            self.profile,
            other_bytes=max(0, fixed) + head,
            head_bytes=head,
            head_forward_bytes=None if early is None else min(-(-early // microbatches), head),
            grad_bytes=self.param_bytes,
        )

    def predict(self, plan: Plan, **kwargs: Any) -> Any:
        """``simulate`` the plan on the matching profile; returns (SimResult, predicted step seconds)."""
        result = simulate(self.profile_for_microbatches(plan.microbatches), plan, **kwargs)
        return result, result.step_time_s + self.other_compute_for(plan)

    @property
    def other_compute_offloaded_optimizer_s(self) -> float:
        """Compute outside the layers when the optimizer steps on the host (no device optimizer step):
        the embedding, the head and the loss; the simulator models the host step itself."""
        return self.other_forward_s + self.other_backward_s

    def other_compute_for(self, plan: Plan) -> float:
        """What to add to ``plan``'s simulated step time: :attr:`other_compute_s`, without the device
        optimizer step when ``plan.optimizer == "offload"``."""
        return self.other_compute_offloaded_optimizer_s if plan.optimizer == "offload" else self.other_compute_s

    def predicted_peak(self, result: Any) -> int:
        """The device peak of a simulated step plus the optimizer step: ``max(result.peak_bytes, optimizer peak)``.

        With ``optimizer="offload"`` there is no device optimizer step: the simulated peak."""
        if result.plan.optimizer == "offload":
            return int(result.peak_bytes)
        return max(int(result.peak_bytes), self.optimizer_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (the profile as :meth:`StepProfile.to_dict`)."""
        return {
            "profile": self.profile.to_dict(),
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "other_forward_s": self.other_forward_s,
            "other_backward_s": self.other_backward_s,
            "param_bytes": self.param_bytes,
            "resident_bytes": self.resident_bytes,
            "other_saved_bytes": self.other_saved_bytes,
            "peak_bytes": self.peak_bytes,
            "optimizer_peak_bytes": self.optimizer_peak_bytes,
            "calibration_bytes": self.calibration_bytes,
            "link": None if self.link is None else self.link.to_dict(),
            "layer_calls": list(self.layer_calls),
            "instrumentation_scale": self.instrumentation_scale,
            "offload_overhead_per_storage_s": self.offload_overhead_per_storage_s,
            "recompute_overhead_per_storage_s": self.recompute_overhead_per_storage_s,
            "layer_storages": list(self.layer_storages),
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "host_step_s_per_byte": self.host_step_s_per_byte,
        }
