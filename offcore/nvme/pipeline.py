"""A pipelined step over groups of state on a slower tier: read group i+1, compute group i, write group i−1.

>>> import numpy as np, tempfile
>>> from offcore.nvme import NvmeTier, pipelined
>>> tier = NvmeTier(tempfile.mkdtemp(), budget="1MiB")
>>> for g in range(4):
...     tier.write(g, np.full(8, g, np.float64)).synchronize()
>>> host = {}
>>> def read(g):
...     host[g] = np.empty(8, np.float64)
...     return tier.read(g, host[g])
>>> def compute(g):
...     host[g] += 1
>>> def write(g):
...     return tier.write(g, host[g])
>>> pipelined(range(4), read, compute, write, release=host.pop)
>>> out = np.empty(8); tier.read(3, out).synchronize(); float(out[0]), len(host)
(4.0, 0)
>>> tier.close()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from offcore.errors import ConfigurationError

__all__ = ["pipelined", "Waitable"]

G = TypeVar("G")


class Waitable(Protocol):
    """What ``read`` and ``write`` return: an :class:`~offcore.nvme.IOHandle`, a backend event, ..."""

    def synchronize(self) -> None: ...


# Note [pipelined step and the host copy]
# pipelined() keeps at most three groups' host buffers live: i−1 (being written), i (being
# computed) and i+1 (being read). Before it reads group i+2 it waits for group i−1's write
# and only then calls release(i−1): a group's host copy is released only after its write
# completed (Note [when may the host copy be released] in offcore/nvme/tier.py). If anything
# fails (a read, compute, a write), every transfer already started is waited for, the groups
# whose host copy is no longer needed are released (written back, or only read and never
# changed), and the exception is raised with ``unwritten_groups``: the groups that compute
# changed but whose write did not complete. Their host buffers are NOT released; they hold
# the only up-to-date copy and the caller decides (write again, or keep them).


def pipelined(
    groups: Iterable[G],
    read: Callable[[G], Waitable],
    compute: Callable[[G], Any],
    write: Callable[[G], Waitable],
    *,
    release: Callable[[G], Any] | None = None,
    lookahead: int = 1,
) -> None:
    """Run ``compute`` over ``groups`` with the reads and writes around it overlapped.

    For each group ``g`` in order: ``read(g)`` starts loading it and returns a handle;
    ``compute(g)`` runs once that handle synchronized; ``write(g)`` starts storing it and
    returns a handle; ``release(g)`` (optional) frees its host buffers once the write
    completed. Group i+1 is read while group i is computed and group i−1 written; the
    results are those of the plain loop (same calls in the same order per group), and at
    most three groups are between ``read`` and ``release`` at any time. ``lookahead=k``
    keeps the reads of groups i+1 … i+k in flight while group i is computed (a deeper
    queue for a disk that needs one): at most ``k + 2`` groups are live.

    A ``read`` or ``write`` call that raises (rather than returning a handle that fails)
    must leave nothing behind for that call: a ``read`` that raised frees what it
    acquired itself. On any failure the exception carries ``unwritten_groups``
    (Note [pipelined step and the host copy]).
    """
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise ConfigurationError(f"lookahead must be a positive integer, got {lookahead!r}")
    order = list(groups)
    n = len(order)
    reads: dict[int, Waitable] = {}
    writes: dict[int, Waitable] = {}
    computed: set[int] = set()
    settled: set[int] = set()  # released or deliberately kept

    def finish_write(j: int) -> None:
        handle = writes.pop(j)
        handle.synchronize()
        settled.add(j)
        if release is not None:
            release(order[j])

    try:
        for j in range(min(lookahead, n)):
            reads[j] = read(order[j])
        for i in range(n):
            if i >= 2:
                finish_write(i - 2)  # frees a slot: at most i-1, i, ..., i+lookahead live below
            if i + lookahead < n:
                reads[i + lookahead] = read(order[i + lookahead])
            reads[i].synchronize()
            del reads[i]
            computed.add(i)
            compute(order[i])
            writes[i] = write(order[i])
        for j in sorted(writes):
            finish_write(j)
    except BaseException as exc:
        unwritten = _drain(order, reads, writes, computed, settled, release)
        exc.unwritten_groups = unwritten  # type: ignore[attr-defined]
        if unwritten and hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"groups changed but not written back (their host buffers were kept): {unwritten!r}")
        raise


def _drain(
    order: list[Any],
    reads: dict[int, Waitable],
    writes: dict[int, Waitable],
    computed: set[int],
    settled: set[int],
    release: Callable[[Any], Any] | None,
) -> list[Any]:
    """After a failure: wait for every transfer started, release what is safe, return the unwritten groups."""
    safe: list[int] = []
    for j, handle in list(reads.items()):
        try:
            handle.synchronize()
        except BaseException:
            pass  # the disk copy is unchanged; the host buffer is only scratch
        if j not in computed:
            safe.append(j)
    for j, handle in list(writes.items()):
        try:
            handle.synchronize()
            safe.append(j)
        except BaseException:
            pass  # kept: the host copy is the only valid one
    unwritten = [order[j] for j in sorted(computed - settled - set(safe))]
    if release is not None:
        for j in sorted(safe):
            if j not in settled:
                settled.add(j)
                release(order[j])
    return unwritten
