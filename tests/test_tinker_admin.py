"""What the official tinker SDK (0.38) reads beside training, against a running embedded Quilt:
sessions (`RestClient.list_sessions` / `get_session`), checkpoints' `user_metadata`, the bill (`AdminClient.get_billing_usage`,
`get_current_checkpoint_storage_usage` and `tinker billing ...`), the audit log
(`AdminClient.get_audit_log`). Each shows one tenant only its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta

import pytest

tinker = pytest.importorskip("tinker")
if not hasattr(tinker, "AdminClient"):
    pytest.skip("tinker releases before 0.38 have no AdminClient", allow_module_level=True)
from tinker import types  # noqa: E402
from tinkerutil import ready  # noqa: E402

from core import db  # noqa: E402

pytestmark = pytest.mark.stack

TINY = "quilt/tiny-qwen3"


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _window() -> tuple[datetime, datetime]:
    """Three UTC hours around now: a test that runs across an hour's end still sees all its usage."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return hour - timedelta(hours=1), hour + timedelta(hours=2)


def _ledger(stack, tenant_id: str) -> dict:
    with db.connect(stack.database_url) as conn:
        return conn.execute(
            "SELECT coalesce(sum(train_tokens), 0) AS training, "
            "coalesce(sum(prefill_tokens + cached_tokens), 0) AS sampling_prefill, "
            "coalesce(sum(sample_tokens), 0) AS sampling_sample, coalesce(sum(cost_micro_usd), 0) AS micro_usd "
            "FROM usage_ledger WHERE tenant_id = %s", (tenant_id,)).fetchone()


def _train_and_sample(service) -> tuple:
    tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
    toks = list(range(40, 57))
    datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16})
    tc.forward_backward([datum, datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = ready(tc.save_weights_and_get_sampling_client())
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=1, stop=[])
    sampler.sample(types.ModelInput.from_ints([40, 41, 42]), 2, params).result()
    return tc, sampler


def test_sessions_bill_and_storage_through_the_official_sdk(stack):
    a, b = stack.create_tenant("adm"), stack.create_tenant("adm")
    with tinker.ServiceClient(user_metadata={"experiment": "grpo-7"}, display_name="nightly",
                              base_url=stack.base_url, api_key=a.key) as service:
        tc, sampler = _train_and_sample(service)
        state = tc.save_state("kept", user_metadata={"eval": "0.81"}).result()
        rest = tinker.RestClient(base_url=stack.base_url, api_key=a.key)
        session_id = tc.model_id.split(":")[0]
        (kept,) = [c for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == state.path]
        assert kept.user_metadata == {"eval": "0.81"}

        # Sessions: the run and the sampler it made, with the metadata and name it was opened with.
        got = rest.get_session(session_id).result()
        assert got.training_run_ids == [tc.model_id] and len(got.sampler_ids) == 1
        assert got.user_metadata == {"experiment": "grpo-7"} and got.display_name == "nightly"
        assert rest.list_sessions().result().sessions[0] == session_id
        assert rest.list_sessions(limit=1, offset=1).result().sessions == []

        # The bill: every token of the ledger, in events attributed to the session and the key.
        admin = tinker.AdminClient(base_url=stack.base_url, api_key=a.key)
        start, end = _window()
        usage = admin.get_billing_usage(start, end).result()
        ledger = _ledger(stack, a.tenant_id)
        by_type = {kind: sum(e.event_info.token_count for e in usage.data if e.event_info.type == kind)
                   for kind in ("training", "sampling_prefill", "sampling_sample")}
        assert by_type == {k: ledger[k] for k in by_type}
        assert by_type["training"] == 32 and by_type["sampling_sample"] == 10
        assert sum(round(e.estimated_cost_usd * 1_000_000) for e in usage.data) == ledger["micro_usd"] > 0
        assert {e.session_id for e in usage.data} == {session_id}
        assert {e.user_id for e in usage.data} == {f"key:{a.key[:12]}"}
        assert usage.sessions[session_id].user_metadata == {"experiment": "grpo-7"}
        assert all(e.bucket_end - e.bucket_start == timedelta(hours=1) for e in usage.data)

        # Checkpoint storage: what list_user_checkpoints lists, in count and bytes, at the storage rate.
        storage = admin.get_current_checkpoint_storage_usage().result()
        listed = rest.list_user_checkpoints().result().checkpoints
        (row,) = storage.data
        assert (row.checkpoint_count, row.size_bytes) == (len(listed), sum(c.size_bytes for c in listed))
        assert row.size_bytes > 0 and storage.effective_rate_usd_per_gigabyte_month > 0
        assert row.estimated_monthly_cost_usd == pytest.approx(row.size_gigabytes * storage.effective_rate_usd_per_gigabyte_month)
        assert row.project_id is not None  # every session is in a project: here the tenant's default one
        assert admin.get_current_checkpoint_storage_usage(project_id=row.project_id).result().data == [row]
        with pytest.raises(tinker.NotFoundError, match="project"):
            admin.get_current_checkpoint_storage_usage(project_id="p-1").result()

        # A checkpoint that happens to be called "publish" still deletes (publishing: test_sharing_sdk.py).
        named_publish = tc.save_state("publish").result().path
        rest.delete_checkpoint_from_tinker_path(named_publish).result()
        assert named_publish not in {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

    # Tenant B sees none of it.
    rest_b = tinker.RestClient(base_url=stack.base_url, api_key=b.key)
    admin_b = tinker.AdminClient(base_url=stack.base_url, api_key=b.key)
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_session(session_id).result()
    assert session_id not in rest_b.list_sessions().result().sessions
    assert admin_b.get_billing_usage(start, end).result().data == []
    assert admin_b.get_current_checkpoint_storage_usage().result().data == []
    with pytest.raises(tinker.NotFoundError):
        admin_b.get_current_checkpoint_storage_usage(project_id=row.project_id).result()


def test_the_tinker_cli_prints_the_bill(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        _train_and_sample(service)
    start, end = (t.strftime("%Y-%m-%dT%H:%M:%SZ") for t in _window())
    env = {**os.environ, "TINKER_API_KEY": tenant.key, "TINKER_BASE_URL": stack.base_url}

    def cli(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "tinker.cli", "--format", "json", *args], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    usage = cli("billing", "usage", start, end)
    ledger = _ledger(stack, tenant.tenant_id)
    assert sum(e["event_info"]["token_count"] for e in usage["data"] if e["event_info"]["type"] == "training") \
        == ledger["training"] > 0
    assert cli("billing", "checkpoint-storage")["data"][0]["checkpoint_count"] >= 1

    done = subprocess.run([sys.executable, "-m", "tinker.cli", "billing", "usage", start.replace(":00:00", ":30:00"),
                           end], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "starting_on must be on a UTC hour" in done.stdout + done.stderr


def test_usage_windows_are_checked_at_the_edge(stack, tenant):
    start, _ = _window()
    with stack.http(tenant.key) as c:
        for params, field in [
            ({"starting_on": start.isoformat(), "ending_before": (start + timedelta(days=15)).isoformat()},
             "ending_before"),
            ({"starting_on": "9999-12-31T23:00:00-05:00", "ending_before": start.isoformat()}, "starting_on"),
            ({"starting_on": "not a time", "ending_before": start.isoformat()}, "query.starting_on"),
            ({"starting_on": "2026-12-01T00:00:00\x00", "ending_before": start.isoformat()}, "starting_on"),
            ({"ending_before": start.isoformat()}, "query.starting_on"),
        ]:
            r = c.get("/billing/usage/events", params=params)
            assert r.status_code == 400 and r.json()["field"] == field, (params, r.text)
        r = c.get("/audit", params={"day": "9999-12-31"})
        assert r.status_code == 200 and r.json() == {"entries": []}
        r = c.get("/audit", params={"event_type": "everything"})
        assert r.status_code == 400 and r.json()["field"] == "query.event_type"
        r = c.get("/sessions", params={"limit": 2**40})
        assert r.status_code == 400 and r.json()["field"] == "query.limit"


def test_audit_log_through_the_official_sdk(stack):
    a, b = stack.create_tenant("aud"), stack.create_tenant("aud")
    with stack.http(a.key) as c:
        c.put("/quilt/budgets", json={"monthly_usd": "25"}).raise_for_status()
    admin = tinker.AdminClient(base_url=stack.base_url, api_key=a.key)
    (entry,) = [e for e in admin.get_audit_log().result().entries if e.event == "budget_set"]
    assert entry.event_details == {"actor": f"key:{a.key[:12]}", "monthly_micro_usd": 25_000_000}
    assert [e.event for e in admin.get_audit_log("organizations").result().entries] == ["budget_set"]
    assert admin.get_audit_log("teams").result().entries == []
    today = datetime.now(UTC).date()
    assert len(admin.get_audit_log(day=today).result().entries) + \
        len(admin.get_audit_log(day=today - timedelta(days=1)).result().entries) == 1
    assert admin.get_audit_log(day=date(2020, 1, 1)).result().entries == []
    assert tinker.AdminClient(base_url=stack.base_url, api_key=b.key).get_audit_log().result().entries == []
