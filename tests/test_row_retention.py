"""Finished requests and abandoned sessions leave Postgres after QUILT_RECORD_RETENTION_S
(core.row_retention), and nothing a user can still ask for goes with them: a model's last answered
seq_id (its replay point), sessions that hold a model, anything still in flight, the ledger."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from stackutil import new_model

from billing import ledger
from billing.pricing import Units
from core import db, row_retention
from core.settings import ApiSettings
from scaleout.placement import last_answered_seq

WEEK_S = 7 * 86_400


def test_records_must_outlive_results(monkeypatch):
    monkeypatch.setenv("QUILT_FUTURE_TTL_SECONDS", "7200")
    monkeypatch.setenv("QUILT_RECORD_RETENTION_S", "3600")
    with pytest.raises(ValidationError, match="QUILT_RECORD_RETENTION_S"):
        ApiSettings()
    monkeypatch.setenv("QUILT_RECORD_RETENTION_S", "7200")
    assert ApiSettings().record_retention_s == 7200


def _request(conn, tenant_id: str, rid: str, *, model_id: str | None, seq_id: int | None, status: str,
             finished_days_ago: float | None) -> None:
    conn.execute(
        "INSERT INTO requests (id, tenant_id, model_id, seq_id, kind, status, created_at, finished_at) "
        "VALUES (%s, %s, %s, %s, 'forward_backward', %s, now() - interval '9 days', "
        "CASE WHEN %s::float8 IS NULL THEN NULL ELSE now() - make_interval(secs => %s::float8 * 86400) END)",
        (rid, tenant_id, model_id, seq_id, status, finished_days_ago, finished_days_ago))


def _session(conn, tenant_id: str, sid: str, *, finished_days_ago: float | None) -> None:
    conn.execute("INSERT INTO sessions (id, tenant_id, finished_at) VALUES (%s, %s, "
                 "CASE WHEN %s::float8 IS NULL THEN NULL ELSE now() - make_interval(secs => %s::float8 * 86400) END)",
                 (sid, tenant_id, finished_days_ago, finished_days_ago))


def test_old_finished_rows_go_and_what_is_still_needed_stays(stack, tenant):
    with stack.http(tenant.key) as http:
        model = new_model(http)
    t = tenant.tenant_id
    with db.connect(stack.database_url) as conn:
        # seq 1..4 answered 8 days ago (4 is the model's replay point), 5 still running.
        for seq in range(1, 5):
            _request(conn, t, f"{model}-r{seq}", model_id=model, seq_id=seq, status="done", finished_days_ago=8)
        _request(conn, t, f"{model}-r5", model_id=model, seq_id=5, status="running", finished_days_ago=None)
        _request(conn, t, f"{model}-old-sample", model_id=None, seq_id=None, status="failed", finished_days_ago=8)
        conn.execute("INSERT INTO usage_ledger (request_id, tenant_id, base_model, train_tokens, train_micro_usd, "
                     "cost_micro_usd) VALUES (%s, %s, 'b', 7, 7, 7)", (f"{model}-r2", t))
        billed = conn.execute("SELECT count(*) AS n FROM usage_ledger WHERE tenant_id = %s", (t,)).fetchone()["n"]
        _session(conn, t, f"{model}-abandoned", finished_days_ago=8)
        conn.execute("INSERT INTO sampling_sessions (id, tenant_id, session_id, seq_id, base_model) "
                     "SELECT %s, %s, %s, 0, base_model FROM training_models WHERE id = %s",
                     (f"{model}-abandoned:sample:0", t, f"{model}-abandoned", model))
        _session(conn, t, f"{model}-recent", finished_days_ago=1)
        _session(conn, t, f"{model}-live", finished_days_ago=None)
        # The model's own session finished long ago but holds the model.
        conn.execute("UPDATE sessions SET finished_at = now() - interval '8 days' "
                     "WHERE id = (SELECT session_id FROM training_models WHERE id = %s)", (model,))
        assert last_answered_seq(conn, model) == 4

        pruned = row_retention.prune(conn, older_than_s=WEEK_S)
        assert pruned.requests >= 4 and pruned.sessions >= 1
        left = {r["id"] for r in conn.execute("SELECT id FROM requests WHERE tenant_id = %s", (t,))}
        assert {f"{model}-r4", f"{model}-r5"} <= left
        assert not left & {f"{model}-r1", f"{model}-r2", f"{model}-r3", f"{model}-old-sample"}
        assert last_answered_seq(conn, model) == 4
        sessions = {r["id"] for r in conn.execute("SELECT id FROM sessions WHERE tenant_id = %s", (t,))}
        assert f"{model}-abandoned" not in sessions
        assert {f"{model}-recent", f"{model}-live"} <= sessions
        assert conn.execute("SELECT 1 FROM training_models WHERE id = %s", (model,)).fetchone()
        assert not conn.execute("SELECT 1 FROM sampling_sessions WHERE session_id = %s",
                                (f"{model}-abandoned",)).fetchone()
        # The ledger keeps the usage; a redelivery of a pruned request finds no row and bills nothing.
        assert conn.execute("SELECT count(*) AS n FROM usage_ledger WHERE tenant_id = %s", (t,)).fetchone()["n"] == billed
        settled = ledger.settle(conn, request_id=f"{model}-r3", tenant_id=t, model_id=model, base_model="b",
                                error=None, units=Units(train_tokens=5))
        assert settled is None
        assert conn.execute("SELECT count(*) AS n FROM usage_ledger WHERE tenant_id = %s", (t,)).fetchone()["n"] == billed
        # Running it again finds nothing of this tenant's left to remove.
        row_retention.prune(conn, older_than_s=WEEK_S)
        assert {r["id"] for r in conn.execute("SELECT id FROM requests WHERE tenant_id = %s", (t,))} == left
