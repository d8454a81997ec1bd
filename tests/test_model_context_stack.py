"""A model's context length, chosen at create_model (issue 64 item 5): an API process whose standard
context is 64 tokens, on the session stack's trainer. A model that asks for none takes 64 and refuses
a longer datum; one that asks for 200 trains a 150-token row; asking past the base's own context is a
400 naming `max_context_length` and the limit; and the ledger bills a model above a price-book
context tier that tier's percent, a model below it the plain rates."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
from stackutil import TINY, datum, fb_body, wait_future

from billing import price_book
from billing.ledger import record_usage
from billing.pricing import Units
from core import db


def _create(http: httpx.Client, session: str, seq: int, **extra) -> httpx.Response:
    return http.post("/create_model", json={"session_id": session, "model_seq_id": seq, "base_model": TINY,
                                            "lora_config": {"rank": 4, "seed": 0}, **extra})


def _model(http: httpx.Client, session: str, seq: int, **extra) -> str:
    r = _create(http, session, seq, **extra)
    assert r.status_code == 200, r.text
    result = wait_future(http, r.json()["request_id"])
    assert "error" not in result, result
    return result["model_id"]


def test_a_model_takes_the_context_it_asked_for_and_pays_its_tier(stack, tenant, tmp_path):
    from stackutil import second_api

    with second_api(stack, tmp_path, QUILT_STANDARD_CONTEXT_LENGTH="64") as url, \
            httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": tenant.key}, timeout=60) as http:
        session = http.post("/create_session", json={}).json()["session_id"]
        standard = _model(http, session, 0)
        longer = _model(http, session, 1, max_context_length=200)

        r = http.post("/forward_backward", json=fb_body(standard, 1, [datum(list(range(10, 76)))]))  # 65 inputs
        assert r.status_code == 400 and "exceed the model's context length 64" in r.text, r.text
        r = http.post("/forward_backward", json=fb_body(standard, 2, [datum(list(range(10, 75)))]))  # 64 inputs
        assert r.status_code == 200, r.text
        assert "error" not in wait_future(http, r.json()["request_id"])

        r = http.post("/forward_backward", json=fb_body(longer, 1, [datum(list(range(10, 161)))]))  # 150 inputs
        assert r.status_code == 200, r.text
        done = wait_future(http, r.json()["request_id"])
        assert "error" not in done and done["metrics"]["loss:sum"] > 0, done
        r = http.post("/forward_backward", json=fb_body(longer, 2, [datum(list(range(10, 212)))]))  # 201 inputs
        assert r.status_code == 400 and "context length 200" in r.text, r.text

        with db.connect(stack.database_url) as conn:
            base_context = conn.execute("SELECT max_context_length FROM base_models WHERE name = %s",
                                        (TINY,)).fetchone()["max_context_length"]
        r = _create(http, session, 2, max_context_length=base_context + 1)
        assert r.status_code == 400, r.text
        assert "max_context_length" in r.text and f"limit of {base_context:,}" in r.text, r.text
        r = _create(http, session, 3, max_context_length=0)  # the schema's own bound
        assert r.status_code in (400, 422) and "max_context_length" in r.text, r.text

    # The ledger: a price whose tier starts above 100 tokens (on a base name of its own, so no other
    # test's bill moves) charges the 200-token model 150 percent and the 64-token one the plain rate.
    base = f"ctx-tier-{uuid.uuid4().hex[:8]}"
    with db.connect(stack.database_url) as conn:
        price_book.add_price(conn, base_model=base, effective_from=datetime.now(UTC) - timedelta(hours=1),
                             prefill=195_000, sample=600_000, train=440_000, context_tiers=[[100, 150]])
        billed = {}
        for model_id in (standard, longer):
            entry = record_usage(conn, request_id=f"ctx-{uuid.uuid4().hex}", tenant_id=tenant.tenant_id,
                                 api_key_id=None, model_id=model_id, base_model=base,
                                 units=Units(train_tokens=1_000_000))
            row = conn.execute("SELECT context_percent, train_micro_usd FROM usage_ledger WHERE id = %s",
                               (entry.id,)).fetchone()
            billed[model_id] = (row["context_percent"], row["train_micro_usd"], entry.cost.train_micro_usd)
    assert billed == {standard: (100, 440_000, 440_000), longer: (150, 660_000, 660_000)}, billed
