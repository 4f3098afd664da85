"""Closed-form figures of offloading: copy times, prefetch starts, waits, memory sizes.

These are the small formulas the simulator is built from and that the seeds work by
hand; the tests reproduce the seeds' numbers with them and with the simulator::

    >>> transfer_time(256 * 2**20, 32 * 2**30)          # 256 MiB at 32 GiB/s
    0.0078125
    >>> exposed_wait(need_at=12.0, copy_time=8.0, lead=3.0)
    5.0
    >>> utilization(t_compute=0.6, t_transfer=0.4)
    0.6
"""

from __future__ import annotations

import math
from typing import NamedTuple

from offcore.errors import ConfigurationError

__all__ = [
    "transfer_time",
    "prefetch_start",
    "CopyWindow",
    "copy_window",
    "exposed_wait",
    "utilization",
    "activation_bytes",
    "checkpoint_peak",
    "adam_state_bytes",
    "copy_lower_bound",
    "two_hop_transfer_time",
]


def _non_negative(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ConfigurationError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def _positive(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def transfer_time(nbytes: float, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds to copy ``nbytes`` at ``bandwidth`` bytes/s plus a fixed ``latency``.

    An infinite bandwidth leaves only the latency.

    >>> transfer_time(10, 2, latency=1)
    6.0
    """
    nbytes = _non_negative(nbytes, "nbytes")
    bandwidth = _positive(bandwidth, "bandwidth")
    latency = _non_negative(latency, "latency")
    return latency + (0.0 if math.isinf(bandwidth) else nbytes / bandwidth)


def prefetch_start(t_need: float, nbytes: float, bandwidth: float, margin: float = 0.0) -> float:
    """Deadline-driven prefetch start: ``t_need − nbytes/bandwidth − margin``.

    >>> prefetch_start(10.0, 5.0, 1.0, 0.0)        # 10 − 5 − 0
    5.0
    """
    return float(t_need) - transfer_time(nbytes, bandwidth) - _non_negative(margin, "margin")


class CopyWindow(NamedTuple):
    """A copy started ``lead`` before its use: when it starts, lands, and the wait it causes."""

    start: float
    done: float
    wait: float


def copy_window(need_at: float, copy_time: float, lead: float) -> CopyWindow:
    """Start, completion and exposed wait of a copy started ``lead`` before ``need_at``.

    >>> copy_window(need_at=12.0, copy_time=8.0, lead=3.0)
    CopyWindow(start=9.0, done=17.0, wait=5.0)
    """
    copy_time = _non_negative(copy_time, "copy_time")
    lead = _non_negative(lead, "lead")
    start = float(need_at) - lead
    done = start + copy_time
    return CopyWindow(start, done, max(0.0, done - float(need_at)))


def exposed_wait(need_at: float, copy_time: float, lead: float) -> float:
    """Wait on the compute stream when a ``copy_time`` copy starts ``lead`` before use.

    >>> exposed_wait(need_at=12.0, copy_time=16.0, lead=12.0)
    4.0
    """
    return copy_window(need_at, copy_time, lead).wait


def utilization(t_compute: float, t_transfer: float) -> float:
    """``U = T_compute / (T_compute + T_transfer)``, where ``T_transfer`` is the *exposed* copy time.

    >>> utilization(6.0, 4.0)
    0.6
    """
    t_compute = _non_negative(t_compute, "t_compute")
    t_transfer = _non_negative(t_transfer, "t_transfer")
    total = t_compute + t_transfer
    return 1.0 if total == 0 else t_compute / total


def activation_bytes(batch: int, layers: int, seq: int, hidden: int, dtype_bytes: int = 2) -> int:
    """The seeds' first-order activation estimate ``M_act = B·L·S·H·dtype_bytes``.

    One hidden-sized tensor per token per layer; real layers save more (see
    :func:`offcore.sim.transformer.transformer_saved_bytes`).

    >>> activation_bytes(8, 32, 4096, 4096)
    8589934592
    """
    for name, value in (
        ("batch", batch),
        ("layers", layers),
        ("seq", seq),
        ("hidden", hidden),
        ("dtype_bytes", dtype_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(f"{name} must be a non-negative integer, got {value!r}")
    return batch * layers * seq * hidden * dtype_bytes


def checkpoint_peak(param_bytes: int, interval: int, layer_bytes: int) -> int:
    """Peak with checkpoint interval ``K``: ``M_peak = M_param + K·A_layer``.

    The recomputed segment's activations are the only ones on device at the peak (the
    checkpoints themselves are neglected, as in the seeds).

    >>> checkpoint_peak(1000, 4, 10)
    1040
    """
    for name, value in (("param_bytes", param_bytes), ("interval", interval), ("layer_bytes", layer_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(f"{name} must be a non-negative integer, got {value!r}")
    return param_bytes + interval * layer_bytes


def adam_state_bytes(n_params: int | float, dtype_bytes: int = 4, moments: int = 2) -> int:
    """Bytes of Adam's moment estimates: ``n_params · moments · dtype_bytes``.

    >>> adam_state_bytes(1e8)          # 1e8 parameters, FP32, two moments: 800 MB
    800000000
    """
    if (
        isinstance(n_params, bool)
        or not isinstance(n_params, (int, float))
        or n_params < 0
        or n_params != int(n_params)
    ):
        raise ConfigurationError(f"n_params must be a non-negative whole number, got {n_params!r}")
    return int(n_params) * moments * dtype_bytes


def copy_lower_bound(
    d2h_bytes: float,
    h2d_bytes: float,
    d2h_bandwidth: float,
    h2d_bandwidth: float | None = None,
    *,
    duplex: bool = False,
) -> float:
    """Least time to move the bytes, with no compute at all to hide behind.

    One shared link serialises both directions: ``(D2H + H2D) / BW``; a duplex link
    runs them at once but each object must leave before it can return, so the bound is
    the larger of the two directions.

    >>> gib = 2**30
    >>> copy_lower_bound(2.5 * gib, 2.5 * gib, 32 * gib)      # shared link: 156.25 ms
    0.15625
    """
    h2d_bandwidth = d2h_bandwidth if h2d_bandwidth is None else h2d_bandwidth
    d2h = transfer_time(d2h_bytes, d2h_bandwidth)
    h2d = transfer_time(h2d_bytes, h2d_bandwidth)
    return max(d2h, h2d) if duplex else d2h + h2d


def two_hop_transfer_time(
    nbytes: float,
    first_bandwidth: float,
    second_bandwidth: float,
    *,
    chunk: float | None = None,
    latency: float = 0.0,
) -> float:
    """Seconds to move ``nbytes`` over two links in series (NVMe → host → device), staged in ``chunk`` s.

    Without staging (``chunk`` None or ≥ ``nbytes``) the hops add up. With ``k`` chunks the
    hops overlap: the first chunk crosses both, the other ``k − 1`` are paced by the slower
    hop — ``t1 + t2 + (k − 1) · max(t1, t2)`` for per-chunk times ``t1``, ``t2`` (the last
    chunk may be smaller) — plus ``latency`` once per hop.

    >>> gib = 2**30
    >>> two_hop_transfer_time(gib, 2 * gib, 32 * gib)                     # 0.5 s + 1/32 s
    0.53125
    >>> two_hop_transfer_time(gib, 2 * gib, 32 * gib, chunk=64 * 2**20)   # ≈ the NVMe hop alone
    0.501953125
    """
    nbytes = _non_negative(nbytes, "nbytes")
    latency = _non_negative(latency, "latency")
    if chunk is None or chunk >= nbytes or nbytes == 0:
        return transfer_time(nbytes, first_bandwidth, latency) + transfer_time(nbytes, second_bandwidth, latency)
    chunk = _positive(chunk, "chunk")
    full, rest = divmod(nbytes, chunk)
    sizes = [chunk] * int(full) + ([rest] if rest else [])
    t1 = [transfer_time(s, first_bandwidth) for s in sizes]
    t2 = [transfer_time(s, second_bandwidth) for s in sizes]
    # flow shop of two machines in order: chunk i enters hop 2 when it left hop 1 and hop 2 is free
    end1 = end2 = 0.0
    for a, b in zip(t1, t2, strict=True):
        end1 += a
        end2 = max(end2, end1) + b
    return 2 * latency + end2
