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
# ``.grad``: the shown gradient still there means "not cleared" (it is removed, so autograd makes a fresh
# one, and the host keeps summing: torch adds into a ``.grad`` not cleared); None means cleared (the host
# gradient starts over: ``_clear_host_gradient``); a tensor of the user's is added into by autograd and
# copied over as the first gradient. ``step()`` and the host-gradient readers check the same before
# reading (``_sync_shown``), so a ``model.zero_grad()`` between backward and ``step()`` skips those
# parameters, as torch's step skips a None ``.grad``. ``zero_grad(set_to_none=False)`` zeroes the host
# gradient through the wrapper. A ``_HostGradient`` kept past a clear of its parameter (``_Slot.clears``)
# refuses to be read: the host buffer is the next round's. DDP (``attach_ddp``) and FSDP2 hand gradients
# over without the optimizer's hooks: their parameters show nothing, and only ``opt.zero_grad()`` clears
# their host gradients (a gradient after a step with no ``opt.zero_grad()`` since is refused, Note [Host
# gradients are cleared by opt.zero_grad()]).
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
# in ``host_updated`` instead (Note [The next step starts early] in parameters.py): its first copies
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
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from offcore_layout import describe, plain_tensor_problem

from offcore.errors import (
    CapacityExceededError,
    ConfigurationError,
    CopyFailedError,
    IllegalTransitionError,
    OffcoreError,
    OffcoreWarning,
    StorageError,
)
from offcore.inflight import must_wait
from offcore.kinds import Kind, Tier
from offcore.ledger import Ledger
from offcore.nvme import NvmeSpec, NvmeTier, pipelined
from offcore.objects import State
from offcore.pool import HostBuffer
from offcore.protocols import Capability
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import Scheduler
from offcore.trace import TraceRecorder
from offcore.units import format_bytes, parse_size
from offcore_torch.nvme import nvme_tier_for, open_nvme
from offcore_torch.runtime import check_bool, check_device, runtime_for

__all__ = ["OffloadOptimizer", "OffloadGradScaler", "MASTER_WEIGHTS_KEY"]

MASTER_WEIGHTS_KEY = "offcore_master_weights"
"""Top-level key of :meth:`OffloadOptimizer.state_dict` holding fp32 masters by parameter index
(only when the masters' dtype differs from the device parameters'; torch optimizers ignore it)."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_NO_STEPS_UNDER_BACKWARD = (
    "OffloadOptimizer: {what} steps parameters under backward, as their gradients land on the host; with "
    "offload_gradients=False the gradients stay on the device until step(), so nothing could step under "
    "backward: drop {what} or keep offload_gradients=True"
)
_LEAD_FRACTION = 16  # step(): the first-needed parameters up to 1/16 of the bytes are stepped (and uploaded) first
_LEAD_MIN_BYTES = 1024**2  # below this many master bytes, step() makes one optimizer call
_STEP_ON_CALLER = True  # step()'s host step on the caller when the worker is idle (Note [One host step at step()]);
# benchmarks/optimizer_offload.py (b) turns it off in every other round, to compare the two side by side
_MASTER = "offcore_master"  # the fp32 master's entry in a parameter's object on NVMe (Note [Masters on NVMe])
_INFLIGHT_DEFAULT_BYTES = 64 * 1024**2  # max_inflight_gradients: at least this (Note [In-flight gradients are capped])
_NVME_GROUP_BYTES = 4 * 1024**2  # tier="nvme": a group is one parameter or small ones up to this many master bytes
_NVME_LOOKAHEAD = 2  # tier="nvme": groups read ahead of the one stepped (k + 2 groups of bounce buffers live; benchmarks/nvme.py: 1.37 x -> 1.62 x sequential)
_COLLECT, _STEPPED, _USES = "collect", "stepped", "uses"  # phases of a round (Note [The optimizer's moves ...])


class _Slot:
    """One device parameter and its host copies."""

    __slots__ = (
        "index",
        "param",
        "group",
        "master",
        "grad",
        "stage",
        "buffers",
        "accumulated",
        "arrivals",
        "stepped",
        "h2d",
        "synced_version",
        "synced_storage",
        "h2d_versions",
        "h2d_dst",
        "hook",
        "layout",
        "state_nbytes",
        "state_buf",
        "host_param",
        "upload_due",
        "nvme_master",
        "pre_hook",
        "shown",
        "clears",
    )

    def __init__(self, index: int, param: torch.Tensor, group: dict[str, Any]) -> None:
        self.index = index
        self.param = param
        self.group = group
        self.master: torch.Tensor = param  # replaced by the host copy
        self.grad: torch.Tensor = param
        self.stage: torch.Tensor | None = None  # pinned, device dtype: casts of masters for the H2D
        self.buffers: list[HostBuffer] = []
        self.accumulated = False  # main thread: the host gradient holds a sum to add to
        self.arrivals = 0  # gradients of this round
        self.stepped = False  # its host step of this round ran (or is queued)
        self.h2d: Any = None  # event of the last H2D of the master into the device parameter
        self.synced_version = param._version
        # Note [Writes to parameters after step()]: the storage the master matched (``p.data = ...`` changes it)
        self.synced_storage = _storage_id(param)
        self.h2d_versions: tuple[int, ...] = ()  # versions the parameter may have once its last H2D landed
        # the last H2D's destination, kept alive until the next one: ``p.data = ...`` may drop the parameter's
        # storage while the copy into it is in flight (Note [Writes to parameters after step()])
        self.h2d_dst: torch.Tensor | None = None
        self.hook: Any = None
        # tier="nvme" (Note [Optimizer states on NVMe]): the state tensors kept on disk, as
        # (name, dtype, shape, byte offset) in one object of ``state_nbytes``; ``state_buf`` is the
        # pool buffer holding them while they are in memory (read for a step, or a failed write)
        self.layout: list[tuple[str, torch.dtype, torch.Size, int]] | None = None
        self.state_nbytes = 0
        self.state_buf: HostBuffer | None = None
        # Note [Parameters on the host with offload_parameters]: the handle's host copy of the parameter
        # (None: the parameter lives on the device and the step is uploaded into it)
        self.host_param: torch.Tensor | None = None
        # Note [One host step at step()]: stepped by step(), its upload not issued yet (sched lock)
        self.upload_due = False
        self.nvme_master = False  # its master lives in its NVMe object between steps (Note [Masters on NVMe])
        # Note [The host gradient is the device parameter's .grad]: the tensor hook that reads ``param.grad``
        # before autograd accumulates into it, and the _HostGradient ``param.grad`` was last set to (or None)
        self.pre_hook: Any = None
        self.shown: _HostGradient | None = None
        self.clears = 0  # times its host gradient was cleared: a _HostGradient of an earlier count is stale


class _AllOf:
    """The transfers of one group: ``synchronize()`` waits for all, then raises the first failure."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def synchronize(self) -> None:
        error: BaseException | None = None
        for handle in self.handles:
            try:
                handle.synchronize()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def _params_of(group: Any) -> list[Any]:
    """The parameters of a group (a dict with ``params``, or the parameters themselves): tensors or
    ``(name, tensor)`` pairs, as torch's optimizers take them."""
    params = group["params"] if isinstance(group, dict) else group
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _tensor_of(param: Any) -> Any:
    """The tensor of a parameter given as a tensor or as ``(name, tensor)`` (``model.named_parameters()``)."""
    if isinstance(param, tuple) and len(param) == 2 and isinstance(param[0], str):
        return param[1]
    return param


def _check_params(groups: list[Any]) -> None:
    """Refuse what cannot be offloaded before anything is allocated: non-tensors, sparse parameters."""
    for group in groups:
        for named in _params_of(group):
            param = _tensor_of(named)
            if not isinstance(param, torch.Tensor):
                raise ConfigurationError(
                    f"OffloadOptimizer params must be tensors or (name, tensor) pairs, got {type(param).__name__}"
                )
            name = f" {named[0]!r}" if isinstance(named, tuple) else ""
            if _is_dtensor(param):
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({describe(param)}) is a DTensor (sharded with "
                    "fully_shard / FSDP2): its bytes are the local shard, not the global shape. Use "
                    "offcore_torch.distributed.FSDPOffloadOptimizer(model, optimizer_class, device=...), which steps "
                    "each rank's shard on the host"
                )
            problem = plain_tensor_problem(param)
            if problem is not None and param.layout is torch.strided:
                # Note [Raw pointers see checked tensors only]: the device copies only plain tensors
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({describe(param)}) cannot be offloaded: {problem}. "
                    "Offload plain dense parameters"
                )
            if not param.is_leaf:
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({describe(param)}) is not a leaf tensor (it was computed "
                    f"by {type(param.grad_fn).__name__}); optimizers step leaves: pass the nn.Parameter, or "
                    "tensor.detach().requires_grad_()"
                )
            if param.layout is not torch.strided:
                raise ConfigurationError(
                    f"OffloadOptimizer: parameter{name} ({tuple(param.shape)}) is sparse ({param.layout}); sparse "
                    "parameters are not supported (the host copies are dense): make it a dense parameter"
                )


def _is_dtensor(tensor: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed when unused)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(tensor, dtensor)


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


def _check_dense_gradient(slot: _Slot, grad: torch.Tensor) -> None:
    """A sparse gradient (``nn.Embedding(sparse=True)``) is refused before any copy starts."""
    if grad.layout is not torch.strided:
        raise ConfigurationError(
            f"OffloadOptimizer: parameter {slot.index} ({tuple(slot.param.shape)}) got a sparse gradient "
            f"({grad.layout}); sparse gradients are not supported (the host gradient is dense): use a dense "
            "embedding (nn.Embedding(..., sparse=False))"
        )


def _unhooked_step(host: torch.optim.Optimizer) -> None:
    """``host.step()`` without torch's step hooks (global and per-instance): the host optimizer's
    steps are parts of one ``OffloadOptimizer.step()``, whose hooks run once, on the caller's thread
    (Note [Step hooks run once per step])."""
    step = type(host).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        host.step()
    else:
        inner(host)


def _storage_id(param: torch.Tensor) -> int | None:
    """The identity of ``param``'s storage object: ``p.data = ...`` changes it; offload_parameters' freeing and
    re-allocating under the same storage does not (Note [Parameter storage is swapped, the Parameter object
    is not] in parameters.py), nor does it run that class's ``__torch_function__`` (None: no storage)."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return int(param.untyped_storage()._cdata)
        except Exception:
            return None


def _typed(buffer: HostBuffer, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    return buffer.view.view(dtype).view(shape)


_WORKER_THREAD = threading.local()  # marked on the optimizers' worker threads (Note [Streamed parameters ...])


def _mark_worker_thread() -> None:
    """The worker's initializer: a module function, so the executor holds no reference to its optimizer."""
    _WORKER_THREAD.marked = True


def _lead_and_rest(slots: list[_Slot]) -> tuple[list[_Slot], list[_Slot]]:
    """``step()``'s two optimizer calls (Note [One host step at step()]): the first-needed parameters
    up to 1/_LEAD_FRACTION of the master bytes (none when there is little to step), then the rest."""
    total = sum(s.master.numel() * s.master.element_size() for s in slots)
    if len(slots) < 2 or total < _LEAD_MIN_BYTES:
        return [], slots
    lead, size = [], 0
    for slot in slots[:-1]:
        lead.append(slot)
        size += slot.master.numel() * slot.master.element_size()
        if size * _LEAD_FRACTION >= total:
            break
    return lead, slots[len(lead) :]


class _HostGradient(torch.Tensor):
    """A device parameter's ``.grad`` whose values are the optimizer's host gradient (Note [The host gradient
    is the device parameter's .grad]): it claims the parameter's device, dtype and shape and holds no device
    memory; every torch operator on it runs on the host gradient (an in-place one writes what ``step()``
    uses), and its results go to the parameter's device."""

    _host: torch.Tensor
    _owner: weakref.ref[OffloadOptimizer]
    _slot: _Slot
    _round: int

    @staticmethod
    def __new__(
        cls, host: torch.Tensor, dtype: torch.dtype, device: torch.device, owner: weakref.ref[Any], slot: _Slot
    ) -> _HostGradient:
        marker = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, host.shape, dtype=dtype, device=device, requires_grad=False
        )
        marker._host, marker._owner, marker._slot, marker._round = host, owner, slot, slot.clears
        return marker

    def __repr__(self) -> str:  # type: ignore[override]
        return f"HostGradient(shape={tuple(self.shape)}, device={self.device}, host dtype={self._host.dtype})"

    def host(self) -> torch.Tensor:
        """The host tensor behind this gradient; refused once the round it belongs to was cleared."""
        owner = self._owner()
        if owner is None or owner._closed or self._slot.clears != self._round or self._slot.master.grad is None:
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
        on_host = not in_place or isinstance(target, _HostGradient)

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
                    return _HostGradient(t, first.dtype, first.device, first._owner, first._slot)
                return t

            return pytree.tree_map(rewrap, out)
        return pytree.tree_map(lambda t: t.to(first.device) if isinstance(t, torch.Tensor) else t, out)


class OffloadOptimizer(torch.optim.Optimizer):
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
        self._futures: list[concurrent.futures.Future[Any]] = []
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
        self._upload_budget = 1 << 62 if upload_budget is None else parse_size(upload_budget, what="upload_budget")
        self._max_inflight = (
            None
            if max_inflight_gradients is None
            else parse_size(max_inflight_gradients, what="max_inflight_gradients")
        )
        self._rs: ResidencyScheduler | None = None
        self._phase = _COLLECT
        self._used: set[int] = set()  # parameters the forward of this round's uses phase used
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

    def remove_gradient_hooks(self) -> None:
        """Stop taking gradients from post-accumulate-grad hooks (they come through :meth:`accept_gradient`)."""
        self._frozen.clear()
        for slot in self._slots:
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None
            if slot.pre_hook is not None:
                slot.pre_hook.remove()
                slot.pre_hook = None
            if slot.shown is not None and slot.param.grad is slot.shown:
                slot.param.grad = None
            slot.shown = None

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
            with self._lock:
                pending = list(self._pending_h2d.values())
            for slot in pending:
                self._wait_parameter(slot, traced=False)

    def _settle_worker(self) -> None:
        """Wait for everything queued on the worker; a failure stays queued for ``step()`` / ``_drain`` to raise."""
        with self._lock:
            futures = list(self._futures)
        concurrent.futures.wait(futures)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
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
                concurrent.futures.wait([oldest])  # the worker frees staging as it accumulates

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

    # -- host steps -----------------------------------------------------------------------
    def _step_slots(self, slots: list[_Slot], rs: ResidencyScheduler | None = None) -> None:
        """Worker: one host optimizer step over ``slots`` only, the casts for their H2D copies, and
        (``rs``) the core's uploads due once they are updated."""
        assert self._host is not None
        for slot in slots:
            if slot.h2d is not None:  # the previous H2D still reads the master (or its stage)
                with contextlib.suppress(Exception):  # a failed copy reads nothing any more; its use re-issues it
                    slot.h2d.synchronize()
        chosen: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        for slot in slots:
            chosen[id(slot.group)].append(slot.master)
        saved = [(group, group["params"]) for group in self._host.param_groups]
        began = time.perf_counter()
        with self._host_work():  # on step()'s caller inside `with dev:` too: its temporaries are host memory
            try:
                for group, _ in saved:
                    group["params"] = chosen.get(id(group), [])
                _unhooked_step(self._host)
            finally:
                for group, params in saved:
                    group["params"] = params
            if self.trace is not None:
                self.trace.span("host", "step", began, time.perf_counter() - began, params=len(slots))
            for slot in slots:
                if slot.stage is not None:
                    slot.stage.copy_(slot.master)
        if rs is not None:
            self._host_updated(rs, slots)

    def _step_lead_and_rest(self, lead: list[_Slot], rest: list[_Slot], rs: ResidencyScheduler) -> None:
        """For ``step()``, on its caller or the worker (Note [One host step at step()]): step ``lead``
        and issue its uploads, then step ``rest`` in one optimizer call; their uploads are due
        (Note [Who issues step()'s uploads])."""
        if lead:
            self._step_slots(lead, rs)
        if rest:
            self._step_slots(rest)
            self._mark_due(rest)

    def _mark_due(self, slots: list[_Slot]) -> None:
        """``slots`` (in need order) were stepped by ``step()``: their uploads are due (Note [Who issues step()'s
        uploads])."""
        with self._sched_lock:
            for slot in slots:
                slot.upload_due = slot.host_param is None
            # added to those still due (streamed parameters stepped under backward: Note [Streamed parameters
            # are written by the caller]); _issue_due skips a slot issued meanwhile (upload_due False)
            self._due = [*self._due, *slots] if self._due else slots

    def _issue_due(self, rs: ResidencyScheduler) -> None:
        """Issue every upload ``step()`` left due, in need order, on this thread (Note [Who issues step()'s
        uploads]; sched lock held)."""
        slots, self._due = self._due, []
        keys = []
        for slot in slots:
            if slot.upload_due:
                slot.upload_due = False
                keys.append(slot.index)
        # one offer for all of them (host_updated_all), not one scan of the plan per parameter; a failed
        # copy ends the offer (refused): what it did not issue stays offloaded and its use issues it
        with contextlib.suppress(Exception):
            self._execute(rs, rs.host_updated_all(keys))

    def _h2d_after_compute(self) -> None:
        """Order the H2D stream after the work queued so far on this thread's compute stream.

        H2D copies issued from the main thread (``step()``, ``load_state_dict``) overwrite
        parameters that compute already queued may still read; the worker's copies are ordered by
        the gradient's D2H event instead (its parameter's last use in backward precedes it).
        """
        done = self._device.new_event()
        self._device.current_stream().record_event(done)
        self._runtime.h2d_stream.wait_event(done)

    def _copy_retrying(self, dst: Any, src: Any, stream: Any, what: str, *, recover: bool = False) -> Any:
        """``copy_`` on ``stream``; a copy refused at submission is tried once more after clearing the
        stream (Note [Failed copies in the optimizer]); a second refusal raises CopyFailedError."""
        if recover:
            self._runtime.recover(stream)
        try:
            return self._device.copy_(dst, src, stream=stream)
        except Exception as first:
            self._runtime.recover(stream)
            try:
                event = self._device.copy_(dst, src, stream=stream)
                self._recovered(f"the copy of {what or 'a tensor'} (refused at submission)", first)
                return event
            except Exception as exc:
                raise CopyFailedError(
                    f"OffloadOptimizer: the copy of {what or 'a tensor'} failed twice ({first}; {exc})"
                ) from exc

    def _recovered(self, what: str, exc: BaseException) -> None:
        """A failed copy was made again and landed (Note [Failed copies in the optimizer]): counted in
        ``copy_failures`` and said, as the other bindings say theirs; the numbers are unchanged."""
        with self._lock:
            self.copy_failures += 1
        warnings.warn(
            f"offcore: {what} failed ({exc}); copied again, recovered without changing a number "
            "(see OffloadOptimizer.copy_failures)",
            OffcoreWarning,
            stacklevel=3,
        )

    def _copy_up(self, slot: _Slot, *, force: bool = False) -> Any:
        """Issue the H2D of ``slot``'s master (its cast stage) into the device parameter; its event.

        Unless ``force``, an upload of a parameter written by someone else since it matched the master
        is cancelled (Note [Writes to parameters after step()]): the event returned copies nothing."""
        if not force and self._written(slot):
            cancelled = self._device.new_event()
            self._runtime.h2d_stream.record_event(cancelled)
            return cancelled
        src = slot.stage if slot.stage is not None else slot.master
        before = slot.param._version
        dst = slot.param.detach()
        event = self._copy_retrying(
            dst,
            src,
            self._runtime.h2d_stream,
            f"parameter {slot.index} to the device (its host master holds the stepped value: opt.synchronize() "
            "uploads it again)",
        )
        after = slot.param._version  # a copy bumps the version when issued (CUDA) or when it lands (the fake device)
        with self._lock:
            slot.h2d, slot.h2d_dst = event, dst
            slot.h2d_versions = (after,) if after != before else (before, before + 1)
            self._pending_h2d[id(slot.param)] = slot
        return event

    # -- the core scheduler (Note [The optimizer's moves go through the core]) ---------------
    def _round(self) -> ResidencyScheduler:
        """The current round's scheduler; gradients after ``step()`` begin a new round (sched lock held)."""
        rs = self._rs
        if rs is None or self._phase != _COLLECT:
            rs = self._begin_round()
        return rs

    def _begin_round(self) -> ResidencyScheduler:
        self._close_round()
        rs = ResidencyScheduler(
            self._predictor,
            duration=self._runtime.h2d_duration,
            prefetch="asap",
            budget=self._upload_budget,
            margin=0.0,
        )
        rs.forward_began(time.perf_counter())
        for slot in self._slots:
            if slot.host_param is not None:
                continue  # streamed in by offload_parameters, never uploaded here
            rs.register(slot.index, Kind.PARAMETER, slot.param.numel() * slot.param.element_size())
            rs.awaiting_host(slot.index)
        rs.make_plan()
        self._rs, self._phase = rs, _COLLECT
        self._used.clear()
        return rs

    def _close_round(self) -> None:
        """Upload what the budget still held back; the uses seen teach the predictor (sched lock held)."""
        rs = self._rs
        if rs is None:
            return
        self._upload_rest(rs)
        if self._phase == _USES:
            rs.backward_ended(time.perf_counter())
        self._rs = None

    def _upload_rest(self, rs: ResidencyScheduler) -> None:
        self._issue_due(rs)
        rest = [k for k, o in rs.objects.items() if k >= 0 and o.state is State.OFFLOADED]
        if rest:
            self._h2d_after_compute()
            for key in rs.upload_order(rest):
                rs.reloaded(key, self._copy_up(self._slots[key]))

    def _execute(self, rs: ResidencyScheduler, actions: Iterable[Any]) -> None:
        """Carry out the core's actions (sched lock held)."""
        for action in actions:
            if action.kind is ActionKind.PREFETCH:
                try:
                    event = self._copy_up(self._slots[action.key])
                except BaseException:
                    rs.refused(action.key, "failed")
                    raise
                rs.started(action.key, event)
            # EVICT: the upload writes the parameter's own storage; nothing to free, the copy stays

    # Note [Streamed parameters are written by the caller]
    # A parameter that offload_parameters streams (params_on_host=False: this optimizer keeps masters of its
    # own) has a device storage only while the handle holds it, and touching it outside a module's use makes
    # the handle bring it in and track it -- state the handle changes from the thread that runs the model.
    # Host steps under backward (accumulation_steps, last_micro_step) run on the worker: had the worker
    # issued their uploads, the handle would have been driven from two threads at once (seen: a copy into a
    # storage the handle had just freed, a prefetch started twice, a use-after-free). So the worker marks
    # such uploads due (Note [Who issues step()'s uploads]) and the caller's thread issues them, at
    # step(), zero_grad(), the parameter's next use or synchronize(), as it does for step()'s own.
    def _host_updated(self, rs: ResidencyScheduler, slots: list[_Slot]) -> None:
        """The host steps of ``slots`` finished: the core returns the uploads due now (one offer for all)."""
        if getattr(_WORKER_THREAD, "marked", False):
            streamed = [slot for slot in slots if getattr(slot.param, "_offcore_slot", None) is not None]
            if streamed:
                self._mark_due(streamed)
                slots = [slot for slot in slots if getattr(slot.param, "_offcore_slot", None) is None]
        keys = [slot.index for slot in slots if slot.host_param is None]
        if keys:
            with self._sched_lock:
                self._execute(rs, rs.host_updated_all(keys))

    def _make_current(self, slot: _Slot) -> None:
        """The device parameter of ``slot`` is about to be read: its upload is issued (on demand, if
        the budget held it back) and the compute stream waits for it (sched lock held)."""
        rs = self._rs
        if rs is not None:
            if slot.upload_due:  # stepped by step(), not issued yet: all of them now (Note [Who issues ...])
                began = time.perf_counter()
                self._issue_due(rs)
                if self.trace is not None:  # the use pays it: a wait of the forward
                    self.trace.span(
                        "wait",
                        f"param {slot.index} (step()'s uploads issued by its use)",
                        began,
                        time.perf_counter() - began,
                    )
            obj = rs.objects.get(slot.index)
            if obj is not None:
                if obj.state is State.OFFLOADED:
                    rs.reloaded(slot.index, self._copy_up(slot))
                elif obj.state is State.PREFETCHING:
                    rs.awaited(slot.index)
        if self._pending_h2d:
            self._wait_parameter(slot)

    def _on_use(self, slot: _Slot) -> None:
        """A module is about to read ``slot``'s parameter (forward pre-hook, main thread)."""
        if slot.stepped and self._futures:
            # Its host step of this round is queued or running (accumulation_steps / last_micro_step)
            # and a forward reads the parameter before step(): the worker issues the upload when the
            # step finishes, which would write the parameter after this forward saved it for
            # backward. Let the queued host work finish first, so the upload is issued and waited for
            # below (rare: step() normally ends the round before the next forward).
            self._drain()
        if self._rs is None:
            if self._pending_h2d:
                self._wait_parameter(slot)
            return
        with self._sched_lock:
            rs = self._rs
            if rs is None or self._phase == _COLLECT:  # a micro-step's forward: no uses phase
                self._make_current(slot)
                return
            key = slot.index
            if key in self._used:
                if self._pending_h2d:
                    self._wait_parameter(slot)
                return
            now = time.perf_counter()
            if self._phase == _STEPPED:
                rs.backward_began(now)  # the uses phase of the round: the next forward
                self._phase = _USES
            self._used.add(key)
            self._make_current(slot)
            rs.consumed(key)
            self._execute(rs, rs.used(key, now, managed_key=key))

    def _wait_parameter(self, slot: _Slot, *, traced: bool = True) -> None:
        """Make the compute stream wait for ``slot``'s H2D (a forward pre-hook); the host observes it."""
        with self._lock:
            if self._pending_h2d.pop(id(slot.param), None) is None:
                return
            event = slot.h2d
        began = time.perf_counter()
        try:
            self._device.current_stream().wait_event(event)
        except Exception as exc:  # the upload failed on its stream: the master is intact, upload again
            self._runtime.recover(self._runtime.h2d_stream)
            self._copy_up(slot, force=True)
            with self._lock:
                self._pending_h2d.pop(id(slot.param), None)
                event = slot.h2d
            try:
                self._device.current_stream().wait_event(event)
            except Exception as again:
                raise CopyFailedError(
                    f"OffloadOptimizer: the upload of parameter {slot.index} failed twice ({exc}; {again}); its "
                    "host master holds the stepped value: fix the cause and call opt.synchronize()"
                ) from again
            self._recovered(f"the upload of parameter {slot.index}", exc)
        if self.trace is not None and traced:
            self.trace.span("wait", f"param {slot.index}", began, time.perf_counter() - began)
        # the compute stream is ordered after the upload now: everything it does later (a write of the
        # user's) comes after the copy, so the version the copy left is the synced one. On the fake device
        # the copy landed (its compute is the host); on CUDA the copy bumped the version when issued
        # (h2d_versions), and querying would leave a copy not landed yet unsynced, and its master refreshed
        # from the device (the fp32 master rounded to bf16) before the next step.
        self._mark_synced(slot)

    def _observe(self, slot: _Slot) -> bool:
        """Whether ``slot`` has no H2D the host has not seen land (records its version if it just landed)."""
        with self._lock:
            if id(slot.param) not in self._pending_h2d:
                return True
            event = slot.h2d
        try:
            landed = event.query()
        except Exception:
            landed = False
        if landed:
            with self._lock:
                self._pending_h2d.pop(id(slot.param), None)
            self._mark_synced(slot)
        return landed

    def _mark_synced(self, slot: _Slot) -> None:
        """``slot``'s last H2D landed and the host saw it: the device parameter matches the master again,
        unless someone else wrote it meanwhile (Note [Writes to parameters after step()])."""
        version = slot.param._version
        if version in slot.h2d_versions and _storage_id(slot.param) == slot.synced_storage:
            slot.synced_version = version
        # else: written while the upload was in flight; synced_version stays, so the master is refreshed

    def _changed(self, slot: _Slot) -> bool:
        """Whether the device parameter was written by someone else since it last matched the master."""
        return slot.param._version != slot.synced_version or _storage_id(slot.param) != slot.synced_storage

    def _written(self, slot: _Slot) -> bool:
        """Note [Writes to parameters after step()]: no upload of ours in flight, and the parameter changed."""
        with self._lock:
            if id(slot.param) in self._pending_h2d:
                return False
        return self._changed(slot)

    def _check_fresh(self, slot: _Slot) -> None:
        """Note [Masters are refreshed when the device parameter changed] (main thread)."""
        if slot.host_param is not None:
            return  # the host copy is the data (Note [Parameters on the host with offload_parameters])
        if self._observe(slot) and self._changed(slot):
            self._drain()
            self._load_master(slot)

    def _settle(self, params: list[torch.Tensor]) -> None:
        """Before ``params`` are written by a module's ``load_state_dict`` (Note [Writes to parameters after
        step()]): their pending uploads are issued, land, and the host observes them."""
        self._drain()
        slots = [self._slot(p) for p in params]
        with self._sched_lock:
            for slot in slots:
                self._make_current(slot)  # issues a due or held-back upload; the compute stream waits for it
        for slot in slots:
            event = slot.h2d
            if event is not None:
                with contextlib.suppress(Exception):  # a failed upload: its use issues it again
                    event.synchronize()
            self._observe(slot)

    def _refresh(self, params: list[torch.Tensor]) -> None:
        """After a module's ``load_state_dict`` wrote ``params``: the masters of those it changed are read
        from the device now (Note [Writes to parameters after step()])."""
        for slot in (self._slot(p) for p in params):
            if self._observe(slot) and self._changed(slot):
                self._drain()  # as _check_fresh: the compute stream's writes are this thread's
                self._load_master(slot)

    def synchronize(self) -> None:
        """Wait for every copy and host step in flight; the device parameters are up to date after it."""
        self._drain()
        with self._sched_lock:
            if self._rs is not None:
                self._upload_rest(self._rs)
        with self._lock:
            pending = list(self._pending_h2d.values())
        for slot in pending:
            self._wait_parameter(slot)
        self._release_landed(wait=True)

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
        for slot in remaining:
            self._check_fresh(slot)
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
        return loss

    def _publish_uploads(self) -> None:
        """Note [Parameters read after step() are the stepped ones]: issue every upload of this step (due,
        or held back by ``upload_budget``) and make the compute stream wait for all of them: a device-side
        wait on a GPU (the host does not block), a block on the fake device, whose compute is the host."""
        began = time.perf_counter()
        with self._sched_lock:
            if self._rs is not None:
                self._upload_rest(self._rs)
        with self._lock:
            pending = list(self._pending_h2d.values())
        for slot in pending:
            self._wait_parameter(slot, traced=False)
        if self.trace is not None and pending:
            self.trace.span("wait", f"step()'s {len(pending)} uploads", began, time.perf_counter() - began)

    # -- optimizer states on NVMe (Note [Optimizer states on NVMe]) --------------------------
    def _groups(self, slots: list[_Slot]) -> list[list[_Slot]]:
        """One parameter, or consecutive small ones up to ~4 MiB of master bytes, per group."""
        groups: list[list[_Slot]] = []
        size = _NVME_GROUP_BYTES
        for slot in slots:
            nbytes = slot.master.numel() * slot.master.element_size()
            if size + nbytes > _NVME_GROUP_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(slot)
            size += nbytes
        return groups

    def _step_groups(self, groups: list[list[_Slot]], rs: ResidencyScheduler | None) -> None:
        """Worker: host steps over ``groups``; with tier="nvme", pipelined over their states on disk."""
        if self._nvme is None:
            for group in groups:
                self._step_slots(group, rs)
            return

        def compute(group: list[_Slot]) -> None:
            self._step_slots(group, rs)
            for slot in group:
                slot.stepped = True
                self._pack(slot)

        pipelined(
            groups, self._read_group, compute, self._write_group, release=self._release_group, lookahead=_NVME_LOOKAHEAD
        )

    def _key(self, slot: _Slot) -> tuple[int, int]:
        """``slot``'s object in the NVMe tier (unique in a tier shared by the device's bindings)."""
        return (self._nvme_base, slot.index)

    def _state_view(self, slot: _Slot) -> Any:
        assert slot.state_buf is not None
        return slot.state_buf.view[: slot.state_nbytes].numpy()

    def _attach(self, slot: _Slot, *, states: bool = True) -> None:
        """Point the host optimizer's state of ``slot`` (``states``) and its NVMe master at views of its
        state buffer (Note [Masters on NVMe])."""
        assert slot.layout is not None and slot.state_buf is not None
        raw = slot.state_buf.view
        for name, dtype, shape, offset in slot.layout:
            n = shape.numel() * torch.empty((), dtype=dtype).element_size()
            view = raw[offset : offset + n].view(dtype).view(shape)
            if name == _MASTER:
                slot.master.set_(view)
            elif states:
                assert self._host is not None
                self._host.state[slot.master][name] = view

    def _park(self, slot: _Slot) -> None:
        """Note [Masters on NVMe]: the master keeps its shape (the host optimizer's key, ``.grad``'s
        match) on a stride-0 view of a tiny storage: no memory; a write to it raises."""
        slot.master.set_(self._parking, 0, slot.master.shape, (0,) * slot.master.dim())

    def _read_object(self, slot: _Slot, *, states: bool = True) -> None:
        """Worker: ``slot``'s object from disk into a state buffer, synchronously (states too when ``states``)."""
        assert self._nvme is not None and slot.state_buf is None
        slot.state_buf = self._acquire_state(slot.state_nbytes)
        try:
            self._nvme.read(self._key(slot), self._state_view(slot)).synchronize()
        except BaseException:
            self._state_pool.release(slot.state_buf)
            slot.state_buf = None
            raise
        self._attach(slot, states=states)

    def _write_object(self, slot: _Slot) -> None:
        """Worker: pack ``slot``'s master and states, write them, wait, release the buffer (or delete)."""
        assert self._nvme is not None
        self._pack(slot)
        if slot.state_buf is not None:
            self._nvme.write(self._key(slot), self._state_view(slot), kind=Kind.OPTIMIZER_STATE).synchronize()
            self._release_group([slot])
        elif self._key(slot) in self._nvme:
            self._nvme.delete(self._key(slot))

    def _master_value(self, slot: _Slot) -> torch.Tensor:
        """Worker: ``slot``'s master, read from disk into a new tensor when it is parked there."""
        if not slot.nvme_master or slot.state_buf is not None:
            return slot.master
        assert self._nvme is not None and slot.layout is not None
        whole = torch.empty(slot.state_nbytes, dtype=torch.uint8)
        self._nvme.read(self._key(slot), whole.numpy()).synchronize()
        _, dtype, shape, offset = next(e for e in slot.layout if e[0] == _MASTER)
        n = shape.numel() * torch.empty((), dtype=dtype).element_size()
        return whole[offset : offset + n].view(dtype).view(shape).clone()

    def _read_group(self, group: list[_Slot]) -> Any:
        handles = []
        try:
            for slot in group:
                if slot.layout is None or slot.state_buf is not None:
                    continue  # no state yet, or still in memory (its last write failed)
                slot.state_buf = self._acquire_state(slot.state_nbytes)
                self._attach(slot)
                assert self._nvme is not None
                handles.append(self._nvme.read(self._key(slot), self._state_view(slot)))
        except BaseException:
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.synchronize()
            self._release_group(group)
            raise
        return _AllOf(handles)

    def _pack(self, slot: _Slot) -> None:
        """After a step or a load: the master (Note [Masters on NVMe]) and the big state tensors of ``slot``
        live in its state buffer, laid out again (a new buffer) when the set of tensors changed."""
        assert self._host is not None
        assert not (slot.nvme_master and slot.state_buf is None), "a parked master is read in before it is packed"
        state = self._host.state.get(slot.master) or {}
        entries: list[tuple[str, torch.dtype, torch.Size]] = []
        if slot.nvme_master:
            entries.append((_MASTER, slot.master.dtype, slot.master.shape))
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 1:
                entries.append((name, value.dtype, value.shape))
        if not entries:
            return

        def value_of(name: str) -> torch.Tensor:
            return slot.master if name == _MASTER else state[name]

        current = [(n, d, sh) for n, d, sh, _ in slot.layout or ()]
        if entries != current or slot.state_buf is None:
            layout, offset = [], 0
            for name, dtype, shape in entries:
                layout.append((name, dtype, shape, offset))
                offset += -(-shape.numel() * torch.empty((), dtype=dtype).element_size() // 64) * 64
            buffer = self._acquire_state(offset)
            for name, dtype, shape, at in layout:
                n = shape.numel() * torch.empty((), dtype=dtype).element_size()
                buffer.view[at : at + n].view(dtype).view(shape).copy_(value_of(name))
            old = slot.state_buf
            slot.layout, slot.state_nbytes, slot.state_buf = layout, offset, buffer
            self._attach(slot)
            if old is not None:
                self._state_pool.release(old)
            return
        raw = slot.state_buf.view
        for name, dtype, shape, offset in slot.layout or ():
            value = value_of(name)
            n = shape.numel() * torch.empty((), dtype=dtype).element_size()
            view = raw[offset : offset + n].view(dtype).view(shape)
            if value.data_ptr() != view.data_ptr():  # created by the step or a load, or replaced
                view.copy_(value)
                if name == _MASTER:
                    slot.master.set_(view)
                else:
                    state[name] = view

    def _write_group(self, group: list[_Slot]) -> Any:
        assert self._nvme is not None
        handles = []
        try:
            for slot in group:
                if slot.state_buf is not None:
                    handles.append(self._nvme.write(self._key(slot), self._state_view(slot), kind=Kind.OPTIMIZER_STATE))
        except BaseException:
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.synchronize()
            raise
        return _AllOf(handles)

    def _release_group(self, group: list[_Slot]) -> None:
        """The disk holds ``group``'s states and masters (or they were only read): their host copies go."""
        for slot in group:
            if slot.state_buf is None:
                continue
            if self._host is not None:
                state = self._host.state.get(slot.master, {})
                for name, *_ in slot.layout or ():
                    if name != _MASTER:
                        state.pop(name, None)
            if slot.nvme_master:
                self._park(slot)
            self._state_pool.release(slot.state_buf)
            slot.state_buf = None

    def _acquire_state(self, nbytes: int) -> HostBuffer:
        try:
            return self._state_pool.acquire(max(nbytes, 1))
        except CapacityExceededError as exc:
            raise CapacityExceededError(
                f"OffloadOptimizer(tier='nvme'): the bounce buffers ({format_bytes(self._state_pool.budget)}) "
                f"cannot hold a group's optimizer states ({format_bytes(nbytes)}); "
                f"{format_bytes(self._state_pool.used_bytes)} are in use"
            ) from exc

    def _storage_failed(self, exc: StorageError, slots: list[_Slot]) -> None:
        """A read or write of the states failed during ``step()``: say what was applied, lose nothing."""
        done = [s for s in slots if s.stepped]
        todo = [s for s in slots if not s.stepped]
        unwritten = [s.index for g in getattr(exc, "unwritten_groups", []) for s in g]
        note = (
            f"OffloadOptimizer(tier='nvme'): the step was applied to {len(done)} of {len(slots)} parameters "
            f"(their states and masters are valid); {len(todo)} were not stepped: fix the cause and call "
            "opt.step() again, it steps only those (the same result as one uninterrupted step)."
        )
        if unwritten:
            note += (
                f" The states of parameters {unwritten} were stepped but not written to disk: they stay in "
                "host memory and are written again by the next step."
            )
        exc.add_note(note)
        raise exc  # the round stays open: the retry steps what is left

    def _end_round(self) -> None:
        self._taken_stepped = True
        for slot in self._slots:
            slot.stepped = False
            slot.arrivals = 0
        if self._params_handle is not None and not self._closed:
            # the host copies are the data now: the next forward streams them in, no upload here
            self._params_handle.host_updated([s.param for s in self._slots if s.host_param is not None])
        with self._sched_lock:
            if self._rs is not None and self._phase == _COLLECT:
                self._phase = _STEPPED  # the next forward's first uses are this round's uses
        self._count_state()

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
        # Parameters whose gradients come through ``accept_gradient`` (DDP's communication hook, FSDP2's
        # shard hooks) show no host gradient as ``.grad`` (Note [The host gradient is the device
        # parameter's .grad]): the sum of their round lives on the host only, so ``model.zero_grad()``
        # or ``p.grad = None`` cannot clear it. A gradient arriving after ``step()`` with no
        # ``opt.zero_grad()`` since would be *added* to the sum the last step used: torch's behaviour for
        # a ``.grad`` nobody cleared, but what a loop clearing through the model gets without knowing it
        # (Trainer calls ``model.zero_grad()``). Which of the two it is cannot be told here, so it is
        # refused, before the gradient's copy starts, naming the fix -- never trained on silently.
        raise OffcoreError(
            f"OffloadOptimizer: parameter {slot.index} ({tuple(slot.param.shape)}) got a gradient after step() with "
            "no opt.zero_grad() since. Its gradients reach the optimizer through DDP / FSDP2 (attach_ddp, "
            "FSDPOffloadOptimizer), so model.zero_grad() and p.grad = None cannot clear the host gradients: call "
            "opt.zero_grad() after opt.step() (a framework: use its integration, e.g. "
            "offcore_torch.integrations.transformers / .accelerate / .lightning)"
        )

    def _count_state(self) -> None:
        total = 0
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
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
        for slot in self._slots:
            grad = slot.param.grad
            if set_to_none:
                slot.clears += 1
                slot.shown = None
            if grad is not None:
                if set_to_none:
                    slot.param.grad = None
                else:
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()
            if set_to_none:
                slot.accumulated = False
                slot.master.grad = None
            elif slot.accumulated:
                slot.grad.zero_()
            if not slot.stepped:
                # the gradients counted so far are gone: accumulation_steps counts again from here, or the next
                # backward would step over fewer micro-steps than declared (a step abandoned midway, then retried)
                slot.arrivals = 0

    # -- worker -----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._closed:
            raise OffcoreError("OffloadOptimizer is closed")
        future = self._worker.submit(fn, *args)
        with self._lock:
            self._futures.append(future)

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
            try:
                future.result()
            except BaseException as exc:
                if error is None:
                    error = exc
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

    # -- state dicts ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The host optimizer's ``state_dict()`` (torch's format), plus fp32 masters when they differ
        from the device parameters' dtype (:data:`MASTER_WEIGHTS_KEY`); states and masters on NVMe are
        read from disk. The hooks of ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook``
        run as torch runs them (a post hook may return a new state dict)."""
        self._check_open("state_dict()")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _state_dict(self) -> dict[str, Any]:
        self._drain()
        assert self._host is not None
        on_disk: dict[int, torch.Tensor] = {}
        if self._nvme is not None:
            sd = self.run_on_host(self._gather_state_dict, on_disk)
        else:
            sd = self._host.state_dict()
        masters = {s.index: on_disk.get(s.index, s.master).clone() for s in self._slots if s.stage is not None}
        if masters:
            sd[MASTER_WEIGHTS_KEY] = masters
        return sd

    def _gather_state_dict(self, masters: dict[int, torch.Tensor]) -> dict[str, Any]:
        """Worker: the host optimizer's state dict with the states on disk read into fresh tensors (and
        the masters on disk into ``masters``)."""
        assert self._host is not None and self._nvme is not None
        attached = []
        try:
            for slot in self._slots:
                if slot.layout is None or slot.state_buf is not None:
                    continue
                whole = torch.empty(slot.state_nbytes, dtype=torch.uint8)
                self._nvme.read(self._key(slot), whole.numpy()).synchronize()
                attached.append(slot)
                for name, dtype, shape, offset in slot.layout:
                    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
                    value = whole[offset : offset + n].view(dtype).view(shape).clone()
                    if name == _MASTER:
                        masters[slot.index] = value
                    else:
                        self._host.state[slot.master][name] = value
            sd = self._host.state_dict()
            sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # torch's dict shares the per-parameter dicts
            return sd
        finally:
            for slot in attached:
                state = self._host.state.get(slot.master, {})
                for name, *_ in slot.layout or ():
                    state.pop(name, None)

    def _store_slot(self, slot: _Slot) -> None:
        """Worker, after load_state_dict: write ``slot``'s loaded states to disk, wait, drop them from memory."""
        if slot.state_buf is not None:  # in memory (a failed write): replaced by the loaded states
            self._state_pool.release(slot.state_buf)
            slot.state_buf = None
        slot.layout = None
        self._write_object(slot)

    def _load_nvme_master(self, slot: _Slot, master: torch.Tensor | None) -> None:
        """Worker, after load_state_dict (Note [Masters on NVMe]): ``slot``'s master from ``master`` (else
        from the device parameter), its cast stage, and the loaded states, written to disk."""
        if slot.state_buf is None:
            self._read_object(slot, states=False)  # the loaded states stay what the state dict gave
        try:
            if master is None:
                self._load_master(slot)
            else:
                slot.master.copy_(master)
                if slot.stage is not None:
                    slot.stage.copy_(slot.master)
        finally:
            self._write_object(slot)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (of this class or of ``optimizer_class`` itself).

        Masters come from the state dict when it has them, else from the device parameters
        as they are now (load the model first). The hooks of ``register_load_state_dict_pre_hook``
        (which may return the state dict to load) and ``register_load_state_dict_post_hook`` run as
        torch runs them.
        """
        self._check_open("load_state_dict()")
        if not isinstance(state_dict, dict):
            raise ConfigurationError(
                f"OffloadOptimizer.load_state_dict() takes a state dict (a dict from state_dict()), got "
                f"{type(state_dict).__name__}"
            )
        state_dict = dict(state_dict)  # torch's shallow copy: a pre hook may change it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._drain()
        assert self._host is not None
        state_dict = dict(state_dict)
        masters = state_dict.pop(MASTER_WEIGHTS_KEY, None) or {}
        host = self._host
        self.run_on_host(host.load_state_dict, state_dict)
        if self._nvme is not None:
            for slot in self._slots:
                if not slot.nvme_master:
                    self.run_on_host(self._store_slot, slot)
        self._regroup()
        self.synchronize()
        with self._sched_lock:
            self._close_round()
        for slot in self._slots:
            master = masters.get(slot.index, masters.get(str(slot.index)))
            if slot.nvme_master:
                self.run_on_host(self._load_nvme_master, slot, master)
                if master is not None and slot.host_param is None:  # the stage from the loaded master goes up
                    self._h2d_after_compute()
                    self._copy_up(slot, force=True)
                    self._wait_parameter(slot)
                    slot.h2d.synchronize()
                    slot.synced_version, slot.synced_storage = slot.param._version, _storage_id(slot.param)
            elif master is not None and slot.host_param is not None:
                self.run_on_host(slot.master.copy_, master)
                if slot.stage is not None:
                    self.run_on_host(slot.stage.copy_, slot.master)
            elif master is not None and slot.stage is not None:
                self.run_on_host(slot.master.copy_, master)
                self._h2d_after_compute()
                self.run_on_host(slot.stage.copy_, slot.master)
                self._copy_up(slot, force=True)
                self._wait_parameter(slot)
                slot.h2d.synchronize()
                slot.synced_version, slot.synced_storage = slot.param._version, _storage_id(slot.param)
            else:
                self._load_master(slot)
        if self._params_handle is not None:
            self._params_handle.host_updated([s.param for s in self._slots if s.host_param is not None])
        self._count_state()

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
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None
            if slot.pre_hook is not None:
                slot.pre_hook.remove()
                slot.pre_hook = None
            if slot.shown is not None and slot.param.grad is slot.shown:
                slot.param.grad = None  # the host gradient goes with the optimizer's host memory
            slot.shown = None
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
            slot.stage = slot.h2d_dst = None
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

    def hook(grad: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None and not optimizer._closed:
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


class OffloadGradScaler:
    """fp16 loss scaling for :class:`OffloadOptimizer`: unscale on the host, skip the step on inf/NaN.

    The same arithmetic as ``torch.amp.GradScaler`` over the host gradients.

        >>> scaler = OffloadGradScaler()                     # doctest: +SKIP
        >>> scaler.scale(loss).backward()                    # doctest: +SKIP
        >>> scaler.step(opt); scaler.update()                # doctest: +SKIP
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._scaler = torch.amp.GradScaler(
            "cpu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    def scale(self, outputs: Any) -> Any:
        """``outputs`` multiplied by the scale (a device tensor times a Python float)."""
        if not self._scaler.is_enabled():
            return outputs
        if self._scaler._scale is None:
            self._scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        return outputs * self.get_scale()

    def get_scale(self) -> float:
        return float(self._scaler.get_scale())

    def _check(self, optimizer: OffloadOptimizer) -> None:
        if not isinstance(optimizer, OffloadOptimizer):
            raise ConfigurationError("OffloadGradScaler works with an OffloadOptimizer")
        if optimizer.stepped_any:
            raise ConfigurationError(
                "OffloadGradScaler: host steps already ran under backward (accumulation_steps / last_micro_step); "
                "unscaling needs every gradient before any step: build the optimizer with accumulation_steps=None"
            )

    def unscale_(self, optimizer: OffloadOptimizer) -> None:
        """Divide the host gradients by the scale (once per step), recording inf/NaN."""
        self._check(optimizer)
        optimizer.gradients_to_host()  # offload_gradients=False: the device gradients come over first
        optimizer.run_on_host(self._scaler.unscale_, optimizer.host_optimizer)

    def step(self, optimizer: OffloadOptimizer) -> Any:
        """Unscale (if not yet), then ``optimizer.step()`` unless a gradient held inf/NaN."""
        self._check(optimizer)
        host = optimizer.host_optimizer
        state = self._scaler._per_optimizer_states[id(host)]
        if self._scaler.is_enabled() and state["stage"].name == "READY":
            self.unscale_(optimizer)
        found = sum(v.item() for v in state["found_inf_per_device"].values()) if self._scaler.is_enabled() else 0
        if found:
            optimizer._drain()
            optimizer._end_round()
            result = None
        else:
            result = optimizer.step()
        if self._scaler.is_enabled():
            from torch.amp.grad_scaler import OptState

            state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | None = None) -> None:
        self._scaler.update(new_scale)

    def state_dict(self) -> dict[str, Any]:
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scaler.load_state_dict(state_dict)
