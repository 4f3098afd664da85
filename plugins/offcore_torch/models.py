"""A small, deterministic model zoo for tests, benchmarks and ``offcore compare``.

Every model is built on the CPU from an integer seed, so two builds with the same
seed hold bit-identical parameters whatever device they are moved to afterwards.
Each model exercises something activation offloading must get right:

- :class:`MLP`: plain ``Linear`` + ``GELU`` blocks (many large saved activations).
- :class:`TinyGPT`: token + position embeddings, pre-norm blocks with causal
  ``scaled_dot_product_attention``, GELU MLP, dropout with ``p > 0`` and an output
  head *tied* to the token embedding (autograd saves views of a shared parameter).
- :class:`SmallCNN`: ``Conv2d``, ``BatchNorm2d`` (buffers updated in place),
  in-place ``ReLU``, transposed / reshaped views and pooling.
- :class:`ViewSaver`: autograd saves a tensor *and* several views of it (strided,
  transposed, with a storage offset), so storage deduplication and exact restore
  of shape / stride / offset are exercised.

A :class:`Workload` bundles a model builder, a deterministic batch generator and the
loss, which is what the equivalence harness (:mod:`offcore_torch.testing`) and the
benchmarks consume::

    >>> import torch
    >>> from offcore_torch.models import GPTConfig, gpt_workload
    >>> work = gpt_workload(GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16), batch_size=2)
    >>> model = work.build(0)
    >>> batch = work.make_batch(0, torch.device("cpu"))
    >>> loss = work.loss(model, batch)
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "GPTConfig",
    "MLP",
    "TinyGPT",
    "next_token_loss",
    "SmallCNN",
    "ViewSaver",
    "Workload",
    "seeded",
    "mlp_workload",
    "gpt_workload",
    "cnn_workload",
    "view_saver_workload",
    "WORKLOADS",
]

Batch = tuple[Tensor, ...]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU random generator seeded to ``seed``, then restore its state.

    Used to make the default ``reset_parameters`` initialisers of ``nn`` layers
    deterministic without disturbing the caller's random stream::

        >>> with seeded(3):
        ...     a = torch.rand(2)
        >>> with seeded(3):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _batch_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for the batch of ``step``; independent of the global random state."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(1_000_003 * (seed + 1) + step)
    return gen


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """A stack of ``Linear → GELU`` blocks followed by a linear head.

    ``MLP`` is an ``nn.Sequential``-like module: iterating ``model.layers`` gives the
    blocks in order (the peak-memory test measures each one's working set)::

        >>> model = MLP(d_in=8, width=16, depth=3, d_out=4, seed=0)
        >>> model(torch.ones(5, 8)).shape
        torch.Size([5, 4])
        >>> len(model.layers)
        4
    """

    def __init__(self, d_in: int = 32, width: int = 128, depth: int = 3, d_out: int = 16, *, seed: int = 0) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"MLP depth must be at least 1, got {depth}")
        with seeded(seed):
            blocks: list[nn.Module] = []
            size = d_in
            for _ in range(depth):
                blocks.append(nn.Sequential(nn.Linear(size, width), nn.GELU()))
                size = width
            blocks.append(nn.Linear(size, d_out))
            self.layers = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


# --------------------------------------------------------------------------- TinyGPT


@dataclass(frozen=True)
class GPTConfig:
    """Size of a :class:`TinyGPT`.

    ``d_model`` must be divisible by ``n_heads``; ``dropout`` applies to embeddings,
    attention probabilities, and both residual branches::

        >>> GPTConfig(d_model=64, n_heads=4).head_dim
        16
    """

    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 32
    dropout: float = 0.1
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, H, T, C/H): transposed views, as real GPT code does.
        q, k, v = (t.view(batch, seq, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model small enough for CPU tests.

    The output head shares its weight with the token embedding
    (``model.lm_head.weight is model.tok_emb.weight``)::

        >>> cfg = GPTConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, seq_len=8)
        >>> model = TinyGPT(cfg, seed=0)
        >>> model.lm_head.weight is model.tok_emb.weight
        True
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(
        self, cfg: GPTConfig | None = None, *, seed: int = 0, checkpoint_blocks: bool | Literal["reentrant"] = False
    ) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        if checkpoint_blocks not in (False, True, "reentrant"):
            raise ValueError(f'checkpoint_blocks must be False, True or "reentrant", got {checkpoint_blocks!r}')
        self.checkpoint_blocks = checkpoint_blocks
        """Recompute each block in backward (``torch.utils.checkpoint``: non-reentrant for True, the
        reentrant implementation for ``"reentrant"``)."""
        with seeded(seed):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # tied embeddings
            self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled by depth.
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() < 2:
                continue
            std = residual_std if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for token ids ``idx`` of shape ``(batch, seq)``."""
        seq = idx.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the configured seq_len {self.cfg.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.checkpoint_blocks == "reentrant")
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` ``(batch, seq, vocab)`` against ``targets`` ``(batch, seq)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------- SmallCNN


class SmallCNN(nn.Module):
    """Conv → BatchNorm → in-place ReLU (twice), max pooling, a token mixer on
    transposed / reshaped views, mean pooling and a linear classifier.

    The mixer flattens the feature map to ``(B, C, H*W)``, transposes it to
    ``(B, H*W, C)``, applies a ``Linear`` over channels, and transposes/reshapes back,
    so autograd saves non-contiguous views::

        >>> model = SmallCNN(in_channels=3, width=8, n_classes=5, seed=0)
        >>> model(torch.ones(2, 3, 16, 16)).shape
        torch.Size([2, 5])
    """

    def __init__(self, in_channels: int = 3, width: int = 16, n_classes: int = 10, *, seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
            self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu1 = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(2 * width)
            self.relu2 = nn.ReLU(inplace=True)
            self.pool = nn.MaxPool2d(2)
            self.mix = nn.Linear(2 * width, 2 * width)
            self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.pool(self.relu2(self.bn2(self.conv2(x))))
        batch, channels, height, width = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (B, H*W, C), non-contiguous view
        mixed = self.mix(tokens).relu_()  # in-place ReLU on a fresh tensor
        x = x + mixed.transpose(1, 2).reshape(batch, channels, height, width)
        return self.head(x.mean(dim=(2, 3)))


# --------------------------------------------------------------------------- ViewSaver


class ViewSaver(nn.Module):
    """Makes autograd save one tensor together with several views of its storage.

    With ``a = x @ w`` the loss is
    ``mean(a * a) + mean(b * b.t().t()) + mean(c * tanh(c))`` where ``b = a[:, ::2]``
    (a strided view) and ``c = a[1:, 1::2]`` (a view with a storage offset), so the
    saved tensors are ``a`` (twice), ``b``, ``b.t().t()`` and ``c`` — one storage::

        >>> model = ViewSaver(d_in=4, d_out=6, seed=0)
        >>> model(torch.ones(3, 4)).shape
        torch.Size([])
    """

    def __init__(self, d_in: int = 32, d_out: int = 64, *, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.w = nn.Parameter(torch.randn(d_in, d_out, generator=gen) / math.sqrt(d_in))

    def forward(self, x: Tensor) -> Tensor:
        a = x @ self.w
        b = a[:, ::2]
        c = a[1:, 1::2]
        return (a * a).mean() + (b * b.t().t()).mean() + (c * torch.tanh(c)).mean()


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A model builder, a deterministic batch generator and a loss: one reproducible training task.

    - ``build(seed)`` returns the model on the CPU, initialised from ``seed``;
    - ``make_batch(step, device)`` returns the batch of step ``step`` on ``device``
      (the same values on every device);
    - ``loss(model, batch)`` returns the scalar loss.

        >>> work = mlp_workload(d_in=4, width=8, depth=2, d_out=3, batch_size=5)
        >>> model = work.build(0)
        >>> work.loss(model, work.make_batch(0, torch.device("cpu"))).dim()
        0
    """

    name: str
    build: Callable[[int], nn.Module]
    make_batch: Callable[[int, torch.device], Batch]
    loss: Callable[[nn.Module, Batch], Tensor]


def mlp_workload(
    *, d_in: int = 32, width: int = 128, depth: int = 3, d_out: int = 16, batch_size: int = 64, data_seed: int = 0
) -> Workload:
    """:class:`MLP` regressing random targets with the mean squared error."""

    def build(seed: int) -> nn.Module:
        return MLP(d_in, width, depth, d_out, seed=seed)

    def make_batch(step: int, device: torch.device) -> Batch:
        gen = _batch_generator(data_seed, step)
        x = torch.randn(batch_size, d_in, generator=gen)
        y = torch.randn(batch_size, d_out, generator=gen)
        return x.to(device), y.to(device)

    def loss(model: nn.Module, batch: Batch) -> Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    return Workload("mlp", build, make_batch, loss)


def gpt_workload(
    cfg: GPTConfig | None = None,
    *,
    batch_size: int = 4,
    data_seed: int = 0,
    checkpoint_blocks: bool | Literal["reentrant"] = False,
) -> Workload:
    """:class:`TinyGPT` predicting the next token of random token sequences.

    ``checkpoint_blocks=True`` recomputes every block in backward (activation checkpointing;
    ``"reentrant"``: torch's reentrant implementation).
    """
    config = cfg or GPTConfig()

    def build(seed: int) -> nn.Module:
        return TinyGPT(config, seed=seed, checkpoint_blocks=checkpoint_blocks)

    def make_batch(step: int, device: torch.device) -> Batch:
        gen = _batch_generator(data_seed, step)
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), generator=gen)
        return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    def loss(model: nn.Module, batch: Batch) -> Tensor:
        idx, targets = batch
        return next_token_loss(model(idx), targets)

    return Workload("gpt", build, make_batch, loss)


def cnn_workload(
    *,
    in_channels: int = 3,
    width: int = 16,
    n_classes: int = 10,
    image_size: int = 16,
    batch_size: int = 8,
    data_seed: int = 0,
) -> Workload:
    """:class:`SmallCNN` classifying random images into random classes."""

    def build(seed: int) -> nn.Module:
        return SmallCNN(in_channels, width, n_classes, seed=seed)

    def make_batch(step: int, device: torch.device) -> Batch:
        gen = _batch_generator(data_seed, step)
        images = torch.randn(batch_size, in_channels, image_size, image_size, generator=gen)
        labels = torch.randint(0, n_classes, (batch_size,), generator=gen)
        return images.to(device), labels.to(device)

    def loss(model: nn.Module, batch: Batch) -> Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    return Workload("cnn", build, make_batch, loss)


def view_saver_workload(*, d_in: int = 32, d_out: int = 64, batch_size: int = 48, data_seed: int = 0) -> Workload:
    """:class:`ViewSaver`, whose forward already returns the scalar loss."""

    def build(seed: int) -> nn.Module:
        return ViewSaver(d_in, d_out, seed=seed)

    def make_batch(step: int, device: torch.device) -> Batch:
        gen = _batch_generator(data_seed, step)
        return (torch.randn(batch_size, d_in, generator=gen).to(device),)

    def loss(model: nn.Module, batch: Batch) -> Tensor:
        return model(*batch)

    return Workload("view_saver", build, make_batch, loss)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mlp": mlp_workload,
    "gpt": gpt_workload,
    "cnn": cnn_workload,
    "view_saver": view_saver_workload,
}
"""Workload factories by name (keyword arguments size them)."""
