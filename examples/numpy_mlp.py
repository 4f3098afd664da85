"""Embedding offcore's core in another framework: a numpy MLP whose saved activations move.

A hand-written training loop in plain numpy (no torch anywhere): a small tanh MLP, MSE
loss, SGD, a fixed seed. Its forward saves every layer's input for backward; this file
is the *binding* that hands those saved activations to the core's residency scheduler
(:class:`offcore.residency.ResidencyScheduler`) on the fake device with numpy buffers,
and executes the actions the scheduler returns:

- forward: each saved activation lives in a device buffer; a device-to-host copy to a
  host-pool buffer starts on the D2H stream at once (``produced``, ``register``,
  ``offload_started``); when its event has completed (polled with ``query()``) the
  binding reports ``landed`` and the scheduler answers FREE (drop the device copy) or
  HOLD (backward needs it soon: keep it as a prefetch);
- end of forward and every use in backward are triggers (``forward_ended``, ``used``):
  the scheduler offers PREFETCH actions by deadline (``t_need - bytes/BW - margin`` over
  a serial link) within its byte budget and the device's room, and EVICT actions when the
  budget is short; the binding allocates, copies on the H2D stream and reports
  ``started(key, event)`` or ``refused(key, reason)`` before taking the next action;
- at use, the binding waits for the prefetch's event (a late prefetch) or reloads the
  host copy synchronously (a miss, a stall), then reports ``consumed`` and ``released``
  once backward is done with it; ``backward_ended`` closes the step, and the long-lived
  predictor (:class:`offcore.scheduler.Scheduler`) learns next-use times for the next step.

The same loop runs once without offload; the two must train bit-identically. The script
prints both final losses, the bytes moved each way, the peak device bytes of each run,
prefetch hits / late prefetches / stalls, and exits 1 when any loss or weight differs.

    python examples/numpy_mlp.py [--steps 6] [--layers 6] [--width 256] [--batch 1024] [--sanitize]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import offcore
from offcore.kinds import Kind, Tier
from offcore.objects import State
from offcore.residency import ActionKind, ResidencyScheduler
from offcore.scheduler import BandwidthEstimator, Scheduler

DTYPE = np.float32


# -- the model: plain numpy, no offload ----------------------------------------------------
def init_params(layers: int, width: int, out: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    dims = [width] * layers + [out]
    return [
        (
            (rng.standard_normal((dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(DTYPE),
            np.zeros(dims[i + 1], dtype=DTYPE),
        )
        for i in range(layers)
    ]


def batches(steps: int, batch: int, width: int, out: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed + 1)
    teacher = rng.standard_normal((width, out)).astype(DTYPE) / np.sqrt(width)
    data = []
    for _ in range(steps):
        x = rng.standard_normal((batch, width)).astype(DTYPE)
        data.append((x, np.sin(x @ teacher).astype(DTYPE)))
    return data


def layer_forward(a: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """One layer: ``tanh(a @ w + b)`` written into ``out`` (a device buffer), or linear when ``out`` is None."""
    z = a @ w
    z += b
    if out is None:
        return z
    return np.tanh(z, out=out)


def layer_backward(
    a: np.ndarray, w: np.ndarray, delta: np.ndarray, first: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Gradients of one layer from its saved input ``a`` (a tanh output unless ``first``)."""
    dw = a.T @ delta
    db = delta.sum(axis=0)
    if first:
        return dw, db, None
    return dw, db, (delta @ w.T) * (1 - a * a)


def sgd(params: list[tuple[np.ndarray, np.ndarray]], grads: list[tuple[np.ndarray, np.ndarray]], lr: float) -> None:
    for (w, b), (dw, db) in zip(params, grads, strict=True):
        w -= lr * dw
        b -= lr * db


def device_array(dev: Any, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A device buffer (raw uint8) and the typed array over it, shaped like ``like``."""
    raw = dev.allocate(like.nbytes, Tier.DEVICE)
    return raw, raw.view(like.dtype).reshape(like.shape)


def train_plain(dev: Any, params: list, data: list, lr: float) -> list[float]:
    """The reference: saved activations stay in device memory until backward used them."""
    losses = []
    for x, y in data:
        saved: list[np.ndarray] = []
        _, a = device_array(dev, x)
        a[...] = x  # the batch, moved to the device
        for i, (w, b) in enumerate(params):
            saved.append(a)
            if i < len(params) - 1:
                _, nxt = device_array(dev, np.empty((x.shape[0], w.shape[1]), DTYPE))
                a = layer_forward(a, w, b, nxt)
            else:
                out = layer_forward(a, w, b, None)
        del a
        diff = out - y
        losses.append(float(np.mean(diff * diff)))
        delta = (2.0 / diff.size) * diff
        grads: list[Any] = [None] * len(params)
        for i in reversed(range(len(params))):
            act = saved.pop()  # backward frees each saved activation after its use
            dw, db, delta = layer_backward(act, params[i][0], delta, first=i == 0)
            grads[i] = (dw, db)
            del act
        sgd(params, grads, lr)
    return losses


# -- the binding: saved activations through the residency scheduler ------------------------
@dataclass
class Saved:
    """What the binding keeps for one saved activation (the scheduler knows none of it)."""

    key: int
    shape: tuple[int, ...]
    nbytes: int
    device: np.ndarray | None  # forward's device copy, a held one, or a prefetched / reloaded one
    host: Any  # the host-pool buffer holding the offloaded bytes
    d2h: Any  # the device-to-host copy's event
    h2d: Any = None  # the prefetch's event, while one is in flight or unused
    held: bool = False  # kept on the device when its D2H copy landed (HOLD)
    used: bool = False
    released: bool = False


class Binding:
    """Feeds one step's events to a ResidencyScheduler and executes its actions on the fake device."""

    def __init__(self, dev: Any, pool: Any, predictor: Scheduler, link: BandwidthEstimator, budget: int) -> None:
        self.dev, self.pool = dev, pool
        self.compute = dev.current_stream()
        self.d2h_stream, self.h2d_stream = dev.new_stream(name="d2h"), dev.new_stream(name="h2d")
        self.predictor, self.link, self.budget = predictor, link, budget
        self.stats = {"hits": 0, "late": 0, "stalls": 0, "kept": 0, "held": 0, "evicted": 0, "refused": 0}

    def begin_step(self, t: float) -> None:
        self.sched = ResidencyScheduler(
            self.predictor,
            duration=self.link.duration,
            budget=self.budget,
            device_capacity=self.dev.capacity,
            device_in_use=lambda: self.dev.memory_stats().allocated_bytes,
        )
        self.saved: dict[int, Saved] = {}
        self.sched.forward_began(t)

    # forward -----------------------------------------------------------------------------
    def save(self, key: int, raw: np.ndarray, shape: tuple[int, ...]) -> None:
        """Forward saved ``raw`` (a device buffer) for backward: start its copy to the host."""
        self.sched.produced(key, time.perf_counter())
        self.sched.register(key, Kind.ACTIVATION, raw.nbytes, name=f"layer {key} input")
        host = self.pool.acquire(raw.nbytes)
        self.d2h_stream.wait_stream(self.compute)  # the copy reads what compute wrote
        event = self.dev.copy_(host.view, raw, stream=self.d2h_stream)
        self.sched.offload_started(key, event, Tier.PINNED)
        self.saved[key] = Saved(key, shape, raw.nbytes, raw, host, event)

    def poll(self) -> None:
        """Report every device-to-host copy that has landed; free or hold its device copy."""
        for s in self.saved.values():
            obj = self.sched.objects[s.key]
            if obj.state is State.OFFLOADING and not s.held and s.d2h.query():
                self._landed(s)

    def _landed(self, s: Saved) -> None:
        action = self.sched.landed(s.key, needed=not s.used)
        if action.kind is ActionKind.HOLD:
            self.stats["held"] += 1
            s.held = True
            return
        s.device = None  # FREE: the scheduler moved the object to OFFLOADED (the D2H event completed)
        if s.released:
            self._finish_release(s)

    def forward_ended(self, t: float) -> None:
        self.poll()
        self.execute(self.sched.forward_ended(t))

    # actions -----------------------------------------------------------------------------
    def execute(self, actions: Any) -> None:
        """Carry out the offered actions; each prefetch's outcome is reported before the next is taken."""
        for action in actions:
            s = self.saved[action.key]
            if action.kind is ActionKind.PREFETCH:
                self._prefetch(s)
            elif action.kind is ActionKind.EVICT:
                self._evict(s)

    def _prefetch(self, s: Saved) -> None:
        try:
            raw = self.dev.allocate(s.nbytes, Tier.DEVICE)
        except offcore.CapacityExceededError:
            self.stats["refused"] += 1
            self.sched.refused(s.key, "oom")  # no more speculative copies this round
            return
        self.h2d_stream.wait_stream(self.compute)
        event = self.dev.copy_(raw, s.host.view, stream=self.h2d_stream)
        self.sched.started(s.key, event)
        s.device, s.h2d = raw, event

    def _evict(self, s: Saved) -> None:
        """Drop a held or prefetched device copy (the host copy stays the data)."""
        obj = self.sched.objects[s.key]
        self.stats["evicted"] += 1
        if s.held:  # held on landing: the scheduler moved it to offloaded already
            s.held = False
        elif obj.state is State.PREFETCHING:  # its buffer may be freed only once the copy landed
            s.h2d.synchronize()
            self.sched.dropped(s.key)
            self.sched.drop_landed(s.key)
        s.device, s.h2d = None, None

    # backward ----------------------------------------------------------------------------
    def backward_began(self, t: float) -> None:
        self.sched.backward_began(t)

    def use(self, key: int) -> np.ndarray:
        """The saved activation ``key`` on the device, ordered before the compute that reads it."""
        self.poll()
        s = self.saved[key]
        now = time.perf_counter()
        if s.h2d is not None:  # prefetched: trigger the next prefetches, then wait for this one
            self.execute(self.sched.used(key, now, managed_key=key))
            if s.h2d.query():
                self.stats["hits"] += 1
            else:
                self.stats["late"] += 1
                self.compute.wait_event(s.h2d)
            self.sched.awaited(key)
        elif s.device is not None:  # held on landing, or its D2H copy is still in flight
            self.stats["kept"] += 1
            self.sched.reused(key)
            self.execute(self.sched.used(key, now, managed_key=key))
        else:  # a miss: reload synchronously on the compute stream (a stall)
            self.stats["stalls"] += 1
            raw = self.dev.allocate(s.nbytes, Tier.DEVICE)
            event = self.dev.copy_(raw, s.host.view, stream=self.compute)
            self.compute.wait_event(event)
            s.device = raw
            self.sched.reloaded(key, event)
            self.execute(self.sched.used(key, now, managed_key=key))
        s.used = True
        assert s.device is not None
        return s.device.view(DTYPE).reshape(s.shape)

    def done_with(self, key: int) -> None:
        """Backward is done with ``key``: it was consumed and no record will read it again."""
        s = self.saved[key]
        obj = self.sched.objects[key]
        self.sched.consumed(key)  # a copy held on landing is moved to offloaded by the scheduler
        self.sched.released(key)
        s.released = True
        if obj.state is State.OFFLOADING:  # its D2H copy is still reading the device copy: poll frees it
            return
        s.device = s.h2d = None
        self._finish_release(s)

    def _finish_release(self, s: Saved) -> None:
        self.pool.release(s.host)  # every copy that read or wrote it has landed
        s.host = None
        self.sched.objects[s.key].release()

    def backward_ended(self, t: float) -> None:
        for action in self.sched.backward_ended(t):  # FREE what is still held
            s = self.saved[action.key]  # the scheduler moved it to offloaded: drop the device copy
            s.device = None
        for s in self.saved.values():  # wait for the last device-to-host copies, then free
            if self.sched.objects[s.key].state is State.OFFLOADING:
                s.d2h.synchronize()
                self._landed(s)
        for entry in self.dev.copy_log():  # one link estimator: the next step plans with it
            if entry["direction"] == "h2d":
                self.link.observe(entry["bytes"], entry["end"] - entry["start"])
        self.dev.clear_copy_log()


def train_offloaded(dev: Any, binding: Binding, params: list, data: list, lr: float) -> list[float]:
    """The same loop as :func:`train_plain`, with every saved activation handed to the binding."""
    losses = []
    for x, y in data:
        binding.begin_step(time.perf_counter())
        raw, a = device_array(dev, x)
        a[...] = x
        for i, (w, b) in enumerate(params):
            binding.save(i, raw, a.shape)
            if i < len(params) - 1:
                raw, nxt = device_array(dev, np.empty((x.shape[0], w.shape[1]), DTYPE))
                a = layer_forward(a, w, b, nxt)
            else:
                out = layer_forward(a, w, b, None)
            binding.poll()
        del raw, a
        binding.forward_ended(time.perf_counter())
        diff = out - y
        losses.append(float(np.mean(diff * diff)))
        delta = (2.0 / diff.size) * diff
        grads: list[Any] = [None] * len(params)
        binding.backward_began(time.perf_counter())
        for i in reversed(range(len(params))):
            act = binding.use(i)
            dw, db, delta = layer_backward(act, params[i][0], delta, first=i == 0)
            grads[i] = (dw, db)
            del act
            binding.done_with(i)
        binding.backward_ended(time.perf_counter())
        sgd(params, grads, lr)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bandwidth", default="1GiB/s", help="the fake link's speed, each direction")
    parser.add_argument("--budget", type=int, default=2, help="prefetch budget, in activations")
    parser.add_argument(
        "--sanitize", action="store_true", help="poison in-flight buffers: a missing wait or early free gives NaNs"
    )
    args = parser.parse_args(argv)

    out_dim = 16
    data = batches(args.steps, args.batch, args.width, out_dim, args.seed)
    options = dict(
        buffers="numpy",
        capacity="256MiB",
        h2d_bandwidth=args.bandwidth,
        d2h_bandwidth=args.bandwidth,
        sanitize=args.sanitize,
    )

    dev = offcore.device("cpu", **options)
    ref_params = dev.adopt(init_params(args.layers, args.width, out_dim, args.seed))
    ref_losses = train_plain(dev, ref_params, data, args.lr)
    ref_peak = dev.memory_stats().peak_allocated_bytes
    dev.close()

    dev = offcore.device("cpu", **options)
    params = dev.adopt(init_params(args.layers, args.width, out_dim, args.seed))
    act_bytes = args.batch * args.width * np.dtype(DTYPE).itemsize
    binding = Binding(dev, dev.host_pool("64MiB"), Scheduler(), BandwidthEstimator(), budget=args.budget * act_bytes)
    t0 = time.perf_counter()
    losses = train_offloaded(dev, binding, params, data, args.lr)
    seconds = time.perf_counter() - t0
    peak = dev.memory_stats().peak_allocated_bytes
    copies = dev.ledger.snapshot()["copies"]
    violations = dev.sanitizer_violations()
    dev.close()

    same_losses = losses == ref_losses
    same_weights = all(
        np.array_equal(w, rw) and np.array_equal(b, rb) for (w, b), (rw, rb) in zip(params, ref_params, strict=True)
    )
    moved = {d: copies.get(d, {}).get("bytes", 0) for d in ("d2h", "h2d")}
    s = binding.stats
    print(f"steps {args.steps}, {args.layers} layers of {args.width}, batch {args.batch}, link {args.bandwidth}")
    print(f"final loss without offload: {ref_losses[-1]!r}")
    print(f"final loss with offload:    {losses[-1]!r}")
    print(f"bytes moved: d2h {moved['d2h']} h2d {moved['h2d']}")
    print(f"peak device bytes: without offload {ref_peak} with offload {peak}")
    print(
        f"uses: prefetch hits {s['hits']} late prefetches {s['late']} stalls {s['stalls']} "
        f"still on device {s['kept']} (held on landing {s['held']}, evicted {s['evicted']}, refused {s['refused']})"
    )
    print(f"offloaded run: {seconds:.3f} s")
    if violations:
        print(f"SANITIZER: {len(violations)} violation(s), first: {violations[0]['message']}", file=sys.stderr)
        return 1
    if not (same_losses and same_weights):
        print("MISMATCH: the offloaded run did not train bit-identically", file=sys.stderr)
        return 1
    print("bit-identical: losses and weights match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
