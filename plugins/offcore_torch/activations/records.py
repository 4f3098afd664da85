"""The records of activation offload: what autograd holds per saved tensor, and one entry per offloaded storage.

Autograd holds what the pack hook returns until backward unpacks it (or the graph dies):

- :class:`Kept`: a tensor offcore did not offload (detached) and its version at save;
- :class:`Offloaded`: a saved tensor whose storage was offloaded: its :class:`Entry`,
  metadata and version keeper (storage.py Note [Version keepers]).

An :class:`Entry` is one offloaded *storage* (a tensor and its views share it): its host
buffer, its device references and the records reading it. Its lifecycle is an explicit
:class:`EntryState`; what the device memory of the original storage did is a
:class:`DeviceFate` (the figures ``freed_device_bytes`` / ``held_elsewhere_bytes``).
Where the copies are (offloading, offloaded, prefetching, restored) is the scheduler's
:class:`offcore.objects.ManagedObject` (``entry.obj``), never duplicated here.

    >>> EntryState.COPYING.value, DeviceFate.FREED.value
    ('copying', 'freed')
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from offcore.objects import ManagedObject
from offcore_torch.activations.storage import TensorMeta, dispatch_modes, internal_ops, is_offloadable_kind

if TYPE_CHECKING:  # pragma: no cover
    from offcore.kinds import Tier
    from offcore.ledger import Ledger
    from offcore.residency import ResidencyScheduler

__all__ = [
    "EntryState",
    "DeviceFate",
    "Kept",
    "Offloaded",
    "Entry",
    "new_entry",
    "GroupEntry",
    "new_group",
    "Region",
]


class Region(Protocol):
    """What the records and the NVMe hop (activations/nvme.py) ask of the region that made them.

    The region is :class:`~offcore_torch.OffloadHandle` (activations/offload.py); they know it
    through this protocol alone, so the dependency runs one way: offload imports records and
    nvme, neither imports offload.
    """

    device: Any
    _sched: ResidencyScheduler
    _by_key: dict[int, Entry]
    _ledger: Ledger
    _host_tier: Tier

    def _pool(self) -> Any: ...

    def _execute(self, actions: Any) -> None: ...

    def _on_landed(self, entry: Entry, failure: Exception | None) -> None: ...

    def _storage_died(self, entry: Entry) -> None: ...

    def _item_died(self, entry: Entry) -> None: ...


class EntryState(enum.Enum):
    """Where an offloaded storage's device-to-host copy, and the entry itself, stand."""

    COPYING = "copying"
    """Its device-to-host copy is in flight: offcore still references the device storage."""
    LANDED = "landed"
    """The copy landed: the host copy is the data (the device copy is freed, held or alive elsewhere)."""
    FAILED = "failed"
    """The copy failed: the device copy stays the data, the host buffer went back."""
    DISPOSED = "disposed"
    """No record uses it any more: its buffers are released once their copies landed."""


class DeviceFate(enum.Enum):
    """What became of the original device storage once offcore let go of it (the memory offloading saved)."""

    UNKNOWN = "unknown"
    """Not known yet (the copy is in flight, or backward already used it)."""
    HELD_ELSEWHERE = "held_elsewhere"
    """Offcore let go, but something else (the batch, a tensor the caller kept) still references it."""
    FREED = "freed"
    """It died on the device after its copy landed: counted in ``freed_device_bytes``."""


# enum members read in hot paths: Note [Enum members are read once per module] (offcore/kinds.py)
_UNKNOWN = DeviceFate.UNKNOWN
_COPYING = EntryState.COPYING


class Kept:
    """What autograd holds for a tensor offcore did not offload: the tensor (detached) and its version."""

    __slots__ = ("tensor", "version", "key")

    def __init__(self, tensor: torch.Tensor, key: int) -> None:
        # detach(): a saved *output* holding its own grad_fn would form a reference cycle
        # autograd cannot collect. The alias shares the version counter.
        if tensor.is_leaf:  # grad_fn is None (storage.py Note [is_leaf, not grad_fn])
            self.tensor = tensor  # a leaf: holding it forms no cycle
        elif dispatch_modes() and is_offloadable_kind(tensor):  # no mode active (the common case): one C call
            with internal_ops():
                self.tensor = tensor.detach()
        else:
            self.tensor = tensor.detach()
        self.version = tensor._version
        self.key = key


class Offloaded:
    """What autograd holds for an offloaded tensor: its storage entry, metadata and version keeper."""

    __slots__ = ("entry", "keeper", "version", "meta", "key", "fmt", "unpacked_round", "__weakref__")

    def __init__(self, entry: Entry, tensor: torch.Tensor, key: int, fmt: Any, meta: TensorMeta) -> None:
        self.entry = entry
        if dispatch_modes():  # storage.version_keeper, inlined: once per saved tensor
            with internal_ops():
                self.keeper = tensor.detach()
        else:  # Note [Metadata ops bypass dispatch modes]: no mode to bypass
            self.keeper = tensor.detach()
        self.version = tensor._version
        self.meta = meta
        self.key = key
        self.fmt = fmt
        self.unpacked_round = -1

    def __del__(self) -> None:
        entry = self.entry
        if entry is not None:
            try:
                entry.region._item_died(entry)
            except Exception:  # pragma: no cover - never raise from a finalizer
                pass


# Note [An entry's records]
# Every object a saved tensor keeps alive from forward to backward is promoted to the cyclic
# collector's oldest generation and walked by each full collection after; at thousands of saves
# per step that is a full collection or two per step, on the thread that launches kernels. So an
# offloaded saved tensor keeps five: its record (Offloaded, what autograd holds), the record's
# version keeper (a tensor), the entry's weak reference to the record, the entry, and the core's
# ManagedObject (tests/torch/test_offload_footprint.py counts them). The entry *is* the weak
# reference to its storage (its callback reports the storage's death), its metadata is shared
# (Note [Saved tensors share their metadata] in storage.py), and it knows its records through
# weak references (a record holds its entry; a strong reference back would be a cycle only the
# collector frees) kept without a list: the first record's is ``items`` (None until the pack that
# made the entry made the record), further records on the same storage (dedupe) are the tuple
# ``more_items``, None while there are none (a group's is a list, extended: Note [Small storages are offloaded in
# groups]). Readers: live_items() and all_unpacked(), and the
# landing (landings.py) and consumption (unpack.py) paths, which read ``items`` directly when
# ``more_items`` is None.
class Entry(weakref.ref):  # type: ignore[type-arg]
    """One offloaded storage: its copies, its host buffer and the records that use it.

    An entry is the weak reference to its storage (``entry()``: the storage while it lives, else
    None) whose callback, :func:`storage_died`, tells the region when the storage dies (Note [When
    may a device copy be freed?], point 2): no reference object of its own per storage, and no
    entry -> weakref -> entry cycle (Note [An entry's records]). Made by :func:`new_entry`.
    """

    __slots__ = (
        "region",
        "key",
        "where",
        "meta",
        "_name",
        "nbytes",
        "data_bytes",
        "obj",
        "skey",
        "src",
        "host",
        "host_view",
        "version_at_copy",
        "items",
        "more_items",
        "live",
        "restored",
        "restored_ref",
        "state",
        "fate",
        "used",
        "used_round",
        "keys",
        "modified_in_flight",
        "alive_elsewhere",
        "nvme",
    )

    # the types of the slots new_entry sets in chained assignments (annotations only: no class attributes)
    _name: str | None
    obj: ManagedObject
    src: torch.Tensor | None
    items: weakref.ref[Offloaded]
    more_items: tuple[weakref.ref[Offloaded], ...] | None
    restored: torch.UntypedStorage | None
    restored_ref: weakref.ref[torch.UntypedStorage] | None
    nvme: str | None

    # identity, not weakref.ref's equality and hash of the referent: two entries on one storage (a
    # disposed one and its successor) are two entries
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    @property
    def name(self) -> str:
        """``#<save index> <module> <shape> <dtype>``: how stats, waits and traces name this storage."""
        name = self._name
        if name is None:
            name = self._name = f"#{self.key} {self.where} {self.meta.describe()}"
        return name

    def live_items(self) -> list[Offloaded]:
        """The records autograd still holds (first record first)."""
        first = self.items
        item = None if first is None else first()
        out = [] if item is None else [item]
        more = self.more_items
        if more is not None:  # dedupe: further saved tensors on this storage
            out.extend(item for ref in more if (item := ref()) is not None)
        return out

    def add_item(self, item: Offloaded) -> None:
        """Know ``item`` as one more record of this storage (Note [An entry's records])."""
        ref = weakref.ref(item)
        if self.items is None:
            self.items = ref
        elif self.more_items is None:
            self.more_items = (ref,)
        else:
            self.more_items += (ref,)  # a tuple, a new one; a group's list (GroupEntry), extended

    def all_unpacked(self, round_: int) -> bool:
        """Every record autograd still holds was unpacked in backward round ``round_``."""
        for item in self.live_items():
            if item.unpacked_round != round_:
                return False
        return True


_new_ref = weakref.ref.__new__


def new_entry(
    storage: torch.UntypedStorage,
    region: Region,
    key: int,
    where: str,
    meta: TensorMeta,
    nbytes: int,
    skey: int,
    host: Any = None,
    host_view: torch.Tensor | None = None,
    version_at_copy: int = 0,
) -> Entry:
    """A new :class:`Entry`: the weak reference to ``storage`` (callback :func:`storage_died`), its slots set.

    Once per offloaded storage: made by weakref.ref's own ``__new__`` (C) and set up here, without
    a Python-level ``__new__`` and ``__init__`` (a frame each); the slots that start alike are set
    in one chained assignment each.
    """
    entry = _new_ref(Entry, storage, storage_died)
    entry.region = region
    entry.key = key
    entry.where = where
    entry.meta = meta
    entry.nbytes = entry.data_bytes = nbytes
    entry.skey = skey
    entry.host = host
    entry.host_view = host_view
    entry.version_at_copy = version_at_copy
    # _name: built when first asked (labels of timed copies, stalls); obj: the scheduler's object,
    # registered once the device-to-host copy was submitted; items: the first record, weakly, and
    # more_items the further ones (Note [An entry's records]); restored / restored_ref: the device
    # copy backward reads; nvme: where its host copy is on the NVMe tier
    # (offcore_torch.activations.nvme): None (never spilled), or "writing", "disk", "both", "reading"
    entry._name = entry.obj = entry.src = entry.items = entry.more_items = None  # type: ignore[assignment]
    entry.restored = entry.restored_ref = entry.nvme = None
    # used: unpacked at least once (in any round, or read by hand outside backward); modified_in_flight:
    # its version changed before its copy landed; alive_elsewhere: the scheduler was told its device
    # memory lives on (device_copy_alive) and not yet that it died
    entry.used = entry.modified_in_flight = entry.alive_elsewhere = False
    entry.live = 0
    entry.used_round = -1  # the last backward round that unpacked it
    entry.state = _COPYING
    entry.fate = _UNKNOWN
    # pack keys of every record that reads this storage: a tuple of ints, which the cyclic garbage
    # collector stops tracking at its first pass (a list it would traverse at every full collection)
    entry.keys = (key,)
    return entry


def storage_died(entry: Entry) -> None:
    """The callback of every entry, the weak reference to its storage (Note [When may a device copy be freed?], point 2)."""
    try:
        entry.region._storage_died(entry)
    except Exception:  # pragma: no cover - weakref callbacks must not raise
        pass


# Note [Small storages are offloaded in groups]
# Every offloaded storage costs offcore a fixed amount of host work, whatever its size: its entry, its
# scheduler object and that object's transitions, its ledger records, two copies with their events, a
# host buffer from the pool and back, its landing and its release. For storages of a few KiB that
# fixed cost is most of a step's offload work (docs/benchmarks.md). Storages smaller than ``group_below``
# (by default 64 KiB, the default ``min_bytes``: nothing is grouped unless ``min_bytes`` is lowered; 0
# turns groups off) are not offloaded one by one: the pack hook adds each to the region's open *group*
# (:class:`GroupEntry`) and hands autograd its record (:class:`GroupedOffloaded`) at once; the group is
# copied when it is full (``GROUP_MAX_BYTES``, ``GROUP_MAX_MEMBERS``, or a quarter of the prefetch
# budget: ``GROUP_BUDGET_SHARE``), when forward ends (the region's exit), when a record of it is
# unpacked first, or at ``handle.synchronize()`` / ``offcore_torch.synchronize(device)`` on the thread
# that entered the region. From then on it is one entry like any
# other: one host buffer holding its members one after another (each at a ``GROUP_ALIGN``-aligned
# offset), one device-to-host ``copy_many`` (a ``copy_`` per member where the backend has none), one
# scheduler object whose readers are all its members' save keys (needed at the first of their uses,
# like a shared storage), one prefetch, one landing, one release. A prefetch or reload allocates each
# member's storage on the device, exactly its size as an entry's is (so a saved tensor comes back with
# its own storage, storage offset and size), and fills them with one host-to-device ``copy_many``; the
# group's ``restored`` is then the list of those storages (:class:`RestoredMembers`), and a record is
# restored over the one at its member's index.
# - The values are those at save: the group holds each member's storage (``src``) from its pack until
#   the copy landed, and a member modified in place before the group's copy fails its version check at
#   unpack, as it does without offcore (a modification after save always raises there).
# - Device memory: members' storages live until their group's copy landed, at most one group's bytes
#   per region longer than one by one.
# - A group is never "alive elsewhere" (``entry()`` is always None): until it landed and let go, its
#   records are restored from their version keepers, which hold the storages (unpack.py); what the
#   region counts per storage (freed or held-elsewhere bytes) it counts per member when the group lets go
#   of them (OffloadHandle._members_released).
# - A group whose copy could not be made (no host memory under fallback="keep", a copy refused at
#   submission or failed on its stream) is FAILED: its records are restored from their keepers too.
GROUP_MAX_BYTES = 1024**2
"""A group is copied once it holds this many bytes (``group_below`` may be at most this)."""
GROUP_MAX_MEMBERS = 256
"""... or this many storages."""
GROUP_BUDGET_SHARE = 4
"""... or a quarter of what the region may prefetch at once (``prefetch_budget``, or the device budget where one
is set and smaller): a group is prefetched whole, so it must fit the budget with room to spare; storages at or
above that size are offloaded one by one. ``prefetch_budget=0`` groups nothing."""
GROUP_ALIGN = 64
"""Each member starts at a multiple of this many bytes in the group's buffers (any dtype's element size
divides it; kernels reading a restored member see an aligned pointer)."""


class GroupedOffloaded(Offloaded):
    """What autograd holds for a saved tensor whose storage is a member of a group: also the member's index."""

    __slots__ = ("member",)

    def __init__(self, entry: Entry, tensor: torch.Tensor, key: int, fmt: Any, meta: TensorMeta, member: int) -> None:
        super().__init__(entry, tensor, key, fmt, meta)
        self.member = member

    def __del__(self) -> None:
        group = self.entry
        if group is not None and group.unpacks_round == self.unpacked_round:
            group.unpacks -= 1  # counted in the group's unpacks: no longer live
        Offloaded.__del__(self)


class RestoredMembers(list):  # type: ignore[type-arg]
    """A group's device copy: each member's restored storage, in member order (a list that can be weakly referenced)."""

    __slots__ = ("__weakref__",)


class _Anchor:
    """A weakly referable nothing: a group's weak reference is dead from the start (``entry()`` is None)."""

    __slots__ = ("__weakref__",)


class GroupEntry(Entry):
    """An entry holding several small storages, copied and scheduled as one (Note [Small storages are
    offloaded in groups]). ``nbytes`` is its host buffer's size (members and alignment: what the
    scheduler and the ledger count); ``data_bytes`` the members' own bytes (what its copies move, and
    the figures count)."""

    # per member, in member order: its storage (weakly), its size, its offset in the host buffer and the
    # saved tensor's version at its pack; ``index``: member index by storage key (how a later save of the
    # storage finds it); ``held``: the members alive elsewhere when the group let go of them (a weak
    # reference each, whose callback counts the storage freed when it dies)
    __slots__ = ("index", "refs", "sizes", "offsets", "versions", "held", "filled", "unpacks", "unpacks_round")

    index: dict[int, int]
    refs: list[weakref.ref[torch.UntypedStorage]]
    sizes: list[int]
    offsets: list[int]
    versions: list[int]
    held: dict[int, weakref.ref[torch.UntypedStorage]] | None

    # ``unpacks``: how many live records were unpacked in round ``unpacks_round`` (counted at their first
    # unpack in it, uncounted when such a record dies), so that all_unpacked is one comparison, not a
    # walk over the group's records at every unpack
    def all_unpacked(self, round_: int) -> bool:
        """Every record autograd still holds was unpacked in backward round ``round_``."""
        return self.unpacks_round == round_ and self.unpacks >= self.live

    def note_unpack(self, item: Offloaded, round_: int) -> None:
        """Count ``item``'s first unpack in round ``round_`` (before its ``unpacked_round`` is set)."""
        if self.unpacks_round != round_:
            self.unpacks_round, self.unpacks = round_, 0
        if item.unpacked_round != round_:
            self.unpacks += 1


def new_group(region: Region, key: int, where: str, meta: TensorMeta) -> GroupEntry:
    """A new, empty, open :class:`GroupEntry` named by its first member's save ``key``."""
    anchor = _Anchor()
    group = _new_ref(GroupEntry, anchor)  # no callback: the anchor dies now, the reference is dead
    del anchor
    group.region = region
    group.key = key
    group.where = where
    group.meta = meta
    group.nbytes = group.filled = group.data_bytes = group.version_at_copy = group.live = 0
    group.skey = -1  # never a key of _by_storage: each member's storage key is (OffloadHandle._pack_grouped)
    group.host = group.host_view = None
    group._name = group.obj = group.items = None  # type: ignore[assignment]
    group.more_items = []  # type: ignore[assignment]  # (a list: a group has many; Entry.add_item extends it)
    group.restored = group.restored_ref = group.nvme = None
    group.src = []  # type: ignore[assignment]  # the members' storages (bytes), held until the copy landed
    group.index = {}
    group.refs, group.sizes, group.offsets, group.versions = [], [], [], []
    group.held = None
    group.used = group.modified_in_flight = group.alive_elsewhere = False
    group.used_round = group.unpacks_round = -1
    group.unpacks = 0
    group.state = _COPYING
    group.fate = _UNKNOWN
    group.keys = []  # type: ignore[assignment]  # (a list: a group has many)
    return group
