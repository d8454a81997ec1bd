"""Worker-side writes to the resource records (requests, models, checkpoints).

The API reads these through tenant-scoped queries (tenancy.scoped); workers write them here, keyed
by ids that the API already checked.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from core import queue, retention
from core.errors import ServerError
from core.work import Rejected, WorkItem, WorkKind


def mark_running(conn: psycopg.Connection, request_ids: list[str]) -> None:
    conn.execute(
        "UPDATE requests SET status = 'running', started_at = now() WHERE id = ANY(%s) AND status = 'queued'",
        (request_ids,),
    )


def mark_finished(conn: psycopg.Connection, request_id: str, error: dict | None) -> bool:
    """Record a request's outcome once; False if it had already finished (a redelivery after a
    crash must not turn a done, billed request into a failed one)."""
    cur = conn.execute(
        "UPDATE requests SET status = %s, error = %s, finished_at = now() "
        "WHERE id = %s AND status IN ('queued', 'running')",
        ("failed" if error else "done", Jsonb(error) if error else None, request_id),
    )
    return cur.rowcount == 1


# Both SDKs stop retrying a 503 within about two minutes; a row queued this long with no stream
# entry ever appended will not get one.
NEVER_ENQUEUED_AFTER_S = 600


def fail_never_enqueued(conn: psycopg.Connection, redis, *, ttl_s: int, after_s: int = NEVER_ENQUEUED_AFTER_S,
                        batch: int = 500) -> list[str]:
    """Fail the requests whose row was committed but whose stream entry never was (the API died
    between the two, or Redis refused the entry) and whose client did not retry (Celery beat):
    queued for `after_s`, younger than the future's lifetime `ttl_s` (the append marker lives that
    long), with no append marker (or one recording that the tokens-per-minute bucket refused it:
    the API died before deleting the refused row). Each gets a failure a poll can read, and is not billed."""
    rows = conn.execute(
        "SELECT id, tenant_id FROM requests WHERE status = 'queued' AND created_at < now() - make_interval(secs => %s) "
        "AND created_at > now() - make_interval(secs => %s) ORDER BY created_at LIMIT %s",
        (after_s, ttl_s, batch)).fetchall()
    if not rows:
        return []
    pipe = redis.pipeline(transaction=False)
    for row in rows:
        pipe.get(queue.enqueued_key(row["id"]))
    failed = []
    for row, marker in zip(rows, pipe.execute(), strict=True):
        if queue.was_appended(marker):
            continue
        outcome = queue.failure(row["id"], ServerError(
            "this request never reached a worker (it could not be queued and the call was not retried); send it "
            "again"))
        queue.publish(redis, outcome, ttl_s, WorkItem(row["id"], row["tenant_id"], "", 0, WorkKind.REJECTED, 0,
                                                      Rejected("never queued")))
        with conn.transaction():
            if mark_finished(conn, row["id"], outcome.error):
                failed.append(row["id"])
    return failed


def set_model_status(conn: psycopg.Connection, model_id: str, status: str, detail: str | None = None) -> None:
    conn.execute("UPDATE training_models SET status = %s, status_detail = %s WHERE id = %s", (status, detail, model_id))


def mark_models_recovering(conn: psycopg.Connection, base_model: str, *, shard: str | None = None) -> list[str]:
    """At trainer start: every live model of the base (placed on trainer shard `shard`, where the
    base has several) is 'recovering' (its snapshot loads, the requests since are replayed) until
    the trainer says 'ready' again. Returns their ids."""
    rows = conn.execute(
        "UPDATE training_models SET status = 'recovering', status_detail = 'trainer restarted' "
        "WHERE base_model = %s AND status IN ('ready', 'recovering') AND (%s::text IS NULL OR trainer_shard = %s) "
        "RETURNING id",
        (base_model, shard, shard),
    ).fetchall()
    return [r["id"] for r in rows]


def mark_models_lost(conn: psycopg.Connection, base_model: str, *, keep: list[str] = (),
                     shard: str | None = None) -> int:
    """At trainer start: models of a previous process (of trainer shard `shard`, where the base has
    several) that it could not restore (no snapshot: batcher.snapshots) are gone."""
    cur = conn.execute(
        "UPDATE training_models SET status = 'lost', status_detail = 'trainer restarted' "
        "WHERE base_model = %s AND status IN ('ready', 'recovering') AND NOT (id = ANY(%s)) "
        "AND (%s::text IS NULL OR trainer_shard = %s)",
        (base_model, list(keep), shard, shard),
    )
    return cur.rowcount


def upsert_checkpoint(conn: psycopg.Connection, *, tenant_id: str, model_id: str, kind: str, name: str,
                      storage_path: str, size_bytes: int, ttl_s: int | None = None, sliding: bool = False,
                      grace_s: int = 0, user_metadata: dict[str, str] | None = None) -> None:
    """Record a save as checkpoint `name` (a new version if the name exists, whose `user_metadata`
    replaces the old one's, none included). The version it replaces is queued for deletion
    `grace_s` from now; see core.retention."""
    with conn.transaction():
        old = conn.execute(
            "SELECT storage_path FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s FOR UPDATE",
            (model_id, kind, name),
        ).fetchone()
        conn.execute(
            "INSERT INTO checkpoints (tenant_id, model_id, kind, name, storage_path, size_bytes, expires_at, "
            "sliding_ttl_s, user_metadata) VALUES (%s, %s, %s, %s, %s, %s, now() + make_interval(secs => %s), %s, %s) "
            "ON CONFLICT (model_id, kind, name) DO UPDATE SET storage_path = EXCLUDED.storage_path, "
            "size_bytes = EXCLUDED.size_bytes, created_at = now(), expires_at = EXCLUDED.expires_at, "
            "sliding_ttl_s = EXCLUDED.sliding_ttl_s, user_metadata = EXCLUDED.user_metadata",
            (tenant_id, model_id, kind, name, storage_path, size_bytes, ttl_s, ttl_s if sliding else None,
             None if user_metadata is None else Jsonb(user_metadata)),
        )
        # (A checkpoint saved before per-save directories holds its files in the name's directory,
        # which the new version now lives in: that one is not queued, or it would take the new one along.)
        if old is not None and old["storage_path"] != storage_path \
                and not Path(storage_path).is_relative_to(old["storage_path"]):
            conn.execute(
                "INSERT INTO storage_garbage (tenant_id, path, delete_after) "
                "VALUES (%s, %s, now() + make_interval(secs => %s))",
                (tenant_id, old["storage_path"], grace_s),
            )


def checkpoint_exists(conn: psycopg.Connection, model_id: str, kind: str, name: str) -> bool:
    row = conn.execute(
        f"SELECT 1 FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s AND {retention.LIVE}",
        (model_id, kind, name),
    ).fetchone()
    return row is not None
