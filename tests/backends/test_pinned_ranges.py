"""Which pinned block holds an address (Note [Which pinned block holds an address] in offcore_accelerator)."""

from __future__ import annotations

import gc
import threading
import weakref

from hypothesis import given, settings
from hypothesis import strategies as st
from offcore_accelerator import PinnedRanges

# non-overlapping blocks: (gap before, length) pairs laid out from address 0
_blocks = st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64)), max_size=40)


def _laid_out(blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for gap, length in blocks:
        start = at + gap
        out.append((start, start + length))
        at = start + length
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_blocks, st.lists(st.integers(0, 40), max_size=10), st.lists(st.integers(-5, 6000), max_size=60))
def test_holds_is_the_scan_it_replaces(blocks: list[tuple[int, int]], dropped: list[int], probes: list[int]) -> None:
    ranges = PinnedRanges()
    live = dict(_laid_out(blocks))
    for start, end in live.items():
        ranges.add(start, end)
    for i in dropped:
        if live:
            start = sorted(live)[i % len(live)]
            ranges.discard(start)
            del live[start]
    ranges.discard(10**9)  # an unknown start: nothing happens
    assert len(ranges) == len(live)
    for address in probes + [a for s, e in live.items() for a in (s, e - 1, e)]:
        assert ranges.holds(address) == any(s <= address < e for s, e in live.items()), address


def test_a_finalizer_inside_a_writer_is_not_lost() -> None:
    """A block's finalizer may run inside add() through the garbage collector, on the same thread."""
    ranges = PinnedRanges()

    class Block:
        pass

    block = Block()
    cycle = [block]
    cycle.append(cycle)  # only the cycle collector frees it
    weakref.finalize(block, ranges.discard, 100)
    ranges.add(100, 200)
    del block, cycle

    class Collecting(dict):  # type: ignore[type-arg]
        def copy(self) -> dict[int, int]:
            gc.collect()  # the finalizer runs here, inside add's critical section
            return dict(self)

    ranges._ends = Collecting(ranges._ends)
    ranges.add(300, 400)
    assert not ranges.holds(150)
    assert ranges.holds(350) and len(ranges) == 1


def test_readers_on_other_threads_see_a_consistent_answer() -> None:
    ranges = PinnedRanges()
    ranges.add(0, 10)
    stop = threading.Event()
    wrong: list[int] = []

    def read() -> None:
        while not stop.is_set():
            if not ranges.holds(5):
                wrong.append(5)

    reader = threading.Thread(target=read)
    reader.start()
    for start in range(100, 3000, 10):
        ranges.add(start, start + 5)
    for start in range(100, 3000, 10):
        ranges.discard(start)
    stop.set()
    reader.join()
    assert wrong == [] and len(ranges) == 1
