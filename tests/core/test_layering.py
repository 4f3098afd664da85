"""Layering: the core imports neither backends nor plugins; backends never reach into each other.

Checked statically on the import statements (lazy imports inside functions included),
so a violation fails here even when the code path is never run. The backends layer is
every package under ``backends/``: the device backends, and the shared packages below
them, each of which may import only the shared packages :data:`MAY_IMPORT` lists. Inside
every package, the modules' imports form no cycle, not even through the imports that only
annotations use (``if TYPE_CHECKING:``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"offcore_cpu", "offcore_cuda", "offcore_npu"}
SHARED = {
    "offcore_accelerator",  # the torch-accelerator base the CUDA and NPU adapters share
    "offcore_layout",  # how a copy between dtypes or shapes is read (every backend)
}
PLUGINS = {"offcore_torch", "pytest_offcore"}
MAY_IMPORT: dict[str, set[str]] = {
    "offcore_cpu": {"offcore_layout"},
    "offcore_cuda": {"offcore_accelerator"},
    "offcore_npu": {"offcore_accelerator"},
    "offcore_accelerator": {"offcore_layout"},
    "offcore_layout": set(),
}
"""The backends layer's whole dependency graph: which other packages of the layer each may import."""


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def _imports(path: Path, *, type_checking: bool = True) -> Iterator[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set() if type_checking else _type_checking_only(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            yield node


def imported_top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def packages(folder: str) -> list[str]:
    return sorted(p.name for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file())


# ------------------------------------------------------------------ between layers and packages


@pytest.mark.parametrize("path", sources("offcore"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_no_backend_and_no_plugin(path: Path) -> None:
    bad = imported_top_level_names(path) & (BACKENDS | SHARED | PLUGINS)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the core may import neither backends nor plugins"


@pytest.mark.parametrize("path", sources("offcore"), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_shipped_test_kit_touches_torch(path: Path) -> None:
    if "testing" in path.relative_to(ROOT / "offcore").parts:
        pytest.skip("offcore.testing builds torch buffers for torch backends, lazily")
    assert "torch" not in imported_top_level_names(path), f"{path.relative_to(ROOT)} imports torch"


def test_every_package_of_the_backends_layer_is_classified() -> None:
    found = set(packages("backends"))
    assert found == BACKENDS | SHARED == set(MAY_IMPORT), (
        f"backends/ holds {sorted(found)}; list each new package in BACKENDS or SHARED and in MAY_IMPORT"
    )
    assert set(packages("plugins")) == PLUGINS


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_backends_layer_package_imports_only_the_shared_packages_it_may(package: str) -> None:
    for path in sources(f"backends/{package}"):
        bad = imported_top_level_names(path) & (BACKENDS | SHARED) - {package} - MAY_IMPORT[package]
        assert not bad, (
            f"{path.relative_to(ROOT)} imports {sorted(bad)}: {package} may import only "
            f"{sorted(MAY_IMPORT[package]) or 'no other package'} of the backends layer"
        )


def test_shared_packages_sit_below_every_backend() -> None:
    for package in SHARED:
        assert not MAY_IMPORT[package] & BACKENDS, f"{package} is shared, so it may not depend on a backend"


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_the_backends_layer_imports_no_plugin(package: str) -> None:
    paths = sources(f"backends/{package}")
    assert paths, f"backends/{package} has no sources"
    for path in paths:
        bad = imported_top_level_names(path) & PLUGINS
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: backends sit below plugins"


# ------------------------------------------------------------------ inside one package


def module_graph(folder: Path, *, type_checking: bool = False) -> dict[str, set[str]]:
    """Package ``folder``'s modules and, for each, the modules of the same package it imports.

    Lazy imports inside functions count (they run as soon as the function does); imports
    under ``if TYPE_CHECKING:`` count only with ``type_checking=True``. ``from pkg import name``
    is an import of the submodule ``pkg.name`` when there is one, else of ``pkg`` itself.
    """
    package = folder.name
    modules: dict[str, Path] = {}
    for path in sorted(folder.rglob("*.py")):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _imports(path, type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join([*here[: len(here) - node.level + 1], *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


ALL_PACKAGES = [
    "offcore",
    *(f"backends/{p}" for p in packages("backends")),
    *(f"plugins/{p}" for p in packages("plugins")),
]


@pytest.mark.parametrize("folder", ALL_PACKAGES)
def test_no_import_cycle_inside_a_package(folder: str) -> None:
    graph = module_graph(ROOT / folder)
    assert len(graph) >= 1
    cycles = import_cycles(graph)
    assert not cycles, (
        f"import cycles in {folder}: {cycles}; move what both sides need into a module both import, "
        "or invert the dependency"
    )


@pytest.mark.parametrize("folder", ALL_PACKAGES)
def test_no_import_cycle_inside_a_package_even_for_annotations(folder: str) -> None:
    """A module that names, in its annotations only, a module importing it is still a circle of design.

    (activations/offload.py imports records.py and nvme.py, whose annotations named the region's
    class back; they now name the :class:`~offcore_torch.activations.records.Region` protocol.)
    """
    cycles = import_cycles(module_graph(ROOT / folder, type_checking=True))
    assert not cycles, (
        f"import cycles in {folder}, counting the imports under `if TYPE_CHECKING:`: {cycles}; "
        "name a Protocol of what the importing side needs in a module both import, or invert the dependency"
    )


def test_the_packages_modules_are_all_in_the_graph() -> None:
    graph = module_graph(ROOT / "plugins/offcore_torch")
    assert {"offcore_torch", "offcore_torch.activations.offload", "offcore_torch.compare.compare"} <= set(graph)
    assert "offcore_torch.activations.records" in graph["offcore_torch.activations.offload"]


def test_the_cycle_checker_finds_lazy_and_relative_cycles(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    # the shape offcore_cpu had: buffers imports torch_buffers lazily, torch_buffers imports buffers
    (package / "buffers.py").write_text("def ops():\n    from pkg.torch_buffers import OPS\n    return OPS\n")
    (package / "torch_buffers.py").write_text("from pkg.buffers import describe\n")
    (package / "sub" / "a.py").write_text("from . import b\n")
    (package / "sub" / "b.py").write_text("from ..sub.a import x\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import plain\n"
    )
    (package / "plain.py").write_text("import pkg.typed\n")
    assert import_cycles(module_graph(package)) == [["pkg.buffers", "pkg.torch_buffers"], ["pkg.sub.a", "pkg.sub.b"]]
    assert import_cycles(module_graph(package, type_checking=True)) == [
        ["pkg.buffers", "pkg.torch_buffers"],
        ["pkg.plain", "pkg.typed"],
        ["pkg.sub.a", "pkg.sub.b"],
    ]


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from offcore_torch import x\n    import torch.nn\n")
    assert imported_top_level_names(module) == {"offcore_torch", "torch"}
