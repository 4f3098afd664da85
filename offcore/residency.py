"""The residency scheduler: events in, actions out (framework-neutral, no torch).

One :class:`ResidencyScheduler` decides, for the managed objects of one step's graph,
*when* each moves and *where* it lives: which device copies are freed once their
device-to-host copy landed, which are held because backward needs them soon, which
reloads start at each trigger (deadline prefetch over a serial link), how many bytes
may be prefetched ahead of use (the byte budget), whether the device has room for a
speculative copy (one device budget), and which copy to evict when it has not (the one
whose next use is furthest away). A binding (``offcore_torch``, or a numpy training
loop, see ``examples/numpy_mlp.py``) only translates: it feeds the scheduler events
and executes the actions it returns on a backend. The simulator drives the same class
on a simulated clock (:mod:`offcore.sim.replay`).

    >>> from offcore.kinds import Kind
    >>> from offcore.scheduler import Scheduler
    >>> done = type("Landed", (), {"query": lambda self: True})()   # a completed copy's event
    >>> rs = ResidencyScheduler(Scheduler(margin=0.0), duration=lambda n: 0.003, budget=1 << 20)
    >>> for key, t in ((0, 0.0), (1, 0.001), (2, 0.002)):   # forward saves three objects
    ...     rs.produced(key, t)
    ...     _ = rs.register(key, Kind.ACTIVATION, 4096)
    ...     rs.offload_started(key, event=done)
    >>> [a.kind.value for a in (rs.landed(0), rs.landed(1))]   # forward: nothing needed yet
    ['free', 'free']
    >>> for action in rs.forward_ended(0.003):                  # backward needs 2 first, then 1
    ...     rs.started(action.key, event=None)                  # the binding started the copy
    ...     print(action.kind.value, action.key)
    prefetch 1
    >>> rs.landed(2).kind.value                                 # just landed and due: kept as a prefetch
    'hold'

Events (methods): ``produced``, ``register``, ``offload_started``/``offload_failed``,
``landed``, ``forward_ended``, ``backward_began``, ``used``, ``started``/``refused``
(the outcome of a prefetch the binding was asked to start), ``device_copy_alive``,
``consumed``, ``released``, ``backward_ended``; for objects on the NVMe tier ``spilled``,
``stage_started``/``stage_refused``, ``staged``, ``stage_failed`` (Note [Two hops from NVMe]).
Actions (:class:`Action`): ``free`` the device copy (its D2H landed), ``hold`` it as a
prefetch, ``prefetch`` (H2D into a new device buffer), ``evict`` a held or prefetched device
copy (the host copy stays valid), ``stage`` (read an object's host copy back from NVMe).
A ``prefetch`` action is offered lazily: the binding executes it and reports
``started(key)`` or ``refused(key, reason)`` before taking the next one, so the budget
and the device's room are judged on what really happened.

# Note [One scheduler, thin bindings]
# Every rule about *when* and *where* lives here, once: the chained deadlines
# (offcore.scheduler.PrefetchPlan), the byte budget with its first-copy exception, holding
# a just-landed copy that the plan would reload now, the device's room for a speculative
# copy and the stop after one allocator refusal, eviction by furthest next use (Belady),
# the watermark with hysteresis, and what a step teaches the next (StepObservation).
# What only the framework knows (storages, views, version counters, whether a storage
# is still referenced elsewhere, whether every record of an object was used) reaches the
# scheduler as events; it never calls back into the binding. Times are arguments (the
# binding's clock or the simulator's), never read here, so a recorded event log replays
# to the same actions (tests/torch/test_schedule_replay.py).

# Note [Budget semantics]
# ``budget`` counts device bytes prefetched (or held) ahead of use that backward has not
# taken over yet: a copy enters the count when it starts (or is held) and leaves it when
# every record of the object was used, the object is released, the copy is evicted, or
# backward ends. A copy that does not fit is not started; it comes back at the next
# trigger. The first copy is always allowed while nothing is outstanding (a budget smaller
# than one object would otherwise forbid every prefetch). The device's room is a separate
# check: a speculative copy must fit the device capacity next to everything allocated now
# (``device_in_use`` reads the backend's own accounting), and after one allocator refusal
# the round starts no more prefetches (Note [No speculative allocation after a refusal]).

# Note [A copy still landing keeps its place in the budget]
# When the link lags, an object forward saved last (backward's first need) may still be
# OFFLOADING when the offer runs: its device copy exists and, due now, it is held when its
# D2H lands (landed) -- if the budget has room then. An offer that skipped it and gave the
# budget to later-needed reloads left it none: it was freed on landing and its use reloaded
# it synchronously (a stall) next to those reloads -- the bytes of one object above the
# peak of the run without offload, measured in examples/numpy_mlp.py on a loaded host. So
# an offer counts each due object still landing as reserved, in need order, and offers a
# later-needed reload only while the outstanding bytes, the reserved ones and its own fit the
# budget (otherwise it comes back at a later trigger, once the landing was held or freed).
# Reserved bytes are not outstanding: only a held copy enters the count (Note [Budget
# semantics]), and the first copy is still always allowed while nothing is outstanding or
# reserved.

# Note [A reused copy leaves the budget at its use]
# A device copy kept after its D2H landed (held, or reused while its D2H is in flight) counts in
# the prefetch budget until backward takes it over. When backward reads it (``reused``, which the
# bindings and the simulator report before the ``used`` trigger of the same read), it leaves the
# count at once, so the offer of that very trigger may start the next reload; before, the offer
# still saw it, no other trigger came before the next use, and that reload ran on demand -- while a
# copy freed on landing and reloaded on demand at the same use (never counted) let it start, so
# reusing made a step slower than reloading (a draw of the simulator's property
# test_reusing_copies_in_flight_never_slows_a_step_nor_breaks_its_bound). Only the count moves: the
# held copy is still freed at ``consumed``, as before. A prefetched copy still leaves the count at
# ``consumed`` (consuming it before the offer raised the compare workload's offload peak by ~10 %).

# Note [Objects produced on the host]
# An optimizer's host step produces a parameter's new value on the host; the device copy
# is stale until it is uploaded, and it is needed on the device at its next use (the
# next forward). Such an object is registered, marked ``awaiting_host`` (plans skip it
# without retiring it), and turned into an offloaded object by ``host_updated`` (no copy:
# its "device-to-host copy" is the host step itself), which is a trigger: the uploads
# due then are offered as prefetches, in the plan's need order, within the byte budget
# and the device's room, exactly as reloads are. The binding feeds its uses as
# ``backward_began`` (the phase of uses starts: for an optimizer, the next forward) and
# ``used`` (each is a trigger, and the first round's uses teach the predictor), and
# closes the round with ``backward_ended``. ``prefetch="asap"`` makes every
# offloaded object due at once, need order first: right for uploads that write into
# device memory that exists anyway (an optimizer's parameters), where only the budget,
# never a deadline, should hold a copy back. ``upload_order`` tells a binding the need
# order before the objects are produced (it steps the first-needed parameters first).

# Note [Two hops from NVMe]
# An offloaded object's host copy may live on the NVMe tier instead of host memory (the
# binding wrote it there and released the host buffer: ``spilled(key)``). Its reload is then
# two copies on two links: a stage (NVMe → host, ``n2h``: a tier read into a host buffer)
# and the prefetch (host → device, ``h2d``). The plan keeps the host → device chain exactly
# as for host-resident objects (so their behaviour does not change) and adds a second chain
# on the NVMe link, with its own measured duration (``stage_duration``: the tier's
# ``read_link`` fed by its completed reads, or offcore.bandwidth.measure_nvme_link): each
# stage must land by the trigger that starts its object's host → device copy (the last one
# before that copy's latest start, less the margin), stages run one after another on their
# link, and are planned as late as possible (offcore.scheduler.PrefetchPlan.stage_latest).
# At each trigger the due stages are offered first (``stage`` actions; the binding answers
# ``stage_started`` / ``stage_refused``, lazily as for prefetches), then the due prefetches
# of host-resident objects; an object still on NVMe or still staging is skipped by the
# prefetch chain until ``staged(key)`` (its read landed: the host copy is in host memory),
# which is itself a trigger offering what is due. Stages hold host memory, not device
# memory: they are outside the device byte budget (the binding's pinned pool bounds them;
# a refusal comes again at the next trigger). ``stage_duration`` None means an unknown
# link: every stage is due at once. Writes to NVMe (``h2n``) are the binding's, off the
# critical path (after the D2H landed); the ledger and the trace count both directions
# (Note [The NVMe tier's copies in the ledger and the trace] in offcore/nvme/tier.py).
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from offcore.errors import ConfigurationError, IllegalTransitionError
from offcore.kinds import Kind, Tier
from offcore.objects import ManagedObject, State
from offcore.scheduler import PrefetchPlan, Scheduler, StepObservation

__all__ = ["ActionKind", "Action", "ResidencyScheduler", "Watermark", "PREFETCH_MODES", "NO_ACTIONS"]

PREFETCH_MODES = ("deadline", "on_demand")
_MODES = (*PREFETCH_MODES, "asap")  # "asap": Note [Objects produced on the host]


class ActionKind(str, enum.Enum):
    """What the binding is asked to do with one object."""

    FREE = "free"
    """Drop the device copy: its device-to-host copy has landed (Note [When may a device copy be freed?])."""
    HOLD = "hold"
    """Keep the device copy whose device-to-host copy just landed: backward needs it soon (counts as a prefetch)."""
    PREFETCH = "prefetch"
    """Copy the host copy back into a new device buffer on the host-to-device stream."""
    EVICT = "evict"
    """Drop a held or prefetched device copy that is not needed as soon as another (the host copy stays)."""
    STAGE = "stage"
    """Read the object's host copy from the NVMe tier into a host buffer (before its ``prefetch``; Note
    [Two hops from NVMe])."""


# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_EVICT, _FREE, _HOLD, _PREFETCH, _STAGE = (
    ActionKind.EVICT,
    ActionKind.FREE,
    ActionKind.HOLD,
    ActionKind.PREFETCH,
    ActionKind.STAGE,
)
_OFFLOADED, _OFFLOADING, _PREFETCHING, _RESIDENT, _RESTORED = (
    State.OFFLOADED,
    State.OFFLOADING,
    State.PREFETCHING,
    State.RESIDENT,
    State.RESTORED,
)
_NVME, _PINNED = Tier.NVME, Tier.PINNED


class _Completed:
    """The event of a copy that needs none: the host already holds the data (host_updated)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_COMPLETED = _Completed()

NO_ACTIONS: Iterator[Action] = iter(())
"""What an event returns when nothing is due (one shared, exhausted iterator: a binding may test
``actions is NO_ACTIONS`` to skip carrying them out)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One action for the binding: ``kind`` applied to the object registered as ``key``."""

    kind: ActionKind
    key: int
    nbytes: int


class Watermark:
    """Offload only while free device memory is below ``alpha`` × capacity, with hysteresis.

    Pressure starts when free memory falls below ``alpha`` × capacity and ends only when
    it rises above ``(alpha + hysteresis)`` × capacity, so a level near the mark does not
    flip the decision at every save.

        >>> w = Watermark(0.3, hysteresis=0.05)
        >>> w.under_pressure(free=20, capacity=100), w.under_pressure(free=32, capacity=100)
        (True, True)
        >>> w.under_pressure(free=40, capacity=100)
        False
    """

    __slots__ = ("alpha", "hysteresis", "pressure")

    def __init__(self, alpha: float, *, hysteresis: float = 0.05) -> None:
        if not 0.0 < alpha < 1.0:
            raise ConfigurationError(f"watermark must be in (0, 1), got {alpha!r}")
        if not 0.0 <= hysteresis < 1.0:
            raise ConfigurationError(f"hysteresis must be in [0, 1), got {hysteresis!r}")
        self.alpha = alpha
        self.hysteresis = hysteresis
        self.pressure = False

    def under_pressure(self, *, free: int, capacity: int) -> bool:
        """Whether to offload now, given the device's free bytes and capacity (no capacity: always)."""
        if capacity <= 0:
            return True
        if self.pressure:
            if free > (self.alpha + self.hysteresis) * capacity:
                self.pressure = False
        elif free < self.alpha * capacity:
            self.pressure = True
        return self.pressure


class ResidencyScheduler:
    """Residency decisions for the objects of one step's graph (see the module doc and Notes).

    ``predictor`` learns next-use times across steps (one per device, long-lived);
    ``duration(nbytes)`` predicts a host-to-device copy (the device's measured link);
    ``prefetch`` is ``"deadline"`` or ``"on_demand"`` (or ``"asap"`` for uploads, Note
    [Objects produced on the host]); ``budget`` bounds prefetched
    bytes ahead of use; ``margin`` (seconds) is the slack before each need;
    ``device_capacity`` and ``device_in_use()`` give the device budget (0: unbounded).
    ``record=True`` keeps every event with its arguments in :attr:`log` and every action
    in :attr:`actions`, for replay through the simulator. ``stage_duration(nbytes)`` predicts
    an NVMe → host read (the tier's measured ``read_link``; Note [Two hops from NVMe]).
    """

    def __init__(
        self,
        predictor: Scheduler,
        *,
        duration: Callable[[int], float],
        prefetch: str = "deadline",
        budget: int = 256 * 1024**2,
        margin: float | None = None,
        device_capacity: int = 0,
        device_in_use: Callable[[], int] | None = None,
        record: bool = False,
        shared_budget: Any = None,
        stage_duration: Callable[[int], float] | None = None,
    ) -> None:
        if prefetch not in _MODES:
            raise ConfigurationError(f"prefetch must be one of {_MODES}, got {prefetch!r}")
        if budget < 0:
            raise ConfigurationError(f"prefetch budget must be non-negative, got {budget!r}")
        self.predictor = predictor
        self.duration = duration
        self.prefetch_mode = prefetch
        self.budget = budget
        self.margin = predictor.margin if margin is None else margin
        self.device_capacity = device_capacity
        self._device_in_use = device_in_use
        self.objects: dict[int, ManagedObject] = {}
        self.observation = StepObservation()
        self.plan: PrefetchPlan | None = None
        self.round = -1
        self.in_backward = False
        self.vtime = -math.inf  # the plan's clock at the last trigger
        self.outstanding = 0  # bytes prefetched or held ahead of use, not yet taken over by backward
        self.peak_outstanding = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self._counted: set[int] = set()  # keys whose bytes are in ``outstanding``
        self._held: dict[int, None] = {}  # keys held on landing, insertion-ordered
        self._alive_elsewhere: set[int] = set()
        self._released: set[int] = set()  # no record uses them (their copies may still be in flight)
        self._no_prefetch_round = -2
        self._t_forward = 0.0
        self._t_backward = 0.0
        self._refused = False
        self._awaiting_host: set[int] = set()  # Note [Objects produced on the host]
        self._spares: dict[int, ManagedObject] = {}  # Note [Objects renewed across rounds]
        self.stage_duration = stage_duration  # Note [Two hops from NVMe]
        self._on_nvme: set[int] = set()  # host copy only on NVMe (stage not landed)
        self._staging: set[int] = set()  # stages in flight
        self.record = record
        self.log: list[tuple[Any, ...]] = []
        self.actions: list[Action] = []
        # Note [One device budget across kinds] in offcore/budget.py: an offcore.budget.DeviceBudget
        # shared by the device's schedulers (None: this scheduler's own ``budget`` only, as before)
        self.shared_budget = shared_budget
        self._budget_evictions: list[Action] = []  # copies the shared budget evicted, for the next trigger
        if shared_budget is not None:
            shared_budget.attach(self, self._budget_evict)

    # -- bookkeeping -------------------------------------------------------------------
    def _log(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Record one event (``record=True``): ``(name, args, kwargs)``, replayable as a call."""
        self.log.append((name, args, kwargs))

    def _offered(self, actions: Iterator[Action]) -> Iterator[Action]:
        """``actions``, with each request for the next one recorded (``record=True``).

        The binding resumes the scheduler's offer after carrying out each action, so the
        events it sends meanwhile (``started``, ``refused``, ...) sit between two ``next``
        entries of the log; a replay resumes at the same points.
        """
        if not self.record:
            return actions
        return self._resumes_recorded(actions)

    def _resumes_recorded(self, actions: Iterator[Action]) -> Iterator[Action]:
        while True:
            self._log("next")
            action = next(actions, None)
            if action is None:
                return
            yield action

    def _emit(self, action: Action) -> Action:
        if self.record:
            self.actions.append(action)
        return action

    def _count(self, key: int, nbytes: int) -> None:
        if key not in self._counted:
            self._counted.add(key)
            self.outstanding += nbytes
            if self.outstanding > self.peak_outstanding:
                self.peak_outstanding = self.outstanding

    def _uncount(self, key: int) -> None:
        if key in self._counted:
            self._counted.remove(key)
            self.outstanding -= self.objects[key].nbytes
            if self.shared_budget is not None:
                self.shared_budget.release(self, key)

    # -- the shared device budget (Note [One device budget across kinds] in offcore/budget.py) --------
    def _next_use(self, key: int) -> float:
        """``key``'s predicted next use on the bindings' clock (seconds), for the shared budget."""
        plan = self.plan
        need = plan.need.get(key, math.inf) if plan is not None else math.inf
        base = self._t_backward if self.in_backward else self._t_forward + self.observation.forward_seconds
        return base + need

    def _admit_shared(self, key: int, nbytes: int) -> bool:
        return self.shared_budget.admit(self, self.objects[key].kind, key, nbytes, next_use=self._next_use(key))

    def _budget_evict(self, key: int) -> None:
        """The shared budget evicted ``key``'s copy for another request (maybe another owner's): the
        same bookkeeping as :meth:`_evict_for`; the EVICT goes to the binding at its next trigger."""
        if key not in self._counted:
            return
        self._counted.remove(key)
        obj = self.objects[key]
        self.outstanding -= obj.nbytes
        if self._unhold(key):
            self._free_held(key)
        if self.plan is not None:
            self.plan.reopen(key)
        self.counters["evicted_shared"] += 1
        self._budget_evictions.append(Action(_EVICT, key, obj.nbytes))

    def _with_evictions_list(self, evictions: list[Action], actions: Iterator[Action]) -> Iterator[Action]:
        for action in evictions:
            yield self._emit(action)
        yield from actions

    def _with_evictions(self, actions: Iterator[Action], skip: int | None = None) -> Iterator[Action]:
        """The shared budget's evictions first; not one of the copy being used now (it is taken over)."""
        while self._budget_evictions:
            action = self._budget_evictions.pop(0)
            if action.key != skip:
                yield self._emit(action)
        yield from actions

    def detach_budget(self) -> None:
        """Give back this scheduler's reservations in the shared budget (its round is over)."""
        if self.shared_budget is not None:
            self.shared_budget.detach(self)
            self._budget_evictions.clear()

    def is_outstanding(self, key: int) -> bool:
        """Whether ``key``'s device copy counts against the budget now: prefetched (or held)
        ahead of use and not yet taken over by backward (Note [Budget semantics])."""
        return key in self._counted

    def within_budget(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be prefetched now (Note [Budget semantics])."""
        budget = self.budget
        return self.outstanding + nbytes <= budget or (self.outstanding == 0 and budget > 0)

    def _device_has_room(self, nbytes: int) -> bool:
        capacity = self.device_capacity
        if capacity <= 0 or self._device_in_use is None:
            return True
        in_use = self._device_in_use()
        if self.record:
            self._log("device_in_use", in_use)
        return in_use + nbytes <= capacity

    def settings(self) -> dict[str, Any]:
        """The settings a replay needs (:func:`offcore.sim.replay.replay` keywords)."""
        return {
            "prefetch": self.prefetch_mode,
            "budget": self.budget,
            "margin": self.margin,
            "device_capacity": self.device_capacity,
        }

    @property
    def upcoming_round(self) -> int:
        """The backward round running now, or the next one between rounds."""
        return self.round if self.in_backward else self.round + 1

    # -- forward -------------------------------------------------------------------------
    def forward_began(self, t: float) -> None:
        """The step's forward starts at ``t`` (the binding's clock, seconds)."""
        if self.record:
            self._log("forward_began", t)
        self._t_forward = t

    def produced(self, key: int, t: float) -> None:
        """Forward saved the object numbered ``key`` at ``t`` (every save is numbered, managed or not)."""
        if self.record:
            self._log("produced", key, t)
        self.observation.pack_times[key] = t - self._t_forward

    def register(self, key: int, kind: Kind, nbytes: int, *, name: str = "") -> ManagedObject:
        """Manage the object ``key`` (``nbytes`` on the device) from now on (a spare of the same key, renewed:
        Note [Objects renewed across rounds])."""
        if self.record:
            self._log("register", key, kind, nbytes)
        if key in self.objects:
            raise IllegalTransitionError(f"object key {key} is registered already")
        spares = self._spares
        obj = spares.pop(key, None) if spares else None
        if obj is None:
            obj = ManagedObject(kind=kind, nbytes=nbytes, name=name)
        else:
            obj.renew(kind, nbytes, name)
        self.objects[key] = obj
        return obj

    # Note [Objects renewed across rounds]
    # A binding that starts a new scheduler for every round of the same objects (OffloadOptimizer: one
    # per step, one PARAMETER object per parameter and one GRADIENT object per gradient) built that many
    # new ManagedObjects per round. Each lives for a whole step, so the garbage collector's young
    # collections promote it into the oldest generation, where it dies the next round: every promoted
    # object counts toward the next full collection (of every object of the program), which came every
    # few steps at thousands of parameters and cost more than the step's own bookkeeping. So the new
    # round's scheduler takes the finished one's objects as spares (``recycle``) and ``register`` of a
    # key with a spare renews that object in place (``ManagedObject.renew``: every field as a new
    # object's, a new ``id``) instead of building one. Nothing else is carried over: the scheduler is
    # new, so the plan, the budget, the observation and what it teaches the predictor are exactly as
    # with new objects. The finished scheduler is left with no objects: an event about one of them
    # afterwards raises (KeyError) instead of changing the object the new round renewed. So a binding
    # recycles only a round no event will come for any more (its copies landed, no worker task holds it).
    def recycle(self, finished: ResidencyScheduler) -> None:
        """Take ``finished``'s objects as spares, renewed by :meth:`register` of the same keys (Note [Objects
        renewed across rounds]); ``finished`` is left with none. Call it before registering anything."""
        if finished is self:
            raise ConfigurationError("a scheduler cannot recycle its own objects")
        if self.objects:
            raise ConfigurationError("recycle() must come before the first register()")
        spares = finished.objects
        finished.objects = {}
        if finished._spares:  # the spares it did not renew stay spares (a round with fewer gradients)
            spares.update((key, obj) for key, obj in finished._spares.items() if key not in spares)
            finished._spares = {}
        self._spares = spares

    def register_offloading(
        self, key: int, kind: Kind, nbytes: int, event: Any, host_tier: Tier = Tier.PINNED, *, name: str = ""
    ) -> ManagedObject:
        """:meth:`register` then :meth:`offload_started`, in one call (a binding's pack hook, once per
        saved tensor); recorded as those two events, so a replay makes the same two calls."""
        if self.record:
            self._log("register", key, kind, nbytes)
            self._log("offload_started", key)
        objects = self.objects
        if key in objects:
            raise IllegalTransitionError(f"object key {key} is registered already")
        # a new object is RESIDENT, and RESIDENT -> OFFLOADING is allowed: start_offload's transition,
        # made by the constructor (one call per saved tensor less)
        obj = objects[key] = ManagedObject(
            kind=kind, nbytes=nbytes, state=_OFFLOADING, name=name, d2h_event=event, host_tier=host_tier
        )
        return obj

    def offload_started(self, key: int, event: Any, host_tier: Tier = Tier.PINNED) -> None:
        """A device-to-host copy of ``key`` was enqueued (``event`` completes when it lands)."""
        if self.record:
            self._log("offload_started", key)
        self.objects[key].start_offload(event, host_tier)

    def offload_failed(self, key: int) -> None:
        """The device-to-host copy failed: the device copy stays the data, nothing is reloaded."""
        if self.record:
            self._log("offload_failed", key)
        self.objects[key].cancel_offload()
        if self.plan is not None:
            self.plan.issued(key)

    def landed(self, key: int, *, needed: bool = True) -> Action:
        """The device-to-host copy of ``key`` completed: free its device copy, or hold it.

        ``needed=False`` when the binding knows backward will not read it again this round
        (every record was used already). The copy is held when the plan would start its
        reload before the next trigger anyway and the budget has room (a reload of what is
        still on the device would only cost a copy).
        """
        if self.record:
            self._log("landed", key, needed=needed)
        held = self._land(key, needed)
        return self._emit(Action(_HOLD if held else _FREE, key, self.objects[key].nbytes))

    def landed_held(self, key: int, *, needed: bool = True) -> bool:
        """:meth:`landed`, answering only whether the copy is held (``HOLD``; otherwise it was freed).

        A binding's landing path, once per saved tensor: no :class:`Action` is built unless
        recording (then it is :meth:`landed` itself, so the log and the actions are the same).
        """
        if self.record:
            return self.landed(key, needed=needed).kind is _HOLD
        return self._land(key, needed)

    def _land(self, key: int, needed: bool) -> bool:
        obj = self.objects[key]
        plan = self.plan
        if (
            needed
            and plan is not None
            and plan.latest_start.get(key, math.inf) <= plan.horizon(self.vtime)
            and self.within_budget(obj.nbytes)
            and (self.shared_budget is None or self._admit_shared(key, obj.nbytes))
        ):
            self._count(key, obj.nbytes)
            self._held[key] = None
            plan.issued(key)
            return True
        if obj.state is _OFFLOADING:
            obj.release_device_copy()  # refuses unless the D2H event completed
        return False

    def device_copy_alive(self, key: int) -> None:
        """The binding freed its device copy but the memory lives on (someone else holds it): no reload needed."""
        if self.record:
            self._log("device_copy_alive", key)
        self._alive_elsewhere.add(key)

    def device_copy_died(self, key: int) -> None:
        """The device memory of ``key`` that lived on elsewhere is gone."""
        if self.record:
            self._log("device_copy_died", key)
        self._alive_elsewhere.discard(key)

    def forward_ended(self, t: float, *, readers: dict[int, list[int]] | None = None) -> Iterator[Action]:
        """Forward ended at ``t``: plan backward's reloads and offer those due before its first use.

        Note [Prefetch from the end of forward] (offcore_torch): what backward needs first
        was saved last, so the plan starts at the end of forward, not at backward's first use.
        ``readers`` maps a managed key to every save key that reads the same object.
        """
        if self.record:
            self._log("forward_ended", t, readers=readers)
        self.observation.forward_seconds = t - self._t_forward
        self._make_plan(readers)
        return self._offered(self._offer(-math.inf))

    def make_plan(self, readers: dict[int, list[int]] | None = None) -> None:
        """(Re)plan the reloads of every managed object still offloaded (deadline mode only)."""
        if self.record:
            self._log("make_plan", readers)
        self._make_plan(readers)

    def _make_plan(self, readers: dict[int, list[int]] | None) -> None:
        if self.prefetch_mode == "on_demand":
            return
        live = {k: o.nbytes for k, o in self.objects.items() if k not in self._released}
        observation = self.observation
        if self._awaiting_host:  # not produced yet: predicted as if produced last (Note [Objects produced on the host])
            packed = observation.pack_times
            last = max(packed.values(), default=0.0)
            missing = {k: last for k in self._awaiting_host if k not in packed}
            if missing:
                observation = StepObservation({**packed, **missing}, observation.forward_seconds)
        stage = {k: live[k] for k in self._on_nvme if k in live and k not in self._staging} or None
        readers = {k: readers[k] for k in live if k in readers} if readers else None
        if stage is None:  # the call as before NVMe existed (a predictor may not take ``stage``)
            self.plan = self.predictor.plan(observation, live, self.duration, margin=self.margin, readers=readers)
        else:
            self.plan = self.predictor.plan(
                observation,
                live,
                self.duration,
                margin=self.margin,
                readers=readers,
                stage=stage,
                stage_duration=self.stage_duration,
            )
        if self.record:  # what the plan rested on: the predictor's state and the link's, then
            if stage is None:
                self._log("plan_inputs", dict(self.plan.use_times), dict(self.plan.durations))
            else:
                self._log(
                    "plan_inputs",
                    dict(self.plan.use_times),
                    dict(self.plan.durations),
                    dict(self.plan.stage_durations),
                )
        self.vtime = -math.inf

    # -- objects produced on the host (an optimizer's updated parameters) --------------------
    def awaiting_host(self, key: int) -> None:
        """The registered object ``key`` will be produced on the host (:meth:`host_updated`) and is
        needed on the device at its next use: plans keep it until then (Note [Objects produced on the host])."""
        if self.record:
            self._log("awaiting_host", key)
        self._awaiting_host.add(key)

    def host_updated(self, key: int) -> Iterator[Action]:
        """The host copy of ``key`` became the data (a host step updated it; the device copy is
        stale): it is offloaded now. Returns the uploads due now (``prefetch`` actions, lazily;
        the binding answers each with ``started``/``refused``, as for every prefetch)."""
        if self.record:
            self._log("host_updated", key)
        self._host_copy_is_data(key)
        if self.plan is None:
            return NO_ACTIONS
        return self._offered(self._offer(self.vtime))

    def host_updated_all(self, keys: Iterable[int]) -> Iterator[Action]:
        """:meth:`host_updated` of every key of ``keys`` at once, then ONE offer: the uploads due now, in
        deadline order within the budget, as the calls one by one would offer them, but one scan of the
        plan instead of one per key (a binding that learns of many host steps together: an optimizer's
        ``step()`` over all its parameters).

            >>> actions = list(rs.host_updated_all([0, 1, 2]))   # doctest: +SKIP
        """
        keys = list(keys)
        if self.record:
            self._log("host_updated_all", keys)
        for key in keys:
            self._host_copy_is_data(key)
        if self.plan is None or not keys:
            return NO_ACTIONS
        return self._offered(self._offer(self.vtime))

    def _host_copy_is_data(self, key: int) -> None:
        self._awaiting_host.discard(key)
        obj = self.objects[key]
        if obj.state is _RESIDENT:
            obj.start_offload(_COMPLETED, obj.host_tier or _PINNED)
            obj.release_device_copy()

    # Note [An offer taken whole, answered after]
    # A binding that issues every upload of an offer together (an optimizer's uploads, one batch of copies:
    # Note [Uploads are issued in batches] in offcore_torch/optimizer/rounds.py) takes the whole offer before
    # it answers any of it. ``host_updated_prefetches`` returns what that binding took from
    # ``host_updated_all`` -- the keys of its ``prefetch`` actions, in order -- without a generator step and
    # an ``Action`` per key (the optimizer's step() pays them per parameter); ``started_all`` is its answers.
    # The offer is the same: the loop below is ``_prefetches``' for the case it covers (no recording, no
    # shared budget, nothing on NVMe, no eviction pending); where an upload does not fit the byte budget,
    # the rest of the offer is ``_prefetches``' own (it may evict: the binding is not told, as it was not
    # before, and the victims' bookkeeping is the same). Otherwise (recording, a shared budget, NVMe) it is
    # ``host_updated_all``'s offer itself, so a recorded log replays as before.
    def host_updated_prefetches(self, keys: Iterable[int]) -> list[int]:
        """:meth:`host_updated_all` for a binding that takes its whole offer before answering any of it
        (Note [An offer taken whole, answered after]): the keys of the offer's ``prefetch`` actions, in order.
        The binding answers them with :meth:`started_all` (or :meth:`started` / :meth:`refused` each), once
        issued. Other actions are not returned (only a binding whose evictions free nothing may use it).

            >>> keys = rs.host_updated_prefetches([0, 1, 2])   # doctest: +SKIP
            >>> rs.started_all(keys, [event] * len(keys))       # doctest: +SKIP
        """
        if self.record or self.shared_budget is not None or self._on_nvme or self._budget_evictions:
            return [a.key for a in self.host_updated_all(keys) if a.kind is _PREFETCH]
        objects, awaiting = self.objects, self._awaiting_host
        keys = list(keys)
        for key in keys:  # _host_copy_is_data, inlined
            awaiting.discard(key)
            obj = objects[key]
            if obj.state is _RESIDENT:
                # start_offload(_COMPLETED) then release_device_copy(): RESIDENT -> OFFLOADING -> OFFLOADED, both
                # allowed, the "copy" complete (Note [Transitions checked inline] in offcore/objects.py)
                obj.state = _OFFLOADED
                obj.tier = obj.host_tier = obj.host_tier or _PINNED
                obj.d2h_event = None
        plan = self.plan
        if plan is None or not keys or not len(plan):
            return []
        vtime = self.vtime  # _offer, inlined
        due = plan.due(math.inf if self.prefetch_mode == "asap" else vtime)
        if not due or self._no_prefetch_round == (self.round if self.in_backward else self.round + 1):
            return []  # Note [No speculative allocation after a refusal]
        out: list[int] = []
        alive, released, done, planned = self._alive_elsewhere, self._released, plan._done, plan.nbytes
        outstanding, budget = self.outstanding, self.budget
        room = self.device_capacity > 0 and self._device_in_use is not None  # _device_has_room asks
        reserved = 0
        for i, key in enumerate(due):  # _prefetches' loop, for the case above (same checks, same order)
            obj = objects.get(key)
            state = None if obj is None else obj.state
            if state is _OFFLOADING or state is _PREFETCHING:
                if state is _OFFLOADING and key not in alive and key not in released:
                    reserved += obj.nbytes  # type: ignore[union-attr]
                continue
            if key in awaiting:
                continue
            if state is not _OFFLOADED or key in alive or key in released:
                if key in planned:  # plan.issued
                    done.add(key)
                continue
            nbytes = obj.nbytes  # type: ignore[union-attr]
            if reserved and outstanding + reserved + nbytes > budget:
                self.counters["prefetch_behind_landing"] += 1
                return out
            if not (outstanding + nbytes <= budget or (outstanding == 0 and budget > 0)):
                # an eviction may make room: the rest is _prefetches' own (Note [An offer taken whole, ...])
                out.extend(a.key for a in self._prefetches(plan, due[i:]) if a.kind is _PREFETCH)
                return out
            if room and not self._device_has_room(nbytes):
                self.counters["prefetch_no_room"] += 1
                return out
            out.append(key)
            done.add(key)  # plan.issued (a due key is planned)
        return out

    def started_all(self, keys: Iterable[int], events: Iterable[Any]) -> None:
        """:meth:`started` of each of ``keys`` with its event of ``events`` (one list each, in step)."""
        if self.record:
            for key, event in zip(keys, events, strict=True):
                self.started(key, event)
            return
        objects, counted = self.objects, self._counted
        for key, event in zip(keys, events, strict=True):
            obj = objects[key]
            obj.start_prefetch(event)
            if key not in counted:  # _count, inlined
                counted.add(key)
                self.outstanding += obj.nbytes
        if self.outstanding > self.peak_outstanding:
            self.peak_outstanding = self.outstanding

    def upload_order(self, keys: list[int]) -> list[int]:
        """``keys`` in the order their uploads are planned: predicted next use first (ties: key order).

        Without a plan, by the predictor's prediction over what this round observed.
        """
        if self.plan is not None:
            need = self.plan.need
        else:
            packed = self.observation.pack_times
            last = max(packed.values(), default=0.0)
            need = self.predictor.predict(StepObservation({**{k: last for k in keys if k not in packed}, **packed}))
        ordered = sorted(keys)  # ties by key: a stable sort by need of the keys in key order (no tuple per key)
        try:
            return sorted(ordered, key=need.__getitem__)
        except KeyError:  # a key without a predicted use: needed at 0.0
            return sorted(ordered, key=lambda k: need.get(k, 0.0))

    # -- backward ------------------------------------------------------------------------
    def backward_began(self, t: float) -> None:
        """A backward round over this graph started at ``t`` (a retained graph may run several).

        The binding then calls :meth:`make_plan` when no plan is running (a retained graph's
        next round, or a forward that ended without planning).
        """
        if self.record:
            self._log("backward_began", t)
        self.round += 1
        self.in_backward = True
        self._t_backward = t

    def backward_aborted(self) -> None:
        """A backward round could not be tracked (the read was not inside autograd's engine)."""
        if self.record:
            self._log("backward_aborted")
        self.in_backward = False

    def used(self, key: int, t: float, *, managed_key: int | None = None) -> Iterator[Action]:
        """Backward read save ``key`` at ``t``: a trigger. Returns the actions due now (lazily).

        ``managed_key`` is the managed object the save belongs to (None for a save that
        was not offloaded); it needs no more planning.
        """
        record = self.record
        if record:
            self._log("used", key, t, managed_key=managed_key)
        now = t - self._t_backward
        if self.round == 0 and self.in_backward:
            self.observation.first_use.setdefault(key, now)
        plan = self.plan
        if plan is None:
            return NO_ACTIONS
        if managed_key is not None:
            plan.issued(key)
        if not len(plan):
            return NO_ACTIONS
        vtime = self.vtime = plan.virtual_time(key, now)  # _offer, inlined (once per unpack)
        due = plan.due(math.inf if self.prefetch_mode == "asap" else vtime)
        actions = self._prefetches(plan, due, managed_key) if due else NO_ACTIONS
        if self._on_nvme:  # Note [Two hops from NVMe]
            actions = self._with_stages(plan, vtime, actions)
        if self._budget_evictions:  # Note [One device budget across kinds]
            actions = self._with_evictions(actions, skip=managed_key)
        return self._resumes_recorded(actions) if record else actions

    def reloaded(self, key: int, event: Any) -> None:
        """The binding reloaded ``key`` on demand (a stall) and the consuming stream waited for ``event``."""
        if self.record:
            self._log("reloaded", key)
        obj = self.objects[key]
        obj.start_prefetch(event)
        obj.finish_prefetch(stream_waited=True)
        if self.plan is not None:
            self.plan.issued(key)

    def reused(self, key: int) -> None:
        """Backward read ``key`` from device memory that was still alive: no copy was needed.

        Call it before :meth:`used` for the same read: a held copy leaves the prefetch budget here
        (Note [A reused copy leaves the budget at its use]).
        """
        if self.record:
            self._log("reused", key)
        if self.plan is not None:
            self.plan.issued(key)
        self._uncount(key)

    def awaited(self, key: int) -> None:
        """The consuming stream waits for the prefetch of ``key``: its device copy is usable there."""
        if self.record:
            self._log("awaited", key)
        obj = self.objects[key]
        if obj.state is _PREFETCHING:
            obj.finish_prefetch(stream_waited=True)

    def _free_held(self, key: int) -> None:
        obj = self.objects[key]
        if obj.state is _OFFLOADING:
            obj.release_device_copy()  # its D2H landed when it was held

    def _offer(self, vtime: float) -> Iterator[Action]:
        if self._budget_evictions:
            evictions, self._budget_evictions = self._budget_evictions, []
            return self._with_evictions_list(evictions, self._offer(vtime))
        plan = self.plan
        if plan is None or not len(plan):
            return NO_ACTIONS
        self.vtime = vtime
        due = plan.due(math.inf if self.prefetch_mode == "asap" else vtime)
        if self._on_nvme:  # Note [Two hops from NVMe]
            return self._with_stages(plan, vtime, self._prefetches(plan, due) if due else NO_ACTIONS)
        if not due:
            return NO_ACTIONS
        return self._prefetches(plan, due)

    def _prefetches(self, plan: PrefetchPlan, due: list[int], in_use: int | None = None) -> Iterator[Action]:
        """Offer the due reloads in deadline order, within the budget and the device's room.

        ``in_use``: the object backward reads at this trigger, never evicted for them (Note [The copy being
        read is not a victim])."""
        if self._no_prefetch_round == (self.round if self.in_backward else self.round + 1):  # upcoming_round
            return  # Note [No speculative allocation after a refusal]
        objects = self.objects
        awaiting, alive, released = self._awaiting_host, self._alive_elsewhere, self._released
        reserved = 0  # due objects still landing, held when they land (Note [A copy still landing keeps ...])
        for key in due:
            obj = objects.get(key)
            state = None if obj is None else obj.state
            if state is _OFFLOADING or state is _PREFETCHING:
                # a copy in flight: its D2H (the device copy is still there, see landed), or an
                # evicted prefetch not landed yet (offered again once drop_landed made it offloaded)
                if state is _OFFLOADING and key not in alive and key not in released:
                    reserved += obj.nbytes  # type: ignore[union-attr]
                continue
            if key in awaiting:
                continue  # its host copy is not the data yet (Note [Objects produced on the host])
            if key in self._on_nvme:
                continue  # not in host memory yet: its stage comes first (Note [Two hops from NVMe])
            if state is not _OFFLOADED or key in alive or key in released:
                plan.issued(key)
                continue
            nbytes = obj.nbytes  # type: ignore[union-attr]
            outstanding, budget = self.outstanding, self.budget
            if reserved and outstanding + reserved + nbytes > budget:
                self.counters["prefetch_behind_landing"] += 1
                return  # Note [A copy still landing keeps its place in the budget]
            if not (outstanding + nbytes <= budget or (outstanding == 0 and budget > 0)):  # within_budget
                victims = self._evict_for(plan, key, nbytes, in_use)
                if not victims:
                    return
                for victim in victims:
                    yield self._emit(Action(_EVICT, victim, objects[victim].nbytes))
            shared = self.shared_budget
            if shared is not None:
                if not self._admit_shared(key, nbytes):
                    self.counters["shared_budget_full"] += 1  # copied on demand at its use, or offered again
                    return
                while self._budget_evictions:  # its own copies the shared budget evicted for it
                    yield self._emit(self._budget_evictions.pop(0))
            if not self._device_has_room(nbytes):
                self.counters["prefetch_no_room"] += 1  # cheap to find out: the next trigger asks again
                if shared is not None:
                    shared.release(self, key)
                return
            self._refused = False
            yield self._emit(Action(_PREFETCH, key, nbytes))
            if self._refused:
                if shared is not None and key not in self._counted:
                    shared.release(self, key)
                return
            plan.issued(key)

    # -- the NVMe tier (Note [Two hops from NVMe]) ----------------------------------------------
    def _with_stages(self, plan: PrefetchPlan, vtime: float, prefetches: Iterator[Action]) -> Iterator[Action]:
        """The due stages (NVMe → host), then ``prefetches``; a refused stage ends this trigger's stages."""
        due = plan.due_stages(math.inf if self.prefetch_mode == "asap" else vtime)
        for key in due:
            obj = self.objects.get(key)
            if key not in self._on_nvme or key in self._staging or key in self._released or obj is None:
                plan.stage_issued(key)
                continue
            self._refused = False
            yield self._emit(Action(_STAGE, key, obj.nbytes))
            if self._refused:
                break
            plan.stage_issued(key)
        yield from prefetches

    def spilled(self, key: int) -> None:
        """The host copy of the offloaded ``key`` now lives on the NVMe tier only (its write completed and the
        host buffer was released): its reload stages it first (Note [Two hops from NVMe])."""
        if self.record:
            self._log("spilled", key)
        obj = self.objects[key]
        if obj.state is not _OFFLOADED:
            raise IllegalTransitionError(
                f"object {obj.describe()} is {obj.state.value}: only an offloaded object (its host copy the data, "
                "no device copy) can live on NVMe"
            )
        obj.host_tier = _NVME
        self._on_nvme.add(key)
        if self.plan is not None:
            self.plan.add_stage(key)

    def on_nvme(self, key: int) -> bool:
        """Whether ``key``'s host copy is on the NVMe tier now (spilled, its stage not landed)."""
        return key in self._on_nvme

    def stage_started(self, key: int, event: Any = None) -> None:
        """The binding started the offered stage of ``key`` (an NVMe → host read; ``event``: its handle)."""
        if self.record:
            self._log("stage_started", key)
        self._staging.add(key)
        self.counters["staged"] += 1

    def stage_refused(self, key: int, reason: str) -> None:
        """The offered stage of ``key`` was not started (``"no_room"``: no host buffer, ...): it comes again at
        the next trigger."""
        if self.record:
            self._log("stage_refused", key, reason)
        self._refused = True
        self.counters["stage_refused"] += 1

    def staged(self, key: int, t: float | None = None) -> Iterator[Action]:
        """The stage of ``key`` landed: its host copy is in host memory (``pinned``). A trigger: returns the
        actions due now (lazily), ``t`` the binding's clock (seconds; None: the plan's clock of the last trigger)."""
        if self.record:
            self._log("staged", key, t)
        self._staging.discard(key)
        self._on_nvme.discard(key)
        self.objects[key].host_tier = _PINNED
        plan = self.plan
        if plan is None:
            return NO_ACTIONS
        vtime = self.vtime if t is None or not self.in_backward else plan.virtual_time(None, t - self._t_backward)
        return self._offered(self._offer(vtime))

    def stage_failed(self, key: int) -> None:
        """The stage of ``key`` failed: its host copy is still on NVMe (offered again at the next trigger)."""
        if self.record:
            self._log("stage_failed", key)
        self._staging.discard(key)
        if self.plan is not None:
            self.plan.stage_reopen(key)

    # Note [The copy being read is not a victim]
    # A trigger is backward reading an object; the prefetches it offers may need budget room, made
    # by evicting copies the plan says are needed after them. The plan is a prediction: the object
    # read right now may be one it placed later (a step whose order differs from the one the
    # predictor learnt, e.g. an evaluation or a frozen teacher in between), and it is still counted
    # until the binding takes it over (awaited/consumed, after the trigger). Evicting it would drop
    # the device copy the binding is about to hand to autograd. ``used`` passes its managed key
    # down, and the victims are chosen among the others.
    def _evict_for(self, plan: PrefetchPlan, key: int, nbytes: int, in_use: int | None = None) -> list[int]:
        """Belady: make budget room for ``key`` by evicting held or prefetched copies needed later.

        Victims are taken furthest next use first, and only among copies needed after
        ``key``, never ``in_use`` (the copy being read now); their reloads are planned again.
        Returns the victims, none when that cannot make enough room.
        """
        need = plan.need.get(key, math.inf)
        candidates = sorted(
            (k for k in self._counted if plan.need.get(k, -math.inf) > need and k != in_use),
            key=lambda k: (plan.need[k], k),
            reverse=True,
        )
        victims: list[int] = []
        freed = 0
        for victim in candidates:
            if self.outstanding - freed + nbytes <= self.budget:
                break
            victims.append(victim)
            freed += self.objects[victim].nbytes
        if not victims or self.outstanding - freed + nbytes > self.budget:
            return []
        for victim in victims:
            self._uncount(victim)
            if self._unhold(victim):
                self._free_held(victim)
            plan.reopen(victim)
            self.counters["evicted"] += 1
        return victims

    def started(self, key: int, event: Any) -> None:
        """The binding started the offered prefetch of ``key`` (``event`` completes when it lands)."""
        if self.record:
            self._log("started", key)
        obj = self.objects[key]
        obj.start_prefetch(event)
        self._count(key, obj.nbytes)

    def refused(self, key: int, reason: str) -> None:
        """The offered prefetch of ``key`` was not started: ``"oom"`` (the allocator refused:
        no more prefetches this round), ``"no_room"`` or ``"failed"`` (it comes again next trigger)."""
        if self.record:
            self._log("refused", key, reason)
        self._refused = True
        if reason == "oom":
            self.counters["prefetch_oom"] += 1
            self._no_prefetch_round = self.upcoming_round
        elif reason == "no_room":
            self.counters["prefetch_no_room"] += 1

    def prefetch_failed(self, key: int) -> None:
        """A started prefetch failed on its stream: the host copy is still the data."""
        if self.record:
            self._log("prefetch_failed", key)
        self._uncount(key)
        self.objects[key].fail_prefetch()

    def consumed(self, key: int, *, dropped: bool = False) -> bool:
        """Every record of ``key`` was used this round: backward owns the device copy now.

        Returns whether it was a held copy (the binding then frees offcore's device copy).
        ``dropped=True``: and the binding stopped referencing its restored copy, as a
        :meth:`dropped` right after (one call; recorded as the two events).
        """
        if self.record:
            self._log("consumed", key)
            if dropped:
                self._log("dropped", key)
        if key in self._counted:  # _uncount, inlined
            self._counted.remove(key)
            self.outstanding -= self.objects[key].nbytes
            if self.shared_budget is not None:
                self.shared_budget.release(self, key)
        if self._budget_evictions:  # taken over: an eviction not delivered yet is void
            self._budget_evictions = [a for a in self._budget_evictions if a.key != key]
        held = key in self._held
        if held:
            del self._held[key]
            self._free_held(key)
        if dropped:
            obj = self.objects[key]
            if obj.state is _RESTORED:
                obj.drop_restored_copy()
        return held

    def _unhold(self, key: int) -> bool:
        if key in self._held:
            del self._held[key]
            return True
        return False

    def dropped(self, key: int) -> None:
        """The binding stopped referencing a restored device copy (the host copy stays).

        A copy still in flight is dropped once it landed: the binding then sends
        :meth:`drop_landed`.
        """
        if self.record:
            self._log("dropped", key)
        self._uncount(key)
        obj = self.objects[key]
        if obj.state is _RESTORED:
            obj.drop_restored_copy()

    def drop_landed(self, key: int) -> None:
        """The prefetch of a dropped copy landed: the host copy is the data again."""
        if self.record:
            self._log("drop_landed", key)
        obj = self.objects[key]
        if obj.state is _PREFETCHING:
            obj.finish_prefetch(stream_waited=True)
            obj.drop_restored_copy()

    def released(self, key: int) -> bool:
        """No record uses ``key`` any more. Returns whether it was held (the binding drops it)."""
        if self.record:
            self._log("released", key)
        if key in self._counted:  # _uncount, inlined
            self._counted.remove(key)
            self.outstanding -= self.objects[key].nbytes
            if self.shared_budget is not None:
                self.shared_budget.release(self, key)
        self._alive_elsewhere.discard(key)
        self._released.add(key)
        if key in self._held:  # _unhold, inlined
            del self._held[key]
            return True
        return False

    def backward_ended(self, t: float) -> list[Action]:
        """The backward round ended at ``t``: free what was held; the first round teaches the predictor."""
        if self.record:
            self._log("backward_ended", t)
        self.in_backward = False
        self.observation.backward_seconds = t - self._t_backward
        if self.round == 0:
            self.predictor.observe(self.observation)
        self.plan = None
        held, self._held = list(self._held), {}
        out = []
        for key in held:
            self._uncount(key)
            self._free_held(key)
            out.append(self._emit(Action(_FREE, key, self.objects[key].nbytes)))
        return out
