"""pytest plugin that ``hw_check.py`` loads into its suite runs (``-p _hw_check_pytest``).

pytest writes its junit file only when the run ends, and has no per-test time-out of its
own, so a hung test on new hardware would cost the whole suite phase and leave no counts.
This plugin, configured through the environment by ``hw_check.py``:

- appends one JSON line per event to ``$HW_CHECK_PROGRESS`` as it happens (``collected``,
  ``start`` and ``done`` of each test with its outcome, ``finished``), flushed at once,
  so a run killed part-way still says what ran and how it went;
- gives each test ``$HW_CHECK_TEST_TIMEOUT`` seconds: then SIGALRM raises
  :class:`TestTimedOut` inside the test (it fails, the run goes on); a test stuck where
  no signal gets through (inside a C call) is ended ``$HW_CHECK_TIMEOUT_GRACE`` seconds
  later by a watchdog thread that records it and exits the process with status 70 --
  ``hw_check.py`` then starts pytest again without the tests already done;
- deselects the node ids listed in ``$HW_CHECK_DESELECT`` (one per line): the tests a
  previous, killed run already finished;
- exits (status 71) when its parent, pid ``$HW_CHECK_PARENT_PID``, is gone: a killed
  ``hw_check.py`` leaves no pytest behind holding the device.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest

WATCHDOG_EXIT = 70  # the process ended a test stuck past its time-out (hw_check.py resumes)
ORPHAN_EXIT = 71  # hw_check.py is gone


class TestTimedOut(Exception):  # noqa: N818 -- named for what the report shows
    """Raised inside a test that ran past its time-out."""

    __test__ = False  # not a test class


class _Progress:
    def __init__(self, path: str | None, timeout: float, grace: float) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 -- open for the run
        self._lock = threading.Lock()
        self.timeout = timeout
        self.grace = grace
        self.current: tuple[str, float] | None = None  # (node id, monotonic start)
        self.outcomes: dict[str, tuple[str, str]] = {}  # node id -> (outcome, message)
        self.timed_out: set[str] = set()

    def write(self, **event: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": round(time.time(), 3), **event}, default=str) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


_state: _Progress | None = None


def _watchdog(state: _Progress, parent: int | None) -> None:
    """End the process when a test is stuck past time-out + grace where SIGALRM cannot reach it,
    or when the parent died (this process was re-parented)."""
    while True:
        time.sleep(0.2)
        if parent is not None and os.getppid() != parent:
            state.write(event="orphaned", parent=parent)
            os._exit(ORPHAN_EXIT)
        current = state.current
        if current is None or state.timeout <= 0:
            continue
        nodeid, started = current
        if time.monotonic() - started > state.timeout + state.grace:
            state.write(event="done", nodeid=nodeid, outcome="timeout", killed=True,
                        message=f"still running {state.timeout + state.grace:g} s after it started "
                                "(stuck where SIGALRM does not reach); the process was ended")  # fmt: skip
            os._exit(WATCHDOG_EXIT)


def pytest_configure(config: pytest.Config) -> None:
    global _state
    timeout = float(os.environ.get("HW_CHECK_TEST_TIMEOUT", "0") or 0)
    grace = float(os.environ.get("HW_CHECK_TIMEOUT_GRACE", "") or max(2.0, 0.25 * timeout))
    _state = _Progress(os.environ.get("HW_CHECK_PROGRESS"), timeout, grace)
    parent = int(os.environ["HW_CHECK_PARENT_PID"]) if os.environ.get("HW_CHECK_PARENT_PID") else None
    if timeout > 0 or parent is not None:
        threading.Thread(target=_watchdog, args=(_state, parent), name="hw_check watchdog", daemon=True).start()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state is not None:
        _state.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get("HW_CHECK_DESELECT")
    if not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as fh:
        done = {line.strip() for line in fh if line.strip()}
    keep = [item for item in items if item.nodeid not in done]
    dropped = [item for item in items if item.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    if _state is not None:
        _state.write(event="collected", count=len(session.items), pid=os.getpid())


def _on_alarm(signum: int, frame: Any) -> None:
    if _state is not None and _state.current is not None:
        _state.timed_out.add(_state.current[0])
    raise TestTimedOut(f"test ran past its {_state.timeout if _state else 0:g} s time-out")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    state = _state
    if state is None:
        yield
        return
    state.write(event="start", nodeid=item.nodeid)
    state.current = (item.nodeid, time.monotonic())
    alarm = state.timeout > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    previous = None
    if alarm:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, state.timeout)
    try:
        yield
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        state.current = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    state = _state
    if state is None:
        return
    outcome, message = state.outcomes.get(report.nodeid, ("passed", ""))
    wasxfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            outcome = "xpassed" if wasxfail else "passed"
        elif report.skipped:
            outcome = "xfailed" if wasxfail else "skipped"
        else:
            outcome = "failed"
    elif report.failed:  # setup or teardown
        outcome = "error"
    elif report.skipped and report.when == "setup":
        outcome = "xfailed" if wasxfail else "skipped"
    if report.failed or (report.skipped and not message):
        text = report.longreprtext or ""
        message = text[-600:] if report.failed else text[:300]
    state.outcomes[report.nodeid] = (outcome, message)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    state = _state
    if state is None:
        return
    outcome, message = state.outcomes.pop(nodeid, ("passed", ""))
    if nodeid in state.timed_out:
        outcome = "timeout"
    state.write(event="done", nodeid=nodeid, outcome=outcome, message=message)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _state is not None:
        _state.write(event="finished", exitstatus=int(exitstatus))
