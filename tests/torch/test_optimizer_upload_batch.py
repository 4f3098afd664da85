"""``step()``'s uploads as one batch (Note [Uploads are issued in batches]), on the sanitized fake device.

Where the backend has ``copy_many`` and no ``upload_budget`` is set, the uploads ``step()`` issues are
one ``copy_many`` call (not one ``copy_`` per parameter) and the compute stream waits for them once
(they share one event), with the numbers of the host reference, bit for bit (fp32, and bf16 parameters
with fp32 masters: the casts into the stages are one ``_foreach_copy_``). A batch holds consecutive
uploads of up to ``_UPLOAD_BATCH_BYTES`` (a larger one is a ``copy_`` of its own), so a parameter's use
waits for its own batch only. Without ``copy_many`` (the backend does not offer it) each upload is its
own ``copy_``, with the same numbers.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
import offcore_torch.optimizer.rounds as rounds_module  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import OPTIMIZERS, assert_same, place, run  # noqa: E402

MLP = mlp_workload(d_in=16, width=32, depth=3, d_out=8, batch_size=8)
STEPS = 3


def _spy_uploads(dev: Any, uploads: list[Any], calls: list[tuple[str, list[int]]]) -> None:
    """Wrap ``dev.copy_many`` (where the device has it) and ``dev.copy_``: every call on one of ``uploads`` (the
    optimizer's upload stream, appended once it exists) is recorded in ``calls`` as ``("many" or "copy", the bytes
    of each upload)``; copy_many's own copy_ calls (the sanitizer's path) are not the optimizer's. Undone with
    ``del dev.copy_`` (and ``del dev.copy_many``)."""
    real_many = getattr(dev, "copy_many", None)
    real_copy = dev.copy_
    inside: list[bool] = []

    def many(pairs: Any, *, stream: Any) -> Any:
        if stream in uploads:
            calls.append(("many", [dst.nbytes for dst, _ in pairs]))
        inside.append(True)
        try:
            return real_many(pairs, stream=stream)  # type: ignore[misc]
        finally:
            inside.pop()

    def copy(dst: Any, src: Any, **kwargs: Any) -> Any:
        if kwargs.get("stream") in uploads and not inside:
            calls.append(("copy", [dst.nbytes]))
        return real_copy(dst, src, **kwargs)

    if real_many is not None:
        dev.copy_many = many  # before the optimizer looks for it
    dev.copy_ = copy


def _train(dev: Any, dtype: torch.dtype) -> tuple[list[Any], list[Any], list[tuple[int, int, int, int, int]]]:
    """STEPS steps; the losses, the parameters, and per ``step()``: copy_many calls on the upload stream, the
    uploads in them, copy_ calls there, and the compute stream's waits (distinct events, calls)."""
    copies: list[tuple[str, list[int]]] = []
    waits: list[Any] = []
    stats: list[tuple[int, int, int, int, int]] = []
    losses = []
    has_many = hasattr(dev, "copy_many")
    compute = dev.current_stream()
    real_wait = compute.wait_event
    uploads: list[Any] = []  # the optimizer's upload stream, once it exists

    def wait(event: Any) -> None:
        waits.append(event)
        real_wait(event)

    _spy_uploads(dev, uploads, copies)
    compute.wait_event = wait
    with dev:
        model = place(MLP.build(0).to(dtype), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            device=dev,
            master_weights=dtype is torch.bfloat16,
            **OPTIMIZERS["adamw"][1],
        )
        uploads.append(opt._runtime.h2d_stream)
        try:
            for step in range(STEPS):
                batch = tuple(
                    b.to(dtype) if b.is_floating_point() else b for b in MLP.make_batch(step, torch.device("cpu"))
                )
                loss = MLP.loss(model, batch)
                loss.backward()
                losses.append(loss.detach().clone())
                opt.host_grads()  # every gradient landed: step() alone is counted
                copies.clear()
                waits.clear()
                opt.step()
                batches = [len(sizes) for kind, sizes in copies if kind == "many"]
                singles = sum(len(sizes) for kind, sizes in copies if kind == "copy")
                stats.append((len(batches), sum(batches), singles, len({id(w) for w in waits}), len(waits)))
                opt.zero_grad()
            opt.synchronize()
            params = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
            if has_many:
                del dev.copy_many
            del dev.copy_
            del compute.wait_event
    return losses, params, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-masters"])
def test_step_uploads_are_one_copy_many_waited_for_once(make_fake_device: Any, dtype: torch.dtype) -> None:
    want = run(
        MLP,
        device=make_fake_device(),
        offload=False,
        steps=STEPS,
        optimizer="adamw",
        dtype=dtype,
        master_weights=dtype is torch.bfloat16,
    )
    n = len(list(MLP.build(0).parameters()))
    losses, params, stats = _train(make_fake_device(link="slow"), dtype)
    for step, (calls, pairs, singles, events, waits) in enumerate(stats):
        assert (calls, pairs, singles) == (1, n, 0), (
            f"step {step}: {calls} copy_many of {pairs} uploads, {singles} copy_"
        )
        assert events == waits == 1, f"step {step}: the compute stream waited {waits} times for {events} events"
    assert_same(losses, want.losses, "losses")
    assert_same(params, want.params, "params")


def test_without_copy_many_each_upload_is_a_copy(make_fake_device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of backends without ``copy_many`` (CUDA, the instant backend), on the fake device."""
    want = run(MLP, device=make_fake_device(), offload=False, steps=STEPS, optimizer="adamw")
    dev = make_fake_device(link="slow")
    owner = next(cls for cls in type(dev).__mro__ if "copy_many" in vars(cls))  # the class (or mixin) defining it
    monkeypatch.delattr(owner, "copy_many")
    n = len(list(MLP.build(0).parameters()))
    losses, params, stats = _train(dev, torch.float32)
    for step, (calls, _, singles, events, waits) in enumerate(stats):
        assert (calls, singles) == (0, n), f"step {step}: {calls} copy_many, {singles} copy_ for {n} uploads"
        assert events == waits == n, f"step {step}: the compute stream waited {waits} times for {events} events"
    assert_same(losses, want.losses, "losses")
    assert_same(params, want.params, "params")


def test_a_batch_holds_uploads_up_to_the_batch_bytes(make_fake_device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of consecutive uploads of up to _UPLOAD_BATCH_BYTES, a larger upload alone: with
    ``overlap_uploads=True`` a parameter's use waits for its own batch, not for every upload of the step."""
    limit = 4096  # the MLP's parameters: 128 to 4096 bytes
    monkeypatch.setattr(rounds_module, "_UPLOAD_BATCH_BYTES", limit)
    want = run(MLP, device=make_fake_device(), offload=False, steps=STEPS, optimizer="adamw")
    dev = make_fake_device(link="slow")
    spied: list[tuple[str, list[int]]] = []  # per call (copy_many or copy_): the bytes of each upload
    uploads: list[Any] = []
    _spy_uploads(dev, uploads, spied)
    losses = []
    with dev:
        model = place(MLP.build(0), dev)
        opt = offcore_torch.OffloadOptimizer(
            model.parameters(), torch.optim.AdamW, device=dev, overlap_uploads=True, **OPTIMIZERS["adamw"][1]
        )
        uploads.append(opt._runtime.h2d_stream)
        n = len(opt._slots)
        try:
            for step in range(STEPS):
                loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                loss.backward()
                losses.append(loss.detach().clone())
                opt.step()
                spied.clear()
                opt.zero_grad()  # issues the step's uploads (Note [Who issues step()'s uploads])
                calls = [sizes for _, sizes in spied]
                assert sum(len(c) for c in calls) == n, calls
                assert all(len(c) == 1 or sum(c) <= limit for c in calls), calls
                assert sum(len(c) > 1 for c in calls) >= 1 and len(calls) > 1, calls  # batches, and more than one
                events = {id(slot.h2d) for slot in opt._slots}
                assert len(events) == len(calls), f"{len(events)} events for {len(calls)} calls"
            opt.synchronize()
            params = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
            del dev.copy_many, dev.copy_
    assert_same(losses, want.losses, "losses")
    assert_same(params, want.params, "params")


@pytest.mark.parametrize("overlap", [False, True], ids=["uploads-in-step", "overlap_uploads"])
def test_step_reads_each_storage_once_and_later_uploads_check_again(
    make_fake_device: Any, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Note [Checked fresh in this step()]: step() checks each parameter against its master once (one storage
    identity read each), and its own uploads and waits reuse that check; uploads issued after step() returned
    (``overlap_uploads=True``: by zero_grad()) check each parameter again, and a write made in between still
    cancels them (the next step starts from the write), with the numbers of the run without offload."""
    reads: list[int] = []
    real = rounds_module._storage_id

    def storage_id(param: Any) -> Any:
        reads.append(id(param))
        return real(param)

    monkeypatch.setattr(rounds_module, "_storage_id", storage_id)
    results = []
    for offload in (False, True):
        dev = make_fake_device(sanitize=True)
        with dev:
            model = place(MLP.build(0), dev)
            params = list(model.parameters())
            if offload:
                opt: Any = offcore_torch.OffloadOptimizer(
                    params, torch.optim.AdamW, device=dev, overlap_uploads=overlap, **OPTIMIZERS["adamw"][1]
                )
            else:
                opt = torch.optim.AdamW(params, **OPTIMIZERS["adamw"][1])
            losses = []
            try:
                for step in range(STEPS):
                    loss = MLP.loss(model, MLP.make_batch(step, torch.device("cpu")))
                    loss.backward()
                    losses.append(loss.detach().clone())
                    if offload:
                        opt.host_grads()  # every gradient landed: step() alone is counted
                    reads.clear()
                    opt.step()
                    if offload:  # once each (a parameter whose version changed needs no read: it was written)
                        assert len(reads) == len(set(reads)) >= len(params) - 1, (
                            f"step {step}: {len(reads)} storage reads of {len(set(reads))} of {len(params)} parameters"
                        )
                    if step == 1:  # a write after step(): with overlap_uploads, before the uploads are issued
                        if offload and overlap:
                            opt.wait_for_parameters([p for p in params if id(p) in opt._pending_h2d])
                        with torch.no_grad():
                            params[0].copy_(torch.full_like(params[0], 0.25))
                    reads.clear()
                    opt.zero_grad()
                    if offload and overlap:  # the uploads zero_grad() issued checked each parameter again
                        assert len(reads) >= len(params) - 1, f"zero_grad(): {len(reads)} storage reads"
                if offload:
                    opt.synchronize()
                results.append((losses, [p.detach().clone() for p in params]))
            finally:
                if offload:
                    opt.close()
    assert_same(results[1][0], results[0][0], "losses")
    assert_same(results[1][1], results[0][1], "params")
