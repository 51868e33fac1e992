"""Servers started for tests and benchmarks do not outlive the process that started them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
import pytest

PARENT = textwrap.dedent(
    """
    import sys, time
    from vllm.benchmarks.server import popen_session
    child = popen_session([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("how", ["kill", "terminate"])
def test_a_session_child_ends_when_its_starter_is_killed(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        assert child.ppid() == parent.pid
        getattr(parent, how)()  # SIGKILL or SIGTERM: the starter runs no clean-up either way
        parent.wait(10)
        child.wait(10)  # psutil.TimeoutExpired if it is still there
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and child.is_running():
            child.kill()
        parent.stdout.close()
