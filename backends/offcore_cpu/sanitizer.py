"""The fake device's sanitizer: make a missing wait give wrong numbers, not lucky ones.

On a CPU, a copy that a program forgot to wait for usually lands long before anyone
reads the buffer, so the bug passes every test and corrupts gradients on a GPU. With
``sanitize=True`` the fake device makes such races visible:

# Note [What the sanitizer poisons, and when]
# Poison is 0xFF in every byte: NaN for floating point, -1 for integers.
# 1. A copy's destination is poisoned when its stream *reaches* the copy, and holds
#    poison until the data lands (after the latency and the jitter below). Poisoning at
#    the stream's pace, not at enqueue time, keeps stream-ordered reuse correct: a copy
#    queued behind another that still reads the same buffer does not corrupt it.
# 2. Memory that is new but uninitialised is poisoned, as reused device memory holds
#    stale bytes on a real allocator: ``allocate(..)`` buffers of every tier, and (torch)
#    the outputs of ``empty``-family operators run while the device is active.
# 3. Released memory is poisoned: host-pool buffers when they return to the pool
#    (``dev.host_pool``), and any buffer a binding hands to ``dev.poison`` when it is
#    done with it.
# 4. Every copy that crosses the link is delayed by a random extra 0..jitter seconds
#    (seeded by ``seed``; drawn at enqueue on the calling thread, so a run is
#    reproducible), so a read that only works because copies are fast stops working.
# A correct program (every read of a copy's destination ordered after the copy's
# event) gives bit-identical results with the sanitizer on or off.

    >>> sanitizer = Sanitizer(enabled=True, seed=0, jitter=2e-3)
    >>> 0.0 <= sanitizer.draw_jitter() <= 2e-3
    True
"""

from __future__ import annotations

import random
import threading

__all__ = ["Sanitizer"]


class Sanitizer:
    """Switch and random source of the sanitizer (see Note [What the sanitizer poisons, and when])."""

    def __init__(self, *, enabled: bool, seed: int, jitter: float) -> None:
        self.enabled = enabled
        self.jitter = jitter
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def draw_jitter(self) -> float:
        """Extra delay for the next copy in seconds (0 when the sanitizer is off)."""
        if not self.enabled or self.jitter <= 0:
            return 0.0
        with self._lock:
            return self._random.uniform(0.0, self.jitter)
