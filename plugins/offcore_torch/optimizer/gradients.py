"""OffloadOptimizer's gradients: taken off the device, copied to the host, landed (mixin ``_Gradients``).

Moved from optimizer.py, whose module doc holds the Notes.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from offcore.errors import (
    CapacityExceededError,
    ConfigurationError,
    CopyFailedError,
    OffcoreError,
)
from offcore.inflight import must_wait
from offcore.kinds import Kind, Tier
from offcore.pool import HostBuffer
from offcore.residency import ActionKind
from offcore_torch.optimizer.slots import _check_dense_gradient, _Slot, _typed


class _Gradients:
    """OffloadOptimizer's gradient methods (see optimizer.py)."""

    # -- gradients ----------------------------------------------------------------------
    def _on_gradient(self, slot: _Slot) -> None:
        """A gradient of ``slot`` was accumulated on the device (main thread, inside backward)."""
        param = slot.param
        grad = param.grad
        if grad is None or self._closed:
            return
        self._send_gradient(slot, grad, clear=True)

    def accept_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> Any:
        """Take ``grad`` as ``param``'s gradient of this micro-step: start its D2H now (main thread).

        For gradients that are ready somewhere else than ``param.grad`` at accumulation time: a DDP
        communication hook hands over the *reduced* bucket (:func:`offcore_torch.distributed.attach_ddp`),
        FSDP2 the reduce-scattered shard. ``grad`` is not cleared or written; it is kept alive until its
        copy landed. Returns the copy's completion event (the caller orders later writes of ``grad``
        after it). Call :meth:`remove_gradient_hooks` first when ``param`` has the optimizer's hook.

            >>> opt.accept_gradient(param, reduced_grad)          # doctest: +SKIP
        """
        self._check_open("accept_gradient()")
        if self._closed:
            raise OffcoreError("OffloadOptimizer is closed")
        return self._send_gradient(self._slot(param), grad, clear=False)

    def remove_gradient_hooks(self) -> None:
        """Stop taking gradients from post-accumulate-grad hooks (they come through :meth:`accept_gradient`)."""
        self._frozen.clear()
        for slot in self._slots:
            slot.unhook()

    def wait_for_parameters(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Make the compute stream wait for the H2D copies of ``params`` (default: all); never blocks a GPU host.

        For parameters the forward pre-hook cannot see (FSDP2's sharded parameters are read by its
        all-gather, not by a module call).
        """
        slots = self._slots if params is None else [self._slot(p) for p in params]
        with self._sched_lock:
            for slot in slots:
                self._make_current(slot)

    def _send_gradient(self, slot: _Slot, grad: torch.Tensor, *, clear: bool) -> Any:
        """Start the D2H of ``grad`` as ``slot``'s gradient (``clear``: set ``param.grad`` to None); its event."""
        param = slot.param
        _check_dense_gradient(slot, grad)
        if slot.stepped:
            raise OffcoreError(
                f"OffloadOptimizer: parameter {slot.index} ({tuple(param.shape)}) got a gradient after its host step "
                "of this round ran; call opt.step() before the next backward, or raise accumulation_steps "
                "(Note [Host step rounds])"
            )
        if slot.accumulated and slot.hook is None and self._stepped_since_zero_grad:
            self._refuse_kept_gradient(slot)
        self._hook_backward_end()
        self._cap_in_flight(grad.numel() * grad.element_size())
        dev, rt = self._device, self._runtime
        produced = dev.new_event()
        dev.current_stream().record_event(produced)
        rt.d2h_stream.wait_event(produced)
        direct = not slot.accumulated and grad.dtype == slot.grad.dtype
        staging: HostBuffer | None = None
        nbytes = grad.numel() * grad.element_size()
        if direct:
            target = slot.grad
        else:
            staging = self._acquire_staging(nbytes)
            target = _typed(staging, grad.dtype, grad.shape)
            self.ledger.add(self._host_tier, Kind.GRADIENT, staging.nbytes)
        try:
            done = self._copy_retrying(target, grad, rt.d2h_stream, f"parameter {slot.index}'s gradient")
        except BaseException as exc:
            if staging is not None:
                self._release_staging(staging)
            self._lost = self._lost or str(exc)
            raise
        if clear:
            param.grad = None  # freed once the copy landed (the holder keeps it until then)
        holder = [grad]
        self.ledger.add(Tier.DEVICE, Kind.GRADIENT, nbytes)
        with self._sched_lock:
            rs = self._round()
            rs.produced(slot.index, time.perf_counter())
            gkey = next(self._grad_keys)
            rs.register(gkey, Kind.GRADIENT, nbytes)
            rs.offload_started(gkey, done, self._host_tier)
            rs.released(gkey)  # no device use follows: the copy goes as soon as it landed
        entry = (done, holder, nbytes, gkey, rs)
        with self._lock:
            self._in_flight.append(entry)
        accumulate = slot.accumulated
        slot.accumulated = True
        slot.arrivals += 1
        n = self._accumulation_steps
        run_step = self._last_micro or (n is not None and slot.arrivals == n)
        if run_step:
            slot.stepped = True
            self._check_fresh(slot)
        self._submit(self._landing(slot, staging, run_step), slot, done, entry, staging, target, accumulate, run_step)
        self._release_landed()
        return done

    def _cap_in_flight(self, nbytes: int) -> None:
        """Note [In-flight gradients are capped]: before holding ``nbytes`` more, wait for the oldest
        D2H copies while the held gradients and these would exceed the cap (main thread)."""
        cap = self._max_inflight
        assert cap is not None
        while must_wait(self.ledger.bytes(Tier.DEVICE, Kind.GRADIENT), nbytes, cap):  # offcore/inflight.py
            with self._lock:
                if not self._in_flight:
                    return  # nothing held (one gradient is always let through), or failed copies the worker retries
                done = self._in_flight[0][0]
            began = time.perf_counter()
            with contextlib.suppress(Exception):  # a failed copy completed too: the worker copies it again
                done.synchronize()
            if self.trace is not None:
                self.trace.span("wait", "gradient cap", began, time.perf_counter() - began)
            self._release_landed()
            with self._lock:
                if self._in_flight and self._in_flight[0][0] is done:
                    self._in_flight.popleft()  # failed: the worker's _land owns it now (Note [Failed copies ...])

    def _acquire_staging(self, nbytes: int) -> HostBuffer:
        while True:
            try:
                return self._pool.acquire(nbytes)
            except CapacityExceededError:
                with self._lock:
                    oldest = next((f for f in self._futures if not f.done()), None)
                if oldest is None:
                    return self._acquire(nbytes, "a gradient staging buffer")
                self._wait_task(oldest)  # the worker frees staging as it accumulates

    def _release_staging(self, staging: HostBuffer) -> None:
        self._pool.release(staging)
        self.ledger.remove(self._host_tier, Kind.GRADIENT, staging.nbytes)

    def _release_landed(self, *, wait: bool = False) -> None:
        """Drop the device gradients whose D2H copy landed (oldest first; the D2H stream is in order)."""
        while True:
            with self._lock:
                if not self._in_flight:
                    return
                entry = self._in_flight[0]
            done = entry[0]
            failed = False
            if not wait:
                try:
                    if not done.query():
                        return
                except Exception:
                    failed = True  # a failed copy is complete; its task reports the failure
            else:
                try:
                    done.synchronize()
                except Exception:
                    failed = True
            with self._lock:
                if not (self._in_flight and self._in_flight[0] is entry):
                    continue
                self._in_flight.popleft()
            if not failed:  # a failed copy is the worker's: it copies again, or frees it (_land)
                self._free_gradient(entry, failed=False)

    def _free_gradient(self, entry: tuple[Any, ...], *, failed: bool) -> None:
        """A gradient's D2H completed (or failed): the core frees its device copy, once."""
        _, holder, nbytes, gkey, rs = entry
        with self._sched_lock:
            if not holder:
                return
            if failed:
                rs.offload_failed(gkey)  # the device copy stays the data; the micro-step's gradient is lost
            else:
                action = rs.landed(gkey, needed=False)
                assert action.kind is ActionKind.FREE, action
            holder.clear()
        self.ledger.remove(Tier.DEVICE, Kind.GRADIENT, nbytes)

    # Note [Host work the worker does is declared to the sanitizer]
    # After backward returned, the worker may still sum a gradient into its host gradient (the staging
    # path) and run a host step (accumulation_steps, last_micro_step) writing the master: host work on
    # another thread, not a copy. A sanitizing backend (Capability.SANITIZER: ``host_writes``) is told
    # when it is queued and when it is done, so a program reading those tensors meanwhile (the optimizer's
    # param_groups' grads or params) is reported as for a copy in flight, not only racing.
    def _landing(self, slot: _Slot, staging: HostBuffer | None, run_step: bool) -> Callable[..., None]:
        """``_land``, its host writes declared to a sanitizing backend (Note above)."""
        writes = ([slot.grad] if staging is not None else []) + ([slot.master] if run_step else [])
        if self._host_writes is None or not writes:
            return self._land
        finish = self._host_writes(writes, what=f"OffloadOptimizer's worker landing parameter {slot.index}'s gradient")

        def land(*args: Any) -> None:
            try:
                self._land(*args)
            finally:
                finish()

        return land

    def _land(
        self,
        slot: _Slot,
        done: Any,
        entry: tuple[Any, ...] | None,
        staging: HostBuffer | None,
        target: torch.Tensor,
        accumulate: bool,
        run_step: bool,
    ) -> None:
        """Worker: wait for one gradient's D2H, accumulate it on the host, step if its round ended."""
        try:
            try:
                done.synchronize()
            except Exception as exc:
                # Note [Failed copies in the optimizer]: the device gradient is still held: copy it again
                grad = entry[1][0] if entry is not None and entry[1] else None
                try:
                    if grad is None or entry is None:
                        raise
                    again = self._copy_retrying(target, grad, self._runtime.d2h_stream, "", recover=True)
                    again.synchronize()
                    with self._sched_lock:  # the core sees the first copy fail and the second start
                        entry[4].offload_failed(entry[3])
                        entry[4].offload_started(entry[3], again, self._host_tier)
                    self._recovered(f"the D2H copy of parameter {slot.index}'s gradient", exc)
                except Exception:
                    if entry is not None:
                        self._free_gradient(entry, failed=True)
                    message = (
                        f"OffloadOptimizer: the D2H copy of parameter {slot.index}'s gradient failed ({exc}); "
                        "its gradient of this micro-step is lost: the step will not be applied; call "
                        "opt.zero_grad() and run the micro-steps again"
                    )
                    self._lost = self._lost or message
                    raise CopyFailedError(message) from exc
            if entry is not None:
                self._free_gradient(entry, failed=False)
            if staging is not None:
                began = time.perf_counter()
                if accumulate:
                    slot.grad.add_(target)
                else:
                    slot.grad.copy_(target)
                if self.trace is not None:
                    self.trace.span("host", "accumulate", began, time.perf_counter() - began, param=slot.index)
        finally:
            if staging is not None:
                self._release_staging(staging)
        slot.master.grad = slot.grad
        if run_step:
            self._step_groups([[slot]], entry[4] if entry is not None else self._rs)

    # Note [Device gradients are read on the host once per round]
    # With offload_gradients=False the gradients stay in ``param.grad`` (autograd sums the micro-steps
    # there) and reach the host in one batch of copies. Everything that reads the host gradients before
    # the step -- clip_grad_norm_ (plain and distributed), OffloadGradScaler.unscale_, host_grads() -- must
    # see them, and the step must then use what those readers left (clipped, unscaled), not copy the
    # unclipped device sum over it again. So the copies are made once per round, by the first of those
    # readers or step() (``gradients_to_host``), which records each device gradient's identity and
    # version (``_taken``). A backward after that and before step() changes a device gradient the host
    # no longer follows: step() refuses it with a ConfigurationError (``_check_taken``) rather than step
    # with a stale or unclipped gradient. After step() the record stays (host_grads() then reads what the
    # step used); a backward without opt.zero_grad() in between (torch sums into the same .grad) makes
    # the next reader copy the new device sum, as a new round. opt.zero_grad() forgets the record.
    def gradients_to_host(self) -> None:
        """Make this round's host gradients current: with ``offload_gradients=False`` the device gradients
        are copied to the host now (once per round; ``step()`` does it otherwise), and the copies in flight
        land either way. :func:`offcore_torch.clip_grad_norm_`, :class:`OffloadGradScaler` and
        :meth:`host_grads` call it; call it before reading the host gradients yourself (``run_on_host``).

            >>> opt.gradients_to_host(); norms = opt.run_on_host(lambda: [m.grad.norm() for m in masters])  # doctest: +SKIP
        """
        if not self._offload_gradients and (self._taken is None or (self._taken_stepped and self._grads_changed())):
            taken = self._device_grads()
            self._gradients_from_device()
            self._taken, self._taken_stepped = taken, False
        self._drain()
        self._sync_shown()

    def _device_grads(self) -> dict[int, tuple[weakref.ref[torch.Tensor], int] | None]:
        """Each parameter's device gradient (weakly: the record must not keep it alive) and its version."""
        grads = ((slot.index, slot.param.grad) for slot in self._slots)
        return {index: None if grad is None else (weakref.ref(grad), grad._version) for index, grad in grads}

    def _grads_changed(self) -> bool:
        """Whether a device gradient is another tensor, or was written, since the host copied it."""
        taken = self._taken or {}
        for slot in self._slots:
            grad, seen = slot.param.grad, taken.get(slot.index)
            if grad is None or seen is None:
                if grad is not seen:
                    return True
            elif seen[0]() is not grad or seen[1] != grad._version:
                return True
        return False

    def _check_taken(self) -> None:
        """step(), offload_gradients=False: no backward changed a device gradient after its host copy was read."""
        if self._taken is None or self._taken_stepped or not self._grads_changed():
            return
        raise ConfigurationError(
            "OffloadOptimizer.step(): a device gradient changed after the host gradients were read this round "
            "(clip_grad_norm_, OffloadGradScaler.unscale_ or host_grads(), with offload_gradients=False): a "
            "backward ran in between, and the host gradients no longer follow it. Read the host gradients after "
            "the last backward of the step, or call opt.zero_grad() and run the micro-steps again"
        )

    def _gradients_from_device(self) -> None:
        """``offload_gradients=False``: the device gradients come over now (host gradient = device sum)."""
        dev, rt = self._device, self._runtime
        produced = dev.new_event()
        dev.current_stream().record_event(produced)
        rt.d2h_stream.wait_event(produced)
        with self._sched_lock:
            rs = self._round()
        for slot in reversed(self._slots):  # produced last, needed first: the default is registration order
            grad = slot.param.grad
            if grad is None:
                continue
            _check_dense_gradient(slot, grad)
            with self._sched_lock:
                rs.produced(slot.index, time.perf_counter())
            staging = None
            if grad.dtype == slot.grad.dtype:
                target = slot.grad
            else:
                staging = self._acquire_staging(grad.numel() * grad.element_size())
                self.ledger.add(self._host_tier, Kind.GRADIENT, staging.nbytes)
                target = _typed(staging, grad.dtype, grad.shape)
            done = dev.copy_(target, grad, stream=rt.d2h_stream)
            slot.accumulated = True
            self._submit(self._land, slot, done, None, staging, target, False, False)  # p.grad keeps the source

    def _refuse_kept_gradient(self, slot: _Slot) -> None:
        # Note [Host gradients are cleared by opt.zero_grad()]
        # Parameters whose gradients come through ``accept_gradient`` without being shown as ``.grad``
        # (a caller's own hand-over; DDP and FSDP2 show them: Note [DDP's .grad is the host gradient],
        # Note [FSDP2's .grad is the host gradient] in distributed.py) show no host gradient (Note [The host gradient is the device
        # parameter's .grad]): the sum of their round lives on the host only, so ``model.zero_grad()``
        # or ``p.grad = None`` cannot clear it. A gradient arriving after ``step()`` with no
        # ``opt.zero_grad()`` since would be *added* to the sum the last step used: torch's behaviour for
        # a ``.grad`` nobody cleared, but what a loop clearing through the model gets without knowing it
        # (Trainer calls ``model.zero_grad()``). Which of the two it is cannot be told here, so it is
        # refused, before the gradient's copy starts, naming the fix -- never trained on silently.
        raise OffcoreError(
            f"OffloadOptimizer: parameter {slot.index} ({tuple(slot.param.shape)}) got a gradient after step() with "
            "no opt.zero_grad() since. Its gradients reach the optimizer through accept_gradient() without the "
            "parameter's .grad, so model.zero_grad() and p.grad = None cannot clear the host gradients: call "
            "opt.zero_grad() after opt.step() (a framework: use its integration, e.g. "
            "offcore_torch.integrations.transformers / .accelerate / .lightning)"
        )

    def _count_state(self) -> None:
        tensor = torch.Tensor
        total = 0
        for state in self.state.values():  # loops, not a generator in sum(): per parameter, per step
            for value in state.values():
                if isinstance(value, tensor):
                    total += value.nbytes
        if total != self._state_bytes:
            if total > self._state_bytes:
                self.ledger.add(Tier.PAGEABLE, Kind.OPTIMIZER_STATE, total - self._state_bytes)
            else:
                self.ledger.remove(Tier.PAGEABLE, Kind.OPTIMIZER_STATE, self._state_bytes - total)
            self._state_bytes = total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the host gradients (and any device gradients), as ``torch.optim.Optimizer.zero_grad``."""
        if self._due:
            with self._sched_lock:
                if self._rs is not None:
                    self._issue_due(self._rs)  # Note [Who issues step()'s uploads]
        with contextlib.suppress(CopyFailedError):  # reported already; zero_grad is how one starts over
            self._drain()
        self._lost = None
        self._stepped_since_zero_grad = False
        self._taken = None
        if set_to_none:  # the loop below for set_to_none=True, with nothing asked twice (per parameter, per step)
            for slot in self._slots:
                slot.clears += 1
                slot.shown = None
                slot.accumulated = False
                param, master = slot.param, slot.master
                if param.grad is not None:
                    param.grad = None
                if master.grad is not None:
                    master.grad = None
                if not slot.stepped:
                    slot.arrivals = 0
            return
        for slot in self._slots:
            grad = slot.param.grad
            if grad is not None:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()
            if slot.accumulated:
                slot.grad.zero_()
            if not slot.stepped:
                # the gradients counted so far are gone: accumulation_steps counts again from here, or the next
                # backward would step over fewer micro-steps than declared (a step abandoned midway, then retried)
                slot.arrivals = 0
