"""Equivalence harness: run a few training steps with and without offloading and compare bits.

offcore's first promise is that offloading never changes a number. This module
runs the same deterministic training loop twice and compares every loss, every
gradient and every final parameter and buffer *bit for bit* (not ``allclose``)::

    >>> import offcore
    >>> from offcore_torch.models import mlp_workload
    >>> from offcore_torch.testing import run_workload, assert_bit_identical
    >>> dev = offcore.device("cpu", capacity="1GiB", sanitize=True)           # doctest: +SKIP
    >>> work = mlp_workload()
    >>> kept = run_workload(work, device=dev)                                 # doctest: +SKIP
    >>> offloaded = run_workload(work, device=dev, offload={"min_bytes": 1})  # doctest: +SKIP
    >>> assert_bit_identical(kept, offloaded)                                 # doctest: +SKIP

The loop is the one ``docs/activation-offload.md`` shows: forward inside
``offcore_torch.offload_activations(device, **offload)``, backward after the block,
then ``AdamW.step()`` and ``zero_grad()``. Dropout is made reproducible by
``torch.manual_seed(seed + step)`` right before each forward, so offloading must not
consume random numbers either.

It works on every backend: the model is built on the CPU from its seed and moved to
``device.torch_device``; the comparison copies everything back to the CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from offcore_torch.models import Batch, Workload

__all__ = [
    "RunRecord",
    "run_steps",
    "run_workload",
    "assert_bit_identical",
    "bit_identical",
    "deterministic_algorithms",
    "measure_peak",
]

ModelFactory = Callable[[int], nn.Module]
BatchFn = Callable[[int, torch.device], Batch]
LossFn = Callable[[nn.Module, Batch], Tensor]


@dataclass
class RunRecord:
    """What :func:`run_steps` observed, copied to the CPU.

    ``losses[i]`` and ``grads[i]`` belong to step ``i`` (gradients as backward left
    them, before the optimizer step); ``params`` and ``buffers`` are the final values;
    ``stats[i]`` is the offload handle's ``stats()`` of step ``i`` (``None`` without
    offloading).
    """

    losses: list[Tensor] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    buffers: dict[str, Tensor] = field(default_factory=dict)
    stats: list[Any] = field(default_factory=list)

    def total(self, stat: str) -> float:
        """Sum of one stats field over all steps (0 when the run did not offload).

        >>> RunRecord(stats=[None, None]).total("offloaded_bytes")
        0
        """
        return sum(getattr(s, stat) for s in self.stats if s is not None)


def _cpu_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Run the block with ``torch.use_deterministic_algorithms(enabled)``, then restore the setting.

    On CUDA two identical runs are only bit-identical with deterministic kernels
    (SDPA's and cuBLAS's defaults are not); on the CPU it changes nothing we use.
    cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first call, which is
    set here when absent.

        >>> with deterministic_algorithms():
        ...     torch.are_deterministic_algorithms_enabled()
        True
    """
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)


OffloadSpec = Mapping[str, Any] | Callable[[], contextlib.AbstractContextManager[Any]] | None


def _offload_context(device: Any, offload: OffloadSpec) -> contextlib.AbstractContextManager[Any]:
    if offload is None:
        return contextlib.nullcontext(None)
    if callable(offload):
        return offload()
    import offcore_torch

    return offcore_torch.offload_activations(device, **offload)


def run_steps(
    model_factory: ModelFactory,
    batch_fn: BatchFn,
    *,
    device: Any,
    loss_fn: LossFn | None = None,
    steps: int = 3,
    offload: OffloadSpec = None,
    seed: int = 0,
    lr: float = 1e-2,
    deterministic: bool = True,
) -> RunRecord:
    """Train ``steps`` AdamW steps on ``device`` and record losses, gradients and final state.

    - ``model_factory(seed)`` builds the model on the CPU; it is moved to
      ``device.torch_device`` inside ``with device:`` (so the fake device counts it).
    - ``batch_fn(step, torch_device)`` returns the batch of step ``step``.
    - ``loss_fn(model, batch)`` returns the scalar loss (default: ``model(*batch)``).
    - ``offload``: keyword arguments of ``offcore_torch.offload_activations``; or a
      zero-argument callable returning any context manager to run the forward in
      (e.g. ``lambda: torch.autograd.graph.save_on_cpu()``); ``None`` runs without
      offloading (the reference).
    - ``seed`` initialises the model; ``torch.manual_seed(seed + step)`` precedes each
      forward so dropout masks are the same in every run.

    Raises whatever the step raises (e.g. the device's out-of-memory error).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    compute_loss: LossFn = loss_fn or (lambda model, batch: model(*batch))
    record = RunRecord()
    with deterministic_algorithms(deterministic), device:
        torch_device = torch.device(device.torch_device)
        model = model_factory(seed).to(torch_device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for step in range(steps):
            batch = batch_fn(step, torch_device)
            torch.manual_seed(seed + step)
            with _offload_context(device, offload) as handle:
                loss = compute_loss(model, batch)
            loss.backward()
            record.losses.append(_cpu_copy(loss))
            record.grads.append({name: _cpu_copy(p.grad) for name, p in model.named_parameters() if p.grad is not None})
            record.stats.append(handle.stats() if hasattr(handle, "stats") else None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss, batch
        record.params = {name: _cpu_copy(p) for name, p in model.named_parameters()}
        record.buffers = {name: _cpu_copy(b) for name, b in model.named_buffers()}
        device.synchronize()
    return record


def run_workload(workload: Workload, **kwargs: Any) -> RunRecord:
    """:func:`run_steps` on a :class:`~offcore_torch.models.Workload` (same keyword arguments)."""
    return run_steps(workload.build, workload.make_batch, loss_fn=workload.loss, **kwargs)


_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_identical(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bit pattern.

    Stricter than ``torch.equal``: ``-0.0`` differs from ``0.0``; a NaN equals the
    same NaN::

        >>> bit_identical(torch.tensor([0.0]), torch.tensor([-0.0]))
        False
        >>> bit_identical(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
        True
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b) and not (a.is_floating_point() or a.is_complex()):
        return True
    a_c, b_c = a.detach().contiguous(), b.detach().contiguous()
    if a_c.is_complex():
        a_c, b_c = torch.view_as_real(a_c), torch.view_as_real(b_c)
    view = _BIT_VIEWS.get(a_c.element_size())
    if view is None:  # pragma: no cover - no such dtype today
        return torch.equal(a_c, b_c)
    return torch.equal(a_c.view(view), b_c.view(view))


def _describe_difference(where: str, a: Tensor, b: Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{where}: dtype/shape differ: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    a64, b64 = a.detach().double(), b.detach().double()
    differing = (a64 != b64) & ~(a64.isnan() & b64.isnan())
    count = int(differing.sum())
    if count == 0:  # only the sign of zero or NaN payload differ
        return f"{where}: values compare equal but the bit patterns differ (signed zero or NaN payload)"
    diff = (a64 - b64).abs().nan_to_num(nan=float("inf"))
    worst = int(diff.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
    return (
        f"{where}: {count} of {a.numel()} elements differ; max |diff| {float(diff.flatten()[worst]):.3e} "
        f"at index {index} ({float(a64.flatten()[worst])!r} vs {float(b64.flatten()[worst])!r}); "
        f"shape {tuple(a.shape)}, dtype {a.dtype}"
    )


def _compare_named(where: str, a: Mapping[str, Tensor], b: Mapping[str, Tensor], problems: list[str]) -> None:
    if a.keys() != b.keys():
        problems.append(
            f"{where}: different names: only in first {sorted(a.keys() - b.keys())}, "
            f"only in second {sorted(b.keys() - a.keys())}"
        )
    for name in sorted(a.keys() & b.keys()):
        if not bit_identical(a[name], b[name]):
            problems.append(_describe_difference(f"{where} {name!r}", a[name], b[name]))


def assert_bit_identical(a: RunRecord, b: RunRecord, *, labels: tuple[str, str] = ("reference", "offloaded")) -> None:
    """Raise ``AssertionError`` listing every loss, gradient, parameter or buffer that differs in any bit.

    The message names the first differences (step, tensor name, how many elements,
    the largest difference and where), e.g.
    ``step 1 gradient 'blocks.0.attn.qkv.weight': 3 of 12288 elements differ; ...``.
    """
    problems: list[str] = []
    if len(a.losses) != len(b.losses):
        problems.append(f"{labels[0]} ran {len(a.losses)} steps, {labels[1]} ran {len(b.losses)}")
    for step, (loss_a, loss_b) in enumerate(zip(a.losses, b.losses, strict=False)):
        if not bit_identical(loss_a, loss_b):
            problems.append(_describe_difference(f"step {step} loss", loss_a, loss_b))
    for step, (grads_a, grads_b) in enumerate(zip(a.grads, b.grads, strict=False)):
        _compare_named(f"step {step} gradient", grads_a, grads_b, problems)
    _compare_named("final parameter", a.params, b.params, problems)
    _compare_named("final buffer", a.buffers, b.buffers, problems)
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise AssertionError(f"{labels[1]} run is not bit-identical to the {labels[0]} run:\n  {shown}{more}")


def measure_peak(device: Any, fn: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``fn()`` and return (device peak bytes above the allocation before the call, ``fn``'s result).

    Uses ``device.reset_peak_memory_stats()`` and ``memory_stats()``; call it inside
    ``with device:``.
    """
    device.synchronize()
    before = device.memory_stats().allocated_bytes
    device.reset_peak_memory_stats()
    result = fn()
    device.synchronize()
    return device.memory_stats().peak_allocated_bytes - before, result
