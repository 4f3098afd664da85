"""The sanitizer reports torch operators on the host that touch bytes of a copy in flight.

Note [Operators checked against copies in flight] in ``offcore_cpu.sanitizer``: with
``sanitize=True`` and torch buffers a dispatch mode checks every operator's arguments
(written: ``Tensor(a!)``; read: any other tensor argument but views and metadata) against
the copies in flight; an operator that reads bytes a copy writes, or writes bytes a copy
reads or writes, is an ``access-in-flight`` violation. Each race is made certain with a
gate (Note [Gates]), never with timing. Note [One checking mode per thread, at the bottom of
its stack] in ``offcore_cpu.op_check``: how the mode composes with other modes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from offcore_cpu.errors import SanitizerViolation  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from offcore import Tier  # noqa: E402

KiB = 1024


@pytest.fixture
def make_device(make_checked_device: Any) -> Iterator[Any]:
    yield functools.partial(make_checked_device, sanitize=True, buffers="torch")
    make_checked_device.close_all()  # before the check below (the fixture's own close_all then finds none)
    assert torch._C._len_torch_dispatch_stack() == 0, "closing the devices pops their checking mode"


def device_tensor(dev: Any, n: int = 256) -> Any:
    with dev:
        return torch.arange(n, dtype=torch.float32)


def accesses(dev: Any) -> list[tuple[str, str, str]]:
    """(op, access, side) of each access-in-flight violation, forgotten afterwards."""
    found = dev.sanitizer_violations(clear=True)
    assert all(v["kind"] == "access-in-flight" for v in found), found
    return [(v["op"], v["access"], v["side"]) for v in found]


def test_reading_an_upload_destination_in_flight_is_reported_naming_op_tensor_copy_and_streams(
    make_device: Any,
) -> None:
    dev = make_device()
    h2d = dev.new_stream(name="h2d")
    param, host = device_tensor(dev), torch.full((256,), 7.0)
    with dev.gate(h2d) as gate:
        done = dev.copy_(param, host, stream=h2d)
        gate.wait_held(1)
        ema = param * 0.1  # the race: the upload has not landed
    done.synchronize()
    assert torch.isnan(ema).all(), "the poisoned destination was read"
    (violation,) = dev.sanitizer_violations()
    assert violation["kind"] == "access-in-flight"
    assert (violation["op"], violation["argument"], violation["access"]) == (
        "aten.mul.Tensor",
        "argument 'self'",
        "read",
    )
    assert (violation["copy"], violation["direction"], violation["side"]) == (1, "h2d", "destination")
    assert violation["stream"] == "h2d" and "MainThread" in violation["op_stream"]
    assert violation["tensor"] == "float32[256], bytes 0..1024 of its storage"
    for words in ("aten.mul.Tensor", "copy #1 (h2d, 1024 bytes, stream 'h2d')", "compute stream", "still writes"):
        assert words in violation["message"], violation["message"]
    with pytest.raises(SanitizerViolation, match=r"\[access-in-flight\] operator aten.mul.Tensor"):
        dev.check_sanitizer()
    # ordered by the program: the same read after the host observed the copy is fine
    assert torch.equal(param * 1, host)
    assert dev.sanitizer_violations() == []


@pytest.mark.parametrize("wait", ["event.synchronize", "compute.wait_event", "stream.synchronize", "dev.synchronize"])
def test_a_read_after_a_wait_that_orders_it_is_not_reported(make_device: Any, wait: str) -> None:
    dev = make_device()
    h2d = dev.new_stream()
    param, host = device_tensor(dev), torch.full((256,), 7.0)
    with dev.gate(h2d) as gate:
        done = dev.copy_(param, host, stream=h2d)
        gate.wait_held(1)
        param.sum()  # unordered: reported
    {
        "event.synchronize": done.synchronize,
        "compute.wait_event": lambda: dev.current_stream().wait_event(done),
        "stream.synchronize": h2d.synchronize,
        "dev.synchronize": dev.synchronize,
    }[wait]()
    assert accesses(dev) == [("aten.sum.default", "read", "destination")]
    assert float(param.sum()) == 7.0 * 256
    assert accesses(dev) == []


def test_writing_an_upload_destination_in_flight_is_reported(make_device: Any) -> None:
    dev = make_device()
    h2d = dev.new_stream()
    param, host = device_tensor(dev), torch.ones(256)
    with dev.gate(h2d) as gate:
        dev.copy_(param, host, stream=h2d)
        gate.wait_held(1)
        with torch.no_grad():
            param.mul_(0.9)  # an EMA update of a parameter still being uploaded
        torch.add(host[128:], 1, out=param[128:])  # out= writes too
    dev.synchronize()
    assert accesses(dev) == [("aten.mul_.Tensor", "write", "destination"), ("aten.add.out", "write", "destination")]


def test_a_download_source_overwritten_in_flight_is_reported_and_read_concurrently_is_not(make_device: Any) -> None:
    dev = make_device()
    d2h = dev.new_stream()
    activation, host = device_tensor(dev), dev.allocate(1 * KiB, Tier.PINNED).view(torch.float32)
    with dev.gate(d2h) as gate:
        done = dev.copy_(host, activation, stream=d2h)
        gate.wait_held(1)
        total = activation.sum()  # both read: fine
        torch._foreach_add_([activation], 1.0)  # in place over bytes the download still reads
    done.synchronize()
    assert float(total) == sum(range(256))
    assert accesses(dev) == [("aten._foreach_add_.Scalar", "write", "source")]


def test_bytes_outside_the_copy_views_and_metadata_are_not_accesses(make_device: Any) -> None:
    """Only bytes the copy moves count; views, ``*_like`` factories and metadata ops read none."""
    dev = make_device()
    h2d = dev.new_stream()
    storage = device_tensor(dev, 512)
    param, other = storage[:256], storage[256:]
    with dev.gate(h2d) as gate:
        dev.copy_(param, torch.ones(256), stream=h2d)
        gate.wait_held(1)
        other.add_(1)  # same storage, other bytes
        view = param.view(16, 16).t().detach()
        torch.zeros_like(param), param.new_empty(4), torch.empty_like(view)
        assert param.shape == (256,) and view.stride() == (1, 16)
        float(param[0])  # ... and the one that is read
    dev.synchronize()
    assert accesses(dev) == [("aten._local_scalar_dense.default", "read", "destination")]


def test_check_ops_false_and_numpy_buffers_check_nothing(make_device: Any) -> None:
    dev = make_device(check_ops=False)
    assert torch._C._len_torch_dispatch_stack() == 0, "no mode without check_ops"
    h2d = dev.new_stream()
    param = device_tensor(dev)
    with dev.gate(h2d) as gate:
        dev.copy_(param, torch.ones(256), stream=h2d)
        gate.wait_held(1)
        param.sum()
    dev.synchronize()
    assert dev.sanitizer_violations() == []
    make_device(buffers="numpy")
    assert torch._C._len_torch_dispatch_stack() == 0, "numpy buffers: no torch operator to check"
    checked = make_device()
    assert checked.options.check_ops and torch._C._len_torch_dispatch_stack() == 1, "on by default with sanitize"


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_mode_nests_under_user_modes_and_fake_tensors(make_device: Any) -> None:
    """Note [One checking mode per thread, at the bottom of its stack]: modes entered later run above it
    and pop themselves; fake tensors pass through; a device made under a user mode checks inside ``with dev:``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = make_device()
    h2d = dev.new_stream()
    param = device_tensor(dev)
    with dev.gate(h2d) as gate:
        dev.copy_(param, torch.ones(256), stream=h2d)
        gate.wait_held(1)
        with _Counting() as user:
            param.sum()
        with FakeTensorMode() as fake_mode:
            fake = fake_mode.from_tensor(param)
            (fake * 2).sum()
    dev.synchronize()
    assert user.ops == ["aten.sum.default"]
    assert accesses(dev) == [("aten.sum.default", "read", "destination")]  # seen below the user's mode
    assert torch._C._len_torch_dispatch_stack() == 1

    def elsewhere() -> None:  # a thread without the mode
        with _Counting():
            inner = make_device()  # under a user mode: not pushed at creation (it would pop the user's mode)
            depths.append(torch._C._len_torch_dispatch_stack())
            with inner:
                depths.append(torch._C._len_torch_dispatch_stack())  # ... but on entry, popped on exit
            depths.append(torch._C._len_torch_dispatch_stack())
            inner.close()
        depths.append(torch._C._len_torch_dispatch_stack())

    depths: list[int] = []
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert depths == [1, 2, 1, 0]
    assert torch._C._len_torch_dispatch_stack() == 1


@pytest.mark.slow
def test_torch_compile_still_compiles_with_the_mode_and_its_runtime_operators_are_checked(make_device: Any) -> None:
    """``ignore_compile_internals``: dynamo compiles with the mode on the stack (it skips frames under other
    Python dispatch modes); the compiled graph's operators (eager backend) are checked at run time."""
    import torch._dynamo

    dev = make_device()
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def f(x: Any) -> Any:
        return (x.sin() * 2).sum()

    h2d = dev.new_stream()
    param = device_tensor(dev, 64)
    with dev.gate(h2d) as gate:
        dev.copy_(param, torch.ones(64), stream=h2d)
        gate.wait_held(1)
        f(param)
    dev.synchronize()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "dynamo compiled the frame"
    assert accesses(dev) == [("aten.sin.default", "read", "destination")]
    torch._dynamo.reset()
