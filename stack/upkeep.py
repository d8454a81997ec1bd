"""Upkeep tasks run by Celery beat."""

from __future__ import annotations

import socket

from checkpoints import retention, storage
from core import db, health, records, redis_client, row_retention
from core.celery_app import app
from core.settings import get_api_settings

SESSION_IDLE_LIMIT = "10 minutes"  # SDKs heartbeat every 10 s; this is 60 missed beats


@app.task(name="quilt.upkeep.heartbeat")
def heartbeat() -> None:
    """Tell /healthz that the Celery worker and beat are alive."""
    health.beacon(redis_client.sync_client(), health.CELERY_KEY, health.CELERY_TTL_S, host=socket.gethostname())


@app.task(name="quilt.upkeep.expire_sessions")
def expire_sessions() -> int:
    """Finish sessions whose client stopped sending heartbeats."""
    with db.connect() as conn:
        cur = conn.execute(
            "UPDATE sessions SET finished_at = now(), finish_reason = 'expired' "
            "WHERE finished_at IS NULL AND last_heartbeat_at < now() - %s::interval",
            (SESSION_IDLE_LIMIT,),
        )
        return cur.rowcount


@app.task(name="quilt.upkeep.prune_records")
def prune_records() -> dict:
    """Delete finished requests and finished sessions past QUILT_RECORD_RETENTION_S (core.row_retention)."""
    with db.connect() as conn:
        pruned = row_retention.prune(conn, older_than_s=get_api_settings().record_retention_s)
    return {"requests": pruned.requests, "sessions": pruned.sessions}


@app.task(name="quilt.upkeep.sweep_checkpoints")
def sweep_checkpoints() -> dict:
    """Expire checkpoints past their TTL and delete checkpoint directories that are due."""
    with db.connect() as conn:
        result = retention.sweep(conn, storage.get_store())
    return {"expired": result.expired, "removed": result.removed}


@app.task(name="quilt.upkeep.sweep_orphan_checkpoints")
def sweep_orphan_checkpoints() -> int:
    """Delete checkpoint directories that no checkpoint names (left by a save that crashed)."""
    with db.connect() as conn:
        return retention.sweep_orphans(conn, storage.get_store())


@app.task(name="quilt.upkeep.fail_never_enqueued")
def fail_never_enqueued() -> int:
    """Fail (unbilled, with a result a poll reads) requests whose stream entry was never appended
    and whose client gave up retrying (core.records.fail_never_enqueued)."""
    with db.connect() as conn:
        return len(records.fail_never_enqueued(conn, redis_client.sync_client(),
                                               ttl_s=get_api_settings().future_ttl_seconds))
