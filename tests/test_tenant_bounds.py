"""Every tenant bounded: free-form fields have size limits, refused with a 400 naming the field and
the limit."""

from __future__ import annotations

import pytest
from stackutil import TINY

from api.schemas import USER_METADATA_BYTES


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/create_session", {"user_metadata": {"note": "x" * (4 << 20)}}, "user_metadata"),
    ("/create_session", {"user_metadata": {f"k{i}": "v" * 100 for i in range(200)}}, "user_metadata"),
    ("/create_session", {"tags": ["t" * 129]}, "tags[0]"),
    ("/create_session", {"tags": ["t"] * 65}, "tags"),
    ("/create_session", {"display_name": "d" * 257}, "display_name"),
    ("/create_model", {"session_id": "s", "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4},
                       "user_metadata": {"note": "x" * (USER_METADATA_BYTES + 1)}}, "user_metadata"),
])
def test_free_form_fields_past_their_limit_are_a_400_naming_them(stack, tenant, route, body, field):
    with stack.http(tenant.key) as client:
        r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.text
    if field == "user_metadata":
        assert str(USER_METADATA_BYTES) in r.json()["detail"]


def test_metadata_within_the_limit_is_kept(stack, tenant):
    metadata = {"run": "a" * (USER_METADATA_BYTES - 100)}
    with stack.http(tenant.key) as client:
        r = client.post("/create_session", json={"user_metadata": metadata})
        assert r.status_code == 200, r.text
        session = client.get(f"/sessions/{r.json()['session_id']}").json()
    assert session["user_metadata"] == metadata


def test_one_tenants_long_polls_are_bounded_per_process_and_others_still_answer(stack, tmp_path):
    """Past QUILT_LONG_POLLS_PER_TENANT open polls, that tenant's next is a 429 with Retry-After;
    another tenant's poll on the same API process is answered."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from stackutil import new_model, second_api

    hog, other = stack.create_tenant("hog"), stack.create_tenant("other")

    def pending_request(tenant) -> str:
        """A request that cannot finish yet: seq_id 2 waits for a seq_id 1 that never comes."""
        with stack.http(tenant.key) as c:
            model_id = new_model(c, rank=4)
            r = c.post("/forward", json={"model_id": model_id, "seq_id": 2, "forward_input": {
                "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                          "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}}}],
                "loss_fn": "cross_entropy"}})
            assert r.status_code == 200, r.text
            return r.json()["request_id"]

    waits = [(hog.key, pending_request(hog))] * 3 + [(other.key, pending_request(other))]
    with second_api(stack, tmp_path, QUILT_LONG_POLLS_PER_TENANT="2", QUILT_LONG_POLL_SECONDS="3") as url:
        def poll(wait) -> httpx.Response:
            key, request_id = wait
            return httpx.post(url + "/api/v1/retrieve_future", json={"request_id": request_id},
                              headers={"X-API-Key": key}, timeout=30)

        with ThreadPoolExecutor(len(waits)) as pool:
            answers = list(pool.map(poll, waits))
    codes = sorted(r.status_code for r in answers[:3])
    assert codes == [200, 200, 429], codes
    refused = next(r for r in answers[:3] if r.status_code == 429)
    assert refused.json()["field"] == "long_polls" and "Retry-After" in refused.headers
    assert answers[3].status_code == 200 and answers[3].json()["type"] == "try_again"  # the other tenant waited


def test_checkpoint_bytes_are_a_plan_quota_shown_in_usage_and_refusing_saves(stack, tenant):
    """max_checkpoint_bytes (issue 46 item 5): once a tenant's live checkpoints reach it, a save is a
    403 naming the field; reads, downloads and deletes keep working, and deleting frees the room."""
    from dashutil import operator_key
    from stackutil import new_model, wait_future

    with stack.http(operator_key(stack)) as operator:
        r = operator.put(f"/quilt/tenants/{tenant.name}/plan", json={"max_checkpoint_bytes": 1})
        assert r.status_code == 200 and r.json()["max_checkpoint_bytes"] == 1, r.text
        assert operator.put(f"/quilt/tenants/{tenant.name}/plan",
                            json={"max_checkpoint_bytes": 2**63}).status_code == 400
    with stack.http(tenant.key) as client:
        model_id = new_model(client)
        first = client.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "first"})
        assert first.status_code == 200, first.text  # nothing stored yet: under the quota
        assert "error" not in wait_future(client, first.json()["request_id"])
        usage = client.get("/quilt/usage").json()
        assert usage["max_checkpoint_bytes"] == 1 and usage["checkpoint_bytes"] > 1
        refused = client.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "second"})
        assert refused.status_code == 403 and refused.json()["field"] == "max_checkpoint_bytes", refused.text
        assert client.get(f"/training_runs/{model_id}/checkpoints").status_code == 200
        assert client.delete(f"/training_runs/{model_id}/checkpoints/weights/first").status_code == 204
        assert client.get("/quilt/usage").json()["checkpoint_bytes"] == 0
        again = client.post("/save_weights", json={"model_id": model_id, "seq_id": 3, "path": "second"})
        assert again.status_code == 200, again.text


def test_stored_result_bytes_are_bounded_per_tenant(stack, r):
    """core.result_bytes: each stored future adds its size to its tenant's hourly counter; past
    QUILT_TENANT_MAX_RESULT_BYTES a flag refuses that tenant's new work with a 429 naming
    `result_bytes` (nothing appended, the row gone, so a retry is admitted once the flag clears),
    and other tenants are untouched."""
    from stackutil import new_model

    from core import result_bytes

    full, other = stack.create_tenant("rbytes-full"), stack.create_tenant("rbytes-other")
    with stack.http(full.key) as client:
        model_id = new_model(client)
    counted = int(r.get(result_bytes.keys(full.tenant_id, 3600)[0]) or 0)
    assert counted > 0  # create_model's future was counted as it was stored
    # A worker storing a 1 KiB result under a cap of 100 bytes sets the flag.
    total = result_bytes.note(r, full.tenant_id, 1024, 3600, cap=100)
    assert total >= 1024 and int(r.get(result_bytes.over_key(full.tenant_id))) == total
    assert 0 < r.ttl(result_bytes.over_key(full.tenant_id)) <= result_bytes.OVER_FLAG_S
    with stack.http(full.key) as client:
        refused = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {
            "learning_rate": 0.01}})
        assert refused.status_code == 429 and refused.json()["field"] == "result_bytes", refused.text
        assert "retry-after" in refused.headers
    with stack.http(other.key) as client:
        assert client.post("/create_session", json={}).status_code == 200
        assert new_model(client)
    r.delete(result_bytes.over_key(full.tenant_id))  # it expires on its own within a minute
    with stack.http(full.key) as client:
        again = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {
            "learning_rate": 0.01}})
        assert again.status_code == 200, again.text  # the refused call left no row holding seq_id 1


def test_the_operator_page_sets_a_tenants_checkpoint_storage(stack, tenant):
    import contextlib
    import re

    from dashutil import csrf_of, login, operator_key

    from core import db

    with contextlib.closing(login(stack, operator_key(stack))) as operator:
        page = operator.get("/dashboard/tenants").text
        assert re.search(rf'id="tenant-{tenant.name}".*?name="checkpoint_gib" value="100"', page, re.S)
        form = {"csrf_token": csrf_of(page), "tokens_per_minute": 1000, "max_inflight_requests": 8, "max_models": 4,
                "plan_weight": 1, "checkpoint_gib": 0.5}
        assert operator.post(f"/dashboard/tenants/{tenant.name}/plan", data=form).status_code == 303
        assert operator.post(f"/dashboard/tenants/{tenant.name}/plan",
                             data={**form, "checkpoint_gib": "nan"}).status_code == 400
    with db.connect(stack.database_url) as conn:
        row = conn.execute("SELECT max_checkpoint_bytes FROM tenants WHERE id = %s", (tenant.tenant_id,)).fetchone()
    assert row["max_checkpoint_bytes"] == 2**29
