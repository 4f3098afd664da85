"""PyTorch's saved-tensor-hooks, ``save_on_cpu`` and checkpoint tests, run with offcore's hooks.

Ported from ``test/test_autograd.py`` of pytorch/pytorch; each test names the PyTorch test
it comes from. Where PyTorch installs ``save_on_cpu`` or a pair of custom hooks, these run
``offload_activations(dev, min_bytes=0)`` (every storage offloaded, however small) on the
test device with the sanitizer on, and check that values and gradients are bit-identical
(``torch.equal``) to the same code without offload, and that what torch rejects without
hooks (an in-place change of a saved tensor) offcore rejects too, with
:class:`offcore.SavedTensorModifiedError`.

offcore keeps leaves that require grad on the device (they are parameters, or held by the
caller anyway), so the ports save intermediates (``leaf.clone()``) where PyTorch saves a
leaf, to have something offloaded.

Not ported, because they test hook plumbing offcore neither uses nor exposes: hooks with
wrong signatures or non-tensor returns and per-``SavedTensor`` ``register_hooks``
(``test_saved_variable_packing_unpacking_saved_original_with_hooks``'s error cases,
``test_custom_function_saved_tensors``, ``test_get_data_and_hooks_from_raw_saved_variable``),
``test_saved_tensor_hooks_extra_exit_during_bw_no_crash`` and
``test_saved_tensor_hooks_extra_enter_during_bw_no_leak`` (an unpack hook entering or
exiting a hooks context: offcore's never does), and ``TestAutogradWithCompiledAutograd``
(the same tests under compiled autograd, which skips these hook tests itself; offcore's
hooks run in eager autograd).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import pool_used_bytes, sanitized_device, settle  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch_test_devices import take_in_place_writes_of_saved_tensors  # noqa: E402

import offcore  # noqa: E402
from offcore.errors import SavedTensorModifiedError  # noqa: E402

TORCH_INPLACE_ERROR = "modified by an inplace operation"


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def offload(dev: Any, **policy: Any) -> Any:
    """The drop-in for ``save_on_cpu``: every saved storage offloaded."""
    return offcore_torch.offload_activations(dev, min_bytes=0, **policy)


def randn(dev: Any, *shape: int, **kwargs: Any) -> Any:
    return torch.randn(*shape, device=dev.torch_device, **kwargs)


def global_module_hooks() -> tuple[int, int, int]:
    """How many global nn.Module forward (pre-)hooks are registered, and how many regions the one pair offcore
    keeps for the process calls (Note [One pair of global module hooks]): a region that failed must leave none."""
    from offcore_torch.activations.policy import _ACTIVE_RULES

    return (
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
        len(_ACTIVE_RULES),
    )


def assert_same(got: Any, expected: Any) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e), (g, e)


# ---------------------------------------------------------------- packing and unpacking
def test_saved_inputs_come_back_equal_and_the_hooks_go_with_the_region(dev: Any) -> None:
    """test_saved_variable_packing_unpacking_saved_original_with_default_hooks (and ..._with_hooks)."""
    with dev:
        a = randn(dev, 5, requires_grad=True)
        with offload(dev) as handle:
            leaf_product = a * a  # a leaf: saved twice, kept
            h = a.clone()
            y = h * h  # an intermediate saved twice: one storage offloaded once
            assert torch.equal(y.grad_fn._saved_self, h) and torch.equal(y.grad_fn._saved_other, h)
            assert y.grad_fn._saved_self.grad_fn is h.grad_fn  # autograd re-attaches the history
            settle(dev)
        stats = handle.stats()
        assert stats.saved_tensors == 4 and stats.kept == {"leaf": 2}, stats
        assert stats.offloaded_storages == 1 and stats.offloaded_tensors == 2, stats

        del h
        (leaf_product + y).sum().backward()
        (expected,) = torch.autograd.grad((a * a + a.clone() * a.clone()).sum(), (a,))
        assert torch.equal(a.grad, expected)

        # the region's hooks are gone: a graph made after it is not packed by offcore
        (a * a).sum().backward()
    assert handle.stats().saved_tensors == 4


def test_gradients_through_saved_inputs_are_bit_identical(dev: Any) -> None:
    """test_saved_variable_packing_unpacking_saved_original_with_default_hooks, compared bit for bit."""

    def run(region: Callable[[], Any]) -> Any:
        torch.manual_seed(0)
        with dev:
            a = randn(dev, 5, requires_grad=True)
            with region():
                h = a.clone()
                y = (a * a) + h * h * h
                settle(dev)
            del h
            y.sum().backward()
        return a.grad

    assert torch.equal(run(lambda: offload(dev)), run(contextlib.nullcontext))


def test_saved_outputs_come_back_equal(dev: Any) -> None:
    """test_saved_variable_packing_unpacking_did_not_save_original_with_default_hooks (and ..._with_hooks)."""
    with dev:
        a = randn(dev, 5, requires_grad=True)
        with offload(dev) as handle:
            y = torch.exp(a)  # exp saves its result
            assert torch.equal(y.grad_fn._saved_result, y)
            assert y.grad_fn._saved_result.grad_fn is y.grad_fn
            settle(dev)
        y.sum().backward()
        assert torch.equal(a.grad, y.detach())
    assert handle.stats().offloaded_storages == 1


@pytest.mark.parametrize(
    ("forward", "grad"), [(True, False), (True, True), (False, True)], ids=["forward", "forward and grad", "grad"]
)
def test_double_backward_through_offloaded_saves_is_bit_identical(dev: Any, forward: bool, grad: bool) -> None:
    """test_default_saved_tensors_hooks_double_backward: a region around the forward, the grad, or both."""

    def double_backward(s: Any, leaf: Any) -> None:
        (g,) = torch.autograd.grad(s, (leaf,), create_graph=True)  # saves inside backward
        g.sum().backward()

    def run(forward: bool, grad: bool) -> Any:
        torch.manual_seed(0)
        with dev:
            leaf = randn(dev, 5, requires_grad=True)
            with offload(dev) if forward else contextlib.nullcontext():
                s = (leaf.clone() ** 3).sum()
                settle(dev)
                if forward and grad:
                    double_backward(s, leaf)
            if not (forward and grad):
                with offload(dev) if grad else contextlib.nullcontext():
                    double_backward(s, leaf)
        return leaf.grad

    assert torch.equal(run(forward, grad), run(False, False))


def test_double_backward_with_saves_during_backward_keeps_them(dev: Any) -> None:
    """test_default_saved_tensors_hooks_double_backward: what backward saves (create_graph) is never offloaded."""
    with dev:
        leaf = randn(dev, 5, requires_grad=True)
        with offload(dev) as handle:
            s = (leaf.clone() ** 3).sum()
            before = handle.stats().saved_tensors
            (g,) = torch.autograd.grad(s, (leaf,), create_graph=True)
            g.sum().backward()
    stats = handle.stats()
    assert stats.saved_tensors > before
    assert stats.kept.get("during_backward", 0) == stats.saved_tensors - before, stats


def test_wrapped_numbers_are_not_packed(dev: Any) -> None:
    """test_wrapped_number_saved_tensors_hooks: ``a * 3`` saves the 3 as a wrapped number, not through hooks."""
    with dev:
        a = randn(dev, 5, requires_grad=True)
        with offload(dev) as handle:
            out = (a.clone() * 3).sum()
            (grad,) = torch.autograd.grad(out, (a,))
    assert handle.stats().saved_tensors == 0
    assert torch.equal(grad, torch.full_like(a, 3.0))


def test_each_saved_tensor_is_packed_once_and_unpacked_once(dev: Any) -> None:
    """test_unpack_hooks_exec_count: ``x * y`` with only x requiring grad saves y alone."""
    with dev:
        x = randn(dev, 4, requires_grad=True)
        y = randn(dev, 4)
        with offload(dev) as handle:
            out = x * y.clone()
            assert handle.stats().saved_tensors == 1
            settle(dev)
        out.sum().backward()
    stats = handle.stats()
    assert stats.saved_tensors == 1 and stats.offloaded_storages == 1
    assert stats.reloaded_bytes == 4 * 4 and stats.stalls + stats.prefetch_hits == 1, stats
    assert torch.equal(x.grad, y)


def test_a_custom_function_saving_a_fresh_leaf(dev: Any) -> None:
    """test_saved_tensor_hooks_custom_function_intermediates: a saved tensor that is a new leaf requiring grad."""

    class Func(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x.exp().clone().detach_().requires_grad_(True))
            return x.exp()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (intermediate,) = ctx.saved_tensors
            return grad * intermediate

    def run(region: Any) -> Any:
        with dev:
            a = torch.full((3,), 0.5, device=dev.torch_device, requires_grad=True)
            with region:
                out = Func.apply(a)
            out.sum().backward()
        return a.grad

    handle = offload(dev)
    assert torch.equal(run(handle), run(contextlib.nullcontext()))
    assert handle.stats().kept == {"leaf": 1}, handle.stats()


def test_reading_a_saved_tensor_before_backward_then_backward(dev: Any) -> None:
    """test_saving_variable_to_disk: the only copy is the host one; reading it early and backward both see it."""
    with dev:
        a = torch.ones(5, device=dev.torch_device, requires_grad=True)
        with offload(dev) as handle:
            h = a.clone()
            y = h * h
            settle(dev)  # landed: offcore dropped the device copy
        del h  # now the host copy is the only one
        assert torch.equal(y.grad_fn._saved_self, torch.ones(5, device=dev.torch_device))
        y.sum().backward()
        assert torch.equal(a.grad, 2 * a.detach())
    assert handle.stats().reloaded_bytes >= 5 * 4


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("kind", ["float32", "float64", "sparse"])
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "intermediate"])
def test_graph_save_on_cpu(dev: Any, kind: str, leaf: bool, pinned: bool) -> None:
    """test_graph_save_on_cpu (``pin_memory`` becomes ``pinned``): values, dtype and layout come back; grad is 2a."""

    def make() -> Any:
        if kind == "sparse":
            indices = torch.tensor([[1, 1]], device=dev.torch_device)
            values = torch.ones(2, device=dev.torch_device)
            return torch.sparse_coo_tensor(indices, values, (3,), requires_grad=True, check_invariants=True)
        return randn(dev, 5, dtype=getattr(torch, kind), requires_grad=True)

    with dev:
        a = make()
        with offload(dev, pinned=pinned) as handle:
            base = a if leaf else a.clone()
            y = base * base
            saved = y.grad_fn._saved_self
            assert saved.dtype == a.dtype and saved.layout == a.layout
            assert torch.equal(saved.to_dense(), base.detach().to_dense())
            settle(dev)
        del base, saved
        (y.to_dense() if y.is_sparse else y).sum().backward()
        expected, got = 2 * a.detach(), a.grad
        if a.is_sparse:
            expected, got = expected.coalesce(), got.coalesce()
        assert torch.equal(got.to_dense(), expected.to_dense())
    stats = handle.stats()
    if kind == "sparse":
        assert stats.offloaded_storages == 0 and stats.kept.get("unsupported", 0) >= 1, stats
    elif not leaf:
        assert stats.offloaded_storages == 1 and stats.reloaded_bytes > 0, stats


def test_graph_save_on_cpu_frees_device_memory(dev: Any) -> None:
    """test_graph_save_on_cpu_cuda: with offload the device holds what a no-grad forward holds."""

    def f(x: Any) -> Any:
        a = x + 1
        return a * a

    def allocated() -> int:
        return int(dev.memory_stats()["allocated_bytes"])

    with dev:
        x = torch.ones(1024, device=dev.torch_device, requires_grad=True)
        start = allocated()
        y = f(x)
        with_grad = allocated() - start
        del y
        with torch.no_grad():
            y = f(x)
        without_grad = allocated() - start
        del y
        assert with_grad > without_grad
        with offload(dev):
            y = f(x)
            settle(dev)  # the copy of `a` landed and its device storage was freed
            with_offload = allocated() - start
        assert with_offload == without_grad
        y.sum().backward()
        assert torch.equal(x.grad, 2 * (x.detach() + 1))


def test_a_detached_saved_input_gives_the_gradient_save_on_cpu_gives(dev: Any) -> None:
    """test_saved_variable_saved_original_inplace_detach.

    Without hooks, backward refuses a saved input that was ``detach_()``-ed. Under any
    saved-tensor hooks (``save_on_cpu`` included) torch has no such check, and the values
    are unchanged by ``detach_``: offcore gives what ``save_on_cpu`` gives.
    """

    def run(region: Callable[[], Any]) -> Any:
        with dev:
            leaf = torch.tensor([1.0, 2.0], device=dev.torch_device, requires_grad=True)
            a = leaf.clone()
            with region():
                b = a.sin()
                settle(dev)
            a.detach_()
            b.sum().backward()
        return leaf.grad

    assert torch.equal(run(lambda: offload(dev)), run(torch.autograd.graph.save_on_cpu))


# ------------------------------------------------------------------------ nesting hooks
def test_nested_hooks_the_inner_one_wins(dev: Any) -> None:
    """test_setting_default_saved_variable_hooks_twice_should_use_inner (and ..._should_not_fail)."""

    def scale(k: float) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(lambda x: k * x, lambda x: k * x)

    with dev:
        a, b = randn(dev, 5, requires_grad=True), randn(dev, 5, requires_grad=True)
        with scale(3.0):
            with offload(dev) as inner:
                y = a.clone() * a.clone()  # offcore's: unscaled
            z = b.clone() * b.clone()  # the outer hooks': each saved value scaled by 3 twice
        with offload(dev) as outer:
            with scale(5.0):
                w = b.clone() * b.clone()  # the inner user hooks': scaled by 5 twice
            v = a.clone() * a.clone()  # offcore's again
        assert inner.stats().saved_tensors == 2 and outer.stats().saved_tensors == 2
        (y + v).sum().backward()
        assert torch.equal(a.grad, 2 * (a.detach() + a.detach()))
        z.sum().backward()
        torch.testing.assert_close(b.grad, 2 * 3 * 3 * b.detach())
        b.grad = None
        w.sum().backward()
        torch.testing.assert_close(b.grad, 2 * 5 * 5 * b.detach())


def test_nested_offload_regions_the_inner_one_owns_the_saves(dev: Any) -> None:
    """test_setting_default_saved_variable_hooks_twice_should_use_inner, with two offcore regions."""

    def run(nested: bool) -> tuple[Any, ...]:
        torch.manual_seed(0)
        with dev:
            a = randn(dev, 64, requires_grad=True)
            outer = offload(dev) if nested else contextlib.nullcontext()
            inner = offload(dev) if nested else contextlib.nullcontext()
            with outer as o:
                h = a.clone().sin()
                with inner as i:
                    h = h.exp() * h
                loss = h.cos().sum()
                settle(dev)
            del h
            loss.backward()
        return a.grad, o, i

    got, outer, inner = run(True)
    expected, _, _ = run(False)
    assert torch.equal(got, expected)
    assert outer.stats().saved_tensors == 2 and inner.stats().saved_tensors == 3


def test_disabled_saved_tensor_hooks_refuse_a_region_and_leave_nothing_behind(dev: Any) -> None:
    """test_disabling_saved_tensor_hooks and test_disabling_saved_tensor_hooks_nested: torch's tests expect a
    RuntimeError carrying its message (``assertRaisesRegex(RuntimeError, "error message")``), which the error
    is, as well as an offcore error."""
    hooks_before = global_module_hooks()
    with dev:
        with torch.autograd.graph.disable_saved_tensors_hooks("error message"):
            with pytest.raises(RuntimeError, match="^error message") as caught:
                with offload(dev):
                    pass
        assert isinstance(caught.value, offcore.OffcoreError) and isinstance(caught.value, offcore.ConfigurationError)
        assert isinstance(caught.value, offcore.SavedTensorHooksDisabledError)
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()
        assert global_module_hooks() == hooks_before, "a region that could not start left its module hooks"

        with torch.autograd.graph.disable_saved_tensors_hooks("outer"):
            with torch.autograd.graph.disable_saved_tensors_hooks("inner"):
                with pytest.raises(RuntimeError, match="^inner"):
                    with offload(dev):
                        pass
            assert not torch._C._autograd._saved_tensors_hooks_is_enabled()
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()

        with offload(dev):
            with pytest.raises(RuntimeError, match="error message"):
                with torch.autograd.graph.disable_saved_tensors_hooks("error message"):
                    pass
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()

        # a region still works afterwards, and leaves nothing behind
        a = randn(dev, 8, requires_grad=True)
        with offload(dev) as handle:
            loss = a.clone().exp().sum()
        loss.backward()
        assert handle.stats().offloaded_storages == 1
    assert global_module_hooks() == hooks_before


def test_errors_in_hooks_propagate_unchanged(dev: Any) -> None:
    """test_saved_tensor_hooks_custom_error_propagation: a user hook's error, and offcore's own, keep their type."""

    class CustomError(Exception):
        pass

    def fail(where: str) -> Any:
        def hook(x: Any) -> Any:
            raise CustomError(where)

        return hook

    hooks_before = global_module_hooks()
    with dev:
        a = randn(dev, 4, requires_grad=True)
        with pytest.raises(CustomError, match="pack"):
            with offload(dev):
                with torch.autograd.graph.saved_tensors_hooks(fail("pack"), lambda x: x):
                    torch.sin(a.clone())
        assert global_module_hooks() == hooks_before

        with offload(dev):
            with torch.autograd.graph.saved_tensors_hooks(lambda x: x, fail("unpack")):
                out = torch.sin(a.clone())
            with pytest.raises(CustomError, match="unpack"):
                out.sum().backward()

        with offload(dev):
            h = a.clone()
            out = h.sin().sum()
        with torch.no_grad():
            h.add_(1)
        take_in_place_writes_of_saved_tensors(dev)  # h's copy may still be in flight (never used: it raises)
        with pytest.raises(SavedTensorModifiedError) as info:
            out.backward()
        assert type(info.value) is SavedTensorModifiedError
        del h, out, info  # the traceback holds unpack's frame, and with it the saved record
        settle(dev, collect=True)
        assert pool_used_bytes(dev) == 0
    assert global_module_hooks() == hooks_before


def test_offcore_never_modifies_what_it_packs(dev: Any) -> None:
    """test_pack_hook_with_inplace_modification_should_fail: offcore's pack leaves every version alone."""

    def inc(x: Any) -> Any:
        x += 1
        return x

    with dev:
        a = randn(dev, 5, requires_grad=True)
        with offload(dev) as handle:
            h = a.clone()
            version = h._version
            y = torch.exp(h) * h  # saves h (twice) and exp's output
            assert h._version == version
            with torch.autograd.graph.saved_tensors_hooks(inc, lambda x: x):
                with pytest.raises(RuntimeError, match="A saved tensor pack hook is modifying its input in place"):
                    torch.exp(h)
        y.sum().backward()
    assert handle.stats().offloaded_tensors == 3


# ------------------------------------------------------------- in-place changes (parity)
def plain_and_offloaded(dev: Any, scenario: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """Run ``scenario(dev, region)`` without hooks and with offcore; return what each raised (or returned)."""
    with dev:
        try:
            plain: Any = scenario(dev, contextlib.nullcontext())
        except RuntimeError as exc:
            plain = exc
        try:
            offloaded: Any = scenario(dev, offload(dev))
        except RuntimeError as exc:
            offloaded = exc
    # every scenario writes a saved tensor in place, maybe while its copy is still in flight: on a GPU that
    # copy would read torn bytes, which offcore never uses (its version moved); the sanitizer reports it
    take_in_place_writes_of_saved_tensors(dev)
    return plain, offloaded


def modify_saved_input(dev: Any, region: Any) -> None:
    x = randn(dev, 4, 4, requires_grad=True)
    with region:
        h = x.clone()
        out = h.sin().sum()
    with torch.no_grad():
        h.add_(1)
    out.backward()


def modify_saved_output(dev: Any, region: Any) -> None:
    """test_saved_variable_version_counter: ``b = exp(a)``, then ``b += 1`` under no_grad."""
    a = randn(dev, 4, requires_grad=True)
    with region:
        b = torch.exp(a)
        assert torch.equal(b.grad_fn._saved_result, b)
    with torch.no_grad():
        b += 1
    b.sum().backward()


def modify_a_view_of_the_saved_tensor(dev: Any, region: Any) -> None:
    x = randn(dev, 4, 4, requires_grad=True)
    with region:
        h = x.clone()
        out = h.sin().sum()
    with torch.no_grad():
        h[1:, 2].mul_(2)
    out.backward()


def modify_the_base_of_a_saved_view(dev: Any, region: Any) -> None:
    x = randn(dev, 4, 4, requires_grad=True)
    with region:
        h = x.clone()
        out = h[1:].t().sin().sum()
    with torch.no_grad():
        h.zero_()
    out.backward()


def modify_a_saved_leaf(dev: Any, region: Any) -> None:
    x = randn(dev, 4, 4, requires_grad=True)
    with region:
        out = x.sin().sum()
    with torch.no_grad():
        x.add_(1)
    out.backward()


def modify_one_dtype_view_of_a_saved_storage(dev: Any, region: Any) -> None:
    x = randn(dev, 4, 4, requires_grad=True)
    with region:
        h = x.clone()
        out = h.sin().sum()
    bits = h.detach().view(torch.int32)  # a detached alias shares the version counter
    bits.bitwise_xor_(1)
    out.backward()


IN_PLACE_SCENARIOS = {
    "saved input": modify_saved_input,
    "saved output": modify_saved_output,
    "a view of the saved tensor": modify_a_view_of_the_saved_tensor,
    "the base of a saved view": modify_the_base_of_a_saved_view,
    "a saved leaf (kept)": modify_a_saved_leaf,
    "a dtype view of the saved storage": modify_one_dtype_view_of_a_saved_storage,
}


@pytest.mark.parametrize("name", list(IN_PLACE_SCENARIOS))
def test_in_place_changes_torch_rejects_offcore_rejects(dev: Any, name: str) -> None:
    """test_saved_variable_version_counter and autograd's in-place check, with offcore's hooks."""
    plain, offloaded = plain_and_offloaded(dev, IN_PLACE_SCENARIOS[name])
    assert isinstance(plain, RuntimeError) and TORCH_INPLACE_ERROR in str(plain), plain
    assert isinstance(offloaded, SavedTensorModifiedError), offloaded


class ModifyInBackward(torch.autograd.Function):
    """Saves ``x``; its backward changes the unpacked tensor in place (as some custom kernels do)."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        (x,) = ctx.saved_tensors
        x.add_(1)
        return grad


class TwoViewsModifyOne(torch.autograd.Function):
    """Saves two views of one storage; backward changes the first and then reads ``saved_tensors`` again."""

    @staticmethod
    def forward(ctx: Any, x: Any, xt: Any) -> Any:
        ctx.save_for_backward(x, xt)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        first, _ = ctx.saved_tensors
        first.mul_(2)
        _, second = ctx.saved_tensors  # torch: the version check of the second access fails
        return grad * second.t(), None


@pytest.mark.parametrize("where", ["host copy", "live storage"])
def test_a_restored_view_changed_in_backward_is_caught_before_another_node_reads_it(dev: Any, where: str) -> None:
    """test_saved_tensors_hook_version_counter_not_shared, the other way round.

    Two nodes save views of one storage; the node backward runs first changes its unpacked
    view in place. Without hooks the two share a version counter and the second unpack
    raises; offcore restores both as views of one storage, so it must raise too, not hand
    the second node the changed values.
    """

    def scenario(dev: Any, region: Any) -> Any:
        torch.manual_seed(0)
        x = randn(dev, 4, 4, requires_grad=True)
        w = randn(dev, 4, 4, requires_grad=True)
        with region:
            h = x * 2
            late = (h.t() * w).sum()  # mul saves h.t() for w's gradient; runs late in backward
            early = ModifyInBackward.apply(h[1:]).sum()  # saves a view of h; runs first
            settle(dev)
        if where == "host copy":
            del h
        torch.autograd.backward([early, late])
        return w.grad

    plain, offloaded = plain_and_offloaded(dev, scenario)
    assert isinstance(plain, RuntimeError) and TORCH_INPLACE_ERROR in str(plain), plain
    assert isinstance(offloaded, SavedTensorModifiedError), f"no error; w.grad came back as {offloaded}"


@pytest.mark.parametrize("where", ["host copy", "live storage"])
def test_a_second_access_after_changing_a_restored_view_is_caught(dev: Any, where: str) -> None:
    """One node saves two views of one storage, changes one, then unpacks again: torch raises."""

    def scenario(dev: Any, region: Any) -> Any:
        x = randn(dev, 4, 4, requires_grad=True)
        with region:
            h = x * 2
            out = TwoViewsModifyOne.apply(h, h.t()).sum()  # views made with grad mode on: both offloaded
            settle(dev)
        if where == "host copy":
            del h
        out.backward()
        return x.grad

    plain, offloaded = plain_and_offloaded(dev, scenario)
    assert isinstance(plain, RuntimeError) and TORCH_INPLACE_ERROR in str(plain), plain
    assert isinstance(offloaded, SavedTensorModifiedError), f"no error; x.grad came back as {offloaded}"


@pytest.mark.parametrize("other_graph", ["without offload", "another offload region"])
def test_a_change_through_a_live_restore_is_seen_by_the_callers_tensor(dev: Any, other_graph: str) -> None:
    """A restore that reused the caller's live storage is changed in place in backward.

    Without hooks the unpacked tensor *is* the caller's (same version counter): the change
    bumps its version, and another graph that saved it raises on backward. offcore's
    restore is a member of the same family (Note [Restore through the version keeper]),
    so the same happens.
    """

    def scenario(dev: Any, region: Any) -> Any:
        torch.manual_seed(0)
        x = randn(dev, 4, 4, requires_grad=True)
        w = randn(dev, 4, 4, requires_grad=True)
        h = x * 2  # the caller keeps h
        offloading = isinstance(region, offcore_torch.OffloadHandle)
        with offload(dev) if offloading and other_graph == "another offload region" else contextlib.nullcontext():
            late = (h.detach() * w).sum()  # saves an alias of h (same version counter) for w's gradient
        with region:
            early = ModifyInBackward.apply(h).sum()  # unpacks a restore of h's live storage, changes it
        early.backward()
        late.backward()
        return w.grad

    plain, offloaded = plain_and_offloaded(dev, scenario)
    assert isinstance(plain, RuntimeError) and TORCH_INPLACE_ERROR in str(plain), plain
    # offcore's check (another region) or torch's own (a graph without hooks, once h's version moved)
    caught = isinstance(offloaded, SavedTensorModifiedError) or TORCH_INPLACE_ERROR in str(offloaded)
    assert isinstance(offloaded, RuntimeError) and caught, f"no error; w.grad came back as {offloaded}"


# --------------------------------------------------------------------------- checkpoint
def test_save_on_cpu_and_checkpoint(dev: Any) -> None:
    """test_save_on_cpu_and_checkpoint: checkpoint inside the region, and the region inside checkpoint."""
    with dev:
        a = randn(dev, 2, 2, requires_grad=True)

        a.pow(2).pow(2).pow(2).pow(2).sum().backward()
        plain = a.grad.clone()
        a.grad = None

        with offload(dev) as handle:
            h = a.pow(2)
            h = checkpoint(lambda x: x.pow(2).pow(2), h, use_reentrant=False)
            c = h.pow(2)
        c.sum().backward()
        region_around = a.grad.clone()
        a.grad = None

        def f(x: Any) -> Any:
            h = x.pow(2)
            with offload(dev):
                h = h.pow(2).pow(2)
            return h.pow(2)

        checkpoint(f, a, use_reentrant=False).sum().backward()
        checkpoint_around = a.grad.clone()
    assert torch.equal(region_around, plain)
    assert torch.equal(checkpoint_around, plain)
    assert handle.stats().offloaded_storages > 0


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_inside_the_region_gives_bit_identical_gradients(dev: Any, use_reentrant: bool) -> None:
    """test_checkpointing_without_reentrant_correct_grad and test_checkpointing (reentrant), with backward and grad."""

    def run(region: Callable[[], Any], how: str) -> Any:
        torch.manual_seed(0)
        with dev:
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)).to(dev.torch_device)
            x = randn(dev, 8, 16, requires_grad=True)
            with region():
                h = x.exp()
                h = checkpoint(model, h, use_reentrant=use_reentrant)
                loss = (h * h).sum()
            if how == "grad":
                return torch.autograd.grad(loss, (x, *model.parameters()))
            loss.backward()
            return (x.grad, *(p.grad for p in model.parameters()))

    for how in ("backward",) if use_reentrant else ("backward", "grad"):  # reentrant checkpoint refuses .grad()
        assert_same(run(lambda: offload(dev), how), run(contextlib.nullcontext, how))


def test_checkpoint_and_the_saved_object_identity(dev: Any) -> None:
    """test_checkpointing_without_reentrant_saved_object_identity.

    With the region inside the checkpointed function, checkpoint owns every save and
    backward gets the object itself. With the region around checkpoint, the inputs
    checkpoint keeps for its recomputation are saved through offcore's hooks (offloaded),
    so the recomputation runs on an equal copy, as under ``save_on_cpu`` on an accelerator.
    """
    seen: list[Any] = []

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, y: Any) -> Any:
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            seen.extend(ctx.saved_tensors)
            return grad, None

    with dev:
        a = torch.ones((), device=dev.torch_device, requires_grad=True)
        b = torch.ones((), device=dev.torch_device)
        with offload(dev) as handle:
            out = checkpoint(Test.apply, a, b, use_reentrant=False)
            settle(dev)
        out.backward()
        assert seen[-1] is not b and torch.equal(seen[-1], b)
        assert handle.stats().offloaded_storages == 1  # b, saved by checkpoint for the recomputation

        def inner(x: Any, y: Any) -> Any:
            with offload(dev):
                return Test.apply(x, y)

        checkpoint(inner, a, b, use_reentrant=False).backward()
        assert seen[-1] is b


def test_checkpoint_still_refuses_a_second_unpack_of_recomputed_tensors(dev: Any) -> None:
    """test_checkpointing_without_reentrant_custom_function_works, inside an offload region."""
    second_access_errors: list[str] = []

    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, y: Any, z: Any) -> Any:
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, y, z, _, _ = ctx.saved_tensors
            try:
                _ = ctx.saved_tensors
            except RuntimeError as exc:
                second_access_errors.append(str(exc))
            return x, y, z

    def foo(x: Any, y: Any, z: Any) -> Any:
        return MyFunc.apply(x * y * z, y * y * z, z * z)

    with dev:
        x, y, z = (torch.full((), v, device=dev.torch_device, requires_grad=True) for v in (1.0, 2.0, 3.0))
        with offload(dev):
            out = checkpoint(foo, x, y, z, use_reentrant=False)
        out.sum().backward()
    assert len(second_access_errors) == 1
    assert "already unpacked once" in second_access_errors[0]


def test_checkpoint_calls_a_parameter_hook_once(dev: Any) -> None:
    """test_checkpointing_without_reentrant_parameter_used_in_an_out, inside an offload region."""
    count = 0

    def hook(grad: Any) -> None:
        nonlocal count
        count += 1

    with dev:
        w = randn(dev, 10, 10, requires_grad=True)
        w.register_hook(hook)
        x = torch.rand(10, 10, device=dev.torch_device, requires_grad=True)
        with offload(dev):
            h = w * x
            out = checkpoint(lambda t: w * t, h, use_reentrant=False)
        out.sum().backward()
    assert count == 1


def test_checkpoint_still_detects_non_determinism(dev: Any) -> None:
    """test_checkpoint_detects_non_determinism: fewer tensors saved in the recomputation, inside a region."""
    calls = [0]

    def fn(x: Any) -> Any:
        calls[0] += 1
        return x.sin().exp().sin() if calls[0] == 1 else x.sin().exp()

    with dev:
        a = randn(dev, 1, requires_grad=True)
        with offload(dev):
            out = checkpoint(fn, a, use_reentrant=False)
        with pytest.raises(RuntimeError, match="A different number of tensors was saved"):
            out.backward()


def test_checkpoint_of_a_no_grad_module(dev: Any) -> None:
    """test_checkpointing_without_reentrant_detached_tensor (use_reentrant=False), inside a region."""

    class NoGradModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)

        def forward(self, x: Any) -> Any:
            with torch.no_grad():
                return self.linear(x)

    with dev:
        module = NoGradModule().to(dev.torch_device)
        a = randn(dev, 2, 2, requires_grad=True)
        for _ in range(3):
            a.grad = None
            with offload(dev):
                out = checkpoint(module, a, use_reentrant=False)
                out = out + a.clone().exp()
            out.sum().backward()
            assert torch.equal(a.grad, a.detach().exp())


# --------------------------------------------------------------------------- lifetimes
@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_a_region_and_its_records_die_with_the_graph(dev: Any) -> None:
    """test_saved_tensor_hooks_extra_enter_during_bw_no_leak's concern, for offcore: nothing outlives the graph."""
    with dev, no_cycle_collection():
        a = randn(dev, 32, requires_grad=True)
        with offload(dev) as handle:
            loss = a.clone().exp().sum()
            settle(dev)
        loss.backward()
        region = weakref.ref(handle)
        del handle, loss
        settle(dev)
        assert region() is None, "the region outlived its graph without the cycle collector"
        assert pool_used_bytes(dev) == 0
