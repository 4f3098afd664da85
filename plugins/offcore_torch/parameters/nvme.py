"""ParameterOffloadHandle's NVMe tier (mixin ``_NvmeTier``; moved from parameters.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection

from offcore.errors import CapacityExceededError
from offcore.kinds import Kind, Tier
from offcore_torch.parameters.state import _Slot, _Step


class _NvmeTier:
    """ParameterOffloadHandle's NVMe-tier methods (see parameters.py)."""

    # -- the NVMe tier (Note [Parameters on NVMe]) ----------------------------------------
    # Note [Parameters on NVMe]
    # With an NVMe tier (``nvme=`` per call, or the device's ``offcore_torch.nvme_tier``) each storage's
    # copy between uses is a file of the tier (key ``(id(handle), slot index)``), written once at setup
    # and again whenever a device copy changed (``_write_back``: D2H into a staging buffer, then the
    # write, both awaited). Host memory is a pinned *staging* pool (the budget plus four of the largest
    # module's parameters, at most every parameter), not a copy of every parameter. A use is two hops:
    # NVMe -> staging buffer (the tier's read) and staging buffer -> device (the H2D copy). Every key
    # of a step whose storages are only on disk is ``spilled`` to the ResidencyScheduler, which plans
    # the reads on the tier's measured read link (``stage_duration``: ``tier.read_link``) so that each
    # lands by the trigger that starts its H2D copy (Note [Two hops from NVMe] in offcore/residency.py):
    # the prefetch of such a key starts earlier by the read's time. STAGE actions start the reads
    # (refused when the pool is full: offered again); each trigger tells the scheduler which reads
    # landed (``staged``, itself a trigger). A use whose read has not landed waits for it (or reads
    # on demand). A staging buffer goes back once its H2D copy landed (``_ready``; on a GPU that
    # waits for the copy on the host), when the device copy is freed, and at the end of a step; when
    # the pool is full on a use, buffers no use holds go first, then the stages in flight
    # (``stage_failed``). The host copy is never the data, so ``host_tensor`` (an OffloadOptimizer
    # stepping the host copies in place) is refused with a ConfigurationError. ``remove()`` brings the
    # parameters back a storage at a time and removes the files (the handle's own tier is closed, its
    # directory removed; a device's tier loses the handle's keys).
    def _offload_all_to_nvme(self) -> None:
        dev, rt = self.device, self.runtime
        largest = max((u.nbytes for u in self._units), default=0)
        rounded = sum(-(-s.nbytes // 512) * 512 for s in self._slots)
        staging = max(512, min(rounded, self.budget + 4 * largest + 512 * len(self._slots)))
        self._pool = dev.host_pool(staging, pinned=True, block_size=staging)
        rt.d2h_stream.wait_stream(dev.current_stream())
        for slot in self._slots:  # one at a time through one staging buffer
            buffer = self._pool.acquire(slot.nbytes)
            try:
                if slot.from_host:
                    buffer.view.copy_(slot.alias)
                else:
                    dev.copy_(buffer.view, slot.alias, stream=rt.d2h_stream).synchronize()
                key = (id(self), slot.index)
                self._tier.write(key, buffer.view.numpy(), kind=Kind.PARAMETER).synchronize()
                slot.disk_key = key
                self.ledger.add(Tier.NVME, Kind.PARAMETER, slot.nbytes)
            finally:
                self._pool.release(buffer)
            if slot.from_host:
                self._to_device_empty(slot)
            self._set_class(slot)
            self._resize(slot, 0)
            slot.resident = False
        self.ledger.reset_step()

    def _acquire_host(self, slot: _Slot, *, reclaim: bool, keep: Collection[_Slot] = ()) -> bool:
        """A staging buffer for ``slot``; with ``reclaim``, buffers no use needs now (none of ``keep``) are
        given back first when the pool is full (False: no room)."""
        try:
            buffer = self._pool.acquire(slot.nbytes)
        except CapacityExceededError:
            if not reclaim:
                return False
            kept = (slot, *keep)
            self._reclaim_host(keep=kept)
            try:
                buffer = self._pool.acquire(slot.nbytes)
            except CapacityExceededError:
                self._reclaim_host(keep=kept, stages=True)  # the stages in flight go too (read again later)
                buffer = self._pool.acquire(slot.nbytes)  # only the storages in use hold buffers now
        slot.host = buffer
        slot.host_view = buffer.view
        self.ledger.add(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
        return True

    def _start_read(self, slot: _Slot) -> None:
        assert slot.host_view is not None
        slot.reading = self._tier.read(slot.disk_key, slot.host_view.numpy())

    def _finish_read(self, slot: _Slot) -> None:
        reading, slot.reading = slot.reading, None
        if reading is not None:
            try:
                reading.synchronize()  # raises the tier's error (missing, truncated, checksum) naming the file
            except BaseException:
                self._release_host(slot)
                raise

    def _host_in(self, slots: list[_Slot]) -> None:
        """The host copies of ``slots`` in host memory (read from NVMe on demand, or the stage awaited)."""
        for slot in slots:
            if slot.host is None:
                # the others of the list are not pinned yet (a module's pre-hook pins after its copies): a
                # full pool must not give back the buffers this call just filled or awaits
                self._acquire_host(slot, reclaim=True, keep=slots)
                self._start_read(slot)
        for slot in slots:
            self._finish_read(slot)

    def _release_host(self, slot: _Slot) -> None:
        """Give ``slot``'s staging buffer back once no copy out of it or read into it is in flight."""
        if slot.host is None or self._tier is None:
            return
        if slot.reading is not None:
            with contextlib.suppress(Exception):  # its error was reported where it was needed, or never will be
                slot.reading.synchronize()
            slot.reading = None
        landing, slot.landing = slot.landing, None
        if landing is not None:
            try:
                if not landing.query():
                    landing.synchronize()
            except Exception:  # Note [A failed copy is a completed copy]: it reads the buffer no more
                self._copy_failed()
        self._pool.release(slot.host)
        self.ledger.remove(Tier.PINNED, Kind.PARAMETER, slot.nbytes)
        slot.host = None
        slot.host_view = None

    def _reclaim_host(self, keep: Collection[_Slot] = (), *, stages: bool = False) -> None:
        """Give back every staging buffer no use holds now and not of ``keep`` (their data stays on NVMe);
        ``stages``: those of the stages in flight too (the scheduler offers them again)."""
        step = self._step
        if stages and step is not None:
            for key in list(step.staging):
                del step.staging[key]
                step.rs.stage_failed(key)
        spared = {id(s) for slots in step.staging.values() for s in slots} if step is not None else set()
        spared.update(id(s) for s in keep)  # and those the caller is filling
        for slot in self._slots:
            if slot.host is not None and not slot.pins and id(slot) not in spared:
                self._release_host(slot)

    def _stage(self, step: _Step, key: int) -> bool:
        """Start the NVMe -> host reads of ``key``'s storages not in host memory (False: no staging room)."""
        unit = self._units[step.sequence[key][0]]
        started: list[_Slot] = []
        for slot in unit.slots:
            if slot.host is None and not slot.resident:
                if not self._acquire_host(slot, reclaim=False):
                    for done in started:
                        self._release_host(done)
                    return False
                self._start_read(slot)
                started.append(slot)
        step.staging[key] = unit.slots
        return True

    def _poll_stages(self, step: _Step, t: float) -> None:
        """Tell the scheduler which stages landed (each a trigger: its prefetches may start now)."""
        for key, slots in list(step.staging.items()):
            if step.staging.get(key) is not slots:
                # an earlier key's actions took this stage meanwhile: a prefetch that found the staging pool
                # full gave back every stage in flight (_reclaim_host(stages=True)); the scheduler offers it again
                continue
            if all(s.reading is None or s.reading.query() for s in slots):
                del step.staging[key]
                for slot in slots:
                    self._finish_read(slot)
                self._execute(step, step.rs.staged(key, t))
