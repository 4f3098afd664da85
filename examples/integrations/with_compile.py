"""torch.compile with offcore: a model compiled whole (``fullgraph=True``) with activation offload and
``OffloadOptimizer``.

    python examples/integrations/with_compile.py [aot_eager|inductor]

offcore's hooks stay out of the compiled graph (no graph break, no recompile after the first step): the
activation region's saved tensors are packed when the compiled graph runs, and the optimizer's waits for its
uploads happen at the compiled module's call. A tiny Llama trains 4 steps with and without offcore (a
checkpoint after step 2, then a resume) and every number is compared bit for bit. Lines marked ``# offcore``
are the user code; the shared set-up is in ``_scaffold.py``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import offcore_torch
import torch
from _scaffold import checkpointed_loop, fake_device, run_both, tiny_llama


def train(use_offcore: bool, out: str, resume: bool = False, backend: str = "aot_eager") -> dict[str, Any]:
    dev = fake_device()
    model = dev.adopt(tiny_llama())
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with dev:
        if use_offcore:
            opt = offcore_torch.OffloadOptimizer(model.parameters(), torch.optim.AdamW, device=dev, lr=1e-2)  # offcore
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train_step(ids: torch.Tensor) -> tuple[torch.Tensor, None]:
            region = offcore_torch.offload_activations(dev) if use_offcore else contextlib.nullcontext()  # offcore
            with region:
                loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss, None

        return checkpointed_loop(model, opt, out, resume, train_step)


def run(backend: str = "aot_eager") -> dict[bool, Any]:
    """Both runs, and a resume of each from its step-2 checkpoint: {with offcore: (full run, resumed run)}."""
    return run_both(train, backend=backend)


if __name__ == "__main__":
    from _compare import report

    # inductor's CPU kernels for the embedding's backward sum in a thread-dependent order: without offcore two
    # runs on 2 threads differ already; on one thread the comparison is meaningful
    torch.set_num_threads(1)
    sys.exit(report(run(sys.argv[1] if len(sys.argv) > 1 else "aot_eager")))
