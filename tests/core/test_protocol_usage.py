"""The backend protocol is what the code uses.

Every member the conformance suite, the framework bindings and the core call on a
device object is declared: a member of :class:`offcore.protocols.Backend`, or an
optional member of :data:`offcore.protocols.OPTIONAL_MEMBERS`. The conformance suite
calls an optional member only in a test that checks the capability promising it.

Checked statically (``ast``) on every attribute read from an expression that names a
device: ``backend``, ``device``, ``dev`` (or ``self.`` one of them, with or without a
leading underscore), and ``type(...)`` of one. A new call to an undeclared member fails
here until it is added to the protocol (and so to every backend) or declared optional.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from offcore.protocols import OPTIONAL_MEMBERS, Backend, Capability

ROOT = Path(__file__).resolve().parents[2]
CONFORMANCE = ROOT / "offcore" / "testing" / "conformance.py"
DEVICE_NAMES = {"backend", "device", "dev"}
NOT_A_DEVICE = {
    # ``device`` there is a row of the comparison table (a dict), not a backend
    ROOT / "offcore" / "comparison.py",
}


def protocol_members(cls: type) -> set[str]:
    """The members a Protocol class declares: annotated attributes and methods (dunders: only ``with``)."""
    names = set(getattr(cls, "__annotations__", {}))
    names |= {name for name, value in vars(cls).items() if callable(value) or isinstance(value, classmethod)}
    return {n for n in names if not n.startswith("_") or n in ("__enter__", "__exit__")}


def _names_a_device(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in DEVICE_NAMES
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr.lstrip("_") in DEVICE_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" and node.args:
        return _names_a_device(node.args[0])
    return False


def device_members_used(path: Path) -> Iterator[tuple[str, int, ast.AST]]:
    """``(member, line, enclosing top-level function or class)`` for each device attribute read in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for top in tree.body:
        for node in ast.walk(top):
            if isinstance(node, ast.Attribute) and _names_a_device(node.value) and not node.attr.startswith("__"):
                yield node.attr, node.lineno, _enclosing_function(top, node)


def _enclosing_function(top: ast.AST, target: ast.AST) -> ast.AST:
    """The innermost function around ``target`` inside ``top`` (or ``top`` itself)."""
    best = top
    for node in ast.walk(top):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is target for n in ast.walk(node)):
            if best is top or any(n is node for n in ast.walk(best)):
                best = node
    return best


def callers() -> list[Path]:
    paths = [CONFORMANCE, *sorted((ROOT / "offcore").rglob("*.py")), *sorted((ROOT / "plugins").rglob("*.py"))]
    return sorted(set(paths) - NOT_A_DEVICE)


REQUIRED = protocol_members(Backend)


def test_the_protocol_declares_what_is_expected() -> None:
    assert {"copy_", "allocate", "holds", "host_pool", "memory_stats", "new_stream", "current_stream"} <= REQUIRED
    assert not REQUIRED & set(OPTIONAL_MEMBERS), "an optional member is also a required one"
    for member, capability in OPTIONAL_MEMBERS.items():
        assert capability is None or isinstance(capability, Capability), member
        doc = Backend.__doc__ or ""
        assert f"``{member}" in doc, f"the Backend docstring does not document the optional member {member}"


@pytest.mark.parametrize("path", callers(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_device_member_called_is_declared(path: Path) -> None:
    undeclared = sorted(
        {
            f"{member} (line {line})"
            for member, line, _ in device_members_used(path)
            if member not in REQUIRED and member not in OPTIONAL_MEMBERS
        }
    )
    assert not undeclared, (
        f"{path.relative_to(ROOT)} uses device members outside the protocol: {undeclared}; add them to "
        "offcore.protocols.Backend (every backend must then provide them) or to OPTIONAL_MEMBERS with a capability"
    )


def test_the_conformance_suite_calls_optional_members_only_behind_their_capability() -> None:
    used = list(device_members_used(CONFORMANCE))
    assert {member for member, _, _ in used} >= {"copy_", "host_pool", "allocate", "capabilities", "availability"}
    for member, line, function in used:
        capability = OPTIONAL_MEMBERS.get(member)
        if capability is None:
            assert member in REQUIRED, f"conformance.py:{line} calls {member}, which a backend may lack"
            continue
        assert f"Capability.{capability.name}" in ast.unparse(function), (
            f"conformance.py:{line} uses {member} in {getattr(function, 'name', '?')} without checking "
            f"Capability.{capability.name}"
        )


def test_the_scanner_sees_device_attributes(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f(backend, self):\n"
        "    if Capability.TORCH in backend.capabilities:\n"
        "        backend.torch_device\n"
        "    type(backend).availability()\n"
        "    self._device.host_pool(1)\n"
        "    other.copy_()\n"
    )
    assert sorted(m for m, _, _ in device_members_used(source)) == [
        "availability",
        "capabilities",
        "host_pool",
        "torch_device",
    ]
