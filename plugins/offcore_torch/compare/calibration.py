"""The instrumentation's own cost taken out of a profile, and the offloading runtime's and checkpoint's measured in (Note [Profiler calibration])."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

# Note [Profiler calibration]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The instrumented step pays for its own hooks (timing events, memory statistics, the
# saved-tensor hook) inside the layers it times, so its layer times overstate a plain
# step's (by ~10 % for a small model on the CPU fake device). Calibration times plain
# forward+backward passes with two events and scales every layer's forward, backward and
# recompute time (and the time outside the layers) by plain / instrumented (never above 1).
# The offloading runtime's own host work (pack and unpack per saved storage: Python, pool,
# events) runs on the compute stream too; passes under offload_activations(modules=layers,
# min_bytes=0) give it as (offloaded pass − its exposed wait − plain pass) / storages
# offloaded, the median over interleaved pairs, so a drift of host load hits both sides.
# Passes with every layer under torch.utils.checkpoint (non-reentrant, RNG preserved, as
# the executor runs them) give the recompute cost: (checkpointed − plain) is the layers'
# forward again plus the checkpoint machinery; the machinery per saved storage goes into
# each layer's recompute_s on top of its forward time.


def _calibrate(
    model: nn.Module,
    step: Callable[[], Tensor],
    device: Any,
    modules: list[nn.Module],
    instrumented_s: float,
    passes: int,
) -> tuple[float, float, float]:
    """Note [Profiler calibration]: (scale of instrumented times, offload overhead per storage, checkpointed − plain)."""
    from offcore.scheduler import Scheduler
    from offcore_torch.activations.offload import offload_activations

    params = list(model.parameters())
    stashed = [p.grad for p in params]
    torch_device = torch.device(device.torch_device)
    fork = (
        torch.random.fork_rng(devices=[])
        if torch_device.type == "cpu"
        else torch.random.fork_rng(devices=[torch_device.index or 0], device_type=torch_device.type)
    )
    scheduler = Scheduler()

    def checkpointed(module: nn.Module) -> Callable[..., Any]:
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(
                original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
            )

        return forward

    def timed(mode: str) -> tuple[float, float, int]:
        for p in params:
            p.grad = None
        device.synchronize()
        start = device.new_event(enable_timing=True)
        end = device.new_event(enable_timing=True)
        start.record(device.current_stream())
        wait, storages = 0.0, 0
        if mode == "offload":
            with offload_activations(device, modules=modules, min_bytes=0, schedule=scheduler) as handle:
                loss = step()
            loss.backward()
        elif mode == "checkpoint":
            own = [module.__dict__.get("forward") for module in modules]  # an instance-level forward, if any
            for module in modules:
                module.forward = checkpointed(module)  # type: ignore[method-assign]
            try:
                loss = step()
            finally:
                for module, previous in zip(modules, own, strict=True):
                    if previous is None:
                        del module.forward
                    else:
                        module.forward = previous  # type: ignore[method-assign]
            loss.backward()
        else:
            loss = step()
            loss.backward()
        del loss
        end.record(device.current_stream())
        device.synchronize()
        end.synchronize()
        if mode == "offload":
            stats = handle.stats()
            wait, storages = stats.exposed_wait_s, stats.offloaded_storages
        return start.elapsed_time(end) / 1e3, wait, storages

    plain: list[float] = []
    overheads: list[float] = []
    recomputes: list[float] = []
    try:
        with device, fork, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            timed("offload")  # warm the runtime (pool, streams) and the scheduler
            timed("checkpoint")
            for _ in range(passes):
                seconds, _, _ = timed("plain")
                plain.append(seconds)
                offloaded, wait, storages = timed("offload")
                if storages:
                    overheads.append(max(0.0, offloaded - wait - seconds) / storages)
                recomputes.append(timed("checkpoint")[0] - seconds)
    finally:
        for p, grad in zip(params, stashed, strict=True):
            p.grad = grad
    scale = min(1.0, statistics.median(plain) / instrumented_s) if instrumented_s > 0 else 1.0
    return scale, statistics.median(overheads) if overheads else 0.0, statistics.median(recomputes)
