"""The README's Python examples run as written, in order, on the CPU fake device.

The README shows one example per kind (activations, optimizer, parameters, NVMe); the examples
after the first continue it, so they run in one namespace, in order. The NVMe example's
directory (``/mnt/nvme`` in the README) is a temporary directory here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[2] / "README.md"
NVME_DIR = "/mnt/nvme"


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python blocks of ``text``, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.mark.offcore_backend("cpu")
def test_readme_examples_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    kinds = ["offload_activations", "OffloadOptimizer", "offload_parameters", "nvme_tier"]
    assert len(blocks) == len(kinds), f"expected one README example per kind {kinds}, found {len(blocks)} blocks"
    for block, kind in zip(blocks, kinds, strict=True):
        assert kind in block, f"the README example for {kind} does not call it"
    assert NVME_DIR in blocks[3]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    namespace: dict[str, object] = {"__name__": "readme"}
    for number, block in enumerate(blocks, start=1):
        code = block.replace(NVME_DIR, str(nvme))
        exec(compile(code, f"README.md (python example {number})", "exec"), namespace)
    out = capsys.readouterr().out
    offloaded = re.search(r"offloaded ([0-9.]+) MiB, stalls (\d+)", out)
    assert offloaded is not None and float(offloaded.group(1)) > 0, out
    streamed = re.search(r"prefetched in time (\d+), stalls (\d+)", out)
    assert streamed is not None and int(streamed.group(1)) > 0, out
    assert list(nvme.iterdir()) == [], "the NVMe tier left files behind after it was closed"
