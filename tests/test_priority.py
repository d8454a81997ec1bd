"""stack.priority: a process's nice value set for every thread it has, and for its session's
autogroup where the kernel has them."""

from __future__ import annotations

import os
import subprocess
import sys

from stack import priority

# Starts a second thread, says so, then waits: the threads' ids are then in /proc/<pid>/task.
_TWO_THREADS = "import threading, sys; threading.Thread(target=lambda: sys.stdin.read(), daemon=True).start(); " \
               "print('ready', flush=True); sys.stdin.read()"


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_every_thread_and_the_session_get_the_value():
    child = subprocess.Popen([sys.executable, "-c", _TWO_THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert len(_threads(child.pid)) == 2
        priority.set_nice(child.pid, 3, threads=True)
        assert [os.getpriority(os.PRIO_PROCESS, t) for t in _threads(child.pid)] == [3, 3]
        assert priority.group_nice(child.pid) in (3, None)  # None: a kernel without autogroups
        priority.set_nice(child.pid, 5)  # the main thread only, and the session
        assert sorted(os.getpriority(os.PRIO_PROCESS, t) for t in _threads(child.pid)) == [3, 5]
        assert priority.group_nice(child.pid) in (5, None)
    finally:
        child.kill()
        child.wait()


def test_a_process_that_has_gone_is_left_alone():
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    child.wait()
    priority.set_nice(child.pid, 4, threads=True)  # no error: the pid is reaped
    assert priority.group_nice(child.pid) is None
