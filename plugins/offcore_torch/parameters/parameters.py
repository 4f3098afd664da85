"""Parameters streamed by next use: ``offload_parameters`` keeps a model's parameters on the host.

Between uses every parameter (and, with ``buffers=True``, every buffer) lives in a pinned
host buffer; its device storage is empty. Each module's parameters are copied in on the
runtime's host-to-device stream before its forward and again before its backward, by the
deadline the core scheduler (:class:`offcore.residency.ResidencyScheduler`) learnt from
earlier steps, within a byte budget of copies made ahead of use; the device copy is freed
after the last use of each pass. The ``nn.Parameter`` objects stay the same objects
(optimizers, tied weights and ``state_dict`` keys keep working).

    >>> import offcore, offcore_torch, torch
    >>> dev = offcore.device("cpu", capacity="64MiB")
    >>> with dev:
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ...     handle = offcore_torch.offload_parameters(model, dev)
    ...     for _ in range(2):
    ...         model(torch.randn(8, 64)).square().mean().backward()
    >>> handle.stats().h2d_copies > 0
    True
    >>> handle.remove()                     # every parameter back on the device, bit-identical

# Note [Parameter storage is swapped, the Parameter object is not]
# A parameter's device memory is freed and re-allocated *under* its storage:
# ``untyped_storage().resize_(0)`` frees it, ``resize_(nbytes)`` allocates it again and an
# H2D copy fills it (FSDP does the same with its unsharded parameters). The tensor, its
# ``UntypedStorage`` object, its version counter and every view of it stay the same
# objects. That matters for autograd: ``Linear`` saves ``weight.t()``, a view that holds
# the *storage*, not the Parameter; swapping ``param.data`` instead would leave that view
# on the old memory (nothing freed until backward). Why it is safe:
# - the version counter: the copies write through an alias made with ``set_`` (its own
#   version counter), and ``resize_`` of a storage bumps no version, so streaming never
#   changes ``param._version``; autograd's check of a saved parameter still catches a real
#   in-place change between forward and backward (an optimizer step before backward);
# - the values: a parameter saved for backward is read by backward only after its module's
#   backward pre-hook (a multi-grad hook on the module's outputs, which fires before any of
#   the module's backward nodes runs) has copied it in again and the compute stream waited
#   for the copy; the host copy is exact, so backward reads the bytes forward read;
# - a use nobody announced (a weight used outside its module's forward, ``load_state_dict``,
#   an optimizer step) goes through ``__torch_function__`` of the parameter's class (a
#   subclass of ``nn.Parameter`` set on the same object) and fetches it synchronously; it
#   stays on the device until the end of backward or the optimizer step;
# - a device copy whose version counter moved (an optimizer step, ``load_state_dict``) is
#   written back to the host before it is freed, and so is every buffer of a module that ran
#   forward in training mode (BatchNorm's kernel updates its running statistics in place
#   without a version bump), so the host copy is always the data.
# A storage is resized only on the compute stream, after every copy touching it completed
# (a copy in flight is waited for first), so no copy reads freed memory.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from offcore_layout import describe, plain_tensor_problem

from offcore.errors import ConfigurationError, OffcoreError
from offcore.kinds import Direction, Kind, Tier
from offcore.ledger import Ledger
from offcore.units import parse_size
from offcore_torch.budget import shared_budget_for
from offcore_torch.nvme import nvme_tier_for, open_nvme
from offcore_torch.parameters.device import _DeviceMemory
from offcore_torch.parameters.hooks import _Hooks
from offcore_torch.parameters.nvme import _NvmeTier
from offcore_torch.parameters.state import ParameterOffloadStats, _History, _no_evict, _Slot, _Step, _Unit
from offcore_torch.parameters.steps import _Steps
from offcore_torch.runtime import DeviceRuntime, check_bool, check_device, runtime_for

__all__ = ["offload_parameters", "ParameterOffloadHandle", "ParameterOffloadStats"]


# ------------------------------------------------------------------------- the handle
class ParameterOffloadHandle(_NvmeTier, _DeviceMemory, _Steps, _Hooks):
    """What :func:`offload_parameters` returns: ``stats()``, ``release()``, ``remove()`` (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: Any,
        *,
        budget: int | str | float | None,
        buffers: bool,
        pinned: bool,
        margin: float | str,
        prefetch: str,
        persist_below: int = 0,
        record: bool = False,
        nvme: Any = None,
        tier: str = "host",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigurationError(f"offload_parameters needs an nn.Module, got {type(model).__name__}")
        if getattr(model, "_offcore_parameter_handle", None) is not None:
            raise ConfigurationError("this model's parameters are offloaded already (call handle.remove() first)")
        self.model = model
        self.device = device
        self.runtime: DeviceRuntime = runtime_for(device)
        self.ledger = Ledger()
        self.buffers = buffers
        self.prefetch = prefetch
        self.persist_below = persist_below
        self.record = record
        self._persistent: list[torch.Tensor] = []  # below persist_below: kept on the device, never offloaded
        self._persistent_ids: set[int] = set()
        self._recorded: list[dict[str, Any]] = []  # record=True: one entry per step (schedule log, settings, actions)
        self._tier: Any = None  # Note [Parameters on NVMe]
        self._tier_owned = False
        self._nvme = nvme
        self._margin = margin
        self._slots: list[_Slot] = []
        self._by_storage: dict[int, _Slot] = {}
        self._units: list[_Unit] = []
        self._module_unit: dict[int, _Unit] = {}
        self._histories: dict[tuple[bool, bool], _History] = {}
        self._step: _Step | None = None
        self._frames: list[tuple[_Unit | None, list[_Slot], bool]] = []
        self._tasks: set[int] = set()
        self._hooks: list[Any] = []
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "stalls", "unplanned", "outside", "evicted", "refused", "steps", "copy_failures"), 0
        )
        self._removed = False
        self._pool: Any = None
        self._foreign_step = False  # an optimizer stepped since the last release point
        self._early: frozenset[int] = frozenset()  # Note [The next step starts early]
        self._turn: frozenset[int] = frozenset()  # Note [Backward's first parameters stay after forward]
        self._thread = threading.current_thread()
        self._last_mode: tuple[bool, bool] | None = None  # the mode of the last step that ended
        self._host_optimizers: set[int] = set()  # ids of optimizers stepping the host copies (and their host ones)

        # a device that is entered (``with dev:``) to place allocations on it, and can be inactive now
        self._enterable = hasattr(device, "__enter__") and hasattr(device, "active")
        # Note [A module's copies are one batch]: the backend's copy_many (an optional member), if it has one
        self._copy_many: Callable[..., Any] | None = getattr(device, "copy_many", None)
        self._collect(model)
        self._param_ids = {id(s.tensor) for s in self._slots}
        largest = max((u.nbytes for u in self._units), default=0)
        capacity = int(getattr(device, "capacity", 0) or 0)
        if budget is None:
            self.budget = 2 * largest
        elif isinstance(budget, float) and not isinstance(budget, bool) and 0.0 < budget <= 1.0:
            if capacity <= 0:
                raise ConfigurationError("budget as a fraction needs a device with a known capacity")
            self.budget = int(budget * capacity)
        else:
            self.budget = parse_size(budget, what="parameter budget", allow_zero=True)
        self._capacity = capacity
        # Note [One device budget across kinds] (offcore/budget.py): offcore_torch.device_budget's, if set
        self._shared = shared_budget_for(device)
        if self._shared is not None:
            if budget is None:
                self.budget = self._shared.capacity_bytes
            self._shared.attach(self, _no_evict, minimum=largest, what="the largest module's parameters")
        try:
            if tier == "nvme":
                self._tier, self._tier_owned = open_nvme(device, nvme)
            self._offload_all()
            self._install()
        except BaseException:
            self._teardown()
            raise
        model._offcore_parameter_handle = self  # type: ignore[assignment]

    # -- setup -----------------------------------------------------------------------
    def _slot_for(self, tensor: torch.Tensor, name: str, is_buffer: bool) -> _Slot | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        problem = None if tensor.is_meta else plain_tensor_problem(tensor)  # meta: "on meta", below
        if problem is not None:  # Note [Raw pointers see checked tensors only]: checked before any storage use
            raise ConfigurationError(
                f"offload_parameters: {name} ({describe(tensor)}) cannot be offloaded: {problem}. Offload plain "
                "dense parameters (FSDP2 shards its parameters itself: offload its optimizer with "
                "offcore_torch.distributed.FSDPOffloadOptimizer)"
            )
        if tensor.numel() == 0:
            return None
        storage = tensor.untyped_storage()
        slot = self._by_storage.get(id(storage))
        if slot is not None:
            if slot.tensor is not tensor:
                raise ConfigurationError(
                    f"offload_parameters: {name} shares its storage with {slot.name} but is another tensor; "
                    "tie parameters by assigning the same nn.Parameter (model.head.weight = model.emb.weight)"
                )
            return slot
        if tensor.storage_offset() != 0 or storage.nbytes() != tensor.numel() * tensor.element_size():
            raise ConfigurationError(
                f"offload_parameters: {name} is a view into a larger storage; only tensors that own their whole "
                "storage can be offloaded"
            )
        if tensor.numel() * tensor.element_size() < self.persist_below:
            # Note [Small parameters stay on the device]
            if id(tensor) not in self._persistent_ids:
                if tensor.device.type != "cpu" and not self.device.holds(tensor):
                    raise ConfigurationError(
                        f"offload_parameters: {name} is on {tensor.device}, neither in the device's memory nor on "
                        "the host"
                    )
                self._persistent_ids.add(id(tensor))
                self._persistent.append(tensor)
            return None
        from_host = not self.device.holds(tensor)
        if from_host and tensor.device.type != "cpu":
            raise ConfigurationError(
                f"offload_parameters: {name} is on {tensor.device}, neither in the device's memory nor on the host"
            )
        slot = _Slot(len(self._slots), self, tensor, name, is_buffer)
        slot.from_host = from_host
        if not from_host:
            self.ledger.add(Tier.DEVICE, Kind.PARAMETER, slot.nbytes)  # on the device until offloaded
        self._slots.append(slot)
        self._by_storage[id(storage)] = slot
        return slot

    def _collect(self, model: torch.nn.Module) -> None:
        # Note [Compiled blocks are units]
        # A block compiled with ``torch.compile(block)`` (an ``OptimizedModule``; FSDP2's per-block recipe) is
        # one unit: every parameter of its tree is fetched by the wrapper's own hooks, which run eagerly at the
        # block's boundary, and released after it (backward: the output's hook fetches them again). Hooks and
        # ``__torch_function__`` traced inside the compiled code return at once (``is_compiling()`` is a
        # constant for dynamo): no graph break, and nothing of offcore's state guarded, so no recompile.
        compiled: list[str] = []
        for mod_name, module in model.named_modules():
            if any(mod_name.startswith(prefix) for prefix in compiled):
                continue
            members = [("", module)]
            if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
                compiled.append(f"{mod_name}." if mod_name else "")
                members = list(module.named_modules())
            slots: list[_Slot] = []
            for sub_name, sub in members:
                self._collect_own(sub, ".".join(n for n in (mod_name, sub_name) if n), slots)
            if slots:
                unit = _Unit(len(self._units), mod_name or type(module).__name__, slots, sum(s.nbytes for s in slots))
                self._units.append(unit)
                self._module_unit[id(module)] = unit

    def _collect_own(self, module: torch.nn.Module, mod_name: str, slots: list[_Slot]) -> None:
        """Add the slots of ``module``'s own parameters (and buffers) to ``slots``."""
        for pname, param in module._parameters.items():
            if param is None:
                continue
            slot = self._slot_for(param, f"{mod_name}.{pname}".lstrip("."), False)
            if slot is not None and slot not in slots:
                slots.append(slot)
        if self.buffers:
            for bname, buf in module._buffers.items():
                if buf is None:
                    continue
                slot = self._slot_for(buf, f"{mod_name}.{bname}".lstrip("."), True)
                if slot is not None and slot not in slots:
                    slots.append(slot)

    def _offload_all(self) -> None:
        dev, rt = self.device, self.runtime
        for tensor in self._persistent:  # Note [Small parameters stay on the device]
            if not dev.holds(tensor):
                self._to_device_with_data(tensor)
        if self._tier is not None:
            self._offload_all_to_nvme()
            return
        # one pinned block holding every host copy exactly (slices are 512-byte aligned)
        total = max(512, sum(-(-s.nbytes // 512) * 512 for s in self._slots))
        self._pool = dev.host_pool(total, pinned=True, block_size=total)
        compute = dev.current_stream()
        rt.d2h_stream.wait_stream(compute)
        last = None
        for slot in self._slots:
            slot.host = self._pool.acquire(slot.nbytes)
            slot.host_view = slot.host.view
            self.ledger.add(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
            if slot.from_host:
                slot.host_view.copy_(slot.alias)
                continue
            last = dev.copy_(slot.host_view, slot.alias, stream=rt.d2h_stream)
        if last is not None:
            last.synchronize()
        for slot in self._slots:
            if slot.from_host:
                self._to_device_empty(slot)
            self._set_class(slot)
            self._resize(slot, 0)
            slot.resident = False
        self.ledger.reset_step()  # peaks and copies count from here

    # -- public ------------------------------------------------------------------------
    def release(self) -> None:
        """Write back what changed and free every device copy not in use (after an optimizer step, an
        exception, or to read device memory between steps). Called automatically after ``optimizer.step()``."""
        if self._frames:
            return
        if self._tasks:
            self._forget_failed_backwards()
        self._end_step()
        self._release_outside()
        for slot in self._slots:
            self._maybe_free(slot)

    def host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host copy of an offloaded parameter or buffer (a typed view of its pinned buffer).

        Writing it changes the parameter: call :meth:`host_updated` afterwards.
        """
        slot = getattr(tensor, "_offcore_slot", None)
        if slot is None or slot.handle is not self:
            raise ConfigurationError("host_tensor: this tensor is not offloaded by this handle")
        if self._tier is not None:
            raise ConfigurationError(
                "the parameters of this handle live on NVMe (offload_parameters(..., nvme=...) or the device's "
                "nvme_tier): they have no host copy to step in place, so OffloadOptimizer cannot use them as its "
                "masters yet; pass params_on_host=False to OffloadOptimizer (its own host masters), or "
                "offload_parameters(..., tier='host') to keep the parameters in host memory"
            )
        assert slot.host_view is not None
        return slot.host_view.view(tensor.dtype).view(tensor.shape)

    def host_updated(self, tensors: Any = None) -> None:
        """The host copies were changed (a host optimizer step): device copies still held are dropped, so
        the next use streams the new values in. With an OffloadOptimizer attached, the next step's round
        begins now (Note [The next step starts early]): its first copies, of the new values, start.

        ``tensors`` (default: every parameter) are the ones whose host copy is the data now: their
        device copies are dropped *without* being written back (a copy fetched before the step holds
        the old values)."""
        if tensors is None:
            updated = [s for s in self._slots if not s.is_buffer]
        else:
            updated = []
            for tensor in tensors:
                slot = getattr(tensor, "_offcore_slot", None)
                if slot is None or slot.handle is not self:
                    raise ConfigurationError("host_updated: a tensor is not offloaded by this handle")
                updated.append(slot)
        for slot in updated:
            slot.outside = False
            slot.dirty = False
            slot.version = slot.vref._version
        self.release()  # ends a backward that raised too (Note [A backward that raised leaves its task behind])
        for slot in self._slots:
            if slot.resident and not (slot.pins or slot.bwd_tasks):
                if slot.event is not None:
                    event, slot.event = slot.event, None
                    try:
                        event.synchronize()
                    except Exception:  # Note [A parameter copy that failed is copied again]: dropped anyway
                        self._copy_failed()
                self._resize(slot, 0)
                slot.resident = False
        mode = self._last_mode
        if (
            self._host_optimizers
            and mode is not None
            and mode[0]
            and not (self._frames or self._tasks or self._removed)
        ):
            # Note [The next step starts early], after the host step: its first copies are of the new values
            step = self._begin_step(time.perf_counter(), mode=mode)
            step.prestarted = True

    def _attach_host_optimizer(self, optimizer: Any) -> None:
        """An OffloadOptimizer steps these host copies in place (Note [Parameters on the host with
        offload_parameters] in optimizer.py): its steps are not foreign steps, and nothing is kept or
        copied in at the end of backward (the values change in the step)."""
        self._host_optimizers.add(id(optimizer))
        host = getattr(optimizer, "host_optimizer", None)
        if host is not None:
            self._host_optimizers.add(id(host))
        self._early = frozenset()

    def _detach_host_optimizer(self, optimizer: Any) -> None:
        self._host_optimizers.discard(id(optimizer))
        host = getattr(optimizer, "_host", None)
        if host is not None:
            self._host_optimizers.discard(id(host))

    def stats(self, *, reset: bool = False) -> ParameterOffloadStats:
        """Bytes, copies and waits so far (see :class:`ParameterOffloadStats`)."""
        self.runtime.resolve_timings()
        ledger = self.ledger
        h2d, d2h = ledger.copies[Direction.H2D], ledger.copies[Direction.D2H]
        host = {"parameter": 0, "buffer": 0}
        nvme = 0
        for slot in self._slots:
            if slot.disk_key is not None:
                nvme += slot.nbytes  # on disk between uses; its host bytes are the staging pool's
            else:
                host["buffer" if slot.is_buffer else "parameter"] += slot.nbytes
        out = ParameterOffloadStats(
            host_bytes=host,
            device_bytes=ledger.bytes(Tier.DEVICE, Kind.PARAMETER),
            peak_device_bytes=ledger.peak(Tier.DEVICE, Kind.PARAMETER),
            h2d_bytes=h2d.bytes,
            h2d_copies=h2d.copies,
            d2h_bytes=d2h.bytes,
            d2h_copies=d2h.copies,
            prefetch_hits=self._counters["hits"],
            stalls=self._counters["stalls"],
            unplanned=self._counters["unplanned"],
            outside_fetches=self._counters["outside"],
            evicted=self._counters["evicted"],
            refused=self._counters["refused"],
            steps=self._counters["steps"],
            budget=self.budget,
            exposed_wait_s=ledger.wait_seconds,
            waits=dict(ledger.waits),
            persistent_bytes=sum(t.numel() * t.element_size() for t in self._persistent),
            nvme_bytes=nvme,
            staging_bytes=self._pool.reserved_bytes if self._tier is not None and self._pool is not None else 0,
            copy_failures=self._counters["copy_failures"],
        )
        if reset:
            ledger.reset_step()
            for name in self._counters:
                self._counters[name] = 0
        return out

    @property
    def schedules(self) -> list[dict[str, Any]]:
        """Each finished step's schedule (needs ``record=True``): ``{"log", "settings", "actions"}``, the
        events fed to that step's :class:`~offcore.residency.ResidencyScheduler` with their times, its
        settings and the actions it returned. ``offcore.sim.replay.replay(s["log"], **s["settings"])``
        decides ``s["actions"]`` again (without a shared device budget, which a replay does not model).

            >>> s = handle.schedules[-1]                                        # doctest: +SKIP
            >>> replay(s["log"], **s["settings"]) == s["actions"]               # doctest: +SKIP
            True
        """
        if not self.record:
            raise ConfigurationError("this handle records no schedule: pass record=True to offload_parameters")
        return list(self._recorded)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of every parameter (and buffer, with ``buffers=True``) this handle manages."""
        return sum(s.nbytes for s in self._slots)

    @property
    def largest_module_bytes(self) -> int:
        """Bytes of the largest module's own parameters (what one use brings in at once)."""
        return max((u.nbytes for u in self._units), default=0)

    def remove(self) -> None:
        """Bring every parameter and buffer back to the device (bit-identical) and remove every hook."""
        if self._removed:
            return
        if self._frames and not self._frames_are_stale():
            raise OffcoreError("handle.remove() inside the model's forward")
        if self._frames:  # Note [Forwards ended by a BaseException]
            self._abort()
        self._end_step()
        for slot in self._slots:
            slot.outside = False
            slot.holds = 0
            slot.bwd_tasks.clear()
            self._maybe_free(slot)  # writes back what changed
        if self._tier is not None:  # through the staging buffers, a storage at a time
            for slot in self._slots:
                self._copy_in([slot])
                self._ready([slot], "remove")
        else:
            self._copy_in(self._slots)
            self._ready(self._slots, "remove")
        self._teardown()

    def discard(self) -> None:
        """Remove every hook and give the host copies back *without* bringing the parameters back: the
        model is unusable afterwards (its parameters have empty storages). For a model that would not
        fit on the device whole, once it is no longer needed."""
        if self._removed:
            return
        self._frames.clear()
        self._step = None
        self._teardown(restore=False)

    def _teardown(self, *, restore: bool = True) -> None:
        self._removed = True
        if self._shared is not None:
            self._shared.detach(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with contextlib.suppress(Exception):
            self.runtime.h2d_stream.synchronize()
            self.runtime.d2h_stream.synchronize()
        for slot in self._slots:
            if slot.tensor.__dict__.get("_offcore_slot") is slot:
                del slot.tensor._offcore_slot  # type: ignore[attr-defined]
                slot.tensor.__class__ = slot.klass
            if not slot.resident and restore:  # setup failed half-way: restore from the host copy
                if slot.host_view is None and slot.disk_key is not None and self._tier is not None:
                    self._host_in([slot])  # its copy is on NVMe
                self._resize(slot, slot.nbytes)
                slot.resident = True
                assert slot.host_view is not None
                slot.alias.copy_(slot.host_view)
            if slot.host is not None:
                self._pool.release(slot.host)
                self.ledger.remove(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
                slot.host = None
                slot.host_view = None
        self._close_tier()
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.trim()
        if getattr(self.model, "_offcore_parameter_handle", None) is self:
            del self.model._offcore_parameter_handle

    def _close_tier(self) -> None:
        """Remove this handle's files: its own tier is closed (its directory goes), a device's shared tier
        loses this handle's keys."""
        tier, self._tier = self._tier, None
        if tier is None:
            return
        for slot in self._slots:
            if slot.reading is not None:
                with contextlib.suppress(Exception):
                    slot.reading.synchronize()
                slot.reading = None
            if slot.disk_key is not None:
                if not self._tier_owned:
                    with contextlib.suppress(Exception):
                        tier.delete(slot.disk_key)
                self.ledger.remove(Tier.NVME, Kind.PARAMETER, slot.nbytes)
                slot.disk_key = None
        if self._tier_owned:
            tier.close()

    def __enter__(self) -> ParameterOffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"ParameterOffloadHandle({len(self._slots)} storages, {self.parameter_bytes} bytes, budget {self.budget}"
            f"{', removed' if self._removed else ''})"
        )


def offload_parameters(
    model: torch.nn.Module,
    device: Any,
    *,
    budget: int | str | float | None = None,
    buffers: bool = False,
    pinned: bool = True,
    margin: float | str = "0.5ms",
    prefetch: str = "deadline",
    persist_below: int | str = 0,
    record: bool = False,
    nvme: Any = None,
    tier: str | None = None,
) -> ParameterOffloadHandle:
    """Keep ``model``'s parameters on the host between uses, streamed in by next use (see the module doc).

    - ``budget``: device bytes copied in ahead of their use at once (bytes, ``"64MiB"``, or a
      fraction of the device's capacity such as ``0.1``); default twice the largest module's
      own parameters. The module being computed is not counted: the device holds at most
      ``budget`` + the parameters in use.
    - ``buffers``: offload buffers too (BatchNorm running statistics are written back when forward
      changed them).
    - ``margin``: slack before each predicted use; ``prefetch``: ``"deadline"`` (each copy planned to land
      just before its predicted use), ``"asap"`` (the next uses' copies start as soon as the budget has room:
      the deepest prefetch the budget allows, for links whose copy times the plan underestimates) or
      ``"on_demand"``.
    - ``persist_below``: parameters (and buffers) smaller than this many bytes stay on the device
      (biases, norms: each use of one costs as much CPU as a large weight's; Note [Small
      parameters stay on the device]); default 0 (everything streamed).
    - ``tier``: ``"host"`` (default) keeps the parameters in pinned host memory between uses; ``"nvme"`` on
      disk, staged NVMe -> pinned host -> device (Note [Parameters on NVMe]), in the tier ``nvme=`` names
      or else the device's (:func:`offcore_torch.nvme_tier`) -- as for activations and the optimizer, the
      device's tier is used only when asked for.
    - ``nvme``: a directory or an :class:`offcore.nvme.NvmeSpec` (a path and a byte budget) for this
      handle's own tier; giving it implies ``tier="nvme"``.
    - ``record``: keep each step's scheduler events and actions (:attr:`ParameterOffloadHandle.schedules`),
      replayable through :func:`offcore.sim.replay.replay` to the same actions.

    Returns a :class:`ParameterOffloadHandle` (``stats()``, ``release()``, ``remove()``; also a
    context manager that removes itself).

        >>> handle = offload_parameters(model, dev, budget="32MiB")   # doctest: +SKIP
    """
    check_device(device, "offload_parameters")
    check_bool(buffers, "buffers", "offload_parameters")
    check_bool(pinned, "pinned", "offload_parameters")
    if prefetch not in ("deadline", "asap", "on_demand"):
        raise ConfigurationError(f"prefetch must be 'deadline', 'asap' or 'on_demand', got {prefetch!r}")
    if not pinned:
        raise ConfigurationError(
            "offload_parameters keeps host copies in pinned memory (pinned=False is not supported)"
        )
    if not isinstance(margin, (int, float)):
        from offcore.units import parse_duration

        margin = parse_duration(margin, what="margin")
    if not math.isfinite(float(margin)) or margin < 0:
        raise ConfigurationError(f"margin must be a non-negative duration, got {margin!r}")
    persist = parse_size(persist_below, what="persist_below", allow_zero=True)
    if nvme is False:  # the spelling of "host" before tier= existed
        nvme = None
    if tier is None:
        tier = "nvme" if nvme is not None else "host"
    if tier not in ("host", "nvme"):
        raise ConfigurationError(
            f"tier={tier!r}: parameters live in 'host' memory (the default) or on 'nvme' (nvme=PATH, or the "
            "device's tier set with offcore_torch.nvme_tier(device, PATH))"
        )
    if tier == "host" and nvme is not None:
        raise ConfigurationError(f"nvme={nvme!r} was given with tier='host': pass tier='nvme' (or leave tier out)")
    if tier == "nvme" and nvme is None and nvme_tier_for(device) is None:
        raise ConfigurationError(
            "tier='nvme' needs a tier: pass nvme=PATH (or an offcore.nvme.NvmeSpec), or set the device's with "
            "offcore_torch.nvme_tier(device, PATH, budget=...)"
        )
    return ParameterOffloadHandle(
        model,
        device,
        budget=budget,
        buffers=buffers,
        pinned=pinned,
        margin=margin,
        prefetch=prefetch,
        persist_below=persist,
        record=bool(record),
        nvme=nvme,
        tier=tier,
    )
