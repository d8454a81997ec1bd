"""A tiny fake Quilt server for SDK tests, plugged in through httpx.MockTransport.

It records every request and answers the routes the SDK uses. Tests change a route by
assigning ``server.routes[name] = handler``; a handler gets the decoded JSON body and returns
a dict (HTTP 200) or an ``httpx.Response``. Future results are queued per request id in
``server.answers``; every answer but the last is used once, the last one is repeated.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import quilt
from quilt._config import RetryPolicy

KEY = "tml-test-key"
BASE_URL = "http://quilt.test"

Handler = Callable[[dict[str, Any]], "dict[str, Any] | httpx.Response"]


@dataclass
class Recorded:
    """One request as the fake server saw it."""

    method: str
    route: str
    body: Any
    headers: httpx.Headers
    url: str


class FakeServer:
    """Records requests; answers like a Quilt server whose work finishes instantly."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.answers: dict[str, list[Any]] = {}
        self._ids = itertools.count(1)
        self.fb_metrics: dict[str, float] = {"loss:sum": 1.5}
        self.routes: dict[str, Handler] = {
            "healthz": lambda body: {"status": "ok"},
            "get_server_capabilities": lambda body: {"supported_models": [{"model_name": "tiny"}]},
            "create_session": lambda body: {"session_id": "sess-1"},
            "session_heartbeat": lambda body: {"type": "session_heartbeat"},
            "create_model": lambda body: self.future(
                {"model_id": f"{body['session_id']}:train:{body['model_seq_id']}"}, body
            ),
            "get_info": lambda body: {"model_id": body["model_id"], "model_data": {"model_name": "tiny"}},
            "forward_backward": lambda body: self.future(self.fb_result(body), body),
            "forward": lambda body: self.future(self.fb_result(body), body),
            "optim_step": lambda body: self.future({"metrics": {"grad_norm:mean": 0.25}}, body),
            "save_weights": lambda body: self.future(
                {"path": f"tinker://{body['model_id']}/weights/{body['path']}"}, body
            ),
            "load_weights": lambda body: self.future({"path": body["path"]}, body),
            "retrieve_future": self.retrieve,
            "sessions/sess-1/finish": lambda body: {},
        }

    def fb_result(self, body: dict[str, Any]) -> dict[str, Any]:
        """A cross_entropy-shaped result with one logprobs tensor per datum."""
        outputs = []
        for datum in (body.get("forward_input") or body["forward_backward_input"])["data"]:
            n = len(datum["loss_fn_inputs"]["target_tokens"]["data"])
            outputs.append({"logprobs": {"data": [-0.5] * n, "dtype": "float32", "shape": [n]}})
        return {
            "loss_fn_output_type": "cross_entropy",
            "loss_fn_outputs": outputs,
            "metrics": dict(self.fb_metrics),
        }

    def future(self, result: Any, body: dict[str, Any]) -> dict[str, Any]:
        """Accept a request: queue ``result`` under a new request id and answer the id."""
        request_id = f"req-{next(self._ids)}"
        self.answers[request_id] = [result]
        answer = {"request_id": request_id}
        if "model_id" in body:
            answer["model_id"] = body["model_id"]
        return answer

    def retrieve(self, body: dict[str, Any]) -> Any:
        queue = self.answers[body["request_id"]]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.removeprefix("/api/v1/")
        body = json.loads(request.content) if request.content else None
        self.requests.append(Recorded(request.method, route, body, request.headers, str(request.url)))
        handler = self.routes.get(route)
        if handler is None:
            return httpx.Response(404, json={"detail": f"no route {route}", "category": "user"})
        answer = handler(body)
        return answer if isinstance(answer, httpx.Response) else httpx.Response(200, json=answer)

    def routes_seen(self) -> list[str]:
        """Route names in arrival order."""
        return [r.route for r in self.requests]

    def bodies(self, route: str) -> list[Any]:
        """JSON bodies sent to ``route``, in arrival order."""
        return [r.body for r in self.requests if r.route == route]


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def make_client(server: FakeServer) -> Iterator[Callable[..., quilt.Client]]:
    """Factory for Clients wired to ``server``; retries have no delay; all are closed after."""
    made: list[quilt.Client] = []

    def make(**kwargs: Any) -> quilt.Client:
        kwargs.setdefault("api_key", KEY)
        kwargs.setdefault("base_url", BASE_URL)
        client = quilt.Client(transport=httpx.MockTransport(server), **kwargs)
        client._http.retry = RetryPolicy(max_retries=2, backoff_base_s=0.0, unavailable_max_s=0.0)
        made.append(client)
        return client

    yield make
    for client in made:
        client._close("success", None, raise_errors=False)


@pytest.fixture
def client(make_client: Callable[..., quilt.Client]) -> quilt.Client:
    return make_client()


@pytest.fixture
def tc(client: quilt.Client) -> quilt.TrainingClient:
    return client.create_training_client("tiny", rank=4)


@pytest.fixture
def batch() -> list[quilt.Datum]:
    return [quilt.datum_for_next_token([1, 2, 3, 4])]
