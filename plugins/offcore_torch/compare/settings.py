"""What ``offcore compare`` runs: the fixed workload's settings, the dtypes, the PCIe-like link and the compared device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import offcore
from offcore.comparison import STRATEGIES
from offcore.errors import ConfigurationError
from offcore.sim import transformer_layer_profile
from offcore.units import format_bandwidth, format_bytes
from offcore_torch.models import GPTConfig, Workload, gpt_workload

Progress = Callable[[int, str], None]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""The dtypes the built-in workload trains in (float16 lacks CPU kernels for parts of the model)."""


@dataclass(frozen=True)
class GpuReference:
    """The machine the fake link imitates: a GPU with its achieved compute rate and its host link."""

    name: str = "H200-class GPU (400 TFLOP/s achieved) on PCIe Gen5 (53 GB/s D2H, 35 GB/s H2D)"
    flops_per_s: float = 400e12
    d2h_bandwidth: float = 53e9
    h2d_bandwidth: float = 35e9
    layer: str = "LLaMA-7B layer at sequence 4096 (bf16, flash attention)"

    def d2h_fraction(self) -> float:
        """Share of one layer's saved bytes the D2H link moves during that layer's forward."""
        layer = transformer_layer_profile(
            batch=1, seq=4096, hidden=4096, heads=32, ffn=11008, flops_per_s=self.flops_per_s
        )
        return self.d2h_bandwidth * layer.forward_s / layer.saved_bytes


GPU_REFERENCE = GpuReference()


def pcie_like_bandwidths(
    saved_bytes: float, forward_s: float, reference: GpuReference = GPU_REFERENCE
) -> tuple[float, float, str]:
    """D2H and H2D bandwidths that give this machine's layer the GPU reference's copy-to-compute ratio.

    A PCIe Gen5 link next to an H200-class GPU moves about 44 % of a LLaMA-7B layer's
    saved activations during that layer's forward; the fake link is set to move the same
    share of *this* layer's saved bytes in *this* layer's measured forward time (H2D at
    the reference's 35/53 of D2H). Returns ``(d2h, h2d, explanation)``.

    >>> d2h, h2d, why = pcie_like_bandwidths(saved_bytes=4e6, forward_s=0.01)
    >>> round(d2h / 1e6), round(h2d / d2h, 3)
    (176, 0.66)
    """
    if not (saved_bytes > 0 and forward_s > 0):
        raise ConfigurationError("scaling the link needs a layer with saved bytes and a positive forward time")
    fraction = reference.d2h_fraction()
    d2h = fraction * saved_bytes / forward_s
    h2d = d2h * reference.h2d_bandwidth / reference.d2h_bandwidth
    why = (
        f"next to an {reference.name}, the link copies {fraction:.0%} of what a {reference.layer} saves in the time "
        f"of that layer's forward; here a layer saves {format_bytes(int(saved_bytes))} in a {forward_s * 1e3:.1f} ms "
        f"forward, so the fake link gets the same ratio: D2H {format_bandwidth(d2h)}, H2D {format_bandwidth(h2d)}"
    )
    return d2h, h2d, why


_PROBE_STEPS = 2  # full steps a max-batch probe runs (Note [The max batch is probed by real steps])
_PROBE_ESTIMATE = 2  # probes a strategy usually needs (the progress bar's estimate)
_PROBE_LIMIT = 12  # probes before the search gives up (the extrapolation stands)
_PROBE_MAX_FACTOR = 8  # batches above this multiple of --batch are not probed (too slow; extrapolated)
_OVERHEAD_PAIRS = 7  # timed pairs of (1, 2 micro-batches) steps, after one warm-up pair


_KIND_ROUNDS = 5  # timed rounds (one step of each variant) after two warm-up rounds


@dataclass(frozen=True)
class CompareSettings:
    """The fixed workload, the strategies and the compared device (see ``offcore compare --help``)."""

    backend: str = "cpu"
    dtype: str = "float32"
    batch: int = 8
    seq_len: int = 64
    layers: int = 4
    d_model: int = 64
    heads: int = 4
    vocab: int = 256
    dropout: float = 0.0
    warmup: int = 1
    iters: int = 3
    seed: int = 0
    lr: float = 1e-3
    strategies: tuple[str, ...] = STRATEGIES
    capacity: int | None = None
    capacity_fraction: float = 0.7
    d2h_bandwidth: float | None = None
    h2d_bandwidth: float | None = None
    latency_s: float = 10e-6
    observe: bool = True
    sanitize: bool = False
    threads: int | None = None
    budget_fraction: float | None = None
    planner_headroom: float = 0.0
    nvme_path: str | None = None
    """A directory on an NVMe disk: the row ``optimizer-offload-nvme`` runs there (skipped without it)."""
    probe_max_batch: bool = True
    """Measure each strategy's max batch by real steps (Note [The max batch is probed by real steps]);
    ``False`` (``--no-probe-max-batch``): the two-point extrapolation instead."""

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        for name in ("batch", "seq_len", "layers", "d_model", "heads", "vocab", "iters"):
            positive(name)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigurationError(f"--warmup must be an integer >= 0, got {self.warmup!r}")
        if self.dtype not in DTYPES:
            raise ConfigurationError(f"--dtype {self.dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
        if self.d_model % self.heads:
            raise ConfigurationError(f"--d-model {self.d_model} must be divisible by --heads {self.heads}")
        if self.layers < 2:
            raise ConfigurationError(
                f"--layers must be at least 2 (the plan acts on a stack of blocks), got {self.layers}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigurationError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 < self.capacity_fraction < 1.0:
            raise ConfigurationError(f"the capacity fraction must be in (0, 1), got {self.capacity_fraction!r}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ConfigurationError(
                f"unknown strategies {unknown or '(none given)'}: choose from {', '.join(STRATEGIES)}"
            )
        if self.budget_fraction is not None and not 0.0 < self.budget_fraction <= 1.0:
            raise ConfigurationError(f"budget_fraction must be in (0, 1], got {self.budget_fraction!r}")
        if not 0.0 <= self.planner_headroom < 0.5:
            raise ConfigurationError(f"planner_headroom must be in [0, 0.5), got {self.planner_headroom!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ConfigurationError(f"--threads must be a positive integer, got {self.threads!r}")
        if self.backend != "cpu" and (self.d2h_bandwidth is not None or self.h2d_bandwidth is not None):
            raise ConfigurationError(
                f"--d2h-bandwidth / --h2d-bandwidth set the fake device's emulated link; the {self.backend} backend "
                "uses its hardware link (drop them)"
            )

    @property
    def needs_overhead(self) -> bool:
        """Whether the micro-batch overhead is measured (accumulation possible and used)."""
        return self.batch % 2 == 0 and bool({"accumulate", "planned"} & set(self.strategies))

    @property
    def needs_kind_overheads(self) -> bool:
        """Whether the optimizer-offload / parameter-streaming runtimes' overheads are measured (a strategy uses them)."""
        return bool(
            {"optimizer-offload", "optimizer+activation-offload", "param-stream", "planned"} & set(self.strategies)
        )

    @property
    def profile_steps(self) -> int:
        """Steps of the reference phase: the reference run, the profiled step, the overhead runs."""
        kinds = 3 * (_KIND_ROUNDS + 2) if self.needs_kind_overheads else 0
        return self.warmup + self.iters + 1 + (2 * (_OVERHEAD_PAIRS + 1) if self.needs_overhead else 0) + kinds

    @property
    def total_steps(self) -> int:
        """Every training step the comparison runs (for a progress bar)."""
        reprofile = 1 if self.backend == "cpu" else 0
        return self.profile_steps + len(self.strategies) * (self.steps_per_strategy + reprofile + self.probe_steps)

    @property
    def probe_steps(self) -> int:
        """The steps one strategy's max-batch probes count for on a progress bar (their usual number)."""
        return _PROBE_ESTIMATE * _PROBE_STEPS if self.probe_max_batch else 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def steps_per_strategy(self) -> int:
        return self.warmup + self.iters + (1 if self.observe else 0)

    def workload(self) -> dict[str, Any]:
        return {
            "model": "TinyGPT",
            "layers": self.layers,
            "d_model": self.d_model,
            "heads": self.heads,
            "vocab": self.vocab,
            "dropout": self.dropout,
            "dtype": self.dtype,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "warmup": self.warmup,
            "iters": self.iters,
            "seed": self.seed,
            "optimizer": f"AdamW(lr={self.lr:g})",
        }


def _make_device(settings: CompareSettings, **options: Any) -> Any:
    if settings.backend == "cpu":
        options.setdefault("sanitize", settings.sanitize)
        return offcore.device("cpu", **options)
    options.pop("d2h_bandwidth", None)
    options.pop("h2d_bandwidth", None)
    options.pop("latency", None)
    return offcore.device(settings.backend, **options)


def build_workload(settings: CompareSettings) -> Workload:
    """The fixed TinyGPT workload of ``settings`` (model builder, batches, loss)."""
    config = GPTConfig(
        vocab_size=settings.vocab,
        d_model=settings.d_model,
        n_heads=settings.heads,
        n_layers=settings.layers,
        seq_len=settings.seq_len,
        dropout=settings.dropout,
    )
    return gpt_workload(config, batch_size=settings.batch, data_seed=settings.seed)
