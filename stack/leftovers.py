"""What a `quilt up` leaves running if it dies hard, and how it is found and stopped.

The launcher records every process it is responsible for (its children's process groups, the
embedded Redis and Postgres servers) in `<data-dir>/stack.pids`, and holds `<data-dir>/quilt.lock`
for as long as it lives, so two launchers never share a data directory. A reaper (`stack.reaper`,
in a session of its own) waits for the launcher: if it dies without removing the record (SIGKILL,
the OOM killer), the reaper stops what the record names. A launcher that finds a record on start
(its reaper died too) stops those processes first.

A process is only signalled if it is still the one recorded (same pid and start time), so a pid
the system has reused is never touched.

What a child's process group holds once its leader is gone (vLLM's engine core and worker, and the
resource tracker of Python's multiprocessing) is ended by `end_group`, which lets the tracker
outlive the others (core.process_end): it is what unlinks the shared memory (`/dev/shm/psm_*`)
and named semaphores its dead clients leaked. Killed with them, those stay until reboot, a few
hundred MiB of address space per crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from core import process_end
from core.errors import Conflict

PIDS_FILE = "stack.pids"
LOCK_FILE = "quilt.lock"
STOP_GRACE_S = 10.0
# A tracker unlinks at once when its last client is gone; a killed engine takes a second or two to
# free its memory and be gone (1.5 s measured on the tiny model).
TRACKER_GRACE_S = 5.0
KILLED_GONE_S = 2.0


class DataDirInUse(Conflict):
    pass


@dataclass(frozen=True)
class Recorded:
    name: str
    pid: int
    started: float  # psutil create_time: tells a reused pid apart
    group: bool  # signal the whole process group (children started in sessions of their own)
    stop_signal: int = signal.SIGTERM


def record_of(name: str, pid: int, *, group: bool, stop_signal: int = signal.SIGTERM) -> Recorded:
    return Recorded(name, pid, psutil.Process(pid).create_time(), group, int(stop_signal))


def write(data_dir: Path, entries: list[Recorded]) -> None:
    path = data_dir / PIDS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(e) for e in entries]))
    os.replace(tmp, path)


def read(data_dir: Path) -> list[Recorded]:
    try:
        return [Recorded(**e) for e in json.loads((data_dir / PIDS_FILE).read_text())]
    except FileNotFoundError:
        return []


def pid_of(data_dir: Path, name: str) -> int:
    """The pid recorded for process `name` (a child's is its process group's); LookupError if
    none is (yet)."""
    for entry in read(data_dir):
        if entry.name == name:
            return entry.pid
    raise LookupError(f"no process {name!r} recorded in {data_dir}")


def kill_hard(data_dir: Path, name: str, *, wait_s: float = 30) -> int:
    """SIGKILL the recorded process `name` (a fault, as the OOM killer would) and wait until it is
    gone; returns its pid. The launcher restarts it."""
    pid = pid_of(data_dir, name)
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(timeout=wait_s)
    return pid


def clear(data_dir: Path) -> None:
    (data_dir / PIDS_FILE).unlink(missing_ok=True)


def _alive(entry: Recorded) -> psutil.Process | None:
    try:
        proc = psutil.Process(entry.pid)
        if abs(proc.create_time() - entry.started) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _signal(entry: Recorded, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if entry.group:
            os.killpg(entry.pid, sig)
        else:
            os.kill(entry.pid, sig)


def stop_recorded(data_dir: Path, *, grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop every recorded process still running (its stop signal, then SIGKILL after `grace_s`),
    remove the record; returns the names of those that were running."""
    entries = [(e, p) for e in read(data_dir) if (p := _alive(e)) is not None]
    for entry, _ in entries:
        _signal(entry, entry.stop_signal)
    deadline = time.monotonic() + grace_s
    for _entry, proc in entries:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            with contextlib.suppress(psutil.Error):
                proc.kill()  # the rest of its group goes next, its resource tracker last
        except psutil.Error:
            pass  # already gone
    for entry, _ in entries:
        if entry.group:  # anything its processes left in their group
            end_group(entry.pid)
    clear(data_dir)
    return [e.name for e, _ in entries]


def group_members(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group `pgid`."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def end_group(pgid: int, *, grace_s: float = TRACKER_GRACE_S) -> None:
    """SIGKILL what is left of process group `pgid` once its leader is gone or stopping, except
    multiprocessing's resource trackers, which are given `grace_s` to unlink what their killed
    clients leaked and exit by themselves; then SIGKILL whatever is still there."""
    trackers = process_end.kill_all_but_trackers(group_members(pgid))
    psutil.wait_procs(trackers, timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    psutil.wait_procs(group_members(pgid), timeout=KILLED_GONE_S)  # a SIGKILL is delivered, not done, on return


def shared_memory_of(pgid: int) -> set[str]:
    """The paths of the `multiprocessing.shared_memory` segments (`/dev/shm/psm_*`) that the
    processes of group `pgid` have mapped: what `end_group` must see unlinked after a crash."""
    paths: set[str] = set()
    for proc in group_members(pgid):
        with contextlib.suppress(psutil.Error):
            paths.update(m.path for m in proc.memory_maps() if m.path.startswith("/dev/shm/psm_"))
    return paths


def lock(data_dir: Path) -> int:
    """Take the data directory for this process's lifetime (the lock goes with the process)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DataDirInUse(f"another `quilt up` (pid {holder}) is running on {data_dir}; stop it first, or use "
                           "another --data-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
