"""Small helpers for tests that speak raw HTTP to the stack (the SDK has its own tests)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from stack.ephemeral import free_port

TINY = "quilt/tiny-qwen3"
# A run inside another test's run (tests/test_tinker_sdk_pinned.py) uses that run's stack (conftest).
SHARED_STACK_ENV = "QUILT_TEST_SHARED_STACK"
ROOT = Path(__file__).resolve().parents[1]



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


def base_sampler(http: httpx.Client) -> str:
    """A new session's sampler on the tiny base: its sampling_session_id."""
    session = http.post("/create_session", json={}).json()["session_id"]
    r = http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": TINY})
    r.raise_for_status()
    return r.json()["sampling_session_id"]


def wait_future(client: httpx.Client, request_id: str, timeout_s: float = 300) -> dict:
    """Poll retrieve_future until the result or the failure arrives."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = client.post("/retrieve_future", json={"request_id": request_id})
        r.raise_for_status()
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise TimeoutError(f"future {request_id} not done in {timeout_s}s")


def new_model(client: httpx.Client, *, rank: int = 8, seed: int | None = 0, session_id: str | None = None,
              model_seq_id: int = 0) -> str:
    if session_id is None:
        session_id = client.post("/create_session", json={}).json()["session_id"]
    lora = {"rank": rank} | ({"seed": seed} if seed is not None else {})
    r = client.post("/create_model", json={"session_id": session_id, "model_seq_id": model_seq_id,
                                           "base_model": TINY, "lora_config": lora})
    r.raise_for_status()
    result = wait_future(client, r.json()["request_id"])
    assert "error" not in result, result
    return result["model_id"]


def datum(tokens: list[int], weights: list[float] | None = None) -> dict:
    n = len(tokens) - 1
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
            "weights": {"data": weights if weights is not None else [1.0] * n, "dtype": "float32", "shape": [n]},
        },
    }


def fb_body(model_id: str, seq_id: int, data: list[dict], loss_fn: str = "cross_entropy", **extra) -> dict:
    return {"model_id": model_id, "seq_id": seq_id,
            "forward_backward_input": {"data": data, "loss_fn": loss_fn, **extra}}


ADAM = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@contextlib.contextmanager
def second_api(stack, log_dir: Path, **env: str) -> Iterator[str]:
    """The base URL of another API process on the session stack's Postgres and Redis, with settings
    of its own (`env`: QUILT_* variables the shared stack does not set); stopped after the block."""
    port = free_port()
    full_env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
                "QUILT_DATA_DIR": str(stack.data_dir), "HF_HUB_OFFLINE": "1", **env}
    full_env.pop("QUILT_STRIPE_API_KEY", None)
    log_path = log_dir / f"api-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app", "--host",
                             "127.0.0.1", "--port", str(port), "--no-proxy-headers"], cwd=ROOT, env=full_env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/api/v1/healthz", timeout=5).status_code in (200, 503):
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def mint_token(stack, key: str, ttl_s: int = 900) -> str:
    """An auth token for `key`, signed as `POST /api/v1/auth/token` signs one (the server's keys,
    made if none exist yet, derived for tokens): the session stack keeps the exchange off, but
    every API process checks the tokens it is sent."""
    import asyncio

    import psycopg
    from psycopg.rows import dict_row

    from core.signing_keys import signing_keys
    from tenancy import tokens
    from tenancy.auth import authenticate

    async def mint() -> str:
        async with await psycopg.AsyncConnection.connect(stack.database_url, row_factory=dict_row,
                                                         autocommit=True) as conn:
            who, _ = await authenticate(conn, key)
            keys = await signing_keys(conn, 86_400, b"embedded-insecure-secret")  # the test stack's secret
        return tokens.mint(keys.for_purpose(tokens.PURPOSE), who, ttl_s=ttl_s)

    return asyncio.run(mint())
