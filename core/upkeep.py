"""Upkeep tasks run by Celery beat."""

from __future__ import annotations

import socket

from core import checkpoint_store, db, health, redis_client, retention
from core.celery_app import app

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


@app.task(name="quilt.upkeep.sweep_checkpoints")
def sweep_checkpoints() -> dict:
    """Expire checkpoints past their TTL and delete checkpoint directories that are due."""
    with db.connect() as conn:
        result = retention.sweep(conn, checkpoint_store.get_store())
    return {"expired": result.expired, "removed": result.removed}


@app.task(name="quilt.upkeep.sweep_orphan_checkpoints")
def sweep_orphan_checkpoints() -> int:
    """Delete checkpoint directories that no checkpoint names (left by a save that crashed)."""
    with db.connect() as conn:
        return retention.sweep_orphans(conn, checkpoint_store.get_store())
