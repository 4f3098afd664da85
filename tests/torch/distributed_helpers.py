"""Run a function on N ranks of a real process group (gloo on the loopback address) and collect results.

Each rank is a fresh process (``multiprocessing`` spawn), joins a process group on
``127.0.0.1`` at a free port, gets its own offcore device (a sanitized fake device on the
CPU; ``cuda:<rank>`` / ``npu:<rank>`` on hardware with nccl / hccl), runs
``fn(ctx, **kwargs)`` and returns what it returned (tensors included) to the parent. The
group runs under a deadline: when it passes, or when one rank fails (the others would wait
in a collective), every rank still alive is killed, and the failure names the rank and
carries its traceback. Nothing outlives :func:`run_ranks`.

    >>> results = run_ranks(losses_of_one_step, backend_name="cpu", steps=2)   # doctest: +SKIP
    >>> results[0]["losses"] == results[1]["losses"]                            # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 180.0
"""Whole-group deadline (process start and torch import included); collectives time out earlier."""

_COLLECTIVE_TIMEOUT_S = 60.0

_DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class RankFailed(AssertionError):
    """A rank raised, crashed, or the group ran past its deadline."""


@dataclass
class RankContext:
    """What a rank function gets: its rank, the world size and the offcore backend under test."""

    rank: int
    world_size: int
    backend_name: str
    dist_backend: str

    @property
    def kind(self) -> str:
        return self.backend_name.split(":")[0]

    def make_device(self, **options: Any) -> Any:
        """This rank's own device: a sanitized fake device (``options`` apply), or accelerator ``rank``."""
        import offcore

        if self.kind == "cpu":
            return offcore.device("cpu", sanitize=True, **{"capacity": "2GiB", **options})
        return offcore.device(f"{self.kind}:{self.rank}")

    def place(self, module: torch.nn.Module, device: Any) -> torch.nn.Module:
        """``module`` on ``device``: adopted by a fake device (counted as its memory), moved elsewhere."""
        if self.kind == "cpu":
            return device.adopt(module)
        return module.to(device.torch_device)

    @property
    def mesh_device_type(self) -> str:
        return "cpu" if self.kind == "cpu" else self.kind


def dist_backend_for(backend_name: str) -> str | None:
    """The ``torch.distributed`` backend for an offcore backend (None: none known)."""
    return _DIST_BACKENDS.get(backend_name.split(":")[0])


def skip_reason(backend_name: str, world_size: int = 2) -> str | None:
    """Why ``world_size`` ranks cannot run on ``backend_name`` here (None: they can)."""
    import torch.distributed as dist

    kind = backend_name.split(":")[0]
    if not dist.is_available():
        return "torch.distributed is not available"
    backend = dist_backend_for(backend_name)
    if backend is None:
        return f"no torch.distributed backend known for offcore backend {backend_name!r}"
    if kind == "cuda" and torch.cuda.device_count() < world_size:
        return f"{world_size} ranks need {world_size} CUDA devices, found {torch.cuda.device_count()}"
    if kind == "npu":
        count = getattr(getattr(torch, "npu", None), "device_count", lambda: 0)()
        if count < world_size:
            return f"{world_size} ranks need {world_size} NPUs, found {count}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name == "lo" or name.startswith("lo")), None)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend_name: str,
    out_dir: str,
    kwargs: dict[str, Any],
) -> None:
    """The body of one rank's process: join the group, run ``fn``, save its result (or traceback)."""
    import torch.distributed as dist

    loopback = _loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    out = Path(out_dir)
    dist_backend = dist_backend_for(backend_name) or "gloo"
    try:
        if dist_backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            dist_backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S),
        )
        try:
            result = fn(RankContext(rank, world_size, backend_name, dist_backend), **kwargs)
        finally:
            dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None


def _kill(procs: list[Any]) -> None:
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.kill()
    for proc in started:
        proc.join(timeout=30)


def run_ranks(
    fn: Callable[..., Any],
    *,
    backend_name: str = "cpu",
    world_size: int = 2,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(ctx: RankContext, **kwargs)`` on ``world_size`` ranks; the list of their results, by rank.

    ``fn`` must be a module-level function (it is pickled into spawned processes) and its
    result picklable by ``torch.save``. Raises :class:`RankFailed` with the failing rank's
    traceback, or when the group runs past ``timeout`` seconds; every rank is gone on return.
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="offcore-ranks-") as out_dir:
        port = _free_port()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, backend_name, out_dir, kwargs),
                name=f"offcore-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.start()
            running = {proc.sentinel: proc for proc in procs}
            while running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankFailed(
                        f"{fn.__name__} on {world_size} ranks ran past its {timeout:.0f} s deadline; "
                        f"ranks {sorted(procs.index(p) for p in running.values())} still running were killed"
                        + _errors(out_dir, world_size)
                    )
                for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
                    proc = running.pop(sentinel)
                    proc.join()
                    if proc.exitcode != 0:
                        rank = procs.index(proc)
                        raise RankFailed(
                            f"rank {rank} of {fn.__name__} exited with code {proc.exitcode}"
                            + _errors(out_dir, world_size)
                        )
        finally:
            _kill(procs)
        return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _errors(out_dir: str, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = Path(out_dir) / f"rank{rank}.err"
        if path.exists():
            parts.append(f"\n--- rank {rank} ---\n{path.read_text()}")
    return "".join(parts)


def fingerprint(tensors: Any) -> list[bytes]:
    """The exact bytes of each tensor (bit-identity across processes, NaN payloads included)."""
    return [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


# -- models and engines shared by the distributed tests ----------------------------------------------------------

TINY_GPT = {"vocab_size": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "seq_len": 16}


def tinygpt(*, checkpoint: bool) -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int, int], Any]]:
    """TinyGPT (tied head, dropout), its loss and a batch maker ``(step, rank) -> batch`` (each rank its own data)."""
    from offcore_torch.models import GPTConfig, gpt_workload

    work = gpt_workload(GPTConfig(**TINY_GPT), batch_size=4, checkpoint_blocks=checkpoint)
    model = work.build(0)

    def batch(step: int, rank: int) -> Any:
        return work.make_batch(2 * step + rank, torch.device("cpu"))

    return model, work.loss, batch


def hf_gpt2(*, checkpoint: bool) -> tuple[torch.nn.Module, Callable[..., Any], Callable[[int, int], Any]]:
    """A small Hugging Face GPT-2 (dropout on; ``gradient_checkpointing_enable``), its loss and batches."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return m(input_ids=b[0], labels=b[0]).loss

    def batch(step: int, rank: int) -> Any:
        gen = torch.Generator().manual_seed(7919 * (2 * step + rank) + 1)
        return (torch.randint(0, 64, (4, 16), generator=gen),)

    return model, loss, batch


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 shards one by one (TinyGPT or GPT-2)."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return list(model.transformer.h)


def wrap(ctx: RankContext, model: torch.nn.Module, engine: str, **options: Any) -> torch.nn.Module:
    """``model`` (already on the rank's device) under ``engine``: ``"ddp"`` or ``"fsdp"`` (fully_shard per block, then root)."""
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, **options)
    if engine == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.mesh_device_type, (ctx.world_size,))
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh, **options)
        return fully_shard(model, mesh=mesh, **options)
    raise ValueError(f"unknown engine {engine!r}")


def local_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's parameters: the local shard of a DTensor, the tensor itself otherwise."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
