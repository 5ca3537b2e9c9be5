"""The agent's hang watchdog: a process the kernel holds stopped for the timeout is frozen; a running, sleeping
or resumed one never is."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatier.launcher.watchdog import StoppedWatch, process_state

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def _state_becomes(pid: int, state: str) -> None:
    deadline = time.monotonic() + 10
    while process_state(pid) != state:
        assert time.monotonic() < deadline, (process_state(pid), state)
        time.sleep(0.01)


def test_a_process_stopped_for_the_timeout_is_frozen_and_a_resumed_one_starts_over(child):
    watch = StoppedWatch(4.0)
    _state_becomes(child.pid, "S")  # asleep in time.sleep: waiting is not frozen
    assert watch.frozen(child.pid, now=0.0) is None and watch.frozen(child.pid, now=100.0) is None
    os.kill(child.pid, signal.SIGSTOP)
    _state_becomes(child.pid, "T")
    assert watch.frozen(child.pid, now=100.0) is None  # first seen stopped
    assert watch.frozen(child.pid, now=103.9) is None
    assert watch.frozen(child.pid, now=104.0) == 4.0
    os.kill(child.pid, signal.SIGCONT)
    _state_becomes(child.pid, "S")
    assert watch.frozen(child.pid, now=105.0) is None
    os.kill(child.pid, signal.SIGSTOP)
    _state_becomes(child.pid, "T")
    assert watch.frozen(child.pid, now=106.0) is None  # stopped again: its clock starts over
    assert watch.frozen(child.pid, now=109.0) is None and watch.frozen(child.pid, now=110.0) == 4.0


def test_off_never_judges_and_a_gone_process_has_no_state(child):
    os.kill(child.pid, signal.SIGSTOP)
    _state_becomes(child.pid, "T")
    watch = StoppedWatch(0)
    assert watch.frozen(child.pid, now=0.0) is None and watch.frozen(child.pid, now=1e6) is None
    child.kill()
    child.wait()
    assert process_state(child.pid) is None and StoppedWatch(1.0).frozen(child.pid) is None
    with pytest.raises(ValueError, match="--hang-timeout-s -1 must be >= 0"):
        StoppedWatch(-1)


def test_a_command_name_with_spaces_and_parentheses_is_read_past(tmp_path):
    script = tmp_path / "a b) (c"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    process = subprocess.Popen([str(script)])
    try:
        _state_becomes(process.pid, "S")
    finally:
        process.kill()
        process.wait()
