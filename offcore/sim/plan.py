"""Plans: what to do with each layer's saved activations, and how to prefetch them.

A :class:`Plan` holds, per layer, one :class:`Action` (keep on device, offload to the
host, or drop and recompute), the checkpoint interval ``K`` that groups consecutive
recomputed layers into segments, the number of micro-batches for gradient
accumulation, and a :class:`PrefetchPolicy`. Plans are plain data: the simulator
predicts them, the planner searches them, the executor applies them, and they travel
as JSON::

    >>> from offcore.sim.plan import Plan, Action
    >>> p = Plan(["keep", "offload", "recompute"])
    >>> p.actions[1] is Action.OFFLOAD
    True
    >>> Plan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from offcore.errors import ConfigurationError
from offcore.inflight import DEFAULT_MAX_INFLIGHT
from offcore.jsonable import loads
from offcore.units import _show, parse_duration, parse_size

if TYPE_CHECKING:
    from offcore.sim.profile import StepProfile

__all__ = ["Action", "PrefetchPolicy", "Plan"]

_PLAN_FORMAT = "offcore.plan/1"

PrefetchMode = Literal["deadline", "lead", "on_demand"]
OptimizerPlacement = Literal["device", "offload"]
ParameterPlacement = Literal["resident", "stream"]
OptimizerTier = Literal["host", "nvme"]


def _brief(value: object) -> str:
    """A short description of ``value`` for a message (never the repr of a deep or huge container)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return _show(value)
    return f"a {type(value).__name__}"


def _names(keys: Iterable[object]) -> str:
    """Field names for a message, sorted (JSON keys are strings; a Python dict's may not be)."""
    return ", ".join(sorted(_brief(key) for key in keys))


class Action(str, enum.Enum):
    """What happens to one layer's saved activations.

    >>> Action.parse("Offload") is Action.OFFLOAD
    True
    """

    KEEP = "keep"
    """Stay on the device from the layer's forward until its backward."""
    OFFLOAD = "offload"
    """Copied to the host after forward, freed on device, copied back before backward."""
    RECOMPUTE = "recompute"
    """Dropped after forward (only the segment's input is kept) and recomputed before backward."""

    @classmethod
    def parse(cls, value: str | Action) -> Action:
        """Return the action named by ``value`` (case-insensitive)."""
        if isinstance(value, Action):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise ConfigurationError(
            f"unknown action {_brief(value)}: each layer must be one of 'keep', 'offload' or 'recompute'"
        )


ACTIONS: tuple[Action, ...] = (Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE)


@dataclass(frozen=True)
class PrefetchPolicy:
    """When the host-to-device copy of an offloaded layer starts.

    Modes:
        ``"deadline"`` (default): at ``t_need − bytes/BW − margin_s``, where ``t_need`` is
        when backward would reach the layer with no waits (the deadline formula
        ``t_prefetch = t_need − V/BW − t_margin``).
        ``"lead"``: at ``t_need − lead_s``, a fixed lead (the seeds' interactive example).
        ``"on_demand"``: no prefetch; the copy starts when backward reaches the layer.

    In every mode a copy also waits for the layer's device-to-host copy to finish, for
    its link, and for ``budget_bytes``: the bytes reloaded but not yet consumed by
    backward never exceed it (a single layer larger than the budget is reloaded alone).
    ``None`` means no budget.

    >>> PrefetchPolicy(margin_s="1ms").margin_s
    0.001
    """

    mode: PrefetchMode = "deadline"
    margin_s: float = 0.0
    lead_s: float | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("deadline", "lead", "on_demand"):
            raise ConfigurationError(
                f"unknown prefetch mode {_brief(self.mode)}: use 'deadline', 'lead' or 'on_demand'"
            )
        object.__setattr__(self, "margin_s", parse_duration(self.margin_s, what="prefetch margin_s"))
        if self.mode == "lead":
            if self.lead_s is None:
                raise ConfigurationError("prefetch mode 'lead' needs lead_s (how long before use the copy starts)")
            object.__setattr__(self, "lead_s", parse_duration(self.lead_s, what="prefetch lead_s"))
        elif self.lead_s is not None:
            raise ConfigurationError(f"lead_s only applies to prefetch mode 'lead', not {_brief(self.mode)}")
        if self.budget_bytes is not None:
            object.__setattr__(self, "budget_bytes", parse_size(self.budget_bytes, what="prefetch budget_bytes"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"mode": self.mode, "margin_s": self.margin_s, "lead_s": self.lead_s, "budget_bytes": self.budget_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefetchPolicy:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(data, dict):
            raise ConfigurationError(f"prefetch must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"mode", "margin_s", "lead_s", "budget_bytes"}
        if unknown:
            raise ConfigurationError(
                f"unknown prefetch fields {_names(unknown)}; known: 'budget_bytes', 'lead_s', 'margin_s', 'mode'"
            )
        return cls(**data)


@dataclass(frozen=True)
class Plan:
    """Per-layer actions plus checkpoint interval, micro-batches and prefetch policy.

    Attributes:
        actions: one :class:`Action` (or its name) per layer, in forward order.
        checkpoint_interval: ``K``, the most consecutive recomputed layers that share one
            checkpoint (segment). ``1`` recomputes layer by layer.
        microbatches: split the step into this many micro-batches (gradient
            accumulation); the profile's ``batch_size`` must divide evenly.
        prefetch: the :class:`PrefetchPolicy` for offloaded layers.
        layer_names: optional names, checked against the profile when given.
        optimizer: ``"device"`` (the default: the optimizer steps on the device, its state
            there) or ``"offload"`` (``offcore_torch.OffloadOptimizer``: gradients D2H as
            backward makes them, the step on the host, parameters H2D after it; Note
            [Optimizer offload and parameter streaming in the simulator] in simulator.py).
        parameters: ``"resident"`` (the default) or ``"stream"``
            (``offcore_torch.offload_parameters``: each layer's parameters copied in before
            its forward and its backward, freed after each).
        optimizer_tier: where ``optimizer="offload"`` keeps the optimizer states between steps:
            ``"host"`` (the default) or ``"nvme"`` (``OffloadOptimizer(tier="nvme")``: the host
            step runs at ``step()``, pipelined over state groups read from and written to the
            NVMe tier; Note [The optimizer's NVMe tier in the simulator] in simulator.py).
        activation_tier: where offloaded activations' host copies live until backward:
            ``"host"`` (the default) or ``"nvme"`` (written to the NVMe tier once their D2H
            landed; a reload is two hops, NVMe → host then H2D: Note [Activations on NVMe in
            the simulator] in simulator.py).
        drain_offloads: ``False`` (the default) or ``True``: each offloaded layer's forward ends
            when the device-to-host copies of its saved tensors landed (PlanExecutor waits for
            them and frees their device copies before the next layer runs), so forward never
            holds more than one layer's copies in flight, however slowly the link runs (Note
            [Drained offloads bound the forward's copies in flight] in simulator.py). It costs
            each offloaded layer the tail of its copies; ``offcore compare`` sets it.
        max_inflight: the most bytes of saved tensors' device-to-host copies in flight at once
            (``offload_activations(max_inflight=)``, whose default it shares: 256 MiB; ``None``: no
            cap; ``0``: one copy at a time; a size text such as ``"64MiB"`` is read too). A save
            that would exceed it waits for the oldest copy to land (Note [The simulator caps
            forward's copies in flight] in simulator.py); PlanExecutor passes it to the runtime.

    >>> Plan.uniform(4, "recompute", checkpoint_interval=2).segments()
    [(0, 1), (2, 3)]
    """

    actions: Sequence[Action | str]
    checkpoint_interval: int = 1
    microbatches: int = 1
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    layer_names: Sequence[str] | None = None
    optimizer: OptimizerPlacement = "device"
    parameters: ParameterPlacement = "resident"
    optimizer_tier: OptimizerTier = "host"
    activation_tier: OptimizerTier = "host"
    drain_offloads: bool = False
    max_inflight: int | None = DEFAULT_MAX_INFLIGHT

    def __post_init__(self) -> None:
        if not isinstance(self.drain_offloads, bool):
            raise ConfigurationError(f"drain_offloads must be True or False, got {_brief(self.drain_offloads)}")
        if self.max_inflight is not None:  # read as offload_activations reads it (parse_size refuses 1.5, True)
            object.__setattr__(
                self, "max_inflight", parse_size(self.max_inflight, what="max_inflight", allow_zero=True)
            )
        if self.optimizer not in ("device", "offload"):
            raise ConfigurationError(f"optimizer must be 'device' or 'offload', got {_brief(self.optimizer)}")
        if self.parameters not in ("resident", "stream"):
            raise ConfigurationError(f"parameters must be 'resident' or 'stream', got {_brief(self.parameters)}")
        if self.optimizer_tier not in ("host", "nvme"):
            raise ConfigurationError(f"optimizer_tier must be 'host' or 'nvme', got {_brief(self.optimizer_tier)}")
        if self.activation_tier not in ("host", "nvme"):
            raise ConfigurationError(f"activation_tier must be 'host' or 'nvme', got {_brief(self.activation_tier)}")
        if self.optimizer_tier == "nvme" and self.optimizer != "offload":
            raise ConfigurationError(
                "optimizer_tier='nvme' needs optimizer='offload' (the host optimizer's states on disk)"
            )
        if isinstance(self.actions, (str, bytes, Mapping, Set)) or not isinstance(self.actions, Iterable):
            raise ConfigurationError(
                "actions must be a list of 'keep' / 'offload' / 'recompute', one per layer in forward order, "
                f"got {_brief(self.actions)}"
            )
        actions = tuple(Action.parse(a) for a in self.actions)
        if not actions:
            raise ConfigurationError("a plan needs at least one layer action")
        object.__setattr__(self, "actions", actions)
        for name in ("checkpoint_interval", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer, got {_brief(value)}")
        if not isinstance(self.prefetch, PrefetchPolicy):
            raise ConfigurationError(f"prefetch must be a PrefetchPolicy, got {type(self.prefetch).__name__}")
        if self.layer_names is not None:
            if isinstance(self.layer_names, (str, bytes, Mapping, Set)) or not isinstance(self.layer_names, Iterable):
                raise ConfigurationError(
                    f"layer_names must be a list of layer names, one per action, got {_brief(self.layer_names)}"
                )
            names = tuple(self.layer_names)
            bad = next((name for name in names if not isinstance(name, str)), None)
            if bad is not None:
                raise ConfigurationError(f"layer_names must be strings, got {_brief(bad)}")
            if len(names) != len(actions):
                raise ConfigurationError(f"plan has {len(actions)} actions but {len(names)} layer names")
            object.__setattr__(self, "layer_names", names)

    # --- constructors -----------------------------------------------------------------

    @classmethod
    def uniform(cls, n_layers: int, action: Action | str, **kwargs: Any) -> Plan:
        """The same action for every layer (``Plan.uniform(32, "recompute")``)."""
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ConfigurationError(f"n_layers must be a positive integer, got {n_layers!r}")
        return cls([Action.parse(action)] * n_layers, **kwargs)

    @classmethod
    def keep_all(cls, n_layers: int, **kwargs: Any) -> Plan:
        """Keep every activation on the device (the baseline)."""
        return cls.uniform(n_layers, Action.KEEP, **kwargs)

    # --- queries ----------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        """Number of layers the plan covers."""
        return len(self.actions)

    def count(self, action: Action | str) -> int:
        """How many layers get ``action``."""
        wanted = Action.parse(action)
        return sum(1 for a in self.actions if a is wanted)

    def segments(self) -> list[tuple[int, int]]:
        """Recompute segments as inclusive ``(first, last)`` layer indices.

        Runs of consecutive recomputed layers are cut into pieces of at most
        ``checkpoint_interval`` layers, from the front of each run.
        """
        segments: list[tuple[int, int]] = []
        index, n = 0, len(self.actions)
        while index < n:
            if self.actions[index] is not Action.RECOMPUTE:
                index += 1
                continue
            end = index
            while (
                end + 1 < n and self.actions[end + 1] is Action.RECOMPUTE and end + 1 - index < self.checkpoint_interval
            ):
                end += 1
            segments.append((index, end))
            index = end + 1
        return segments

    @property
    def strategy(self) -> str:
        """A one-word summary: ``keep``, ``offload``, ``checkpoint``, ``hybrid``, with ``+accumulate``."""
        kinds = {a for a in self.actions if a is not Action.KEEP}
        if not kinds:
            word = "keep"
        elif kinds == {Action.OFFLOAD}:
            word = "offload"
        elif kinds == {Action.RECOMPUTE}:
            word = "checkpoint"
        else:
            word = "hybrid"
        if self.parameters == "stream":
            word += "+param-stream"
        if self.optimizer == "offload":
            word += "+optimizer-offload" + ("-nvme" if self.optimizer_tier == "nvme" else "")
        return word + ("+accumulate" if self.microbatches > 1 else "")

    def check(self, profile: StepProfile) -> None:
        """Raise ConfigurationError unless this plan fits ``profile``."""
        if len(self.actions) != profile.n_layers:
            raise ConfigurationError(
                f"plan has {len(self.actions)} layer actions but the profile has {profile.n_layers} layers: "
                "make one action per layer, in forward order"
            )
        if self.layer_names is not None and tuple(self.layer_names) != profile.layer_names:
            mismatched = [(p, q) for p, q in zip(self.layer_names, profile.layer_names, strict=True) if p != q][:3]
            raise ConfigurationError(f"plan layer names do not match the profile's (first differences: {mismatched})")
        if profile.batch_size % self.microbatches:
            raise ConfigurationError(
                f"plan splits the step into {self.microbatches} micro-batches, but batch_size "
                f"{profile.batch_size} is not divisible by it"
            )

    def with_actions(self, actions: Sequence[Action | str]) -> Plan:
        """A copy with other actions (same interval, micro-batches, prefetch)."""
        return replace(self, actions=tuple(actions))

    def describe(self) -> str:
        """Compact text such as ``'KKOR'`` plus the other knobs."""
        letters = "".join({"keep": "K", "offload": "O", "recompute": "R"}[a.value] for a in self.actions)
        prefetch = self.prefetch
        budget = "∞" if prefetch.budget_bytes is None else str(prefetch.budget_bytes)
        kinds = (
            (" optimizer=offload" if self.optimizer == "offload" else "")
            + ("/nvme" if self.optimizer_tier == "nvme" else "")
            + (" activations=nvme" if self.activation_tier == "nvme" else "")
            + (" parameters=stream" if self.parameters == "stream" else "")
            + (" drained" if self.drain_offloads else "")
            + (
                ""
                if self.max_inflight == DEFAULT_MAX_INFLIGHT
                else f" max_inflight={'∞' if self.max_inflight is None else self.max_inflight}"
            )
        )
        return f"{letters} K={self.checkpoint_interval} m={self.microbatches} prefetch={prefetch.mode}/{budget}{kinds}"

    # --- JSON -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        data: dict[str, Any] = {
            "format": _PLAN_FORMAT,
            "actions": [a.value for a in self.actions],
            "checkpoint_interval": self.checkpoint_interval,
            "microbatches": self.microbatches,
            "prefetch": self.prefetch.to_dict(),
            "layer_names": None if self.layer_names is None else list(self.layer_names),
        }
        if self.optimizer != "device":  # written only when set: older readers keep reading activation plans
            data["optimizer"] = self.optimizer
        if self.parameters != "resident":
            data["parameters"] = self.parameters
        if self.optimizer_tier != "host":
            data["optimizer_tier"] = self.optimizer_tier
        if self.activation_tier != "host":
            data["activation_tier"] = self.activation_tier
        if self.drain_offloads:
            data["drain_offloads"] = True
        if self.max_inflight != DEFAULT_MAX_INFLIGHT:  # older plans ran with the default
            data["max_inflight"] = self.max_inflight
        return data

    def to_json(self, *, indent: int | None = 2) -> str:
        """Serialise to JSON text; :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, profile: StepProfile | None = None) -> Plan:
        """Build from :meth:`to_dict` output; with ``profile``, also check it fits."""
        if not isinstance(data, dict):
            raise ConfigurationError(f"a plan must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format", _PLAN_FORMAT)
        if fmt != _PLAN_FORMAT:
            raise ConfigurationError(f"unknown plan format {_brief(fmt)}; expected {_PLAN_FORMAT!r}")
        known = {
            "format",
            "actions",
            "checkpoint_interval",
            "microbatches",
            "prefetch",
            "layer_names",
            "optimizer",
            "parameters",
            "optimizer_tier",
            "activation_tier",
            "drain_offloads",
            "max_inflight",
        }
        unknown = set(data) - known
        if unknown:
            raise ConfigurationError(f"unknown plan fields {_names(unknown)}; known: {_names(known)}")
        if not isinstance(data.get("actions"), list):
            got = "none" if "actions" not in data else _brief(data["actions"])
            raise ConfigurationError(
                f"a plan needs an 'actions' list, one of 'keep' / 'offload' / 'recompute' per layer; got {got}"
            )
        if data.get("layer_names") is not None and not isinstance(data["layer_names"], list):
            raise ConfigurationError(
                f"a plan's 'layer_names' must be a list of strings, got {_brief(data['layer_names'])}"
            )
        prefetch = PrefetchPolicy.from_dict(data["prefetch"]) if data.get("prefetch") is not None else PrefetchPolicy()
        plan = cls(
            data["actions"],
            checkpoint_interval=data.get("checkpoint_interval", 1),
            microbatches=data.get("microbatches", 1),
            prefetch=prefetch,
            layer_names=data.get("layer_names"),
            optimizer=data.get("optimizer", "device"),
            parameters=data.get("parameters", "resident"),
            optimizer_tier=data.get("optimizer_tier", "host"),
            activation_tier=data.get("activation_tier", "host"),
            drain_offloads=data.get("drain_offloads", False),
            max_inflight=data.get("max_inflight", DEFAULT_MAX_INFLIGHT),
        )
        if profile is not None:
            plan.check(profile)
        return plan

    @classmethod
    def from_json(cls, text: str, *, profile: StepProfile | None = None) -> Plan:
        """Read a plan written by :meth:`to_json` (optionally checked against ``profile``).

        Raises:
            ConfigurationError: ``text`` is not JSON text, not valid JSON, nested too
                deeply, or not a valid plan.
        """
        return cls.from_dict(loads(text, what="plan"), profile=profile)
