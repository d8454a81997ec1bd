"""A refused training call uses up its seq_id, so the model's later calls never wait for it."""

from __future__ import annotations

import quilt.training
from stackutil import ADAM, datum, fb_body, new_model, wait_future

from api import seq_gaps
from core import db

TOKENS = list(range(10, 30))


def test_server_and_sdk_agree_on_which_refusals_keep_the_id_free():
    assert seq_gaps.SEQ_FREE_STATUSES == quilt.training.SEQ_FREE_STATUSES
    assert [s for s in (400, 402, 403, 404, 422) if not seq_gaps.uses_up_seq(s)] == []
    assert [s for s in (200, 401, 408, 409, 413, 429, 500, 503) if seq_gaps.uses_up_seq(s)] == []


def _ledger_rows(stack, request_id: str) -> int:
    with db.connect(stack.database_url) as conn:
        return conn.execute("SELECT count(*) AS n FROM usage_ledger WHERE request_id = %s", (request_id,)).fetchone()["n"]


def test_refused_calls_do_not_block_the_model(stack, tenant):
    http = stack.http(tenant.key)
    model_id = new_model(http)

    def post(route: str, seq_id: int, **body):
        return http.post(route, json={"model_id": model_id, "seq_id": seq_id, **body})

    first = http.post("/forward_backward", json=fb_body(model_id, 1, [datum(TOKENS)]))
    # Refused in the route (no such checkpoint), by validation (bad name), and by datum checks.
    missing = post("/load_weights", 2, path=f"tinker://{model_id}/weights/nope")
    assert missing.status_code == 404, missing.text
    bad_name = post("/save_weights", 3, path="no spaces allowed")
    assert bad_name.status_code == 400 and bad_name.json()["field"] == "path", bad_name.text
    bad_token = http.post("/forward", json=fb_body(model_id, 4, [datum([10, 10**7])]))
    assert bad_token.status_code == 400, bad_token.text
    # The next calls run, in order, after the refused ones.
    optim = post("/optim_step", 5, adam_params=ADAM)
    after = http.post("/forward", json=fb_body(model_id, 6, [datum(TOKENS)]))
    assert "loss:sum" in wait_future(http, first.json()["request_id"], timeout_s=120)["metrics"]
    stepped = wait_future(http, optim.json()["request_id"], timeout_s=120)
    assert "error" not in stepped and "grad_norm:mean" in stepped["metrics"], stepped
    assert "loss:sum" in wait_future(http, after.json()["request_id"], timeout_s=120)["metrics"]

    # Each refusal is on record as a failed request at its seq_id, and nothing was billed for it.
    with db.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT id, seq_id, kind, status, error FROM requests WHERE model_id = %s "
                            "AND seq_id BETWEEN 2 AND 4 ORDER BY seq_id", (model_id,)).fetchall()
    assert [(r["seq_id"], r["kind"], r["status"]) for r in rows] == [
        (2, "load_weights", "failed"), (3, "save_weights", "failed"), (4, "forward", "failed")]
    assert "HTTP 404" in rows[0]["error"]["error"] and "nope" in rows[0]["error"]["error"]
    assert all(_ledger_rows(stack, r["id"]) == 0 for r in rows)


def test_another_tenants_refusal_does_not_touch_my_model(stack, tenant):
    mine, theirs = stack.http(tenant.key), stack.http(stack.create_tenant("intruder").key)
    model_id = new_model(mine)
    r = theirs.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": ADAM})
    assert r.status_code == 404
    r = theirs.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "bad name"})
    assert r.status_code == 400
    ok = mine.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": ADAM})
    assert "metrics" in wait_future(mine, ok.json()["request_id"], timeout_s=120)
