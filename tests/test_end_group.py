"""`leftovers.end_group` ends what a dead child leaves in its process group, and lets the group's
multiprocessing resource tracker unlink the shared memory its killed clients made (as vLLM's
engine core and worker make theirs), instead of killing it with them and leaking `/dev/shm`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stack import leftovers

# A leader that makes a segment through a spawned child (which shares the leader's resource
# tracker, as vLLM's processes do), prints its name, and waits to be killed.
_GROUP = r"""
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def make(names):
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    names.put(segment.name)
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    names = ctx.Queue()
    ctx.Process(target=make, args=(names,)).start()
    print(names.get(), flush=True)
    time.sleep(600)
"""

# A leader that makes a segment itself (its resource tracker is then its only other process).
_ALONE = r"""
import time
from multiprocessing import shared_memory

segment = shared_memory.SharedMemory(create=True, size=1 << 20)
print(segment.name, flush=True)
time.sleep(600)
"""


def _start_group(tmp_path: Path, code: str = _GROUP) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "group.py"
    script.write_text(code)
    leader = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, leader.stdout.readline().strip()


def _members(pgid: int) -> list[int]:
    return [p.pid for p in leftovers.group_members(pgid)]


def test_a_dead_leaders_group_is_ended_and_its_shared_memory_unlinked(tmp_path):
    leader, name = _start_group(tmp_path)
    assert name.startswith("psm_") and Path("/dev/shm", name).exists()
    assert len(_members(leader.pid)) == 3  # the leader, its resource tracker, the segment's maker
    leader.kill()  # the crash: the group's other processes live on
    leader.wait()

    started = time.monotonic()
    leftovers.end_group(leader.pid)
    took = time.monotonic() - started

    assert _members(leader.pid) == []
    assert not Path("/dev/shm", name).exists(), "the segment leaked"
    assert took < leftovers.TRACKER_GRACE_S, "the tracker was waited out, not left to finish"


def test_a_group_whose_leader_is_stopping_is_ended_too(tmp_path):
    leader, name = _start_group(tmp_path, _ALONE)
    os.killpg(leader.pid, signal.SIGSTOP)  # even a group that answers nothing, its tracker included
    try:
        leftovers.end_group(leader.pid, grace_s=0.5)
        leader.wait()
        assert _members(leader.pid) == []
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)  # a stopped tracker cannot unlink it
