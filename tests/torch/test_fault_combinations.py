"""A copy fails somewhere in a training step that offloads several kinds: a clear error, and nothing leaks.

The fault suites (test_offload_faults.py, test_optimizer_faults.py) fail copies of one kind at a time.
Here hypothesis draws a combination of kinds (activations, parameters on the host or NVMe, the
optimizer on the device or the host, its steps at ``step()`` or under backward), then which copy of
the run fails (the fake device's ``inject_copy_fault``: refused at submission, or failing on its
stream). Three steps run. Either offcore absorbs the failure (it retries what it can) or the step
raises an error of offcore's own (``offcore.OffcoreError``, or one caused by it: never a bare
torch or Python error about offcore's internals). Then the user cleans up as after any failed step
-- ``zero_grad()``, one empty backward (torch keeps a failed backward's nodes until the next),
``handle.remove()``, ``opt.close()`` -- and the device's own accounting must be back where it was
before the bindings were made: device and pageable bytes, and the bytes offcore's pinned pools hand
out (their reservation is kept for the next step, as test_offload_leaks.py measures it). The sanitizer is on (a buffer
freed while a copy still used it fails the test at teardown). The draws are derandomized.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
from typing import Any

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

import offcore_torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis_draws import choices_strategy, covering, derandomized  # noqa: E402
from offcore_torch.models import GPTConfig, Workload, gpt_workload, mlp_workload  # noqa: E402
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402
from offload_helpers import memory_levels  # noqa: E402
from optimizer_offload_helpers import offload_optimizer_of_kind  # noqa: E402
from torch_test_devices import fake_device, finish_device  # noqa: E402

from offcore.errors import OffcoreError  # noqa: E402

STEPS = 3
ADAMW = {"lr": 1e-2, "fused": True}
WORKLOADS: dict[str, Workload] = {
    "gpt": gpt_workload(
        GPTConfig(vocab_size=48, d_model=32, n_heads=2, n_layers=2, seq_len=12, dropout=0.1), batch_size=2
    ),
    "mlp": mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=16),
}

CHOICES: dict[str, Any] = {
    "model": sorted(WORKLOADS),
    "activations": [None, "on_demand", "deadline"],
    "max_inflight": ["256MiB", 0],  # the default cap, or one D2H copy at a time
    "parameters": [False, True],
    "optimizer": ["device", "offload", "offload-under-backward"],
    "nvme": [False, True],
    "fault_at": range(1, 121),
    "fault_mode": ["submit", "stream"],
}
faults = choices_strategy(CHOICES)


def _offcore_caused(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OffcoreError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _run(drawn: dict[str, Any]) -> tuple[str | None, dict[str, int], dict[str, int]]:
    work = WORKLOADS[drawn["model"]]
    kind = drawn["optimizer"]
    device = fake_device(link="slow")
    directory = tempfile.mkdtemp(prefix="offcore-faults-") if drawn["nvme"] else None
    try:
        with device:
            if directory is not None:
                offcore_torch.nvme_tier(device, directory)
            tier = {"tier": "nvme"} if directory is not None else {}
            model = device.adopt(work.build(0))
            # one plain forward and backward first: what the model caches on its first call is not a leak
            work.loss(model, work.make_batch(0, torch.device("cpu"))).backward()
            model.zero_grad(set_to_none=True)
            before = memory_levels(device)
            handle = offload_parameters(model, device, **tier) if drawn["parameters"] else None
            if kind == "device":
                opt: Any = torch.optim.AdamW(model.parameters(), **ADAMW)
            else:
                opt = offload_optimizer_of_kind(
                    kind,
                    model,
                    device,
                    micro_steps=1,
                    streamed_from_nvme=handle is not None and directory is not None,
                    **tier,
                    **ADAMW,
                )
            device.inject_copy_fault(drawn["fault_at"], mode=drawn["fault_mode"])
            error: str | None = None
            try:
                for step in range(STEPS):
                    batch = work.make_batch(step, torch.device("cpu"))
                    region = (
                        offcore_torch.offload_activations(
                            device, prefetch=drawn["activations"], min_bytes="0", max_inflight=drawn["max_inflight"]
                        )
                        if drawn["activations"] is not None
                        else contextlib.nullcontext()
                    )
                    with region:
                        loss = work.loss(model, batch)
                    del batch  # made inside `with device:`: device memory, like the loss
                    loss.backward()
                    del loss
                    opt.step()
                    opt.zero_grad()
                if kind != "device":
                    opt.synchronize()
            except Exception as exc:  # what a user's loop sees; kept as text (its traceback holds the step's frames)
                error = (
                    f"{type(exc).__name__}: {exc}"
                    if _offcore_caused(exc)
                    else f"NOT OFFCORE {type(exc).__name__}: {exc}"
                )
            # cleaning up as after any failed step
            device.inject_copy_fault(None)
            batch = loss = None  # noqa: F841  (what a failed step left: device memory)
            with contextlib.suppress(Exception):
                opt.zero_grad()
            model.zero_grad(set_to_none=True)
            torch.autograd.backward(torch.zeros((), requires_grad=True))  # drops a failed backward's nodes
            if handle is not None:
                handle.remove()
            if kind != "device":
                opt.close()
            del opt, handle
            if directory is not None:
                offcore_torch.nvme_tier(device, None)
            gc.collect()
            offcore_torch.synchronize(device)  # the copies offcore started land, what they held goes
            after = memory_levels(device)
        return error, before, after
    finally:
        finish_device(device)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.filterwarnings("ignore::offcore.errors.OffcoreWarning")  # each recovered failure says so: expected here
@pytest.mark.filterwarnings("ignore:module forward hook with ``always_call=True`` raised")  # torch, on a failed forward
@derandomized(max_examples=60, examples=covering(CHOICES))
@given(drawn=faults)
def test_a_failed_copy_anywhere_gives_a_clear_error_and_leaks_nothing(drawn: dict[str, Any]) -> None:
    error, before, after = _run(drawn)
    assert error is None or not error.startswith("NOT OFFCORE"), error
    assert after == before, (after, before, error)
