"""Devices for the PyTorch tests: fake devices with emulated links, built from the ``backend`` fixture.

The tests run on every backend the ``backend`` fixture yields. On the CPU fake device
they also vary the emulated link (bandwidth and latency) and always run with the
sanitizer on (every fixture asserts it: :func:`assert_sanitized`), so a missing wait, a
buffer freed while a copy still uses it, or a torch operator touching bytes of a copy in
flight (``check_ops``) gives NaNs and a recorded violation, which every fixture checks at
teardown (:func:`finish_device`). On real accelerators the link
is the hardware's, so the emulated variants skip with that reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import offcore  # noqa: E402
from offcore import Capability  # noqa: E402

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # bit-identical cuBLAS runs on CUDA

LINKS: dict[str, dict[str, Any]] = {
    # copies take no emulated time: what is left is the plugin's own machinery
    "unlimited": {"h2d_bandwidth": "inf", "d2h_bandwidth": "inf", "latency": 0},
    # slow enough that copies are still in flight when the next op runs
    "slow": {"h2d_bandwidth": "1GiB/s", "d2h_bandwidth": "1GiB/s", "latency": "100us"},
}


def is_fake_device(backend: Any) -> bool:
    """True for the CPU fake device, whose capacity and link can be chosen per test."""
    return getattr(backend, "name", None) == "cpu"


def assert_sanitized(device: Any) -> Any:
    """Fail unless a fake device runs its sanitizer (poison, jitter, use-after-free checks); returns it."""
    if is_fake_device(device):
        assert Capability.SANITIZER in device.capabilities and device.options.sanitize, (
            f"{device!r}: the PyTorch tests run the fake device with its sanitizer on; without it a missing "
            "wait or an early free passes unnoticed"
        )
        assert device.options.check_ops, (
            f"{device!r}: the PyTorch tests check torch operators against the copies in flight (check_ops=True); "
            "without it an operator reading a copy's destination too early only computes NaN"
        )
    return device


def finish_device(device: Any) -> None:
    """Teardown of a test's device: open its gates, let its copies land, fail on any sanitizer violation, close it."""
    try:
        if is_fake_device(device):
            device.open_gates()  # a failed test must not leave a stream held
        device.synchronize()
        if is_fake_device(device):
            device.check_sanitizer()  # raises SanitizerViolation naming every early free it saw
    finally:
        close = getattr(device, "close", None)
        if callable(close):
            close()


def take_in_place_writes_of_saved_tensors(device: Any) -> list[dict[str, Any]]:
    """Take (clear and return) the sanitizer's reports of an in-place write to a tensor whose device-to-host
    copy was still in flight -- and fail on any other violation.

    For tests whose *program* writes a saved tensor in place (forward after saving it, or a custom
    Function's backward after unpacking it) while offcore's copy of it may still be in flight: on a GPU
    that copy would read torn bytes, and the sanitizer says so (Note [Operators checked against copies in
    flight]). Whether the copy is still in flight at that moment is timing (jitter), so the report may or
    may not be there; offcore never uses such a host copy (the saved tensor's version changed: backward
    raises SavedTensorModifiedError, or the device original is reused). A no-op off the fake device.
    """
    if not is_fake_device(device):
        return []
    found = device.sanitizer_violations(clear=True)
    races = [
        v
        for v in found
        if (v["kind"], v.get("access"), v["side"], v["direction"]) == ("access-in-flight", "write", "source", "d2h")
    ]
    assert len(races) == len(found), [v for v in found if v not in races]
    return races


def fake_device(*, capacity: int | str = "4GiB", link: str = "unlimited", **options: Any) -> Any:
    """A CPU fake device with the sanitizer on and one of the :data:`LINKS`."""
    if options.pop("sanitize", True) is not True:
        raise AssertionError("the PyTorch tests never turn the fake device's sanitizer off")
    return assert_sanitized(offcore.device("cpu", capacity=capacity, sanitize=True, **{**LINKS[link], **options}))


def device_with_link(backend: Any, link: str, make: Callable[..., Any] = fake_device) -> Any:
    """``backend`` itself on real hardware (only the 'unlimited' slot runs there); on the fake
    device a fresh sanitized fake device with the requested emulated link, made by ``make``
    (the ``make_fake_device`` fixture, which closes it after the test)."""
    if is_fake_device(backend):
        return make(link=link)
    if link != "unlimited":
        pytest.skip(f"emulated link {link!r} exists only on the fake device; {backend.name} uses its own hardware link")
    return backend
