"""A forward_backward looks its loss up once at the API: `core.loss_spec.spec_of` runs once per
call through the route's own parse path (body, seq_id, model limits, datums, loss config), and a
bad `loss_fn` is still a 400 naming the field, before the model is read. No stores: the model
read and the enqueue are stood in for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from api.routes import training
from core import loss_spec
from core.errors import InvalidInput
from core.settings import ApiSettings

MODEL = {"id": "sess-1:train:0", "status": "ready", "vocab_size": 100, "max_context_length": 32}


def _request(body: dict) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/api/v1/forward_backward", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    return Request(scope, receive)


def _body(loss_fn: str) -> dict:
    tokens = [5, 6, 7, 8]
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
             "loss_fn_inputs": {"target_tokens": {"data": tokens, "dtype": "int64", "shape": [len(tokens)]},
                                "weights": {"data": [1.0] * len(tokens), "dtype": "float32", "shape": [len(tokens)]}}}
    return {"model_id": MODEL["id"], "seq_id": 1,
            "forward_backward_input": {"loss_fn": loss_fn, "loss_fn_config": None, "data": [datum]}}


@pytest.fixture
def calls(monkeypatch) -> dict:
    """Counts `spec_of` wherever a loaded module holds it (so a fresh `from core.loss_spec import
    spec_of` anywhere is counted too), and stands in for the model read and the enqueue."""
    counts = {"spec_of": 0, "model_reads": 0, "queued": []}
    real = loss_spec.spec_of

    def counting(loss_fn):
        counts["spec_of"] += 1
        return real(loss_fn)

    # The module's own names only: a lazy module's __getattr__ (transformers) would import on a probe.
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("spec_of") is real:
            monkeypatch.setattr(module, "spec_of", counting)

    @contextlib.asynccontextmanager
    async def autocommit(pool):
        yield None

    async def training_model(callers, conn, who, model_id):
        counts["model_reads"] += 1
        return MODEL

    async def model_call(conn, redis, who, model_id, *, seq_id, kind, body, n_tokens):
        counts["queued"].append(body)
        return {"request_id": "req-1"}

    monkeypatch.setattr(training.db, "autocommit", autocommit)
    monkeypatch.setattr(training.caller_cache, "training_model", training_model)
    monkeypatch.setattr(training, "_model_call", model_call)
    return counts


def _forward(body: dict) -> dict:
    who = SimpleNamespace(tenant_id="tenant-1")
    return asyncio.run(training._forward(_request(body), who, None, None, ApiSettings(), None, forward_only=False))


def test_a_forward_backward_looks_its_loss_up_once(calls):
    assert _forward(_body("cross_entropy")) == {"request_id": "req-1"}
    [work] = calls["queued"]
    assert work.loss_fn == "cross_entropy" and len(work.data) == 1
    assert calls["spec_of"] == 1


def test_an_unknown_loss_fn_is_a_400_naming_the_field_before_the_model_is_read(calls):
    with pytest.raises(InvalidInput, match="'mystery' is not supported.*cross_entropy") as info:
        _forward(_body("mystery"))
    assert info.value.field == "loss_fn" and info.value.status_code == 400
    assert calls["spec_of"] == 1 and calls["model_reads"] == 0 and not calls["queued"]
