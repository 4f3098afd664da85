"""What torch's optimizers do silently right, OffloadOptimizer must too (or refuse loudly).

- Gradual unfreezing: a parameter frozen when the optimizer was made and unfrozen later is
  stepped from then on, as torch steps it (it never moved: no gradient hook, no warning).
- Two optimizers over one parameter: torch steps both; here the first one's gradient hook
  takes the gradient off the device, so the second would never see one. The second is refused
  while the first is open (Note [One OffloadOptimizer per parameter]).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore_torch  # noqa: E402
from offload_helpers import sanitized_device  # noqa: E402

import offcore  # noqa: E402


@pytest.fixture
def dev(backend: Any, make_fake_device: Any) -> Any:
    return sanitized_device(backend, make_fake_device, link="slow")


def _model(dev: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    with dev:
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(
            dev.torch_device
        )


@pytest.mark.parametrize("offload_gradients", [True, False])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_a_parameter_unfrozen_after_construction_is_stepped_as_torch_steps_it(
    dev: Any, optimizer: type[torch.optim.Optimizer], offload_gradients: bool
) -> None:
    model = _model(dev)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[0].weight.requires_grad_(False)  # frozen at first
    opt = offcore_torch.OffloadOptimizer(
        model.parameters(), optimizer, device=dev, lr=0.1, offload_gradients=offload_gradients
    )
    ref_opt = optimizer(reference.parameters(), lr=0.1)
    with dev:
        data = [torch.randn(4, 16, device=dev.torch_device) for _ in range(3)]
    try:
        for step, x in enumerate(data):
            if step == 1:  # unfrozen after the first step
                for m in (model, reference):
                    m[0].weight.requires_grad_(True)
            for m, o in ((model, opt), (reference, ref_opt)):
                with dev:
                    m(x).square().sum().backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got.detach(), want.detach())
        assert not torch.equal(model[0].weight.detach(), _model(dev)[0].weight.detach()), "never moved"
    finally:
        opt.close()


def test_a_second_optimizer_over_the_same_parameters_is_refused_while_the_first_is_open(dev: Any) -> None:
    model = _model(dev)
    first = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1)
    with pytest.raises(offcore.ConfigurationError, match="already optimized by another open OffloadOptimizer"):
        offcore_torch.OffloadOptimizer(model[2].parameters(), torch.optim.SGD, device=dev, lr=0.1)
    # a copy of the model is other parameters, and the model still pickles (the parameters carry no mark)
    other = offcore_torch.OffloadOptimizer(copy.deepcopy(model).parameters(), torch.optim.SGD, device=dev, lr=0.1)
    other.close()
    torch.save(model, io.BytesIO())
    first.close()
    second = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.SGD, device=dev, lr=0.1)
    with dev:
        model(torch.randn(2, 16, device=dev.torch_device)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    second.step()
    second.synchronize()
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    second.close()
