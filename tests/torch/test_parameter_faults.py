"""offload_parameters when a copy fails (Note [A parameter copy that failed is copied again]).

A copy that fails on its stream (the fake device's ``inject_copy_fault(n, mode="stream")``, as an
asynchronous CUDA error) is absorbed: the stream recovers, a host-to-device copy a use waits for is
made again from the intact host copy, a write-back again from the intact device copy; training
stays bit-identical to keep-all and ``stats().copy_failures`` counts it. A copy refused at
submission (``mode="submit"``) raises from the step; the user's retry of the step then gives the
same numbers. Either way ``handle.remove()`` gives the model back. Before, one failed copy left its
event on the parameter: every later step raised the same error, and so did ``handle.remove()``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_torch.models import mlp_workload  # noqa: E402
from offcore_torch.parameters.parameters import offload_parameters  # noqa: E402

from offcore.errors import OffcoreError  # noqa: E402

WORK = mlp_workload(d_in=16, width=32, depth=2, d_out=8, batch_size=16)
STEPS = 3


def _train(dev: Any, *, offload: bool, fault: tuple[int, str] | None = None, nvme: str | None = None) -> dict[str, Any]:
    with dev:
        model = dev.adopt(WORK.build(0))
        handle = offload_parameters(model, dev, **({"nvme": nvme} if nvme else {})) if offload else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if fault is not None:
            dev.inject_copy_fault(fault[0], mode=fault[1])
        losses, raised = [], []
        step = tries = 0
        while step < STEPS:
            tries += 1
            assert tries <= STEPS + 1, f"the step keeps failing after one injected fault: {raised}"
            try:
                loss = WORK.loss(model, WORK.make_batch(step, torch.device("cpu")))
                loss.backward()
                opt.step()
            except OffcoreError as exc:  # a refused copy: the step is run again, as a user's loop would
                raised.append(exc)
                opt.zero_grad()
                continue
            opt.zero_grad()
            losses.append(loss.detach().clone())
            step += 1
        if handle is not None:
            try:
                handle.remove()  # gives the model back, whatever failed
            except OffcoreError as exc:  # a copy of remove() itself refused at submission: remove() again
                raised.append(exc)
                handle.remove()
        stats = handle.stats() if handle is not None else None
        params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "raised": raised, "stats": stats}


@pytest.mark.filterwarnings("ignore:offcore. the .* failed on its stream")
@pytest.mark.parametrize("nth", [1, 3, 7, 12, 18])  # a run makes 28-42 copies, with the timing
@pytest.mark.parametrize("mode", ["stream", "submit"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_failed_parameter_copy_is_recovered_bit_identically(
    make_fake_device: Any, tmp_path: Any, nth: int, mode: str, tier: str
) -> None:
    """With ``tier``="nvme" a module's copies go as one batch: a copy refused in the middle of it left the ones
    before it in flight while their storages were freed and staging buffers returned (the sanitizer saw it;
    found by tests/torch/test_fault_combinations.py)."""
    want = _train(make_fake_device(), offload=False)
    dev = make_fake_device(link="slow")
    got = _train(dev, offload=True, fault=(nth, mode), nvme=str(tmp_path) if tier == "nvme" else None)
    assert not dev.copy_fault_armed, "the fault never fired: the case was not exercised"
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], want["losses"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"], strict=True))
    if mode == "stream":  # absorbed: nothing reached the loop; counted (each copy the failure reached)
        assert got["raised"] == [] and got["stats"].copy_failures >= 1
    else:  # refused at submission: the step raised once and was run again, or a write-back copied again
        assert len(got["raised"]) + got["stats"].copy_failures == 1, (got["raised"], got["stats"].copy_failures)


@pytest.mark.parametrize("where", ["pre_hook", "hook", "global_hook"])
def test_a_keyboard_interrupt_in_forward_leaves_a_removable_handle(make_fake_device: Any, where: str) -> None:
    """torch runs ``always_call`` forward hooks on an ``Exception`` only: a KeyboardInterrupt in a user's hook
    left the handle inside forward forever (``remove()`` refused every later try, its pinned copies held;
    Note [Forwards ended by a BaseException]). The next forward is bit-identical, remove() works and gives
    the pinned memory back."""
    dev = make_fake_device(link="slow")
    torch.manual_seed(0)
    with dev:
        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3))).to(dev.torch_device)
        x = torch.randn(2, 64, device=dev.torch_device)
        want = model(x)
    pinned = dev.memory_stats()["pinned_bytes"]
    handle = offload_parameters(model, dev)

    def interrupt(*args: Any) -> None:
        raise KeyboardInterrupt

    if where == "pre_hook":
        hook = model[1].register_forward_pre_hook(interrupt)
    elif where == "hook":
        hook = model[1].register_forward_hook(interrupt)
    else:
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: interrupt() if module is model[1] else None
        )
    try:
        with pytest.raises(KeyboardInterrupt), dev:
            model(x)
    finally:
        hook.remove()
    with dev:
        assert torch.equal(model(x), want)
    handle.remove()
    assert dev.memory_stats()["pinned_bytes"] == pinned
    with dev:
        assert torch.equal(model(x), want)
