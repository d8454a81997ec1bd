"""Shared fixtures. `stack` runs the real embedded platform (`quilt up`: Postgres, Redis, API,
trainer, Celery) once per test session on a free port, in a short temporary data directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from stackutil import ROOT, free_port

STARTUP_TIMEOUT_S = 240


@dataclass(frozen=True)
class TenantHandle:
    name: str
    tenant_id: str
    key: str


@dataclass
class Stack:
    base_url: str
    data_dir: Path
    database_url: str
    redis_url: str
    log_dir: Path

    def create_tenant(self, prefix: str = "t") -> TenantHandle:
        from core import db
        from tenancy.keys import create_key
        from tenancy.tenants import create_tenant

        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        with db.connect(self.database_url) as conn:
            tenant = create_tenant(conn, name)
            secret, _ = create_key(conn, tenant.id)
        return TenantHandle(name, tenant.id, secret)

    def http(self, key: str | None) -> httpx.Client:
        headers = {"X-API-Key": key} if key else {}
        return httpx.Client(base_url=self.base_url + "/api/v1", headers=headers, timeout=60)

    def sdk(self, key: str):
        import quilt

        return quilt.Client(api_key=key, base_url=self.base_url)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))


def _wait_healthy(proc: subprocess.Popen, data_dir: Path, out_path: Path) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    state_file = data_dir / "stack.json"
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"quilt up exited with {proc.returncode}:\n{out_path.read_text()[-4000:]}")
        if state_file.exists():
            state = json.loads(state_file.read_text())
            try:
                last = httpx.get(state["base_url"] + "/api/v1/healthz", timeout=5)
                if last.status_code == 200:
                    return state
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"stack not healthy in {STARTUP_TIMEOUT_S}s; last healthz: {last and last.text}")


@pytest.fixture(scope="session")
def stack():
    # Short path: Postgres' Unix socket lives in the data directory and must stay under ~107 bytes.
    data_dir = Path(tempfile.mkdtemp(prefix="qt-", dir="/tmp"))
    out_path = data_dir / "up.out"
    # Requests behind a missing seq_id give up after 20 s here (default minutes), so a test can see it.
    env = {"QUILT_TRAINER_SEQ_GAP_DEADLINE_S": "20", **os.environ, "QUILT_DATA_DIR": str(data_dir),
           "HF_HUB_OFFLINE": "1"}
    env.pop("QUILT_DATABASE_URL", None)
    env.pop("QUILT_REDIS_URL", None)
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stack.cli", "up", "--port", str(free_port())],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        state = _wait_healthy(proc, data_dir, out_path)
        yield Stack(state["base_url"], data_dir, state["database_url"], state["redis_url"], data_dir / "logs")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        # Keep the processes' logs for a post-mortem (CI keeps artifacts/).
        artifacts = Path(os.environ.get("QUILT_TEST_ARTIFACTS") or ROOT / "artifacts")
        shutil.copytree(data_dir / "logs", artifacts / "stack-logs", dirs_exist_ok=True)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def tenant(stack) -> TenantHandle:
    return stack.create_tenant()
