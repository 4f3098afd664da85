"""What an OffloadOptimizer step leaves alive for the cyclic garbage collector, per parameter.

An object made during a step that is still alive when the step is over lived through the step's
young collections: it was promoted to the collector's oldest generation, and each object promoted
there brings the next full collection (of every object of the program) closer. At thousands of
parameters the optimizer's own per-parameter objects of each round (the core's ``ManagedObject`` of
each parameter and of each gradient, each upload's destination tensor) brought one every few steps,
more than the step's bookkeeping cost. They are renewed in place now (Note [Objects renewed across
rounds] in offcore/residency.py, Note [An upload's destination is made once per storage] in
optimizer/rounds.py); this counts the objects a step leaves that were not there before it, so a change
that makes one per parameter per step again fails here, not in a benchmark. The landings' worker tasks,
one per gradient, are let go as they finish instead of at the end of backward (Note [Finished tasks are
let go while backward runs] in optimizer/optimizer.py).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402

import offcore  # noqa: E402

pytestmark = pytest.mark.torch

# per parameter per step; the objects a round makes once (its scheduler, plan, tables) cancel in the slope
BOUND = 0.3


def _new_objects_after_a_step(params: int) -> tuple[int, dict[str, int]]:
    """Objects the collector tracks after one step (backward, step, zero_grad, the next forward) that
    were not there before it, and how many of each type."""
    dev = offcore.device("cpu", capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    with dev:
        generator = torch.Generator().manual_seed(1)
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(8, generator=generator)) for _ in range(params))
        dev.adopt(model)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, accumulation_steps=None, lr=1e-3
        )
        try:

            def step() -> None:
                torch.stack([p.sum() for p in model]).sum().backward()
                opt.step()
                opt.zero_grad()
                torch.stack([p.sum() for p in model]).sum()  # the next forward: it waits for the uploads
                opt.synchronize()

            for _ in range(3):  # warm-up: pools, the predictor's learned round, the first rounds' objects
                step()
            gc.disable()  # no automatic collection while counting (explicit ones still run)
            try:
                gc.collect()
                gc.freeze()  # what exists now is left out of gc.get_objects() (no reference held to any of it)
                step()
                gc.collect()  # untracks what the collector stops tracking at its first pass (tuples of ints)
                counts: dict[str, int] = {}
                for o in gc.get_objects():  # made by the step, and alive
                    counts[type(o).__name__] = counts.get(type(o).__name__, 0) + 1
            finally:
                gc.unfreeze()
                gc.enable()
        finally:
            opt.close()
    return sum(counts.values()), counts


def test_a_step_leaves_no_new_object_per_parameter_for_the_collector() -> None:
    few, few_types = _new_objects_after_a_step(100)
    many, many_types = _new_objects_after_a_step(300)
    per_parameter = (many - few) / 200
    grown = {k: (v - few_types.get(k, 0)) / 200 for k, v in many_types.items() if v > few_types.get(k, 0)}
    assert per_parameter <= BOUND, (
        f"an OffloadOptimizer step leaves {per_parameter:.2f} new objects per parameter alive for the cyclic "
        f"collector (bound {BOUND}; by type: {grown}): each is promoted to the oldest generation, and brings "
        "full collections closer (Note [Objects renewed across rounds] in offcore/residency.py)"
    )


def test_finished_landings_are_not_kept_through_backward() -> None:
    """Note [Finished tasks are let go while backward runs]: a gradient's landing task that finished without a
    failure is let go while backward goes on, not kept (and promoted) until its end."""
    params = 300
    dev = offcore.device("cpu", capacity="1GiB", h2d_bandwidth="inf", d2h_bandwidth="inf", latency=0)
    alive: list[int] = []
    with dev:
        model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(8)) for _ in range(params))
        dev.adopt(model)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, accumulation_steps=None, lr=1e-3
        )
        try:

            def landed(_: Any) -> None:  # after the optimizer's own hook (registered first) queued the landing
                with opt._lock:
                    task = opt._futures[-1]
                opt._wait_task(task)  # the worker ran it: every task queued so far finished (an event, no sleep)
                with opt._lock:
                    alive.append(len(opt._futures))  # the tasks the optimizer keeps

            hooks = [p.register_post_accumulate_grad_hook(landed) for p in model]
            torch.stack([p.sum() for p in model]).sum().backward()
            for hook in hooks:
                hook.remove()
            opt.step()
            opt.zero_grad()
        finally:
            opt.close()
    assert len(alive) == params
    assert max(alive) <= 2 * 64, f"up to {max(alive)} finished landing tasks kept alive during a backward of {params}"
