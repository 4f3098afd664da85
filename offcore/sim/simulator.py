"""An event-driven timeline simulator of one training step under a plan.

Three in-order streams: **compute** (forward layers in order, then backward in
reverse, with recompute inserted where the plan says), **D2H** and **H2D** (over a
duplex link, or one shared link that serialises both directions in the order the
copies were issued). Copies cost ``latency + bytes / bandwidth`` in their direction.

Offloaded layers are run by the runtime's own scheduler: every simulated step drives
one :class:`~offcore.residency.ResidencyScheduler` on the simulated clock (Note [The
simulator drives the runtime's scheduler]). Each saved tensor of an offloaded layer
(``LayerProfile.saved_tensors``; one object per layer when the profile has no detail)
is registered when forward saves it and its D2H is enqueued then; the scheduler's
``landed`` frees or holds the device copy, its ``PREFETCH`` actions issued at the end
of forward and at each use in backward start the reloads, backward waits for what is
not back (exposed wait, charged to that layer). A recomputed layer keeps only its
segment's input; the segment is rerun just before the backward of its last layer and
its saved bytes are back on device from then until each layer's backward. Kept
activations stay until their backward. The compute stream never stalls for memory: a
plan that needs more than the capacity is reported with ``oom=True``.

    >>> from offcore.sim.profile import uniform_profile
    >>> from offcore.sim.plan import Plan
    >>> p = uniform_profile(2, forward_s=0.0, backward_s=0.003, saved_bytes=256 * 2**20,
    ...                     d2h_bandwidth="inf", h2d_bandwidth="32GiB/s")
    >>> r = simulate(p, Plan(["offload", "keep"]))
    >>> round(r.exposed_wait_s * 1e3, 4)           # 7.8125 ms copy, 3 ms to hide it
    4.8125
"""

from __future__ import annotations

from offcore.errors import ConfigurationError
from offcore.sim.plan import Plan
from offcore.sim.profile import StepProfile
from offcore.sim.result import SimResult, TimelineEvent
from offcore.sim.step import _Step

__all__ = ["simulate", "SimResult", "TimelineEvent"]

# Note [The simulator drives the runtime's scheduler]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# There is one implementation of deadline prefetch, the byte budget, holding a landed
# copy and Belady eviction: offcore.residency.ResidencyScheduler, which offcore_torch runs.
# A simulated step feeds a new one the events a binding would (produced, register,
# offload_started at each save of an offloaded layer; landed when its D2H lands;
# forward_ended; backward_began; used at each layer's backward start for every save of
# that layer, then awaited/reused/reloaded, consumed, released at its end; backward_ended)
# and executes its actions as offcore_torch does (PREFETCH: allocate the destination now,
# copy on the H2D queue; EVICT: drop the copy; FREE: drop the device copy). The predictor
# has observed this step's ideal timeline once (a runtime in steady state), and the link's
# copy time is the profile's. So a copy starts at a trigger (the end of forward or a use
# in backward), never between two: the trigger whose next trigger comes at or after its
# latest start (offcore.scheduler, Note [Prefetch plan: serial link, latest start, horizon]).
# ``simulate(..., record_schedule=True)`` returns the scheduler's log: the same event names
# a real step's ``OffloadHandle.schedule_log`` has (tests/core/test_sim_scheduler.py).
#
# Note [Lead mode on the deadline plan]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``PrefetchPolicy("lead", lead_s=L)`` is the deadline plan with copies that take ``L``
# each and no margin: latest start ``t_need − L`` (chained like the link's copies).

# Note [Simulated lifetimes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Device bytes in the simulator follow the rules the runtime obeys (offcore/objects.py,
# Note [When may a device copy be freed?]):
#   - keep:      +saved at forward start, -saved at the end of the layer's backward.
#   - offload:   each saved tensor: + from the previous save of the layer (the first from
#                the forward start), its D2H enqueued when it is saved; - when the scheduler
#                frees it after its D2H landed (never earlier), or kept when it holds it;
#                + again when a reload is issued (the destination buffer), - at the end of
#                its backward, or at the next use after its own when the gross working set is
#                measured (Note [An offloaded layer's saves go as backward uses them]).
#   - recompute: +input at forward start of the first layer of a segment (the checkpoint),
#                freed at the end of that layer's backward; +saved of every layer of the
#                segment while the segment is rerun, each freed at the end of its backward.
#   - working bytes live while a layer runs: ``forward_work`` in its forward and recompute,
#                ``working_bytes`` (or the gross working sets, offloaded) in its backward.
# Events at one instant run frees first: the end of a compute step, then a D2H landing,
# then an H2D landing, then what allocates (a compute step's start, a save, a trigger and
# the reloads it issues). A compute step's own end is scheduled when it starts, so a
# layer that takes no time still holds its bytes at that instant.

# Note [A layer's saves are freed when its backward ends]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Backward uses a layer's saves one by one, the last saved first (``LayerProfile.saved_tensors``:
# a save made a share f of the forward before the last one is used that share of the backward
# later); each use is a trigger of the scheduler, and an offloaded save not back by then is
# waited for there. Autograd frees saves as it goes, but ``working_bytes`` is measured (by the
# profiler, in a step that keeps everything) as the backward's peak above its start, net of
# those frees: so the simulator frees a kept or recomputed layer's saves when its backward ends,
# and its level during the backward is its start level plus the working set, as measured. An
# offloaded layer's saves are not all there at its start (Note [An offloaded layer's saves go as
# backward uses them]).
#
# Note [An offloaded layer's saves go as backward uses them]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An offloaded layer's saves come back one by one (within the prefetch budget) and autograd frees
# each right after the node that used it: its backward never holds them all, as a kept layer's
# does. Keeping them to the backward's end with the net ``working_bytes`` put the default
# ``offcore compare`` workload's offload peak at 1.11-1.14 x the measured one and param-stream's
# at 1.28 x (each block's backward ended with its 2 MiB of saves plus the working set on the
# device, where the runtime held at most its 1 MiB budget of them). With
# ``LayerProfile.gross_working_bytes`` measured (per save: the transient bytes beyond the saves
# still alive, from its use to the next; Note [Gross working bytes of a backward] in
# offcore_torch/compare/recording.py), an offloaded layer's backward instead:
#   - at each group's use frees the saves of the group used before it (autograd is done with them;
#     a copy used in place still waits for its D2H, Note [Reuse of device copies still in flight]);
#   - holds, from each group's use to the next, the largest gross working set of that group's saves
#     (one figure replaces the other at each use, the last goes when the backward ends);
#   - holds its gradients inside those figures (the profiler's step made them too), and from its
#     end on explicitly (``grad_bytes``, as before; optimizer offload then copies them out).
# Its level is then what the runtime holds: the reloads not yet used (at most the budget), the
# saves in use and the nodes' transient bytes. The forward and a recompute hold
# ``LayerProfile.forward_work``. Without ``gross_working_bytes`` (a profile from shapes, an older
# profile) nothing changes. Note [The worst peak within the prefetch budget] adds the budget's room
# to this level as before; batch_memory_floor and instance_lower_bound (offcore/sim/bounds.py) take
# the smallest backward working set any action holds (``LayerProfile.offloaded_backward_work``), so
# they stay lower bounds.

# Note [The turn sees the head's saved bytes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# offcore_torch plans the first reloads when the offload region exits, after the loss was computed
# (PlanExecutor; Note [Prefetch from the end of forward] in offcore_torch/activations/offload.py): the device
# then holds what the head and the loss saved, not yet their backward's transients, and the
# scheduler's room (capacity minus bytes in use) is read there. The simulator's turn allocates
# ``StepProfile.head_forward_bytes`` first, runs forward_ended, then allocates the rest of
# ``head_bytes``. With all of ``head_bytes`` counted before the plan, a step near the capacity
# deferred reloads the runtime issues: at 3.25 x the ``offcore compare`` default batch the offload
# plan was predicted at 8.7 MiB and fitting where the runtime reloaded 1.6 MiB at the turn and ran
# out of its 9.4 MiB, so the predicted max batch was 29 against 24 measured.

# Note [Reads of kept tensors are triggers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every read of a saved tensor in backward is a trigger of offcore_torch's scheduler, also of one it
# keeps on the device (a parameter a linear layer saved: ``Kept``, ``used`` without a managed key).
# A node that saved an activation and a weight reads the weight right after the activation, once
# that activation was consumed: its reload no longer counts against the prefetch budget, and the
# trigger offers the next reloads into the room it left, before the node's transient bytes are
# allocated. Without that trigger the simulator offered them only at the next save's use: with a
# budget of 2 MiB and two consecutive 1.25 MiB saves (a TinyGPT block's attention scores and
# probabilities at batch 20 of benchmarks/sim_vs_measured.py), the second could never be
# prefetched (the first was outstanding at its use), was reloaded on demand at its own use, outside
# the budget, and the budget was then filled with 1.9 MiB more on top of it; the runtime had
# prefetched it at the weight's read within the budget (0.6 MiB more). The simulated peak came
# 1.09 x the measured one at batches 20 and 21, above the planning budget, and 8.73 MiB at batch 22
# below batch 21's 9.21 (the stepwise budget decision moved the peak elsewhere), so the predicted
# max batch was 19 against 21. ``LayerProfile.reads_after`` (measured by the profiler: the reads
# of tensors it does not count, after each save's use and before the layer's next save's) says
# where these triggers are; after a group whose saves have any, the simulator feeds the scheduler
# one ``used`` of a key outside the saves' (a kept read) once the group was consumed. Without
# ``reads_after`` (a profile from shapes, an older profile) nothing changes.

# Note [Reuse of device copies still in flight]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A device copy may be freed only after its D2H completed (offcore/objects.py, Note [When
# may a device copy be freed?]); until then it is still there, and offcore_torch uses it
# rather than reloading (offload.py, Note [Prefetch from the end of forward]). With
# ``StepProfile.reuse_in_flight`` the simulator does the same: backward reaching a save
# whose D2H has not landed reads the device copy (the scheduler's ``reused``), and its D2H
# landing after forward, when the plan would start its reload before the next trigger,
# makes the scheduler hold it (``landed`` → HOLD). A copy used in place stays on the device
# until both its backward ended and its D2H landed; the step ends when the last copy
# landed (a wait charged to that layer when compute finishes first). Without
# ``reuse_in_flight`` (a runtime that always reloads) nothing is held, and backward
# waits for such a D2H, then reloads.

# Note [Reuse under a binding prefetch budget]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Reuse never slows a step where no prefetch budget (nor the device's capacity) limits the offers.
# Why: forward and its D2H copies are the same in both runs; the plan is made from the profile; each
# trigger is a use whose plan clock is its predicted time, so every trigger offers the same due
# reloads. With no limit an offer starts every due copy whose D2H landed. A due copy still landing is
# skipped by both: reusing holds it when it lands (it was due) or reads it in place, reloading
# reloads it later. So reusing copies a subset of the reloading run's copies, in the same link
# order, and by induction over the uses it issues each copy and reaches each use no later.
# A binding budget breaks "an offer starts every due copy": what it starts depends on what is counted
# then, and a copy prefetched ahead of its use counts until backward takes it over, after the offer
# of its own use, while a copy reloaded on demand at that use never counts (Note [Budget semantics]
# in offcore/residency.py). Reuse turns reloads on demand into prefetches (a held copy leaves the
# budget at its use, Note [A reused copy leaves the budget at its use], so the next one fits), and
# such a prefetched copy keeps, at its use, the room that the on-demand copy left to a later reload;
# with no trigger before that reload's use, it runs on demand there. Reusing is then slower by that
# exposed reload, not by rounding; a larger budget does the same without reuse. The draw, and the same
# in megabytes (1 ms slower):
# test_under_a_binding_budget_a_prefetched_copy_holds_its_room_at_its_use_where_a_reload_does_not
# (tests/core/test_sim_simulator.py). The property test_reusing_copies_in_flight_never_slows_a_step_nor_breaks_its_bound
# compares the two runs without a budget, and checks the rest of its bound with the drawn one.

# Note [Optimizer offload and parameter streaming in the simulator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``Plan.optimizer == "offload"`` models offcore_torch.OffloadOptimizer with
# ``accumulation_steps=1`` (a parameter steps as soon as its gradient landed):
#   - a layer's gradients (``LayerProfile.grad_bytes``) appear when its backward starts, as
#     always; when its backward ends their D2H is enqueued on the d2h link, and the device
#     bytes are freed when it lands;
#   - the host step of that layer (``param_bytes × StepProfile.host_step_s_per_byte``) runs
#     on one serial host worker (stream ``"host"``) from the later of the landing and the
#     worker's previous step;
#   - the updated parameters go back on the h2d link after their step (parameters resident),
#     writing the parameter's own storage (no device allocation);
#   - the parameters outside the layers (``param_bytes`` minus the layers') follow the same
#     path from the end of the layers' backward;
#   - ``StepProfile.optimizer_state_bytes`` is not on the device.
# The step ends when the last copy landed and the host worker is done (``offcore compare``
# times ``step()`` plus a device synchronize), so nothing is left for the next forward to
# wait for. ``Plan.parameters == "stream"`` models offcore_torch.offload_parameters: each
# layer's parameters are not resident; they are on the device for each use (its forward, its
# recompute, its backward) and freed when nothing uses or holds them. *When* they are copied in is
# decided by a ResidencyScheduler, as the runtime's (Note [Parameter streaming drives a
# ResidencyScheduler]). A use waits for its copy (an exposed wait).
# With both, the host step writes the handle's host copies and there is no H2D after it.
# The runtimes' own compute-stream work (StepProfile.optimizer_offload_overhead_s and
# parameter_stream_overhead_s, measured) is added to the layers' backward (streaming: half
# to their forward) in proportion to their parameter bytes.

# Note [Parameter streaming drives a ResidencyScheduler]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One policy for streamed parameters, the runtime's (plugins/offcore_torch/parameters/parameters.py): a
# simulated step runs one round of its own ResidencyScheduler (Kind.PARAMETER objects) beside the
# activations' one, fed the events offload_parameters feeds its round and executing its actions
# as it does:
#   - the round's start (``_begin_step``): forward_began; every use of the step's sequence (a
#     layer's forward, recompute and backward, in the order the compute stream runs them) is an
#     object: produced at the synthetic time ``t − key × 1 ms / backward_ratio``, register,
#     offload_started (its host copy is the data), landed(needed=False); forward_ended (the plan,
#     first copies offered), backward_began: one round on one clock from the step's start;
#   - each use (``_use``), a trigger: a held prefetch is used, awaited, consumed; otherwise the
#     parameters are copied in now (unless on the device already) and ``reloaded``, used, consumed;
#     then the actions: PREFETCH copies the layer in on the h2d link (no copy when it is on the
#     device: ``_copy_in`` copies only what is not, and the copy stays held), EVICT drops a hold;
#   - a layer's device copy is freed when no use pins it and no prefetch holds it (a recompute in
#     backward pins it until its backward ends), once the copy into it landed;
#   - compute's end (``_end_step``): backward_ended at the last use; prefetches nobody used dropped.
# The settings are offload_parameters' defaults: budget StepProfile.parameter_budget_bytes (the
# profiler's: twice the largest *module's* parameters, as the runtime's default; its objects are
# modules, the simulator's layers, so a layer bigger than the budget is copied alone, by the
# scheduler's first-copy exception, when nothing else is outstanding — the runtime keeps about two
# modules in flight; with twice the largest layer the simulator kept two whole layers in flight and
# predicted a link-bound step 10 % fast),
# margin 0.5 ms, prefetch "deadline", the device's capacity and the simulated level as its room.
# The predictor has observed this step's ideal timeline of uses once (steady state). The round's
# first copies (offered at its start) are made at the end of the previous step, after its host
# step (Note [The next step starts early] in parameters.py): they are on the device at t = 0, and
# this step issues the same copies (steady state: the same plan offers the same) from the later of
# compute's end and the host worker's, and ends when they landed. Simplifications: the recompute
# uses come just before the segment's last backward use (the runtime sees that backward use
# first); with a device optimizer, the runtime keeps the next forward's first parameters on the
# device at the end of backward and its optimizer step fetches and writes back the parameters,
# neither is modelled (the first copies are made after compute ends, as with a host optimizer).
# ``simulate(..., record_schedule=True)`` returns the round's log (SimResult.parameter_schedule_log):
# it replays to the same actions (offcore.sim.replay; tests/core/test_sim_kinds.py) and has the
# event names a real offload_parameters step feeds its scheduler (tests/torch/test_sim_memory.py).

# Note [Backward's first parameters stay after forward in the simulator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The runtime keeps the storages backward uses first (up to its budget) on the device after their
# forward use (Note [Backward's first parameters stay after forward] in offcore_torch/parameters/parameters.py):
# the plan's prefetch for their backward use finds them there and no copy is made at the turn. The
# simulator does the same per layer: backward's first layers whose parameters add up to at most the
# round's budget are not freed after their forward (``p_turn``), and their first use in backward
# takes the copy over. The head (the parameters outside the layers used first by backward) is kept
# too: no outside copy at the turn when any layer is kept. Simplifications: the runtime's unit is a
# module and it counts the head in the budget first, so it may keep part of one more layer (at the
# issue-12 test's shape: the last layer and 4 of the 6 modules of the one before; the simulator keeps
# two whole layers, whose bytes equal its budget); under a shared device budget the runtime keeps
# nothing this way, which the simulator does not model.

#
# Note [The optimizer's NVMe tier in the simulator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``Plan.optimizer_tier == "nvme"`` models OffloadOptimizer(tier="nvme") (Note [Optimizer states on
# NVMe] in plugins/offcore_torch/optimizer/optimizer.py): gradients go D2H under backward as with the host tier,
# but nothing steps before ``step()`` (Note [One host step at step()] there); once compute ended and
# every gradient landed, the host worker runs offcore.nvme.pipelined over groups — one layer, or
# consecutive ones up to _NVME_GROUP_BYTES of parameters (the optimizer's own grouping, per
# parameter; a layer above it split evenly) — with the layer's share of ``optimizer_state_bytes``
# (the profiled state / parameter ratio: AdamW 2) read on the NVMe read link before its step and
# written on the write link after it, read _NVME_LOOKAHEAD groups ahead; group i waits for the write
# of group i-2 (lookahead + 2 groups live: the bounce buffers, SimResult.optimizer_host_bytes). The NVMe tier is one more link per
# direction with its own measured ``latency + bytes / bandwidth`` (StepProfile.nvme_*:
# offcore.bandwidth.measure_nvme_link), independent of each other and of the device's links (the
# tier's reads and writes have their own thread pools; a disk that slows one while the other runs
# would need the "both" figure measure_copy_bandwidth takes for the device). The parameters are
# uploaded after their group's step (resident parameters); the step ends when the last write and
# upload completed. An object that is on NVMe and needed on the device crosses two links in series,
# NVMe → host then H2D (offcore.sim.formulas.two_hop_transfer_time; Note [Two hops from NVMe] in
# offcore/residency.py for the scheduler's staging).
#
# Note [Activations on NVMe in the simulator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``Plan.activation_tier == "nvme"``: an offloaded save whose D2H landed and whose device copy
# went (not held, nobody waiting) is written to the NVMe tier on its write link (``h2n``); when
# the write completes and no reload took the host copy meanwhile, the host copy is released and
# the scheduler told (``spilled``). Its reload is then two hops: the scheduler offers a ``stage``
# (NVMe → host on the read link, ``n2h``, timed by StepProfile.nvme_read_*; its deadline is the
# H2D copy's latest start, Note [Two hops from NVMe] in offcore/residency.py), ``staged`` at its
# landing is a trigger, and the H2D prefetch follows as for a host copy. A use that finds its save
# still on NVMe stages it and reloads it on demand, waiting for both hops in series
# (offcore.sim.formulas.two_hop_transfer_time without chunking). The tier's links are
# independent queues (Note [The optimizer's NVMe tier in the simulator]); host memory is not
# modelled.
#
# Note [The worst peak within the prefetch budget]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An offloaded step's measured peak moves 20-30 % from run to run on the loaded fake device, and
# what moves is in backward: how many reloads are outstanding (issued, not yet consumed) at the
# peak. The runtime issues a reload at the trigger whose successor comes after the reload's latest
# start, by its *own* online estimate of the link, which carries the copy threads' wake-up delays
# under load (about 1 ms per copy where the idle link measures 10-20 us): a slower estimate
# starts reloads earlier, more of them are outstanding at once, and the peak rises; a quiet run
# starts them late and peaks low. Nothing in that estimate is the simulator's to know. What the
# runtime does enforce is the prefetch budget (``PrefetchPolicy.budget_bytes``, passed by
# PlanExecutor as ``prefetch_budget``): reloaded bytes not yet consumed never exceed it (a single
# copy larger than it goes alone). So besides the peak of its own timing, the simulator gives
# SimResult.worst_peak_bytes: at every instant of backward, its level plus the reload bytes the
# budget still allows beyond those it has outstanding — min(budget, outstanding + not yet
# reloaded) − outstanding, over saves not consumed yet whose device copy is gone. Every timing
# the runtime can reach peaks at or below it; with no budget (``None``: the capacity, in
# PlanExecutor) it is every remaining reload at once, i.e. as high as keeping them. Forward's
# side — device copies waiting for their D2H to land — is capped by ``Plan.max_inflight`` (default
# 256 MiB, as the runtime's; Note [The simulator caps forward's copies in flight]), which this
# bound does not add beyond what the simulated timing holds, except in a plan that drains its
# offloads (Note [Drained offloads bound the forward's copies in flight]): there the bound also
# holds, at the end of each offloaded layer's forward, every save of that layer on the device (none
# landed yet). Before the backward's
# model freed saves as they are used (Note [An offloaded layer's saves go as backward uses
# them]) its over-prediction covered a forward slowed by its copies; the measured param-stream
# peak of benchmarks/sim_vs_measured.py came to 1.001 x this bound without the forward's term.
# The planner and ``offcore compare`` still size with ``peak_bytes``; a plan given a finite
# budget is the way to a peak that holds in every run.
#
# Note [Drained offloads bound the forward's copies in flight]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A device copy of a saved tensor is freed when its D2H landed, and forward's copies in flight are
# capped only by ``max_inflight`` (256 MiB by default, far above these workloads' layers; Note [The
# simulator caps forward's copies in flight]): where the
# link runs slower than the profile's (the fake device's sanitizer
# checks every copy on its copy thread; a loaded host starves that thread) forward's device
# copies pile up, up to keeping every layer's saves, and the peak moves with the load (1.8 to
# 3.5 MiB run to run in tests/torch/test_sim_memory.py's offload plan, against 1.6 unsanitized).
# ``Plan.drain_offloads``: PlanExecutor ends each offloaded layer's forward by waiting on the D2H
# stream and handing the landings to the regions (offcore_torch.activations.offload.poll), so their device
# copies are freed before the next layer runs; the simulator's compute stream waits for the
# layer's last D2H the same way. Forward then holds at most the running layer's copies, the
# turn starts with every copy landed, and backward's level is set by the prefetch budget alone
# (Note [A finite prefetch budget makes the peak hold] in planner.py). The cost is each layer's
# copy tail (zero when copies keep up with compute).
#
# Note [The simulator caps forward's copies in flight]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The runtime caps the bytes of saved tensors' D2H copies in flight (``offload_activations(
# max_inflight=)``, 256 MiB by default; the rule: Note [Copies in flight are capped] in
# offcore/inflight.py): a save that would exceed the cap waits, in forward, for the oldest copies
# to land, and their device copies are freed before it starts its own. ``Plan.max_inflight`` (the
# same default; PlanExecutor passes it to the runtime) makes the simulator do the same: at a managed
# save, ``copies_to_land`` over the saves in flight (``d2h_in_flight``, in link order) says how many
# must land first; the forward then waits until the last of them lands (an exposed wait of that
# layer), and the rest of that forward -- its later saves and its end -- runs that much later. A
# save at the forward's very end (the layer's output) that must wait delays the end too. The wait
# splits the layer's forward span in two on the compute stream (as a reload splits a backward):
# the forward's end, where a plan turns, is the end of its last piece. Without
# the cap a forward that makes saves faster than the link moves them held them all (the peak of
# keeping them, at a slow enough link) where the runtime holds at most max(cap, one save) of them
# and runs slower by the waits: the simulated step was short and its peak high by the same amount.
#
# Note [Saves at a forward's end that wait behind each other]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At one instant the simulator runs ends before starts: a layer's forward ends (its transient bytes
# freed) before the saves made at that instant (its output) start their copies. The end asks whether
# its first pending save must wait; when that one may go now but a later one made at the same
# instant must wait behind it (two storages saved at the end of the forward, together over the cap),
# the end lets those saves go first and asks again: the waiting save then stalls the forward and
# delays its end, as a single waiting save does. Before, the end went on, the next layer and then
# backward ran before the stalled save was ever made, and backward's use of it raised KeyError in
# the scheduler (a 400 MiB layer output in two storages under the default 256 MiB cap did).
# Not modelled: OffloadOptimizer's cap on gradients in flight (``max_inflight_gradients``, at least
# 64 MiB and twice the largest gradient, applied per parameter where the simulator knows a layer's
# gradients as one copy): a backward that makes gradients faster than the link moves them is
# simulated without its waits.
#
# Note [Parameters outside the layers are streamed too]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# offload_parameters streams every module's parameters, the embedding, the final norm and the
# output head's too (a tied head fetches the embedding's weight again), but only the layers are
# simulated one by one; what runs outside them is a lump of compute added to the step
# (StepMeasurement.other_compute_for). Their copies are on the same H2D link, though: a TinyGPT
# step copies about 0.42 MB more than its layers' parameters at d_model 128, 16 % more at the
# ``offcore compare`` default. The simulator copies StepProfile.outside_param_bytes (one pass,
# ``outside_param_copies`` latencies) three times a step: at the turn (the head, before the
# backward can start: compute waits for it), at the end of backward (the embedding's backward:
# the step waits for it) and with the next forward's first copies (the embedding). Where the
# runtime prefetches them under compute this overstates the wait, by at most one copy each.
#
# Note [Parameter copies pay one latency each]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# offload_parameters copies each parameter tensor on its own (``_copy_in``: one copy per slot),
# so a layer's copy-in is ``LayerProfile.param_copies`` copies back to back on the H2D queue:
# ``param_copies × latency_s + param_bytes / h2d_bandwidth`` (a TinyGPT block: 12 tensors per
# use, about 100 copies per step with the embedding, the head and the backward refetch). The
# latency is the profiler's, measured with small copies queued together (Note [The latency is
# measured with small copies] in offcore_torch/compare/link.py), not the intercept of a fit through
# two large copies, whose noise (0 to 1.3 ms per copy on a loaded host) this term multiplied.
# The scheduler's own copy durations stay one latency per object, as the runtime's estimator has them.


def simulate(
    profile: StepProfile,
    plan: Plan,
    *,
    microbatch_overhead_s: float = 0.0,
    record_events: bool = True,
    record_schedule: bool = False,
) -> SimResult:
    """Simulate one training step of ``profile`` under ``plan``.

    With ``plan.microbatches = m > 1`` the step runs ``m`` identical micro-steps of
    ``profile.split_microbatches(m)`` back to back, and ``microbatch_overhead_s`` is
    charged to the compute stream for each micro-step after the first.
    ``record_events=False`` skips the event list (faster; the planner uses it).
    ``record_schedule=True`` keeps the residency scheduler's event log and actions
    (:attr:`SimResult.schedule_log`, :attr:`SimResult.schedule_actions`).

    >>> from offcore.sim.profile import uniform_profile
    >>> p = uniform_profile(4, forward_s=1.0, backward_s=2.0, saved_bytes=100)
    >>> simulate(p, Plan.uniform(4, "recompute")).step_time_s      # 4 + 8 + 4 recompute
    16.0
    """
    if not isinstance(profile, StepProfile):
        raise ConfigurationError(f"simulate() needs a StepProfile, got {type(profile).__name__}")
    if not isinstance(plan, Plan):
        raise ConfigurationError(f"simulate() needs a Plan, got {type(plan).__name__}")
    plan.check(profile)
    if not (isinstance(microbatch_overhead_s, (int, float)) and microbatch_overhead_s >= 0):
        raise ConfigurationError(f"microbatch_overhead_s must be >= 0, got {microbatch_overhead_s!r}")
    if plan.microbatches == 1:
        return _simulate_once(profile, plan, record_events, record_schedule)
    micro = _simulate_once(profile.split_microbatches(plan.microbatches), plan, record_events, record_schedule)
    return _repeat(micro, plan.microbatches, float(microbatch_overhead_s), profile.capacity_bytes)


def _repeat(micro: SimResult, count: int, overhead_s: float, capacity: int | None) -> SimResult:
    """Chain ``count`` copies of a micro-step with ``overhead_s`` between them."""
    period = micro.step_time_s + overhead_s
    times: list[float] = []
    levels: list[int] = []
    events: list[TimelineEvent] = []
    for k in range(count):
        shift = k * period
        times.extend(t + shift for t in micro.memory_times)
        levels.extend(micro.memory_bytes)
        events.extend(
            TimelineEvent(e.stream, f"{e.name}#{k}", e.start + shift, e.end + shift, e.kind, e.layer)
            for e in micro.events
        )
        if k + 1 < count and overhead_s > 0:
            events.append(
                TimelineEvent(
                    "compute", f"microstep-overhead#{k}", shift + micro.step_time_s, shift + period, "overhead", ""
                )
            )
    return SimResult(
        plan=micro.plan,
        step_time_s=count * micro.step_time_s + (count - 1) * overhead_s,
        forward_s=count * micro.forward_s,
        backward_s=count * micro.backward_s,
        recompute_s=count * micro.recompute_s,
        overhead_s=count * micro.overhead_s + (count - 1) * overhead_s,
        exposed_wait_s=count * micro.exposed_wait_s,
        wait_by_layer={name: count * wait for name, wait in micro.wait_by_layer.items()},
        static_bytes=micro.static_bytes,
        peak_bytes=micro.peak_bytes,
        peak_time_s=micro.peak_time_s,
        memory_times=tuple(times),
        memory_bytes=tuple(levels),
        d2h_busy_s=count * micro.d2h_busy_s,
        h2d_busy_s=count * micro.h2d_busy_s,
        d2h_bytes=count * micro.d2h_bytes,
        h2d_bytes=count * micro.h2d_bytes,
        capacity_bytes=capacity,
        events=tuple(events),
        reused_bytes=count * micro.reused_bytes,
        schedule_log=micro.schedule_log,
        schedule_actions=micro.schedule_actions,
        host_step_s=count * micro.host_step_s,
        parameter_schedule_log=micro.parameter_schedule_log,
        parameter_schedule_actions=micro.parameter_schedule_actions,
        parameter_schedule_settings=micro.parameter_schedule_settings,
        parameter_h2d_copies=count * micro.parameter_h2d_copies,
    )


def _simulate_once(profile: StepProfile, plan: Plan, record_events: bool, record_schedule: bool = False) -> SimResult:
    return _Step(profile, plan, record_events, record_schedule).run()
