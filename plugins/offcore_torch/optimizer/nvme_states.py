"""OffloadOptimizer's optimizer states and masters on NVMe (mixin ``_NvmeStates``).

Moved from optimizer.py, whose module doc holds Note [Optimizer states on NVMe] and Note [Masters on NVMe].
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from offcore.errors import (
    CapacityExceededError,
    StorageError,
)
from offcore.kinds import Kind
from offcore.nvme import pipelined
from offcore.pool import HostBuffer
from offcore.residency import ResidencyScheduler
from offcore.units import format_bytes
from offcore_torch.optimizer.slots import _COLLECT, _MASTER, _STEPPED, _AllOf, _Slot

_NVME_GROUP_BYTES = 4 * 1024**2  # tier="nvme": a group is one parameter or small ones up to this many master bytes
_NVME_LOOKAHEAD = 2  # tier="nvme": groups read ahead of the one stepped (k + 2 groups of bounce buffers live; benchmarks/nvme.py: 1.37 x -> 1.62 x sequential)


class _NvmeStates:
    """OffloadOptimizer's NVMe-tier methods (see optimizer.py)."""

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
