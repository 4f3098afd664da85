"""ParameterOffloadHandle's device memory: copies in, storage swaps, write-backs (mixin ``_DeviceMemory``).

Moved from parameters.py.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from offcore.errors import ConfigurationError, CopyFailedError, OffcoreWarning
from offcore.kinds import Direction, Kind, Tier
from offcore_torch.parameters.state import _Slot, _slot_bytes, _version_ref
from offcore_torch.parameters.tensors import OffloadedBuffer, OffloadedParameter


class _DeviceMemory:
    """ParameterOffloadHandle's device-memory methods (see parameters.py)."""

    def _to_device_with_data(self, tensor: torch.Tensor) -> None:
        """A small tensor of a model built on the host moves to the device with its values (it stays there)."""
        with self._device_active():
            new = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=self.device.torch_device
            )
            with torch.no_grad():
                new.copy_(tensor)
        with torch.no_grad():
            tensor.data = new

    def _to_device_empty(self, slot: _Slot) -> None:
        """A tensor of a model built on the host gets a device storage (one tensor on the device at a time,
        freed right after by the caller), so the whole model never has to fit on the device."""
        tensor = slot.tensor
        with self._device_active():
            new = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=self.device.torch_device
            )
        with torch.no_grad():
            tensor.data = new
        slot.storage = new.untyped_storage()
        slot.alias = torch.empty(0, dtype=torch.uint8, device=new.device).set_(slot.storage)
        slot.vref = _version_ref(tensor)
        slot.version = slot.vref._version
        self.ledger.add(Tier.DEVICE, Kind.PARAMETER, slot.nbytes)

    def _set_class(self, slot: _Slot) -> None:
        tensor = slot.tensor
        slot.klass = type(tensor)
        if slot.is_buffer:
            if type(tensor) is not torch.Tensor:
                raise ConfigurationError(f"offload_parameters: buffer {slot.name} is a {type(tensor).__name__}")
            tensor.__class__ = OffloadedBuffer
        else:
            if type(tensor) is not torch.nn.Parameter:
                raise ConfigurationError(
                    f"offload_parameters: parameter {slot.name} is a {type(tensor).__name__}; only plain "
                    "nn.Parameter objects can be offloaded"
                )
            tensor.__class__ = OffloadedParameter
        tensor._offcore_slot = slot  # type: ignore[attr-defined]

    def _install(self) -> None:
        seen: set[int] = set()
        modules = [self.model] + [m for m in self.model.modules() if id(m) in self._module_unit]
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook))
            self._hooks.append(module.register_forward_hook(self._post_hook, always_call=True))
        for slot in self._slots:
            if not slot.is_buffer and slot.tensor.requires_grad:
                self._hooks.append(slot.tensor.register_post_accumulate_grad_hook(self._accumulated))
        self._hooks.append(register_optimizer_step_post_hook(self._optimizer_stepped))

    # -- device memory -----------------------------------------------------------------
    def _resize(self, slot: _Slot, nbytes: int) -> None:
        """Allocate (``nbytes``) or free (0) the device memory under ``slot``'s storage, on the compute stream."""
        dev = self.device
        if self._enterable and not dev.active:
            with dev:
                self._resize_now(slot, nbytes)
        else:
            self._resize_now(slot, nbytes)
        if nbytes:
            self.ledger.add(Tier.DEVICE, Kind.PARAMETER, nbytes)
        elif slot.resident:
            self.ledger.remove(Tier.DEVICE, Kind.PARAMETER, slot.nbytes)

    @staticmethod
    def _resize_now(slot: _Slot, nbytes: int) -> None:
        if nbytes:
            # an operator (not UntypedStorage.resize_ from Python): both of the fake device's
            # accountings see it, and torch allocates with the storage's own allocator
            slot.alias.resize_(nbytes)
        else:
            slot.storage.resize_(0)
            slot.alias.set_(slot.storage)  # a dispatched op on the storage: the accounting sees the size

    @contextlib.contextmanager
    def _device_active(self) -> Iterator[None]:
        dev = self.device
        if not self._enterable or dev.active:
            yield
            return
        with dev:
            yield

    def _copy_in(self, slots: list[_Slot]) -> Any:
        """Allocate and start the H2D copies of the slots not on the device; returns the last copy's event."""
        need = [s for s in slots if not s.resident]
        if not need:
            return None
        dev, rt = self.device, self.runtime
        if self._tier is not None:
            self._host_in(need)  # Note [Parameters on NVMe]: the first hop, if its stage has not landed
        done: list[_Slot] = []
        try:
            for slot in need:
                self._resize(slot, slot.nbytes)
                slot.resident = True
                done.append(slot)
        except BaseException:
            for slot in done:
                self._resize(slot, 0)
                slot.resident = False
            raise
        h2d = rt.h2d_stream
        h2d.wait_stream(dev.current_stream())
        try:
            event = None
            many = self._copy_many
            batch: list[_Slot] = []
            nbytes = 0
            for slot in need:
                nbytes += slot.nbytes
                timed = rt.sample(Direction.H2D)
                if many is not None and not timed:
                    batch.append(slot)  # Note [A module's copies are one batch]
                    continue
                start, issued = rt.begin_timing(dev, h2d, record=False) if timed else (None, 0.0)
                event = dev.copy_(slot.alias, slot.host_view, stream=h2d, start_event=start)
                if timed:
                    rt.end_timing(
                        dev,
                        h2d,
                        start,
                        issued,
                        nbytes=slot.nbytes,
                        direction=Direction.H2D,
                        label="param",
                        ledger=self.ledger,
                    )
                slot.event = event
                slot.landing = event
                slot.version = slot.vref._version
            if batch:
                if len(batch) > 1:
                    batch.sort(key=_slot_bytes)  # the small ones first: they may run at once on an idle stream
                event = many([(slot.alias, slot.host_view) for slot in batch], stream=h2d)
                for slot in batch:
                    slot.event = event
                    slot.landing = event
                    slot.version = slot.vref._version
        except BaseException:
            # Note [A parameter copy that failed is copied again]: a copy refused at submission leaves the ones
            # issued before it in flight (a batch's events are not even on their slots yet). Let them land
            # before anything frees their storages or returns their staging buffers, and leave every storage of
            # this call not resident: its host copy is intact, the next use copies it again.
            with contextlib.suppress(Exception):
                h2d.synchronize()
            self.runtime.recover(h2d)
            for slot in need:
                slot.event = slot.landing = None
                if slot.resident:
                    self._resize(slot, 0)
                    slot.resident = False
            raise
        self.ledger.record_copy(Direction.H2D, nbytes, copies=len(need))
        return event

    def _ready(self, slots: list[_Slot], label: str) -> None:
        """Make the compute stream wait for the copies into ``slots`` still in flight."""
        compute = None
        for slot in slots:
            event = slot.event
            if event is None:
                continue
            slot.event = None
            try:
                if event.query():
                    continue
            except Exception as exc:  # Note [A parameter copy that failed is copied again]
                self._copy_again(slot, exc)
                continue
            if compute is None:
                compute = self.device.current_stream()
            t0 = time.perf_counter()
            try:
                compute.wait_event(event)
            except Exception as exc:  # Note [A parameter copy that failed is copied again]
                self._copy_again(slot, exc)
            self.ledger.record_wait(time.perf_counter() - t0, what=label)
        if self._tier is not None:  # the staging buffers go back once their copies landed
            for slot in slots:
                if slot.host is not None and slot.resident:
                    self._release_host(slot)

    # Note [A prefetch refused at submission is not an error of the caller's]
    # Prefetches are issued from wherever a trigger lands: a module's hooks, and also the end of an
    # OffloadOptimizer's step() (host_updated starts the next round early, Note [The next step starts
    # early]). A prefetch copy that the device refuses at submission (``copy_`` raising) left
    # _copy_in's storages not resident, their host copies intact; raising it out of step() told the
    # caller the step failed *after* the update was applied, so a retry applied it twice. A prefetch is
    # only ahead of time: its failure is a warning and a counted copy failure, the prefetch is refused
    # for this trigger, and the use copies the storages in (raising there, where nothing else happened,
    # if that copy fails too). Out-of-memory refusals stay what they were (no more prefetches).

    # Note [A parameter copy that failed is copied again]
    # A host-to-device copy of a parameter can fail on its stream (the event raises when waited for,
    # as an asynchronous CUDA error does; the fake device's injected faults do). The host copy is
    # intact (Note [A failed copy is a completed copy] in runtime.py), so: the stream's sticky error is
    # cleared (runtime.recover), and where the device copy is needed now (a use waits for it) it is
    # copied again, once, and waited for; where it is not (a prefetch nobody used, dropped or freed)
    # nothing is written back -- the device copy never held the data. A second failure raises
    # CopyFailedError, with the storage freed and not resident, so the next use copies it again. A
    # write-back (device to host) that fails is copied again the same way from the device copy, which
    # stays resident if the second one fails too.
    # Before, the failed event stayed on the slot: every later step re-raised the same error, and
    # handle.remove() too (the model could not even be taken back).
    def _copy_failed(self) -> None:
        self._counters["copy_failures"] += 1
        self.runtime.recover(self.runtime.h2d_stream)

    def _copy_again(self, slot: _Slot, first: BaseException) -> None:
        """A use waits for ``slot``'s copy, which failed on its stream: copy it again from the host (once)."""
        self._copy_failed()
        warnings.warn(
            f"offcore: the host-to-device copy of {slot.name} failed on its stream ({first}); copied again from "
            "its intact host copy (Note [A parameter copy that failed is copied again])",
            OffcoreWarning,
            stacklevel=3,
        )
        try:
            if self._tier is not None and slot.host is None:
                self._host_in([slot])
            self.device.copy_(slot.alias, slot.host_view, stream=self.runtime.h2d_stream).synchronize()
        except Exception as again:
            self.runtime.recover(self.runtime.h2d_stream)
            self._resize(slot, 0)
            slot.resident = False
            raise CopyFailedError(
                f"offload_parameters: the copy of {slot.name} to the device failed twice ({first}; {again}). Its "
                "host copy is intact: fix the cause and run the step again (the next use copies it again)"
            ) from again
        slot.version = slot.vref._version

    def _maybe_free(self, slot: _Slot) -> None:
        if not slot.resident or slot.pins or slot.holds or slot.bwd_tasks or slot.outside or self._removed:
            return
        if slot.event is not None:  # a prefetch nobody used: let it land first
            event, slot.event = slot.event, None
            try:
                event.synchronize()
            except Exception:  # Note [A parameter copy that failed is copied again]: nothing to write back
                self._copy_failed()
                slot.version = slot.vref._version
        if slot.dirty or slot.vref._version != slot.version:
            self._write_back(slot)
        self._resize(slot, 0)
        slot.resident = False
        if slot.host is not None and self._tier is not None:
            self._release_host(slot)

    def _write_back(self, slot: _Slot) -> None:
        """Copy a device copy that changed (its version moved, or ``.data`` escaped) back to the host."""
        dev, rt = self.device, self.runtime
        rt.d2h_stream.wait_stream(dev.current_stream())
        rt.d2h_stream.wait_stream(rt.h2d_stream)  # after any upload into it (an optimizer's, too)
        if self._tier is not None and slot.host is None:
            self._acquire_host(slot, reclaim=True)  # overwritten whole by the D2H below
        try:
            dev.copy_(slot.host_view, slot.alias, stream=rt.d2h_stream).synchronize()
        except Exception as first:
            # Note [A parameter copy that failed is copied again], the other way: the device copy is the data
            # and intact (still resident); copied again, once; a second failure keeps it on the device
            self._counters["copy_failures"] += 1
            rt.recover(rt.d2h_stream)
            warnings.warn(
                f"offcore: the write-back of {slot.name} to the host failed on its stream ({first}); copied again "
                "from its intact device copy (Note [A parameter copy that failed is copied again])",
                OffcoreWarning,
                stacklevel=3,
            )
            try:
                dev.copy_(slot.host_view, slot.alias, stream=rt.d2h_stream).synchronize()
            except Exception as again:
                rt.recover(rt.d2h_stream)
                raise CopyFailedError(
                    f"offload_parameters: the write-back of {slot.name} to the host failed twice ({first}; {again}). "
                    "Its device copy is intact and stays on the device: fix the cause and run the step again"
                ) from again
        self.ledger.record_copy(Direction.D2H, slot.nbytes)
        if self._tier is not None:  # the disk copy is the data between uses (Note [Parameters on NVMe])
            assert slot.host_view is not None
            self._tier.write(slot.disk_key, slot.host_view.numpy(), kind=Kind.PARAMETER).synchronize()
        slot.version = slot.vref._version
        slot.dirty = False
