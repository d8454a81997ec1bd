"""A small stateful fake of the part of Stripe's HTTP API that Quilt uses, for tests and local runs.

It is a real HTTP server on a loopback port (point `QUILT_STRIPE_API_BASE` at `fake.url`), speaks
Stripe's wire format (form-encoded requests, JSON answers, Stripe's error bodies), keeps its state
in memory, and enforces what matters for billing correctness:

- meter-event `identifier`s are unique: a second event with a known identifier is refused (HTTP 400,
  code `resource_already_exists`) and recorded in `duplicate_identifiers`, so a double send is
  caught instead of counted;
- `Idempotency-Key` replays the first answer for the same request (recorded in
  `idempotent_replays`) and refuses a different request under a used key;
- events must name an active meter and an existing customer, with a timestamp within the past 35
  days and at most 5 minutes ahead.

Routes: POST/GET /v1/customers[/{id}], GET/POST /v1/billing/meters,
GET /v1/billing/meters/{id}/event_summaries, POST /v1/billing/meter_events, POST /v1/checkout/sessions
(setup mode), GET /v1/setup_intents/{id}, GET /v1/invoices, POST /v1/billing/credit_grants, and
GET /_fake/state.

Card setup: a Checkout session's `url` is a page of this server (`/_fake/checkout/{id}`) with one
button; pressing it saves a test card (visa 4242) on a SetupIntent, sends `checkout.session.completed`
to `webhook_url` signed with `webhook_secret` as Stripe signs (`Stripe-Signature: t=..,v1=..`), and
redirects to the session's success_url. `add_invoice` and `send_event` let tests create invoices
and deliver any event the same way.

Test hook: `hang_on_meter_event(n)` makes the n-th next meter event be *accepted* and then left
unanswered until `release()` - the worst moment for a client to die.

Run alone: `python -m billing.fake_stripe [--port 12111]`.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import html
import json
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import httpx

MAX_AGE_S = 35 * 24 * 3600
MAX_FUTURE_S = 5 * 60


class StripeHTTPError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def body(self) -> dict:
        err = {"type": self.type, "message": self.message}
        if self.code:
            err["code"] = self.code
        if self.param:
            err["param"] = self.param
        return {"error": err}


def parse_form(text: str) -> dict:
    """Stripe's bracket encoding (`payload[value]=3`, `expand[0]=x`) into nested dicts."""
    out: dict = {}
    for key, value in parse_qsl(text, keep_blank_values=True):
        parts = key.replace("]", "").split("[")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(7)}"


@dataclass
class _Hang:
    countdown: int
    reached: threading.Event
    release: threading.Event
    identifier: str | None = None


class FakeStripe:
    """The fake's state and its HTTP server. Use as a context manager or call start()/stop()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.customers: dict[str, dict] = {}
        self.meters: dict[str, dict] = {}
        self.events: dict[str, dict] = {}  # identifier -> accepted event
        self.duplicate_identifiers: list[str] = []
        self.idempotent_replays: list[str] = []
        self.request_log: list[tuple[str, str]] = []
        self._idempotency: dict[str, tuple[str, int, dict]] = {}
        self._hang: _Hang | None = None
        self.held_identifiers: list[str] = []  # meter events accepted, then held unanswered
        self.checkout_sessions: dict[str, dict] = {}
        self.setup_intents: dict[str, dict] = {}
        self.invoices: dict[str, dict] = {}
        self.credit_grants: dict[str, dict] = {}
        self.webhook_url: str | None = None  # where events go (Quilt's /api/v1/stripe/webhook)
        self.webhook_secret = "whsec_quilt_fake"
        self.delivered: list[tuple[str, int]] = []  # (event type, HTTP status of Quilt's answer)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def start(self, port: int = 0) -> FakeStripe:
        fake = self

        class Handler(_Handler):
            state = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-stripe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._hang:
            self._hang.release.set()
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeStripe:  # noqa: PYI034 - start() returns this instance
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------------------ test hooks

    def hang_on_meter_event(self, n: int = 1) -> threading.Event:
        """Accept the n-th next meter event, then hold its answer until `release()`. Returns an event
        set when that moment is reached."""
        with self._lock:
            self._hang = _Hang(n, threading.Event(), threading.Event())
            return self._hang.reached

    def release(self) -> None:
        with self._lock:
            hang, self._hang = self._hang, None
        if hang:
            hang.release.set()

    def meter_totals(self) -> dict[tuple[str, str], int]:
        """(customer id, event name) -> sum of accepted values."""
        with self._lock:
            return dict(self._totals_unlocked())

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "customers": list(self.customers.values()),
                "meters": list(self.meters.values()),
                "events": len(self.events),
                "duplicate_identifiers": list(self.duplicate_identifiers),
                "idempotent_replays": list(self.idempotent_replays),
                "totals": [{"customer": c, "event_name": n, "value": v}
                           for (c, n), v in sorted(self._totals_unlocked().items())],
            }

    def _totals_unlocked(self) -> dict[tuple[str, str], int]:
        totals: dict[tuple[str, str], int] = defaultdict(int)
        for e in self.events.values():
            totals[(e["payload"]["stripe_customer_id"], e["event_name"])] += int(e["payload"]["value"])
        return totals

    # ------------------------------------------------------------------------------ the API

    def handle(self, method: str, path: str, query: dict, form: dict, headers) -> tuple[int, dict, _Hang | None]:
        """One request -> (status, JSON body, a hang to wait on before answering, if any)."""
        auth = headers.get("Authorization", "")
        if not auth.startswith("Bearer sk_"):
            raise StripeHTTPError(401, "Invalid API Key provided", type_="invalid_request_error")
        key = headers.get("Idempotency-Key")
        fingerprint = json.dumps([method, path, form], sort_keys=True)
        with self._lock:
            self.request_log.append((method, path))
            if method == "POST" and key and key in self._idempotency:
                seen, status, body = self._idempotency[key]
                if seen != fingerprint:
                    raise StripeHTTPError(400, f"Keys for idempotent requests can only be used with the same "
                                               f"parameters they were first used with. Key: {key}",
                                          type_="idempotency_error")
                self.idempotent_replays.append(key)
                return status, body, None
            try:
                status, body = self._route(method, path, query, form)
            except StripeHTTPError as err:
                status, body = err.status, err.body()
            if method == "POST" and key and status < 500:
                self._idempotency[key] = (fingerprint, status, body)
            hang = None
            if method == "POST" and path == "/v1/billing/meter_events" and status == 200 and self._hang:
                self._hang.countdown -= 1
                if self._hang.countdown == 0:
                    hang = self._hang
                    hang.identifier = body["identifier"]
                    self.held_identifiers.append(body["identifier"])
            return status, body, hang

    def _route(self, method: str, path: str, query: dict, form: dict) -> tuple[int, dict]:
        parts = [p for p in path.split("/") if p]
        if parts[:1] != ["v1"]:
            raise StripeHTTPError(404, f"Unrecognized request URL ({method}: {path})")
        rest = parts[1:]
        if rest == ["customers"] and method == "POST":
            return 200, self._create_customer(form)
        if len(rest) == 2 and rest[0] == "customers" and method == "GET":
            if rest[1] not in self.customers:
                raise StripeHTTPError(404, f"No such customer: '{rest[1]}'", code="resource_missing", param="id")
            return 200, self.customers[rest[1]]
        if len(rest) == 2 and rest[0] == "customers" and method == "POST":
            customer = self.customers.get(rest[1])
            if customer is None:
                raise StripeHTTPError(404, f"No such customer: '{rest[1]}'", code="resource_missing", param="id")
            customer.setdefault("invoice_settings", {}).update(form.get("invoice_settings", {}))
            return 200, customer
        if rest == ["billing", "credit_grants"] and method == "POST":
            return 200, self._create_credit_grant(form)
        if rest == ["checkout", "sessions"] and method == "POST":
            return 200, self._create_checkout(form)
        if len(rest) == 2 and rest[0] == "setup_intents" and method == "GET":
            if rest[1] not in self.setup_intents:
                raise StripeHTTPError(404, f"No such setupintent: '{rest[1]}'", code="resource_missing", param="id")
            return 200, self.setup_intents[rest[1]]
        if rest == ["invoices"] and method == "GET":
            found = sorted((i for i in self.invoices.values() if i["customer"] == query.get("customer")),
                           key=lambda i: -i["created"])
            return 200, {"object": "list", "url": "/v1/invoices", "has_more": False, "data": found}
        if rest == ["billing", "meters"] and method == "GET":
            return 200, self._list_meters(query)
        if rest == ["billing", "meters"] and method == "POST":
            return 200, self._create_meter(form)
        if rest == ["billing", "meter_events"] and method == "POST":
            return 200, self._create_event(form)
        if len(rest) == 4 and rest[:2] == ["billing", "meters"] and rest[3] == "event_summaries" and method == "GET":
            return 200, self._summaries(rest[2], query)
        raise StripeHTTPError(404, f"Unrecognized request URL ({method}: {path})")

    # ---------------------------------------------------------------------- cards, invoices, events

    def add_invoice(self, customer: str, amount_due: int, status: str = "open") -> dict:
        """An invoice of `customer` (amounts in cents), as Stripe's invoice object carries it."""
        invoice_id = _new_id("in")
        invoice = {"id": invoice_id, "object": "invoice", "customer": customer, "amount_due": amount_due,
                   "amount_paid": amount_due if status == "paid" else 0, "currency": "usd", "status": status,
                   "number": f"QUILT-{len(self.invoices) + 1:04d}", "created": int(time.time()),
                   "hosted_invoice_url": f"{self.url}/_fake/invoices/{invoice_id}", "livemode": False}
        with self._lock:
            self.invoices[invoice_id] = invoice
        return invoice

    def sign(self, payload: bytes, timestamp: int | None = None, secret: str | None = None) -> str:
        """A `Stripe-Signature` header for `payload`: HMAC-SHA256 of "<t>.<payload>" (Stripe's scheme)."""
        t = int(time.time()) if timestamp is None else timestamp
        mac = hmac.new((secret or self.webhook_secret).encode(), f"{t}.".encode() + payload, hashlib.sha256)
        return f"t={t},v1={mac.hexdigest()}"

    def event(self, type_: str, obj: dict, event_id: str | None = None) -> bytes:
        return json.dumps({"id": event_id or _new_id("evt"), "object": "event", "type": type_,
                           "created": int(time.time()), "livemode": False, "api_version": "2025-01-27.acacia",
                           "data": {"object": obj}}).encode()

    def send_event(self, type_: str, obj: dict, *, event_id: str | None = None,
                   payload: bytes | None = None, signature: str | None = None) -> httpx.Response:
        """Deliver an event to `webhook_url`, signed (unless `signature` says otherwise)."""
        body = payload if payload is not None else self.event(type_, obj, event_id)
        r = httpx.post(self.webhook_url, content=body, timeout=30, headers={
            "Content-Type": "application/json", "Stripe-Signature": signature or self.sign(body)})
        self.delivered.append((type_, r.status_code))
        return r

    def _create_credit_grant(self, form: dict) -> dict:
        if form.get("customer") not in self.customers:
            raise StripeHTTPError(400, f"No such customer: '{form.get('customer')}'", code="resource_missing",
                                  param="customer")
        monetary = (form.get("amount") or {}).get("monetary") or {}
        if not str(monetary.get("value", "")).isdigit() or int(monetary["value"]) <= 0:
            raise StripeHTTPError(400, "amount[monetary][value] must be a positive integer", param="amount")
        if form.get("category") not in ("paid", "promotional"):
            raise StripeHTTPError(400, "Invalid category", param="category")
        if not (form.get("applicability_config") or {}).get("scope"):
            raise StripeHTTPError(400, "Missing required param: applicability_config.", code="parameter_missing")
        grant = {"id": _new_id("credgr"), "object": "billing.credit_grant", "customer": form["customer"],
                 "category": form["category"], "name": form.get("name"), "metadata": form.get("metadata", {}),
                 "amount": {"type": "monetary", "monetary": {"currency": monetary.get("currency", "usd"),
                                                             "value": int(monetary["value"])}}}
        self.credit_grants[grant["id"]] = grant
        return grant

    def _create_checkout(self, form: dict) -> dict:
        if form.get("mode") != "setup":
            raise StripeHTTPError(400, "this fake only has setup mode", param="mode")
        if form.get("customer") not in self.customers:
            raise StripeHTTPError(400, f"No such customer: '{form.get('customer')}'", code="resource_missing",
                                  param="customer")
        for required in ("success_url", "cancel_url", "currency"):
            if not form.get(required):
                raise StripeHTTPError(400, f"Missing required param: {required}.", code="parameter_missing",
                                      param=required)
        session_id = _new_id("cs_test")
        session = {"id": session_id, "object": "checkout.session", "mode": "setup", "status": "open",
                   "customer": form["customer"], "success_url": form["success_url"], "cancel_url": form["cancel_url"],
                   "setup_intent": None, "url": f"{self.url}/_fake/checkout/{session_id}", "livemode": False}
        self.checkout_sessions[session_id] = session
        return session

    def complete_checkout(self, session_id: str) -> str:
        """What pressing the checkout page's button does; returns where the browser goes next."""
        with self._lock:
            session = self.checkout_sessions[session_id]
            pm = {"id": _new_id("pm"), "object": "payment_method", "type": "card",
                  "card": {"brand": "visa", "last4": "4242", "exp_month": 12, "exp_year": 2030}}
            intent = {"id": _new_id("seti"), "object": "setup_intent", "status": "succeeded",
                      "customer": session["customer"], "payment_method": pm}
            self.setup_intents[intent["id"]] = intent
            session.update(status="complete", setup_intent=intent["id"])
        if self.webhook_url:
            self.send_event("checkout.session.completed", dict(session))
        return session["success_url"]

    def _create_customer(self, form: dict) -> dict:
        customer = {"id": _new_id("cus"), "object": "customer", "created": int(time.time()), "livemode": False,
                    "name": form.get("name"), "email": form.get("email"), "metadata": form.get("metadata", {})}
        self.customers[customer["id"]] = customer
        return customer

    def _list_meters(self, query: dict) -> dict:
        meters = sorted(self.meters.values(), key=lambda m: m["created"])
        if query.get("status"):
            meters = [m for m in meters if m["status"] == query["status"]]
        if query.get("starting_after"):
            ids = [m["id"] for m in meters]
            after = query["starting_after"]
            meters = meters[ids.index(after) + 1:] if after in ids else []
        limit = int(query.get("limit", 10))
        return {"object": "list", "url": "/v1/billing/meters", "has_more": len(meters) > limit, "data": meters[:limit]}

    def _create_meter(self, form: dict) -> dict:
        name = form.get("event_name")
        if not name or not form.get("display_name"):
            raise StripeHTTPError(400, "Missing required param: event_name / display_name.", code="parameter_missing")
        if any(m["event_name"] == name and m["status"] == "active" for m in self.meters.values()):
            raise StripeHTTPError(400, f"An active meter with event_name {name!r} already exists.",
                                  code="resource_already_exists", param="event_name")
        now = int(time.time())
        meter = {
            "id": _new_id("mtr"), "object": "billing.meter", "created": now, "updated": now, "livemode": False,
            "display_name": form["display_name"], "event_name": name, "status": "active",
            "event_time_window": None, "status_transitions": {"deactivated_at": None},
            "default_aggregation": form.get("default_aggregation", {"formula": "sum"}),
            "customer_mapping": form.get("customer_mapping", {"event_payload_key": "stripe_customer_id",
                                                              "type": "by_id"}),
            "value_settings": form.get("value_settings", {"event_payload_key": "value"}),
        }
        self.meters[meter["id"]] = meter
        return meter

    def _create_event(self, form: dict) -> dict:
        name = form.get("event_name")
        payload = form.get("payload") or {}
        meter = next((m for m in self.meters.values() if m["event_name"] == name and m["status"] == "active"), None)
        if meter is None:
            raise StripeHTTPError(400, f"No active meter was found for event_name {name!r}.", param="event_name")
        customer = payload.get(meter["customer_mapping"]["event_payload_key"])
        if customer not in self.customers:
            raise StripeHTTPError(400, f"No such customer: {customer!r}", code="resource_missing",
                                  param="payload[stripe_customer_id]")
        raw_value = payload.get(meter["value_settings"]["event_payload_key"])
        try:
            value = int(raw_value)
        except (TypeError, ValueError):
            raise StripeHTTPError(400, f"payload value must be a whole number, got {raw_value!r}",
                                  param="payload[value]") from None
        now = int(time.time())
        timestamp = int(form.get("timestamp", now))
        if timestamp < now - MAX_AGE_S or timestamp > now + MAX_FUTURE_S:
            raise StripeHTTPError(400, "timestamp must be within the past 35 calendar days or up to 5 minutes "
                                       "in the future", param="timestamp")
        ident = form.get("identifier") or _new_id("mev")
        if ident in self.events:
            self.duplicate_identifiers.append(ident)
            raise StripeHTTPError(400, f"An event with identifier {ident!r} already exists.",
                                  code="resource_already_exists", param="identifier")
        event = {"object": "billing.meter_event", "created": now, "livemode": False, "event_name": name,
                 "identifier": ident, "timestamp": timestamp,
                 "payload": {"stripe_customer_id": customer, "value": str(value)}}
        self.events[ident] = event
        return event

    def _summaries(self, meter_id: str, query: dict) -> dict:
        meter = self.meters.get(meter_id)
        if meter is None:
            raise StripeHTTPError(404, f"No such billing meter: '{meter_id}'", code="resource_missing")
        for required in ("customer", "start_time", "end_time"):
            if required not in query:
                raise StripeHTTPError(400, f"Missing required param: {required}.", code="parameter_missing",
                                      param=required)
        start, end = int(query["start_time"]), int(query["end_time"])
        total = sum(int(e["payload"]["value"]) for e in self.events.values()
                    if e["event_name"] == meter["event_name"] and e["payload"]["stripe_customer_id"] == query["customer"]
                    and start <= e["timestamp"] < end)
        summary = {"id": _new_id("mtrusg"), "object": "billing.meter_event_summary", "livemode": False,
                   "meter": meter_id, "customer": query["customer"], "start_time": start, "end_time": end,
                   "aggregated_value": float(total)}
        return {"object": "list", "url": f"/v1/billing/meters/{meter_id}/event_summaries", "has_more": False,
                "data": [summary]}


class _Handler(BaseHTTPRequestHandler):
    state: FakeStripe
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Request-Id", _new_id("req"))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode() if length else ""
        if url.path == "/_fake/state":
            return self._answer(200, self.state.snapshot())
        if url.path.startswith("/_fake/checkout/"):
            return self._checkout_page(method, url.path.split("/")[3])
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        try:
            status, body, hang = self.state.handle(method, url.path, query, parse_form(raw), self.headers)
        except StripeHTTPError as err:
            return self._answer(err.status, err.body())
        if hang is not None:
            hang.reached.set()
            hang.release.wait()
        try:
            self._answer(status, body)
        except OSError:  # the client died while we held the answer
            pass

    def _checkout_page(self, method: str, session_id: str) -> None:
        """The hosted page a customer sees: one button that saves the test card."""
        session = self.state.checkout_sessions.get(session_id)
        if session is None:
            return self._answer(404, {"error": {"type": "invalid_request_error", "message": "no such session"}})
        if method == "POST":
            self.send_response(303)
            self.send_header("Location", self.state.complete_checkout(session_id))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        page = (f"<!doctype html><title>Fake Stripe Checkout</title><h1>Save a card</h1>"
                f"<p>Customer {html.escape(session['customer'])}</p><form method=post>"
                f"<button id=fake-checkout-submit>Save card visa 4242</button></form>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)
        return None

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the fake Stripe API on a loopback port.")
    parser.add_argument("--port", type=int, default=12111)
    args = parser.parse_args()
    fake = FakeStripe().start(args.port)
    print(f"fake Stripe at {fake.url} (export QUILT_STRIPE_API_BASE={fake.url}); Ctrl-C stops it", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()
