"""Tensor subclasses into every entry point: a correct result or a clear offcore error, never a crash.

A raw path (a ``memmove`` by address, a pool slice, a disk read into a tensor's memory) that
is handed a tensor whose address and size are not its own bytes writes or reads memory it
does not own: a DTensor's ``numel()`` is the global size while its memory is the local
shard, a wrapper subclass reports ``data_ptr() == 0``, a meta tensor has no memory
(Note [Raw pointers see checked tensors only]). Each case here passes one kind of such
tensor -- a DTensor (on a fake process group, in this process), nested tensors (strided and
jagged), a user ``__torch_dispatch__`` wrapper, torchao's subclasses when importable, meta and
fake tensors -- into ``Backend.copy_`` (either side), ``OffloadOptimizer``,
``offload_parameters``, ``offload_activations`` and the NVMe tier. A case passes when the call
returns the numbers torch computes without offcore, or raises an :class:`offcore.OffcoreError`
that says what was wrong; a segfault kills the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

import offcore  # noqa: E402


class Wrapper(torch.Tensor):
    """A user ``__torch_dispatch__`` wrapper subclass: no storage of its own, the data in ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device, requires_grad=inner.requires_grad
        )
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t.inner if isinstance(t, Wrapper) else t

        def wrap(t: Any) -> Any:
            return Wrapper(t) if isinstance(t, torch.Tensor) and not isinstance(t, Wrapper) else t

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


@contextlib.contextmanager
def _fake_group() -> Iterator[Any]:
    """A one-process fake process group of two ranks (no communication) and its device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - the suite never leaves a group behind
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _dtensor(base: torch.Tensor, stack: contextlib.ExitStack) -> torch.Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    mesh = stack.enter_context(_fake_group())
    return distribute_tensor(base, mesh, [Shard(0)])


def _fake(base: torch.Tensor, stack: contextlib.ExitStack) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(base)


def _torchao(base: torch.Tensor, stack: contextlib.ExitStack) -> torch.Tensor:
    ao = pytest.importorskip("torchao.dtypes")
    return ao.to_affine_quantized_intx(base, mapping_type=None, block_size=(1, base.shape[-1]), target_dtype=torch.int8)


SUBCLASSES: dict[str, Callable[[torch.Tensor, contextlib.ExitStack], torch.Tensor]] = {
    "dtensor": _dtensor,
    "nested_strided": lambda base, _: torch.nested.nested_tensor([base[0], base[1, :3]]),
    "nested_jagged": lambda base, _: torch.nested.nested_tensor([base[0], base[1, :3]], layout=torch.jagged),
    "wrapper": lambda base, _: Wrapper(base.clone()),
    "torchao": _torchao,
    "meta": lambda base, _: torch.empty_like(base, device="meta"),
    "fake": _fake,
}


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="unlimited")


@pytest.fixture(params=sorted(SUBCLASSES))
def odd(request: pytest.FixtureRequest, dev: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)``: a 4 x 8 float32 tensor of one subclass, made on the device."""
    with contextlib.ExitStack() as stack:
        with dev:
            base = torch.randn(4, 8, device=dev.torch_device)
        tensor = SUBCLASSES[request.param](base, stack)
        yield request.param, tensor


def _clear(call: Callable[[], Any]) -> Any:
    """``call()``: its result, or None when it raised an offcore error naming what was wrong."""
    try:
        return call()
    except offcore.OffcoreError as exc:
        assert len(str(exc)) > 40, f"an offcore error must say what was wrong and how to fix it: {exc!r}"
        return None


def test_backend_copy_refuses_or_copies_the_bytes(dev: Any, odd: tuple[str, torch.Tensor]) -> None:
    name, tensor = odd
    stream = dev.new_stream()
    with dev:
        plain = torch.zeros(4, 8, device=dev.torch_device)
    for dst, src in ((plain, tensor), (tensor, plain)):
        event = _clear(lambda dst=dst, src=src: dev.copy_(dst, src, stream=stream))
        if event is not None:
            event.synchronize()
            pytest.fail(f"copy_ accepted a {name} tensor; it must refuse what it cannot copy by address")
    stream.synchronize()


def test_offload_optimizer_refuses_a_subclass_parameter(dev: Any, odd: tuple[str, torch.Tensor]) -> None:
    name, tensor = odd
    with dev:
        plain = torch.nn.Parameter(torch.randn(4, 8, device=dev.torch_device))
        param = torch.nn.Parameter(tensor) if name != "nested_jagged" else tensor
        opt = _clear(lambda: offcore_torch.OffloadOptimizer([plain, param], torch.optim.AdamW, device=dev))
    assert opt is None, f"OffloadOptimizer accepted a {name} parameter"
    if name == "dtensor":
        with pytest.raises(offcore.ConfigurationError, match="FSDPOffloadOptimizer"):
            offcore_torch.OffloadOptimizer([param], torch.optim.AdamW, device=dev)


def test_offload_parameters_refuses_or_keeps_the_numbers(dev: Any, odd: tuple[str, torch.Tensor]) -> None:
    name, tensor = odd
    with dev:
        model = torch.nn.Linear(8, 8).to(dev.torch_device)
        model.weight = torch.nn.Parameter(tensor, requires_grad=False) if name != "nested_jagged" else None
    if model.weight is None:
        pytest.skip("a jagged nested tensor cannot be an nn.Parameter")
    handle = _clear(lambda: offcore_torch.offload_parameters(model, dev, budget="1MiB"))
    if handle is None:
        return
    handle.remove()
    pytest.fail(f"offload_parameters accepted a {name} parameter it cannot stream")


def test_offload_activations_keeps_the_numbers_or_refuses(dev: Any, odd: tuple[str, torch.Tensor]) -> None:
    name, tensor = odd
    if name in ("meta", "fake"):
        leaf = tensor.detach().requires_grad_()
    else:
        leaf = tensor.detach().clone().requires_grad_()

    def run(offload: bool) -> Any:
        with dev:
            region = offcore_torch.offload_activations(dev, min_bytes=0) if offload else contextlib.nullcontext()
            try:
                with region:
                    out = (leaf * leaf) * leaf
                    loss = out.sum() if not out.is_nested else out.values().sum()
                loss.backward()
            except offcore.OffcoreError:
                raise
            except Exception as exc:  # torch itself refuses this subclass: offcore must not be asked then
                return ("torch", type(exc).__name__)
            grad = leaf.grad
            leaf.grad = None
            offcore_torch.synchronize(dev)
            return grad

    expected = run(False)
    got = _clear(lambda: run(True))
    if got is None or isinstance(expected, tuple):
        return
    for a, b in ((got, expected),):
        if name == "dtensor":
            a, b = a.to_local(), b.to_local()
        elif name.startswith("nested"):
            a, b = (
                a.values() if a.is_nested and name == "nested_jagged" else a,
                b.values() if name == "nested_jagged" else b,
            )
            a, b = torch.cat([t.flatten() for t in a.unbind()]), torch.cat([t.flatten() for t in b.unbind()])
        elif name == "wrapper":
            a, b = a.inner, b.inner
        elif name in ("meta", "fake"):
            assert a.shape == b.shape
            continue
        elif name == "torchao":
            a, b = a.dequantize(), b.dequantize()
        assert torch.equal(a, b), f"offload_activations changed the gradient of a {name} tensor"


def test_the_nvme_tier_refuses_a_subclass_buffer(tmp_path: Any, odd: tuple[str, torch.Tensor]) -> None:
    from offcore.nvme import NvmeSpec

    name, tensor = odd
    tier = NvmeSpec(str(tmp_path), "16MiB").open()
    try:
        handle = _clear(lambda: tier.write("k", tensor))
        assert handle is None, f"the NVMe tier accepted a {name} tensor as a buffer"
        import numpy as np

        tier.write("k", np.arange(32, dtype=np.float32)).synchronize()
        assert _clear(lambda: tier.read("k", tensor)) is None, f"the NVMe tier read into a {name} tensor"
    finally:
        tier.close()
