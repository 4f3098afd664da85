"""ParameterOffloadHandle's module and autograd hooks (mixin ``_Hooks``; moved from parameters.py)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from offcore_torch.parameters.state import _CALL_IMPL_CODE, _graph_task_id, _output_tensors, _Slot, _Unit


class _Hooks:
    """ParameterOffloadHandle's hook methods (see parameters.py)."""

    # -- hooks -------------------------------------------------------------------------
    # Note [Forwards ended by a BaseException]
    # The post hook that pops a module's frame is registered with ``always_call=True``, but torch calls
    # those hooks only when forward raised an ``Exception``: a ``KeyboardInterrupt`` (or ``SystemExit``,
    # ``GeneratorExit``) raised in forward or in a user's hook leaves every frame of that forward behind,
    # and the handle believed it was inside forward from then on: ``remove()`` refused forever and the
    # step never ended (its pins and pinned buffers held). A frame is stale when no call of a module this
    # handle hooks is on the stack of the handle's thread: the root model's pre hook finding frames checks
    # that (a root model is not called inside its own forward), so does ``remove()``; stale frames are
    # dropped as a failed forward's are (``_abort``).
    def _frames_are_stale(self) -> bool:
        if threading.current_thread() is not self._thread:
            return False  # a forward may be running on the handle's thread
        hooked = {id(self.model), *self._module_unit}
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _CALL_IMPL_CODE and id(frame.f_locals.get("self")) in hooked:
                return False
            frame = frame.f_back
        return True

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # Note [Compiled blocks are units]
            return
        if self._frames and module is self.model and self._frames_are_stale():
            self._abort()  # Note [Forwards ended by a BaseException]
        unit = self._module_unit.get(id(module))
        in_backward = _graph_task_id() >= 0
        frame: tuple[_Unit | None, list[_Slot], bool] = (unit, [], in_backward)
        if not self._frames and not in_backward:
            if self._tasks:
                self._forget_failed_backwards()
            self._frames.append(frame)
            if self._foreign_step:
                self._release_outside()
            step = self._step
            if step is None or not step.prestarted or step.forward_seen or step.mode != self._mode():
                step = self._begin_step(time.perf_counter())
            step.forward_seen = True
        else:
            self._frames.append(frame)
        if unit is None:
            return
        self._use(unit, "f")
        training = module.training
        for slot in unit.slots:
            slot.pins += 1
            frame[1].append(slot)
            if training and slot.is_buffer:
                # kernels update buffers without a version bump (BatchNorm's running statistics)
                slot.dirty = True

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if not self._frames:
            return
        unit, pinned, in_backward = self._frames.pop()
        failed = sys.exc_info()[0] is not None
        task = _graph_task_id()
        for slot in pinned:
            slot.pins -= 1
            if task >= 0 and not failed:
                self._pin_backward(slot, task)
        if failed and not self._frames:
            self._abort()
            return
        if unit is not None and not failed and task < 0 and torch.is_grad_enabled():
            tensors = _output_tensors(output)
            if len(tensors) == 1:
                # one output: its tensor hook fires once per backward pass, before the module's backward
                # nodes run, as register_multi_grad_hook(mode="any") would (without its per-call lock and
                # wrapper, a measurable cost per module call)
                tensors[0].register_hook(self._backward_hook(unit))
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_hook(unit), mode="any")
        turn = self._turn if task < 0 and not failed and torch.is_grad_enabled() else ()
        for slot in pinned:
            if slot.index not in turn:  # Note [Backward's first parameters stay after forward]
                self._maybe_free(slot)

    def _backward_hook(self, unit: _Unit) -> Callable[[Any], None]:
        def hook(_grad: Any) -> None:
            task = _graph_task_id()
            self._use(unit, "b")
            for slot in unit.slots:
                self._pin_backward(slot, task)

        return hook

    def _pin_backward(self, slot: _Slot, task: int) -> None:
        if task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(task))
        slot.bwd_tasks.add(task)

    def _accumulated(self, param: torch.Tensor) -> None:
        slot = getattr(param, "_offcore_slot", None)
        if slot is None:
            return
        slot.bwd_tasks.discard(_graph_task_id())
        if slot.index in self._early and not self._frames and len(self._tasks) <= 1 and not self._host_optimizers:
            return  # needed first by the next forward: kept for the next round (Note [The next step starts early])
        self._maybe_free(slot)

    # Note [A backward that raised leaves its task behind]
    # A parameter used by a backward is kept on the device until that backward's end (``bwd_tasks``, the
    # graph task's ``queue_callback``). A backward that raised never runs its callbacks: its task stayed in
    # ``_tasks`` and on its slots for good. Those copies were then never freed (device memory held until
    # ``remove()``), the step-end work of Note [The next step starts early] never ran again, and
    # ``host_updated`` skipped them -- so after an OffloadOptimizer step the next forward read the copy
    # fetched before the step: silently stale parameters (a tied embedding, used first and last, showed it;
    # tests/torch/test_abandoned_step_combinations.py). The handle is driven from one thread and a backward
    # runs to its end before the thread that called it goes on, so a task still recorded when that thread
    # is outside any backward and any module call (a top-level forward begins, ``host_updated``,
    # ``release``) belongs to a backward that raised: it is ended there, as if it had returned.
    def _forget_failed_backwards(self) -> None:
        """End the backward tasks that raised (Note [A backward that raised leaves its task behind])."""
        if self._frames or _graph_task_id() >= 0 or threading.current_thread() is not self._thread:
            return
        for task in list(self._tasks):
            self._backward_done(task)

    def _backward_done(self, task: int) -> None:
        self._tasks.discard(task)
        last = not self._tasks
        for slot in self._slots:
            slot.bwd_tasks.discard(task)
        if last:
            self._release_outside()
            if not self._frames and self._step is not None and not self._removed and not self._host_optimizers:
                # Note [The next step starts early]: its first copies of what is still on the device cost nothing.
                # In the mode of the step that ends: autograd runs this callback with grad disabled, and a
                # round begun in that mode would never be taken over by the next (grad-enabled) forward
                step = self._begin_step(time.perf_counter(), mode=self._step.mode)
                step.prestarted = True
        # what the next forward needs first stays, whether or not the new round's plan holds it yet (its
        # copy would otherwise be freed here and made again, exposed, at the forward: Note [The next step
        # starts early]); its first use frees it after the module, as any copy
        keep = self._early if last and self._step is not None and self._step.prestarted else frozenset()
        for slot in self._slots:
            if slot.index not in keep:
                self._maybe_free(slot)

    # Note [The next step starts early]
    # When a backward ends (outside any forward), the next step's round begins at once, in the
    # same mode: its first copies (the first modules' forward, or what an optimizer step reads
    # next) start under the optimizer step and data loading instead of at the next forward,
    # where they would be exposed. The next top-level forward takes this round over when its
    # mode (grad enabled, train/eval) matches and no forward used it yet; otherwise it ends it
    # (its copies are dropped) and begins its own. The step's clock starts at the end of
    # backward, so the learnt use times include the time between steps. Backward's last uses
    # are the next forward's first: the storages the next forward needs first (up to the
    # budget) are not freed when their gradients are accumulated, so the new round's first
    # copies find them on the device and cost nothing.

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After any optimizer's step (a global hook: it may run on another thread, e.g. a host optimizer
        on a worker). One that steps these parameters: write back what it fetched and changed, free it.
        Any other (a host optimizer whose step is uploaded into these parameters by its owner, as
        OffloadOptimizer does): only noted; the next release point writes back what was fetched."""
        if id(optimizer) in self._host_optimizers:
            return  # steps the host copies (Note [Parameters on the host with offload_parameters])
        ours = self._param_ids
        if any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
            if self._frames or threading.current_thread() is not self._thread:
                self._foreign_step = True
                return
            self._foreign_step = True
            self._release_outside()  # the next step's prefetches (already started) stay
        else:
            self._foreign_step = True

    def _release_outside(self) -> None:
        """Free what was fetched outside a module; after an optimizer step, write it all back first."""
        fetched = [s for s in self._slots if s.outside]
        if not fetched:
            self._foreign_step = False
            return
        if self._foreign_step:
            # an optimizer may have uploaded into the parameters on a copy stream (OffloadOptimizer),
            # and copies need not bump the version counter: wait for them, write every copy back
            self._foreign_step = False
            self.runtime.h2d_stream.synchronize()
            for slot in fetched:
                slot.dirty = True
        for slot in fetched:
            slot.outside = False
            self._maybe_free(slot)

    def _use_outside(self, slots: list[_Slot], *, escaped: bool) -> None:
        """An operator reads ``slots``: those no module call pins now are fetched and kept until released."""
        if self._removed:
            return
        fresh = [s for s in slots if not (s.outside or s.pins)]
        if fresh:
            task = _graph_task_id()
            fresh = [s for s in fresh if task < 0 or task not in s.bwd_tasks]
        if fresh:
            step = self._step
            for slot in fresh:
                if step is not None and not slot.resident:
                    if slot.unit is None:
                        slot.unit = _Unit(len(self._units), f"<outside {slot.name}>", [slot], slot.nbytes)
                        self._units.append(slot.unit)
                    self._use(slot.unit, "o")
                slot.outside = True
            self._counters["outside"] += len(fresh)
            self._copy_in(fresh)
        self._ready(slots, "outside")
        if escaped:
            for slot in slots:
                slot.dirty = True

    def _abort(self) -> None:
        """Forward raised at the top level: drop every pin, hold and prefetch of the step."""
        self._frames.clear()
        for slot in self._slots:
            slot.pins = 0
        self._end_step()
        for slot in self._slots:
            self._maybe_free(slot)
