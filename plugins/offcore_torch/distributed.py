"""offcore under ``torch.distributed``: OffloadOptimizer with DDP and with FSDP2 (``fully_shard``).

offcore does not shard, reduce or replicate anything: the distributed engine does. What it
adds is where the *reduced* gradients go and where the optimizer runs.

- **DDP**: :func:`attach_ddp` registers a communication hook. Each bucket is all-reduced as
  DDP's own default does (divide by the world size, then sum); once the reduction is done the
  bucket's gradients go to the host through :meth:`OffloadOptimizer.accept_gradient` — never
  the raw local gradient (a post-accumulate-grad hook fires *before* DDP reduces).
- **FSDP2**: :class:`FSDPOffloadOptimizer` runs the host optimizer over each rank's local
  shard (``DTensor.to_local()``). FSDP2 calls the sharded parameters' post-accumulate-grad
  hooks after its reduce-scatter, with the reduced shard as ``grad``: that shard goes to the
  host. ``state_dict()`` is keyed by parameter name with DTensor values, so
  ``torch.distributed.checkpoint`` saves and loads it sharded.
- :func:`clip_grad_norm_`: the global norm over sharded host gradients (per-parameter norms
  combined with one all-reduce, as torch does with DTensor gradients), or over DDP's replicated ones.

    >>> import torch, offcore, offcore_torch                                   # doctest: +SKIP
    >>> from offcore_torch.distributed import FSDPOffloadOptimizer              # doctest: +SKIP
    >>> model = fully_shard(model, mesh=init_device_mesh("cuda", (world,)))    # doctest: +SKIP
    >>> opt = FSDPOffloadOptimizer(model, torch.optim.AdamW, device=dev, lr=1e-3)  # doctest: +SKIP
    >>> loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()    # doctest: +SKIP

# Note [Reduced gradients go to the host]
# Under DDP a parameter's post-accumulate-grad hook sees the local, unreduced gradient; DDP
# reduces buckets later and writes the result back. So attach_ddp removes the optimizer's
# hooks and hands over each bucket from DDP's communication hook, once its all-reduce is done:
# at the next bucket's hook (the host asks the future, ``done()``; ``wait()`` then orders the
# current stream after the collective on hardware) and, for the rest, in an autograd callback
# at the end of backward (queued before DDP's own finalize). A second callback, queued from the
# first and so run after DDP's finalize wrote the reduced values into ``param.grad``, waits until
# every handed gradient landed on the host and shows it as ``param.grad`` (Note [DDP's .grad is the
# host gradient]). The bucket is rewritten by the next backward: the compute stream waits for
# the last D2H before the DDP module's next forward. Under FSDP2 the sharded
# parameter's hooks run after the reduce-scatter (and only when gradients are synchronized:
# ``set_requires_gradient_sync(False)`` accumulates unsharded on the device, then one reduced
# shard arrives), on whatever stream FSDP2 made current: OffloadOptimizer records its events
# on ``device.current_stream()`` read at that moment, never a stream captured earlier.
#
# Note [DDP's .grad is the host gradient]
# torch's contracts hold under DDP as without it (Note [The host gradient is the device parameter's
# .grad] in optimizer/optimizer.py): when backward returns, each parameter DDP reduced has the
# optimizer's ``_HostGradient`` as ``.grad``, whose values are the reduced gradient on the host, so
# ``clip_grad_norm_(ddp.parameters())`` clips what ``step()`` uses and ``model.zero_grad()`` clears it.
# Plain DDP *adds* a local gradient into a ``.grad`` nobody cleared and then reduces the sum
# (``no_sync`` micro-steps, or a backward reduced on top of the last one): reduce(g + l), not
# g + reduce(l), which differ in their last bits. So a tensor hook on each parameter
# (``_before_accumulation``, run before autograd accumulates into ``.grad``) looks at what the
# previous backward showed: the shown gradient still there (not cleared, or zeroed through it) is
# copied back to the device as a plain ``.grad`` for autograd to add into and DDP to reduce, and the
# host gradient starts over (the reduced sum arrives as its first gradient); None (cleared) or a
# tensor of the user's clears the host gradient (autograd adds into the user's tensor on the device).
# The copy back costs one H2D of the gradient, only for a backward into a gradient not cleared.
# ``step()`` sees ``model.zero_grad()`` / ``p.grad = t`` made after backward as without DDP
# (``_sync_shown``). The hook also runs for ``torch.autograd.grad(..., inputs=params)``, which writes no
# ``.grad``: it asks the engine whether the parameter's AccumulateGrad node runs, and does nothing
# when not. A ``step()`` while a ``.grad`` holds a local gradient autograd accumulated after the last show
# (every micro-step under ``no_sync()``) is refused by a step pre-hook: the host has no reduced gradient
# for it and would skip it, where plain DDP steps the unreduced local sum. ``DDPHandoff.close()`` removes
# the tensor hooks and the step pre-hook.
#
# Note [FSDP2's .grad is the host gradient]
# The contracts of Note [DDP's .grad is the host gradient] hold under FSDP2: FSDPOffloadOptimizer hands each reduced
# shard to the host from the sharded parameter's post-accumulate-grad hook (``_on_gradient``) and drops the device
# ``.grad``; an autograd callback queued at the first hand-over of a backward (so after FSDP2's final callback,
# queued when backward began, which reduce-scatters the root's gradients) waits until every shard landed and sets
# each parameter's ``.grad`` to a DTensor over a ``_HostGradient`` with the parameter's spec (``_show_gradients``). The
# shard's own ``.grad`` (the plain local tensor the OffloadOptimizer holds) is the same ``_HostGradient``, shown to
# the optimizer (``slot.shown``), so its ``_sync_shown`` sees clears. torch's ``clip_grad_norm_`` over DTensor
# gradients runs ``_foreach_norm`` on the local tensors (on the host, through the wrapper), all-reduces the partial
# norms as FSDP2 does, and scales with an in-place ``_foreach_mul_`` (the host gradients). A ``model.zero_grad()`` /
# ``p.grad = t`` since the show reaches the shard's ``.grad`` before anything reads the host gradients (``_follow``:
# a step pre-hook of the OffloadOptimizer, ``clip_grad_norm_``, ``zero_grad``). Plain FSDP2 adds a reduced shard
# into a ``.grad`` nobody cleared (``_local_tensor += shard`` in its foreach_reduce); adding into the wrapper would
# run on the host, on the main thread, outside the optimizer's accounting, so the root's forward pre-hook
# (``_release_shown``) makes a shown ``.grad`` still there a device copy of the host gradient, as if the user had
# set it: a ``step()`` or clipping before any backward (an evaluation forward) copies it back (``_sync_shown``),
# and at the next hand-over the host gradient starts over (``_on_gradient``: the optimizer still shows an old
# one, or the shard's ``.grad`` is set) and the reduced shard FSDP2 added into the copy arrives as its first
# gradient. A cleared ``.grad`` restarts it the same way. (A second backward with no forward since,
# ``retain_graph=True``, does add through the wrapper: the host holds the sum, as plain FSDP2's ``.grad`` does.)
# ``close()`` drops what it showed.
#
# Note [Parameters DDP found unused]
# With ``find_unused_parameters=True`` DDP reduces a parameter that took no part in a rank's forward
# too (its bucket slice zeroed, or filled from a ``.grad`` not cleared), and at its finalize leaves the
# ``.grad`` of a parameter *no* rank used as it was (None, or the last one), where it sets the others'
# to the reduced gradient. Which of the two it is is known only after that finalize (the ranks' use
# is all-reduced at the end of backward), so such a parameter -- no device ``.grad`` at its bucket's
# hand-over, or its tensor hook did not run since the last show -- is not handed over from the bucket
# but after DDP's finalize (``_show_gradients``), from what DDP left in ``.grad``: None: nothing (the
# optimizer skips it, as torch's does); the shown gradient, untouched: the host gradient stays as it
# is (with ``gradient_as_bucket_view=False`` DDP copies the reduced values into ``.grad``, and so into
# the host gradient through the wrapper); another tensor (DDP's bucket view, or the user's): the host
# gradient starts over from it. (Handing over the zeroed slice stepped a parameter no rank used.)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from offcore.errors import ConfigurationError, OffcoreError
from offcore_torch.optimizer.clip import clip_grad_norm_ as _clip_replicated
from offcore_torch.optimizer.optimizer import OffloadOptimizer, _HostGradient
from offcore_torch.optimizer.slots import MASTER_WEIGHTS_KEY, _accumulates, _grad_accumulator, _unhooked_step

__all__ = ["DDPHandoff", "FSDPOffloadOptimizer", "attach_ddp", "clip_grad_norm_"]


# ----------------------------------------------------------------------------- DDP


def _wait_before_state_dict(ref: weakref.ref[OffloadOptimizer]) -> Any:
    """A state-dict pre-hook: the parameters' H2D copies from the last step land before anyone reads them.

    Note [Checkpoints read landed parameters]: ``opt.step()`` returns with the updated parameters still
    on the H2D stream; a forward waits for them, but ``model.state_dict()`` handed to
    ``torch.distributed.checkpoint.save`` is read directly (on the fake device with the sanitizer, a
    save right after ``step()`` wrote NaN into the checkpoint). So the model's state dict orders the
    current stream after them first.
    """

    def hook(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        optimizer = ref()
        if optimizer is not None and not optimizer._closed:
            optimizer.wait_for_parameters()

    return hook


class DDPHandoff:
    """The link between a DDP module and an :class:`OffloadOptimizer` made by :func:`attach_ddp`: the module's
    forward and state-dict pre-hooks, a tensor hook per parameter and the communication hook's state.

    ``buckets_handed`` counts reduced buckets given to the optimizer (tests read it).
    """

    def __init__(self, model: torch.nn.Module, optimizer: OffloadOptimizer, process_group: Any) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.process_group = process_group
        self._members: set[int] = set()
        self._tensor_hooks: list[Any] = []
        # id(param) -> its AccumulateGrad node, held here and not in the hook (which the parameter holds: the node
        # holds the parameter, a cycle through C++ that the garbage collector cannot see)
        self._accumulators: dict[int, Any] = {}
        self._params: list[torch.Tensor] = []  # the parameters with a tensor hook
        for param in model.parameters():
            try:
                optimizer.master(param)
            except ConfigurationError:
                continue
            self._members.add(id(param))
            if param.requires_grad:  # Note [DDP's .grad is the host gradient]
                self._accumulators[id(param)] = _grad_accumulator(param)
                self._params.append(param)
                self._tensor_hooks.append(param.register_hook(_before_accumulation(weakref.ref(self), param)))
        if not self._members:
            raise ConfigurationError("attach_ddp: none of the DDP module's parameters belongs to the OffloadOptimizer")
        # (future, [(param, offset, numel, shape)]) of buckets reduced but not handed over yet
        self._pending: list[tuple[torch.futures.Future[Any], list[tuple[torch.Tensor, int, int, torch.Size]]]] = []
        self._callback_queued = False
        self._last_copy: Any = None
        self._handed: list[torch.Tensor] = []
        self._unused: list[torch.Tensor] = []  # reduced without a local gradient (Note [Parameters DDP found unused])
        self.buckets_handed = 0
        self._forward_handle = model.register_forward_pre_hook(self._before_forward)
        self._state_dict_handle = model.register_state_dict_pre_hook(_wait_before_state_dict(self._optimizer))
        self._step_handle = optimizer.register_step_pre_hook(_unreduced_before_step(weakref.ref(self)))

    # the communication hook (main thread, inside backward)
    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        layout = []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if id(param) in self._members:
                layout.append((param, grad.storage_offset() - buffer.storage_offset(), grad.numel(), grad.shape))
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        buffer.div_(group.size())  # DDP's default: divide first, then sum (torch's allreduce_hook)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
        self._hand_over(block=False)
        self._pending.append((future, layout))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return future

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._hand_over(block=True)
        # runs after DDP's finalize (queued after it), which writes the reduced buckets into param.grad
        torch.autograd.Variable._execution_engine.queue_callback(self._show_gradients)

    def _show_gradients(self) -> None:
        """The host holds this backward's reduced gradients: once they landed, each parameter's ``.grad`` shows
        its host gradient instead of DDP's bucket (never written: a D2H may still read it), Note [DDP's .grad is
        the host gradient]."""
        handed, self._handed = self._handed, []
        unused, self._unused = self._unused, []
        optimizer = self._optimizer()
        if optimizer is None or optimizer._closed:
            for param in handed:
                param.grad = None
            return
        for param in unused:  # Note [Parameters DDP found unused]
            slot = optimizer._slot(param)
            grad, shown = param.grad, slot.shown
            if shown is not None and grad is shown:
                continue  # left as it was (no rank used it), or DDP copied the reduced values into it: both shown
            slot.shown = None
            if shown is not None:  # cleared, or replaced (by DDP's bucket view, or a tensor of the user's)
                optimizer._clear_host_gradient(slot)
            if grad is not None:  # another rank used it: DDP's reduced gradient (or the user's tensor DDP left)
                self._last_copy = optimizer.accept_gradient(param, grad)
                handed.append(param)
        optimizer._settle_worker()  # every D2H landed and summed: .grad is final when backward returns
        for param in handed:
            slot = optimizer._slot(param)
            if slot.master.grad is None:  # lost (a failed copy): step() refuses the round
                param.grad = slot.shown = None
            else:
                param.grad = slot.shown = optimizer._show(slot)

    def _hand_over(self, *, block: bool) -> None:
        optimizer = self._optimizer()
        while self._pending:
            future, layout = self._pending[0]
            if not block and not future.done():
                return
            self._pending.pop(0)
            reduced = future.wait()  # done: on hardware this orders the current stream after the collective
            if optimizer is None:
                continue
            flat = reduced.view(-1)
            for param, offset, numel, shape in layout:
                if param.grad is None or optimizer._slot(param).shown is not None:
                    # no local gradient in this backward (find_unused_parameters=True): DDP's finalize decides
                    self._unused.append(param)
                    continue
                self._last_copy = optimizer.accept_gradient(param, flat.narrow(0, offset, numel).view(shape))
                self._handed.append(param)
            self.buckets_handed += 1

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        # a backward that raised midway left its buckets and its end-of-backward flag: they belong to
        # a step that did not happen, so they are dropped, never handed to the next step
        self._pending.clear()
        self._handed.clear()
        self._unused.clear()
        self._callback_queued = False
        last, self._last_copy = self._last_copy, None
        optimizer = self._optimizer()
        if last is not None and optimizer is not None:
            optimizer._device.current_stream().wait_event(last)  # the next backward rewrites the buckets

    def close(self) -> None:
        """Remove the module and tensor hooks (DDP cannot unregister a communication hook: keep the module or
        rebuild it)."""
        self._forward_handle.remove()
        self._state_dict_handle.remove()
        self._step_handle.remove()
        for handle in self._tensor_hooks:
            handle.remove()
        self._tensor_hooks.clear()
        self._accumulators.clear()


def _unreduced_before_step(ref: weakref.ref[DDPHandoff]) -> Any:
    """A step pre-hook: refuse a ``step()`` while a parameter's ``.grad`` holds a local gradient DDP never reduced
    (accumulated by autograd after the last show: a backward under ``no_sync()`` with no synchronizing one after
    it). The host has no gradient for it (the copy back cleared it), so the step would skip it silently, where plain
    DDP steps the unreduced local sum (and the replicas drift apart)."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        handoff = ref()
        if handoff is None or optimizer._closed:
            return
        for param in handoff._params:
            grad = param.grad
            if grad is None or isinstance(grad, _HostGradient) or optimizer._slot(param).shown is not None:
                continue  # cleared, shown, or a tensor the user set after the show (step() takes it)
            raise OffcoreError(
                f"OffloadOptimizer.step() under DDP: a parameter ({tuple(param.shape)}) has a local gradient that DDP "
                "did not reduce (the last backward ran under model.no_sync()), so no reduced gradient reached the "
                "optimizer for it. Run the last micro-step's backward outside no_sync() before step() (or clear "
                ".grad to drop the micro-steps)"
            )

    return hook


def _before_accumulation(ref: weakref.ref[DDPHandoff], param: torch.Tensor) -> Any:
    """A tensor hook of a DDP parameter: before autograd accumulates a local gradient into ``param.grad``, what the
    last backward showed there becomes a device ``.grad`` again or is cleared (Note [DDP's .grad is the host
    gradient])."""
    weak_param = weakref.ref(param)

    def hook(grad: torch.Tensor) -> None:
        handoff, target = ref(), weak_param()
        if handoff is None or target is None:
            return
        optimizer = handoff._optimizer()
        if optimizer is None or optimizer._closed or not _accumulates(handoff._accumulators[id(target)]):
            return
        slot = optimizer._slot(target)
        shown, slot.shown = slot.shown, None
        if shown is None:  # nothing shown since the last clear: autograd and DDP take it as plain DDP does
            return
        if target.grad is shown:  # not cleared: plain DDP adds into it on the device, then reduces the sum
            with torch.no_grad():
                device_grad = torch.empty_like(target)
                device_grad.copy_(shown.host())
            arrivals = slot.arrivals  # the sum is carried on: accumulation_steps counts on
            optimizer._clear_host_gradient(slot)
            slot.arrivals = arrivals
            target.grad = device_grad
        else:  # cleared (None), or a tensor of the user's that autograd adds into
            optimizer._clear_host_gradient(slot)

    return hook


def attach_ddp(
    model: torch.nn.parallel.DistributedDataParallel, optimizer: OffloadOptimizer, *, process_group: Any = None
) -> DDPHandoff:
    """Send DDP's *reduced* gradients to ``optimizer`` (Note [Reduced gradients go to the host]).

    Build ``optimizer`` over ``model.parameters()`` after wrapping with DDP, then attach once, before the
    first backward. The all-reduce is DDP's default (mean over ``process_group``, DDP's own by default);
    ``model.no_sync()`` accumulates on the device as usual and the reduced sum arrives at the synchronizing
    backward. DDP keeps its gradient buckets on the device (``gradient_as_bucket_view=True`` avoids a second
    copy in ``param.grad``); what leaves the device is the optimizer state and step. When backward returns,
    each parameter's ``.grad`` shows its reduced gradient on the host (Note [DDP's .grad is the host gradient]):
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` clips what ``step()`` uses, and
    ``model.zero_grad()`` clears it, with plain DDP's numbers.

        >>> ddp = DistributedDataParallel(dev.adopt(model), gradient_as_bucket_view=True)   # doctest: +SKIP
        >>> opt = OffloadOptimizer(ddp.parameters(), torch.optim.AdamW, device=dev, lr=1e-3) # doctest: +SKIP
        >>> attach_ddp(ddp, opt)                                                            # doctest: +SKIP
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigurationError(f"attach_ddp takes a DistributedDataParallel module, got {type(model).__name__}")
    if not isinstance(optimizer, OffloadOptimizer):
        raise ConfigurationError(f"attach_ddp takes an OffloadOptimizer, got {type(optimizer).__name__}")
    optimizer.remove_gradient_hooks()
    handoff = DDPHandoff(model, optimizer, process_group if process_group is not None else model.process_group)
    model.register_comm_hook(None, lambda _state, bucket: handoff.hook(bucket))
    return handoff


# ----------------------------------------------------------------------------- FSDP2


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class FSDPOffloadOptimizer:
    """:class:`OffloadOptimizer` over the local shards of a ``fully_shard`` model (one per rank).

    Each rank's host optimizer steps its own shard; gradients arrive already reduce-scattered
    (Note [Reduced gradients go to the host]); updated shards go back on the H2D stream and the
    root module's next forward waits for them before FSDP2 all-gathers. ``state_dict()`` is keyed
    by parameter name with DTensor values (torch.distributed.checkpoint saves it sharded and loads it
    back in place); ``load_state_dict`` takes it back. Other keyword arguments go to
    :class:`OffloadOptimizer` (``accumulation_steps``, ``master_weights``, ...) and the optimizer.
    LR schedulers take ``opt.optimizer`` (the :class:`OffloadOptimizer`; the parameter groups are shared).

        >>> opt = FSDPOffloadOptimizer(model, torch.optim.AdamW, device=dev, lr=1e-3)  # doctest: +SKIP
        >>> dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)                # doctest: +SKIP
    """

    def __init__(
        self, model: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer], *, device: Any, **kwargs: Any
    ) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        plain = [name for name, p in named if not _is_dtensor(p)]
        if plain:
            raise ConfigurationError(
                f"FSDPOffloadOptimizer: parameters {plain[:5]} are not sharded (not DTensors); apply fully_shard to "
                "the model (and its blocks) before building the optimizer"
            )
        if not named:
            raise ConfigurationError("FSDPOffloadOptimizer: the model has no parameters that require grad")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        # the local shards, as plain tensors sharing storage and version counter with FSDP2's shard
        self.shards = [p.to_local().detach() for p in self.params]
        self._storage = [_storage_ptr(s) for s in self.shards]
        self.optimizer = OffloadOptimizer(self.shards, optimizer_class, device=device, **kwargs)
        self._device = device
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_shard_hook(ref, i)) for i, p in enumerate(self.params)]
        self._forward_handle = model.register_forward_pre_hook(_root_pre_forward(ref), prepend=True)
        self._state_dict_handle = model.register_state_dict_pre_hook(
            _wait_before_state_dict(weakref.ref(self.optimizer))
        )
        # Note [FSDP2's .grad is the host gradient]: the DTensor each parameter shows as .grad (None: none shown)
        self._shown: list[Any] = [None] * len(self.params)
        self._copied: list[Any] = [None] * len(self.params)  # the device copy a shown .grad became at a forward
        self._handed: list[int] = []  # the parameters handed over in this backward, shown at its end
        self._show_task = -1  # the autograd graph task whose end shows them
        self._step_handle = self.optimizer.register_step_pre_hook(_follow_before_step(ref))
        self._closed = False

    # -- gradients and waits ------------------------------------------------------------
    def _on_gradient(self, index: int) -> None:
        param = self.params[index]
        grad = param.grad
        if grad is None:
            return
        shown = self._shown[index]
        if shown is not None and grad is shown:
            # a second backward with no forward since (retain_graph=True): FSDP2 added its reduced shard into the
            # shown .grad in place, i.e. into the host gradient through the wrapper: the host holds the sum
            return
        shard, optimizer = self.shards[index], self.optimizer
        slot = optimizer._slot(shard)
        if shown is not None or shard.grad is not None or slot.shown is not None:
            # the host gradient is not this .grad's (a device copy made at the forward, cleared, or replaced): it
            # starts over, and the reduced shard (FSDP2 added it into a .grad not cleared) arrives as its first
            self._shown[index] = None
            optimizer._settle_worker()
            arrivals = slot.arrivals
            optimizer._clear_host_gradient(slot)
            if grad is self._copied[index]:  # the sum is carried on: accumulation_steps counts on
                slot.arrivals = arrivals
            shard.grad = slot.shown = None
        self._copied[index] = None
        self.optimizer.accept_gradient(self.shards[index], grad.to_local())
        param.grad = None  # the host has it; the shard is freed once its copy landed; shown when backward ends
        self._handed.append(index)
        task = torch._C._current_graph_task_id()
        if task == -1:
            self._show_gradients()
        elif task != self._show_task:
            self._show_task = task
            # queued after FSDP2's final callback (queued when backward began, it reduce-scatters the root's
            # gradients) and after the optimizer's own, which waits for every copy: runs last
            torch.autograd.Variable._execution_engine.queue_callback(_show_callback(weakref.ref(self)))

    def _show_gradients(self) -> None:
        """Every handed shard landed on the host: each parameter's ``.grad`` shows it (Note [FSDP2's .grad is the
        host gradient])."""
        self._show_task = -1
        handed, self._handed = self._handed, []
        if self._closed:
            return
        optimizer = self.optimizer
        optimizer._settle_worker()  # every D2H landed and summed: .grad is final when backward returns
        for index in dict.fromkeys(handed):
            param, shard = self.params[index], self.shards[index]
            slot = optimizer._slot(shard)
            if slot.master.grad is None or param.grad is not None:  # lost (step() refuses), or set by someone else
                continue
            shard.grad = slot.shown = optimizer._show(slot)  # the optimizer follows a clear of it (_sync_shown)
            self._wrap(index)

    def _wrap(self, index: int) -> None:
        """Show the shard's ``.grad`` (the optimizer's ``_HostGradient``) as the parameter's, a DTensor over it."""
        param = self.params[index]
        param.grad = self._shown[index] = _sharded_grad(param, self.shards[index].grad)

    def _follow(self) -> None:
        """A shown ``.grad`` cleared or replaced since (``model.zero_grad()``, ``p.grad = t``): the shard's ``.grad``
        follows, and the optimizer with it (``_sync_shown``: cleared, or ``t`` copied to the host and shown instead,
        as without distribution)."""
        changed = self._mirror()
        if not changed:
            return
        optimizer = self.optimizer
        optimizer._settle_worker()
        optimizer._sync_shown()
        for index in changed:
            shard = self.shards[index]
            if shard.grad is not None and shard.grad is optimizer._slot(shard).shown:
                self._wrap(index)

    def _before_forward(self) -> None:
        for index, param in enumerate(self.params):
            if _storage_ptr(param.to_local()) != self._storage[index]:
                raise OffcoreError(
                    f"FSDPOffloadOptimizer: the local shard of {self.names[index]} moved to new storage (the model was "
                    "re-sharded or loaded with assign=True after the optimizer was built); build the optimizer after "
                    "loading, or load in place"
                )
        # FSDP2's all-gather reads the shards: the compute stream waits for their H2D copies first
        self.optimizer.wait_for_parameters()
        self._release_shown()

    def _mirror(self) -> list[int]:
        """Each shown ``.grad`` cleared or replaced since the show: the shard's ``.grad`` the same (None, or the new
        tensor's local tensor), for the optimizer's ``_sync_shown`` to follow when it next reads the host gradients
        (``step()``, clipping); the indices of those parameters."""
        changed = []
        for index, param in enumerate(self.params):
            shown = self._shown[index]
            if shown is None or param.grad is shown:
                continue
            self._shown[index] = None
            grad = param.grad
            self.shards[index].grad = None if grad is None else (grad.to_local() if _is_dtensor(grad) else grad)
            changed.append(index)
        return changed

    def _release_shown(self) -> None:
        """Before the next backward: FSDP2 adds a reduced shard into a ``.grad`` not cleared, in place (into the
        host gradient, through the wrapper): a shown ``.grad`` becomes a device copy of its host gradient for it
        to add into, as if the user had set it (a ``step()`` before any backward copies it back to the host)."""
        for index, param in enumerate(self.params):
            shown = self._shown[index]
            if shown is not None and param.grad is shown:
                try:
                    host = shown.to_local().host()
                except OffcoreError:  # cleared since through the inner optimizer (opt.optimizer.zero_grad())
                    param.grad = None
                    continue
                with torch.no_grad():
                    local = torch.empty_like(self.shards[index])
                    local.copy_(host)
                param.grad = self._copied[index] = _sharded_grad(param, local)
        self._mirror()

    # -- the optimizer's surface ----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:
        """The host step of every local shard (:meth:`OffloadOptimizer.step`)."""
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the host gradients and the parameters' ``.grad`` (``set_to_none=False``: zero the shown ones)."""
        self._follow()  # a .grad of the user's is the shard's .grad now: zeroed with the host gradients
        self.optimizer.zero_grad(set_to_none)
        if set_to_none:
            for index, param in enumerate(self.params):
                param.grad = self._shown[index] = None

    def last_micro_step(self) -> Any:
        return self.optimizer.last_micro_step()

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The host master of sharded parameter ``param`` (this rank's shard)."""
        for index, each in enumerate(self.params):
            if each is param:
                return self.optimizer.master(self.shards[index])
        raise ConfigurationError("this tensor is not a parameter of the FSDPOffloadOptimizer")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, group: Any = None) -> torch.Tensor:
        """Clip the sharded host gradients to a global norm (:func:`clip_grad_norm_`)."""
        self._follow()
        return _clip_sharded(self.optimizer, max_norm, norm_type, group=group, device=self._device)

    # -- state dicts (torch.distributed.checkpoint) ---------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"state": {name: {key: DTensor | tensor}}, "param_groups": [...]}``, keyed by parameter name.

        Per-parameter tensors shaped like the shard become DTensors with the parameter's mesh and
        placements (saved sharded); scalars (``step``) stay plain (the same on every rank). Before the
        first step the state is built by a zero-learning-rate step on copies and then dropped, as
        ``torch.distributed.checkpoint.state_dict`` does, so a fresh optimizer has a template to load into.
        """
        from torch.distributed.tensor import DTensor

        local = self.optimizer.state_dict()
        if len(local["state"]) < len(self.shards):
            local = self._template()
        out_state: dict[str, Any] = {}
        for index, values in local["state"].items():
            param, shard = self.params[int(index)], self.shards[int(index)]
            out_state[self.names[int(index)]] = {
                key: _as_dtensor(value, param, shard, DTensor) for key, value in values.items()
            }
        groups = [{**g, "params": [self.names[int(i)] for i in g["params"]]} for g in local["param_groups"]]
        out: dict[str, Any] = {"state": out_state, "param_groups": groups}
        masters = local.get(MASTER_WEIGHTS_KEY)
        if masters:
            out[MASTER_WEIGHTS_KEY] = {
                self.names[int(i)]: _as_dtensor(m, self.params[int(i)], self.shards[int(i)], DTensor)
                for i, m in masters.items()
            }
        return out

    def _template(self) -> dict[str, Any]:
        """The state dict with every parameter's state: the missing ones made by a zero-lr step on copies."""
        host = self.optimizer.host_optimizer
        masters = [m for g in host.param_groups for m in g["params"]]

        def build() -> dict[int, dict[str, Any]]:
            missing = [m for m in masters if m not in host.state]  # only these step: the others' state is kept
            chosen = {id(m) for m in missing}
            saved = [(m, m.detach().clone(), m.grad) for m in missing]
            groups = [(g, g["params"], g["lr"]) for g in host.param_groups]
            try:
                for m in missing:
                    m.grad = torch.zeros_like(m)
                for g, params, lr in groups:
                    g["params"] = [m for m in params if id(m) in chosen]
                    g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
                _unhooked_step(host)  # a state set-up, not a training step: no step hooks
                return {
                    i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in host.state[m].items()}
                    for i, m in enumerate(masters)
                    if id(m) in chosen
                }
            finally:
                for g, params, lr in groups:
                    g["params"], g["lr"] = params, lr
                with torch.no_grad():
                    for m, value, grad in saved:
                        m.copy_(value)
                        m.grad = grad
                        host.state.pop(m, None)

        made = self.optimizer.run_on_host(build)
        template = self.optimizer.state_dict()
        template["state"] = {**template["state"], **made}
        return template

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (after ``torch.distributed.checkpoint.load`` filled it in place)."""
        index_of = {name: i for i, name in enumerate(self.names)}
        unknown = [n for n in state_dict.get("state", {}) if n not in index_of]
        if unknown:
            raise ConfigurationError(f"FSDPOffloadOptimizer.load_state_dict: unknown parameter names {unknown[:5]}")
        local: dict[str, Any] = {
            "state": {
                index_of[name]: {k: _local(v) for k, v in values.items()}
                for name, values in state_dict.get("state", {}).items()
            },
            "param_groups": [
                {**g, "params": [index_of[n] for n in g["params"]]} for g in state_dict.get("param_groups", [])
            ],
        }
        masters = state_dict.get(MASTER_WEIGHTS_KEY)
        if masters:
            local[MASTER_WEIGHTS_KEY] = {index_of[n]: _local(m) for n, m in masters.items()}
        self.optimizer.load_state_dict(local)

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks and close the :class:`OffloadOptimizer` (host memory goes back)."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._forward_handle.remove()
        self._state_dict_handle.remove()
        self._step_handle.remove()
        for index, param in enumerate(self.params):
            if self._shown[index] is not None and param.grad is self._shown[index]:
                param.grad = None  # its host gradient goes with the optimizer
            self._shown[index] = self._copied[index] = self.shards[index].grad = None
        self.optimizer.close()

    def __enter__(self) -> FSDPOffloadOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sharded_grad(param: Any, local: torch.Tensor) -> Any:
    """A gradient of sharded parameter ``param`` over its local shard ``local``: a DTensor with the parameter's spec
    (mesh, placements, global shape and stride), made as FSDP2 makes its gradients (``DTensor(local, spec)``: no
    autograd, no view of ``local``), or with ``DTensor.from_local`` when the parameter has no spec."""
    from torch.distributed.tensor import DTensor

    spec = getattr(param, "_spec", None)
    if spec is not None and spec.shape == param.shape:
        return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.numel() else 0


def _as_dtensor(value: Any, param: Any, shard: torch.Tensor, dtensor: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape:
        return dtensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


def _local(value: Any) -> Any:
    return value.to_local() if _is_dtensor(value) else value


def _shard_hook(ref: weakref.ref[FSDPOffloadOptimizer], index: int) -> Any:
    def hook(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None and not owner._closed:
            owner._on_gradient(index)

    return hook


def _show_callback(ref: weakref.ref[FSDPOffloadOptimizer]) -> Any:
    def callback() -> None:
        owner = ref()
        if owner is not None:
            owner._show_gradients()

    return callback


def _follow_before_step(ref: weakref.ref[FSDPOffloadOptimizer]) -> Any:
    """A step pre-hook of the inner optimizer: ``step()`` sees the ``.grad`` cleared or replaced since the show."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None and not owner._closed:
            owner._follow()

    return hook


def _root_pre_forward(ref: weakref.ref[FSDPOffloadOptimizer]) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:
        owner = ref()
        if owner is not None and not owner._closed:
            owner._before_forward()

    return hook


# ----------------------------------------------------------------------------- clipping


def _clip_sharded(
    optimizer: OffloadOptimizer, max_norm: float, norm_type: float, *, group: Any, device: Any
) -> torch.Tensor:
    if optimizer.stepped_any:
        raise ConfigurationError(
            "clip_grad_norm_ needs every gradient before any host step, but host steps of this round already ran "
            "under backward (accumulation_steps= / last_micro_step()); build the optimizer with accumulation_steps=None"
        )
    norm_type = float(norm_type)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    optimizer.gradients_to_host()  # offload_gradients=False: the device gradients come over first

    def local_norms() -> torch.Tensor:
        # one norm per parameter (0 without a gradient), in the same order on every rank
        norms = [
            torch.linalg.vector_norm(m.grad, norm_type) if m.grad is not None else torch.zeros((), dtype=m.dtype)
            for m in masters
        ]
        return torch.stack([n.to(norms[0].dtype) for n in norms])

    local = optimizer.run_on_host(local_norms)
    # Note [Sharded norms as torch computes them]: each parameter's norm is combined over the ranks
    # (x^p, sum, then ^(1/p); max for inf), then the norm of those norms is taken; this is what
    # torch.nn.utils.clip_grad_norm_ does with FSDP2's DTensor gradients, so the bits match it.
    # The collective runs on a device tensor: nccl/hccl groups cannot reduce host tensors.
    value = local.to(device.torch_device)
    if norm_type == float("inf"):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    else:
        value = value**norm_type
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        value = value ** (1.0 / norm_type)
    total = torch.linalg.vector_norm(value, norm_type)
    total = total.cpu()

    def scale() -> None:
        with_grads = [m for m in masters if m.grad is not None]  # torch takes the parameters, scales their .grad
        if with_grads:
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total)

    optimizer.run_on_host(scale)
    return total


def clip_grad_norm_(
    optimizer: OffloadOptimizer | FSDPOffloadOptimizer, max_norm: float, norm_type: float = 2.0, *, group: Any = None
) -> torch.Tensor:
    """Clip the host gradients to a global norm of ``max_norm``; returns the norm (a host tensor).

    With an :class:`FSDPOffloadOptimizer` the gradients are shards: the norm is the local norm combined
    over ``group`` (the world by default) with one all-reduce, the same arithmetic (and bits) as
    ``torch.nn.utils.clip_grad_norm_`` on FSDP2's DTensor gradients. With an :class:`OffloadOptimizer`
    under DDP the gradients are already reduced (the same on every rank): no collective.

        >>> norm = clip_grad_norm_(opt, 1.0)     # doctest: +SKIP
    """
    if isinstance(optimizer, FSDPOffloadOptimizer):
        return optimizer.clip_grad_norm_(max_norm, norm_type, group=group)
    return _clip_replicated(optimizer, max_norm, norm_type)
