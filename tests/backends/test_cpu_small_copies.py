"""The fake device's fast path for small plain copies (Note [The small copy's fast path] in offcore_cpu/copying.py).

A device without the sanitizer takes small copies between two plain ``torch.Tensor`` buffers on one
of its copy streams on ``copy_``'s fast path; everything else goes down its general path (``_copy_checked``). Each
test runs a case on such a device and checks it against what the general path gives (the same
device's answers with the fast path switched off, or the sanitized device's), so a shortcut that
skipped a check or booked a copy differently shows up here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_cpu.errors import FreedStorageError, InjectedFault, StreamWorkError  # noqa: E402

import offcore  # noqa: E402
from offcore import ConfigurationError, Tier  # noqa: E402

FAST = {"capacity": "64MiB", "h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0}


def _hook_or_skip() -> Any:
    from offcore_cpu.tracking import allocator_hook

    hook = allocator_hook()
    if hook is None:
        pytest.skip("the allocator hook cannot be built here")
    return hook


@pytest.fixture(params=["fast", "fast-python", "general"])
def dev(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A torch-buffer fake device without the sanitizer: with its fast path (the allocator hook's checks, or
    the dispatch accounting's in Python), and with it switched off."""
    if request.param == "fast":
        _hook_or_skip()
    device = offcore.device("cpu", accounting="dispatch" if request.param == "fast-python" else "auto", **FAST)
    if request.param == "general":
        device._small_pair = None  # what copy_ does without the fast path
    with device:
        yield device
    device.close()


def _counting(dev: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Counters of the pairs the fast path's checker took, and of the copies that went down the general path."""
    taken: list[int] = []
    general: list[int] = []
    small, checked = dev._small_pair, dev._copy_checked

    def took(dst: Any, src: Any) -> Any:
        pair = small(dst, src)
        if pair is not None:
            taken.append(1)
        return pair

    def counted(*args: Any, **kwargs: Any) -> Any:
        general.append(1)
        return checked(*args, **kwargs)

    monkeypatch.setattr(dev, "_small_pair", took)
    monkeypatch.setattr(dev, "_copy_checked", counted)
    return taken, general


def test_small_plain_copies_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    device = offcore.device("cpu", **FAST)
    taken, general = _counting(device, monkeypatch)
    with device:
        stream = device.new_stream()
        src = torch.arange(4096, dtype=torch.float32)
        host = device.allocate(src.numel() * 4, Tier.PINNED)
        device.copy_(host, src.view(torch.uint8), stream=stream).synchronize()
        back = torch.empty_like(src)
        device.copy_(back.view(torch.uint8), host, stream=stream).synchronize()
    device.close()
    assert len(taken) == 2 and not general
    assert torch.equal(back, src)


def test_the_sanitizer_keeps_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    device = offcore.device("cpu", sanitize=True, **FAST)
    assert device._small_pair is None
    with device:
        stream = device.new_stream()
        src = torch.arange(16, dtype=torch.float32)
        host = device.allocate(64, Tier.PINNED)
        device.copy_(host, src.view(torch.uint8), stream=stream).synchronize()
        assert torch.equal(host.view(torch.float32), src)
    device.close()


@pytest.mark.parametrize(
    ("src_tier", "dst_tier", "direction"),
    [
        (Tier.DEVICE, Tier.PINNED, "d2h"),
        (Tier.PINNED, Tier.DEVICE, "h2d"),
        (Tier.DEVICE, Tier.DEVICE, "d2d"),
        (Tier.PINNED, Tier.PAGEABLE, "h2h"),
    ],
)
def test_copies_are_booked_like_the_general_path(dev: Any, src_tier: Tier, dst_tier: Tier, direction: str) -> None:
    stream = dev.new_stream()
    src = dev.allocate(4096, src_tier)
    src.copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
    dst = dev.allocate(4096, dst_tier)
    before = dev.ledger.copies[offcore.Direction(direction)].copies
    event = dev.copy_(dst, src, stream=stream)
    event.synchronize()
    assert event.query()
    assert torch.equal(dst, src)
    assert dev.ledger.copies[offcore.Direction(direction)].copies == before + 1
    (logged,) = dev.copy_log()[-1:]
    assert logged["direction"] == direction and logged["bytes"] == 4096
    assert logged["src"] == src.data_ptr() and logged["dst"] == dst.data_ptr()


def test_declined_pairs_are_copied_the_general_way(dev: Any) -> None:
    """Views, a parameter, a conj view, a large copy: not the fast path's, all still copied right."""
    stream = dev.new_stream()
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    cases = [
        (torch.empty(8, 8).t(), base),  # a non-contiguous destination
        (torch.empty(64), torch.nn.Parameter(torch.arange(64, dtype=torch.float32))),  # a subclass
        (torch.empty(64), torch.arange(64, dtype=torch.float32)[::1]),
        (torch.empty(300 * 1024), torch.ones(300 * 1024)),  # above the GIL-held limit
    ]
    for dst, src in cases:
        dev.copy_(dst, src, stream=stream).synchronize()
        assert torch.equal(dst, src.detach())
    real = torch.randn(8, dtype=torch.complex64)
    dst = torch.empty(8, dtype=torch.complex64)
    dev.copy_(dst, real.conj(), stream=stream).synchronize()
    assert torch.equal(dst, real.conj().resolve_conj())


def test_refusals_are_the_general_paths(dev: Any) -> None:
    stream = dev.new_stream()
    with pytest.raises(ConfigurationError, match="different sizes"):
        dev.copy_(torch.empty(4), torch.empty(8), stream=stream)
    with pytest.raises(ConfigurationError, match="meta tensor"):
        dev.copy_(torch.empty(4), torch.empty(4, device="meta"), stream=stream)
    with pytest.raises(ConfigurationError, match="a stream of this device"):
        dev.copy_(torch.empty(4), torch.empty(4), stream=offcore.device("cpu", **FAST).new_stream())
    freed = torch.empty(16)
    view = freed[4:]
    freed.untyped_storage().resize_(0)
    with pytest.raises((FreedStorageError, StreamWorkError)):
        dev.copy_(torch.empty(12), view, stream=stream).synchronize()
    assert dev.copy_(torch.empty(4), torch.ones(4), stream=stream) is not None  # the device goes on


@pytest.mark.parametrize("mode", ["submit", "stream"])
def test_injected_faults_fire_on_the_same_copy(dev: Any, mode: str) -> None:
    stream = dev.new_stream()
    src, dst = torch.ones(16), torch.empty(16)
    dev.copy_(dst, src, stream=stream).synchronize()
    dev.inject_copy_fault(2, mode=mode)
    dev.copy_(dst, src, stream=stream).synchronize()  # the 1st from now
    if mode == "submit":
        with pytest.raises(InjectedFault, match="copy #3"):
            dev.copy_(dst, src, stream=stream)
    else:
        with pytest.raises(StreamWorkError, match="inject_copy_fault"):
            dev.copy_(dst, src, stream=stream).synchronize()
        with pytest.raises(StreamWorkError):
            stream.synchronize()  # the stream reports its failure once, then goes on
    assert not dev.copy_fault_armed
    dev.copy_(dst, torch.full((16,), 2.0), stream=stream).synchronize()
    assert torch.equal(dst, torch.full((16,), 2.0))


def test_a_disarmed_or_replaced_fault_is_not_fired_by_the_fast_path(dev: Any) -> None:
    """The fast path finds the armed fault by its copy number (``_fault_at``): disarming and re-arming keep it."""
    stream = dev.new_stream()
    src, dst = torch.ones(16), torch.empty(16)
    dev.inject_copy_fault(1)
    dev.inject_copy_fault(None)  # disarmed: the next copy runs
    dev.copy_(dst, src, stream=stream).synchronize()
    assert not dev.copy_fault_armed
    dev.inject_copy_fault(3)
    dev.inject_copy_fault(1)  # replaces it
    with pytest.raises(InjectedFault):
        dev.copy_(dst, src, stream=stream)
    for _ in range(3):  # the replaced fault (3rd from its arming) does not fire either
        dev.copy_(dst, src, stream=stream).synchronize()
    assert not dev.copy_fault_armed and dev.copy_log()[-1]["number"] == 5


@pytest.mark.parametrize(
    "link",
    [{"latency": "2ms"}, {"h2d_bandwidth": "1GiB/s", "d2h_bandwidth": "1GiB/s"}],
    ids=["latency", "bandwidth"],
)
def test_a_limited_link_times_the_fast_paths_copies(dev: Any, link: dict[str, Any]) -> None:
    """Only a link with infinite bandwidth and no latency books its copies as instant (Note [A direction's
    route is built once]); a latency or a bandwidth alone still makes each copy last its emulated time."""
    limited = offcore.device("cpu", **{**FAST, **link})
    try:
        if dev._small_pair is None:
            limited._small_pair = None
        with limited:
            stream = limited.new_stream()
            src, dst = limited.allocate(64 * 1024, Tier.DEVICE), limited.allocate(64 * 1024, Tier.PINNED)
            first = limited.copy_(dst, src, stream=stream)
            second = limited.copy_(dst, src, stream=stream)
            second.synchronize()
            assert first.query()
        one, two = limited.copy_log()[-2:]
        for entry in (one, two):
            assert entry["emulated_seconds"] > 0
            assert entry["end"] - entry["start"] >= entry["emulated_seconds"]
        assert two["start"] >= one["end"]  # the channel is busy until the first one lands
    finally:
        limited.close()


def test_an_unlimited_links_copies_land_when_they_start(dev: Any) -> None:
    stream = dev.new_stream()
    src, dst = dev.allocate(4096, Tier.DEVICE), dev.allocate(4096, Tier.PINNED)
    dev.copy_(dst, src, stream=stream).synchronize()
    (entry,) = dev.copy_log()[-1:]
    assert entry["emulated_seconds"] == 0.0 and entry["end"] == entry["start"]


def test_a_closed_copy_gate_holds_a_small_copy(dev: Any) -> None:
    stream = dev.new_stream()
    src, dst = torch.ones(16), torch.zeros(16)
    with dev.gate(stream, direction="d2d") as gate:
        done = dev.copy_(dst, src, stream=stream)
        gate.wait_held(1)
        assert not done.query()
        gate.open()
    done.synchronize()
    assert torch.equal(dst, src)


def test_a_closed_device_refuses_the_copy(dev: Any) -> None:
    stream = dev.new_stream()
    dev.close()
    with pytest.raises(ConfigurationError, match="closed"):
        dev.copy_(torch.empty(4), torch.ones(4), stream=stream)


def test_copy_many_checks_its_pairs_in_one_pass_too(dev: Any) -> None:
    """copy_many asks small_pair of each pair (the directions and bytes must come out as copy_'s)."""
    stream = dev.new_stream()
    on_device = [dev.allocate(1024 * (i + 1), Tier.DEVICE) for i in range(3)]
    for i, buffer in enumerate(on_device):
        buffer.fill_(i + 1)
    host = [dev.allocate(b.numel(), Tier.PINNED) for b in on_device]
    odd = torch.empty(64, 16).t()  # a non-contiguous side: checked the general way

    def counted(direction: str) -> tuple[int, int]:
        totals = dev.ledger.copies[offcore.Direction(direction)]
        return totals.copies, totals.bytes

    d2h, d2d = counted("d2h"), counted("d2d")
    dev.copy_many([*zip(host, on_device, strict=True), (odd, torch.ones(16, 64))], stream=stream).synchronize()
    for i, buffer in enumerate(host):
        assert bool((buffer == i + 1).all())
    assert torch.equal(odd, torch.ones(16, 64))
    assert counted("d2h") == (d2h[0] + 3, d2h[1] + 6144)
    assert counted("d2d") == (d2d[0] + 1, d2d[1] + 4096)


def _pair_cases(dev: Any) -> dict[str, tuple[Any, Any]]:
    """(dst, src) pairs the fast path takes, and pairs it must decline (the general path refuses or resolves them)."""
    on_device, host = dev.allocate(4096, Tier.DEVICE), dev.allocate(4096, Tier.PINNED)
    floats = torch.randn(1024)
    freed = torch.empty(16)
    freed_view = freed[4:]
    freed.untyped_storage().resize_(0)
    complex_ = torch.randn(4, dtype=torch.complex64)
    pageable, moved = dev.allocate(4096, Tier.PAGEABLE), dev.allocate(4096, Tier.PINNED)
    old_address = moved.untyped_storage().data_ptr()
    with dev.host_work():
        moved.untyped_storage().resize_(1 << 20)  # its bytes move: the hook's mark of its old address goes stale
    moved = moved.untyped_storage()  # the grown storage, all of it
    moved_view = torch.empty(0, dtype=torch.uint8).set_(moved, 0, (4096,))
    assert moved.data_ptr() != old_address
    return {
        "d2h": (host, on_device),
        "pageable": (pageable, on_device),
        "moved host buffer": (on_device, moved_view),
        "host to host": (pageable, host),
        "h2d": (on_device, host),
        "h2d typed": (floats, host),
        "slices": (on_device[1024:3072], host[:2048]),
        "empty": (torch.empty(0), torch.empty(0)),
        "non-contiguous": (torch.empty(32, 32).t(), torch.ones(32, 32)),
        "conj source": (torch.empty(4, dtype=torch.complex64), complex_.conj()),
        "neg source": (torch.empty(4), torch.randn(4)._neg_view()),
        "meta": (torch.empty(4, device="meta"), torch.empty(4, device="meta")),
        "sizes differ": (torch.empty(4), torch.empty(5)),
        "above the limit": (torch.empty(300 * 1024), torch.empty(300 * 1024)),
        "freed source": (torch.empty(12), freed_view),
        "sparse": (torch.zeros(4).to_sparse(), torch.ones(4).to_sparse()),
        "functional": (torch.empty(4), torch._to_functional_tensor(torch.randn(4))),
        "subclass": (torch.empty(4), torch.nn.Parameter(torch.ones(4))),
    }


def test_the_hooks_checks_answer_as_the_python_ones() -> None:
    """The allocator hook's small_pair takes exactly the pairs TorchBuffers.small_pair takes, with the same
    bytes and addresses, and tells the device's sides from host memory as the arena does."""
    _hook_or_skip()
    from offcore_cpu.torch_buffers import TORCH_OPS

    device = offcore.device("cpu", **FAST)
    with device:
        assert device.accounting == "allocator"
        for name, (dst, src) in _pair_cases(device).items():
            python, native = TORCH_OPS.small_pair(dst, src), device._small_pair(dst, src)
            if python is None:
                assert native is None, name
                continue
            assert native is not None, name
            assert native[:3] == (python[0], python[3], python[4]), name
            if name in ("d2h", "h2d", "h2d typed", "slices", "pageable", "host to host"):
                assert native[3] in (1 | 2, 1 | 8, 4 | 2, 4 | 8), name  # the hook knows both sides: no lookup
            sides = device._direction_of(dst, src, native[3])  # the hook's knowledge, the arena's for the rest
            assert sides is offcore.Direction.between(
                *(Tier.DEVICE if device.holds(b) else Tier.PINNED for b in (src, dst))
            )

        def inside(t: Any) -> Any:  # functorch-wrapped tensors
            assert TORCH_OPS.small_pair(t, t) is None and device._small_pair(t, t) is None
            return t

        torch.vmap(inside)(torch.ones(2, 4))
    device.close()
