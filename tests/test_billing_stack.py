"""Metering on the real stack: every completed request priced exactly once, budgets at admission,
the spend header, the usage / prices / estimate routes, the SDK and `quilt usage`."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime

import psycopg
import pytest
from billing_workload import (
    ledger_rows,
    recomputed_cost,
    run_workload,
    sampling_available,
    wait_recorded,
)
from psycopg.rows import dict_row
from stackutil import ADAM, TINY, datum, fb_body, new_model, wait_future

from billing import budgets
from billing.pricing import usd
from core import db

SPEND = "X-Quilt-Spend-USD"


@pytest.fixture(scope="module")
def workload(stack):
    return run_workload(stack, prefix="meter")


def _db(stack):
    return psycopg.connect(stack.database_url, row_factory=dict_row, autocommit=True)


def test_every_completed_request_has_exactly_one_ledger_row_and_failures_none(stack, workload):
    rows = {r["request_id"]: r for r in ledger_rows(stack.database_url, workload.tenant_ids)}
    with _db(stack) as conn:
        statuses = {r["id"]: r for r in conn.execute(
            "SELECT id, status, kind, n_tokens, api_key_id, tenant_id, model_id, seq_id FROM requests "
            "WHERE tenant_id = ANY(%s)", (workload.tenant_ids,))}
    done = {rid for rid, r in statuses.items() if r["status"] == "done"}
    failed = {rid for rid, r in statuses.items() if r["status"] == "failed"}
    assert set(rows) == done  # create_model, optim_step and save included (at zero cost)
    assert failed and not (failed & set(rows))
    placeholders = {rid for rid, r in statuses.items() if (r["model_id"], r["seq_id"]) in workload.refused}
    assert len(placeholders) == len(workload.refused)  # a refused call still holds its seq_id, failed
    assert {s.request_id for s in workload.requests if not s.expect_ok} | placeholders == failed
    submitted = {s.request_id: s for s in workload.requests}
    for rid, row in rows.items():
        req = statuses[rid]
        assert row["tenant_id"] == req["tenant_id"] and row["api_key_id"] == req["api_key_id"]
        assert row["base_model"] == TINY and row["price_id"] is not None
        if req["kind"] == "sample":  # the generation pool's units: prompt tokens and generated tokens
            sampled = sum(len(seq["tokens"]) for seq in submitted[rid].result["sequences"])
            assert row["sample_tokens"] == sampled > 0 and row["prefill_tokens"] > 0 and row["train_tokens"] == 0
            continue
        expected = {"forward_backward": (0, 0, req["n_tokens"]), "forward": (req["n_tokens"], 0, 0)}
        assert (row["prefill_tokens"], row["sample_tokens"], row["train_tokens"]) == \
            expected.get(req["kind"], (0, 0, 0)), req["kind"]


def test_ledger_cost_equals_costs_recomputed_from_units_and_prices(stack, workload):
    rows = ledger_rows(stack.database_url, workload.tenant_ids)
    assert sum(r["train_tokens"] for r in rows) > 0 and sum(r["prefill_tokens"] for r in rows) > 0
    for r in rows:
        assert r["cost_micro_usd"] == recomputed_cost(r), r
    for tenant in workload.tenants:
        mine = [r for r in rows if r["tenant_id"] == tenant.tenant_id]
        report = stack.http(tenant.key).get("/quilt/usage").json()
        assert report["total_micro_usd"] == sum(r["cost_micro_usd"] for r in mine) > 0
        by_unit = {u["unit"]: u for u in report["by_unit"]}
        assert by_unit["train"]["tokens"] == sum(r["train_tokens"] for r in mine)
        assert by_unit["prefill"]["cost_micro_usd"] == sum(r["prefill_micro_usd"] for r in mine)


def test_the_ledger_is_append_only(stack, workload):
    with _db(stack) as conn:
        for sql in ("UPDATE usage_ledger SET cost_micro_usd = 0 WHERE tenant_id = %s",
                    "DELETE FROM usage_ledger WHERE tenant_id = %s"):
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                conn.execute(sql, (workload.tenant_ids[0],))


def test_recording_a_request_twice_bills_it_once(stack, workload):
    from billing.ledger import record_usage
    from billing.pricing import Units

    row = ledger_rows(stack.database_url, workload.tenant_ids[:1])[0]
    with db.connect(stack.database_url) as conn:
        again = record_usage(conn, request_id=row["request_id"], tenant_id=row["tenant_id"], api_key_id=None,
                             model_id=row["model_id"], base_model=row["base_model"], units=Units(train_tokens=10**6))
    assert again is None
    assert ledger_rows(stack.database_url, workload.tenant_ids[:1]) == \
        ledger_rows(stack.database_url, workload.tenant_ids[:1])  # unchanged, and still one row for it
    assert [r["request_id"] for r in ledger_rows(stack.database_url, workload.tenant_ids[:1])].count(
        row["request_id"]) == 1


def test_the_hourly_session_rollup_is_the_ledger_grouped(stack, workload):
    # usage_hourly_sessions (what GET billing/usage/events reads) is written with each ledger row.
    units = ("prefill_tokens", "sample_tokens", "train_tokens", "prefill_micro_usd", "sample_micro_usd",
             "train_micro_usd")
    with _db(stack) as conn:
        grouped = conn.execute(
            "SELECT date_trunc('hour', l.created_at, 'UTC') AS hour, l.base_model, "
            "COALESCE(m.session_id, s.session_id, '') AS session_id, COALESCE(l.api_key_id, '') AS api_key_id, "
            + ", ".join(f"sum(l.{u})::bigint AS {u}" for u in units) +
            " FROM usage_ledger l LEFT JOIN training_models m ON m.id = l.model_id "
            "LEFT JOIN sampling_sessions s ON s.id = l.model_id "
            "WHERE l.tenant_id = ANY(%s) AND l.prefill_tokens + l.sample_tokens + l.train_tokens > 0 "
            "GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4", (workload.tenant_ids,)).fetchall()
        rollup = conn.execute(
            f"SELECT hour, base_model, session_id, api_key_id, {', '.join(units)} FROM usage_hourly_sessions "
            "WHERE tenant_id = ANY(%s) ORDER BY 1, 2, 3, 4", (workload.tenant_ids,)).fetchall()
    assert rollup == grouped and len(rollup) >= len(workload.tenant_ids)
    assert all(r["session_id"] for r in rollup)  # every workload call was made in a session


def test_every_authenticated_response_carries_the_month_to_date_spend(stack, workload):
    tenant = workload.tenants[0]
    client = stack.http(tenant.key)
    with _db(stack) as conn:
        spent = conn.execute("SELECT sum(cost_micro_usd) AS s FROM usage_ledger WHERE tenant_id = %s "
                             "AND created_at >= date_trunc('month', now(), 'UTC')", (tenant.tenant_id,)).fetchone()["s"]
    for r in (client.get("/quilt/prices"), client.post("/client/config", json={}),
              client.post("/get_info", json={"model_id": "nope"})):
        assert r.headers[SPEND] == usd(int(spent)), r.request.url
    assert SPEND not in stack.http(None).get("/quilt/prices").headers  # 401: no tenant, no header


def test_usage_report_by_day_model_and_unit(stack, workload):
    tenant = workload.tenants[2]
    report = stack.http(tenant.key).get("/quilt/usage").json()
    today = datetime.now(UTC).date().isoformat()
    assert [d["day"] for d in report["by_day"]] == [today]
    assert [m["base_model"] for m in report["by_model"]] == [TINY]
    assert {u["unit"] for u in report["by_unit"]} == {"prefill", "cached", "sample", "train", "storage"}
    assert report["by_day"][0]["cost_micro_usd"] == report["total_micro_usd"] == report["month_to_date_micro_usd"]
    assert report["by_day"][0]["requests"] == sum(1 for s in workload.requests
                                                  if s.tenant_id == tenant.tenant_id and s.expect_ok) + 1  # + create
    if sampling_available(stack):
        assert report["by_day"][0]["sample_tokens"] > 0
    bad = stack.http(tenant.key).get("/quilt/usage", params={"since": "2026-02-01", "until": "2026-01-01"})
    assert bad.status_code == 400 and bad.json()["field"] == "until"


def test_prices_and_estimate(stack, tenant):
    client = stack.http(tenant.key)
    prices = client.get("/quilt/prices").json()["prices"]
    q8 = next(p for p in prices if p["base_model"] == "Qwen/Qwen3-8B" and p["current"])
    assert (q8["prefill_usd_per_mtok"], q8["sample_usd_per_mtok"], q8["train_usd_per_mtok"]) == \
        ("0.195000", "0.600000", "0.440000")
    assert any(p["base_model"] == TINY and p["current"] for p in prices)
    body = {"base_model": "Qwen/Qwen3-8B", "steps": 100,
            "tokens_per_step": {"prefill": 10_000, "sample": 20_000, "train": 30_000}}
    est = client.post("/quilt/estimate", json=body).json()
    # 100 steps: 1M prefill x 0.195 + 2M sample x 0.60 + 3M train x 0.44 = 2.715 USD
    assert est["cost_usd"] == "2.715000" and est["cost_micro_usd"] == 2_715_000
    assert est["fits_budget"] is None
    missing = client.post("/quilt/estimate", json={**body, "base_model": "nope"})
    assert missing.status_code == 404 and "Qwen/Qwen3-8B" in missing.json()["detail"]


def test_sdk_estimate_cost_and_usage(stack, workload):
    tenant = workload.tenants[1]
    with stack.sdk(tenant.key) as client:
        est = client.estimate_cost("Qwen/Qwen3-8B", steps=10, train_tokens=100_000)
        assert est.cost_micro_usd == 440_000 and str(est.cost_usd) == "0.44"
        assert est.by_unit == {"prefill": 0, "cached": 0, "sample": 0, "train": 440_000}
        report = client.usage()
        assert report.total_micro_usd == sum(r["cost_micro_usd"]
                                             for r in ledger_rows(stack.database_url, [tenant.tenant_id]))
        assert report.by_model[0]["base_model"] == TINY


def _fb(client, model, seq, n=20):
    return client.post("/forward_backward", json=fb_body(model, seq, [datum(list(range(3, 3 + n)))]))


def test_over_budget_is_402_naming_the_budget_the_spend_and_the_fix(stack):
    tenant = stack.create_tenant("budget")
    client = stack.http(tenant.key)
    model = new_model(client, rank=4)
    wait_future(client, _fb(client, model, 1).json()["request_id"])
    wait_recorded(stack.database_url, [tenant.tenant_id])  # billed a moment after it was answered
    with db.connect(stack.database_url) as conn:
        budgets.set_budget(conn, tenant.tenant_id, 1)  # 1 micro-USD: already spent
    r = _fb(client, model, 2)
    assert r.status_code == 402, r.text
    body = r.json()
    assert body["category"] == "user" and body["field"] == "budget.tenant"
    assert f"tenant {tenant.name!r}" in body["detail"] and "spent" in body["detail"]
    assert f"quilt budgets set {tenant.name} --usd" in body["detail"]
    assert float(r.headers[SPEND]) > 0
    session = client.post("/create_session", json={}).json()["session_id"]  # nothing new starts either
    create = client.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": TINY,
                                                "lora_config": {"rank": 4}})
    assert create.status_code == 402 and create.json()["field"] == "budget.tenant", create.text
    # Free requests still pass, so work can be stepped and saved. The refusal used up seq_id 2
    # (api.seq_gaps): the next call is 3, and it does not wait for 2.
    opt = client.post("/optim_step", json={"model_id": model, "seq_id": 3, "adam_params": ADAM})
    assert opt.status_code == 200 and "error" not in wait_future(client, opt.json()["request_id"])
    with db.connect(stack.database_url) as conn:
        budgets.set_budget(conn, tenant.tenant_id, 10_000_000)
    ok = _fb(client, model, 4)
    assert ok.status_code == 200 and "error" not in wait_future(client, ok.json()["request_id"])


def test_a_key_budget_stops_only_that_key(stack):
    from tenancy.keys import create_key

    tenant = stack.create_tenant("keybudget")
    with db.connect(stack.database_url) as conn:
        capped_secret, capped = create_key(conn, tenant.tenant_id, name="capped")
        budgets.set_budget(conn, tenant.tenant_id, 0, capped.id)
    free, capped_client = stack.http(tenant.key), stack.http(capped_secret)
    model = new_model(free, rank=4)
    r = _fb(capped_client, model, 1)
    assert r.status_code == 402 and r.json()["field"] == "budget.api_key"
    assert capped.prefix in r.json()["detail"] and f"--key {capped.prefix}" in r.json()["detail"]
    assert _fb(free, model, 1).status_code == 200


def test_in_flight_work_counts_against_the_budget(stack):
    """Queued work is priced into admission, so overshoot is bounded by what is already in flight."""
    tenant = stack.create_tenant("inflight")
    client = stack.http(tenant.key)
    model = new_model(client, rank=4)
    with db.connect(stack.database_url) as conn:
        # 10M train tokens queued (a request the trainer never sees): 2 USD at the tiny model's 0.20/M
        conn.execute("INSERT INTO requests (id, tenant_id, model_id, seq_id, kind, status, n_tokens) "
                     "VALUES (%s, %s, %s, 999999, 'forward_backward', 'queued', 10000000)",
                     (f"req-fake-{tenant.tenant_id}", tenant.tenant_id, model))
        budgets.set_budget(conn, tenant.tenant_id, 2_000_000)
    r = _fb(client, model, 1)
    assert r.status_code == 402 and "$2.000000 in flight" in r.json()["detail"]
    usage = client.get("/quilt/usage").json()
    assert usage["budgets"][0]["in_flight_usd"] == "2.000000" and usage["budgets"][0]["exhausted"] is True


def test_quilt_usage_prints_spend_by_day_and_by_model(stack, workload):
    tenant = workload.tenants[0]
    env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
           "QUILT_DATA_DIR": str(stack.data_dir)}
    out = subprocess.run([sys.executable, "-m", "stack.cli", "usage", tenant.name], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    today = datetime.now(UTC).date().isoformat()
    assert "By day:" in out.stdout and today in out.stdout
    assert "By model:" in out.stdout and TINY in out.stdout
    total = sum(r["cost_micro_usd"] for r in ledger_rows(stack.database_url, [tenant.tenant_id]))
    assert f"${usd(total)}" in out.stdout or f"${total / 1e6:.2f}" in out.stdout
