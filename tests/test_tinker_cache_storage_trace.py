"""Issue 62 items 8 and 9 through the official tinker SDK against the embedded stack: a repeated
prompt's prefix-cache hits come back per sample (`prompt_cache_hit_tokens`) and are billed at the
cached rate (20% of prefill by default); checkpoint storage is accrued onto the ledger once per
hour however often the accrual runs, and shows in `get_billing_usage` and the storage report; a
session's trace exports (`RestClient.export_session_trace`) as Chrome trace-event JSON with its
admission, queue waits, trainer passes, exports and sampling, for its own tenant only."""

from __future__ import annotations

import json
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest

tinker = pytest.importorskip("tinker")
if not hasattr(tinker, "AdminClient"):
    pytest.skip("the storage report and trace export are tinker 0.38's", allow_module_level=True)
from tinker import types  # noqa: E402
from tinkerutil import ready, sft_row  # noqa: E402

from billing import price_book, storage  # noqa: E402
from billing.pricing import storage_cost, unit_cost  # noqa: E402
from core import db  # noqa: E402

pytestmark = pytest.mark.stack

TINY = "quilt/tiny-qwen3"
PROMPT = list(range(20, 220))  # 200 tokens: many prefix-cache blocks


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run(stack):
    """One tenant's session: a training step, an export to a sampler, the same prompt sampled
    twice, and a saved state."""
    tenant = stack.create_tenant("cache")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        tc.forward_backward([sft_row(40)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = ready(tc.save_weights_and_get_sampling_client())
        params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=3, stop=[])
        first = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
        again = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
        tc.save_state("kept").result()
        session_id = tc.model_id.split(":")[0]
    return tenant, session_id, first, again


def _window() -> tuple[datetime, datetime]:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return hour - timedelta(hours=1), hour + timedelta(hours=2)


def test_a_repeated_prompt_reports_its_hits_and_pays_a_fifth_for_them(stack, run):
    tenant, _, first, again = run
    assert again.prompt_cache_hit_tokens > 0 and again.prompt_cache_hit_tokens < len(PROMPT)
    with db.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT l.* FROM usage_ledger l JOIN requests r ON r.id = l.request_id "
                            "WHERE l.tenant_id = %s AND r.kind = 'sample' ORDER BY l.id", (tenant.tenant_id,)).fetchall()
        price = price_book.current_price_sync(conn, TINY)
    assert price is not None and price.rate("cached") * 5 == price.prefill_micro_usd_per_mtok
    assert [(r["prefill_tokens"] + r["cached_tokens"]) for r in rows] == [len(PROMPT)] * 2
    assert [r["cached_tokens"] for r in rows] == [first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens]
    hit = rows[1]
    assert hit["cached_micro_usd"] == unit_cost(hit["cached_tokens"], price.prefill_micro_usd_per_mtok // 5)
    assert hit["prefill_micro_usd"] == unit_cost(hit["prefill_tokens"], price.prefill_micro_usd_per_mtok)
    assert hit["cost_micro_usd"] == hit["prefill_micro_usd"] + hit["cached_micro_usd"] + hit["sample_micro_usd"]

    admin = tinker.AdminClient(base_url=stack.base_url, api_key=tenant.key)
    usage = admin.get_billing_usage(*_window()).result()
    cached = [e for e in usage.data if e.event_info.type == "sampling_prefill" and e.event_info.cached]
    assert sum(e.event_info.token_count for e in cached) == sum(r["cached_tokens"] for r in rows)
    assert sum(round(e.estimated_cost_usd * 1e6) for e in cached) == sum(r["cached_micro_usd"] for r in rows)


def test_storage_is_accrued_once_per_hour_and_reported(stack, run):
    """The hour's accrual runs twice (Celery beat and a retry, say): one ledger row per tenant and
    base. A storage rate of $1,000 per GB-month (a new price entry for the tiny base, same token
    rates) makes the tiny checkpoints' hour cost whole micro-USD."""
    tenant = run[0]
    with db.connect(stack.database_url) as conn:
        now = conn.execute("SELECT now() AS now").fetchone()["now"]
        old = price_book.current_price_sync(conn, TINY)
        assert old is not None
        price_book.add_price(conn, base_model=TINY, effective_from=now, prefill=old.prefill_micro_usd_per_mtok,
                             sample=old.sample_micro_usd_per_mtok, train=old.train_micro_usd_per_mtok,
                             cached=old.cached_micro_usd_per_mtok, storage=10**9, note="storage test")
        # A copy inside the tenant names the same files (as copy_weights makes it): stored, and billed, once.
        conn.execute("INSERT INTO checkpoints (tenant_id, model_id, kind, name, storage_path, size_bytes) "
                     "SELECT tenant_id, model_id, kind, name || '-copy', storage_path, size_bytes FROM checkpoints "
                     "WHERE tenant_id = %s ORDER BY id LIMIT 1", (tenant.tenant_id,))
        hour = storage.last_hour(now) + timedelta(hours=1)  # this hour: the test's own period
        assert storage.accrue(conn, hour) >= 1
        assert storage.accrue(conn, hour) == 0
        # An hour accrued late bills only what was saved before it ended: nothing of this tenant's.
        storage.accrue(conn, hour - timedelta(hours=1))
        (row,) = conn.execute("SELECT * FROM usage_ledger WHERE tenant_id = %s AND storage_byte_hours > 0",
                              (tenant.tenant_id,)).fetchall()
        # Dated at the hour it bills, not when it was written (an hour later): so are the rollups.
        hourly = conn.execute("SELECT hour FROM usage_hourly WHERE tenant_id = %s AND storage_byte_hours > 0",
                              (tenant.tenant_id,)).fetchall()
        live = conn.execute("SELECT sum(size_bytes)::bigint AS b FROM (SELECT DISTINCT ON (storage_path) size_bytes "
                            "FROM checkpoints WHERE tenant_id = %s) f", (tenant.tenant_id,)).fetchone()["b"]
    assert row["request_id"] == f"storage:{tenant.tenant_id}:{TINY}:{hour:%Y-%m-%dT%H}"
    assert row["created_at"] == hour and [h["hour"] for h in hourly] == [hour]
    assert row["storage_byte_hours"] == live > 0
    assert row["storage_micro_usd"] == row["cost_micro_usd"] == storage_cost(live, 10**9) > 0

    admin = tinker.AdminClient(base_url=stack.base_url, api_key=tenant.key)
    (event,) = [e for e in admin.get_billing_usage(*_window()).result().data if e.event_info.type == "storage"]
    assert event.event_info.gigabyte_hours == pytest.approx(live / 1e9)
    assert round(event.estimated_cost_usd * 1e6) == row["storage_micro_usd"]
    report = admin.get_current_checkpoint_storage_usage().result()
    assert report.effective_rate_usd_per_gigabyte_month == pytest.approx(1000.0)
    assert report.data[0].estimated_monthly_cost_usd == pytest.approx(report.data[0].size_gigabytes * 1000.0)


def test_the_session_trace_opens_as_chrome_json_for_its_owner_only(stack, run):
    tenant, session_id, _, _ = run
    rest = tinker.RestClient(base_url=stack.base_url, api_key=tenant.key)
    url = rest.export_session_trace(session_id).result()
    with urllib.request.urlopen(url, timeout=60) as response:
        trace = json.loads(response.read())
    names = [e["name"] for e in trace["traceEvents"]]
    assert {"admitted", "queue wait", "trainer pass", "optimizer step", "export", "sampling"} <= set(names)
    assert names.count("sampling") == 2 * 2  # two samples, a begin and an end each
    assert trace["otherData"]["truncated"] is False and trace["otherData"]["session_id"] == session_id
    begins = sorted((e["id"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "b")
    assert begins == sorted((e["id"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "e")

    other = stack.create_tenant("cache")
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=stack.base_url, api_key=other.key).export_session_trace(session_id).result()
