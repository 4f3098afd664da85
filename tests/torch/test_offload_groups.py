"""Small storages offloaded in groups (``group_below``): the same numbers, the same restores, nothing left behind.

With ``group_below`` set, storages smaller than it are copied and scheduled a group at a time
(Note [Small storages are offloaded in groups] in offcore_torch/activations/records.py). Every
test here checks what the per-storage path guarantees, with groups: training is bit-identical to
keep-all (real models: attention with dropout, a CNN with in-place ops and views), every dtype and
layout comes back exactly (its own storage, offset and size) from the host copy, dedupe shares one
member, a tensor modified in place before its group is copied still fails its version check, a
failed or refused copy recovers, and device, pinned and pageable memory return to where they were.
On the fake device the sanitizer is on (the fixtures' devices), so a copy racing its buffers fails
the test too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offcore_torch.activations.records import GROUP_MAX_BYTES  # noqa: E402

# torch's note on an experimental dtype (one of every dtype is saved), not about offcore
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
from offcore_torch.models import cnn_workload, gpt_workload, mlp_workload, view_saver_workload  # noqa: E402
from offcore_torch.testing import assert_bit_identical, run_workload  # noqa: E402
from offload_helpers import memory_levels, same_storage, sanitized_device, settle  # noqa: E402
from test_equivalence import GPT_CONFIG, check_really_offloaded  # noqa: E402
from test_restore_fidelity import (  # noqa: E402
    LAYOUTS,
    PLAIN_DTYPES,
    Keep,
    Saved,
    assert_restored_exactly,
    base_of,
    random_tensor,
)
from torch_test_devices import device_with_link, is_fake_device  # noqa: E402

import offcore  # noqa: E402

GROUP = "64KiB"
STEPS = 3

WORKLOADS: dict[str, Callable[[], Any]] = {
    "mlp": lambda: mlp_workload(d_in=32, width=128, depth=3, d_out=16, batch_size=64),
    "gpt": lambda: gpt_workload(GPT_CONFIG, batch_size=2),
    "cnn": lambda: cnn_workload(in_channels=3, width=8, n_classes=10, image_size=16, batch_size=4),
    "view_saver": lambda: view_saver_workload(d_in=32, d_out=64, batch_size=48),
}


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


@contextlib.contextmanager
def landed_groups(device: Any, **policy: Any) -> Iterator[Any]:
    """``offload_activations(device, group_below=GROUP, ...)`` whose groups are copied and landed before forward
    ends (``handle.synchronize()`` inside the region): offcore lets their device storages go, backward copies
    them back from the host."""
    with offcore_torch.offload_activations(device, group_below=GROUP, **policy) as handle:
        yield handle
        handle.synchronize()


@pytest.mark.parametrize("link", ["unlimited", "slow"])
@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_grouped_training_is_bit_identical(
    backend: Any, make_fake_device: Callable[..., Any], name: str, prefetch: str, link: str
) -> None:
    device = device_with_link(backend, link, make_fake_device)
    reference = run_workload(WORKLOADS[name](), device=device, steps=STEPS)
    grouped = run_workload(
        WORKLOADS[name](),
        device=device,
        steps=STEPS,
        offload={"min_bytes": 0, "prefetch": prefetch, "group_below": GROUP},
    )
    assert_bit_identical(reference, grouped, labels=("keep-all", "grouped"))
    check_really_offloaded(grouped)


@pytest.mark.parametrize("prefetch", ["deadline", "on_demand"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_grouped_storages_restored_from_host_are_bit_identical(
    backend: Any, make_fake_device: Callable[..., Any], name: str, prefetch: str
) -> None:
    """Every group landed before forward ended: backward must copy the groups back (and free what it read)."""
    device = device_with_link(backend, "slow", make_fake_device) if is_fake_device(backend) else backend
    reference = run_workload(WORKLOADS[name](), device=device, steps=STEPS)
    grouped = run_workload(
        WORKLOADS[name](),
        device=device,
        steps=STEPS,
        offload=lambda: landed_groups(device, min_bytes=0, prefetch=prefetch),
    )
    assert_bit_identical(reference, grouped, labels=("keep-all", "grouped, restored from host"))
    check_really_offloaded(grouped, reloaded=True)
    for stats in grouped.stats:
        assert stats is not None and stats.freed_device_bytes > 0, stats


def save_and_restore_grouped(dev: Any, make: Callable[[], Sequence[Any]]) -> tuple[list[Saved], list[Saved], Any]:
    """Save ``make()``'s tensors (their storages are small: one group) through :class:`Keep`, let the group land
    and the device storages die, and record each tensor as backward reads it back."""
    restored: list[Saved] = []
    with dev:
        anchor = torch.zeros(2, device=dev.torch_device, requires_grad=True)
        tensors = tuple(make())
        expected = [Saved.of(t) for t in tensors]
        with landed_groups(dev, min_bytes=0) as handle:
            out = Keep.apply(restored, Saved.of, anchor, *tensors)
        del tensors
        out.sum().backward()
    assert torch.equal(anchor.grad, torch.ones_like(anchor))
    return expected, restored, handle.stats()


def test_every_dtype_in_one_group_comes_back_exactly(dev: Any) -> None:
    """One tensor of every dtype, each its own storage and a member of one group at its own offset."""
    torch.manual_seed(0)
    expected, restored, stats = save_and_restore_grouped(
        dev, lambda: [random_tensor(dtype, (3, 5), dev.torch_device) for dtype in PLAIN_DTYPES]
    )
    for dtype, got, want in zip(PLAIN_DTYPES, restored, expected, strict=True):
        assert_restored_exactly(got, want, str(dtype))
    nbytes = sum(saved.meta[-1] for saved in expected)  # each storage's bytes
    assert stats.offloaded_storages == len(PLAIN_DTYPES) and stats.offloaded_bytes == nbytes, stats
    assert stats.reloaded_bytes == nbytes and stats.freed_device_bytes == nbytes, stats  # the group came back


def test_every_layout_in_one_group_comes_back_exactly(dev: Any) -> None:
    """Views with offsets, strides, conj/neg bits and dtype reinterpretations, all in one group."""
    torch.manual_seed(0)
    names = [name for name, layout in LAYOUTS.items() if layout.offloaded]
    expected, restored, stats = save_and_restore_grouped(
        dev, lambda: [LAYOUTS[name].view(base_of(LAYOUTS[name], dev.torch_device)) for name in names]
    )
    for name, got, want in zip(names, restored, expected, strict=True):
        assert_restored_exactly(got, want, name)
    assert stats.offloaded_storages == len(names) and stats.reloaded_bytes == stats.offloaded_bytes, stats


def test_views_of_one_storage_share_one_member_and_come_back_as_views_of_one_restore(dev: Any) -> None:
    torch.manual_seed(0)

    def make() -> list[Any]:
        base = torch.randn(8, 8, device=dev.torch_device)
        return [base, base[2:, 1:], torch.randn(16, device=dev.torch_device), base.t()]

    expected, restored, stats = save_and_restore_grouped(dev, make)
    for what, got, want in zip(("base", "slice", "other", "transposed"), restored, expected, strict=True):
        assert_restored_exactly(got, want, what)
    assert stats.offloaded_storages == 2 and stats.offloaded_tensors == 4, stats
    assert stats.offloaded_bytes == (64 + 16) * 4 == stats.reloaded_bytes, stats


def test_views_restored_from_a_group_share_their_storage(dev: Any) -> None:
    seen: list[Any] = []
    with dev:
        anchor = torch.zeros(2, device=dev.torch_device, requires_grad=True)
        base = torch.randn(8, 8, device=dev.torch_device)
        with landed_groups(dev, min_bytes=0):
            out = Keep.apply(seen, lambda t: t, anchor, base, base[2:, 1:], torch.randn(4, device=dev.torch_device))
        del base
        out.sum().backward()
    assert same_storage(seen[0], seen[1]) and not same_storage(seen[0], seen[2])


def test_an_in_place_change_before_the_group_is_copied_fails_the_version_check(dev: Any) -> None:
    """The group copies its members when it is full or forward ends: a member changed in place before then
    must not be read back as if unchanged (autograd raises here without offcore too)."""
    with dev:
        x = torch.randn(64, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=0, group_below=GROUP) as handle:
            h = x * 2.0
            y = torch.sin(h)  # saves h: a member of the open group
            h.add_(1.0)  # in place, before the group is copied
            z = torch.cos(h)  # saves h again, changed: not the member's values (kept on the device)
        with pytest.raises(RuntimeError, match="modified"):
            (y + z).sum().backward()
    stats = handle.stats()
    assert stats.offloaded_storages >= 1 and stats.kept.get("modified_after_save") == 1, stats


def test_a_record_read_before_forward_ends_copies_its_group_first(dev: Any) -> None:
    """Backward inside the region reads a member of the open group: the group is copied then, the values are right."""
    with dev:
        x = torch.randn(32, device=dev.torch_device, requires_grad=True)
        expected = torch.cos(torch.sin(x).detach())  # d sin(sin x)/dx = cos(sin x) cos x
        with offcore_torch.offload_activations(dev, min_bytes=0, group_below=GROUP) as handle:
            y = torch.sin(torch.sin(x))
            y.sum().backward()
        assert torch.equal(x.grad, expected * torch.cos(x))
    assert handle.stats().offloaded_storages >= 1


def test_without_host_memory_a_group_stays_on_the_device(backend: Any, make_fake_device: Any) -> None:
    device = sanitized_device(backend, make_fake_device, link="slow")
    reference = run_workload(WORKLOADS["mlp"](), device=device, steps=2)
    kept = run_workload(
        WORKLOADS["mlp"](),
        device=device,
        steps=2,
        offload={"min_bytes": 0, "group_below": GROUP, "host_budget": "64KiB", "fallback": "keep"},
    )
    assert_bit_identical(reference, kept, labels=("keep-all", "grouped, no host memory"))
    assert any(stats is not None and stats.kept.get("host_budget", 0) > 0 for stats in kept.stats), kept.stats
    # this workload's group is larger than the host budget: it is not copied, and leaves the offloaded figures
    assert all(stats.offloaded_storages == stats.offloaded_bytes == 0 for stats in kept.stats), kept.stats


def test_a_graph_dropped_in_forward_or_before_backward_leaves_nothing(dev: Any) -> None:
    torch.manual_seed(0)
    with dev:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
        model = model.to(dev.torch_device)
        x = torch.randn(32, 64, device=dev.torch_device)
        settle(dev)
        before = memory_levels(dev)
        for drop_in_forward in (True, False):
            with offcore_torch.offload_activations(dev, min_bytes=0, group_below=GROUP) as handle:
                loss = model(x).square().mean()
                if drop_in_forward:
                    del loss  # every record of the open group dies before it is copied
            if not drop_in_forward:
                del loss  # the group was copied at the region's end; nobody runs backward
            settle(dev)
            assert memory_levels(dev) == before, "dropped in forward" if drop_in_forward else "no backward"
            if drop_in_forward:  # the group was never copied: nothing counts as offloaded
                assert handle.stats().offloaded_storages == handle.stats().offloaded_bytes == 0, handle.stats()
        assert handle.stats().offloaded_storages > 0


def test_records_dying_in_forward_leave_the_open_group_usable(dev: Any) -> None:
    """Every record of the open group so far dies (a branch dropped in forward); later saves join the same
    group, which is copied and read back as usual: the numbers are right and nothing is left behind."""
    torch.manual_seed(0)
    with dev:
        x = torch.randn(256, device=dev.torch_device, requires_grad=True)
        settle(dev)
        before = memory_levels(dev)
        with offcore_torch.offload_activations(dev, min_bytes=0, group_below=GROUP) as handle:
            dropped = torch.sin(x * 3.0)
            del dropped  # its saved tensors' records die while their group is open
            y = torch.sin(torch.sin(x * 2.0))
            handle.synchronize()  # the group is copied and lands: backward reads it back
        y.sum().backward()
        expected = torch.cos(torch.sin(x * 2.0)) * torch.cos(x * 2.0) * 2.0
        assert torch.equal(x.grad, expected)
        stats = handle.stats()
        assert stats.reloaded_bytes > 0, stats
        del y, expected
        x.grad = None
        settle(dev)
        assert memory_levels(dev) == before


def test_full_groups_are_copied_during_forward(dev: Any) -> None:
    """More small storages than a group holds: earlier groups are copied while forward still runs."""
    with dev:
        x = torch.randn(16 * 1024 // 4, device=dev.torch_device, requires_grad=True)  # 16 KiB
        count = 3 * GROUP_MAX_BYTES // (16 * 1024)
        with offcore_torch.offload_activations(dev, min_bytes=0, group_below=GROUP) as handle:
            y = x * 1.0
            for _ in range(count):
                y = torch.sin(y)
            # two full groups copied (scheduled objects), the third still open
            copied, open_members = len(handle._by_key), len(handle._open_group.refs)
        y.sum().backward()
    assert (copied, open_members) == (2, GROUP_MAX_BYTES // (16 * 1024))
    assert handle.stats().offloaded_storages == count


def _chain_of_saves(dev: Any, count: int, nbytes: int, **policy: Any) -> tuple[Any, int, int]:
    """``count`` saves of ``nbytes`` each (sin saves its input) under ``offload_activations(dev, min_bytes=0, **policy)``: (the
    handle, the scheduled objects and the members of the open group when forward's last save is made)."""
    with dev:
        x = torch.randn(nbytes // 4, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=0, **policy) as handle:
            y = x * 1.0
            for _ in range(count):
                y = torch.sin(y)
            group = handle._open_group
            copied, open_members = len(handle._by_key), 0 if group is None else len(group.refs)
        y.sum().backward()
        settle(dev)
    return handle, copied, open_members


def test_small_storages_are_grouped_by_default_once_min_bytes_lets_them_in(dev: Any) -> None:
    """The default group_below is 64 KiB, min_bytes' default: a region that offloads smaller storages
    groups them; group_below=0 copies each on its own; at 64 KiB and above storages go one by one."""
    _, copied, open_members = _chain_of_saves(dev, 8, 16 * 1024)
    assert (copied, open_members) == (0, 8)  # one open group, copied when forward ends
    _, copied, open_members = _chain_of_saves(dev, 8, 16 * 1024, group_below=0)
    assert (copied, open_members) == (8, 0)  # every sin's input its own object
    _, copied, open_members = _chain_of_saves(dev, 8, 64 * 1024)
    assert (copied, open_members) == (8, 0)


@pytest.mark.parametrize(("budget", "members"), [("256KiB", 4), ("128KiB", 2), ("64KiB", 0), ("0", 0)])
def test_a_group_holds_at_most_a_quarter_of_the_prefetch_budget(dev: Any, budget: str, members: int) -> None:
    """A group is prefetched whole: it holds at most a quarter of prefetch_budget (16 KiB storages: 4 in a
    group under 256 KiB), and a storage that would fill more goes on its own (nothing grouped at 0)."""
    handle, copied, open_members = _chain_of_saves(dev, 8, 16 * 1024, prefetch_budget=budget)
    if members:  # the full groups copied during forward, the last one open
        assert (copied, open_members) == (8 // members - 1, members)
    else:
        assert (copied, open_members) == (8, 0)
    assert handle.stats().offloaded_storages == 8


def test_a_group_holds_at_most_a_quarter_of_the_device_budget(dev: Any) -> None:
    """With a device budget (offcore_torch.device_budget) smaller than prefetch_budget, the quarter is the
    device budget's: under 128 KiB, two 16 KiB storages per group."""
    offcore_torch.device_budget(dev, 128 * 1024)
    try:
        _, copied, open_members = _chain_of_saves(dev, 8, 16 * 1024)
    finally:
        offcore_torch.device_budget(dev, None)
    assert (copied, open_members) == (3, 2)


def test_synchronize_in_the_region_copies_its_open_group(dev: Any) -> None:
    """offcore_torch.synchronize(device) on the thread that entered a region copies the region's open group,
    so afterwards every saved tensor offcore offloads is on the host (as handle.synchronize() does); a
    region entered on another thread keeps its open group (its pack hook may be adding to it)."""
    import threading

    with dev:
        x = torch.randn(4096, device=dev.torch_device, requires_grad=True)
        with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            y = torch.sin(x * 1.0)
            assert handle._open_group is not None
            elsewhere = threading.Thread(target=offcore_torch.synchronize, args=(dev,))
            elsewhere.start()
            elsewhere.join()
            assert handle._open_group is not None  # another thread's synchronize left it open
            offcore_torch.synchronize(dev)
            assert handle._open_group is None
            assert handle.stats().freed_device_bytes == x.nbytes  # landed, and offcore let the storage go
        y.sum().backward()
    assert handle.stats().reloaded_bytes == x.nbytes


def test_groups_on_the_nvme_tier_train_bit_identically_and_leave_no_file(
    make_fake_device: Callable[..., Any], tmp_path: Any
) -> None:
    """Groups go on to disk like storages do (their host buffer is one file) and come back from it."""
    from test_activation_nvme import files_under, settled_offload, wait_for_writes

    device = make_fake_device(link="slow")
    reference = run_workload(WORKLOADS["gpt"](), device=device, steps=STEPS)

    @contextlib.contextmanager
    def grouped_on_disk() -> Iterator[Any]:
        with settled_offload(
            device, min_bytes=0, group_below=GROUP, nvme=str(tmp_path), nvme_read_ahead="8KiB"
        ) as handle:
            yield handle
            handle.synchronize()  # the last group copied and landed: its write starts
            wait_for_writes(handle)

    spilled = run_workload(WORKLOADS["gpt"](), device=device, steps=STEPS, offload=grouped_on_disk)
    assert_bit_identical(reference, spilled, labels=("keep-all", "groups on NVMe"))
    stats = [s for s in spilled.stats if s is not None]
    assert sum(s.spilled_bytes for s in stats) > 0 and sum(s.nvme_read_bytes for s in stats) > 0, stats
    assert all(s.nvme_failures == 0 for s in stats)
    settle(device)
    assert files_under(tmp_path) == []


def test_group_below_is_checked() -> None:
    from offcore_torch.activations.policy import OffloadPolicy

    assert OffloadPolicy.parse(group_below="64KiB").group_below == 64 * 1024
    assert OffloadPolicy.parse().group_below == 64 * 1024  # the default: min_bytes' (nothing grouped at defaults)
    assert OffloadPolicy.parse(group_below=0).group_below == 0
    with pytest.raises(offcore.ConfigurationError, match="group_below"):
        OffloadPolicy.parse(group_below="2MiB")
    with pytest.raises(offcore.ConfigurationError):
        OffloadPolicy.parse(group_below="lots")
