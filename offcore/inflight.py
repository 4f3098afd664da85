"""The cap on device-to-host copies in flight: one rule for every kind, and for the simulator.

A device copy that offcore moves off the device is held from its device-to-host copy's start
until that copy landed (Note [When may a device copy be freed?] in offcore/objects.py). When the
program makes such bytes faster than the link moves them, the held copies pile up and the device
peak depends on the link's speed and the machine's load. The bindings cap them:

    >>> from offcore.inflight import copies_to_land, must_wait
    >>> must_wait(held=3 << 20, nbytes=2 << 20, cap=4 << 20)     # 3 MiB in flight + 2 > 4
    True
    >>> must_wait(held=0, nbytes=8 << 20, cap=4 << 20)           # nothing in flight: it goes
    False
    >>> copies_to_land(4 << 20, 2 << 20, [1 << 20, 1 << 20, 1 << 20])   # the oldest must land first
    1
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["DEFAULT_MAX_INFLIGHT", "copies_to_land", "must_wait"]

# Note [Copies in flight are capped]
# Before a device-to-host copy of ``nbytes`` starts, while the bytes already in flight (``held``)
# plus ``nbytes`` exceed the cap, the thread that would start it waits for the OLDEST copy in flight
# (a copy stream runs in order, so it lands first), hands the landing on (the device copy is freed),
# and asks again; never a sleep. A copy is always let through when nothing is in flight, so a cap
# below one copy (0 included) means "one at a time", and the bytes held never exceed
# max(cap, the largest copy). Waiting before the copy costs no overlap: on an in-order stream it
# would queue behind the oldest anyway. The rule is this module's; who applies it:
# - saved activations: ``offload_activations(max_inflight=)``, the device's copies of every region
#   together (Note [Activation copies in flight are capped] in plugins/offcore_torch/activations/copies.py);
# - gradients: ``OffloadOptimizer(max_inflight_gradients=)`` (Note [In-flight gradients are capped]
#   in plugins/offcore_torch/optimizer/optimizer.py);
# - the simulator: ``Plan.max_inflight`` stalls a simulated forward at a save the same way (Note
#   [The simulator caps forward's copies in flight] in offcore/sim/simulator.py).
DEFAULT_MAX_INFLIGHT = 256 * 1024**2  # offload_activations' and Plan's default cap


def must_wait(held: int, nbytes: int, cap: int | None) -> bool:
    """Whether a copy of ``nbytes`` must wait for the oldest copy in flight before it starts
    (Note [Copies in flight are capped]): ``held`` bytes are in flight; ``cap`` None is no cap.

        >>> must_wait(held=1, nbytes=1, cap=None)
        False
    """
    return cap is not None and held > 0 and held + nbytes > cap


def copies_to_land(cap: int | None, nbytes: int, in_flight: Iterable[int]) -> int:
    """How many of the copies in flight (their bytes, oldest first) must land before a copy of
    ``nbytes`` may start under ``cap``: :func:`must_wait` applied until it lets the copy through.

        >>> copies_to_land(0, 5, [5, 5])      # cap 0: one copy at a time
        2
    """
    sizes = list(in_flight)
    held = sum(sizes)
    landed = 0
    while must_wait(held, nbytes, cap):
        held -= sizes[landed]
        landed += 1
    return landed
