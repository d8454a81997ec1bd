"""CPU priority of the processes `quilt up` starts.

Linux shares a core first between autogroups, then between the threads inside each. With
autogroups on (`/proc/sys/kernel/sched_autogroup_enabled`, the default of most distributions'
kernels), every session is one, and each child of the launcher starts a session of its own. A
thread's nice value then ranks it only against its own session: a trainer whose threads are all
at nice 19 still weighs as much as Postgres or Redis on a shared core, and a store woken by a
statement waits for it. What does rank sessions against each other is the autogroup's own nice
value (`/proc/<pid>/autogroup`), which any process may raise for its own session.

Measured on this project's two-core host (a thread asking to wake every millisecond, pinned to a
core with four busy processes in sessions of their own): woken late by p99 7.8 ms with everything
at nice 0; p99 11.0 ms with the busy ones at SCHED_IDLE, which compares groups, not threads, and
so made it worse; p99 0.13 ms with their autogroups at nice 10, as with 19; p99 2.5 ms at 5.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def set_nice(pid: int, nice: int, *, threads: bool = False) -> None:
    """Give process `pid` the nice value `nice`, for its session's autogroup and for its main
    thread, or with `threads` for every thread it has now (a thread started later inherits its
    starter's). Raising a nice value needs no privilege; lowering one does, and where it is
    refused, or the process has gone, or the kernel has no autogroups, what could not be set is
    left as it was."""
    tids = [pid]
    if threads:
        with contextlib.suppress(FileNotFoundError):  # gone: the main thread's call below finds that out
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    with contextlib.suppress(OSError):  # no such file without CONFIG_SCHED_AUTOGROUP
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def group_nice(pid: int) -> int | None:
    """The nice value of `pid`'s autogroup, None where the kernel has none."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()  # "/autogroup-123 nice 10"
    except OSError:
        return None
    return int(text.split()[-1])
