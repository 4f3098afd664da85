"""GPT- or LLaMA-shaped step profiles estimated from a model's shapes and an achieved FLOP rate.

:func:`transformer_layer_profile` and :func:`transformer_step_profile` build them; :func:`transformer_saved_bytes`
and :func:`transformer_layer_flops` are the formulas they use.
"""

from __future__ import annotations

import math
from typing import Literal

from offcore.errors import ConfigurationError
from offcore.sim.profile import LayerProfile, StepProfile, _check_positive_ints

__all__ = [
    "transformer_layer_profile",
    "transformer_step_profile",
    "transformer_saved_bytes",
    "transformer_layer_flops",
]

# --- transformer-shaped profiles -----------------------------------------------------------

AttentionKind = Literal["flash", "eager"]
MlpKind = Literal["swiglu", "gelu"]
BlockPart = Literal["block", "attention", "mlp"]


def transformer_saved_bytes(
    *,
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    ffn: int,
    dtype_bytes: int = 2,
    attention: AttentionKind = "flash",
    mlp: MlpKind = "swiglu",
    dropout: bool = False,
) -> int:
    """Bytes one pre-norm transformer block saves for backward (no tensor/sequence parallelism).

    Term by term, per token (``t = batch·seq`` tokens, ``d = dtype_bytes``, ``h = hidden``,
    ``f = ffn``, ``a = heads``), following Korthikanti et al., *Reducing Activation
    Recomputation in Large Transformer Models* (2022), §4.1:

    - norm inputs (two norms): ``2·h·d``; attention input (norm output): ``h·d``;
      Q, K, V: ``3·h·d``; attention output = output-projection input: ``h·d``;
      MLP input (norm output): ``h·d``.
    - ``attention="eager"``: softmax output ``a·s·d`` per token; with dropout also its
      mask (``a·s`` bytes) and output (``a·s·d``). ``"flash"`` (fused SDPA) saves only the
      log-sum-exp, ``a·4`` bytes per token.
    - ``mlp="gelu"``: the two ``f``-wide tensors (GeLU input, second linear's input):
      ``2·f·d``; ``mlp="swiglu"``: gate, up and their product: ``3·f·d``.
    - ``dropout``: one-byte masks after attention and after the MLP: ``2·h`` bytes.

    With ``attention="eager"``, ``mlp="gelu"``, ``dropout=True``, ``f = 4h`` and ``d = 2``
    this is exactly the paper's ``s·b·h·(34 + 5·a·s/h)``:

    >>> b, s, h, a = 1, 2048, 1024, 16
    >>> transformer_saved_bytes(batch=b, seq=s, hidden=h, heads=a, ffn=4 * h,
    ...     attention="eager", mlp="gelu", dropout=True) == s * b * h * 34 + 5 * a * s * s * b
    True
    """
    attention_part, mlp_part = _saved_bytes_by_half(
        batch=batch,
        seq=seq,
        hidden=hidden,
        heads=heads,
        ffn=ffn,
        dtype_bytes=dtype_bytes,
        attention=attention,
        mlp=mlp,
        dropout=dropout,
    )
    return attention_part + mlp_part


def _saved_bytes_by_half(
    *,
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    ffn: int,
    dtype_bytes: int,
    attention: AttentionKind,
    mlp: MlpKind,
    dropout: bool,
) -> tuple[int, int]:
    """(attention half, MLP half) of :func:`transformer_saved_bytes`."""
    _check_positive_ints(batch=batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn, dtype_bytes=dtype_bytes)
    tokens = batch * seq
    d = dtype_bytes
    # attention half: norm input, attention input, Q, K, V, attention output
    attention_token = (1 + 1 + 3 + 1) * hidden * d
    if attention == "eager":
        attention_token += heads * seq * d
        if dropout:
            attention_token += heads * seq * (1 + d)
    elif attention == "flash":
        attention_token += heads * 4
    else:
        raise ConfigurationError(f"attention must be 'flash' or 'eager', got {attention!r}")
    # MLP half: norm input, MLP input, the f-wide tensors
    mlp_token = (1 + 1) * hidden * d
    if mlp == "gelu":
        mlp_token += 2 * ffn * d
    elif mlp == "swiglu":
        mlp_token += 3 * ffn * d
    else:
        raise ConfigurationError(f"mlp must be 'swiglu' or 'gelu', got {mlp!r}")
    if dropout:
        attention_token += hidden
        mlp_token += hidden
    return tokens * attention_token, tokens * mlp_token


def transformer_layer_flops(
    *, batch: int, seq: int, hidden: int, ffn: int, mlp: MlpKind = "swiglu", causal: bool = True
) -> float:
    """Forward FLOPs of one transformer block (multi-head attention, no GQA).

    ``2·t·(4h² + m·h·f)`` for the projections (``m = 3`` for SwiGLU, 2 for GeLU) plus
    ``4·b·s²·h`` for the two attention products, halved when ``causal`` (fused kernels
    skip the masked half). Backward is taken as twice the forward.

    >>> transformer_layer_flops(batch=1, seq=1, hidden=1, ffn=4, mlp="gelu", causal=False)
    28.0
    """
    attention_part, mlp_part = _flops_by_half(batch=batch, seq=seq, hidden=hidden, ffn=ffn, mlp=mlp, causal=causal)
    return attention_part + mlp_part


def _flops_by_half(*, batch: int, seq: int, hidden: int, ffn: int, mlp: MlpKind, causal: bool) -> tuple[float, float]:
    """(attention half, MLP half) of :func:`transformer_layer_flops`."""
    _check_positive_ints(batch=batch, seq=seq, hidden=hidden, ffn=ffn)
    mlp_mats = {"swiglu": 3, "gelu": 2}.get(mlp)
    if mlp_mats is None:
        raise ConfigurationError(f"mlp must be 'swiglu' or 'gelu', got {mlp!r}")
    tokens = batch * seq
    attention = 2.0 * tokens * 4 * hidden * hidden + 4.0 * batch * seq * seq * hidden * (0.5 if causal else 1.0)
    return attention, 2.0 * tokens * mlp_mats * hidden * ffn


def transformer_layer_profile(
    *,
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    ffn: int,
    flops_per_s: float,
    dtype_bytes: int = 2,
    attention: AttentionKind = "flash",
    mlp: MlpKind = "swiglu",
    dropout: bool = False,
    causal: bool = True,
    name: str = "layer",
    part: BlockPart = "block",
) -> LayerProfile:
    """A :class:`LayerProfile` for one transformer block (or half of one), estimated from shapes.

    ``flops_per_s`` is the *achieved* rate (peak × a realistic utilisation), not the
    datasheet peak. Times: forward = :func:`transformer_layer_flops` / rate, backward =
    2 × forward, recompute = forward. Saved bytes: :func:`transformer_saved_bytes`.
    Working bytes: ``t·(2f + 2h)·d`` (the largest transient, the MLP's ``f``-wide
    gradients plus the input gradient). Input bytes (the checkpoint): ``t·h·d``.

    ``part="attention"`` or ``"mlp"`` gives one half of the block (norm + attention with
    its projections, or norm + MLP) with that half's saved bytes and FLOPs; the
    attention half's working set is ``t·2h·d``. Planning halves lets a plan recompute the
    half that is cheaper per byte and offload the other.

    >>> lp = transformer_layer_profile(batch=1, seq=4096, hidden=4096, heads=32, ffn=11008,
    ...                                flops_per_s=400e12)
    >>> round(lp.forward_s * 1e3, 2), round(lp.saved_bytes / 1e6)
    (4.49, 539)
    """
    if isinstance(flops_per_s, bool) or not isinstance(flops_per_s, (int, float)) or not flops_per_s > 0:
        raise ConfigurationError(f"flops_per_s must be a positive number (achieved FLOP/s), got {flops_per_s!r}")
    saved_halves = _saved_bytes_by_half(
        batch=batch,
        seq=seq,
        hidden=hidden,
        heads=heads,
        ffn=ffn,
        dtype_bytes=dtype_bytes,
        attention=attention,
        mlp=mlp,
        dropout=dropout,
    )
    flop_halves = _flops_by_half(batch=batch, seq=seq, hidden=hidden, ffn=ffn, mlp=mlp, causal=causal)
    tokens = batch * seq
    mlp_working = tokens * (2 * ffn + 2 * hidden) * dtype_bytes
    if part == "block":
        saved, flops, working = sum(saved_halves), sum(flop_halves), mlp_working
    elif part == "attention":
        saved, flops, working = saved_halves[0], flop_halves[0], tokens * 2 * hidden * dtype_bytes
    elif part == "mlp":
        saved, flops, working = saved_halves[1], flop_halves[1], mlp_working
    else:
        raise ConfigurationError(f"part must be 'block', 'attention' or 'mlp', got {part!r}")
    forward_s = flops / float(flops_per_s)
    return LayerProfile(
        name,
        forward_s=forward_s,
        backward_s=2.0 * forward_s,
        saved_bytes=saved,
        recompute_s=forward_s,
        working_bytes=working,
        input_bytes=tokens * hidden * dtype_bytes,
    )


def transformer_step_profile(
    *,
    layers: int,
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    ffn: int,
    flops_per_s: float,
    dtype_bytes: int = 2,
    vocab: int = 0,
    attention: AttentionKind = "flash",
    mlp: MlpKind = "swiglu",
    dropout: bool = False,
    causal: bool = True,
    grad_bytes: int | None = None,
    other_bytes: int = 0,
    d2h_bandwidth: float | str = math.inf,
    h2d_bandwidth: float | str = math.inf,
    latency_s: float | str = 0.0,
    duplex: bool = True,
    capacity_bytes: int | str | None = None,
    granularity: Literal["block", "half"] = "block",
) -> StepProfile:
    """A :class:`StepProfile` for a stack of identical transformer blocks.

    ``granularity="block"`` makes one profile layer per block (``layer{i}``);
    ``"half"`` makes two, ``layer{i}.attn`` and ``layer{i}.mlp``, so a plan can treat the
    halves differently (full per-block checkpointing is then ``checkpoint_interval=2``).

    Parameter bytes: ``layers·(4h² + m·h·f)·d`` plus ``2·vocab·h·d`` for untied
    embedding and output head. ``grad_bytes`` defaults to the parameter bytes (gradients
    in the parameters' dtype, resident all step). The embedding, the head and the loss
    are not modelled as layers (their activations are not planned).

    >>> p = transformer_step_profile(layers=2, batch=1, seq=128, hidden=64, heads=4, ffn=256,
    ...                              flops_per_s=1e12)
    >>> p.n_layers, p.param_bytes == p.grad_bytes
    (2, True)
    """
    _check_positive_ints(layers=layers)
    mlp_mats = {"swiglu": 3, "gelu": 2}.get(mlp, 3)
    params = layers * (4 * hidden * hidden + mlp_mats * hidden * ffn) + 2 * vocab * hidden
    param_bytes = params * dtype_bytes
    if granularity == "block":
        parts: list[tuple[str, BlockPart]] = [("", "block")]
    elif granularity == "half":
        parts = [(".attn", "attention"), (".mlp", "mlp")]
    else:
        raise ConfigurationError(f"granularity must be 'block' or 'half', got {granularity!r}")
    stack = [
        transformer_layer_profile(
            batch=batch,
            seq=seq,
            hidden=hidden,
            heads=heads,
            ffn=ffn,
            flops_per_s=flops_per_s,
            dtype_bytes=dtype_bytes,
            attention=attention,
            mlp=mlp,
            dropout=dropout,
            causal=causal,
            name=f"layer{index}{suffix}",
            part=part,
        )
        for index in range(layers)
        for suffix, part in parts
    ]
    return StepProfile(
        stack,
        param_bytes=param_bytes,
        grad_bytes=param_bytes if grad_bytes is None else grad_bytes,
        other_bytes=other_bytes,
        d2h_bandwidth=d2h_bandwidth,
        h2d_bandwidth=h2d_bandwidth,
        latency_s=latency_s,
        duplex=duplex,
        capacity_bytes=capacity_bytes,
        batch_size=batch,
    )
