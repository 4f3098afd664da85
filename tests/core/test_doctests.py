"""The examples in every public docstring run and print what they say.

Runs ``doctest`` on the installed modules (so it works the same from a wheel in tox);
modules that need torch are skipped where torch is not installed (``tox -e core``).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from types import ModuleType

import pytest

PACKAGES = ("offcore", "offcore_cpu", "offcore_cuda", "offcore_npu", "offcore_torch", "pytest_offcore")
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.submodule_search_locations is None:
            continue
        names.append(package)
        found = pkgutil.walk_packages(spec.submodule_search_locations, prefix=f"{package}.")
        names += [info.name for info in found if not info.name.endswith(".__main__")]  # runs the CLI on import
    return sorted(names)


# what a module may need that an env may not have (offcore_torch.integrations: the stacks, in tox -e integrations)
_OPTIONAL = {"torch", "torch_npu", "matplotlib", "tqdm", "scipy", "transformers", "accelerate", "pytorch_lightning"}


def _import(name: str) -> ModuleType:
    if not HAVE_TORCH and name.split(".")[0] == "offcore_torch":
        pytest.skip("the PyTorch binding's examples need torch")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in _OPTIONAL:
            pytest.skip(f"{name} needs {exc.name}")
        raise


@pytest.mark.parametrize("name", module_names())
def test_docstring_examples(name: str) -> None:
    module = _import(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (see above)"


def test_the_modules_are_found() -> None:
    names = module_names()
    assert {"offcore", "offcore.units", "offcore_cpu"} <= set(names)
    if HAVE_TORCH:
        assert "offcore_torch.activations.offload" in names
