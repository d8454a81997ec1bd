"""HTTP errors become typed exceptions; transient ones are retried."""

import pickle
import time

import httpx
import pytest
import quilt
from quilt._config import RetryPolicy

STATUS_CLASSES = [
    (400, quilt.BadRequestError),
    (413, quilt.BadRequestError),
    (422, quilt.BadRequestError),
    (401, quilt.AuthenticationError),
    (402, quilt.BudgetExceededError),
    (403, quilt.PermissionDeniedError),
    (404, quilt.NotFoundError),
    (429, quilt.RateLimitError),
    (500, quilt.InternalServerError),
    (503, quilt.InternalServerError),
]


@pytest.mark.parametrize("status, cls", STATUS_CLASSES)
def test_status_maps_to_typed_error(server, client, status, cls):
    category = "server" if status >= 500 else "user"
    server.routes["healthz"] = lambda body: httpx.Response(
        status,
        json={"detail": "it went wrong", "category": category, "request_id": "req-77", "field": "x"},
        headers={"X-Request-ID": "req-77", "Retry-After": "0"},
    )
    with pytest.raises(cls) as info:
        client.healthz()
    error = info.value
    assert isinstance(error, quilt.APIStatusError) and isinstance(error, quilt.QuiltError)
    assert (error.status_code, error.message, error.request_id, error.category, error.field) == (
        status, "it went wrong", "req-77", category, "x",
    )


def test_request_id_falls_back_to_header(server, client):
    server.routes["healthz"] = lambda body: httpx.Response(
        404, json={"detail": "nope"}, headers={"X-Request-ID": "req-h"}
    )
    with pytest.raises(quilt.NotFoundError) as info:
        client.healthz()
    assert info.value.request_id == "req-h" and info.value.category == "user"


def test_fastapi_validation_detail_is_readable(server, client):
    detail = [{"loc": ["body", "rank"], "msg": "must be positive", "type": "value_error"}]
    server.routes["healthz"] = lambda body: httpx.Response(422, json={"detail": detail})
    with pytest.raises(quilt.BadRequestError, match="body.rank: must be positive"):
        client.healthz()


def test_4xx_is_not_retried(server, client):
    server.routes["healthz"] = lambda body: httpx.Response(400, json={"detail": "bad"})
    with pytest.raises(quilt.BadRequestError):
        client.healthz()
    assert server.routes_seen() == ["healthz"]


def test_5xx_is_retried_then_succeeds(server, client):
    answers = [httpx.Response(502, json={"detail": "gateway"})]
    server.routes["healthz"] = lambda body: answers.pop() if answers else {"status": "ok"}
    assert client.healthz() == {"status": "ok"}
    assert server.routes_seen() == ["healthz", "healthz"]


def test_retries_are_bounded(server, client):
    server.routes["healthz"] = lambda body: httpx.Response(429, json={"detail": "slow down"})
    with pytest.raises(quilt.RateLimitError):
        client.healthz()
    assert server.routes_seen().count("healthz") == 3  # 1 + max_retries (2 in tests)


def test_503_is_retried_for_a_time_not_a_count(server, client):
    """A store restarting answers 503 for seconds: retried past max_retries, within unavailable_max_s."""
    client._http.retry = RetryPolicy(max_retries=2, backoff_base_s=0.0, unavailable_max_s=0.5)
    unavailable_until = time.monotonic() + 0.2
    server.routes["healthz"] = lambda body: (
        httpx.Response(503, json={"detail": "restarting"}, headers={"Retry-After": "0"})
        if time.monotonic() < unavailable_until else {"status": "ok"})
    assert client.healthz() == {"status": "ok"}
    assert server.routes_seen().count("healthz") > 3  # more than 1 + max_retries

    server.routes["healthz"] = lambda body: httpx.Response(503, json={"detail": "down"}, headers={"Retry-After": "0"})
    started = time.monotonic()
    with pytest.raises(quilt.InternalServerError):
        client.healthz()
    assert time.monotonic() - started < 5  # gives up once unavailable_max_s is spent


def test_connection_error_is_retried_then_typed(server, client):
    def refuse(body):
        raise httpx.ConnectError("connection refused")

    server.routes["healthz"] = refuse
    with pytest.raises(quilt.APIConnectionError, match="QUILT_BASE_URL"):
        client.healthz()
    assert server.routes_seen().count("healthz") == 3


def test_timeout_is_api_timeout_error(server, client):
    def slow(body):
        raise httpx.ReadTimeout("too slow")

    server.routes["healthz"] = slow
    with pytest.raises(quilt.APITimeoutError):
        client.healthz()


def test_non_json_success_body_is_response_error(server, client):
    server.routes["healthz"] = lambda body: httpx.Response(200, text="<html>")
    with pytest.raises(quilt.APIResponseError):
        client.healthz()


@pytest.mark.parametrize(
    "error",
    [
        quilt.NotFoundError(404, "gone", "req-1", "user", field="model_id"),
        quilt.UserRequestError("bad token", "req-2", "user"),
        quilt.APIConnectionError("down"),
    ],
)
def test_errors_survive_pickling(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and vars(copy) == vars(error) and str(copy) == str(error)
