"""`quilt up` killed hard leaves nothing running, two launchers never share a data directory,
SIGTERM stops the stack within a stated time, and a dead trainer leaves health within 3 s.

Runs its own short-lived stacks (not the session's): each is killed long before its generation
worker has loaded, since what matters is what the launcher started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import redis
from stackutil import ROOT

from core import health
from stack import leftovers, priority
from stack.ephemeral import free_port

pytestmark = pytest.mark.stack


def _launch(data_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "QUILT_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    env.pop("QUILT_DATABASE_URL", None)
    env.pop("QUILT_REDIS_URL", None)
    with open(data_dir / "up.out", "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "stack.cli", "up", "--port", str(free_port())], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def _recorded_with_children(data_dir: Path, timeout_s: float = 180, *,
                            not_from: list[leftovers.Recorded] = ()) -> list[leftovers.Recorded]:
    """The launcher's record once it names its children (and is not the `not_from` record)."""
    old = {e.pid for e in not_from}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = leftovers.read(data_dir)
        names = {e.name for e in entries}
        if {"redis", "postgres", "api"} <= names and not old & {e.pid for e in entries}:
            return entries
        time.sleep(0.2)
    raise TimeoutError(f"no complete process record in {data_dir}")


def _running(entries: list[leftovers.Recorded]) -> list[str]:
    out = []
    for e in entries:
        try:
            p = psutil.Process(e.pid)
            if abs(p.create_time() - e.started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                out.append(e.name)
        except psutil.Error:
            pass
    return out


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _wait_gone(entries, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (alive := _running(entries)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _reaper_of(launcher_pid: int) -> psutil.Process:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "stack.reaper" in cmd and str(launcher_pid) in cmd:
            return p
    raise LookupError("no reaper")


def test_a_hard_killed_launcher_leaves_nothing_running():
    data_dir = Path(tempfile.mkdtemp(prefix="qd-", dir="/tmp"))
    first = _launch(data_dir)
    try:
        entries = _recorded_with_children(data_dir)
        # A second launcher on the same directory refuses at once.
        second = subprocess.run([sys.executable, "-m", "stack.cli", "up", "--port", str(free_port())], cwd=ROOT,
                                env={**os.environ, "QUILT_DATA_DIR": str(data_dir)}, capture_output=True, text=True,
                                timeout=60)
        assert second.returncode != 0 and "another `quilt up`" in second.stderr, second.stderr
        assert _running(entries) == [e.name for e in entries]  # and disturbed nothing

        # SIGKILL: the reaper stops everything the launcher recorded, removes the record, exits.
        reaper = _reaper_of(first.pid)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert _wait_gone(entries) == []
        reaper.wait(timeout=60)  # it clears the record after its last process is gone
        assert not (data_dir / leftovers.PIDS_FILE).exists()

        # The launcher and its reaper both killed: the next launcher stops the leftovers first.
        first = _launch(data_dir)
        entries = _recorded_with_children(data_dir)
        reaper = _reaper_of(first.pid)
        reaper.kill()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        time.sleep(1)
        assert set(_running(entries)) >= {"redis", "postgres"}  # nobody cleaned up yet
        gen_logs = {p: p.stat().st_size for p in (data_dir / "logs").glob("gen-*.log")}
        first = _launch(data_dir)
        fresh = _recorded_with_children(data_dir, not_from=entries)
        assert _running(entries) == []
        assert {e.pid for e in fresh}.isdisjoint({e.pid for e in entries})

        # A dead trainer's health key is gone within its TTL, however long a round would run.
        trainer = next(e for e in fresh if e.name.startswith("trainer:"))
        base = trainer.name.removeprefix("trainer:")
        state = json.loads((data_dir / "stack.json").read_text()) if (data_dir / "stack.json").exists() else None
        deadline = time.monotonic() + 180
        while state is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if (data_dir / "stack.json").exists():
                state = json.loads((data_dir / "stack.json").read_text())
        client = redis.Redis(unix_socket_path=state["redis_url"].removeprefix("unix://"))
        while client.get(health.trainer_key(base)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        beacon = json.loads(client.get(health.trainer_key(base)))
        assert beacon["pid"] == trainer.pid
        os.kill(trainer.pid, signal.SIGKILL)
        killed = time.monotonic()
        while client.get(health.trainer_key(base)) is not None:
            time.sleep(0.05)
        shown_dead_s = time.monotonic() - killed
        print(f"trainer killed: health key gone after {shown_dead_s:.2f} s (TTL {health.HEALTH_TTL_S} s)")

        # SIGTERM stops the whole stack, in a time a supervisor can wait for: no child waits out
        # the launcher's grace, not even a generation worker whose engine is still starting.
        gen = next(e for e in fresh if e.name.startswith("gen:"))
        deadline = time.monotonic() + 120
        while not psutil.Process(gen.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)  # its engine's processes are starting
        gen_log = next((data_dir / "logs").glob("gen-*.log"))
        with open(gen_log, "rb") as f:  # what this launch's worker wrote
            f.seek(gen_logs.get(gen_log, 0))
            engine_state = "up" if b"ready" in f.read() else "starting"
        gen_group = leftovers.group_members(gen.pid)
        segments = leftovers.shared_memory_of(gen.pid)
        started = time.monotonic()
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
        stop_s = time.monotonic() - started
        print(f"quilt up stopped {stop_s:.1f} s after SIGTERM (engine {engine_state})")
        launcher_log = (data_dir / "up.out").read_text(errors="replace")
        assert "did not stop" not in launcher_log, launcher_log[-3000:]
        assert _wait_gone(fresh, timeout_s=10) == []
        assert _live(gen_group) == []
        assert [s for s in segments if os.path.exists(s)] == []
        assert first.returncode == 0
    finally:
        if first.poll() is None:
            first.kill()
        leftovers.stop_recorded(data_dir, grace_s=5)
        shutil.rmtree(data_dir, ignore_errors=True)


def test_workers_yield_the_cpu_to_the_api_and_the_stores(monkeypatch):
    """`quilt up` gives its workers QUILT_WORKER_NICE, for their main thread (which every later
    thread inherits) and, where the kernel has autogroups, for their session's: a thread's own
    value ranks it only inside its session (stack.priority). The API and the stores keep 0."""
    data_dir = Path(tempfile.mkdtemp(prefix="qn-", dir="/tmp"))
    monkeypatch.setenv("QUILT_WORKER_NICE", "7")  # _launch passes this process's environment on
    up = _launch(data_dir)
    try:
        entries = {e.name: e.pid for e in _recorded_with_children(data_dir)}
        workers = [name for name in entries if name.startswith(("trainer:", "gen:", "celery"))]
        assert {"celery"} < set(workers) and any(n.startswith("trainer:") for n in workers), entries
        for name, pid in entries.items():
            want = 7 if name in workers else 0
            assert os.getpriority(os.PRIO_PROCESS, pid) == want, name
            assert priority.group_nice(pid) in (want, None), name
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
        leftovers.stop_recorded(data_dir, grace_s=5)
        shutil.rmtree(data_dir, ignore_errors=True)
