"""Worker-side writes to the resource records (requests and models; checkpoints: checkpoints.records).

The API reads these through tenant-scoped queries (tenancy.scoped); workers write them here, keyed
by ids that the API already checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from core import queue
from core.errors import ServerError
from core.work import Rejected, WorkItem, WorkKind


def mark_running(conn: psycopg.Connection[DictRow], request_ids: list[str]) -> None:
    conn.execute(
        "UPDATE requests SET status = 'running', started_at = now() WHERE id = ANY(%s) AND status = 'queued'",
        (request_ids,),
    )


def mark_finished(conn: psycopg.Connection[DictRow], request_id: str, error: dict[str, Any] | None) -> bool:
    """Record a request's outcome once; False if it had already finished (a redelivery after a
    crash must not turn a done, billed request into a failed one)."""
    cur = conn.execute(
        "UPDATE requests SET status = %s, error = %s, finished_at = now() "
        "WHERE id = %s AND status IN ('queued', 'running')",
        ("failed" if error else "done", Jsonb(_jsonb_safe(error)) if error else None, request_id),
    )
    return cur.rowcount == 1


def _jsonb_safe(value: Any) -> Any:
    """`value` with NUL and lone surrogates in its text replaced (U+FFFD, `?`): an error message may
    quote them from a request, and Postgres refuses both in jsonb, which would leave the request
    unfinished for good."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_jsonb_safe(k): _jsonb_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonb_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class Settled:
    """How a request's row stands after `billing.ledger.settle`: `first` when that call finished
    it, False for a redelivery of a request finished before; `error` its failure (None: done)."""

    first: bool
    error: dict[str, Any] | None


def settled_before(conn: psycopg.Connection[DictRow], request_id: str) -> Settled | None:
    """The standing of a request that was finished before (None: no such row, or not finished)."""
    row = conn.execute("SELECT status, error FROM requests WHERE id = %s", (request_id,)).fetchone()
    if row is None or row["status"] not in ("done", "failed"):
        return None
    return Settled(first=False, error=row["error"] if row["status"] == "failed" else None)


# Both SDKs stop retrying a 503 within about two minutes; a row queued this long with no stream
# entry ever appended will not get one.
NEVER_ENQUEUED_AFTER_S = 600


def fail_never_enqueued(conn: psycopg.Connection[DictRow], redis: Any, *, ttl_s: int, after_s: int = NEVER_ENQUEUED_AFTER_S,
                        batch: int = 500) -> list[str]:
    """Fail the requests whose row was committed but whose stream entry never was (the API died
    between the two, or Redis refused the entry) and whose client did not retry (Celery beat):
    queued for `after_s`, younger than the future's lifetime `ttl_s` (the append marker lives that
    long), with no append marker (or one recording that the tokens-per-minute bucket refused it:
    the API died before deleting the refused row). Each gets a failure a poll can read, and is not billed.
    Its row is failed and committed before its future is published (core.queue.publish says why);
    dying between the two leaves the failure in the row, which `retrieve_future` answers from. Call
    it outside any transaction block of the caller's: it commits each row on `conn`."""
    rows = conn.execute(
        # A call that waited in a queue state (api.queue_states) counts from when it was queued (not_before).
        "SELECT id, tenant_id FROM requests WHERE status = 'queued' "
        "AND greatest(created_at, not_before) < now() - make_interval(secs => %s) "
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
        finished_now = mark_finished(conn, row["id"], outcome.error)
        # Committed here, not by a transaction() block: on the caller's connection a transaction is
        # open already (the SELECT above), inside which such a block is only a savepoint.
        conn.commit()
        if not finished_now:  # a late append ran after all: its worker answers it
            continue
        queue.publish(redis, outcome, ttl_s, WorkItem(row["id"], row["tenant_id"], "", 0, WorkKind.REJECTED, 0,
                                                      Rejected("never queued")))
        failed.append(row["id"])
    return failed


def set_model_status(conn: psycopg.Connection[DictRow], model_id: str, status: str, detail: str | None = None) -> None:
    conn.execute("UPDATE training_models SET status = %s, status_detail = %s WHERE id = %s", (status, detail, model_id))


def mark_models_recovering(conn: psycopg.Connection[DictRow], base_model: str, *, shard: str | None = None) -> list[str]:
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


def mark_models_lost(conn: psycopg.Connection[DictRow], base_model: str, *, keep: Sequence[str] = (),
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


def finished_requests(conn: psycopg.Connection[DictRow], request_ids: list[str]) -> dict[str, str]:
    """request id -> 'done' or 'failed', for those of `request_ids` that have finished."""
    rows = conn.execute("SELECT id, status FROM requests WHERE id = ANY(%s) AND status IN ('done', 'failed')",
                        (request_ids,)).fetchall()
    return {r["id"]: r["status"] for r in rows}


def plan_weights(conn: psycopg.Connection[DictRow]) -> dict[str, float]:
    """tenant id -> its plan's weight in the trainer's fair share."""
    return {r["id"]: float(r["plan_weight"]) for r in conn.execute("SELECT id, plan_weight FROM tenants").fetchall()}
