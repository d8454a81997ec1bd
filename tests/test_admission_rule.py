"""Admission's refusals as a table (api.admission_rule.decide), and the SQL fast path checked
against the same rule: `records.insert_call` inserts a call's row exactly when `decide` on the row
it reads admits the call."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import replace

import psycopg
import pytest
from psycopg.rows import dict_row
from stackutil import new_model

from api import admission, records
from api import admission_rule as rule
from billing.budgets import BudgetState
from core.loss_spec import LossConfig
from core.work import AdamParams, OptimStep, PassWork, WorkItem, WorkKind
from tenancy.auth import Principal

WHO = Principal("t1", "acme", "tenant", "k1", 1.0, max_models=2, max_inflight_requests=3, tokens_per_minute=1000,
                max_checkpoint_bytes=100)
SPENT = BudgetState("tenant", 100, 90, 20)  # 110 of 100 committed: exhausted
ROOM = BudgetState("key", 100, 10, 0, "k1", "qk_ab")
CALL = rule.Facts(WHO, "forward_backward", tokens=100, billable=True, model_id="m", seq_id=4,
                  model_status="ready", inflight=0, budgeted=False)


def _outcome(d: rule.Decision):
    """A decision as a table cell: 'admit', 'resume <id> <status>', 'read <what>', or
    '<status code> <field>' of the refusal."""
    if isinstance(d, rule.Admit):
        return "admit"
    if isinstance(d, rule.Resume):
        return f"resume {d.request_id} {d.status}"
    if isinstance(d, rule.Read):
        return f"read {d.what}"
    if isinstance(d, rule.Pause):
        return f"pause {d.queue_state}"
    return f"{d.error.status_code} {d.error.field}"


@pytest.mark.parametrize(("change", "expected"), [
    ({}, "admit"),
    # 1. the model's state
    ({"model_status": "failed"}, "400 model_id"),
    ({"model_status": "lost"}, "400 model_id"),
    ({"model_status": "creating"}, "admit"),  # queued behind its create
    ({"model_status": "recovering"}, "admit"),
    ({"model_status": "lost", "holder": rule.Holder("r0", "forward_backward", "done")}, "400 model_id"),
    # 2. the seq_id's holder: a retry resumes, another kind is a client bug, whatever the quotas say
    ({"holder": rule.Holder("r0", "forward_backward", "queued")}, "resume r0 queued"),
    ({"holder": rule.Holder("r0", "forward_backward", "done"), "inflight": 3}, "resume r0 done"),
    ({"holder": rule.Holder("r0", "optim_step", "done")}, "400 seq_id"),
    ({"holder": rule.Holder("r0", None, "running")}, "resume r0 running"),  # a sampling slot: no kind
    ({"holder": rule.Holder("r0", "forward_backward", "done"),
      "who": replace(WHO, suspended_kind="operator")}, "resume r0 done"),
    # 3. before any read
    ({"who": replace(WHO, suspended_kind="payment", suspended_reason="card declined")}, "402 tenant.suspended"),
    ({"who": replace(WHO, suspended_kind="operator", suspended_reason="abuse")}, "403 tenant.suspended"),
    ({"who": replace(WHO, suspended_kind="operator"), "billable": False, "tokens": 0}, "admit"),  # an optim_step
    # a checkpoint save meters nothing, yet a suspended tenant stores nothing new
    ({"who": replace(WHO, suspended_kind="operator"), "billable": False, "stores": True, "tokens": 0},
     "403 tenant.suspended"),
    ({"tokens": 1001}, "400 tokens_per_minute"),
    ({"tokens": 1000}, "admit"),
    ({"known_wait_s": 2.5}, "429 tokens_per_minute"),
    ({"tokens": 1001, "billable": False}, "400 tokens_per_minute"),
    # 4. quotas
    ({"inflight": 2}, "admit"),
    ({"inflight": 3}, "429 max_inflight_requests"),
    ({"inflight": None, "budgeted": None}, "read quota"),
    ({"new_model": True, "model_status": None}, "read live_models"),
    ({"new_model": True, "model_status": None, "live_models": 1}, "admit"),
    ({"new_model": True, "model_status": None, "live_models": 2}, "403 max_models"),
    ({"new_model": True, "model_status": None, "live_models": 2,
      "who": replace(WHO, suspended_kind="operator")}, "403 tenant.suspended"),  # the suspension says why first
    ({"stores": True, "billable": False, "tokens": 0}, "read stored_bytes"),
    ({"stores": True, "billable": False, "tokens": 0, "stored_bytes": 99}, "admit"),
    ({"stores": True, "billable": False, "tokens": 0, "stored_bytes": 100}, "403 max_checkpoint_bytes"),
    ({"stores": True, "billable": False, "tokens": 0, "stored_bytes": 100, "check_quota": False}, "admit"),
    # 5. budgets, billable calls only
    ({"budgeted": True}, "read budgets"),
    ({"budgeted": True, "billable": False, "tokens": 0}, "admit"),
    ({"budgeted": True, "budgets": (ROOM,)}, "admit"),
    ({"budgeted": True, "budgets": (ROOM, SPENT)}, "402 budget.tenant"),
    ({"budgeted": True, "budgets": (replace(SPENT, scope="key", api_key_prefix="qk_ab"),)}, "402 budget.api_key"),
    ({"budgeted": True, "budgets": ()}, "admit"),  # the budget was removed meanwhile
    ({"budgeted": True, "budgets": (SPENT,), "inflight": 3}, "429 max_inflight_requests"),
    # placeholders of refused calls hold no new work
    ({"check_quota": False, "inflight": 3, "budgeted": True, "who": replace(WHO, suspended_kind="payment")},
     "admit"),
    ({"check_quota": False, "model_status": "lost"}, "400 model_id"),
    # a call that waits (a training call on an existing model): queue states where others get 429
    ({"waits": True, "paused": 0}, "admit"),
    ({"waits": True, "paused": None}, "read quota"),
    ({"waits": True, "paused": 0, "inflight": 3}, "pause paused_rate_limit"),
    ({"waits": True, "paused": 0, "known_wait_s": 2.5}, "pause paused_rate_limit"),
    ({"waits": True, "paused": 1}, "pause paused_rate_limit"),  # behind the tenant's earlier waiting calls
    ({"waits": True, "paused": 1000, "inflight": 3}, "429 max_paused_requests"),
    ({"waits": True, "paused": 999, "max_paused": 999}, "429 max_paused_requests"),
    ({"waits": True, "paused": 1000}, "429 max_paused_requests"),
    ({"waits": True, "paused": 5, "holder": rule.Holder("r0", "forward_backward", "paused")}, "resume r0 paused"),
    # final refusals are judged before a wait: a call that will never run never waits
    ({"waits": True, "paused": 0, "inflight": 3, "budgeted": True, "budgets": (SPENT,)}, "402 budget.tenant"),
    ({"waits": True, "paused": 0, "inflight": 3, "budgeted": True}, "read budgets"),
    ({"waits": True, "paused": 0, "inflight": 3, "tokens": 1001}, "400 tokens_per_minute"),
    ({"waits": True, "paused": 0, "inflight": 3, "who": replace(WHO, suspended_kind="operator")},
     "403 tenant.suspended"),
    ({"waits": True, "paused": 0, "inflight": 3, "budgeted": True, "budgets": (ROOM,)}, "pause paused_rate_limit"),
    ({"paused": 3, "check_quota": False}, "pause paused_rate_limit"),  # a placeholder does not overtake them
    ({"paused": 0, "check_quota": False, "inflight": 9}, "admit"),
])
def test_every_refusal(change, expected):
    assert _outcome(rule.decide(replace(CALL, **change))) == expected


def test_reading_what_is_asked_for_always_reaches_a_decision():
    """Each Read names a fact that, once given, is never asked for again."""
    facts = replace(CALL, new_model=True, model_status=None, inflight=None, budgeted=None)
    given = {"live_models": {"live_models": 0}, "quota": {"inflight": 0, "budgeted": True},
             "budgets": {"budgets": (ROOM,)}}
    asked = []
    while isinstance(d := rule.decide(facts), rule.Read):
        asked.append(d.what)
        facts = replace(facts, **given[d.what])
    assert asked == ["live_models", "quota", "budgets"] and isinstance(d, rule.Admit)


# ------------------------------------------------------------------ the SQL guard against the rule

STATUSES = ("ready", "creating", "failed", "lost")
HOLDERS = (None, "forward_backward", "optim_step")


@pytest.mark.stack
def test_the_sql_fast_path_inserts_exactly_when_the_rule_admits(stack, tenant):
    model_id = new_model(stack.http(tenant.key))
    asyncio.run(_against_the_rule(stack.database_url, tenant.tenant_id, model_id))


async def _against_the_rule(url: str, tenant_id: str, model_id: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row) as conn:
        key_id = (await (await conn.execute("SELECT id FROM api_keys WHERE tenant_id = %s", (tenant_id,))
                         ).fetchone())["id"]
        inflight = (await (await conn.execute(
            "SELECT count(*) AS n FROM requests WHERE tenant_id = %s AND status IN ('queued', 'running')",
            (tenant_id,))).fetchone())["n"]
        base = Principal(tenant_id, "t", "tenant", key_id, 1.0, max_models=64, max_inflight_requests=inflight + 1,
                         tokens_per_minute=1000)
        whos = {"plain": base, "suspended": replace(base, suspended_kind="operator", suspended_reason="x"),
                "at quota": replace(base, max_inflight_requests=inflight)}
        seq = itertools.count(1000)
        cases = 0
        for status, holder, who_name, budgeted, tokens in itertools.product(
                STATUSES, HOLDERS, whos, (False, True), (0, 50, 2000)):
            who, seq_id = whos[who_name], next(seq)
            await conn.execute("UPDATE training_models SET status = %s WHERE id = %s", (status, model_id))
            if holder:
                await conn.execute("INSERT INTO requests (id, tenant_id, model_id, seq_id, kind, status) "
                                   "VALUES (%s, %s, %s, %s, %s, 'done')",
                                   (f"h-{uuid.uuid4().hex}", tenant_id, model_id, seq_id, holder))
            if budgeted:
                await conn.execute("INSERT INTO budgets (tenant_id, api_key_id, monthly_limit_micro_usd) "
                                   "VALUES (%s, NULL, 10000000000)", (tenant_id,))
            kind = WorkKind.FORWARD_BACKWARD if tokens else WorkKind.OPTIM_STEP
            body = PassWork("cross_entropy", LossConfig(), ()) if tokens else OptimStep(AdamParams())
            item = WorkItem(f"q-{uuid.uuid4().hex}", tenant_id, model_id, seq_id, kind, tokens, body)
            call = admission.facts(who, admission.Ticket(item, "", admission.SeqSlot(model_id, seq_id)))
            row = await records.insert_call(conn, who, item.request_id, model_id=model_id, seq_id=seq_id,
                                            kind=str(kind), n_tokens=tokens, billable=call.billable,
                                            unusable=list(rule.UNUSABLE), admissible=rule.fast_admissible(call))
            read = admission.facts(who, admission.Ticket(item, "", admission.SeqSlot.of(row, seq_id)))
            expected = isinstance(rule.decide(read), rule.Admit)
            assert row["inserted"] == expected, (status, holder, who_name, budgeted, tokens, _outcome(rule.decide(read)))
            await conn.execute("DELETE FROM requests WHERE id = %s", (item.request_id,))
            await conn.execute("DELETE FROM budgets WHERE tenant_id = %s", (tenant_id,))
            cases += 1
        await conn.execute("UPDATE training_models SET status = 'ready' WHERE id = %s", (model_id,))
    assert cases == len(STATUSES) * len(HOLDERS) * 3 * 2 * 3


def test_a_waiting_reason_names_the_limit():
    d = rule.decide(replace(CALL, waits=True, paused=0, inflight=3))
    assert isinstance(d, rule.Pause) and "max_inflight_requests" in d.reason and "3" in d.reason
    d = rule.decide(replace(CALL, waits=True, paused=0, known_wait_s=4.0))
    assert isinstance(d, rule.Pause) and "tokens_per_minute" in d.reason and "4.0 s" in d.reason
    assert rule.capacity_pause(2048).queue_state == "paused_capacity"


# ------------------------------------------------------------------ promotion of waiting calls

def _w(rid, model="m", seq=0, wait_s=0.0, age_s=0.0, cap=False):
    return rule.Waiting(rid, model, seq, 10, wait_s, age_s, cap)


@pytest.mark.parametrize(("waiting", "inflight", "limit", "expected"), [
    ([], 0, 3, []),
    ([_w("a", seq=1), _w("b", seq=2)], 0, 3, ["a", "b"]),
    ([_w("a", seq=1), _w("b", seq=2), _w("c", seq=3)], 1, 3, ["a", "b"]),  # two free places
    ([_w("a", seq=1), _w("b", seq=2)], 3, 3, []),  # none free
    ([_w("a", seq=1), _w("b", seq=2)], 5, 3, []),  # over (the limit was lowered meanwhile)
    # a model's later seq_id recorded first still runs after its earlier one
    ([_w("b", seq=2), _w("a", seq=1)], 2, 3, ["a"]),
    # the first in line still waiting for the bucket stops the line: no overtaking
    ([_w("a", seq=1, wait_s=2.0), _w("b", model="n", seq=1)], 0, 3, []),
    ([_w("a", seq=1), _w("b", seq=2, wait_s=0.5), _w("c", model="n")], 0, 3, ["a"]),
    ([_w("a", seq=1, cap=True), _w("b", model="n")], 0, 3, []),
    # models interleave in the order their calls came
    ([_w("a1", "a", 1), _w("b1", "b", 1), _w("a2", "a", 2)], 0, 2, ["a1", "b1"]),
    ([_w("a2", "a", 2), _w("b1", "b", 1), _w("a1", "a", 1)], 0, 3, ["a1", "b1", "a2"]),
])
def test_promotion(waiting, inflight, limit, expected):
    assert rule.promotable(waiting, inflight, limit) == expected


@pytest.mark.parametrize(("ages", "deadline", "expected"), [
    ([], 10.0, []),
    ([1.0, 9.9], 10.0, []),
    ([10.0, 3.0, 11.0], 10.0, ["w0", "w2"]),
])
def test_expiry(ages, deadline, expected):
    assert rule.expired([_w(f"w{i}", age_s=a) for i, a in enumerate(ages)], deadline) == expected


@pytest.mark.parametrize(("queued", "depth", "expected"), [
    (None, 10, False), (9, 10, False), (10, 10, True), (10_000, 0, False), (0, 0, False)])
def test_capacity(queued, depth, expected):
    assert rule.at_capacity(queued, depth) is expected
