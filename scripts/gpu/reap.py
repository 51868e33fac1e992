"""Run a command under a time limit, then end every process it left behind.

    python3 scripts/gpu/reap.py SECONDS COMMAND [ARG...]

This process makes itself a child subreaper (Linux ``prctl``), so the command's orphans
re-parent to it instead of init: a ``vllm serve`` a test or script started in a session
of its own (``start_new_session``) stays findable by pid after the command died. On the
time limit (or SIGTERM/SIGINT to this process) the command gets SIGTERM, then SIGKILL 15 s
later; then every remaining descendant gets SIGTERM, then SIGKILL. Exit status: the
command's, 124 on the time limit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
TIMED_OUT = 124


def descendants(root: int) -> list[int]:
    """Pids below ``root`` in the process tree (read from /proc), children first."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier]
        found += children
        frontier = children
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_leftovers(grace_s: float = 10.0) -> None:
    reap_zombies()  # orphans that already exited
    left = [p for p in descendants(os.getpid()) if not _zombie(p)]
    if not left:
        return
    for pid in left:
        print(f"[reap] ending leftover pid {pid}: {_cmdline(pid)}", file=sys.stderr, flush=True)
    signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap_zombies()
        left = [p for p in left if os.path.exists(f"/proc/{p}") and not _zombie(p)]
        if not left:
            return
        time.sleep(0.2)
    signal_all(descendants(os.getpid()), signal.SIGKILL)
    time.sleep(0.5)
    reap_zombies()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    limit = float(argv[0])
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("[reap] prctl(PR_SET_CHILD_SUBREAPER) failed: orphans escape", file=sys.stderr)
    proc = subprocess.Popen(argv[1:])

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        print(f"[reap] {argv[1]} timed out after {limit:g} s", file=sys.stderr, flush=True)
        stop(proc)
        rc = TIMED_OUT
    except KeyboardInterrupt:
        stop(proc)
        rc = 130
    finally:
        end_leftovers()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
