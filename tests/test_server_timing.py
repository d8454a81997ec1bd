"""Every answer's Server-Timing says the request's whole time in the API and what it waited on
meanwhile (core.waits), per request: a submission shows its statement and its Lua script, a call
that touches no store shows none."""

from __future__ import annotations

import pytest
from stackutil import datum, fb_body, new_model

pytestmark = pytest.mark.stack


def _timing(response) -> dict[str, float]:
    out = {}
    for entry in response.headers["Server-Timing"].split(","):
        name, _, dur = entry.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def test_server_timing_splits_a_call_into_its_waits(stack, tenant):
    c = stack.http(tenant.key)
    model_id = new_model(c)
    submitted = c.post("/forward_backward", json=fb_body(model_id, 1, [datum([1, 2, 3, 4])]))
    assert submitted.status_code == 200, submitted.text
    t = _timing(submitted)
    assert set(t) == {"app", "pool", "pg", "redis"}
    assert t["pg"] > 0 and t["redis"] > 0  # the request's row, and its stream entry
    assert t["app"] >= t["pool"] + t["pg"] + t["redis"]  # the waits are sequential parts of the whole

    refused = stack.http(None).post("/get_info", json={"model_id": model_id})  # no key: no store is asked
    assert refused.status_code == 401
    assert _timing(refused)["pg"] == 0 and _timing(refused)["redis"] == 0 and _timing(refused)["pool"] == 0
