"""Shared fixtures. `stack` runs the real embedded platform (`quilt up`: Postgres, Redis, API,
trainer, Celery) once per test session on a free port, in a short temporary data directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dashutil import chromium
from stackutil import ROOT, SHARED_STACK_ENV, Stack, TenantHandle

from core import redis_client
from stack.ephemeral import ephemeral_stack

# A loaded machine (several suites at once) starts the stack slower: QUILT_TEST_STARTUP_S waits longer.
STARTUP_TIMEOUT_S = float(os.environ.get("QUILT_TEST_STARTUP_S", "240"))




@pytest.fixture(scope="session")
def stack():
    shared = os.environ.get(SHARED_STACK_ENV)
    if shared:
        fields = json.loads(shared)
        yield Stack(**{k: Path(v) if k in ("data_dir", "log_dir") else v for k, v in fields.items()})
        return
    # Requests behind a missing seq_id give up after 20 s here (default minutes), so a test can see it.
    env = {"QUILT_TRAINER_SEQ_GAP_DEADLINE_S": os.environ.get("QUILT_TRAINER_SEQ_GAP_DEADLINE_S", "20"),
           # Every test logs in from 127.0.0.1 and the fuzzer fails logins by the hundred: the per-address
           # brake is tested on an API of its own (tests/test_members.py).
           "QUILT_LOGIN_FAILURES_PER_ADDRESS": "1000000"}
    # The processes' logs are kept for a post-mortem (CI keeps artifacts/).
    artifacts = Path(os.environ.get("QUILT_TEST_ARTIFACTS") or ROOT / "artifacts")
    with ephemeral_stack(env, STARTUP_TIMEOUT_S, keep_logs=artifacts / "stack-logs") as s:
        yield Stack(s.base_url, s.data_dir, s.database_url, s.redis_url, s.log_dir)


@pytest.fixture
def tenant(stack) -> TenantHandle:
    return stack.create_tenant()


@pytest.fixture
def r(stack):
    """A synchronous client of the stack's Redis."""
    client = redis_client.sync_client(stack.redis_url)
    yield client
    client.close()


def pytest_collection_modifyitems(config, items):
    """A test that uses the embedded stack (the `stack` fixture, directly or through another
    fixture) is marked `stack`, whether or not its file says so: the fast tier leaves it out."""
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.stack)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless (the browser tests of the dashboard and the status page)."""
    try:
        with chromium() as launched:
            yield launched
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
