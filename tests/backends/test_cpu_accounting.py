"""The fake device's two torch accountings give the same figures: the allocator hook vs the dispatch-mode reference.

``accounting="allocator"`` counts in torch's CPU allocator (``offcore_cpu/_alloc_hook.cpp``),
``accounting="dispatch"`` in a Python ``TorchDispatchMode`` (the reference); see
Note [Counting device memory with allocations] in ``offcore_cpu/tracking.py``. Every
scenario runs on one device of each kind and compares ``allocated_bytes``,
``peak_allocated_bytes``, ``device_allocations`` and ``holds()`` after every step.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_cpu import tracking  # noqa: E402
from offcore_cpu.device import FakeDevice  # noqa: E402

import offcore  # noqa: E402
from offcore import CapacityExceededError, ConfigurationError, Tier  # noqa: E402

pytestmark = pytest.mark.torch

needs_hook = pytest.mark.skipif(
    tracking.allocator_hook() is None, reason=f"the allocator hook cannot be built: {tracking.allocator_hook_error()}"
)

Snapshot = tuple[int, int, int, tuple[bool, ...]]


def _snapshot(dev: FakeDevice, held: dict[str, Any]) -> Snapshot:
    gc.collect()
    stats = dev.memory_stats()
    holds = tuple(dev.holds(t) for _, t in sorted(held.items()))
    return (stats.allocated_bytes, stats.peak_allocated_bytes, stats["device_allocations"], holds)


def _run(accounting: str, scenario: Callable[[FakeDevice, dict[str, Any], Callable[[], None]], None], **options: Any):
    dev = offcore.device("cpu", capacity="64MiB", accounting=accounting, **options)
    assert dev.accounting == accounting
    snaps: list[Snapshot] = []
    held: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        scenario(dev, held, lambda: snaps.append(_snapshot(dev, held)))
        held.clear()
        snaps.append(_snapshot(dev, held))
    finally:
        dev.close()
    return snaps


def _views(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.randn(256, 4)
        snap()
        t["v"] = t["x"][10:].view(-1)
        t["tr"] = t["x"].t()
        t["d"] = t["x"].detach()
        snap()
        t["u"] = t["x"].unsqueeze(0).expand(3, 256, 4)
        snap()


def _in_place(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.randn(1024)
        t["y"] = torch.ones(1024)
        snap()
        t["x"].mul_(2)
        t["x"].add_(t["y"])
        t["x"].mul_(2.5)
        t["x"].clamp_(min=0)
        t["x"][3] = t["y"][5]
        t["x"][4:6] = t["y"][:2]
        snap()


def _out_arguments(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        a, b = torch.randn(300), torch.randn(300)
        t["c"] = torch.empty(300)
        snap()
        torch.add(a, b, out=t["c"])
        snap()
        t["d"] = torch.empty(300)
        torch.mul(a, b, out=t["d"])
        snap()
        del a, b
        snap()


def _literals(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    import numpy as np

    with dev:
        t["lit"] = torch.tensor([1.0, 2.0, 3.0])
        t["scalar"] = torch.tensor(5)
        t["as"] = torch.as_tensor([1, 2, 3, 4])
        snap()
        t["np"] = torch.from_numpy(np.ones(64, np.float32))  # foreign memory: host
        snap()


def _freed_under_a_view(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.randn(4096)
        t["view"] = t["x"][100:200]
    snap()
    del t["x"]
    snap()  # the view keeps the whole storage alive
    del t["view"]
    snap()
    with dev:
        t["y"] = torch.randn(100)
    snap()


def _python_numbers(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.randn(512)
        snap()
        t["y"] = t["x"] * 2
        snap()
        t["w"] = torch.randn(8, requires_grad=True)
        t["saved"] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s: t["saved"].append(s) or s, lambda s: s):
            t["prod"] = t["w"] * 3.0  # autograd saves the Python number as a CPU scalar: host memory
        assert not any(dev.holds(s) for s in t["saved"] if s.dim() == 0)
        del t["saved"]
        snap()
        t["loss"] = t["x"].sum() * 0.5
        snap()
        t["z"] = t["x"] + 1.5
        t["x"].mul_(3)
        t["w"] = 2 ** t["x"].abs().clamp(max=3)
        snap()
        t["rng"] = torch.get_rng_state()  # host memory on CUDA too
        snap()


def _other_threads(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    made: dict[str, Any] = {}

    def worker_active() -> None:
        with dev:
            made["on_device"] = torch.randn(333)

    def worker_idle() -> None:
        made["host"] = torch.randn(444)

    for target in (worker_active, worker_idle):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    t.update(made)
    snap()
    with dev:
        t["mine"] = torch.randn(50)

    def release() -> None:
        del t["on_device"]

    thread = threading.Thread(target=release)  # freed on another thread than it was made on
    thread.start()
    thread.join()
    snap()


def _copies(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.zeros(1000)
        snap()
        t["c"] = t["x"].to(torch.float64)
        t["k"] = t["x"].view(10, 100).t().contiguous()
        t["cl"] = t["x"].clone()
        snap()


def _training(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    from offcore_torch.models import gpt_workload

    work = gpt_workload()
    with dev:
        model = work.build(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        snap()
        for step in range(2):
            dev.reset_peak_memory_stats()
            loss = work.loss(model, work.make_batch(step, torch.device("cpu")))
            snap()
            loss.backward()
            snap()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
            snap()
    t["param"] = next(model.parameters())
    snap()


def _adopted(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    module = dev.adopt(torch.nn.Linear(32, 16))
    t["weight"] = module.weight
    snap()
    with dev:
        t["out"] = module(torch.randn(8, 32))
        dev.adopt(t["out"])  # already device memory: no-op
    snap()
    t["buf"] = dev.allocate(4096, "device")
    t["pinned"] = dev.allocate(4096, "pinned")
    snap()


SCENARIOS = {
    "views": _views,
    "in_place": _in_place,
    "out_arguments": _out_arguments,
    "literals": _literals,
    "freed_under_a_view": _freed_under_a_view,
    "python_numbers": _python_numbers,
    "other_threads": _other_threads,
    "copies": _copies,
    "training": _training,
    "adopted": _adopted,
}


@needs_hook
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_allocator_accounting_matches_the_dispatch_reference(name: str) -> None:
    scenario = SCENARIOS[name]
    assert _run("allocator", scenario) == _run("dispatch", scenario)


# Known differences, each closer to CUDA's allocator than the reference (Note [Counting device
# memory with allocations]); the figures differ exactly by the bytes named.
def _resize_grows(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.zeros(4)  # 16 bytes
        t["out"] = torch.empty(10)  # 40 bytes
        snap()
        t["x"].resize_(1000)  # a new 4000-byte allocation, the old 16 bytes freed after the copy
        snap()
        torch.neg(t["x"], out=t["out"])  # out= resized from 40 to 4000 bytes
        snap()


def _index_assign_number(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.zeros(100)
        snap()
        t["x"][3] = 7.0  # the reference counts the 4-byte tensor made of 7.0; the hook leaves it on the host
        snap()


@needs_hook
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_known_differences_from_the_reference_are_exact() -> None:
    hooked, reference = _run("allocator", _resize_grows), _run("dispatch", _resize_grows)
    assert [s[0] for s in hooked] == [s[0] for s in reference], "the same bytes are allocated"
    assert [s[2:] for s in hooked] == [s[2:] for s in reference]
    # while a storage grows, CUDA (and the hook) hold the old and the new memory at once
    assert [s[1] for s in hooked] == [56, 4016 + 40, 8000 + 40, 8040]
    assert [s[1] for s in reference] == [56, 4040, 8000, 8000]
    hooked, reference = _run("allocator", _index_assign_number), _run("dispatch", _index_assign_number)
    assert [s[0] for s in hooked] == [s[0] for s in reference] == [400, 400, 0]
    assert [s[1] for s in hooked] == [400, 400, 400] and [s[1] for s in reference] == [400, 404, 404]


@needs_hook
def test_sanitizer_poisons_uninitialised_outputs_only() -> None:
    dev = offcore.device("cpu", capacity="1MiB", accounting="allocator", sanitize=True)
    try:
        with dev:
            empty = torch.empty(64)
            like = torch.empty_like(empty)
            strided = torch.empty_strided((4, 4), (4, 1), dtype=torch.int32)
            zeros = torch.zeros(64)
            summed = zeros + 1
        assert torch.isnan(empty).all() and torch.isnan(like).all()
        assert (strided == -1).all(), "poison is 0xFF in every byte: -1 for integers"
        assert (zeros == 0).all() and (summed == 1).all(), "written outputs are not affected"
        outside = torch.empty(64)  # not on the device: not poisoned by it
        assert dev.memory_stats().allocated_bytes == 4 * (64 + 64 + 16 + 64 + 64)
        del outside
    finally:
        dev.close()


@needs_hook
def test_out_of_memory_raises_the_device_error_and_counts_nothing() -> None:
    dev = offcore.device("cpu", capacity="64KiB", accounting="allocator")
    try:
        with dev:
            kept = torch.zeros(8 * 1024)  # 32 KiB
            with pytest.raises(torch.OutOfMemoryError) as caught:
                torch.randn(16 * 1024)  # 64 KiB more
            assert isinstance(caught.value, CapacityExceededError)
            assert "out of memory" in str(caught.value) and "cpu:0" in str(caught.value)
            assert dev.memory_stats().allocated_bytes == kept.nbytes
            with pytest.raises(torch.OutOfMemoryError):  # inside backward too
                w = torch.randn(4 * 1024, requires_grad=True)
                (w.unsqueeze(0).expand(4, -1) * 2).sum().backward()
            after = torch.ones(16)
        gc.collect()
        assert dev.memory_stats().allocated_bytes == kept.nbytes + after.nbytes + w.nbytes
    finally:
        dev.close()


@needs_hook
def test_hooked_storages_are_device_memory_of_their_device_only() -> None:
    a = offcore.device("cpu", accounting="allocator")
    b = offcore.device("cpu", accounting="allocator")
    try:
        with a:
            x = torch.randn(100)
            with b:  # only the innermost active device counts
                y = torch.randn(50)
            z = torch.randn(25)
        assert a.holds(x) and a.holds(z) and not a.holds(y)
        assert b.holds(y) and not b.holds(x)
        assert a.memory_stats().allocated_bytes == 500 and b.memory_stats().allocated_bytes == 200
        with pytest.raises(ConfigurationError, match="already counted as device memory"):
            a._arena.register(x.untyped_storage(), x.nbytes, Tier.PINNED)
        with a, a._untracked():  # the device's own bookkeeping is not counted
            torch.randn(1000)
        assert a.memory_stats().allocated_bytes == 500
    finally:
        a.close()
        b.close()


def test_accounting_option_is_checked_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="accounting must be"):
        offcore.device("cpu", accounting="magic")
    assert offcore.device("cpu", accounting="dispatch").accounting == "dispatch"
    assert offcore.device("cpu", buffers="numpy").accounting is None
    monkeypatch.setenv(tracking.ACCOUNTING_ENV, "dispatch")
    assert offcore.device("cpu").accounting == "dispatch"
    monkeypatch.delenv(tracking.ACCOUNTING_ENV)
    monkeypatch.setattr(tracking, "allocator_hook", lambda: None)
    monkeypatch.setattr(tracking, "allocator_hook_error", lambda: "no compiler here")
    assert offcore.device("cpu").accounting == "dispatch", "auto falls back to the reference"
    with pytest.raises(ConfigurationError, match="no compiler here"):
        offcore.device("cpu", accounting="allocator")


# -- adopted storages freed and re-allocated under them (FSDP-style parameter streaming) -------
def _adopted_streaming(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    module = dev.adopt(torch.nn.Linear(32, 16))  # built on the host: 2048 + 64 bytes
    weight = module.weight
    storage = weight.untyped_storage()
    alias = torch.empty(0, dtype=torch.uint8).set_(storage)
    host = weight.detach().clone()
    t["weight"], t["bias"] = weight, module.bias
    snap()
    for _ in range(2):
        with dev:  # what offload_parameters does: free under the storage, then allocate again
            storage.resize_(0)
            alias.set_(storage)  # an operator on the storage: the reference sees the new size
        snap()
        with dev:
            alias.resize_(host.nbytes)
            weight.detach().copy_(host)
        snap()
    t["vec"] = dev.adopt(torch.randn(100))
    snap()
    with dev:
        t["vec"].resize_(0)  # aten resize_ of a tensor never shrinks its storage (nor on CUDA)
    snap()
    with dev:
        t["vec"].resize_(50)
    snap()
    t["grown"] = t["vec"]
    with dev:
        t["grown"].resize_(400)  # 1600 bytes: the hook holds the old 400 bytes during the copy
    snap()


def _figures(snaps: list[Snapshot]) -> list[tuple[int, int, int]]:
    return [s[:3] for s in snaps]


@needs_hook
def test_adopted_storages_are_credited_when_freed_and_counted_when_regrown() -> None:
    hooked, reference = _run("allocator", _adopted_streaming), _run("dispatch", _adopted_streaming)
    bias = 64
    assert [s[0] for s in hooked] == [s[0] for s in reference]
    assert [s[0] for s in hooked] == [2112, bias, 2112, bias, 2112, 2512, 2512, 2512, 3712, 0]
    assert [s[2] for s in hooked] == [s[2] for s in reference] == [2, 1, 2, 1, 2, 3, 3, 3, 3, 0]
    # peaks agree except while a storage grows (the hook holds the old 400 bytes during the copy)
    assert [s[1] for s in reference] == [2112, 2112, 2112, 2112, 2112, 2512, 2512, 2512, 3712, 3712]
    assert [s[1] for s in hooked] == [2112, 2112, 2112, 2112, 2112, 2512, 2512, 2512, 4112, 4112]
    # holds() (bias, weight): an emptied storage is still the reference's; the hook knows no memory under it
    assert [s[3] for s in hooked][1] == (True, False) and [s[3] for s in reference][1] == (True, True)
    assert [s[3] for s in hooked][2] == [s[3] for s in reference][2] == (True, True)


def _streamed_adopted_model(accounting: str) -> list[tuple[int, int]]:
    import offcore_torch

    dev = offcore.device("cpu", capacity="64MiB", accounting=accounting)
    figures = []
    try:
        torch.manual_seed(0)
        model = dev.adopt(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
        figures.append((dev.memory_stats().allocated_bytes, dev.memory_stats()["device_allocations"]))
        handle = offcore_torch.offload_parameters(model, dev, prefetch="on_demand")
        gc.collect()
        figures.append((dev.memory_stats().allocated_bytes, dev.memory_stats()["device_allocations"]))
        with dev:
            for _ in range(2):
                model(torch.randn(8, 64)).square().mean().backward()
                model.zero_grad(set_to_none=True)
        handle.remove()
        gc.collect()
        figures.append((dev.memory_stats().allocated_bytes, dev.memory_stats()["device_allocations"]))
        del model, handle
        gc.collect()
        figures.append((dev.memory_stats().allocated_bytes, dev.memory_stats()["device_allocations"]))
    finally:
        dev.close()
    return figures


@needs_hook
def test_parameter_streaming_frees_an_adopted_model_under_both_accountings() -> None:
    model_bytes = 4 * (64 * 64 + 64) * 4
    hooked, reference = _streamed_adopted_model("allocator"), _streamed_adopted_model("dispatch")
    assert hooked == reference
    assert hooked[0] == (model_bytes, 8)
    assert hooked[1] == (0, 0), "between uses the adopted parameters' device memory is freed"
    assert hooked[2] == (model_bytes, 8) and hooked[3] == (0, 0)


def test_adopted_storages_are_credited_under_the_dispatch_reference_without_the_hook() -> None:
    snaps = _run("dispatch", _adopted_streaming)
    assert _figures(snaps)[1] == (64, 2112, 1) and _figures(snaps)[-1] == (0, 3712, 0)


@needs_hook
def test_adopted_foreign_memory_stays_counted_until_it_dies() -> None:
    import numpy as np

    dev = offcore.device("cpu", accounting="allocator")
    try:
        array = torch.from_numpy(np.ones(256, np.float32))  # not torch's memory: the arena's weak reference
        dev.adopt(array)
        assert dev.holds(array) and dev.memory_stats().allocated_bytes == 1024
        del array
        gc.collect()
        assert dev.memory_stats().allocated_bytes == 0 and dev.memory_stats()["device_allocations"] == 0
    finally:
        dev.close()


# ``UntypedStorage.resize_`` called from Python (no operator): a known, pinned difference
# (Note [Counting device memory with allocations]).
def _direct_storage_resize(dev: FakeDevice, t: dict[str, Any], snap: Callable[[], None]) -> None:
    with dev:
        t["x"] = torch.zeros(256)  # 1024 bytes
    storage = t["x"].untyped_storage()
    snap()
    with dev:
        storage.resize_(0)  # frees the memory
    snap()
    with dev:
        t["x"].set_(storage)  # an operator outputs the storage
    snap()
    with dev:
        storage.resize_(2048)  # allocates outside any operator, holding the GIL
    snap()
    with dev:
        t["x"].set_(storage, 0, (512,))
    snap()


@needs_hook
def test_direct_storage_resize_is_a_pinned_difference() -> None:
    hooked, reference = _run("allocator", _direct_storage_resize), _run("dispatch", _direct_storage_resize)
    # a shrink: the hook credits the freed memory at once, the reference at the next operator
    assert [s[0] for s in hooked][:3] == [1024, 0, 0] and [s[0] for s in reference][:3] == [1024, 1024, 0]
    # a growth: the hook leaves it on the host, the reference counts it at the next operator
    assert [s[0] for s in hooked][3:] == [0, 0, 0] and [s[0] for s in reference][3:] == [0, 2048, 0]


# -- building the hook: failures fall back to the reference with one warning --------------------
@pytest.fixture
def _unbuilt_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's hook forgotten (restored after the test); the next allocator_hook() builds again."""
    monkeypatch.setattr(tracking, "_hook", None)
    monkeypatch.setattr(tracking, "_hook_error", None)
    monkeypatch.delenv(tracking.ACCOUNTING_ENV, raising=False)


@pytest.mark.usefixtures("_unbuilt_hook")
def test_a_failed_build_falls_back_to_the_reference_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ninja() -> Any:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(tracking, "_load_hook", no_ninja)
    with pytest.warns(RuntimeWarning, match="Ninja is required") as caught:
        dev = offcore.device("cpu")
        other = offcore.device("cpu")
    try:
        assert len([w for w in caught if "allocator hook" in str(w.message)]) == 1
        assert dev.accounting == other.accounting == "dispatch"
        with dev:
            x = torch.zeros(100)
        assert dev.holds(x) and dev.memory_stats().allocated_bytes == 400
        with pytest.raises(ConfigurationError, match="Ninja is required"):
            offcore.device("cpu", accounting="allocator")
    finally:
        dev.close()
        other.close()


@pytest.mark.usefixtures("_unbuilt_hook")
def test_a_stuck_build_is_given_up_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(tracking, "_load_hook", release.wait)  # a build waiting on a lock nobody releases
    monkeypatch.setenv(tracking.BUILD_TIMEOUT_ENV, "0.05")
    try:
        with pytest.warns(RuntimeWarning, match="gave up after 0.05 s"):
            dev = offcore.device("cpu")
        assert dev.accounting == "dispatch"
        dev.close()
    finally:
        release.set()  # the abandoned build thread ends


@pytest.mark.usefixtures("_unbuilt_hook")
def test_a_stale_build_lock_is_removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import os

    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (1.0, 1.0))  # left behind by a build that crashed long ago
    monkeypatch.setattr(tracking, "_build_lock", lambda: lock)

    class Built:
        def install(self) -> None:
            pass

    built = Built()
    monkeypatch.setattr(tracking, "_load_hook", lambda: None if lock.exists() else built)
    assert tracking.allocator_hook() is built and not lock.exists()


def test_a_bad_build_timeout_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tracking.BUILD_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigurationError, match="OFFCORE_CPU_HOOK_BUILD_TIMEOUT"):
        tracking._build_timeout()


# -- random programs: the two accountings agree after every operation -------------------------
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

_ACTIONS = ("new", "view", "in_place", "binary", "scalar", "literal", "delete", "clone", "out", "reduce")


def _apply(action: str, arg: int, live: list[Any]) -> None:
    index = arg % len(live) if live else 0
    pick = live[index] if live else None
    if action == "new" or pick is None:
        live.append(torch.randn(1 + arg % 300))
    elif action == "view":
        live.append(pick.view(-1)[arg % max(pick.numel(), 1) :])
    elif action == "in_place":
        pick.mul_(1.5)
    elif action == "binary":
        live.append(pick * pick)
    elif action == "scalar":
        live.append(pick + arg)
    elif action == "literal":
        live.append(torch.tensor([float(arg)] * (1 + arg % 5)))
    elif action == "delete":
        del live[index]
    elif action == "clone":
        live.append(pick.clone())
    elif action == "out":
        fresh = torch.empty_like(pick)
        torch.neg(pick, out=fresh)
        live.append(fresh)
    elif action == "reduce":
        live.append(pick.sum() * 0.5)


def _program(accounting: str, program: list[tuple[str, int]]) -> list[tuple[int, int]]:
    dev = offcore.device("cpu", capacity="64MiB", accounting=accounting)
    figures = []
    live: list[Any] = []
    try:
        with dev:
            for action, arg in program:
                _apply(action, arg, live)
                stats = dev.memory_stats()
                figures.append((stats.allocated_bytes, stats.peak_allocated_bytes))
    finally:
        dev.close()
    return figures


@needs_hook
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.sampled_from(_ACTIONS), st.integers(0, 1000)), min_size=1, max_size=20))
def test_random_programs_count_alike(program: list[tuple[str, int]]) -> None:
    assert _program("allocator", program) == _program("dispatch", program)


@pytest.fixture(autouse=True)
def _no_device_left_active() -> Iterator[None]:
    yield
    assert not tracking._active_stack(), "a test left a fake device active on this thread"
