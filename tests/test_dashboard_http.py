"""The dashboard over plain HTTP: session cookie flags, CSRF on every change, logging out,
the operator gate, tenant isolation and the adapter download."""

from __future__ import annotations

import io
import tarfile
from urllib.parse import quote

import httpx
import pytest
from dashutil import csrf_of, login, operator_key, run_url
from stackutil import datum, fb_body, new_model, second_api, wait_future


@pytest.fixture(scope="module")
def owned(stack):
    """Tenant A with a trained model and a training checkpoint."""
    a = stack.create_tenant("da")
    client = stack.http(a.key)
    model_id = new_model(client)
    fb = client.post("/forward_backward", json=fb_body(model_id, 1, [datum(list(range(3, 20)))])).json()
    wait_future(client, fb["request_id"])
    save = client.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "ck-1"}).json()
    saved = wait_future(client, save["request_id"])
    assert "error" not in saved, saved
    return a, model_id


def _download_url(model_id: str, name: str) -> str:
    return f"{run_url(model_id)}/checkpoints/weights/{quote(name, safe='')}/adapter.tar.gz"


def _set_cookie_headers(response: httpx.Response, name: str) -> list[str]:
    return [h for h in response.headers.get_list("set-cookie") if h.startswith(name + "=")]


def test_the_servers_address_opens_the_dashboard(stack):
    client = httpx.Client(base_url=stack.base_url)
    r = client.get("/")
    assert r.status_code == 307 and r.headers["location"] == "/dashboard/runs"
    # Not logged in: the runs page sends the browser on to the login form.
    assert client.get("/", follow_redirects=True).url.path == "/dashboard/login"


def test_login_sets_an_httponly_samesite_cookie_scoped_to_the_dashboard(stack, tenant):
    client = httpx.Client(base_url=stack.base_url)
    form = client.get("/dashboard/login")
    r = client.post("/dashboard/login", data={"api_key": tenant.key, "csrf_token": csrf_of(form.text)})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/runs"
    (cookie,) = _set_cookie_headers(r, "quilt_session")
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "samesite=lax", "path=/dashboard"} <= flags
    assert "secure" not in flags  # plain HTTP here
    assert tenant.key not in cookie


def test_forwarded_https_counts_only_from_a_trusted_proxy(stack, tenant, tmp_path):
    # The session stack trusts no proxy: a client's own X-Forwarded-Proto changes nothing.
    claimed = httpx.get(stack.base_url + "/dashboard/login", headers={"X-Forwarded-Proto": "https"})
    (login_cookie,) = _set_cookie_headers(claimed, "quilt_login_csrf")
    assert "secure" not in login_cookie.lower()
    with second_api(stack, tmp_path, QUILT_TRUSTED_PROXIES="127.0.0.1") as url:
        _secure_cookies_behind_https(url, tenant)


def _secure_cookies_behind_https(url: str, tenant) -> None:
    # 127.0.0.1 is a trusted proxy here, as a TLS-terminating proxy would be.
    client = httpx.Client(base_url=url, headers={"X-Forwarded-Proto": "https"})
    form = client.get("/dashboard/login")
    (login_cookie,) = _set_cookie_headers(form, "quilt_login_csrf")
    assert "secure" in login_cookie.lower()
    # httpx keeps Secure cookies off plain http, so hand the login CSRF cookie over ourselves.
    r = client.post("/dashboard/login", data={"api_key": tenant.key, "csrf_token": csrf_of(form.text)},
                    headers={"Cookie": login_cookie.split(";")[0]})
    (cookie,) = _set_cookie_headers(r, "quilt_session")
    assert "secure" in {f.strip().lower() for f in cookie.split(";")[1:]}


def test_login_needs_its_csrf_cookie_and_a_valid_key(stack, tenant):
    client = httpx.Client(base_url=stack.base_url)
    assert client.post("/dashboard/login", data={"api_key": tenant.key, "csrf_token": "forged"}).status_code == 403
    form = client.get("/dashboard/login")
    r = client.post("/dashboard/login", data={"api_key": "tml-not-a-key", "csrf_token": csrf_of(form.text)})
    assert r.status_code == 401 and "unknown API key" in r.text and "quilt_session" not in client.cookies


def test_pages_need_a_session(stack):
    r = httpx.get(stack.base_url + "/dashboard/keys")
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/login?next=%2Fdashboard%2Fkeys"
    assert httpx.get(stack.base_url + "/dashboard/data/ops").status_code == 401


def test_login_does_not_redirect_off_site(stack, tenant):
    client = httpx.Client(base_url=stack.base_url)
    form = client.get("/dashboard/login")
    r = client.post("/dashboard/login", data={"api_key": tenant.key, "csrf_token": csrf_of(form.text),
                                              "next": "//evil.example/dashboard/"})
    assert r.headers["location"] == "/dashboard/runs"


@pytest.mark.parametrize("token", [None, "wrong"])
def test_changes_without_the_csrf_token_are_403(stack, tenant, token):
    client = login(stack, tenant.key)
    data = {"name": "sneaky"} | ({"csrf_token": token} if token else {})
    r = client.post("/dashboard/keys", data=data)
    assert r.status_code == 403 and "CSRF" in r.text
    assert "sneaky" not in client.get("/dashboard/keys").text
    prefix = tenant.key[:12]
    assert client.post("/dashboard/keys/revoke", data={"prefix": prefix}).status_code == 403
    assert client.post("/dashboard/logout", data={}).status_code == 403
    assert client.get("/dashboard/runs").status_code == 200  # still logged in, key still active


def test_csrf_token_may_come_in_a_header(stack, tenant):
    client = login(stack, tenant.key)
    token = csrf_of(client.get("/dashboard/keys").text)
    r = client.post("/dashboard/keys", data={"name": "by-header"}, headers={"X-CSRF-Token": token})
    assert r.status_code == 200 and "by-header" in r.text


def test_pages_carry_a_strict_content_security_policy(stack, tenant):
    r = login(stack, tenant.key).get("/dashboard/runs")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"


def test_logout_ends_the_session_on_the_server(stack, tenant):
    client = login(stack, tenant.key)
    stolen = client.cookies["quilt_session"]
    r = client.post("/dashboard/logout", data={"csrf_token": csrf_of(client.get("/dashboard/runs").text)})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
    replay = httpx.get(stack.base_url + "/dashboard/runs", cookies={"quilt_session": stolen})
    assert replay.status_code == 303 and replay.headers["location"].startswith("/dashboard/login")


def test_revoking_the_login_key_ends_the_session(stack):
    t = stack.create_tenant("dr")
    client = login(stack, t.key)
    token = csrf_of(client.get("/dashboard/keys").text)
    r = client.post("/dashboard/keys/revoke", data={"prefix": t.key[:12], "csrf_token": token})
    assert r.status_code == 303
    assert client.get("/dashboard/keys").status_code == 303  # back to the login page
    assert stack.http(t.key).post("/create_session", json={}).status_code == 401


def test_tenants_cannot_open_operator_pages(stack, tenant):
    client = login(stack, tenant.key)
    assert client.get("/dashboard/ops").status_code == 403
    assert client.get("/dashboard/data/ops").status_code == 403
    assert 'id="nav-ops"' not in client.get("/dashboard/runs").text


def test_operators_get_the_health_numbers(stack):
    client = login(stack, operator_key(stack))
    assert client.get("/dashboard/ops").status_code == 200
    data = client.get("/dashboard/data/ops", params={"minutes": 5}).json()
    assert data["window_s"] == 300 and data["bases"][0]["base_model"] == "quilt/tiny-qwen3"
    assert {"queues", "trainer", "gen", "busy", "fused", "rates", "capacity"} <= set(data["bases"][0])
    assert set(data["env_waits"]) == {"tenants", "rollout", "trainer", "steps", "start_s", "step_s", "reward_s",
                                      "sample_s", "train_s", "lost_s"}
    assert client.get("/dashboard/data/ops", params={"minutes": 0}).status_code == 400


def test_another_tenants_run_and_checkpoint_are_404(stack, owned):
    _, model_id = owned
    other = login(stack, stack.create_tenant("db").key)
    data_url = "/dashboard/data/runs/" + quote(model_id, safe="")
    for path in (run_url(model_id), data_url, _download_url(model_id, "ck-1")):
        assert other.get(path).status_code == 404, path


def test_checkpoint_download_is_the_peft_adapter(stack, owned):
    a, model_id = owned
    client = login(stack, a.key)
    page = client.get("/dashboard/checkpoints").text
    url = _download_url(model_id, "ck-1")
    assert url in page
    r = client.get(url)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    assert r.headers["content-disposition"].endswith('.tar.gz"')
    names = {m.name.split("/", 1)[1] for m in tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz")}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "optimizer.pt" not in names


def test_spend_page_shows_plots_and_budgets(stack, owned):
    from billing.budgets import set_budget
    from core import db

    a, _ = owned
    with db.connect(stack.database_url) as conn:
        set_budget(conn, a.tenant_id, 5_000_000)
    page = login(stack, a.key).get("/dashboard/spend").text
    assert 'id="spend-day-plot"' in page and 'id="spend-model-plot"' in page
    assert 'id="budgets-table"' in page and "$5.000000" in page
    assert '"base_model": "quilt/tiny-qwen3"' in page or '"base_model":"quilt/tiny-qwen3"' in page  # the plot's data
    backwards = {"since": "2026-02-01", "until": "2026-01-01"}
    assert login(stack, a.key).get("/dashboard/spend", params=backwards).status_code == 400


def test_every_dashboard_change_needs_its_csrf_token(stack):
    """Every POST route of the dashboard, found in the app itself, refuses a request without the
    token: 403, whether it needs a session (the session's token) or not (the double-submit cookie)."""
    from api.app import create_app

    posts = sorted({r.path for r in create_app().routes
                    if getattr(r, "methods", None) and "POST" in r.methods and r.path.startswith("/dashboard")})
    assert len(posts) >= 15, posts
    client = login(stack, operator_key(stack))
    try:
        for path in posts:
            concrete = path.replace("{name}", "nobody")
            r = client.post(concrete, data={"reason": "x", "usd": "1", "email": "a@b.example", "password": "p" * 12})
            assert r.status_code == 403 and "CSRF" in r.text, (path, r.status_code, r.text[:200])
    finally:
        client.close()
