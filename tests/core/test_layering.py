"""Layering: the core imports neither backends nor plugins; backends never reach into each other.

Checked statically on the import statements (lazy imports inside functions included),
so a violation fails here even when the code path is never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"offcore_cpu", "offcore_cuda", "offcore_npu"}
SHARED = {"offcore_accelerator"}  # the torch-accelerator base the CUDA and NPU adapters share (backends layer)
PLUGINS = {"offcore_torch", "pytest_offcore"}


def imported_top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", sources("offcore"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_no_backend_and_no_plugin(path: Path) -> None:
    bad = imported_top_level_names(path) & (BACKENDS | SHARED | PLUGINS)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the core may import neither backends nor plugins"


@pytest.mark.parametrize("path", sources("offcore"), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_shipped_test_kit_touches_torch(path: Path) -> None:
    if "testing" in path.relative_to(ROOT / "offcore").parts:
        pytest.skip("offcore.testing builds torch buffers for torch backends, lazily")
    assert "torch" not in imported_top_level_names(path), f"{path.relative_to(ROOT)} imports torch"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_backend_never_reaches_into_another(backend: str) -> None:
    for path in sources(f"backends/{backend}"):
        bad = imported_top_level_names(path) & (BACKENDS - {backend})
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("package", sorted(BACKENDS | SHARED))
def test_the_backends_layer_imports_no_plugin(package: str) -> None:
    paths = sources(f"backends/{package}")
    assert paths, f"backends/{package} has no sources"
    for path in paths:
        bad = imported_top_level_names(path) & PLUGINS
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: backends sit below plugins"


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from offcore_torch import x\n    import torch.nn\n")
    assert imported_top_level_names(module) == {"offcore_torch", "torch"}
