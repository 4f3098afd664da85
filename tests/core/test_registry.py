"""The backend registry: entry points, third-party plugins, switches, broken plugins, device specs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import offcore
from offcore import Availability
from offcore.registry import broken_plugins, parse_device_spec, reset_registry

BUILTINS = {"cpu", "cuda", "npu"}


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """A registry that reloads entry points, and is reset again afterwards (no leaks into other tests)."""
    reset_registry()
    yield
    reset_registry()


class _Device:
    def __init__(self, index: int = 0, **options: Any) -> None:
        self.index = index
        self.options = options


class InlineDevice(_Device):
    name = "inline"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "", 2)


class ExplodingAvailability(_Device):
    name = "exploding"

    @classmethod
    def availability(cls) -> Availability:
        raise RuntimeError("driver crashed while probing")


class InlinePlugin:
    @offcore.hookimpl
    def offcore_register_backends(self, register: Any) -> None:
        register("inline", InlineDevice, description="an inline third-party backend")
        register("exploding", ExplodingAvailability)
        register("missing", "no_such_module_for_offcore:Device")


class CapacityCapPlugin:
    @offcore.hookimpl
    def offcore_configure_backend(self, name: str, options: dict[str, Any]) -> None:
        if name == "inline":
            options.setdefault("capacity", "1GiB")


# ----------------------------------------------------------------------------- in process


def test_entry_points_register_the_three_builtins(fresh_registry: None) -> None:
    infos = {info.name: info for info in offcore.backends()}
    assert BUILTINS <= set(infos)
    for name in BUILTINS:
        assert infos[name].plugin == name, "built-ins register through their own entry point"
        assert infos[name].description
        status = infos[name].availability()  # never raises, whatever this machine has
        assert isinstance(status, Availability)
        assert status.available or status.reason, f"{name} is unavailable without a reason"
    assert not {n for n in broken_plugins() if n in BUILTINS}


def test_inline_third_party_plugin(fresh_registry: None) -> None:
    offcore.register_plugin(InlinePlugin(), name="inline-plugin")
    offcore.register_plugin(CapacityCapPlugin(), name="capacity-cap")
    names = [info.name for info in offcore.backends()]
    assert {"inline", "exploding", "missing"} <= set(names) and names == sorted(names)
    device = offcore.device("inline:1", host_budget="2GiB")
    assert isinstance(device, InlineDevice) and device.index == 1
    assert device.options == {"host_budget": "2GiB", "capacity": "1GiB"}, "offcore_configure_backend amends options"
    assert offcore.get_backend_class("inline") is InlineDevice
    with pytest.raises(offcore.ConfigurationError, match="2 device"):
        offcore.device("inline:2")


def test_availability_that_raises_is_reported_unavailable(fresh_registry: None) -> None:
    offcore.register_plugin(InlinePlugin(), name="inline-plugin")
    info = next(i for i in offcore.backends() if i.name == "exploding")
    status = info.availability()
    assert not status.available and "driver crashed while probing" in status.reason
    with pytest.raises(offcore.BackendUnavailableError, match="driver crashed"):
        offcore.device("exploding")


def test_a_lazy_target_that_cannot_import_is_unavailable_with_a_hint(fresh_registry: None) -> None:
    offcore.register_plugin(InlinePlugin(), name="inline-plugin")
    info = next(i for i in offcore.backends() if i.name == "missing")
    status = info.availability()
    assert not status.available
    assert "no_such_module_for_offcore" in status.reason and "Hint:" in status.reason
    with pytest.raises(offcore.BackendUnavailableError, match="could not be loaded"):
        offcore.device("missing")


def test_unknown_backend_lists_the_registered_ones(fresh_registry: None) -> None:
    with pytest.raises(offcore.BackendUnavailableError) as caught:
        offcore.device("nosuch")
    message = str(caught.value)
    assert "'nosuch'" in message and "registered backends: cpu, cuda, npu" in message


def test_a_name_registered_twice_marks_the_second_plugin_broken(fresh_registry: None) -> None:
    class Impostor:
        @offcore.hookimpl
        def offcore_register_backends(self, register: Any) -> None:
            register("cpu", InlineDevice)

    offcore.backends()
    offcore.register_plugin(Impostor(), name="impostor")
    assert "registered by both" in broken_plugins()["impostor"]
    assert offcore.get_backend_class("cpu") is not InlineDevice


def test_invalid_backend_names_are_refused(fresh_registry: None) -> None:
    class BadName:
        @offcore.hookimpl
        def offcore_register_backends(self, register: Any) -> None:
            register("has space", InlineDevice)

    offcore.register_plugin(BadName(), name="bad-name")
    offcore.backends()
    assert "invalid backend name" in broken_plugins()["bad-name"]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("cpu", ("cpu", 0)), ("cuda:1", ("cuda", 1)), ("npu:0", ("npu", 0)), ("cuda:12", ("cuda", 12))],
)
def test_device_specs(spec: str, expected: tuple[str, int]) -> None:
    assert parse_device_spec(spec) == expected


@pytest.mark.parametrize("spec", ["cuda:x", "cuda:", "cuda:-1", "cuda:1:2", "cuda:1.0", "cuda:²", ":0", "", None, 3])
def test_bad_device_specs_are_configuration_errors(spec: Any) -> None:
    with pytest.raises(offcore.ConfigurationError) as caught:
        parse_device_spec(spec)
    assert repr(spec) in str(caught.value)
    with pytest.raises(offcore.ConfigurationError):
        offcore.device(spec)


# ----------------------------------------------------------------------------- subprocesses

PROBE = """
import json, sys
import offcore
from offcore.registry import broken_plugins
infos = offcore.backends()
result = {
    "names": [i.name for i in infos],
    "broken": broken_plugins(),
    "availability": {i.name: [i.availability().available, i.availability().reason] for i in infos
                     if i.name not in ("cuda", "npu")},
}
print(json.dumps(result))
"""

PLUGINS = {
    "exploding_offcore_plugin.py": 'raise ImportError("CANN toolkit not found (simulated)")\n',
    "misspelt_offcore_plugin.py": """
        import offcore

        @offcore.hookimpl
        def offcore_register_backend(register):  # missing 's': no such hook
            register("misspelt", "x:y")
    """,
    "badsig_offcore_plugin.py": """
        import offcore

        @offcore.hookimpl
        def offcore_register_backends(register, unknown_argument):
            register("badsig", "x:y")
    """,
    "thirdparty_offcore_plugin.py": """
        import offcore
        from offcore import Availability

        class ThirdParty:
            name = "thirdparty"
            @classmethod
            def availability(cls):
                return Availability(True, "", 1)
            def __init__(self, index=0, **options):
                self.options = options

        class Flaky:
            name = "flaky"
            @classmethod
            def availability(cls):
                raise OSError("libdriver.so: cannot open shared object file")

        @offcore.hookimpl
        def offcore_register_backends(register):
            register("thirdparty", ThirdParty)
            register("flaky", Flaky)
    """,
}


def _plugin_dir(root: Path) -> Path:
    dist = root / "offcore_test_plugins-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: offcore-test-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[offcore.backends]\n"
        "exploding = exploding_offcore_plugin\n"
        "misspelt = misspelt_offcore_plugin\n"
        "badsig = badsig_offcore_plugin\n"
        "thirdparty = thirdparty_offcore_plugin\n"
    )
    for filename, source in PLUGINS.items():
        (root / filename).write_text(textwrap.dedent(source))
    return root


def _run(code: str, *, pythonpath: Path | None = None, **env: str) -> Any:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OFFCORE_")}
    environment.update(env)
    if pythonpath is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), environment.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_broken_plugins_are_listed_and_break_nothing_else(tmp_path: Path) -> None:
    result = _run(PROBE, pythonpath=_plugin_dir(tmp_path))
    assert BUILTINS | {"thirdparty", "flaky"} <= set(result["names"])
    assert not {"misspelt", "badsig"} & set(result["names"])
    broken = result["broken"]
    assert "CANN toolkit not found (simulated)" in broken["exploding"]
    assert "offcore_register_backend" in broken["misspelt"]
    assert "unknown_argument" in broken["badsig"]
    assert result["availability"]["thirdparty"] == [True, ""]
    available, reason = result["availability"]["flaky"]
    assert not available and "libdriver.so" in reason
    assert result["availability"]["cpu"][0] or result["availability"]["cpu"][1]


def test_block_list_skips_entry_points(tmp_path: Path) -> None:
    result = _run(PROBE, pythonpath=_plugin_dir(tmp_path), OFFCORE_BACKEND_BLOCK="cuda, exploding,badsig")
    assert "cuda" not in result["names"] and {"cpu", "npu", "thirdparty"} <= set(result["names"])
    assert set(result["broken"]) == {"misspelt"}, "blocked entry points are not even imported"


def test_autoload_off_loads_no_entry_points_but_hand_registration_works(tmp_path: Path) -> None:
    code = PROBE.replace(
        "infos = offcore.backends()",
        "assert offcore.backends() == []\n"
        "import thirdparty_offcore_plugin\n"
        "offcore.register_plugin(thirdparty_offcore_plugin)\n"
        "infos = offcore.backends()\n"
        "assert type(offcore.device('thirdparty', x=1)).__name__ == 'ThirdParty'",
    )
    result = _run(code, pythonpath=_plugin_dir(tmp_path), OFFCORE_BACKEND_AUTOLOAD="0")
    assert result["names"] == ["flaky", "thirdparty"] and result["broken"] == {}


IMPORTS = """
import json, sys
import offcore
before = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "offcore_cpu", "offcore_cuda", "offcore_npu", "offcore_torch"})
offcore.backends()
after = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
print(json.dumps({"import": before, "listing": after}))
"""


def test_import_offcore_imports_neither_torch_nor_a_backend() -> None:
    result = _run(IMPORTS)
    assert result["import"] == [], f"`import offcore` imported {result['import']}"
    assert result["listing"] == [], f"listing the backends imported {result['listing']}: registration must be lazy"
