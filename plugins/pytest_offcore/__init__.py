"""pytest plugin: run tests on every offcore backend, or the ones you choose.

Installed with offcore (entry point ``pytest11``), so it is active in any pytest run:

- ``--offcore-backend=NAME[,NAME]``: the backends to test (default: every registered
  one). Repeatable; a name may carry an index (``cuda:1``). A name no plugin registered
  (or an empty one) is a usage error listing the registered names; a registered backend
  that cannot run here is skipped (or failed, see the next option).
- ``--offcore-require-backend``: fail, instead of skip, when a selected backend cannot
  run here (``tox -e cuda`` uses it, so a GPU job never passes by skipping).
- ``backend`` fixture: an :func:`offcore.device` instance, parametrised over the
  selected backends; unavailable ones skip with the registry's reason.
- ``backend_name`` fixture: the name of the backend under test.
- marker ``@pytest.mark.offcore_backend("cpu", "cuda", capacity="64MiB")``: run only
  on these backends (intersected with the selection); keyword arguments become
  device options.
- test classes may set ``backend_spec`` (run on that backend only) and
  ``backend_options`` (device options), as :class:`offcore.testing.BackendConformance` does.

Example::

    def test_roundtrip(backend):
        stream = backend.new_stream()
        ...

    $ pytest --offcore-backend=cpu
    $ pytest --offcore-backend=cuda --offcore-require-backend

The plugin imports neither torch nor any backend when pytest loads it; backends are
imported when a test first asks for one -- except that when the ``cpu`` backend is selected
and torch is installed, the session starts by building (first run on a machine, ~40 s, with
a progress line) or loading the CPU fake device's allocator hook, so no test's own timeout
absorbs the build (Note [Building the allocator hook] in ``offcore_cpu/tracking.py``);
``OFFCORE_CPU_ACCOUNTING=dispatch`` skips it.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["BackendSelection", "selection"]

_MARKER = "offcore_backend"
_NAME_FIXTURE = "_offcore_backend_spec"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("offcore", "offcore backends")
    group.addoption(
        "--offcore-backend",
        action="append",
        default=None,
        metavar="NAME[,NAME]",
        help="offcore backends to test (comma-separated, repeatable; default: every registered backend)",
    )
    group.addoption(
        "--offcore-require-backend",
        action="store_true",
        default=False,
        help="fail instead of skipping when a selected offcore backend is unavailable here",
    )


@pytest.hookimpl(trylast=True)  # after conftests' own pytest_configure, which may register backends
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(*names, **options): run only on these offcore backends; keyword arguments are device options",
    )
    _check_selection(config)


def _check_selection(config: pytest.Config) -> None:
    """An explicit ``--offcore-backend`` must name registered backends (else a green run of skips).

    Raises:
        pytest.UsageError: an empty or malformed name, or a backend no plugin registered.
    """
    raw = config.getoption("--offcore-backend")
    if not raw:
        return
    import offcore
    from offcore.registry import broken_plugins, parse_device_spec

    known = sorted(info.name for info in offcore.backends())
    listing = ", ".join(known) or "none"
    names = selection(config).names
    if not names:
        raise pytest.UsageError(
            f"--offcore-backend={','.join(raw)!r} names no backend; give one or more of: {listing} "
            "(comma-separated), or leave the option out to test every registered backend"
        )
    unknown: list[str] = []
    for spec in names:
        try:
            name, _ = parse_device_spec(spec)
        except offcore.OffcoreError as exc:
            raise pytest.UsageError(f"--offcore-backend: {exc}") from None
        if name not in known:
            unknown.append(spec)
    if unknown:
        broken = broken_plugins()
        failed = [f"{n!r} failed to load: {broken[_base(n)]}" for n in unknown if _base(n) in broken]
        raise pytest.UsageError(
            f"--offcore-backend: unknown backend{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"registered backends: {listing}" + (f" ({'; '.join(failed)})" if failed else "")
        )


def _base(spec: str) -> str:
    return spec.partition(":")[0]


def pytest_sessionstart(session: pytest.Session) -> None:
    _prepare_cpu_accounting(session.config)


def _prepare_cpu_accounting(config: pytest.Config) -> None:
    """Build (or load the cached build of) the CPU fake device's allocator hook once, before any test.

    Spawned ranks of distributed tests find the build in the extension cache and only load it.
    """
    if os.environ.get("OFFCORE_CPU_ACCOUNTING", "") == "dispatch":
        return
    # Not selection(config) when no backend is named: it would fix the list of registered backends
    # before conftests and test modules register theirs.
    if config.getoption("--offcore-backend"):
        if not selection(config).allows("cpu"):
            return
    else:
        import offcore

        if "cpu" not in {info.name for info in offcore.backends()}:
            return
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("offcore_cpu") is None:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "offcore: loading the CPU fake device's allocator hook (the first run on a machine compiles it, ~40 s)"
        )
    started = time.perf_counter()
    from offcore_cpu import tracking

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # reported below instead
        hook = tracking.allocator_hook()
    if reporter is not None:
        took = time.perf_counter() - started
        if hook is not None:
            reporter.write_line(f"offcore: allocator hook ready ({took:.1f} s)")
        else:
            reporter.write_line(
                f"offcore: allocator hook unavailable ({tracking.allocator_hook_error()}); "
                "accounting='auto' uses the dispatch reference"
            )


@dataclass
class BackendSelection:
    """The backends a pytest run tests, and whether an unavailable one is an error."""

    names: list[str]
    explicit: bool
    require: bool

    def allows(self, spec: str) -> bool:
        return _base(spec) in {_base(n) for n in self.names}

    def describe(self) -> str:
        return ",".join(self.names) or "none"


_SELECTION_KEY = pytest.StashKey[BackendSelection]()


def selection(config: pytest.Config) -> BackendSelection:
    """The run's backend selection (``--offcore-backend``, or every registered backend)."""
    cached = config.stash.get(_SELECTION_KEY, None)
    if cached is not None:
        return cached
    raw = config.getoption("--offcore-backend")
    require = bool(config.getoption("--offcore-require-backend"))
    if raw:
        names = [n.strip() for value in raw for n in value.split(",") if n.strip()]
        result = BackendSelection(list(dict.fromkeys(names)), explicit=True, require=require)
    else:
        import offcore

        result = BackendSelection([info.name for info in offcore.backends()], explicit=False, require=require)
    config.stash[_SELECTION_KEY] = result
    return result


def _unavailable_reason(spec: str) -> str | None:
    """None when ``spec``'s backend can run here, else the registry's reason (never raises)."""
    import offcore
    from offcore.registry import parse_device_spec

    try:
        name, _ = parse_device_spec(spec)
        info = next((i for i in offcore.backends() if i.name == name), None)
        if info is None:
            offcore.get_backend_class(name)  # raises with the list of registered backends
            return f"backend {name!r} is not registered"
        status = info.availability()
    except offcore.OffcoreError as exc:
        return str(exc)
    return None if status.available else f"backend {name!r} is unavailable: {status.reason}"


def _skip_or_fail(config: pytest.Config, reason: str) -> None:
    if selection(config).require:
        pytest.fail(f"{reason} (--offcore-require-backend is set)", pytrace=False)
    pytest.skip(reason)


def pytest_report_header(config: pytest.Config) -> list[str]:
    chosen = selection(config)
    lines = []
    for spec in chosen.names:
        reason = _unavailable_reason(spec)
        lines.append(f"  {spec}: " + ("available" if reason is None else f"UNAVAILABLE ({reason})"))
    mode = "required" if chosen.require else "skipped when unavailable"
    return [f"offcore backends ({'--offcore-backend' if chosen.explicit else 'all registered'}, {mode}):", *lines]


def _marker_names(node: Any) -> list[str]:
    names: list[str] = []
    for mark in node.iter_markers(_MARKER):
        names.extend(str(a) for a in mark.args)
    return names


def _marker_options(node: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for mark in reversed(list(node.iter_markers(_MARKER))):  # closest marker wins
        options.update(mark.kwargs)
    return options


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if _NAME_FIXTURE not in metafunc.fixturenames:
        return
    chosen = selection(metafunc.config)
    class_spec = getattr(metafunc.cls, "backend_spec", None) if metafunc.cls is not None else None
    wanted = _marker_names(metafunc.definition)
    if class_spec:
        candidates = [class_spec]
    elif wanted:
        candidates = [n for n in chosen.names if _base(n) in {_base(w) for w in wanted}] or wanted
    else:
        candidates = list(chosen.names)
    params = []
    for spec in candidates:
        if chosen.allows(spec):
            params.append(pytest.param(spec, id=spec))
        else:
            reason = f"backend {spec!r} not selected (--offcore-backend={chosen.describe()})"
            params.append(pytest.param(spec, id=spec, marks=pytest.mark.skip(reason=reason)))
    if not params:
        reason = "no offcore backend is registered or selected"
        params.append(pytest.param("none", id="no-backend", marks=pytest.mark.skip(reason=reason)))
    metafunc.parametrize(_NAME_FIXTURE, params, indirect=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests with the marker but without the ``backend`` fixture run only when a named backend can."""
    wanted = _marker_names(item)
    if not wanted or _NAME_FIXTURE in getattr(item, "fixturenames", ()):
        return
    chosen = selection(item.config)
    selected = [w for w in wanted if chosen.allows(w)]
    if not selected:
        pytest.skip(f"needs offcore backend {' or '.join(wanted)}; selected: {chosen.describe()}")
    reasons = [_unavailable_reason(w) for w in selected]
    if all(reasons):
        _skip_or_fail(item.config, "; ".join(r for r in reasons if r))


@pytest.fixture
def _offcore_backend_spec(request: pytest.FixtureRequest) -> str:
    spec = getattr(request, "param", None)
    if spec is None:  # pragma: no cover - every user is parametrised by pytest_generate_tests
        names = selection(request.config).names
        if not names:
            pytest.skip("no offcore backend is registered or selected")
        spec = names[0]
    return str(spec)


@pytest.fixture
def backend_name(request: pytest.FixtureRequest, _offcore_backend_spec: str) -> str:
    """The backend under test (``"cpu"``, ``"cuda:1"``, ...); skips (or fails) when it cannot run here."""
    reason = _unavailable_reason(_offcore_backend_spec)
    if reason is not None:
        _skip_or_fail(request.config, reason)
    return _offcore_backend_spec


@pytest.fixture
def backend(request: pytest.FixtureRequest, backend_name: str) -> Iterator[Any]:
    """An :func:`offcore.device` of the backend under test, with the test class's ``backend_options``.

    Options come from the class attribute ``backend_options`` and then the
    ``offcore_backend`` marker's keyword arguments. The device is synchronized (and
    closed, when it has ``close()``) after the test.
    """
    import offcore

    options: dict[str, Any] = dict(getattr(request.cls, "backend_options", None) or {})
    options.update(_marker_options(request.node))
    try:
        device = offcore.device(backend_name, **options)
    except offcore.BackendUnavailableError as exc:
        _skip_or_fail(request.config, str(exc))
    try:
        yield device
    finally:
        try:
            device.synchronize()  # surfaces a failure of work the test left queued
        finally:
            close = getattr(device, "close", None)
            if callable(close):
                close()
