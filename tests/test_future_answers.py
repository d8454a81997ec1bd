"""A finished future is answered from what the worker stored (core.queue.publish): in JSON, the
stored text as it is, not decoded and encoded again; in protobuf (the tinker SDK's accept), encoded
from the decoded result. Both say the same numbers."""

from __future__ import annotations

import json
import uuid

import pytest

from api import tinker_proto
from core import queue
from core.loss_spec import LossConfig
from core.work import PassWork, WorkItem, WorkKind

pytestmark = pytest.mark.stack

# Floats whose shortest repr round-trips, a subnormal, a large count, text outside ASCII.
RESULT = {"loss_fn_outputs": [{"logprobs": {"data": [-0.1, -2.5e-08, -5e-324, -123.456789012345], "dtype": "float32",
                                            "shape": [4]}} for _ in range(3)],
          "metrics": {"loss:sum": 7.25, "tokens:sum": 2**53}, "note": "réponse ✓"}


def _published(r, tenant_id: str) -> str:
    """A finished forward_backward of `tenant_id`, stored as a worker stores one."""
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    item = WorkItem(request_id, tenant_id, "m", 0, WorkKind.FORWARD_BACKWARD, 0,
                    PassWork("cross_entropy", LossConfig(), ()))
    queue.publish(r, queue.Outcome(request_id, result=RESULT), 60, item)
    return request_id


def test_a_json_answer_is_the_stored_text(stack, tenant, r):
    request_id = _published(r, tenant.tenant_id)
    stored = r.xrange(queue.future_key(request_id))[0][1][b"body"]
    answer = stack.http(tenant.key).post("/retrieve_future", json={"request_id": request_id})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.content == stored
    assert answer.json() == RESULT


def test_a_protobuf_answer_says_the_same_numbers(stack, tenant, r):
    request_id = _published(r, tenant.tenant_id)
    c = stack.http(tenant.key)
    answer = c.post("/retrieve_future", json={"request_id": request_id}, headers={"Accept": tinker_proto.PROTOBUF})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == tinker_proto.PROTOBUF
    # Compared as messages: a map's entries have no fixed order on the wire.
    message = tinker_proto._pb().ForwardBackwardOutput
    expected = tinker_proto.encode_forward_backward_output(json.loads(json.dumps(RESULT)))
    assert message.FromString(answer.content) == message.FromString(expected)


def test_another_tenants_stored_future_is_not_answered(stack, tenant, r):
    other = stack.create_tenant()
    request_id = _published(r, other.tenant_id)
    answer = stack.http(tenant.key).post("/retrieve_future", json={"request_id": request_id})
    assert answer.status_code == 404, answer.text
    assert b"loss_fn_outputs" not in answer.content
