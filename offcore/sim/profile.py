"""Step profiles: what one training step costs, layer by layer, on a given machine.

A :class:`StepProfile` is the simulator's and the planner's input: for every layer the
forward, backward and recompute time, the bytes it saves for backward, its transient
working set and the bytes of its input (kept when the layer is recomputed), plus the
resident bytes (parameters, gradients, anything else) and the link between device and
host (bandwidth per direction, fixed latency per copy, duplex or one shared link) and
the device capacity.

A profile can be measured (the profiler fills one from a warm-up step) or estimated
from a model's shapes::

    >>> from offcore.sim.profile import LayerProfile, StepProfile
    >>> layer = LayerProfile("block0", forward_s=0.002, backward_s=0.004, saved_bytes=256 * 2**20)
    >>> layer.recompute_s            # defaults to the forward time
    0.002
    >>> step = StepProfile([layer], param_bytes="1GiB", d2h_bandwidth="32GiB/s", h2d_bandwidth="32GiB/s")
    >>> StepProfile.from_json(step.to_json()) == step
    True

:func:`transformer_layer_profile` and :func:`transformer_step_profile` build GPT- or
LLaMA-shaped profiles from shapes and an achieved FLOP rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from offcore.errors import ConfigurationError
from offcore.jsonable import loads
from offcore.units import parse_bandwidth, parse_duration, parse_size

__all__ = [
    "LayerProfile",
    "StepProfile",
]

_PROFILE_FORMAT = "offcore.step_profile/1"


def _seconds(value: float | int | str, what: str) -> float:
    return parse_duration(value, what=what)


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer (or one saved-tensor group) in one training step.

    Attributes:
        name: label used in results and traces.
        forward_s: forward compute time in seconds.
        backward_s: backward compute time in seconds.
        saved_bytes: bytes the layer saves for backward (its activations).
        recompute_s: time to rerun the forward for recomputation; ``None`` means
            ``forward_s``.
        working_bytes: transient bytes alive while the layer computes (forward,
            backward or recompute), freed when it finishes.
        input_bytes: bytes of the layer's input. When the layer is recomputed the
            input is what stays on device (the checkpoint), from the forward until the
            layer's backward; with a checkpoint interval ``K`` only the first layer of
            each segment keeps it.
        offload_overhead_s: host time the offloading runtime spends on the compute
            stream for this layer when it is offloaded (packing its saved tensors in
            forward, unpacking them in backward: Python, pool, events), charged half to
            its forward and half to its backward. 0 by default; the PyTorch profiler
            measures it.
        saved_tensors: the saved storages one by one, in save order, as
            ``(fraction, nbytes)``: the share of the layer's forward elapsed when it was
            saved (0 to 1) and its bytes; they sum to ``saved_bytes``. An offloaded layer's
            storages are the objects the simulator's residency scheduler manages: each is
            allocated from the previous save on and its device-to-host copy starts when it
            is saved (Note [Simulated lifetimes] in simulator.py). Empty (the default): one
            object of ``saved_bytes`` saved at the end of the forward.
        grad_bytes: gradient bytes of the layer's parameters: allocated when its backward
            starts, alive to the end of the step (the optimizer takes them over). 0 by
            default; ignored when :attr:`StepProfile.grad_bytes` already counts every
            gradient as resident for the whole step (gradient accumulation).
        param_bytes: bytes of the layer's parameters: what parameter streaming copies in
            before its forward and its backward, and what the host optimizer steps under
            optimizer offload. 0 (the default) means ``grad_bytes`` (same dtype).
        forward_working_bytes: the transient peak of the layer's forward (and of its
            recompute) above its start; 0 (the default) means ``working_bytes``. The profiler
            measures it apart, since a transformer block's backward transient is several times
            its forward's.
        gross_working_bytes: per saved tensor (in save order, one entry when ``saved_tensors``
            is empty), the transient peak of the layer's backward above its start while that
            save is the latest of the layer's saves backward has used, with the layer's saves
            autograd released by then added back: what the backward needs beyond the saves
            still alive, from that use to the next (Note [Gross working bytes of a backward]
            in offcore_torch/compare/recording.py). An offloaded layer's backward holds, from each use,
            its saves reloaded and not yet used plus these bytes; each save goes at the next
            use (Note [An offloaded layer's saves go as backward uses them] in simulator.py).
            Empty (the default): unknown; an offloaded layer's saves then stay to the end of
            its backward, with ``working_bytes``.
        param_copies: the copies parameter streaming makes for each use of the layer's
            parameters (offcore_torch.offload_parameters copies each parameter tensor on its
            own): each pays the link's ``latency_s`` (Note [Parameter copies pay one latency
            each] in simulator.py). 0 (the default) means one copy.
        reads_after: per saved tensor (in save order, one entry when ``saved_tensors`` is
            empty), how many tensors the runtime does not offload (parameters, saves outside
            the layers' storages) backward reads after that save and before the next save of
            the layer: each read is a trigger of the runtime's scheduler, after the save was
            consumed (Note [Reads of kept tensors are triggers] in simulator.py). Empty (the
            default): unknown, no such trigger is simulated.

    >>> LayerProfile("mlp", 1e-3, 2e-3, 1 << 20, working_bytes=4096).recompute_s
    0.001
    """

    name: str
    forward_s: float
    backward_s: float
    saved_bytes: int
    recompute_s: float | None = None
    working_bytes: int = 0
    input_bytes: int = 0
    offload_overhead_s: float = 0.0
    saved_tensors: tuple[tuple[float, int], ...] = ()
    grad_bytes: int = 0
    param_bytes: int = 0
    param_copies: int = 0
    forward_working_bytes: int = 0
    gross_working_bytes: tuple[int, ...] = ()
    reads_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"a layer needs a non-empty string name, got {self.name!r}")
        set_ = object.__setattr__
        set_(self, "forward_s", _seconds(self.forward_s, f"forward_s of layer {self.name!r}"))
        set_(self, "backward_s", _seconds(self.backward_s, f"backward_s of layer {self.name!r}"))
        recompute = self.forward_s if self.recompute_s is None else self.recompute_s
        set_(self, "recompute_s", _seconds(recompute, f"recompute_s of layer {self.name!r}"))
        set_(
            self,
            "offload_overhead_s",
            _seconds(self.offload_overhead_s, f"offload_overhead_s of layer {self.name!r}"),
        )
        for attribute in (
            "saved_bytes",
            "working_bytes",
            "input_bytes",
            "grad_bytes",
            "param_bytes",
            "forward_working_bytes",
        ):
            value = parse_size(getattr(self, attribute), what=f"{attribute} of layer {self.name!r}", allow_zero=True)
            set_(self, attribute, value)
        copies = self.param_copies
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
            raise ConfigurationError(f"param_copies of layer {self.name!r} must be an integer >= 0, got {copies!r}")
        set_(self, "saved_tensors", self._checked_tensors())
        set_(self, "gross_working_bytes", self._checked_gross())
        set_(self, "reads_after", self._checked_reads())

    def _checked_tensors(self) -> tuple[tuple[float, int], ...]:
        raw = self.saved_tensors
        if isinstance(raw, (str, bytes, dict)) or not isinstance(raw, (list, tuple)):
            raise ConfigurationError(
                f"saved_tensors of layer {self.name!r} must be a list of (fraction, nbytes) pairs, "
                f"got {type(raw).__name__}"
            )
        out: list[tuple[float, int]] = []
        previous = 0.0
        for item in raw:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ConfigurationError(f"saved_tensors of layer {self.name!r}: each entry is (fraction, nbytes)")
            fraction, nbytes = item
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
                raise ConfigurationError(
                    f"saved_tensors of layer {self.name!r}: a fraction of the forward must be in [0, 1], "
                    f"got {fraction!r}"
                )
            if fraction < previous:
                raise ConfigurationError(f"saved_tensors of layer {self.name!r} must be in save order")
            previous = float(fraction)
            size = parse_size(nbytes, what=f"a saved tensor of layer {self.name!r}", allow_zero=True)
            out.append((float(fraction), size))
        if out and sum(size for _, size in out) != self.saved_bytes:
            raise ConfigurationError(
                f"the saved_tensors of layer {self.name!r} sum to {sum(size for _, size in out)} bytes, "
                f"not its saved_bytes {self.saved_bytes}"
            )
        return tuple(out)

    def _per_save(self, field: str, unit: str) -> tuple[Any, ...]:
        """``field``'s raw entries (one per saved tensor, or none), checked for shape; ``unit`` names them."""
        raw = getattr(self, field)
        if isinstance(raw, (str, bytes, dict)) or not isinstance(raw, (list, tuple)):
            raise ConfigurationError(
                f"{field} of layer {self.name!r} must be a list of {unit}, got {type(raw).__name__}"
            )
        expected = len(self.saved_tensors) or 1
        if raw and len(raw) != expected:
            raise ConfigurationError(
                f"{field} of layer {self.name!r} has {len(raw)} entries; it needs one per saved tensor ({expected})"
            )
        return tuple(raw)

    def _checked_gross(self) -> tuple[int, ...]:
        what = f"gross_working_bytes of layer {self.name!r}"
        return tuple(
            parse_size(n, what=what, allow_zero=True) for n in self._per_save("gross_working_bytes", "byte counts")
        )

    def _checked_reads(self) -> tuple[int, ...]:
        raw = self._per_save("reads_after", "counts")
        for count in raw:
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ConfigurationError(f"reads_after of layer {self.name!r}: counts are integers >= 0, got {count!r}")
        return raw

    def scaled(self, factor: float) -> LayerProfile:
        """This layer at ``factor`` × the batch: times and per-sample bytes scale (bytes rounded up).

        >>> LayerProfile("l", 1.0, 2.0, 10, saved_tensors=[(0.5, 4), (1.0, 6)]).scaled(0.5).saved_tensors
        ((0.5, 2), (1.0, 3))
        """
        divisor = round(1.0 / factor) if factor > 0 else 0
        exact = divisor >= 1 and divisor * factor == 1.0  # one micro-batch of `divisor`: integer rounding up

        def size(nbytes: int) -> int:
            return -(-nbytes // divisor) if exact else math.ceil(nbytes * factor)

        tensors = tuple((fraction, size(nbytes)) for fraction, nbytes in self.saved_tensors)
        return LayerProfile(
            self.name,
            self.forward_s * factor,
            self.backward_s * factor,
            sum(n for _, n in tensors) if tensors else size(self.saved_bytes),
            recompute_s=self.recompute_time * factor,
            working_bytes=size(self.working_bytes),
            input_bytes=size(self.input_bytes),
            offload_overhead_s=self.offload_overhead_s,  # per saved tensor, not per sample
            saved_tensors=tensors,
            grad_bytes=self.grad_bytes,  # per parameter, not per sample
            param_bytes=self.param_bytes,
            param_copies=self.param_copies,
            forward_working_bytes=size(self.forward_working_bytes),
            gross_working_bytes=tuple(size(n) for n in self.gross_working_bytes),
            reads_after=self.reads_after,  # reads, not bytes
        )

    @property
    def forward_work(self) -> int:
        """Transient bytes of the forward and of a recompute: ``forward_working_bytes`` or ``working_bytes``."""
        return self.forward_working_bytes or self.working_bytes

    @property
    def offloaded_backward_work(self) -> int:
        """The fewest transient bytes the simulator holds at any moment of this layer's backward, whatever its
        action: ``working_bytes``, or the least of ``gross_working_bytes`` when measured and smaller (an
        offloaded layer holds those; Note [An offloaded layer's saves go as backward uses them]).

        >>> LayerProfile("l", 1.0, 2.0, 10, working_bytes=8, saved_tensors=[(0.5, 4), (1.0, 6)],
        ...              gross_working_bytes=[5, 12]).offloaded_backward_work
        5
        """
        gross = self.gross_working_bytes
        return min(self.working_bytes, *gross) if gross else self.working_bytes

    @property
    def recompute_time(self) -> float:
        """``recompute_s`` as a plain float (never ``None`` after construction)."""
        assert self.recompute_s is not None
        return self.recompute_s


@dataclass(frozen=True)
class StepProfile:
    """One training step on one machine: layers, resident bytes, link and capacity.

    Attributes:
        layers: the layers in forward order (backward visits them in reverse).
        param_bytes: parameter bytes resident on the device for the whole step.
        grad_bytes: gradient bytes counted as resident for the whole step (0 by default;
            set it to ``param_bytes`` when gradients persist across steps).
        other_bytes: anything else resident (optimizer states kept on device, buffers).
        head_bytes: the part of ``other_bytes`` that lives only around the turn from
            forward to backward: what the output head and the loss save and their
            transients (the batch-dependent bytes outside the layers). Allocated when the
            last layer's forward ends, freed before the last layer's backward starts.
            0 by default (everything in ``other_bytes`` is resident all step).
        head_forward_bytes: the part of ``head_bytes`` already allocated when forward ends
            (what the head and the loss saved): the runtime plans its first reloads there
            (Note [Prefetch from the end of forward] in offcore_torch/activations/offload.py), seeing these
            bytes but not the head's backward transients that follow. ``None`` (the default):
            all of ``head_bytes`` (Note [The turn sees the head's saved bytes] in simulator.py).
        d2h_bandwidth, h2d_bandwidth: bytes per second per direction (numbers or strings
            such as ``"53GB/s"``; ``"inf"`` for a free copy).
        latency_s: fixed cost added to every copy.
        duplex: ``True`` when both directions copy at once (independent D2H and H2D
            queues); ``False`` for one shared link that serialises them.
        capacity_bytes: device capacity; ``None`` for unlimited.
        batch_size: samples per step; gradient accumulation splits it into micro-batches.
        reuse_in_flight: ``True`` when the runtime uses a device copy in place instead
            of reloading it while that copy still exists, as ``offcore_torch`` does
            (Note [Reuse of device copies still in flight] in simulator.py): backward
            reaching a layer before its D2H landed reads the device copy (no H2D, no
            wait), and a D2H landing after forward ended when its reload is already
            due keeps its device copy. ``False`` (the default) models a runtime that
            always reloads; the analytic lower bounds are tightest then.
        optimizer_state_bytes: the part of ``other_bytes`` that is the device optimizer's
            state (AdamW: 2 × the fp32 parameter bytes); a plan with
            ``optimizer="offload"`` does not hold it.
        host_step_s_per_byte: the host optimizer step's time per parameter byte (the
            profiler times one step of the same optimizer class over host copies); what a
            plan with ``optimizer="offload"`` spends per layer on its serial host worker.
        optimizer_offload_overhead_s, parameter_stream_overhead_s: compute-stream seconds
            per step of the runtime's own work under optimizer offload (gradient hooks,
            copy issue, the host worker contending for the host) and under parameter
            streaming (hooks, copies issued, storages swapped), measured (``offcore
            compare`` times steps with and without them); the simulator adds them to the
            layers' backward (and, for streaming, half to their forward) in proportion to
            their parameter bytes. 0 by default.
        parameter_budget_bytes: the prefetch budget of parameter streaming (device bytes of
            parameters copied in ahead of use): offcore_torch.offload_parameters' default is
            twice its largest module's own parameters, which the profiler measures (a module,
            not a layer: a transformer block's largest Linear). 0 (the default) means twice
            the largest layer's ``param_bytes``.
        outside_param_bytes, outside_param_copies: what parameter streaming copies for the
            modules outside the layers (embedding, final norm, output head: a tied weight
            once per module using it) in one pass, and in how many copies. The simulator
            copies them three times a step (Note [Parameters outside the layers are streamed
            too] in simulator.py). 0 by default.
        nvme_read_bandwidth, nvme_write_bandwidth, nvme_read_latency_s, nvme_write_latency_s:
            the NVMe tier's two links (NVMe → host and host → NVMe, ``latency + bytes /
            bandwidth`` each; :func:`offcore.bandwidth.measure_nvme_link` measures them). What
            is on NVMe reaches the device in two hops (NVMe → host, then the H2D link). Used by
            plans that put something there (``Plan.optimizer_tier == "nvme"``); unlimited by
            default.

    >>> p = StepProfile([LayerProfile("l0", 1.0, 2.0, 100)], param_bytes=10, duplex=False)
    >>> p.static_bytes, p.compute_s
    (10, 3.0)
    """

    layers: Sequence[LayerProfile]
    param_bytes: int = 0
    grad_bytes: int = 0
    other_bytes: int = 0
    head_bytes: int = 0
    d2h_bandwidth: float = math.inf
    h2d_bandwidth: float = math.inf
    latency_s: float = 0.0
    duplex: bool = True
    capacity_bytes: int | None = None
    batch_size: int = 1
    reuse_in_flight: bool = False
    optimizer_state_bytes: int = 0
    host_step_s_per_byte: float = 0.0
    optimizer_offload_overhead_s: float = 0.0
    parameter_stream_overhead_s: float = 0.0
    parameter_budget_bytes: int = 0
    outside_param_bytes: int = 0
    outside_param_copies: int = 0
    nvme_read_bandwidth: float = math.inf
    nvme_write_bandwidth: float = math.inf
    nvme_read_latency_s: float = 0.0
    nvme_write_latency_s: float = 0.0
    head_forward_bytes: int | None = None
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        layers = tuple(self.layers)
        if not layers:
            raise ConfigurationError("a step profile needs at least one layer")
        for layer in layers:
            if not isinstance(layer, LayerProfile):
                raise ConfigurationError(f"layers must be LayerProfile objects, got {type(layer).__name__}")
        names = tuple(layer.name for layer in layers)
        if len(set(names)) != len(names):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            raise ConfigurationError(f"layer names must be unique; repeated: {duplicates}")
        set_(self, "layers", layers)
        set_(self, "_names", names)
        for attribute in (
            "param_bytes",
            "grad_bytes",
            "other_bytes",
            "head_bytes",
            "optimizer_state_bytes",
            "parameter_budget_bytes",
            "outside_param_bytes",
        ):
            set_(self, attribute, parse_size(getattr(self, attribute), what=attribute, allow_zero=True))
        if self.optimizer_state_bytes > self.other_bytes - self.head_bytes:
            raise ConfigurationError(
                f"optimizer_state_bytes ({self.optimizer_state_bytes}) is the part of the resident other_bytes "
                f"({self.other_bytes - self.head_bytes} without head_bytes) that the device optimizer keeps: "
                "it cannot exceed it"
            )
        copies = self.outside_param_copies
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
            raise ConfigurationError(f"outside_param_copies must be an integer >= 0, got {copies!r}")
        step = self.host_step_s_per_byte
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not (step >= 0 and math.isfinite(step)):
            raise ConfigurationError(f"host_step_s_per_byte must be a finite number >= 0, got {step!r}")
        set_(self, "host_step_s_per_byte", float(step))
        for attribute in ("optimizer_offload_overhead_s", "parameter_stream_overhead_s"):
            set_(self, attribute, parse_duration(getattr(self, attribute), what=attribute))
        if self.head_bytes > self.other_bytes:
            raise ConfigurationError(
                f"head_bytes ({self.head_bytes}) is the part of other_bytes ({self.other_bytes}) alive only "
                "around the turn from forward to backward: it cannot exceed other_bytes"
            )
        if self.head_forward_bytes is not None:
            early = parse_size(self.head_forward_bytes, what="head_forward_bytes", allow_zero=True)
            if early > self.head_bytes:
                raise ConfigurationError(
                    f"head_forward_bytes ({early}) is the part of head_bytes ({self.head_bytes}) allocated when "
                    "forward ends: it cannot exceed head_bytes"
                )
            set_(self, "head_forward_bytes", early)
        set_(self, "d2h_bandwidth", parse_bandwidth(self.d2h_bandwidth, what="d2h_bandwidth"))
        set_(self, "h2d_bandwidth", parse_bandwidth(self.h2d_bandwidth, what="h2d_bandwidth"))
        set_(self, "latency_s", parse_duration(self.latency_s, what="latency_s"))
        for attribute in ("nvme_read_bandwidth", "nvme_write_bandwidth"):
            set_(self, attribute, parse_bandwidth(getattr(self, attribute), what=attribute))
        for attribute in ("nvme_read_latency_s", "nvme_write_latency_s"):
            set_(self, attribute, parse_duration(getattr(self, attribute), what=attribute))
        if not isinstance(self.duplex, bool):
            raise ConfigurationError(f"duplex must be True or False, got {self.duplex!r}")
        if self.capacity_bytes is not None:
            set_(self, "capacity_bytes", parse_size(self.capacity_bytes, what="capacity_bytes"))
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if not isinstance(self.reuse_in_flight, bool):
            raise ConfigurationError(f"reuse_in_flight must be True or False, got {self.reuse_in_flight!r}")

    # --- derived figures -------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Layer names in forward order."""
        return self._names

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + other (``head_bytes`` included: the most the step holds outside its layers)."""
        return self.param_bytes + self.grad_bytes + self.other_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes resident for the whole step: :attr:`static_bytes` without ``head_bytes``."""
        return self.static_bytes - self.head_bytes

    @property
    def forward_s(self) -> float:
        """Sum of forward times."""
        return math.fsum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        """Sum of backward times."""
        return math.fsum(layer.backward_s for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """Forward + backward time without any recompute (the keep-all step's compute)."""
        return self.forward_s + self.backward_s

    @property
    def saved_bytes(self) -> int:
        """Sum of the layers' saved bytes: the keep-all activation footprint."""
        return sum(layer.saved_bytes for layer in self.layers)

    def transfer_s(self, nbytes: int, direction: Literal["d2h", "h2d"]) -> float:
        """Time of one copy of ``nbytes`` in ``direction``, latency included."""
        bandwidth = self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth
        return self.latency_s + (0.0 if math.isinf(bandwidth) else nbytes / bandwidth)

    def with_link(self, **changes: Any) -> StepProfile:
        """A copy with other link or capacity settings, e.g. ``with_link(h2d_bandwidth="64GB/s")``."""
        allowed = {
            "d2h_bandwidth",
            "h2d_bandwidth",
            "latency_s",
            "duplex",
            "capacity_bytes",
            "reuse_in_flight",
            "nvme_read_bandwidth",
            "nvme_write_bandwidth",
            "nvme_read_latency_s",
            "nvme_write_latency_s",
            "head_forward_bytes",
        }
        unknown = set(changes) - allowed
        if unknown:
            raise ConfigurationError(f"with_link() accepts {sorted(allowed)}, not {sorted(unknown)}")
        return replace(self, **changes)

    def with_nvme_link(self, link: Any) -> StepProfile:
        """A copy with an NVMe tier's measured links (an :class:`offcore.bandwidth.NvmeLinkMeasurement`).

        >>> from offcore.bandwidth import NvmeLinkMeasurement
        >>> p = StepProfile([LayerProfile("l", 1.0, 2.0, 0)])
        >>> p.with_nvme_link(NvmeLinkMeasurement(2e9, 1e9, 1e-4, 2e-4, True)).nvme_write_bandwidth
        1000000000.0
        """
        return replace(
            self,
            nvme_read_bandwidth=link.read_bandwidth,
            nvme_write_bandwidth=link.write_bandwidth,
            nvme_read_latency_s=link.read_latency_s,
            nvme_write_latency_s=link.write_latency_s,
        )

    def split_microbatches(self, microbatches: int) -> StepProfile:
        """The profile of one micro-batch when the step is split for gradient accumulation.

        Linear model: every layer's times and per-sample bytes (saved, working, input)
        scale by ``1 / microbatches``; resident bytes do not change. Small micro-batches
        are often less efficient than this on real hardware: the planner's
        ``microbatch_overhead_s`` charges a fixed cost per extra micro-step.

        >>> p = StepProfile([LayerProfile("l", 4.0, 8.0, 400)], batch_size=4)
        >>> q = p.split_microbatches(2)
        >>> (q.layers[0].forward_s, q.layers[0].saved_bytes, q.batch_size)
        (2.0, 200, 2)
        """
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigurationError(f"microbatches must be a positive integer, got {microbatches!r}")
        if self.batch_size % microbatches:
            raise ConfigurationError(
                f"cannot split a batch of {self.batch_size} into {microbatches} equal micro-batches: "
                "choose a divisor of batch_size"
            )
        if microbatches == 1:
            return self
        layers = [layer.scaled(1.0 / microbatches) for layer in self.layers]
        return replace(self, layers=layers, batch_size=self.batch_size // microbatches)

    # --- JSON -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (infinite bandwidths are written as ``"inf"``)."""

        def bandwidth(value: float) -> float | str:
            return "inf" if math.isinf(value) else value

        return {
            "format": _PROFILE_FORMAT,
            "layers": [asdict(layer) for layer in self.layers],
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "other_bytes": self.other_bytes,
            "head_bytes": self.head_bytes,
            "d2h_bandwidth": bandwidth(self.d2h_bandwidth),
            "h2d_bandwidth": bandwidth(self.h2d_bandwidth),
            "latency_s": self.latency_s,
            "duplex": self.duplex,
            "capacity_bytes": self.capacity_bytes,
            "batch_size": self.batch_size,
            "reuse_in_flight": self.reuse_in_flight,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "host_step_s_per_byte": self.host_step_s_per_byte,
            "optimizer_offload_overhead_s": self.optimizer_offload_overhead_s,
            "parameter_stream_overhead_s": self.parameter_stream_overhead_s,
            "parameter_budget_bytes": self.parameter_budget_bytes,
            "outside_param_bytes": self.outside_param_bytes,
            "outside_param_copies": self.outside_param_copies,
            "nvme_read_bandwidth": bandwidth(self.nvme_read_bandwidth),
            "nvme_write_bandwidth": bandwidth(self.nvme_write_bandwidth),
            "nvme_read_latency_s": self.nvme_read_latency_s,
            "nvme_write_latency_s": self.nvme_write_latency_s,
            "head_forward_bytes": self.head_forward_bytes,
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """Serialise to JSON text; :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        """Build from :meth:`to_dict` output; raises ConfigurationError on bad input."""
        if not isinstance(data, dict):
            raise ConfigurationError(f"a step profile must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format", _PROFILE_FORMAT)
        if fmt != _PROFILE_FORMAT:
            raise ConfigurationError(f"unknown step profile format {fmt!r}; expected {_PROFILE_FORMAT!r}")
        known = {
            "layers",
            "param_bytes",
            "grad_bytes",
            "other_bytes",
            "head_bytes",
            "d2h_bandwidth",
            "h2d_bandwidth",
            "latency_s",
            "duplex",
            "capacity_bytes",
            "batch_size",
            "reuse_in_flight",
            "optimizer_state_bytes",
            "host_step_s_per_byte",
            "optimizer_offload_overhead_s",
            "parameter_stream_overhead_s",
            "parameter_budget_bytes",
            "outside_param_bytes",
            "outside_param_copies",
            "nvme_read_bandwidth",
            "nvme_write_bandwidth",
            "nvme_read_latency_s",
            "nvme_write_latency_s",
            "head_forward_bytes",
        }
        unknown = set(data) - known - {"format"}
        if unknown:
            raise ConfigurationError(f"unknown step profile fields {sorted(unknown)}; known: {sorted(known)}")
        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list):
            raise ConfigurationError("a step profile needs a 'layers' list")
        layers = []
        for index, raw in enumerate(raw_layers):
            if not isinstance(raw, dict):
                raise ConfigurationError(f"layer {index} must be a JSON object, got {type(raw).__name__}")
            try:
                layers.append(LayerProfile(**raw))
            except TypeError as exc:
                raise ConfigurationError(f"layer {index} has bad fields: {exc}") from None
        kwargs = {key: value for key, value in data.items() if key in known - {"layers"}}
        return cls(layers, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> StepProfile:
        """Read a profile written by :meth:`to_json` (any bad input is a ConfigurationError)."""
        return cls.from_dict(loads(text, what="step profile"))


def _check_positive_ints(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")


def uniform_profile(
    n_layers: int,
    *,
    forward_s: float,
    backward_s: float,
    saved_bytes: int,
    names: Iterable[str] | None = None,
    **step: Any,
) -> StepProfile:
    """``n_layers`` identical layers; ``step`` passes through to :class:`StepProfile`.

    >>> uniform_profile(3, forward_s=1.0, backward_s=2.0, saved_bytes=10).saved_bytes
    30
    """
    _check_positive_ints(n_layers=n_layers)
    labels = list(names) if names is not None else [f"layer{i}" for i in range(n_layers)]
    if len(labels) != n_layers:
        raise ConfigurationError(f"got {len(labels)} names for {n_layers} layers")
    layers = [LayerProfile(label, forward_s, backward_s, saved_bytes) for label in labels]
    return StepProfile(layers, **step)


__all__ += ["uniform_profile"]
