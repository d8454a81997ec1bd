"""How long the records of finished work stay in Postgres, and removing them after.

Two tables grew with every call for as long as the service ran (bench/soak.py measured it):
`requests` (one row per call) and `sessions` (one per SDK client, abandoned ones included). What a
user can still ask for bounds each of them:

  * a finished request's row backs polls once its Redis result (QUILT_FUTURE_TTL_SECONDS) is gone,
    and nothing else; after QUILT_RECORD_RETENTION_S it goes, except each model's highest answered
    `seq_id`, which a restored model's replay starts from (scaleout.placement.last_answered_seq).
    Billing does not read these rows back: the ledger and its rollups hold the usage, and a
    stream redelivery whose row is gone finds `mark_finished` false and bills nothing;
  * a finished session that never made a training model has nothing left to name; it goes with its
    samplers and custom losses once finished that long.

Ledger, invoices, the audit log and runs' curves (`run_metrics`, one row per forward_backward) are
records a tenant or an auditor may need for years; they grow with work done, by a bounded amount
per call (docs/operations/soak.md), and stay.

`prune` runs from Celery beat every minute in batches, so a backlog (a first run on an old database)
drains without one long transaction; it is safe to repeat and to run twice at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import DictRow

_REQUESTS = """
DELETE FROM requests WHERE id IN (
  SELECT r.id FROM requests r
  WHERE r.status IN ('done', 'failed') AND r.finished_at < now() - make_interval(secs => %(age)s)
    AND NOT (r.model_id IS NOT NULL AND r.seq_id IS NOT NULL AND r.seq_id = (
      SELECT max(k.seq_id) FROM requests k WHERE k.model_id = r.model_id AND k.status IN ('done', 'failed')))
  ORDER BY r.finished_at LIMIT %(batch)s
  FOR UPDATE SKIP LOCKED)
"""

# Sessions that hold a training model stay: the model's row (and its checkpoints, its tinker paths)
# names them.
_SESSIONS = """
SELECT s.id FROM sessions s
WHERE s.finished_at < now() - make_interval(secs => %(age)s)
  AND NOT EXISTS (SELECT 1 FROM training_models m WHERE m.session_id = s.id)
ORDER BY s.finished_at LIMIT %(batch)s
FOR UPDATE OF s SKIP LOCKED
"""


@dataclass(frozen=True)
class Pruned:
    requests: int
    sessions: int


def prune(conn: psycopg.Connection[DictRow], *, older_than_s: int, batch: int = 5000) -> Pruned:
    """Delete at most `batch` rows of each kind that finished more than `older_than_s` ago (see the
    module docstring for what is kept), each kind in its own transaction."""
    args = {"age": older_than_s, "batch": batch}
    with conn.transaction():
        n_requests = conn.execute(_REQUESTS, args).rowcount
    with conn.transaction():
        ids = [r["id"] for r in conn.execute(_SESSIONS, args).fetchall()]
        if ids:
            conn.execute("DELETE FROM sampling_sessions WHERE session_id = ANY(%s)", (ids,))
            conn.execute("DELETE FROM sessions WHERE id = ANY(%s)", (ids,))  # custom_losses cascade
    return Pruned(requests=n_requests, sessions=len(ids))
