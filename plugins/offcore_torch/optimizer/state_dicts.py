"""OffloadOptimizer's state dicts (mixin ``_StateDicts``; moved from optimizer.py)."""

from __future__ import annotations

from typing import Any

import torch

from offcore.errors import (
    ConfigurationError,
)
from offcore_torch.optimizer.slots import _MASTER, MASTER_WEIGHTS_KEY, _Slot, _storage_id


class _StateDicts:
    """OffloadOptimizer's state_dict / load_state_dict (see optimizer.py)."""

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
