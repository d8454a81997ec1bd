"""The public status page in headless Chromium (Debian's package, driven by Playwright) against the
real stack: what a visitor with no account sees, and an operator's note shown as text, not markup.
Screenshots go to artifacts/screenshots/."""

from __future__ import annotations

import time

import httpx
import pytest
from dashutil import SHOTS, operator_key
from stackutil import TINY


@pytest.fixture
def page(browser):
    """A fresh visitor: no cookies, no session."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    visitor = context.new_page()
    visitor.set_default_timeout(60_000)
    problems: list[str] = []
    visitor.on("pageerror", lambda exc: problems.append(str(exc)))
    visitor.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    yield visitor
    context.close()
    assert not problems, f"errors on the page: {problems}"


def test_a_visitor_sees_each_component_and_the_figures(stack, page):
    response = page.goto(stack.base_url + "/status")
    assert response.status == 200 and page.url == stack.base_url + "/status"  # no login redirect
    headline = page.locator("#status-headline").inner_text()
    assert headline in ("All systems operational", "Some components are down")
    rows = {page.locator(f'tr[data-component="{c}"] td').first.inner_text():
            page.locator(f'tr[data-component="{c}"] .state').inner_text()
            for c in ("api", "postgres", "redis", f"trainer:{TINY}")}
    assert rows == {"API": "up", "Database (Postgres)": "up", "Queues (Redis)": "up", f"Training · {TINY}": "up"}
    assert page.locator("#errors tbody tr").count() == 3
    assert page.locator(f'#queue-waits tr[data-base="{TINY}"]').count() == 1
    assert page.locator("header.top").count() == 0  # no account menu for a visitor
    page.screenshot(path=str(SHOTS / "status.png"), full_page=True)


def test_an_operators_note_reads_as_text(stack, page):
    title = f"Maintenance <img src=x onerror=alert(1)> {time.monotonic_ns()}"
    body = "Line one\n<script>document.title='owned'</script>"
    r = httpx.post(stack.base_url + "/api/v1/status/incidents", headers={"X-API-Key": operator_key(stack)},
                   json={"title": title, "body": body, "severity": "maintenance"}, timeout=30)
    assert r.status_code == 200, r.text
    note = page.locator(f'li.incident[data-incident="{r.json()["id"]}"]')
    deadline = time.monotonic() + 30
    while True:  # every API process shows it within its 2 s cache
        page.goto(stack.base_url + "/status")
        if note.count() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert note.locator(".incident-title").inner_text() == title
    assert note.locator(".incident-body").inner_text() == body
    assert note.locator("img, script").count() == 0 and page.title() == "Status · Quilt"
    assert "ongoing" in note.inner_text()
    page.screenshot(path=str(SHOTS / "status-incident.png"), full_page=True)
    httpx.post(f"{stack.base_url}/api/v1/status/incidents/{r.json()['id']}/resolve",
               headers={"X-API-Key": operator_key(stack)}, json={}, timeout=30).raise_for_status()
