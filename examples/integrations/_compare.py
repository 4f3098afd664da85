"""Shared by the examples' ``__main__``: compare the runs with and without offcore bit for bit."""

from __future__ import annotations

from typing import Any

import torch


def same(a: Any, b: Any) -> bool:
    """Bit-identical: tensors by ``torch.equal`` (and dtype), floats by ``==``, containers element-wise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def differences(results: dict[bool, Any]) -> list[str]:
    """What differs between the run without offcore (``results[False]``) and with it (``results[True]``)."""
    without, with_ = results[False], results[True]
    out = []
    for phase, (a, b) in enumerate(zip(without, with_, strict=True)):
        for key in a:
            if not same(a[key], b[key]):
                out.append(f"{'resumed ' if phase else ''}{key}: {_show(a[key])} != {_show(b[key])}")
    return out


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return f"{len(value)} tensors"
    return repr(value)


def report(results: dict[bool, Any]) -> int:
    diff = differences(results)
    for line in diff:
        print("DIFFERS", line)
    a = results[False][0]
    print(f"losses {a['losses']}\ngrad norms {a.get('grad_norms')}")
    print("bit-identical" if not diff else f"{len(diff)} differences")
    return 1 if diff else 0
