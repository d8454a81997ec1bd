"""The dashboard in headless Chromium (Debian's package, driven by Playwright) against the real
stack: log in, the SFT example's loss curve, API keys through the UI, tenant isolation, CSRF, and
the operator's health plots. Screenshots go to artifacts/screenshots/ (CI keeps artifacts/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import quilt
from dashutil import SHOTS, operator_key, run_url
from stackutil import datum, fb_body, new_model, wait_future

ROOT = Path(__file__).resolve().parents[1]
SFT_STEPS = 12
SERIES_BLUE = (37, 99, 235)  # the first series' colour in dashboard.js

# Pixels of a plot's canvas in its first series' colour: a drawn curve or bars, not just axes.
_SERIES_PIXELS = """(el, rgb) => {
  const c = el.querySelector('canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (d[i + 3] > 100 && Math.abs(d[i] - rgb[0]) < 40 && Math.abs(d[i + 1] - rgb[1]) < 40
        && Math.abs(d[i + 2] - rgb[2]) < 40) n++;
  return n;
}"""


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"script errors on the page: {errors}"


def _login(page, stack, key: str) -> None:
    page.goto(stack.base_url + "/dashboard/login")
    page.fill("#api-key", key)
    page.click("#login-submit")
    page.wait_for_url("**/dashboard/runs")


def _shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def sft_run(stack):
    """A tenant who ran the SFT example; returns (tenant, model id)."""
    tenant = stack.create_tenant("ui")
    env = {**os.environ, "QUILT_API_KEY": tenant.key, "QUILT_BASE_URL": stack.base_url}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sft_tiny.py"), "--steps", str(SFT_STEPS)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_id = re.search(r"^training (\S+) \(rank", proc.stdout, re.M).group(1)
    return tenant, model_id


def test_sft_loss_curve_has_one_point_per_step(stack, page, sft_run):
    tenant, model_id = sft_run
    _login(page, stack, tenant.key)
    _shot(page, "runs")
    page.click(f"a.run-link:text-is('{model_id}')")
    page.wait_for_selector("#loss-plot[data-drawn='1'] canvas")
    assert page.get_attribute("#loss-plot", "data-points") == str(SFT_STEPS)
    assert page.eval_on_selector("#loss-plot", _SERIES_PIXELS, list(SERIES_BLUE)) > 50
    assert page.text_content("#run-step") == str(SFT_STEPS)
    _shot(page, "run-loss-curve")


def test_create_and_revoke_a_key_in_the_ui(stack, page, tenant):
    _login(page, stack, tenant.key)
    page.click("text=API keys")
    page.fill("#key-name", "made-in-the-ui")
    page.click("#create-key")
    secret = page.text_content("#new-key-secret").strip()
    assert secret.startswith("tml-")
    assert stack.http(secret).post("/create_session", json={}).status_code == 200
    _shot(page, "key-created")

    row = f"#keys-table tr[data-prefix='{secret[:12]}']"
    page.click(f"{row} button.revoke")
    page.wait_for_selector("#revoked-notice")
    assert page.text_content(f"{row} .key-status").strip().startswith("revoked")
    assert stack.http(secret).post("/create_session", json={}).status_code == 401
    assert page.text_content(f"#keys-table tr[data-prefix='{tenant.key[:12]}'] .key-status").strip() == "active"
    _shot(page, "key-revoked")


def test_tenant_b_cannot_reach_tenant_a_pages(stack, page, sft_run):
    _, model_id = sft_run
    _login(page, stack, stack.create_tenant("ui-b").key)
    response = page.goto(stack.base_url + run_url(model_id))
    assert response.status == 404 and page.text_content("#error-status") == "404"
    _shot(page, "other-tenants-run-404")
    download = page.request.get(stack.base_url + run_url(model_id) + "/checkpoints/weights/sft-final/adapter.tar.gz")
    assert download.status == 404
    page.goto(stack.base_url + "/dashboard/checkpoints")
    assert model_id not in page.content()


def test_a_change_without_the_csrf_token_is_403(stack, page, tenant):
    _login(page, stack, tenant.key)
    page.goto(stack.base_url + "/dashboard/keys")
    post = """token => fetch('/dashboard/keys', {method: 'POST', body: new URLSearchParams(
        Object.assign({name: 'via-fetch'}, token ? {csrf_token: token} : {}))}).then(r => r.status)"""
    assert page.evaluate(post, None) == 403
    token = page.get_attribute("#create-key-form input[name=csrf_token]", "value")
    assert page.evaluate(post, token) == 200


def test_operator_page_draws_its_health_plots(stack, page, sft_run):
    tenant, _ = sft_run
    with stack.sdk(tenant.key) as client:  # one finished sampling group: a time-to-batch sample
        sampler = client.create_sampling_client(base_model="quilt/tiny-qwen3")
        sampler.sample([5, 6, 7], 2, quilt.SamplingParams(max_tokens=4, seed=0)).result()
    http = stack.http(tenant.key)  # one forward_backward on data of a named policy version: staleness
    model_id = new_model(http)
    body = fb_body(model_id, 1, [datum(list(range(5, 20)))], loss_fn_config={"policy_version": 0})
    assert "error" not in wait_future(http, http.post("/forward_backward", json=body).json()["request_id"])
    _login(page, stack, operator_key(stack))
    page.click("#nav-ops")
    page.wait_for_function("() => { const p = [...document.querySelectorAll('.plot.health')];"
                           " return p.length > 0 && p.every(e => e.dataset.drawn === '1'); }")
    plots = page.eval_on_selector_all(".plot.health", "els => els.map(e => [e.id, +e.dataset.points])")
    ids = {name for name, _ in plots}
    assert {"queue-plot-0", "rate-plot-0", "busy-plot-0", "slots-plot-0", "rounds-plot-0", "tokens-plot-0",
            "ttb-plot", "staleness-plot", "share-plot"} <= ids
    for name in ("rate-plot-0", "busy-plot-0", "rounds-plot-0", "ttb-plot", "share-plot"):
        assert dict(plots)[name] > 0, plots
        assert page.eval_on_selector(f"#{name}", _SERIES_PIXELS, list(SERIES_BLUE)) > 20, name
    assert "forward_backward requests" in page.text_content("#staleness-n")
    refreshed = page.evaluate("() => document.body.dataset.lastRefresh")
    page.wait_for_function("r => document.body.dataset.lastRefresh !== r", arg=refreshed)  # live polling
    _shot(page, "operator-health")


def test_an_owner_edits_budgets_and_sees_who_did_it(stack, page, tenant):
    _login(page, stack, tenant.key)
    page.click("#nav-account")
    assert page.is_visible("#no-budgets")
    page.fill("#budget-usd", "25")
    page.click("#budget-save")
    page.wait_for_selector("#saved-notice")
    assert page.text_content("#account-budgets tr[data-scope='tenant'] .budget-limit").strip() == "$25.000000"
    page.select_option("#budget-scope", tenant.key[:12])
    page.fill("#budget-usd", "0")
    page.click("#budget-save")
    page.wait_for_selector("#account-budgets tr[data-scope='key']")
    model = stack.http(tenant.key).post("/create_model", json={
        "session_id": stack.http(tenant.key).post("/create_session", json={}).json()["session_id"],
        "model_seq_id": 0, "base_model": "quilt/tiny-qwen3", "lora_config": {"rank": 4}})
    assert model.status_code == 402 and model.json()["field"] == "budget.api_key", model.text
    actions = [a.strip() for a in page.locator("#audit-table .audit-action").all_text_contents()]
    assert actions[:2] == ["budget.set", "budget.set"]
    _shot(page, "account-budgets")
    # A bad amount is an error page naming the field, and changes nothing.
    page.fill("#budget-usd", "NaN")
    page.click("#budget-save")
    assert "monthly_usd" in page.content()
    page.goto(stack.base_url + "/dashboard/account")
    assert len(page.locator("#audit-table .audit-row").all()) == 2


def test_an_operator_suspends_restores_and_grants_credit(stack, browser, page, tenant):
    _login(page, stack, operator_key(stack))
    page.click("#nav-tenants")
    row = f"#tenants-table tr[data-tenant='{tenant.name}']"
    page.fill(f"{row} .suspend-reason", "abuse report 1234")
    page.click(f"{row} button.suspend")
    page.wait_for_selector(f"{row} button.restore")
    assert "abuse report 1234" in page.text_content(f"{row} .tenant-status")
    refused = stack.http(tenant.key).post("/create_session", json={})  # a suspended tenant starts nothing new
    assert refused.status_code == 403 and "abuse report 1234" in refused.json()["error"], refused.text

    owner = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    _login(owner, stack, tenant.key)
    owner.goto(stack.base_url + "/dashboard/account")
    assert "abuse report 1234" in owner.text_content("#suspended-banner")
    _shot(owner, "account-suspended")

    page.fill(f"{row} .credit-usd", "12.5")
    page.fill(f"{row} .credit-reason", "sorry for the trouble")
    page.click(f"{row} button.grant")
    page.wait_for_url(f"**/dashboard/tenants#tenant-{tenant.name}")
    page.click(f"{row} button.restore")
    page.wait_for_selector(f"{row} button.suspend")
    _shot(page, "operator-tenants")
    assert stack.http(tenant.key).post("/create_model", json={
        "session_id": stack.http(tenant.key).post("/create_session", json={}).json()["session_id"],
        "model_seq_id": 0, "base_model": "quilt/tiny-qwen3", "lora_config": {"rank": 4}}).status_code == 200
    owner.goto(stack.base_url + "/dashboard/account")
    assert owner.query_selector("#suspended-banner") is None
    assert owner.text_content("#credit-balance").strip() == "$12.500000"
    assert [a.strip() for a in owner.locator("#audit-table .audit-action").all_text_contents()][:3] == [
        "tenant.restored", "credit.granted", "tenant.suspended"]
    owner.context.close()


def test_tenants_page_and_its_forms_are_for_operators_only(stack, page, tenant):
    _login(page, stack, tenant.key)
    assert page.query_selector("#nav-tenants") is None
    response = page.goto(stack.base_url + "/dashboard/tenants")
    assert response.status == 403
    page.goto(stack.base_url + "/dashboard/account")
    token = page.get_attribute("#budget-form input[name=csrf_token]", "value")
    post = """([url, token]) => fetch(url, {method: 'POST', body: new URLSearchParams(
        {reason: 'x', csrf_token: token})}).then(r => r.status)"""
    assert page.evaluate(post, [f"/dashboard/tenants/{tenant.name}/suspend", token]) == 403  # not an operator
    assert page.evaluate(post, ["/dashboard/account/budget", ""]) == 403  # no CSRF token


@pytest.fixture(scope="module")
def stripe_fake(stack):
    from stripeutil import stripe_fake as running_fake

    with running_fake(stack) as f:
        yield f


@pytest.fixture(scope="module")
def billed_dashboard(stack, stripe_fake, tmp_path_factory):
    """A second API process billing through the fake (the shared stack has no Stripe)."""
    from stripeutil import billing_api

    with billing_api(stack, stripe_fake, tmp_path_factory.mktemp("billed")) as url:
        yield url


def test_card_setup_through_checkout_and_the_invoice_list(stack, page, tenant, stripe_fake, billed_dashboard):
    from types import SimpleNamespace

    from stripeutil import billed_customer

    customer = billed_customer(stack, stripe_fake, tenant.tenant_id)
    stripe_fake.add_invoice(customer, 1234, status="open")
    stripe_fake.add_invoice(customer, 500, status="paid")
    _login(page, SimpleNamespace(base_url=billed_dashboard), tenant.key)
    page.click("#nav-billing")
    assert page.text_content("#card-on-file").strip() == "No card on file."
    statuses = [s.strip() for s in page.locator("#invoices-table .invoice-status").all_text_contents()]
    assert sorted(statuses) == ["open", "paid"]
    assert "12.34 USD" in page.text_content("#invoices-table")

    page.click("#add-card")  # to Stripe Checkout (the fake's hosted page), and back
    page.wait_for_selector("#fake-checkout-submit")
    page.click("#fake-checkout-submit")
    page.wait_for_selector("#card-notice")
    assert page.text_content("#card-on-file").strip() == "visa ending in 4242"
    assert stripe_fake.delivered[-1] == ("checkout.session.completed", 200)
    pm = stripe_fake.customers[customer]["invoice_settings"]["default_payment_method"]
    assert pm.startswith("pm_")
    _shot(page, "billing-card-saved")


def test_sign_up_log_out_and_log_in_with_a_password(stack, page, tmp_path):
    import time

    from stackutil import second_api

    with second_api(stack, tmp_path, QUILT_SIGNUP="open") as url:
        email, name = f"ui-{time.time_ns()}@startup.example", f"ui-startup-{time.time_ns()}"
        page.goto(url + "/dashboard/login")
        page.click("#signup-link")
        page.fill("#signup-email", email)
        page.fill("#signup-tenant", name)
        page.fill("#signup-password", "short")
        page.click("#signup-submit")
        assert "10 to 200 characters" in page.text_content("#signup-error")
        page.fill("#signup-password", "a long enough password")
        page.click("#signup-submit")
        page.wait_for_url("**/dashboard/runs")
        page.click("#nav-members")
        assert page.text_content(f"#members-table tr[data-email='{email}'] .member-role").strip() == "owner"
        _shot(page, "members")
        page.click("text=Log out")
        page.wait_for_url("**/dashboard/login")
        page.fill("#login-email", email)
        page.fill("#login-password", "a long enough password")
        page.click("#password-login-submit")
        page.wait_for_url("**/dashboard/runs")
        page.click("#nav-account")
        assert name in page.text_content("h1")


def test_a_waiting_run_shows_its_queue_state_and_why(stack, page):
    """A call over the tenant's tokens-per-minute limit waits (api.queue_states); the run's pages
    say so and why, until a poll of its future lets it go."""
    from core import db
    from tenancy.tenants import set_quota

    tenant = stack.create_tenant("ui-wait")
    with db.connect(stack.database_url) as conn:
        set_quota(conn, tenant.name, tokens_per_minute=1000)
    client = stack.http(tenant.key)
    model_id = new_model(client)
    data = [datum(list(range(1, 102)))] * 3  # 300 model-input tokens
    calls = [client.post("/forward_backward", json=fb_body(model_id, seq, data)) for seq in (1, 2, 3, 4)]
    assert [r.status_code for r in calls] == [200] * 4, [r.text for r in calls]  # the 4th waits: nobody polls it

    _login(page, stack, tenant.key)
    row = page.locator(f"#runs-table tr:has(a.run-link:text-is('{model_id}')) .state")
    assert row.text_content().strip() == "waiting"
    assert "tokens_per_minute" in row.get_attribute("title")
    page.goto(stack.base_url + run_url(model_id))
    notice = page.text_content("#run-queue-state")
    assert "paused_rate_limit" in notice and "tokens_per_minute limit of 1000" in notice, notice
    assert page.text_content("#run-waiting") == "1"
    _shot(page, "run-waiting")

    for r in calls:  # the polls let it go once the bucket refills
        assert "loss:sum" in wait_future(client, r.json()["request_id"])["metrics"]
    page.reload()
    assert page.locator("#run-queue-state").count() == 0 and page.text_content("#run-waiting") == "0"
