"""Accounts a tenant and an operator manage through the API: budgets a tenant sets itself (PUT
/api/v1/quilt/budgets), suspension by an operator (new billable work refused with the reason,
everything else kept), credit grants and their balance, and the append-only audit trail of who
did what, each tenant seeing only its own."""

from __future__ import annotations

import subprocess
import sys
from datetime import date

import psycopg
import pytest
from billing_workload import wait_recorded
from dashutil import operator_key
from stackutil import ROOT, datum, fb_body, new_model, wait_future

from billing.credits import CreditState, apply
from tenancy.keys import PREFIX_LEN

D1, D2, D3 = date(2026, 12, 1), date(2026, 12, 2), date(2026, 12, 3)


@pytest.mark.parametrize(("grants", "usage", "expected"), [
    ([], [(D1, 5)], CreditState(0, 0, 0)),                                   # no grant: nothing to apply
    ([(D1, 100)], [(D1, 30), (D2, 50)], CreditState(100, 80, 0)),            # used within the balance
    ([(D1, 100)], [(D1, 70), (D2, 70)], CreditState(100, 100, 40)),          # past it: the rest is charged
    ([(D2, 100)], [(D1, 70), (D2, 10)], CreditState(100, 10, 0)),            # usage before the grant is not its
    ([(D1, 10), (D3, 50)], [(D2, 30), (D3, 20)], CreditState(60, 30, 20)),   # a later grant covers later usage
])
def test_credits_pay_for_usage_from_their_day_on(grants, usage, expected):
    state = apply(grants, usage)
    assert state == expected
    assert state.balance_micro_usd == expected.granted_micro_usd - expected.applied_micro_usd


def _train_call(client, model_id: str, seq_id: int):
    return client.post("/forward_backward", json=fb_body(model_id, seq_id, [datum(list(range(20, 37)))]))


def _audit(client, **params) -> list[dict]:
    r = client.get("/quilt/audit", params=params)
    assert r.status_code == 200, r.text
    return r.json()["entries"]


def test_a_tenant_sets_its_own_budget_and_it_is_enforced(stack, tenant):
    with stack.http(tenant.key) as c:
        model_id = new_model(c, rank=4)
        r = c.put("/quilt/budgets", json={"monthly_usd": "0"})
        assert r.status_code == 200, r.text
        assert [(b["scope"], b["monthly_limit_usd"]) for b in r.json()["budgets"]] == [("tenant", "0.000000")]
        refused = _train_call(c, model_id, 1)
        assert refused.status_code == 402 and refused.json()["field"] == "budget.tenant", refused.text

        assert c.put("/quilt/budgets", json={"monthly_usd": None}).json()["budgets"] == []
        admitted = _train_call(c, model_id, 2)  # a refused call keeps its seq_id (api.seq_gaps)
        assert admitted.status_code == 200, admitted.text
        assert "error" not in wait_future(c, admitted.json()["request_id"])

        prefix = tenant.key[:PREFIX_LEN]
        r = c.put("/quilt/budgets", json={"monthly_usd": "12.50", "api_key_prefix": prefix})
        assert [(b["scope"], b["api_key_prefix"], b["monthly_limit_usd"]) for b in r.json()["budgets"]] == [
            ("key", prefix, "12.500000")]
        assert [e["action"] for e in _audit(c)][:3] == ["budget.set", "budget.cleared", "budget.set"]
        assert {e["actor"] for e in _audit(c)} == {f"key:{prefix}"}


@pytest.mark.parametrize(("body", "field"), [
    ({"monthly_usd": "NaN"}, "monthly_usd"), ({"monthly_usd": "-1"}, "monthly_usd"),
    ({"monthly_usd": "1e999"}, "monthly_usd"), ({"monthly_usd": "2000000000"}, "monthly_usd"),
    ({"monthly_usd": "ten"}, "monthly_usd"), ({"monthly_usd": "1\u0000"}, "monthly_usd"),
    ({"monthly_usd": "1", "api_key_prefix": "tml-nothere"}, "api_key_prefix"),
    ({"monthly_usd": "1", "surprise": 1}, "surprise"), ({}, "monthly_usd"),
])
def test_bad_budgets_are_refused_naming_the_field(stack, tenant, body, field):
    with stack.http(tenant.key) as c:
        r = c.put("/quilt/budgets", json=body)
    assert 400 <= r.status_code < 500 and r.json()["field"] == field, r.text


def test_a_tenant_cannot_budget_another_tenants_key(stack):
    a, b = stack.create_tenant("bud-a"), stack.create_tenant("bud-b")
    with stack.http(a.key) as c:
        r = c.put("/quilt/budgets", json={"monthly_usd": "1", "api_key_prefix": b.key[:PREFIX_LEN]})
    assert r.status_code == 404 and r.json()["field"] == "api_key_prefix"


def test_suspension_refuses_new_work_keeps_the_rest_and_lifts_at_once(stack):
    op, victim, other = operator_key(stack), stack.create_tenant("susp"), stack.create_tenant("bystander")
    with stack.http(op) as o, stack.http(victim.key) as v, stack.http(other.key) as x:
        model_id = new_model(v, rank=4)
        assert v.post(f"/quilt/tenants/{victim.name}/suspend", json={"reason": "x"}).status_code == 403
        r = o.post(f"/quilt/tenants/{victim.name}/suspend", json={"reason": "invoice 42 is 30 days overdue"})
        assert r.status_code == 200, r.text

        refused = _train_call(v, model_id, 1)
        assert refused.status_code == 403 and refused.json()["field"] == "tenant.suspended", refused.text
        assert "invoice 42 is 30 days overdue" in refused.json()["error"]
        assert v.post("/get_info", json={"model_id": model_id}).status_code == 200  # nothing is taken away
        # Nothing new is stored either: no session, no checkpoint (saves meter no tokens).
        assert v.post("/create_session", json={}).status_code == 403
        save = v.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "kept"})
        assert save.status_code == 403 and save.json()["field"] == "tenant.suspended", save.text
        assert v.get(f"/training_runs/{model_id}/checkpoints").status_code == 200  # reads still work
        other_model = new_model(x, rank=4)  # another tenant is untouched
        assert _train_call(x, other_model, 1).status_code == 200

        o.post(f"/quilt/tenants/{victim.name}/suspend", json={"reason": "card declined", "kind": "payment"})
        assert _train_call(v, model_id, 3).status_code == 402

        assert o.post(f"/quilt/tenants/{victim.name}/restore").json()["was_suspended"] is True
        admitted = _train_call(v, model_id, 4)  # refused calls keep their seq_ids (api.seq_gaps)
        assert admitted.status_code == 200, admitted.text
        assert "error" not in wait_future(v, admitted.json()["request_id"])

        mine = [e["action"] for e in _audit(v)]
        assert mine[:3] == ["tenant.restored", "tenant.suspended", "tenant.suspended"]
        assert not any(e["tenant"] == victim.name for e in _audit(x))  # isolation
        assert x.get("/quilt/audit", params={"tenant": victim.name}).status_code == 403
        assert [e["action"] for e in _audit(o, tenant=victim.name)][:1] == ["tenant.restored"]
        assert o.post("/quilt/tenants/no-such-tenant/suspend", json={"reason": "x"}).status_code == 404


def test_credit_grants_show_balance_and_what_usage_used(stack):
    op, t = operator_key(stack), stack.create_tenant("credit")
    with stack.http(op) as o, stack.http(t.key) as c:
        assert c.post(f"/quilt/tenants/{t.name}/credits", json={"usd": "5", "reason": "x"}).status_code == 403
        for bad in ("0", "-5", "NaN", "1e999"):
            r = o.post(f"/quilt/tenants/{t.name}/credits", json={"usd": bad, "reason": "welcome"})
            assert r.status_code == 400 and r.json()["field"] == "usd", (bad, r.text)
        r = o.post(f"/quilt/tenants/{t.name}/credits", json={"usd": "5", "reason": "welcome", "category": "promotional"})
        assert r.status_code == 200, r.text
        assert c.get("/quilt/credits").json()["balance_usd"] == "5.000000"

        model_id = new_model(c, rank=4)
        assert "error" not in wait_future(c, _train_call(c, model_id, 1).json()["request_id"])
        wait_recorded(stack.database_url, [t.tenant_id])
        cost = c.get("/quilt/usage").json()["month_to_date_micro_usd"]  # all of it today: a new tenant
        assert cost > 0
        got = c.get("/quilt/credits").json()
        assert got["balance_micro_usd"] == 5_000_000 - cost
        assert [(g["usd"], g["category"], g["reason"]) for g in got["grants"]] == [("5.000000", "promotional", "welcome")]
        assert _audit(c)[0]["action"] == "credit.granted"


def test_the_audit_log_is_append_only(stack, tenant):
    with psycopg.connect(stack.database_url) as conn:
        conn.execute("INSERT INTO audit_log (tenant_id, actor, action) VALUES (%s, 'test', 'probe')",
                     (tenant.tenant_id,))
        conn.commit()
        for statement in ("UPDATE audit_log SET action = 'forged'", "DELETE FROM audit_log",
                          "UPDATE credit_grants SET amount_micro_usd = 1", "TRUNCATE audit_log"):
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                conn.execute(statement)
            conn.rollback()


def test_the_cli_suspends_grants_and_records_it(stack):
    t = stack.create_tenant("cli-acct")
    env = {"QUILT_DATA_DIR": str(stack.data_dir), "QUILT_DATABASE_URL": stack.database_url,
           "QUILT_REDIS_URL": stack.redis_url, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}

    def quilt(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "stack.cli", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "suspended" in quilt("tenants", "suspend", t.name, "--reason", "abuse report 7")
    with stack.http(t.key) as c:
        refused = c.post("/create_session", json={})
        assert refused.status_code == 403 and "abuse report 7" in refused.json()["error"]
        quilt("tenants", "restore", t.name)
        quilt("credits", "grant", t.name, "--usd", "2.5", "--reason", "apology", "--paid")
        assert c.get("/quilt/credits").json()["balance_usd"] == "2.500000"
        assert [(e["action"], e["actor"]) for e in _audit(c)][:3] == [
            ("credit.granted", "cli"), ("tenant.restored", "cli"), ("tenant.suspended", "cli")]


def test_an_operator_sets_a_tenants_plan_and_quotas(stack):
    op, t = operator_key(stack), stack.create_tenant("plan")
    with stack.http(op) as o, stack.http(t.key) as c:
        assert c.put(f"/quilt/tenants/{t.name}/plan", json={"plan_weight": 5}).status_code == 403
        for bad in ({"plan_weight": 0}, {"plan_weight": "NaN"}, {"plan_weight": 1e999}, {"max_models": 0},
                    {"tokens_per_minute": 2**31}, {"max_models": 3, "colour": "red"}):
            r = o.put(f"/quilt/tenants/{t.name}/plan", content=str(bad).replace("'", '"').replace("inf", "1e999"),
                      headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (bad, r.text)
        r = o.put(f"/quilt/tenants/{t.name}/plan", json={"plan_weight": 2.5, "max_models": 3})
        assert r.status_code == 200 and (r.json()["plan_weight"], r.json()["max_models"]) == (2.5, 3), r.text
        for _ in range(3):
            new_model(c, rank=4)
        refused = c.post("/create_model", json={"session_id": c.post("/create_session", json={}).json()["session_id"],
                                                "model_seq_id": 0, "base_model": "quilt/tiny-qwen3",
                                                "lora_config": {"rank": 4}})
        assert refused.status_code == 403 and refused.json()["field"] == "max_models", refused.text
        assert _audit(c)[0]["action"] == "tenant.plan_set"
