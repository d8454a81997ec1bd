"""Ending processes among which Python's multiprocessing may have a resource tracker.

vLLM's engine makes shared memory segments (`/dev/shm/psm_*`) and named semaphores, registered
with the resource tracker of the process that started it. The tracker unlinks whatever its
clients leaked once every one of them has gone; killed along with them, those stay until reboot.
So the others are killed first and the tracker is spared to finish: `stack.leftovers.end_group`
waits for it, and a worker ending its own engine just exits, which is the tracker's cue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import psutil

_TRACKER = "multiprocessing.resource_tracker"  # in its command line from Python 3.8 to 3.13


def _is_resource_tracker(proc: psutil.Process) -> bool:
    try:
        return any(_TRACKER in arg for arg in proc.cmdline())
    except psutil.Error:
        return False


def kill_all_but_trackers(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each of `procs` except resource trackers, which are returned, spared."""
    trackers = []
    for proc in procs:
        if _is_resource_tracker(proc):
            trackers.append(proc)
        else:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    return trackers
