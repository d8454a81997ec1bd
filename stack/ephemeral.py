"""A throwaway embedded stack: `quilt up` in a temporary data directory, as a newcomer would run
it, healthy when the block starts, stopped (SIGTERM) and its directory removed when it ends. The
test session's stack, the fault-injection tests and the benchmarks that need a whole stack use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TINY = "quilt/tiny-qwen3"


@dataclass(frozen=True)
class RunningStack:
    base_url: str
    database_url: str
    redis_url: str
    data_dir: Path
    api_urls: tuple[str, ...] = ()  # every API replica's address, base_url first

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"


def free_port(consecutive: int = 1) -> int:
    """A loopback port with the `consecutive - 1` after it free too (API replicas take port + i)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for i in range(1, consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/api/v1/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def ephemeral_stack(env: dict[str, str] | None = None, startup_s: float = 600, *,
                    keep_logs: Path | None = None, setup: Sequence[Sequence[str]] = (),
                    parent: Path = Path("/tmp"), api_replicas: int = 1,
                    gen_replicas: int = 1, trainer_shards: int = 1, trainer_ranks: int = 1) -> Iterator[RunningStack]:
    """`env` is added to this process's environment for the stack; `keep_logs` receives a copy of
    the stack's logs when it stops (for a post-mortem); `setup` are `quilt` commands (argument
    lists) run in the data directory before `quilt up`, e.g. to add or remove base models;
    `parent` is where the data directory is made (a short path: Postgres' socket lives in it);
    `api_replicas` is `quilt up --api-replicas` (the block starts once all of them answer),
    `gen_replicas` its `--gen-replicas`, `trainer_shards` its `--trainer-shards`, `trainer_ranks` its
    `--trainer-ranks`."""
    data_dir = Path(tempfile.mkdtemp(prefix="qt-", dir=parent))
    full_env = {**os.environ, **(env or {}), "QUILT_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    full_env.pop("QUILT_DATABASE_URL", None)
    full_env.pop("QUILT_REDIS_URL", None)
    for command in setup:
        done = subprocess.run([sys.executable, "-m", "stack.cli", *command], cwd=ROOT, env=full_env,
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            shutil.rmtree(data_dir, ignore_errors=True)
            raise RuntimeError(f"quilt {' '.join(command)} failed:\n{done.stdout}{done.stderr}")
    with open(data_dir / "up.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stack.cli", "up", "--port", str(free_port(api_replicas)),
                                 "--api-replicas", str(api_replicas), "--gen-replicas", str(gen_replicas),
                                 "--trainer-shards", str(trainer_shards), "--trainer-ranks", str(trainer_ranks)],
                                cwd=ROOT,
                                env=full_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"quilt up exited:\n{(data_dir / 'up.out').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack in {data_dir} did not become healthy in {startup_s:.0f} s")
            state_file = data_dir / "stack.json"
            if state_file.exists():
                state = json.loads(state_file.read_text())
                if all(healthy(url) for url in state["api_urls"]):
                    break
            time.sleep(0.5)
        yield RunningStack(state["base_url"], state["database_url"], state["redis_url"], data_dir,
                           tuple(state["api_urls"]))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if keep_logs is not None and (data_dir / "logs").exists():
            shutil.copytree(data_dir / "logs", keep_logs, dirs_exist_ok=True)
        shutil.rmtree(data_dir, ignore_errors=True)


def new_tenant(stack: RunningStack, name: str, **quota) -> tuple[str, str]:
    """(tenant id, API key) of a new tenant, with the quotas given."""
    from core import db
    from tenancy.keys import create_key
    from tenancy.tenants import create_tenant, set_quota

    with db.connect(stack.database_url) as conn:
        tenant = create_tenant(conn, f"{name}-{int(time.time() * 1000) % 10**8}")
        key, _ = create_key(conn, tenant.id)
        if quota:
            set_quota(conn, tenant.name, **quota)
    return tenant.id, key
