"""Restore fidelity: a saved tensor comes back from the host copy exactly as forward saved it.

offcore copies a saved tensor's whole storage to the host and rebuilds the tensor as a
view of the restored storage (``offcore_torch.activations.storage.TensorMeta``). Every case here saves
tensors under ``offload_activations(dev, min_bytes=0)`` (so even a one-byte storage is
offloaded), lets the copy land and the device storage die, so backward must read the
host copy, and checks in backward that each unpacked tensor has the dtype, shape, stride,
storage offset, conj and neg bits, storage size and bits of the one forward saved. Where
autograd differentiates the dtype, a small graph whose backward reads the saved tensor
must also give gradients bit-identical to the same graph without offload. Layouts offcore
does not offload (sparse, quantized, nested) are kept on the device, and still come back
right.

Every dtype torch defines is covered (enumerated from the ``torch`` namespace, so a dtype
a new torch adds is tested without editing this file); values are random bytes, so
floating-point dtypes also carry NaN, infinity and subnormal bit patterns, compared bit
for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device, settle  # noqa: E402

# torch's notes on its experimental layouts and dtypes, not about offcore
pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*deprecated"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype"),
]


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


# ------------------------------------------------------------------------------ checking
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def storage_bytes(tensor: Any) -> Any:
    """Every byte of ``tensor``'s storage, as a new uint8 tensor."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    return raw.clone()


def value_bits(tensor: Any) -> Any:
    """The tensor's element values (lazy conj/neg applied) as same-width integers: exact, NaN-safe."""
    values = tensor.resolve_conj().resolve_neg()
    if values.element_size() == 16:  # complex128: (real, imag) pairs of float64
        values = torch.view_as_real(values)
    return values.view(_SAME_WIDTH[values.element_size()]).clone()


@dataclass
class Saved:
    """What a saved tensor looked like: metadata, the bytes of its storage and its values' bits."""

    meta: tuple[Any, ...]
    storage: Any
    values: Any

    @staticmethod
    def of(tensor: Any) -> Saved:
        meta = (
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.is_conj(),
            tensor.is_neg(),
            tensor.device,
            tensor.untyped_storage().nbytes(),
        )
        return Saved(meta, storage_bytes(tensor), value_bits(tensor))


_META_NAMES = ("dtype", "shape", "stride", "storage_offset", "is_conj", "is_neg", "device", "storage bytes")


def assert_restored_exactly(got: Saved, expected: Saved, what: str) -> None:
    for name, g, e in zip(_META_NAMES, got.meta, expected.meta, strict=True):
        assert g == e, f"{what}: {name} came back as {g}, forward saved {e}"
    assert torch.equal(got.storage, expected.storage), f"{what}: the storage's bytes changed"
    assert torch.equal(got.values, expected.values), f"{what}: the values' bits changed"


class Keep(torch.autograd.Function):
    """Saves ``tensors`` (which need no gradient) for backward; backward records them in ``sink``."""

    @staticmethod
    def forward(ctx: Any, sink: list[Any], record: Callable[[Any], Any], anchor: Any, *tensors: Any) -> Any:
        ctx.sink, ctx.record = sink, record
        ctx.save_for_backward(*tensors)
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        saved = ctx.saved_tensors  # once: a second access would reload storages that died meanwhile
        ctx.sink.extend(ctx.record(t) for t in saved)
        return (None, None, grad) + (None,) * len(saved)


def unique_storage_bytes(tensors: Sequence[Any]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def save_and_restore(dev: Any, make: Callable[[], Sequence[Any]], record: Callable[[Any], Any] = Saved.of) -> Any:
    """Save ``make()``'s tensors through :class:`Keep` with every storage offloaded; backward reads the host copies.

    Returns ``(expected, restored, stats)``: ``record`` of each tensor before the save and in backward.
    """
    restored: list[Any] = []
    with dev:
        anchor = torch.zeros(2, device=dev.torch_device, requires_grad=True)
        tensors = tuple(make())
        expected = [record(t) for t in tensors]
        with offcore_torch.offload_activations(dev, min_bytes=0) as handle:
            out = Keep.apply(restored, record, anchor, *tensors)
            settle(dev)  # the copies landed and offcore let go of the device storages
        del tensors  # the last references: backward must bring the storages back from the host
        out.sum().backward()
    assert torch.equal(anchor.grad, torch.ones_like(anchor))
    return expected, restored, handle.stats()


def random_tensor(dtype: Any, shape: tuple[int, ...], device: Any) -> Any:
    """Random bytes viewed as ``dtype`` (every bit pattern; bool gets 0 or 1), made on the device."""
    numel = 1
    for size in shape:
        numel *= size
    width = torch.empty(0, dtype=dtype).element_size()
    high = 2 if dtype is torch.bool else 256
    raw = torch.randint(0, high, (numel * width,), dtype=torch.uint8, device=device)
    return raw.view(dtype).view(shape)


# ------------------------------------------------------------------------------ dtypes
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
PLAIN_DTYPES = [d for d in ALL_DTYPES if d not in QUANTIZED]
DIFFERENTIABLE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def dtype_id(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def test_the_dtype_list_covers_what_the_issue_names() -> None:
    named = {torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.bfloat16, torch.float16}
    named |= {torch.complex32, torch.complex64, torch.complex128}
    named |= {getattr(torch, n) for n in dir(torch) if n.startswith("float8_")}
    assert named <= set(PLAIN_DTYPES)
    assert QUANTIZED <= set(ALL_DTYPES)


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=dtype_id)
def test_every_dtype_comes_back_bit_exact(dev: Any, dtype: Any) -> None:
    """One storage saved as a whole, as a transposed slice with an offset and as a 0-dim element."""
    torch.manual_seed(0)

    def make() -> tuple[Any, ...]:
        t = random_tensor(dtype, (4, 6), dev.torch_device)
        return t, t[1:, ::2].t(), t[2, 3]

    expected, restored, stats = save_and_restore(dev, make)
    for what, got, want in zip(("whole", "strided view", "0-dim element"), restored, expected, strict=True):
        assert_restored_exactly(got, want, f"{dtype_id(dtype)} {what}")
    assert stats.offloaded_storages == 1 and stats.offloaded_tensors == 3, stats
    assert stats.reloaded_bytes == expected[0].storage.numel(), stats
    assert stats.reused_live_bytes == 0, "the restore should have come back from the host copy"


@pytest.mark.parametrize("dtype", sorted(QUANTIZED, key=str), ids=dtype_id)
def test_quantized_tensors_are_kept_and_come_back_unchanged(dev: Any, dtype: Any) -> None:
    def record(t: Any) -> tuple[Any, ...]:
        return t.dtype, t.q_scale(), t.q_zero_point(), t.int_repr().clone()

    def make() -> tuple[Any]:
        zero_point = 0 if dtype is torch.qint32 else 1
        return (torch.quantize_per_tensor(torch.randn(4, 4, device=dev.torch_device), 0.1, zero_point, dtype),)

    torch.manual_seed(0)
    (expected,), (got,), stats = save_and_restore(dev, make, record)
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
    assert stats.offloaded_storages == 0 and stats.kept == {"unsupported": 1}, stats


# ------------------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class Layout:
    """A saved tensor built as ``view(base)`` from a fresh ``base`` of ``shape`` and ``dtype``."""

    shape: tuple[int, ...]
    dtype: Any
    view: Callable[[Any], Any]
    differentiable: bool = True
    offloaded: bool = True


f32, c64, c128, u8 = torch.float32, torch.complex64, torch.complex128, torch.uint8

LAYOUTS: dict[str, Layout] = {
    "contiguous": Layout((4, 6), f32, lambda b: b),
    "0-dim": Layout((), f32, lambda b: b),
    "0-dim element of a larger storage": Layout((4, 6), f32, lambda b: b[1, 2]),
    "storage offset": Layout((5, 6), f32, lambda b: b[2:, 1:]),
    "transposed": Layout((4, 6), f32, lambda b: b.t()),
    "strided slice": Layout((6, 8), f32, lambda b: b[::2, 1::3]),
    "permuted": Layout((2, 3, 4), f32, lambda b: b.permute(2, 0, 1)),
    "diagonal": Layout((4, 4), f32, lambda b: b.diagonal()),
    "expanded (stride 0)": Layout((1, 6), f32, lambda b: b.expand(4, 6)),
    "expanded 0-dim": Layout((), f32, lambda b: b.expand(3, 2)),
    "overlapping as_strided": Layout((10,), f32, lambda b: b.as_strided((3, 4), (2, 1), 1)),
    "channels_last": Layout((2, 3, 4, 5), f32, lambda b: b.contiguous(memory_format=torch.channels_last)),
    "channels_last_3d": Layout((2, 3, 2, 4, 3), f32, lambda b: b.contiguous(memory_format=torch.channels_last_3d)),
    "empty view with an offset": Layout((6,), f32, lambda b: b[6:]),
    "empty storage": Layout((0, 3), f32, lambda b: b, offloaded=False),
    "dtype view float32 as int32": Layout((4, 6), f32, lambda b: b.view(torch.int32), differentiable=False),
    "dtype view float32 as bytes": Layout((4, 6), f32, lambda b: b[1:].view(torch.uint8), differentiable=False),
    "dtype view bytes as int64": Layout((16,), u8, lambda b: b.view(torch.int64), differentiable=False),
    "dtype view into a storage not a multiple of its width": Layout(
        (14,), u8, lambda b: b[4:12].view(torch.int32), differentiable=False
    ),
    "view_as_real": Layout((3, 4), c64, lambda b: torch.view_as_real(b)),
    "imag (offset 1, stride 2)": Layout((3, 4), c64, lambda b: b.imag),
    "conj": Layout((3, 4), c64, lambda b: b.conj()),
    "conj of a strided slice": Layout((4, 4), c64, lambda b: b[1:, ::2].conj()),
    "mH": Layout((3, 4), c64, lambda b: b.mH),
    "adjoint": Layout((3, 4), c128, lambda b: b.adjoint()),
    "neg view": Layout((3, 4), f32, lambda b: torch._neg_view(b)),
    "neg view of a complex": Layout((3, 4), c64, lambda b: torch._neg_view(b)),
    "conj and neg": Layout((3, 4), c128, lambda b: torch._neg_view(b.conj())),
    "imag of a conj (neg bit)": Layout((3, 4), c64, lambda b: b.conj().imag),
}


def base_of(layout: Layout, device: Any, *, requires_grad: bool = False) -> Any:
    if layout.dtype.is_floating_point or layout.dtype.is_complex:
        return torch.randn(layout.shape, dtype=layout.dtype, device=device, requires_grad=requires_grad)
    return random_tensor(layout.dtype, layout.shape, device)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_comes_back_bit_exact(dev: Any, name: str) -> None:
    layout = LAYOUTS[name]
    torch.manual_seed(0)
    expected, restored, stats = save_and_restore(dev, lambda: (layout.view(base_of(layout, dev.torch_device)),))
    assert_restored_exactly(restored[0], expected[0], name)
    if layout.offloaded:
        assert stats.offloaded_storages == 1, stats
        assert stats.reloaded_bytes == expected[0].storage.numel() and stats.reused_live_bytes == 0, stats
    else:
        assert stats.offloaded_storages == 0, stats


def gradients(dev: Any, layout: Layout, *, offload: bool) -> tuple[Any, Any, Any]:
    """``sum(view(x.clone()) * w)`` (real part for complex): mul saves the view, and w's gradient is it.

    Returns the gradients of ``x`` and ``w`` and the region's stats (None without offload).
    """
    torch.manual_seed(0)
    with dev:
        x = base_of(layout, dev.torch_device, requires_grad=True)
        region = offcore_torch.offload_activations(dev, min_bytes=0) if offload else contextlib.nullcontext()
        with region as handle:
            v = layout.view(x.clone())  # not a leaf: offcore offloads it
            w = torch.randn(v.shape, dtype=v.dtype, device=dev.torch_device, requires_grad=True)
            y = v * w
            loss = (torch.view_as_real(y) if y.is_complex() else y).sum()
            settle(dev)
        del v, y  # only autograd's saved record is left: backward reads the host copy
        loss.backward()
    return x.grad, w.grad, handle.stats() if offload else None


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.differentiable])
def test_gradients_through_every_layout_are_bit_identical(dev: Any, name: str) -> None:
    layout = LAYOUTS[name]
    x_grad, w_grad, stats = gradients(dev, layout, offload=True)
    x_ref, w_ref, _ = gradients(dev, layout, offload=False)
    assert torch.equal(w_grad, w_ref), f"{name}: the gradient that reads the saved tensor changed"
    assert torch.equal(x_grad, x_ref), name
    if layout.offloaded:
        assert stats.offloaded_storages == 1 and stats.reloaded_bytes > 0, stats


@pytest.mark.parametrize("dtype", DIFFERENTIABLE_DTYPES, ids=dtype_id)
def test_gradients_in_every_differentiable_dtype_are_bit_identical(dev: Any, dtype: Any) -> None:
    layout = Layout((5, 6), dtype, lambda b: b[1:, ::2].t())
    x_grad, w_grad, stats = gradients(dev, layout, offload=True)
    x_ref, w_ref, _ = gradients(dev, layout, offload=False)
    assert torch.equal(w_grad, w_ref) and torch.equal(x_grad, x_ref)
    assert stats.offloaded_storages == 1 and stats.reloaded_bytes > 0, stats


@pytest.mark.parametrize(
    "product",
    {
        "x.conj() @ y": lambda x, y: x.conj() @ y,
        "x.mH @ y.mH": lambda x, y: x.mH @ y.mH,
        "x.adjoint() @ y.t()": lambda x, y: x.adjoint() @ y.t(),
        "neg view @ y": lambda x, y: torch._neg_view(x) @ y,
    }.items(),
    ids=lambda item: item[0],
)
def test_matmul_of_lazy_conj_and_neg_views_gives_bit_identical_gradients(dev: Any, product: Any) -> None:
    """mm saves its operands as they are: lazy conj/neg views, whose bits backward must see."""
    _, fn = product

    def run(offload: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        with dev:
            x = torch.randn(3, 4, dtype=torch.complex64, device=dev.torch_device, requires_grad=True)
            y = torch.randn(4, 3, dtype=torch.complex64, device=dev.torch_device, requires_grad=True)
            region = offcore_torch.offload_activations(dev, min_bytes=0) if offload else contextlib.nullcontext()
            with region:
                loss = torch.view_as_real(fn(x.clone(), y.clone())).sum()
                settle(dev)
            loss.backward()
        return x.grad, y.grad

    got, expected = run(True), run(False)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_views_of_one_storage_with_different_dtypes_and_bits_share_one_copy(dev: Any) -> None:
    """Dedupe: a complex storage saved plain, conjugated, as its imaginary part, as floats and as bytes."""
    torch.manual_seed(0)

    def make() -> tuple[Any, ...]:
        z = torch.randn(4, 4, dtype=torch.complex64, device=dev.torch_device)
        return z, z.conj(), z.imag, z.conj().imag, torch.view_as_real(z).permute(2, 0, 1), z.view(torch.uint8), z[1:, 2]

    expected, restored, stats = save_and_restore(dev, make)
    for i, (got, want) in enumerate(zip(restored, expected, strict=True)):
        assert_restored_exactly(got, want, f"view #{i}")
    assert stats.offloaded_storages == 1 and stats.offloaded_tensors == len(expected), stats


# ---------------------------------------------------------------- layouts offcore keeps
def dense_record(t: Any) -> tuple[Any, ...]:
    return t.layout, t.dtype, tuple(t.shape), t.to_dense().clone()


@pytest.mark.parametrize(
    "to_sparse",
    [lambda t: t.to_sparse(), lambda t: t.to_sparse_csr(), lambda t: t.to_sparse_csc()],
    ids=["coo", "csr", "csc"],
)
def test_sparse_tensors_are_kept_not_offloaded_and_still_correct(dev: Any, to_sparse: Any) -> None:
    torch.manual_seed(0)

    def make() -> tuple[Any]:
        dense = torch.randn(4, 5, device=dev.torch_device)
        return (to_sparse(dense * (dense > 0)),)

    (expected,), (got,), stats = save_and_restore(dev, make, dense_record)
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
    assert stats.offloaded_storages == 0 and stats.kept == {"unsupported": 1}, stats


def test_sparse_gradients_with_offload_are_bit_identical(dev: Any) -> None:
    """A sparse leaf (kept) next to a dense intermediate (offloaded): torch.sparse.mm saves both."""

    def run(offload: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        with dev:
            dense = torch.randn(4, 5, device=dev.torch_device)
            s = (dense * (dense > 0)).to_sparse().requires_grad_()
            w = torch.randn(5, 3, device=dev.torch_device, requires_grad=True)
            region = offcore_torch.offload_activations(dev, min_bytes=0) if offload else contextlib.nullcontext()
            with region:
                loss = torch.sparse.mm(s, w.exp()).sum()
                settle(dev)
            loss.backward()
        return s.grad.to_dense(), w.grad

    got, expected = run(True), run(False)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_nested_tensors_are_kept_and_gradients_stay_bit_identical(dev: Any) -> None:
    def run(offload: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        with dev:
            parts = [torch.randn(2, 3, device=dev.torch_device), torch.randn(4, 3, device=dev.torch_device)]
            nested = torch.nested.nested_tensor(parts, requires_grad=True)
            region = offcore_torch.offload_activations(dev, min_bytes=0) if offload else contextlib.nullcontext()
            with region as handle:
                doubled = nested * 2  # not a leaf: offcore would offload it if it could
                loss = (doubled * doubled).to_padded_tensor(0.0).sum()
                settle(dev)
            loss.backward()
        return nested.grad.unbind(), handle.stats() if offload else None

    (got, stats), (expected, _) = run(True), run(False)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert stats.offloaded_storages == 0 and set(stats.kept) == {"unsupported"}, stats
