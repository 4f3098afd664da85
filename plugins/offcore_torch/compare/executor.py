"""Apply an :class:`offcore.sim.Plan` to a PyTorch model: keep, offload or recompute each layer.

Per layer, in forward order:

- ``keep``: nothing changes.
- ``recompute``: the layer (or a segment of up to ``checkpoint_interval`` consecutive
  recomputed layers) runs under ``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=False, preserve_rng_state=True)``: only its input is kept, the forward
  is rerun in backward with the random state it first saw, so dropout masks and every
  number are the same as without it.
- ``offload``: the tensors the layer saves go through
  :func:`offcore_torch.offload_activations` restricted to the offloaded layers
  (``modules=``), with the plan's prefetch policy.

``plan.optimizer`` and ``plan.parameters`` (optimizer offload, parameter streaming) are not
the executor's: they decide how the model's optimizer and parameters are set up before it
runs (``offcore compare`` builds them with ``OffloadOptimizer`` / ``offload_parameters``,
``offcore_torch.compare.runs._optimizer_for``); the executor applies the per-layer actions.

With ``plan.microbatches = m > 1`` the batch is split along its first dimension into
``m`` micro-batches; each runs forward and backward (its loss weighted by its share of
the batch) and the gradients accumulate (gradient accumulation).

    >>> import offcore, torch
    >>> from offcore.sim import Plan
    >>> from offcore_torch.compare.executor import PlanExecutor
    >>> dev = offcore.device("cpu", capacity="1GiB")
    >>> with dev:
    ...     model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)])
    ...     x = torch.randn(32, 64)
    ...     with PlanExecutor(model, Plan(["offload", "recompute", "keep"]), dev) as run:
    ...         outcome = run.forward_backward((x,), lambda model, batch: model(*batch).square().mean())
    >>> outcome.loss.dim(), model[0][0].weight.grad is not None
    (0, True)
    >>> dev.close()

# Note [Bit-identical plans]
# keep / offload / recompute never change a number: offloading restores storages
# exactly (offcore_torch.activations.offload), and checkpoint reruns the layer with the RNG state of
# its first forward (preserve_rng_state=True). With one micro-batch the executor calls
# exactly `loss_fn(model, batch).backward()`, as a plain training loop does, so any
# such plan is bit-identical to the keep-everything baseline. With m > 1 micro-batches
# the gradient is a sum of m weighted partial gradients: equal to the full-batch one
# only up to floating-point summation order (and dropout draws its masks per
# micro-batch). Two runs with the same m are bit-identical whatever the per-layer
# actions are, which is what tests/torch/test_executor.py checks exactly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from offcore.errors import ConfigurationError
from offcore.scheduler import Scheduler
from offcore.sim import Action, Plan
from offcore_torch.activations.copies import poll
from offcore_torch.activations.offload import OffloadHandle, offload_activations
from offcore_torch.activations.policy import KNOWN_OPTIONS, OffloadPolicy
from offcore_torch.layers import resolve_layers
from offcore_torch.runtime import runtime_of

__all__ = ["PlanExecutor", "StepOutcome", "split_batch"]

# offload_activations options the executor sets from the plan (callers may not override them)
_EXECUTOR_OWNED = ("modules", "schedule")

Batch = tuple[Any, ...]
LossFn = Callable[[nn.Module, Batch], Tensor]


def split_batch(batch: Batch, microbatches: int) -> list[tuple[Batch, float]]:
    """Split every tensor of ``batch`` along dimension 0 into ``microbatches`` equal parts.

    Returns ``(micro_batch, weight)`` pairs; ``weight`` is the part's share of the batch
    (``1/m``), by which its mean loss is scaled before backward. Non-tensor items are
    passed to every part unchanged.

        >>> parts = split_batch((torch.arange(6), "tag"), 3)
        >>> [p[0][0].tolist() for p in parts], parts[0][0][1], parts[0][1]
        ([[0, 1], [2, 3], [4, 5]], 'tag', 0.3333333333333333)
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigurationError(f"microbatches must be a positive integer, got {microbatches!r}")
    sizes = {item.shape[0] for item in batch if isinstance(item, Tensor) and item.dim() > 0}
    if not sizes:
        raise ConfigurationError("the batch holds no tensor with a batch dimension to split into micro-batches")
    if len(sizes) != 1:
        raise ConfigurationError(f"the batch's tensors disagree on their first dimension: {sorted(sizes)}")
    (size,) = sizes
    if size % microbatches:
        raise ConfigurationError(
            f"a batch of {size} does not split into {microbatches} equal micro-batches: choose a divisor of {size}"
        )
    chunks = [
        item.chunk(microbatches, dim=0) if isinstance(item, Tensor) and item.dim() > 0 else [item] * microbatches
        for item in batch
    ]
    return [(tuple(parts[k] for parts in chunks), 1.0 / microbatches) for k in range(microbatches)]


@dataclass
class StepOutcome:
    """What :meth:`PlanExecutor.forward_backward` did for one optimizer step.

    ``loss`` is the step's loss, detached (with micro-batches: the weighted sum of
    their losses); ``handles`` the offload regions, one per micro-batch that
    offloaded (``handle.stats()``, ``handle.write_trace(path)``); ``phases`` the host
    clock (``time.perf_counter``) spans ``("forward#k" | "backward#k", start, end)``.
    """

    loss: Tensor
    micro_losses: list[Tensor] = field(default_factory=list)
    handles: list[OffloadHandle] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)

    def stats(self) -> list[Any]:
        """``stats()`` of every offload region of the step."""
        return [handle.stats() for handle in self.handles]


class _Segment:
    """One recompute segment: layers ``first..last`` run as one checkpointed function."""

    def __init__(self, executor: PlanExecutor, members: Sequence[nn.Module], originals: Sequence[Callable[..., Any]]):
        self.executor = executor
        self.members = list(members)
        self.originals = list(originals)
        self.output: Any = None
        self.passed = 0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpointed function: the first layer's real forward, then the others' (forward and recompute)."""
        self.executor._running_segments += 1
        try:
            out = self.originals[0](*args, **kwargs)
            for module in self.members[1:]:
                out = module(out)  # module call: hooks fire; its patched forward sees _running_segments
            return out
        finally:
            self.executor._running_segments -= 1

    def head_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.executor._running_segments:  # pragma: no cover - segments never nest
            return self.run(*args, **kwargs)
        if torch.is_grad_enabled():
            out = checkpoint(self.run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        else:  # nothing is saved without grad: run the segment as it is
            out = self.run(*args, **kwargs)
        # Kept only for the members that pass it on (checkpoint_interval > 1), and dropped after the
        # last of them: a reference kept past its use held the output, and through its grad_fn the
        # checkpoint's saved input, until the next step (one (B, T, D) tensor per layer under
        # K=1: the checkpoint strategy's backward level 128 KiB a layer above the simulator's at
        # offcore compare's default, its max batch 15 measured against 18 predicted)
        self.output = out if len(self.members) > 1 else None
        self.passed = 0
        return out

    def member_forward(self, index: int) -> Callable[..., Any]:
        original = self.originals[index]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.executor._running_segments:
                return original(*args, **kwargs)
            # Outside the segment function the model calls this layer on the segment's output,
            # which already went through it: pass it on.
            if kwargs or len(args) != 1 or args[0] is not self.output:
                raise ConfigurationError(
                    f"checkpoint_interval > 1 joins consecutive layers into one checkpoint, which needs each layer "
                    f"to take the previous layer's output as its only argument; {type(self.members[index]).__name__} "
                    "was called with something else. Use checkpoint_interval=1 for this model."
                )
            self.passed += 1
            if self.passed == len(self.members) - 1:
                self.output = None
            return args[0]

        return forward


class PlanExecutor:
    """Runs training steps of ``model`` under ``plan`` on ``device`` (see the module doc).

    Use it as a context manager: entering installs the checkpoint wrappers of the
    recomputed layers (their ``forward`` is replaced on the instance), leaving restores
    the model exactly. ``offload`` passes extra keyword arguments to
    :func:`offcore_torch.offload_activations` (default ``min_bytes=0`` and ``group_below=0``: every
    saved storage of an offloaded layer moves, on its own, as the simulator assumes). The executor owns a
    :class:`~offcore.scheduler.Scheduler`, so prefetch timing learnt in one step serves
    the next step of the same plan.

    Args:
        model: the model (on ``device.torch_device``).
        plan: one action per layer (:class:`offcore.sim.Plan`).
        device: an offcore backend device.
        layers: the modules the plan's actions refer to, in forward order (default:
            :func:`offcore_torch.layers.find_layers`), the same list the profiler used.
        offload: extra ``offload_activations`` options (``trace=True``, ``host_budget``...).

    Raises:
        ConfigurationError: the plan does not have one action per layer, a layer
            named by the plan's ``layer_names`` is not where it says, or ``offload``
            holds an unknown option or a bad value (checked here, not at the first step).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        device: Any,
        *,
        layers: Sequence[nn.Module] | Sequence[tuple[str, nn.Module]] | None = None,
        offload: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(plan, Plan):
            raise ConfigurationError(f"PlanExecutor needs an offcore.sim.Plan, got {type(plan).__name__}")
        named = resolve_layers(model, layers)
        if len(named) != plan.n_layers:
            raise ConfigurationError(
                f"the plan has {plan.n_layers} layer actions but the model has {len(named)} layers "
                f"({', '.join(name for name, _ in named[:4])}{', ...' if len(named) > 4 else ''}); "
                "plan for the same layers the profiler measured"
            )
        if plan.layer_names is not None and tuple(plan.layer_names) != tuple(name for name, _ in named):
            raise ConfigurationError(
                f"the plan's layer names {list(plan.layer_names)[:4]} do not match the model's layers "
                f"{[name for name, _ in named][:4]}"
            )
        self.model = model
        self.plan = plan
        self.device = device
        self.layers = named
        self.offload_options = self._offload_options(plan, device, offload)
        self.offloaded = [
            module for (_, module), action in zip(named, plan.actions, strict=True) if action is Action.OFFLOAD
        ]
        self.scheduler = Scheduler(margin=plan.prefetch.margin_s)
        self._running_segments = 0
        self._saved_forwards: list[tuple[nn.Module, bool, Any]] = []
        self._drain_hooks: list[Any] = []
        self._installed = False

    @staticmethod
    def _offload_options(plan: Plan, device: Any, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        prefetch = plan.prefetch
        options: dict[str, Any] = {
            "min_bytes": 0,
            # each storage copied and scheduled on its own: the simulator models storages one by one, not groups
            # (Note [Small storages are offloaded in groups] in offcore_torch/activations/records.py)
            "group_below": 0,
            "prefetch": "on_demand" if prefetch.mode == "on_demand" else "deadline",
            "margin": prefetch.margin_s,
            "max_inflight": plan.max_inflight,  # Note [The simulator caps forward's copies in flight]
        }
        if prefetch.budget_bytes is not None:
            options["prefetch_budget"] = prefetch.budget_bytes
        else:
            capacity = int(device.memory_stats().get("capacity_bytes", 0) or 0)
            if capacity:
                options["prefetch_budget"] = capacity
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigurationError(
                f"offload must be a dict of offload_activations options, got {type(extra).__name__}"
            )
        settable = tuple(key for key in KNOWN_OPTIONS if key not in _EXECUTOR_OWNED)
        for key, value in (extra or {}).items():
            if key in _EXECUTOR_OWNED:
                raise ConfigurationError(f"offload option {key!r} is set by the executor from the plan")
            if key not in settable:
                raise ConfigurationError(
                    f"unknown offload option {key!r}; the options PlanExecutor(offload=...) accepts are "
                    f"{', '.join(settable)}"
                )
            options[key] = value
        OffloadPolicy.parse(**options)  # every value checked now, not at the first step
        return options

    # -- checkpoint wrappers ----------------------------------------------------------
    def __enter__(self) -> PlanExecutor:
        if self._installed:
            raise ConfigurationError("this PlanExecutor is already entered")
        modules = [module for _, module in self.layers]
        for first, last in self.plan.segments():
            members = modules[first : last + 1]
            originals = [m.forward for m in members]
            segment = _Segment(self, members, originals)
            for offset, module in enumerate(members):
                self._saved_forwards.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
                module.forward = segment.head_forward if offset == 0 else segment.member_forward(offset)  # type: ignore[method-assign]
        if self.plan.drain_offloads:
            self._drain_hooks = [module.register_forward_hook(self._drain) for module in self.offloaded]
        self._installed = True
        return self

    def _drain(self, module: nn.Module, args: Any, output: Any) -> None:
        """Note [Drained offloads bound the forward's copies in flight] (offcore/sim/simulator.py): the
        layer's device-to-host copies land, and their device copies are freed, before the next layer runs."""
        if not torch.is_grad_enabled():
            return  # nothing was saved
        runtime = runtime_of(self.device)
        if runtime is None:
            return
        runtime.d2h_stream.synchronize()  # an event wait on the copy stream, not a sleep
        poll(runtime)  # the landings handed to their regions: device copies freed now

    def __exit__(self, *exc: object) -> None:
        for hook in self._drain_hooks:
            hook.remove()
        self._drain_hooks.clear()
        for module, had_own, previous in reversed(self._saved_forwards):
            if had_own:
                module.forward = previous  # type: ignore[method-assign]
            else:
                del module.forward
        self._saved_forwards.clear()
        self._installed = False

    # -- one step -----------------------------------------------------------------------
    def _region(self) -> contextlib.AbstractContextManager[Any]:
        if not self.offloaded:
            return contextlib.nullcontext(None)
        return offload_activations(self.device, modules=self.offloaded, schedule=self.scheduler, **self.offload_options)

    def forward_backward(self, batch: Batch, loss_fn: LossFn) -> StepOutcome:
        """Forward and backward of one optimizer step (the caller steps the optimizer).

        ``loss_fn(model, batch)`` returns the scalar mean loss of ``batch`` (a tuple).
        With one micro-batch this is ``loss_fn(model, batch).backward()``; with ``m``
        it runs each micro-batch's forward and ``(loss * 1/m).backward()``.
        """
        if not self._installed:
            raise ConfigurationError("use the executor as a context manager: `with PlanExecutor(...) as run:`")
        if not isinstance(batch, tuple):
            raise ConfigurationError(f"batch must be a tuple of tensors, got {type(batch).__name__}")
        outcome = StepOutcome(loss=torch.zeros(()))
        clock = time.perf_counter
        if self.plan.microbatches == 1:
            start = clock()
            with self._region() as handle:
                loss = loss_fn(self.model, batch)
            middle = clock()
            loss.backward()
            outcome.phases += [("forward#0", start, middle), ("backward#0", middle, clock())]
            outcome.loss = loss.detach()
            outcome.micro_losses.append(outcome.loss)
            if handle is not None:
                outcome.handles.append(handle)
            return outcome
        total: Tensor | None = None
        for index, (micro_batch, weight) in enumerate(split_batch(batch, self.plan.microbatches)):
            start = clock()
            with self._region() as handle:
                loss = loss_fn(self.model, micro_batch)
            middle = clock()
            (loss * weight).backward()
            outcome.phases += [(f"forward#{index}", start, middle), (f"backward#{index}", middle, clock())]
            part = loss.detach() * weight
            total = part if total is None else total + part
            outcome.micro_losses.append(loss.detach())
            if handle is not None:
                outcome.handles.append(handle)
            del loss
        assert total is not None
        outcome.loss = total
        return outcome
