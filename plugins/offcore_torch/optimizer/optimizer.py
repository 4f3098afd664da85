"""OffloadOptimizer: any torch optimizer, run on the host over host copies of the parameters.

Optimizer states never take device memory; gradients leave the device as backward
produces them (post-accumulate-grad hooks, D2H on the device's copy stream), accumulate
on the host in the master dtype, and updated parameters go back on the H2D stream, the
next forward waiting per parameter on its own event.

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="256MiB")
    >>> with dev:
    ...     model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    ...     opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-3)
    ...     for _ in range(2):
    ...         model(torch.randn(8, 16)).square().mean().backward()
    ...         opt.step()
    ...         opt.zero_grad()
    >>> len(opt.state_dict()["state"])
    4
    >>> opt.close()

# Note [Host step rounds]
# A *round* is everything between two ``step()`` calls. Each parameter's gradients of the
# round accumulate into its host gradient buffer (``copy`` for the first since
# ``zero_grad``, ``add_`` after, in the master dtype: the same additions autograd makes on
# the device, so the sums are bit-identical). The host step of a parameter runs either at
# ``step()`` or, when the user declared where accumulation ends (``accumulation_steps=N``:
# its N-th gradient of the round; or a backward inside ``opt.last_micro_step()``), as soon
# as that gradient landed, on the worker, while backward goes on. A gradient arriving for a
# parameter whose step already ran in this round is refused (it would be silently dropped
# from the update, the DeepSpeed accumulation bug), naming the fix. ``zero_grad()`` drops the
# gradients the round counted so far, so it restarts the count of a parameter not stepped yet: a
# micro-step abandoned midway and retried after ``zero_grad()`` would otherwise step over fewer
# micro-steps than N (tests/torch/test_abandoned_step_combinations.py).
#
# Note [Host work runs on one worker thread]
# Every read or write of host masters, host gradients and the host optimizer's state runs
# on the optimizer's single worker thread, in submission order: accumulation, host steps,
# casts for the H2D, clipping, unscaling, load_state_dict. So they never race with each
# other, the main thread never blocks on a copy (the worker waits for D2H events), and on
# the fake device the tensors the host optimizer creates are host memory (its storage
# tracker counts tensors created on the activating thread only). ``step()``, ``zero_grad()``,
# ``state_dict()`` ... drain the worker first, re-raising the first exception it met. One
# exception: ``step()``'s host step runs on the caller's thread when the worker is idle (Note [One
# host step at step()]): nothing else touches host state then (every gradient landed, the queue is
# empty, nothing is queued until the step finished), and the arithmetic runs inside the backend's
# ``host_work()`` (offcore.protocols.OPTIONAL_MEMBERS), so that its temporaries are host memory
# even inside ``with dev:``.
#
# Note [One host step at step()]
# By the time ``step()`` steps, every gradient has landed (it drains the worker first): there is
# no backward left to overlap, so cutting the step into chunks only adds optimizer calls (each
# with its Python and kernel-launch overhead) and runs the uploads of early chunks beside the
# later chunks' arithmetic (on the fake device a memcpy contending for the same cores and
# memory bandwidth). So ``step()`` steps a *lead* (the first-needed parameters, up to
# 1/_LEAD_FRACTION of the master bytes, when there is more than _LEAD_MIN_BYTES to step) and has its
# uploads issued, so the first layer's copy lands under the rest of the step, then steps all the
# others in ONE optimizer call (torch's fused/foreach kernel over every tensor at once, as a bare
# ``AdamW(fused=True).step()``), casts for bf16/fp16, marks their uploads due (``_Slot.upload_due``;
# Note [Who issues step()'s uploads]) and returns. It does so on its own thread when the worker is
# idle (the usual case: ``step()`` drained it, and ``offload_gradients=False``'s gradients landed
# first), inside the backend's ``host_work()``: no hand-off to the worker and no waking the
# caller after it. (Issuing the lead's uploads from a worker job beside the rest's kernel was
# measured and dropped: the job's Python holds the GIL while the caller runs the optimizer's Python
# before the kernel, so the time only moved.) Otherwise all of it is one worker job. ``step()``
# returns when the arithmetic finished. A refused upload stays offloaded and is issued again by its
# use. Host steps under backward (accumulation_steps, last_micro_step) are unchanged: one per
# parameter as its gradient lands. tier="nvme" steps in its pipelined groups (Note [Optimizer states
# on NVMe]), uploads issued as each group is stepped.
#
# Note [In-flight gradients are capped]
# A gradient's device copy is held from its D2H's start until the copy landed (then the core frees
# it). When the link is slower than backward makes gradients, held gradients pile up: the device
# peak would grow with the link's speed and the machine's load instead of being a bound the user
# can plan for. ``max_inflight_gradients`` caps the bytes held (the optimizer's ledger of device
# gradients, which is what the device holds for it): before starting a gradient's D2H, while the
# held bytes plus this gradient's would exceed the cap, backward's thread waits on the OLDEST
# copy's event (the D2H stream is in order, so it lands first) and the landed copies are freed;
# never a sleep. Waiting before the copy costs no overlap: the D2H stream is in order, the new
# copy would queue behind the oldest anyway. A gradient is always let through when nothing is
# held, so a cap below one gradient is "one at a time". A copy that failed completes its event
# too: it is left to the worker's retry (Note [Failed copies in the optimizer]) and no longer
# waited for here. The bound: held <= max(cap, largest gradient), device peak <= the peak without
# optimizer gradients + that (tests/torch/test_optimizer_inflight.py). The rule is the core's, shared
# with saved activations (Note [Copies in flight are capped] in offcore/inflight.py).
#
# Note [Masters are refreshed when the device parameter changed]
# The host master is the truth the optimizer updates. If the device parameter was written
# by someone else (``model.load_state_dict`` after the optimizer was built), the master is
# stale and the next step would overwrite the loaded weights with it (Megatron's resume
# bug). Each slot remembers the device parameter's version counter from when it last
# matched the master (construction, and the H2D of each step once the host observed it
# land); before a host step, a changed version reloads the master from the device.
# ``p.data = ...`` keeps the version: the storage's pointer (``synced_storage``) is compared too.
#
# Note [Writes to parameters after step()]
# Between ``step()`` and the next forward, the step's uploads may be in flight, due (not issued
# yet), or held back by ``upload_budget``; a write to the parameter there (a resume's
# ``model.load_state_dict``, ``p.copy_`` under no_grad, ``p.data = ...``) must win over them, and
# the next step must start from it, never from the stale master (Megatron's resume bug):
# - a module's ``load_state_dict``: the forward pre-hook gives every module whose parameters the
#   optimizer uploads a load pre-hook, which issues the module's pending uploads and waits until
#   they landed (``_settle``) before the load writes, and a load post-hook, which reads the masters
#   of the parameters the load changed from the device (``_refresh``);
# - any other write: an upload not issued yet is cancelled when issued (``_copy_up``: the parameter
#   changed since it matched the master and no upload of ours is in flight: the write is the data),
#   and the master is refreshed before its next step (Note [Masters are refreshed ...]). An upload
#   already in flight is not cancellable: a write of one's own must wait for it first
#   (``opt.wait_for_parameters([p])``, or ``opt.synchronize()``), as for any copy on another stream.
#   When the host sees an upload land with a version its own copy does not explain (``h2d_versions``:
#   the copy bumps the version when issued on CUDA, when it lands on the fake device), someone wrote
#   the parameter meanwhile: the master is refreshed from whatever the device holds, so master and
#   device never disagree. The upload's destination is kept alive until the next upload
#   (``h2d_dst``): ``p.data = ...`` may drop the storage the copy writes.
#
# Note [Who issues step()'s uploads]
# The uploads ``step()`` left due are issued all at once, in need order, on the caller's thread
# under the sched lock (``_issue_due``), by the first of: ``zero_grad()`` (a training loop calls it
# between ``step()`` and the next forward, or at the top of the next iteration), the first use of a
# parameter (the forward's pre-hook: its issue time is traced as a ``"wait"`` of that forward),
# ``wait_for_parameters`` / a module's ``state_dict`` or ``load_state_dict``, and the round's end
# (``_upload_rest``: ``synchronize()``, the next round's first gradient). Issuing all of them at the
# first use keeps them prefetched: the later layers' copies fly while the first layers compute.
# They are not issued by a worker job in the background any more, for two reasons measured in
# optimizer_offload.py (b): (1) writes. Code after ``step()`` may write parameters (an EMA swap,
# ``p.data = ...``, ``p.copy_`` under no_grad), and "an upload not issued yet is cancelled when
# issued" (Note [Writes to parameters after step()]) holds only while no upload is being issued
# beside the write: a job's check ("the parameter still matches its master") and its copy are two
# steps, and a write between them was lost (test_reference_optimizers' write-after-step test, in a
# full run); guarding it made ``zero_grad()`` wait for the job. On one thread the check and the copy
# are never split by a write. (2) time. The job woke as ``step()`` returned and took the GIL from the
# caller (step() +1.3 ms of a 7.4 ms bare step), and ``zero_grad()`` waiting for it waited behind
# the uploads' memcpy on the fake device (a median 4.5 ms). What a background job bought, uploads
# issued while the caller does something else between ``step()`` and the forward, is little on one
# interpreter: the issue is Python under the GIL wherever it runs.
#
# Note [Parameters read after step() are the stepped ones]
# torch.optim's contract: once ``step()`` returned, every read of a parameter -- an EMA update
# (``ema.mul_(0.9).add_(p, alpha=0.1)``), a logged weight norm, ``torch.func.functional_call``, a
# checkpoint -- sees the stepped value. A forward pre-hook sees only reads through module calls, so by
# default (``overlap_uploads=False``) ``step()`` ends by issuing every upload of the step (due, or held
# back by ``upload_budget``: ``_upload_rest``) and making the compute stream wait for each
# (``_publish_uploads``). On a GPU that is a device-side wait: the host goes on queueing the next
# forward, whose kernels start once the copies landed; what is lost is only the overlap of the later
# layers' copies with the first layers' compute. On the fake device compute is the host, so it blocks.
# ``overlap_uploads=True`` keeps that overlap: the uploads are issued at the first of ``zero_grad()``,
# a parameter's use ... (Note [Who issues step()'s uploads]) and each module's pre-hook waits for its
# own parameters; a read outside a module call is then the caller's to order
# (``opt.wait_for_parameters([p])`` / ``opt.synchronize()``), and the sanitizer reports one that is not
# (a read of an upload's destination in flight). benchmarks/optimizer_offload.py times both.
#
# Note [Gradients are final when backward returns]
# torch's contract: when ``loss.backward()`` returns, every ``.grad`` is final, and frameworks read them
# at once (Lightning clips the gradients it finds in ``param_groups``). Here gradients land on the worker
# thread, which used to set each master's ``.grad`` as its copy landed: after backward returned, 1 to 28 of
# 28 were present. So the first gradient of each backward (``_send_gradient``: the optimizer's hooks,
# ``accept_gradient`` from DDP's communication hook or FSDP2's shard hooks) queues an autograd callback
# for the end of that graph task (``_hook_backward_end``, once per ``torch._C._current_graph_task_id()``),
# and the callback (``_backward_ended``) waits for everything queued on the worker -- every D2H landed and
# summed, the host steps under backward (``accumulation_steps``) finished -- and, without
# ``overlap_uploads``, orders the compute stream after those steps' uploads. From then until the next
# backward or ``step()``, no thread of offcore writes ``.grad``, ``param_groups``, ``state`` or parameters.
# A failure on the worker stays queued for ``step()`` to raise, where it was raised before. What it costs:
# backward returns after the last gradient's copy and sum (a tail of one gradient's D2H on a GPU), which
# ``step()`` waited for anyway.
#
# Note [The host gradient is the device parameter's .grad]
# Frameworks clear gradients through the model (Trainer: ``model.zero_grad()``; ``p.grad = None``) and clip
# over ``model.parameters()`` (``max_grad_norm``, ``accelerator.clip_grad_norm_``); both read the device
# parameters' ``.grad``, which offcore sets to None as each gradient leaves the device. So at the end of
# each backward (Note [Gradients are final when backward returns]), every parameter whose gradients the
# optimizer's own hooks take gets a ``_HostGradient`` as ``.grad`` (``_Slot.shown``): a wrapper tensor
# that claims the parameter's device, dtype and shape, holds no device memory, and runs every torch
# operator on the host gradient -- ``clip_grad_norm_`` computes torch's norm over the host gradients and
# its in-place ``mul_`` scales what ``step()`` uses; results go to the parameter's device. Clearing is
# seen where torch would see it: a tensor hook (``_pre_gradient``) runs before autograd accumulates into
# ``.grad`` (and does nothing under ``torch.autograd.grad``, which runs it too but writes no ``.grad``: it asks
# the engine whether the parameter's AccumulateGrad node runs, ``_accumulates``): the shown gradient still there means "not cleared" (it is removed, so autograd makes a fresh
# one, and the host keeps summing: torch adds into a ``.grad`` not cleared); None means cleared (the host
# gradient starts over: ``_clear_host_gradient``); a tensor of the user's is added into by autograd and
# copied over as the first gradient. ``step()`` and the host-gradient readers check the same before
# reading (``_sync_shown``), so a ``model.zero_grad()`` between backward and ``step()`` skips those
# parameters, as torch's step skips a None ``.grad``. ``zero_grad(set_to_none=False)`` zeroes the host
# gradient through the wrapper. A ``_HostGradient`` kept past a clear of its parameter (``_Slot.clears``)
# refuses to be read: the host buffer is the next round's. DDP (``attach_ddp``) shows its reduced gradients
# the same way, from its own tensor hooks and end-of-backward callback (Note [DDP's .grad is the host gradient]
# in distributed.py), and so does FSDPOffloadOptimizer, as DTensors over them (Note [FSDP2's .grad is the host
# gradient]). Gradients handed over with ``accept_gradient`` and shown by no one are cleared by ``opt.zero_grad()``
# only (Note [Host gradients are cleared by opt.zero_grad()]).
#
# Note [Step hooks run once per step]
# torch runs its global step hooks (``register_optimizer_step_pre_hook``/``post_hook``) and an
# optimizer's own around every ``Optimizer.step`` call. ``OffloadOptimizer.step()`` is the user's
# step: its hooks run once, on the caller's thread, with the OffloadOptimizer as argument. The host
# optimizer's calls inside (one per parameter under backward, the lead and the rest at ``step()``,
# the NVMe groups) are parts of it, so they run torch's unwrapped step (``_unhooked_step``), on the
# worker, with no hooks. The state-dict hooks (``register_state_dict_pre_hook`` ...) run in the
# overridden ``state_dict()`` / ``load_state_dict()`` as torch's own run them.
#
# Note [The optimizer's moves go through the core]
# Every *when* and *where* of the optimizer's copies is decided by the core's
# offcore.residency.ResidencyScheduler (one per round, over the optimizer's own long-lived
# offcore.scheduler.Scheduler: its keys are parameter indices, a namespace apart from the
# activations' save order), and this class only translates events and executes actions:
# - gradients are Kind.GRADIENT objects: registered as each D2H starts (``offload_started``;
#   ``released`` at once: no device use follows), and their device copy is dropped when the
#   core answers the landing with ``free`` (the core refuses before the D2H event completed);
# - parameters are Kind.PARAMETER objects "produced on the host" (Note [Objects produced on
#   the host] in offcore/residency.py): ``produced`` at their gradient's arrival (the default
#   prediction is LIFO, as for activations: the last gradient of backward belongs to the first
#   layer of the next forward), ``host_updated`` when their host step finished (a trigger:
#   the core returns the uploads due, ``prefetch="asap"``, in need order, within
#   ``upload_budget``); the order of the host steps at ``step()`` is the core's
#   ``upload_order``; the next forward's first use of each parameter is ``used`` (a trigger:
#   the uploads the budget held back), and those times teach the predictor for the next
#   rounds (``backward_began``/``backward_ended`` bracket the uses).
# What stays here is what only torch knows: hooks, version counters, streams and events,
# the host optimizer's arithmetic, and the rule that a use of a parameter whose upload was
# not issued yet issues it on demand (``reloaded``). An EVICT of an upload frees nothing
# (it writes the parameter's own storage): the copy stays and is not repeated. The device
# capacity check is off (``device_capacity=0``): an upload allocates no device memory.
#
# Note [Parameters on the host with offload_parameters]
# When the parameters are offloaded by offcore_torch.offload_parameters (``params_on_host=handle``,
# or found on the parameters: the default), their host copy (``handle.host_tensor(param)``) is the
# data between uses, so the optimizer works on it directly instead of round-tripping through the
# device: with the master dtype equal to the parameter's, the master *is* the handle's host copy
# (no read from the device, no master buffer); with ``master_weights=True`` and bf16/fp16
# parameters, an fp32 master is made from the host copy and the host copy is the cast stage the
# step writes. Such parameters are not objects of the optimizer's rounds: no upload after the
# step, no wait in the forward pre-hook, no version-based refresh (the device copy is a transient
# copy of the host one). Each round's end (``step()``, a skipped step, ``load_state_dict``) calls
# ``handle.host_updated(params)``: device copies still held are dropped without being written back
# and the next forward streams the new values in by deadline. The handle ignores these optimizers'
# step hooks (they are not foreign steps that wrote device copies), keeps nothing at the end of
# backward for the next forward (the values change in the step), and begins the next step's round
# in ``host_updated`` instead (Note [The next step starts early] in parameters/hooks.py): its first copies
# are of the new values. Gradients still leave the device by the optimizer's hooks, as before.
#
# Note [Failed copies in the optimizer]
# A copy can fail at submission (``copy_`` raises) or on its stream (its event raises).
# Gradients: the device gradient is held until its D2H landed, so a failed D2H is made
# again once (after clearing the stream's sticky error, DeviceRuntime.recover); if that
# fails too, the gradient of that micro-step is lost: the error says so, and ``step()``
# refuses to apply the round (CopyFailedError) until ``zero_grad()`` starts it over, so a
# step is either applied with every gradient or not at all. (With host steps under
# backward, accumulation_steps / last_micro_step, parameters whose step already ran in that
# round keep it; the others are refused.) Uploads: the host master holds the stepped value,
# so a failed H2D is issued again (at submission, or where the forward waits for it), and a
# second failure raises CopyFailedError telling to call ``opt.synchronize()`` once fixed: the
# step was applied fully, only its upload is pending. Either way the device gradients, the
# staging buffers and the pool return to their baseline (tests/torch/test_optimizer_faults.py).
#
# Note [Optimizer states on NVMe]
# With ``tier="nvme"`` each parameter's big state tensors (every tensor state of more than
# one element: AdamW's exp_avg and exp_avg_sq, SGD's momentum_buffer) live in one object
# of an offcore.nvme.NvmeTier between steps; scalars (AdamW's step) stay in memory. A host
# step runs offcore.nvme.pipelined over groups (one parameter, or consecutive small ones up
# to _NVME_GROUP_BYTES of masters): read group i+1 into bounce buffers from a pinned pool,
# step group i with the host optimizer's state pointing at views of its buffers, write
# group i-1, and release a group's buffers only once its write completed (Note [when may
# the host copy be released] in offcore/nvme/tier.py). Nothing lost: a failed read leaves
# the disk copy as it was and the group unstepped; a failed write leaves the stepped states
# in their buffers (the only valid copy, still the optimizer's state) and the next step
# writes them again. ``step()`` then raises the StorageError with a note saying how many
# parameters were stepped, and keeps the round open: calling ``step()`` again steps only the
# others, so the result is that of one uninterrupted step. Keys are ``(id(optimizer), index)``,
# so a tier shared by the device's bindings (``offcore_torch.nvme_tier``) holds several
# optimizers' objects; a shared tier loses only this optimizer's keys when it is dropped, an own
# one (``nvme=`` / ``nvme_path=``) is closed with it.
#
# Note [Masters on NVMe]
# With tier="nvme" (``nvme_masters``, default on) the fp32 master of a bf16/fp16 parameter
# (``master_weights=True``) is one more entry (``_MASTER``) of that parameter's object on disk, in
# front of its states: read, stepped and written in the same pipelined groups, so host memory holds
# only the host gradient and the cast stage (the upload's source, in the parameter's dtype) between
# steps. The master tensor itself stays the same Python object (the host optimizer's state key and
# ``param_groups`` entry, and ``.grad``'s shape match): while its object is in a state buffer it is
# ``set_`` onto its region (``_attach``); once written it is *parked* on a stride-0 view of a
# 64-byte storage (``_park``: its shape intact, no memory behind it, a write raises). Everything
# that reads a master outside the step brings it in first: ``state_dict()`` reads it from disk,
# ``master(param)`` returns a copy read from disk, a refresh from the device (Note [Masters are
# refreshed ...]) and ``load_state_dict`` read the object, change the master, write it back. The
# object's layout is made again when its set of tensors changes (the first step adds the states).
# Masters in the parameter's own dtype are not moved: the host copy is what is uploaded. The bytes
# on disk are booked in the tier's ledger as the object's kind (OPTIMIZER_STATE).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from offcore_layout import describe

from offcore.errors import (
    CapacityExceededError,
    ConfigurationError,
    CopyFailedError,
    IllegalTransitionError,
    OffcoreError,
    StorageError,
)
from offcore.kinds import Kind, Tier
from offcore.ledger import Ledger
from offcore.nvme import NvmeSpec, NvmeTier
from offcore.pool import HostBuffer
from offcore.protocols import Capability
from offcore.residency import ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore.trace import TraceRecorder
from offcore.units import format_bytes, parse_size
from offcore_torch.nvme import nvme_tier_for, open_nvme
from offcore_torch.optimizer.gradients import _Gradients
from offcore_torch.optimizer.nvme_states import _NVME_GROUP_BYTES, _NvmeStates
from offcore_torch.optimizer.rounds import _HostRounds
from offcore_torch.optimizer.slots import (
    _COLLECT,
    _INFLIGHT_DEFAULT_BYTES,
    _LOW_PRECISION,
    _MASTER,
    _NO_STEPS_UNDER_BACKWARD,
    _UNBOUNDED,
    MASTER_WEIGHTS_KEY,
    _accumulates,
    _check_params,
    _grad_accumulator,
    _lead_and_rest,
    _mark_worker_thread,
    _params_of,
    _Slot,
    _storage_id,
    _Task,
    _tensor_of,
    _typed,
)
from offcore_torch.optimizer.state_dicts import _StateDicts
from offcore_torch.runtime import check_bool, check_device, runtime_for

__all__ = ["OffloadOptimizer", "MASTER_WEIGHTS_KEY"]

_STEP_ON_CALLER = True  # step()'s host step on the caller when the worker is idle (Note [One host step at step()]);
# benchmarks/optimizer_offload.py (b) turns it off in every other round, to compare the two side by side
# finished tasks are let go at least this often (Note [Finished tasks are let go while backward runs])
_PRUNE_EVERY = 64


def _unsettled(tasks: list[_Task]) -> list[_Task]:
    """The tasks still needed in ``_futures``: not finished, or failed (their failure is raised later)."""
    return [task for task in tasks if not task.finished or task.error is not None]


# Note [One OffloadOptimizer per parameter]
# Each OffloadOptimizer takes its parameters' gradients off the device in their post-accumulate-grad
# hooks and clears ``param.grad``. Two of them over one parameter (torch steps both of two plain
# optimizers) would race for the gradient: the one whose hook runs second finds ``grad`` None and
# never steps, silently. So an open optimizer claims its parameters, and a second one is refused until
# the first is closed (or collected). The claims live in a registry keyed by ``id(param)``, each a
# weak reference to the parameter and to its optimizer, held alive by the optimizer (``_claims``): the
# parameter carries nothing (an attribute would be pickled with ``torch.save(model)`` and copied by
# ``copy.deepcopy``), a claim goes with its optimizer, and an id reused by another tensor does not match.
class _Claim:
    __slots__ = ("param", "opt", "__weakref__")

    def __init__(self, param: torch.Tensor, opt: OffloadOptimizer) -> None:
        self.param = weakref.ref(param)
        self.opt = weakref.ref(opt)


_CLAIMS: weakref.WeakValueDictionary[int, _Claim] = weakref.WeakValueDictionary()


def _claim(param: torch.Tensor, opt: OffloadOptimizer) -> None:
    claim = _CLAIMS.get(id(param))
    other = claim.opt() if claim is not None and claim.param() is param else None
    if other is not None and other is not opt and not other._closed:
        raise ConfigurationError(
            f"OffloadOptimizer: a parameter ({describe(param)}) is already optimized by another open "
            "OffloadOptimizer; each takes its parameters' gradients off the device, so the second would never "
            "see one. Close the first (opt.close(), or use it as a context manager), or give each optimizer "
            "its own parameters"
        )
    claim = _Claim(param, opt)
    opt._claims.append(claim)
    _CLAIMS[id(param)] = claim


def _unclaim(opt: OffloadOptimizer) -> None:
    for claim in opt._claims:
        param = claim.param()
        if param is not None and _CLAIMS.get(id(param)) is claim:
            del _CLAIMS[id(param)]
    opt._claims.clear()


class _HostGradient(torch.Tensor):
    """A device parameter's ``.grad`` whose values are the optimizer's host gradient (Note [The host gradient
    is the device parameter's .grad]): it claims the parameter's device, dtype and shape and holds no device
    memory; every torch operator on it runs on the host gradient (an in-place one writes what ``step()``
    uses), and its results go to the parameter's device."""

    # slots: no instance dict per gradient shown (a new one per parameter per round, alive from backward to
    # zero_grad(): the cyclic collector promotes and walks each object it keeps, Note [An entry's records])
    __slots__ = ("_host", "_owner", "_index", "_round")
    _host: torch.Tensor
    _owner: weakref.ref[OffloadOptimizer]
    _index: int  # its slot's, found through the owner: the parameter holds its .grad, the slot holds the parameter
    _round: int

    @staticmethod
    def __new__(
        cls, host: torch.Tensor, dtype: torch.dtype, device: torch.device, owner: weakref.ref[Any], slot: _Slot
    ) -> _HostGradient:
        marker = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, host.shape, dtype=dtype, device=device, requires_grad=False
        )
        marker._host, marker._owner, marker._index, marker._round = host, owner, slot.index, slot.clears
        return marker

    def _slot(self) -> _Slot | None:
        owner = self._owner()
        return None if owner is None or owner._closed else owner._slots[self._index]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"HostGradient(shape={tuple(self.shape)}, device={self.device}, host dtype={self._host.dtype})"

    # Note [A gradient a host step already used is not written]
    # With ``accumulation_steps=N`` (or ``last_micro_step()``) a parameter's host step runs under the
    # last backward, as soon as its gradient is complete: by the time backward returns, the update is
    # made from that gradient. Code that then writes the gradient, as torch's contract lets it before
    # ``step()`` (``clip_grad_norm_`` / ``clip_grad_value_`` over ``model.parameters()``, a scaler's
    # ``unscale_``, ``p.grad.zero_()``), would change nothing the step uses: the training numbers would
    # silently differ from torch's. Such a write is refused (ConfigurationError, naming the fix); reads
    # (a norm for logging) stay allowed. ``opt.clip_grad_norm_`` refuses the same case up front, and
    # ``_sync_shown`` a ``.grad`` cleared or replaced then (``model.zero_grad()`` before ``step()``: torch
    # would skip those parameters, which have stepped).
    def _check_unused(self, func: Any) -> None:
        """Refuse an in-place write (``func``) once a host step of this round used the gradient."""
        slot = self._slot()
        if slot is not None and slot.stepped:
            raise ConfigurationError(
                f"{func.__name__} writes the .grad of a parameter whose host step already ran under backward "
                "(OffloadOptimizer(accumulation_steps=N) / last_micro_step() steps each parameter as soon as its "
                "gradient is complete), so the write could not change the update. To clip or modify gradients after "
                "backward, build the optimizer with accumulation_steps=None (the host step then runs in step())"
            )

    def host(self) -> torch.Tensor:
        """The host tensor behind this gradient; refused once the round it belongs to was cleared."""
        slot = self._slot()
        if slot is None or slot.clears != self._round or slot.master.grad is None:
            raise OffcoreError(
                "this .grad belonged to an OffloadOptimizer's host gradient that was cleared since (opt.zero_grad(), "
                "model.zero_grad(), or the optimizer was closed): read the parameter's current .grad instead"
            )
        return self._host

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        markers: list[_HostGradient] = []
        in_place = func._schema.is_mutable and func.__name__.split(".")[0].endswith("_")
        target = args[0][0] if args and isinstance(args[0], (list, tuple)) and args[0] else (args[0] if args else None)
        # an operator writing a tensor of the user's (``x.copy_(p.grad)``) reads the host values on its device;
        # every other one runs on the host (a device scalar, clip_grad_norm_'s coefficient, comes over)
        if "out" in kwargs:
            target, in_place = kwargs["out"], True
        if in_place:  # Note [A gradient a host step already used is not written]
            written = args[0] if args and isinstance(args[0], (list, tuple)) else (target,)
            for tensor in written:
                if isinstance(tensor, _HostGradient):
                    tensor._check_unused(func)
        on_host = not in_place or isinstance(target, _HostGradient)
        if func.namespace == "_c10d_functional" and not in_place:  # DTensor's full_tensor(): nccl needs the device
            on_host = False

        def unwrap(x: Any) -> Any:
            if isinstance(x, _HostGradient):
                markers.append(x)
                return x.host() if on_host else x.host().to(x.device)
            if on_host and isinstance(x, torch.Tensor) and x.device.type != "cpu":
                return x.cpu()
            return x

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        first = markers[0]
        if "out" in kwargs:
            return kwargs["out"]
        if in_place:  # the tensor written (the marker itself, when the host gradient was written)
            return None if out is None else args[0]
        if func.is_view:  # a view of the host gradient is a gradient too (``p.grad.detach().mul_(c)``)

            def rewrap(t: Any) -> Any:
                if isinstance(t, torch.Tensor):
                    slot = first._slot()
                    assert slot is not None  # its host() was read just now
                    return _HostGradient(t, first.dtype, first.device, first._owner, slot)
                return t

            return pytree.tree_map(rewrap, out)
        return pytree.tree_map(lambda t: t.to(first.device) if isinstance(t, torch.Tensor) else t, out)


class OffloadOptimizer(_Gradients, _HostRounds, _NvmeStates, _StateDicts, torch.optim.Optimizer):
    """Run ``optimizer_class`` on the host over host copies of ``params`` (see the module doc).

    - ``device``: the offcore backend device the parameters live on.
    - ``master_weights``: keep fp32 masters on the host when device parameters are bf16/fp16
      (the step runs in fp32; the device gets the master rounded to its dtype).
    - ``offload_gradients`` (True): each gradient leaves the device as soon as backward made it;
      False keeps gradients on the device until ``step()``.
    - ``accumulation_steps`` (None): with N, a parameter's host step runs as soon as its N-th
      gradient since the last ``step()`` or ``zero_grad()`` landed, under backward (Note [Host step rounds]);
      None steps at ``step()`` (any number of micro-steps). ``opt.last_micro_step()`` declares
      one backward the last instead.
    - ``trace``: an :class:`offcore.trace.TraceRecorder` that gets the host work (track
      ``"host"``: accumulation and steps) and the forward's waits for parameters (``"wait"``).
    - ``pin_memory`` (True) and ``host_budget`` (default: what masters and gradients need plus
      staging room): the host pool holding masters, gradients and staging buffers.
    - ``upload_budget`` (None: unbounded): with ``overlap_uploads=True``, bytes of updated parameters
      uploaded ahead of their use in the next forward; the rest is uploaded at the forward's triggers,
      in the core's need order (Note [The optimizer's moves go through the core]). Without it,
      ``step()`` issues every upload before it returns.
    - ``max_inflight_gradients`` (None: the larger of 64 MiB and twice the largest gradient):
      bytes of device gradients whose D2H has not landed; past it, backward waits for the
      oldest copy's event before going on (Note [In-flight gradients are capped]). One gradient
      is always let through, however large.
    - ``params_on_host`` (None): the :func:`offcore_torch.offload_parameters` handle of these
      parameters; None finds it on the parameters, False ignores it (then the step is uploaded
      into the device parameters, which the handle writes back). With a handle, the host step
      updates the handle's host copies in place and the next forward streams them in (Note
      [Parameters on the host with offload_parameters]).
    - ``tier`` (``"host"``): ``"nvme"`` keeps the optimizer states in files on an NVMe tier, stepped
      with :func:`offcore.nvme.pipelined` (Note [Optimizer states on NVMe]); the files go when the
      optimizer is closed or dropped. The tier: ``nvme=`` (a directory or an
      :class:`offcore.nvme.NvmeSpec` with a byte budget: a tier of its own), or ``nvme_path=`` with
      ``nvme_budget`` (default: the free space there) and ``verify`` (CRC-checked reads), or else the
      device's shared tier set by :func:`offcore_torch.nvme_tier`.
    - ``nvme_masters`` (None: on with ``tier="nvme"``): the fp32 masters of bf16/fp16 parameters
      (``master_weights=True``) live on disk with their states (Note [Masters on NVMe]).
    - ``overlap_uploads`` (False): when ``step()`` returns, every updated parameter's upload is issued
      and the compute stream waits for them (a device-side wait on a GPU), so any later read of a
      parameter, by any torch op, sees the stepped value. True keeps the uploads in flight past
      ``step()``, overlapping the next forward, which waits per parameter in its module's pre-hook;
      a parameter read outside a module call then needs :meth:`wait_for_parameters` (or
      :meth:`synchronize`) first (Note [Parameters read after step() are the stepped ones]).

    ``param_groups`` and ``state`` are the host optimizer's own (LR schedulers work; the state is
    keyed by the host masters); ``state_dict()`` is in torch's format. When ``backward()`` returns,
    every gradient is final on the host, and each parameter's ``.grad`` shows its host gradient (torch
    operators on it run on the host: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` clips
    what ``step()`` uses; ``model.zero_grad()`` clears it: Note [The host gradient is the device
    parameter's .grad]).

        >>> opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-3)  # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        device: Any,
        master_weights: bool = False,
        offload_gradients: bool = True,
        pin_memory: bool = True,
        accumulation_steps: int | None = None,
        host_budget: int | str | None = None,
        upload_budget: int | str | None = None,
        max_inflight_gradients: int | str | None = None,
        tier: str = "host",
        nvme: NvmeSpec | str | os.PathLike[str] | None = None,
        nvme_masters: bool | None = None,
        nvme_path: str | None = None,
        nvme_budget: int | str | None = None,
        verify: bool | None = None,
        trace: TraceRecorder | None = None,
        params_on_host: Any = None,
        overlap_uploads: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        check_device(device, "OffloadOptimizer")
        for flag, value in (
            ("master_weights", master_weights),
            ("offload_gradients", offload_gradients),
            ("pin_memory", pin_memory),
            ("verify", False if verify is None else verify),
        ):
            check_bool(value, flag, "OffloadOptimizer")
        if trace is not None and not callable(getattr(trace, "span", None)):
            raise ConfigurationError(
                f"OffloadOptimizer: trace must be an offcore.trace.TraceRecorder (or None), got {trace!r}"
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ConfigurationError(
                f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), got {optimizer_class!r}"
            )
        if optimizer_class.__name__ == "LBFGS":
            raise ConfigurationError(
                "LBFGS keeps state over all parameters at once; OffloadOptimizer steps per parameter"
            )
        if accumulation_steps is not None and (
            isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1
        ):
            raise ConfigurationError(f"accumulation_steps must be a positive int or None, got {accumulation_steps!r}")
        if accumulation_steps is not None and not offload_gradients:
            raise ConfigurationError(_NO_STEPS_UNDER_BACKWARD.format(what=f"accumulation_steps={accumulation_steps}"))
        if isinstance(params, torch.Tensor):
            raise ConfigurationError("params must be an iterable of tensors or of param-group dicts, not one tensor")
        if tier not in ("host", "nvme"):
            raise ConfigurationError(f"tier must be 'host' or 'nvme', got {tier!r}")
        if tier == "host" and (
            nvme_path is not None or nvme_budget is not None or nvme is not None or nvme_masters is not None
        ):
            raise ConfigurationError("nvme= / nvme_path= / nvme_budget= / nvme_masters= need tier='nvme'")
        if nvme is not None and nvme_path is not None:
            raise ConfigurationError(
                "give the NVMe tier once: nvme= (a path or an offcore.nvme.NvmeSpec) or nvme_path="
            )
        if tier == "nvme" and nvme is None and nvme_path is None and (nvme_budget is not None or verify is not None):
            raise ConfigurationError(
                "nvme_budget= / verify= set up a tier of this optimizer's own: give its directory with nvme= or "
                "nvme_path= (the device's shared tier, offcore_torch.nvme_tier, has its own budget and verify)"
            )
        if tier == "nvme" and nvme is None and nvme_path is None and nvme_tier_for(device) is None:
            raise ConfigurationError(
                "tier='nvme' needs a directory on the NVMe disk: nvme= (a path or an offcore.nvme.NvmeSpec), "
                "nvme_path=, or a tier set for the device with offcore_torch.nvme_tier(device, path)"
            )
        if optimizer_kwargs.get("differentiable"):
            raise ConfigurationError(
                "OffloadOptimizer: differentiable=True cannot be: the host step runs on detached host masters, so no "
                "gradient flows through the update; differentiate through a plain optimizer on the device instead"
            )
        if optimizer_kwargs.get("capturable") and not optimizer_kwargs.get("fused"):
            raise ConfigurationError(
                f"OffloadOptimizer: capturable=True cannot be: {optimizer_class.__name__} steps CPU tensors on the "
                "host, and torch captures (CUDA graphs) only device steps (fused=True is the one CPU implementation "
                "that takes capturable=True); drop capturable="
            )
        groups = list(params)
        if not groups:
            raise ConfigurationError("OffloadOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": _params_of(g)} if isinstance(g, dict) else g for g in groups]
        _check_params(groups)

        self._device = device
        # Note [Host work the worker does is declared to the sanitizer]
        self._host_writes: Callable[..., Any] | None = (
            device.host_writes if Capability.SANITIZER in getattr(device, "capabilities", ()) else None
        )
        self._runtime = runtime_for(device)
        self._master_weights = master_weights
        # Note [Masters on NVMe]: default on with tier="nvme" (it applies to masters of another dtype)
        self._nvme_masters = tier == "nvme" and (nvme_masters is None or nvme_masters)
        self._params_handle = self._find_handle(groups, params_on_host)
        self._offload_gradients = offload_gradients
        self._accumulation_steps = accumulation_steps
        if not isinstance(overlap_uploads, bool):
            raise ConfigurationError(f"overlap_uploads must be True or False, got {overlap_uploads!r}")
        self._overlap_uploads = overlap_uploads  # Note [Parameters read after step() are the stepped ones]
        self._pin_memory = pin_memory
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = dict(optimizer_kwargs)
        self.ledger = Ledger()
        self.trace = trace
        self._slots: list[_Slot] = []
        self._frozen: set[int] = set()  # slots frozen when made: no gradient hook (Note [Parameters unfrozen ...])
        self._claims: list[_Claim] = []  # Note [One OffloadOptimizer per parameter]
        self._by_param: dict[int, _Slot] = {}
        self._device_params: dict[int, _Slot] = {}  # the forward pre-hook's: parameters not on the host
        self._lock = threading.Lock()
        self._pending_h2d: dict[int, _Slot] = {}  # id(device param) -> slot whose H2D the host has not observed
        self._in_flight: collections.deque[tuple[Any, list[torch.Tensor], int]] = collections.deque()
        self._futures: list[_Task] = []  # Note [Worker tasks without a Future each]
        self._prune_at = _PRUNE_EVERY  # Note [Finished tasks are let go while backward runs]
        self._tasks: collections.deque[_Task] = collections.deque()  # queued for the pump, in order
        self._task_done = threading.Condition(threading.Lock())  # guards _tasks, _pumping, each task's finished
        self._pumping = False
        # step()'s rest, in need order: their uploads are due (Note [Who issues step()'s uploads])
        self._due: list[_Slot] = []
        # Note [Host gradients are cleared by opt.zero_grad()]: a step ran since the last zero_grad()
        self._stepped_since_zero_grad = False
        # offload_gradients=False: the device gradients this round already copied to the host (a weak
        # reference to each, and its version at the copy), or None (Note [Device gradients are read on the
        # host once per round]); _taken_stepped: that round's step() ran
        self._taken: dict[int, tuple[weakref.ref[torch.Tensor], int] | None] | None = None
        self._taken_stepped = False
        self._last_micro = False
        # Note [Gradients are final when backward returns]: the autograd graph task whose end is hooked
        self._backward_task = -1
        # the core scheduler (Note [The optimizer's moves go through the core])
        self._predictor = Scheduler(margin=0.0)
        self._upload_budget = _UNBOUNDED if upload_budget is None else parse_size(upload_budget, what="upload_budget")
        # Note [Uploads are issued in batches]: the backend's copy_many (an optional member), if it has one
        self._copy_many: Callable[..., Any] | None = getattr(device, "copy_many", None)
        self._max_inflight = (
            None
            if max_inflight_gradients is None
            else parse_size(max_inflight_gradients, what="max_inflight_gradients")
        )
        self._rs: ResidencyScheduler | None = None
        self._phase = _COLLECT
        self._used: set[int] = set()  # parameters the forward of this round's uses phase used
        # parameters of the round whose host copy became the data but whose upload the core may not have offered
        # (held back by the budget, or a failed batch): _upload_rest uploads those still offloaded
        self._unissued: set[int] = set()
        self._fresh: object | None = None  # Note [Checked fresh in this step()]: this step()'s mark, while it runs
        self._sched_lock = threading.RLock()  # order: _sched_lock before _lock, never the reverse
        self._grad_keys = itertools.count(-1, -1)  # gradient objects: negative keys
        self._lost: str | None = None  # a gradient of this round was lost (Note [Failed copies in the optimizer])
        self.copy_failures = 0
        """Copies that failed and were made again, recovered (each also an OffcoreWarning)."""
        self._state_bytes = 0
        self._closed = False
        self._host_tier = Tier.PINNED if pin_memory else Tier.PAGEABLE
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="offcore-optimizer", initializer=_mark_worker_thread
        )
        # Note [One host step at step()]: "host work, not device memory" on the calling thread (the
        # backend's optional host_work(); where host tensors are host memory anyway, nothing to do)
        self._host_work: Callable[[], contextlib.AbstractContextManager[Any]] = (
            getattr(device, "host_work", None) or contextlib.nullcontext
        )

        # the host pool: budget for masters + grads (+ stages) and staging room
        flat = [_tensor_of(p) for g in groups for p in _params_of(g)]
        need = sum(self._persistent_bytes(p) for p in flat if isinstance(p, torch.Tensor))
        if self._max_inflight is None:
            largest_grad = max((p.numel() * p.element_size() for p in flat if isinstance(p, torch.Tensor)), default=0)
            self._max_inflight = max(_INFLIGHT_DEFAULT_BYTES, 2 * largest_grad)
        if host_budget is None:
            largest = max((p.numel() * p.element_size() for p in flat), default=0)
            budget = need + max(4 * largest, min(need, 64 * 1024**2)) + 512 * (4 * len(flat) + 8)
        else:
            budget = parse_size(host_budget, what="host_budget")
        self._pool = device.host_pool(budget, pinned=pin_memory)
        self._host: torch.optim.Optimizer | None = None
        self._nvme: NvmeTier | None = None
        self._state_pool: Any = None
        self._nvme_owned = True
        self._nvme_base = id(self)  # keys (id, index): unique in a tier shared by the device's bindings
        if tier == "nvme":
            if nvme_path is not None:
                nvme = NvmeSpec(nvme_path, nvme_budget, True if verify is None else verify)
            elif nvme_budget is not None or verify is not None:
                spec = NvmeSpec(os.fspath(nvme), nvme_budget, verify) if not isinstance(nvme, NvmeSpec) else nvme
                nvme = NvmeSpec(
                    spec.path,
                    nvme_budget if nvme_budget is not None else spec.budget,
                    spec.verify if verify is None else verify,
                )
            self._nvme, self._nvme_owned = open_nvme(device, nvme, ledger=self.ledger)
            # bounce buffers: three groups live in the pipeline (read i+1, step i, write i-1), each of
            # up to ~4 x its master bytes of state and master (AdamW: 3 x), a failed write's groups kept besides
            largest = max((p.numel() * 4 for p in flat), default=0)
            self._state_pool = device.host_pool(
                4 * max(largest, _NVME_GROUP_BYTES) * 4 + 64 * 1024**2, pinned=pin_memory
            )
        # Note [Masters on NVMe]: parked masters point here (made on the worker: host memory on the fake device)
        self._parking: Any = self._worker.submit(torch.UntypedStorage, 64).result() if self._nvme_masters else None

        # torch.optim.Optimizer's own attributes (hooks, profiling names), without its param handling
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Callable[..., Any]] = collections.OrderedDict()
        self._patch_step_function()

        try:
            host_groups = [self._make_slots(g) for g in groups]
            self._host = optimizer_class(host_groups, **optimizer_kwargs)
        except BaseException:
            self._closed = True  # claims nothing (Note [One OffloadOptimizer per parameter])
            self._release_everything()
            raise
        self._regroup()
        if self._params_handle is not None:
            self._params_handle._attach_host_optimizer(self)
        self._state_dict_hooked: dict[int, Any] = {}  # id(module) -> its state_dict pre-hook's handle
        self._wait_handle = torch.nn.modules.module.register_module_forward_pre_hook(_forward_pre_hook(self))
        self._finalizer = weakref.finalize(
            self, _shutdown, self._worker, self._wait_handle, self._nvme, self._nvme_owned, self._nvme_base
        )

    # -- construction ------------------------------------------------------------------
    def _master_dtype(self, param: torch.Tensor) -> torch.dtype:
        if self._master_weights and param.dtype in _LOW_PRECISION:
            return torch.float32
        return param.dtype

    def _find_handle(self, groups: list[Any], given: Any) -> Any:
        """The ``offload_parameters`` handle whose host copies the masters are (Note [Parameters on the
        host with offload_parameters]): ``given``, or found on the parameters when None; False: none."""
        if given is False:
            return None
        handles = set()
        for group in groups:
            for param in map(_tensor_of, _params_of(group)):
                slot = getattr(param, "_offcore_slot", None)
                if slot is not None and not slot.is_buffer:
                    handles.add(slot.handle)
        if given is None or given is True:
            if len(handles) > 1:
                raise ConfigurationError(
                    "OffloadOptimizer: the parameters are offloaded by more than one offload_parameters handle; "
                    "use one OffloadOptimizer per handle (params_on_host=handle)"
                )
            if not handles:
                if given is True:
                    raise ConfigurationError("params_on_host=True: no parameter is offloaded by offload_parameters")
                return None
            return next(iter(handles))
        if not hasattr(given, "host_tensor") or not hasattr(given, "host_updated"):
            raise ConfigurationError(
                f"params_on_host must be an offload_parameters handle, None (find it) or False, got {given!r}"
            )
        if handles - {given}:
            raise ConfigurationError("OffloadOptimizer: some parameters are offloaded by another handle")
        return given

    def _host_param(self, param: torch.Tensor) -> torch.Tensor | None:
        handle = self._params_handle
        slot = getattr(param, "_offcore_slot", None)
        if handle is None or slot is None or slot.handle is not handle or slot.is_buffer:
            return None
        return handle.host_tensor(param)

    def _persistent_bytes(self, param: torch.Tensor) -> int:
        n = param.numel()
        master = n * torch.empty((), dtype=self._master_dtype(param)).element_size()
        stage = n * param.element_size() if self._master_dtype(param) != param.dtype else 0
        if self._host_param(param) is not None:  # the handle's host copy is the master (same dtype) or the stage
            return 2 * master if stage else master
        if stage and self._nvme_masters:  # Note [Masters on NVMe]: the master is on disk between steps
            return master + stage
        return 2 * master + stage

    def _acquire(self, nbytes: int, what: str) -> HostBuffer:
        try:
            return self._pool.acquire(max(nbytes, 1))
        except CapacityExceededError as exc:
            raise CapacityExceededError(
                f"OffloadOptimizer: the host budget ({format_bytes(self._pool.budget)}, "
                f"{'pinned' if self._pin_memory else 'pageable'}) cannot hold {what} ({format_bytes(nbytes)}); "
                f"{format_bytes(self._pool.used_bytes)} are in use. Pass a larger host_budget= "
                "(masters and gradients need about 2 x master bytes per parameter, plus a cast stage for bf16/fp16 "
                "with master_weights)."
            ) from exc

    def _make_slots(self, group: dict[str, Any]) -> dict[str, Any]:
        params = _params_of(group)
        _check_params([params])
        masters: list[Any] = []
        for named in params:
            param = _tensor_of(named)
            if id(param) in self._by_param:
                raise ConfigurationError("some parameters appear in more than one parameter group")
            _claim(param, self)
            if not param.is_floating_point():
                raise ConfigurationError(f"OffloadOptimizer optimizes floating-point parameters, got {param.dtype}")
            slot = _Slot(len(self._slots), param, group)
            dtype = self._master_dtype(param)
            nbytes = param.numel() * torch.empty((), dtype=dtype).element_size()
            slot.host_param = self._host_param(param)
            if slot.host_param is not None and dtype == param.dtype:
                slot.master = slot.host_param  # the handle's host copy is the master: no copy of it
            elif self._nvme_masters and dtype != param.dtype:
                # Note [Masters on NVMe]: in a state buffer until written at the end of construction
                slot.nvme_master = True
                slot.master = torch.empty(0, dtype=dtype)
                slot.layout = [(_MASTER, dtype, param.shape, 0)]
                slot.state_nbytes = -(-nbytes // 64) * 64
                slot.state_buf = self._acquire_state(slot.state_nbytes)
                self._attach(slot)
            else:
                master_buf = self._acquire(nbytes, "a master copy")
                slot.buffers.append(master_buf)
                slot.master = _typed(master_buf, dtype, param.shape)
                self.ledger.add(self._host_tier, Kind.PARAMETER, nbytes)
            grad_buf = self._acquire(nbytes, "a host gradient")
            slot.buffers.append(grad_buf)
            slot.grad = _typed(grad_buf, dtype, param.shape)
            self.ledger.add(self._host_tier, Kind.GRADIENT, nbytes)
            if slot.host_param is not None:
                slot.stage = None if dtype == param.dtype else slot.host_param  # the step writes the host copy
            elif dtype != param.dtype:
                stage_buf = self._acquire(param.numel() * param.element_size(), "a cast stage")
                slot.buffers.append(stage_buf)
                slot.stage = _typed(stage_buf, param.dtype, param.shape)
                self.ledger.add(self._host_tier, Kind.PARAMETER, stage_buf.nbytes)
            self._slots.append(slot)
            self._by_param[id(param)] = slot
            if slot.host_param is None:
                self._device_params[id(param)] = slot
            self._load_master(slot)
            if slot.nvme_master:
                assert self._nvme is not None
                self._nvme.write(self._key(slot), self._state_view(slot), kind=Kind.OPTIMIZER_STATE).synchronize()
                self._release_group([slot])
            if self._offload_gradients and param.requires_grad:
                slot.hook = param.register_post_accumulate_grad_hook(_grad_hook(self, slot))
                slot.pre_hook = param.register_hook(_pre_grad_hook(self, slot))
            elif self._offload_gradients:  # Note [Parameters unfrozen after construction]
                self._frozen.add(slot.index)
            # named parameters: the host group gets (name, master), so torch writes "param_names" as for its own
            masters.append((named[0], slot.master) if isinstance(named, tuple) else slot.master)
        return {**{k: v for k, v in group.items() if k != "params"}, "params": masters}

    def _load_master(self, slot: _Slot) -> None:
        """Copy the device parameter into its master (synchronously: construction, refresh, load)."""
        if slot.nvme_master and slot.state_buf is None:  # parked on disk (Note [Masters on NVMe]): read, load, write
            self._read_object(slot)
            try:
                self._load_master(slot)
            finally:
                self._write_object(slot)
            return
        if slot.host_param is not None:  # read from the handle's host copy: nothing from the device
            self._params_handle.release()  # a device copy changed meanwhile (load_state_dict) is written back
            if slot.stage is not None:
                slot.master.copy_(slot.stage)
            return
        dev, rt = self._device, self._runtime
        param = slot.param.detach()
        produced = dev.new_event()
        dev.current_stream().record_event(produced)
        rt.d2h_stream.wait_event(produced)
        target = slot.master if slot.stage is None else slot.stage
        done = dev.copy_(target, param, stream=rt.d2h_stream)
        done.synchronize()
        if slot.stage is not None:
            slot.master.copy_(slot.stage)
        slot.synced_version, slot.synced_storage = slot.param._version, _storage_id(slot.param)

    def _regroup(self) -> None:
        """Point every slot at the host group holding its master (torch's load_state_dict makes new groups)."""
        assert self._host is not None
        group_of = {id(m): g for g in self._host.param_groups for m in g["params"]}
        for slot in self._slots:
            slot.group = group_of[id(slot.master)]

    # -- torch.optim.Optimizer's surface -------------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The host optimizer's parameter groups (their ``params`` are the host masters)."""
        return self._host.param_groups if self._host is not None else []

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The host optimizer's state, keyed by host masters."""
        return self._host.state if self._host is not None else {}

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._host.defaults if self._host is not None else {}

    @property
    def host_optimizer(self) -> torch.optim.Optimizer:
        """The ``optimizer_class`` instance that runs on the host."""
        assert self._host is not None
        return self._host

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The host master of device parameter ``param`` (its ``.grad`` is the host gradient).

        A master on NVMe between steps (Note [Masters on NVMe]) comes back as a copy read from disk."""
        slot = self._slot(param)
        if slot.nvme_master and slot.state_buf is None:
            return self.run_on_host(self._master_value, slot)
        return slot.master

    def host_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The accumulated host gradient of ``param`` (None after ``zero_grad(set_to_none=True)``)."""
        self._drain()
        return self._slot(param).master.grad

    def _slot(self, param: torch.Tensor) -> _Slot:
        slot = self._by_param.get(id(param))
        if slot is None:
            raise ConfigurationError("this tensor is not a parameter of the OffloadOptimizer")
        return slot

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of device parameters (their host copies are made now)."""
        self._check_open("add_param_group()")
        if self._host is None:  # Optimizer.__init__ path, unused: groups are built in __init__
            raise OffcoreError("OffloadOptimizer is not initialised")
        self._drain()
        with self._sched_lock:
            self._close_round()  # the next round registers the new parameters too
        host_group = self._make_slots(param_group)
        self._host.add_param_group(host_group)
        self._regroup()

    # Note [Parameters unfrozen after construction]
    # Gradients reach the host through each parameter's post-accumulate-grad hook, and torch refuses
    # that hook on a tensor that does not require grad. A parameter frozen when the optimizer was made
    # and unfrozen later (gradual unfreezing) therefore had no hook: its gradient stayed on the device
    # and it never moved, silently, where torch's optimizers step it. So such slots are remembered
    # (``_frozen``) and ``step()`` adopts the ones that require grad now: their hook is registered for
    # the next rounds, and a gradient already accumulated on the device is taken now, as the hook would
    # have taken it. (Not after remove_gradient_hooks(): then the caller hands the gradients over.)
    def _adopt_unfrozen(self) -> None:
        for index in sorted(self._frozen):
            slot = self._slots[index]
            if not slot.param.requires_grad:
                continue
            self._frozen.discard(index)
            slot.hook = slot.param.register_post_accumulate_grad_hook(_grad_hook(self, slot))
            slot.pre_hook = slot.param.register_hook(_pre_grad_hook(self, slot))
            self._on_gradient(slot)

    # -- torch's gradient contract (Note [Gradients are final when backward returns], Note [The host gradient
    # is the device parameter's .grad]) ------------------------------------------------------------------
    def _hook_backward_end(self) -> None:
        """Inside a backward: have :meth:`_backward_ended` run when it ends (once per autograd graph task)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._backward_task:
            return
        self._backward_task = task
        torch.autograd.Variable._execution_engine.queue_callback(_backward_end_callback(self))

    def _backward_ended(self) -> None:
        """The backward that sent gradients returns now: every one of them landed and was summed on the host,
        the host steps it started finished, and each device parameter's ``.grad`` shows its host gradient."""
        self._backward_task = -1
        if self._closed:
            return
        self._settle_worker()
        self._sync_shown()
        for slot in self._slots:
            if slot.hook is not None and slot.param.grad is None and slot.master.grad is not None:
                slot.param.grad = slot.shown = self._show(slot)
        if not self._overlap_uploads:  # host steps under backward uploaded: later reads see the step
            self._wait_all(traced=False)

    def _settle_worker(self) -> None:
        """Wait for everything queued on the worker; a failure stays queued for ``step()`` / ``_drain`` to raise."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            self._wait_task(future)
        with self._lock:
            self._futures = _unsettled(self._futures)
        self._release_landed()

    def _show(self, slot: _Slot) -> _HostGradient:
        param = slot.param
        return _HostGradient(slot.grad, param.dtype, param.device, weakref.ref(self), slot)

    def _pre_gradient(self, slot: _Slot) -> None:
        """A gradient of ``slot`` is about to be accumulated into ``param.grad`` (tensor hook, inside backward)."""
        shown, slot.shown = slot.shown, None
        if shown is None:
            return
        if slot.param.grad is shown:  # not cleared: the host sum goes on (torch adds to a .grad not cleared)
            slot.param.grad = None
        else:  # cleared (None), or a tensor of the user's that autograd adds into and the hook copies over
            self._clear_host_gradient(slot)

    def _clear_host_gradient(self, slot: _Slot) -> None:
        slot.clears += 1
        slot.accumulated = False
        slot.master.grad = None
        if not slot.stepped:
            slot.arrivals = 0

    def _sync_shown(self) -> None:
        """``model.zero_grad()`` / ``p.grad = None`` / ``p.grad = t`` since the host gradients were shown: the
        host gradient follows (cleared, or ``t`` copied over and shown instead). Main thread, worker idle."""
        for slot in self._slots:
            shown = slot.shown
            if shown is None or slot.param.grad is shown:
                continue
            if slot.stepped:  # Note [A gradient a host step already used is not written]
                raise ConfigurationError(
                    f"the .grad of parameter #{slot.index} was cleared or replaced after backward, but its host step ran "
                    "under that backward (OffloadOptimizer(accumulation_steps=N) / last_micro_step()), so the change "
                    "could not reach the update. Clear gradients after step() (or build the optimizer with "
                    "accumulation_steps=None to change them between backward and step())"
                )
            grad, slot.shown = slot.param.grad, None
            self._clear_host_gradient(slot)
            if grad is not None:
                value = grad.host() if isinstance(grad, _HostGradient) else grad.detach()
                slot.grad.copy_(value)
                slot.master.grad = slot.grad
                slot.accumulated = True
                slot.param.grad = slot.shown = self._show(slot)

    def _watch_state_dict(self, module: torch.nn.Module) -> None:
        """Make ``module.state_dict()`` wait for its parameters' uploads (Note [A checkpoint reads landed
        parameters]) and ``module.load_state_dict()`` settle them before its writes and refresh the masters
        after (Note [Writes to parameters after step()])."""
        self._state_dict_hooked[id(module)] = _Handles(
            module.register_state_dict_pre_hook(_state_dict_pre_hook(self)),
            module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook(self)),
            module.register_load_state_dict_post_hook(_load_state_dict_post_hook(self)),
        )

    @contextlib.contextmanager
    def last_micro_step(self) -> Iterator[OffloadOptimizer]:
        """The backward inside is the last micro-step before ``step()``: host steps start under it.

        >>> with opt.last_micro_step():        # doctest: +SKIP
        ...     loss.backward()
        """
        if not self._offload_gradients:
            raise ConfigurationError(_NO_STEPS_UNDER_BACKWARD.format(what="last_micro_step()"))
        self._last_micro = True
        try:
            yield self
        finally:
            self._last_micro = False

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run the host steps not run yet (first-used parameters first) and issue their H2D copies.

        Returns when the host steps finished (Note [One host step at step()]); the uploads are issued
        in need order from there, and the next forward waits per parameter for its copy.
        """
        self._check_open("step()")
        if self._frozen:
            self._adopt_unfrozen()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._drain()
        self._sync_shown()
        if self._lost is not None:
            raise CopyFailedError(
                f"OffloadOptimizer.step(): not applied, a gradient of this round was lost ({self._lost}); "
                "call opt.zero_grad() and run the micro-steps again"
            )
        if not self._offload_gradients:  # Note [Device gradients are read on the host once per round]
            self._check_taken()
            self.gradients_to_host()
        with self._sched_lock:
            rs = self._round()
            rs.make_plan()  # with this round's gradient arrivals
            keys = [s.index for s in self._slots if not s.stepped and s.accumulated]
            remaining = [self._slots[k] for k in rs.upload_order(keys)]  # first needed, first stepped
        # Note [Checked fresh in this step()]: what passes the check below is not written before step() returns
        self._fresh = fresh = object()
        try:
            self._check_fresh_all(remaining, fresh)
            self._h2d_after_compute()
            # Note [One host step at step()]
            try:
                if not remaining:  # every host step ran under backward (accumulation_steps, last_micro_step)
                    pass
                elif self._nvme is not None:
                    self._worker.submit(self._step_groups, self._groups(remaining), rs).result()
                else:
                    lead, rest = _lead_and_rest(remaining)
                    if _STEP_ON_CALLER and self._worker_idle():  # no hand-off to the worker, no waking this thread
                        self._step_lead_and_rest(lead, rest, rs)
                    else:
                        self._worker.submit(self._step_lead_and_rest, lead, rest, rs).result()
            except StorageError as exc:
                if self._nvme is None:
                    self._end_round()
                    raise
                self._storage_failed(exc, remaining)  # keeps the round open: a retry steps the rest
            except BaseException:
                self._end_round()
                raise
            try:
                self._end_round()
            except BaseException as exc:  # an error must say what happened: here, the update did
                exc.add_note(
                    "OffloadOptimizer.step(): this error came after the update was applied to every parameter of "
                    "the round (from what step() starts for the next one); do not call step() again for this round"
                )
                raise
            self._stepped_since_zero_grad = True
            if not self._overlap_uploads:
                self._publish_uploads()
        finally:
            self._fresh = None
        return loss

    # -- worker -----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the worker, after everything queued (Note [Worker tasks without a Future each])."""
        if self._closed:
            raise OffcoreError("OffloadOptimizer is closed")
        task = _Task(fn, args)
        with self._task_done:
            start = not self._pumping
            if start:
                self._worker.submit(self._pump)  # before anything changes: a refusal leaves nothing queued
                self._pumping = True
            self._tasks.append(task)
        with self._lock:
            futures = self._futures
            n = len(futures)
            if n >= self._prune_at:  # Note [Finished tasks are let go while backward runs]
                futures = self._futures = _unsettled(futures)
                self._prune_at = 2 * len(futures) + _PRUNE_EVERY
            elif n < _PRUNE_EVERY:  # emptied since (a drain, the end of backward)
                self._prune_at = _PRUNE_EVERY
            futures.append(task)

    # Note [Finished tasks are let go while backward runs]
    # ``_futures`` holds every task submitted since the last drain (``step()``) or the end of backward
    # (``_settle_worker``), so that those raise the first failure. A task that finished without one is
    # needed there no more, but it stayed until then: one per gradient, alive for most of a backward, so the
    # collector's young collections promoted it to the oldest generation (the cost Note [Objects renewed
    # across rounds] in offcore/residency.py describes). So ``_submit`` drops the finished tasks that did not
    # fail once the list has grown to ``_prune_at`` (twice what the last pass kept, plus _PRUNE_EVERY:
    # linear work over a backward however far the worker lags). The failed ones stay, in order, so the first
    # failure raised is the same; a task not finished stays, so waiting for ``_futures`` waits for the same
    # work; an empty list still means that nothing is queued (``_worker_idle``).
    def _pump(self) -> None:
        """Worker: run the queued tasks in order until none is left."""
        cond, tasks = self._task_done, self._tasks
        while True:
            with cond:
                if not tasks:
                    self._pumping = False
                    return
                task = tasks.popleft()
            try:
                task.fn(*task.args)  # type: ignore[misc]
            except BaseException as exc:  # kept for _drain / step() to raise, as a Future kept it
                task.error = exc
            with cond:
                task.finished = True
                task.fn = task.args = None  # what it held (buffers, events) goes now
                cond.notify_all()

    def _wait_task(self, task: _Task) -> None:
        """Block until ``task`` ran (its failure stays in it)."""
        if task.finished:
            return
        with self._task_done:
            while not task.finished:
                self._task_done.wait()

    def _worker_idle(self) -> bool:
        """Nothing queued on the worker (submissions not waited for are all in ``_futures``)."""
        with self._lock:
            return not self._futures

    def _drain(self) -> None:
        """Wait for the worker's queue; re-raise the first exception it met (Note [Host work runs on one worker thread])."""
        with self._lock:
            futures, self._futures = self._futures, []
        error: BaseException | None = None
        for future in futures:
            self._wait_task(future)
            if error is None:
                error = future.error
        self._release_landed()
        if error is not None:
            self._end_round()
            raise error

    def run_on_host(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker after everything queued (host tensors stay host memory)."""
        self._drain()
        future = self._worker.submit(fn, *args)
        return future.result()

    def host_grads(self) -> list[torch.Tensor]:
        """The accumulated host gradients, in parameter order (:meth:`gradients_to_host` first)."""
        self.gradients_to_host()
        return [s.master.grad for s in self._slots if s.master.grad is not None]

    @property
    def stepped_any(self) -> bool:
        """Whether a host step of the current round already ran (or is queued)."""
        return any(s.stepped for s in self._slots)

    # -- lifecycle --------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        """Refuse ``what`` on a closed optimizer: its host copies are gone, so it would step nothing."""
        if self._closed:
            raise IllegalTransitionError(
                f"OffloadOptimizer.{what} after close(): the optimizer gave its host memory back and steps "
                "nothing; make a new OffloadOptimizer (load its state_dict(), saved before close(), to go on)"
            )

    def close(self) -> None:
        """Wait for work in flight, remove the hooks, give the host memory back."""
        if self._closed:
            return
        try:
            self.synchronize()
        finally:
            self._closed = True
            self._release_everything()

    def _release_everything(self) -> None:
        with contextlib.suppress(Exception):
            self._worker.shutdown(wait=True)
        for slot in self._slots:
            slot.unhook()
            if slot.h2d is not None:
                with contextlib.suppress(Exception):
                    slot.h2d.synchronize()
        self._release_landed(wait=True)
        handle = getattr(self, "_wait_handle", None)
        if handle is not None:
            handle.remove()
        for hooked in getattr(self, "_state_dict_hooked", {}).values():
            hooked.remove()
        params_handle = getattr(self, "_params_handle", None)
        if params_handle is not None:
            params_handle._detach_host_optimizer(self)
        host = self._host
        if host is not None:
            host.state.clear()
            for slot in self._slots:
                slot.master.grad = None
        for slot in self._slots:
            for buffer in slot.buffers:
                self._pool.release(buffer)
            slot.buffers = []
        self._pool.trim()
        if self._nvme is not None:
            for slot in self._slots:
                if slot.state_buf is not None:
                    self._state_pool.release(slot.state_buf)
                    slot.state_buf = None
            self._state_pool.trim()
            _drop_nvme(self._nvme, self._nvme_owned, self._nvme_base)
        self.ledger = Ledger()
        _unclaim(self)  # Note [One OffloadOptimizer per parameter]
        empty = torch.empty(0)
        for slot in self._slots:  # the views of the pool's blocks go, so the blocks' memory goes
            slot.master = slot.grad = empty
            slot.stage = slot.h2d_dst = slot.h2d_pair = None
            slot.group = {**slot.group, "params": []}  # the host group listed the masters (pinned views)
        self._host = None
        self._pending_h2d.clear()
        self._rs = None

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadOptimizer:
        raise ConfigurationError(
            "OffloadOptimizer cannot be deep-copied: it owns host copies in a pinned pool, a worker thread and "
            "hooks on the device parameters; to copy its state use opt.state_dict() (and load it into another "
            "OffloadOptimizer with load_state_dict)"
        )

    def __copy__(self) -> OffloadOptimizer:
        raise ConfigurationError(
            "OffloadOptimizer cannot be copied (it owns a pinned pool, a worker thread and hooks); use "
            "opt.state_dict() and load_state_dict() on another OffloadOptimizer"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise ConfigurationError(
            "OffloadOptimizer cannot be pickled (it owns a pinned pool, a worker thread and hooks); save "
            "opt.state_dict() instead (torch.save(opt.state_dict(), path))"
        )

    def __enter__(self) -> OffloadOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        name = self._optimizer_class.__name__
        return (
            f"OffloadOptimizer({name}, {len(self._slots)} parameters, masters="
            f"{'fp32' if self._master_weights else 'param dtype'}, offload_gradients={self._offload_gradients})"
        )


def _grad_hook(opt: OffloadOptimizer, slot: _Slot) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(opt)

    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._on_gradient(slot)

    return hook


def _pre_grad_hook(opt: OffloadOptimizer, slot: _Slot) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(opt)
    accumulator = _grad_accumulator(slot.param)  # torch.autograd.grad runs the hook too, writing no .grad

    def hook(grad: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None and not optimizer._closed and _accumulates(accumulator):
            optimizer._pre_gradient(slot)

    return hook


def _backward_end_callback(opt: OffloadOptimizer) -> Callable[[], None]:
    ref = weakref.ref(opt)

    def callback() -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._backward_ended()

    return callback


# Note [The forward pre-hook under torch.compile]
# The hook is global (every module's call runs it), so dynamo traces it inside a compiled module's
# ``_call_impl``: it would break the graph (it sets attributes, records events, registers hooks). Under
# tracing it returns at once (``torch.compiler.is_compiling()`` is a constant there, so no graph break), and
# the waits happen eagerly, one call earlier: at ``torch.compile(module)``'s wrapper (an ``OptimizedModule``,
# whose own call runs the hook outside the compiled frame), for every parameter of the wrapped module — the
# whole model, or one block when each block is compiled (``model.layers[i] = torch.compile(block)``). Each
# parameter is then current before the compiled code reads it (tests/integrations/test_compile.py).
def _compiled_inside(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose parameters this (eager) call of ``module`` must make current for compiled code."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return [module._orig_mod]
    return []


def _forward_pre_hook(opt: OffloadOptimizer) -> Callable[..., None]:
    ref = weakref.ref(opt)

    def use(optimizer: OffloadOptimizer, module: torch.nn.Module) -> None:
        by_param = optimizer._device_params
        mine = False
        for param in module._parameters.values():
            if param is None:
                continue
            slot = by_param.get(id(param))
            if slot is not None:
                mine = True
                optimizer._on_use(slot)
        if mine and id(module) not in optimizer._state_dict_hooked:
            optimizer._watch_state_dict(module)

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # Note [The forward pre-hook under torch.compile]
            return
        optimizer = ref()
        if optimizer is None:
            return
        use(optimizer, module)
        for compiled in _compiled_inside(module):
            for sub in compiled.modules():
                use(optimizer, sub)

    return hook


def _state_dict_pre_hook(opt: OffloadOptimizer) -> Callable[..., None]:
    # Note [A checkpoint reads landed parameters]
    # After step() a parameter's upload may still be in flight (or held back by upload_budget);
    # the next forward's pre-hook waits for it, but ``model.state_dict()`` right after step()
    # (a checkpoint) reads the parameter with no module call in between, and would save a torn
    # or stale value. Every module whose parameters this optimizer updates gets this hook the
    # first time forward runs it (a step needs a forward first), so its state_dict waits for
    # (and if needed issues) exactly those uploads. offcore_torch.distributed does the same for
    # FSDP2's root (Note [Checkpoints read landed parameters]).
    ref = weakref.ref(opt)

    def hook(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        optimizer = ref()
        if optimizer is None or optimizer._closed:
            return
        by_param = optimizer._device_params
        params = [p for p in module._parameters.values() if p is not None and id(p) in by_param]
        if params:
            optimizer.wait_for_parameters(params)
            optimizer._device.current_stream().synchronize()  # the host reads the values next

    return hook


def _own_params(opt: OffloadOptimizer, module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of ``module`` itself (not its children's) whose uploads ``opt`` makes."""
    by_param = opt._device_params
    return [p for p in module._parameters.values() if p is not None and id(p) in by_param]


def _load_state_dict_pre_hook(opt: OffloadOptimizer) -> Callable[..., None]:
    # Note [Writes to parameters after step()]: before a module's load_state_dict writes its parameters,
    # their uploads from the last step land (or are issued and land), so none overwrites what is loaded.
    ref = weakref.ref(opt)

    def hook(module: torch.nn.Module, *args: Any) -> None:
        optimizer = ref()
        if optimizer is None or optimizer._closed:
            return
        params = _own_params(optimizer, module)
        if params:
            optimizer._settle(params)

    return hook


def _load_state_dict_post_hook(opt: OffloadOptimizer) -> Callable[..., None]:
    # Note [Writes to parameters after step()]: after the load, the masters of the parameters it wrote are
    # read from the device (the next step starts from the loaded weights, not from the stale masters).
    ref = weakref.ref(opt)

    def hook(module: torch.nn.Module, incompatible_keys: Any) -> None:
        optimizer = ref()
        if optimizer is None or optimizer._closed:
            return
        params = _own_params(optimizer, module)
        if params:
            optimizer._refresh(params)

    return hook


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _shutdown(
    worker: concurrent.futures.ThreadPoolExecutor, handle: Any, nvme: NvmeTier | None, owned: bool, base: int
) -> None:
    handle.remove()
    worker.shutdown(wait=False)
    if nvme is not None:
        _drop_nvme(nvme, owned, base)


def _drop_nvme(nvme: NvmeTier, owned: bool, base: int) -> None:
    """The optimizer's files go with it: its own tier is closed, a shared one loses only its keys."""
    with contextlib.suppress(Exception):
        if owned:
            nvme.close()
            return
        for key in list(nvme.keys()):
            if isinstance(key, tuple) and key[0] == base:
                with contextlib.suppress(Exception):
                    nvme.delete(key)
