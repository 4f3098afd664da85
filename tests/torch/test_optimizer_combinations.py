"""OffloadOptimizer's options together: bit-identical to the host reference in every combination drawn.

The other optimizer tests vary one or two options at a time. Here hypothesis draws them all at
once: the optimizer, micro-steps per step, host steps under backward (``accumulation_steps``),
bf16 parameters with fp32 masters, clipping, gradients kept on the device until the step, where
the loop calls ``zero_grad()`` and whether it sets the gradients to None, a tiny upload budget (uploads held back until the parameter's use),
and a slow link (copies still in flight at the next operator). Each draw runs three optimizer steps
on the sanitized fake device and must reproduce the host reference bit for bit: losses, host
gradients, clip norms, device parameters, masters and optimizer state.

Two combinations are refused, and draws of them check the refusal instead: clipping with host steps
under backward (``clip_grad_norm_`` needs every gradient before any step), and host steps under
backward with the gradients kept on the device (``offload_gradients=False``: they reach the host at
``step()``). With ``offload_gradients=False`` the reference sums the micro-steps in ``.grad`` (the
parameter's dtype), as the device does, and converts at the step. The draws are derandomized, so CI runs the
same examples every time; a failure prints the options that broke.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given  # noqa: E402
from hypothesis_draws import choices_strategy, covering, derandomized  # noqa: E402
from offcore_torch.models import mlp_workload  # noqa: E402
from optimizer_offload_helpers import OPTIMIZERS, assert_equivalent, run  # noqa: E402
from torch_test_devices import fake_device, finish_device  # noqa: E402

from offcore.errors import ConfigurationError  # noqa: E402

MLP = mlp_workload(d_in=12, width=24, depth=2, d_out=6, batch_size=6)
STEPS = 3

CHOICES: dict[str, Any] = {
    "optimizer": sorted(OPTIMIZERS),
    "accumulation": range(1, 4),
    "overlap": [False, True],
    "bf16_masters": [False, True],
    "clip": [None, 0.05],
    "offload_gradients": [False, True],
    "zero_grad_before_backward": [False, True],
    "set_to_none": [False, True],
    "upload_budget": [None, "1KiB"],
    "link": ["unlimited", "slow"],
}
options = choices_strategy(CHOICES)


def _run(drawn: dict[str, Any], *, offload: bool) -> Any:
    device = fake_device(link=drawn["link"] if offload else "unlimited")
    try:
        return run(
            MLP,
            device=device,
            offload=offload,
            steps=STEPS,
            optimizer=drawn["optimizer"],
            accumulation=drawn["accumulation"],
            overlap=drawn["overlap"],
            dtype=torch.bfloat16 if drawn["bf16_masters"] else torch.float32,
            master_weights=drawn["bf16_masters"],
            clip=drawn["clip"],
            offload_gradients=drawn["offload_gradients"],
            zero_grad_before_backward=drawn["zero_grad_before_backward"],
            set_to_none=drawn["set_to_none"],
            options={"upload_budget": drawn["upload_budget"]} if offload else None,
        )
    finally:
        finish_device(device)


def _trains(drawn: dict[str, Any]) -> bool:
    """Whether OffloadOptimizer accepts the combination (the test checks the two refusals below)."""
    return not (drawn["overlap"] and (not drawn["offload_gradients"] or drawn["clip"] is not None))


_TRAINING = covering(CHOICES, valid=_trains)
FAST_EXAMPLES = [
    *_TRAINING,
    {**_TRAINING[0], "overlap": True, "offload_gradients": False},  # refused: gradients stay on the device
    {**_TRAINING[0], "overlap": True, "offload_gradients": True, "clip": 0.05},  # refused: clipping under backward
]


@derandomized(max_examples=100, examples=FAST_EXAMPLES)
@given(drawn=options)
def test_every_combination_matches_the_host_reference(drawn: dict[str, Any]) -> None:
    if drawn["overlap"] and not drawn["offload_gradients"]:
        # host steps under backward need the gradients on the host as backward makes them
        with pytest.raises(ConfigurationError, match="offload_gradients=False the gradients stay on the device"):
            _run(drawn, offload=True)
        return
    if drawn["clip"] is not None and drawn["overlap"]:
        # host steps under backward ran before clip_grad_norm_ could see every gradient
        with pytest.raises(ConfigurationError, match="accumulation_steps=None"):
            _run(drawn, offload=True)
        return
    want = _run(drawn, offload=False)
    got = _run(drawn, offload=True)
    assert_equivalent(got, want)
