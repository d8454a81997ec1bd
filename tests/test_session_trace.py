"""A session's trace (api.session_trace.build_trace): Chrome trace-event JSON from request rows,
pure. Every request is one async slice holding its queue wait and its work, each begin matched by
an end no earlier; a truncated trace says so."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from api.session_trace import MAX_TRACE_REQUESTS, build_trace, work_name

T0 = datetime(2026, 5, 1, 12, tzinfo=UTC)


def row(i: int, kind: str, *, model: str = "m1", wait: float = 0.5, run: float | None = 1.0, status: str = "done",
        started: bool = True) -> dict:
    created = T0 + timedelta(seconds=i)
    start = created + timedelta(seconds=wait) if started else None
    finished = None if run is None else (start or created) + timedelta(seconds=run)
    return {"id": f"r{i}", "kind": kind, "status": status, "model_id": model, "seq_id": i, "n_tokens": 8,
            "queue_state": None, "created_at": created, "started_at": start, "finished_at": finished}


def slices(trace: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """(request id, slice name) -> (begin, end) in microseconds; every b has exactly one e after it."""
    open_: dict[tuple[str, str], int] = {}
    out = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "b":
            assert (e["id"], e["name"]) not in open_
            open_[(e["id"], e["name"])] = e["ts"]
        elif e["ph"] == "e":
            begin = open_.pop((e["id"], e["name"]))
            assert e["ts"] >= begin
            out[(e["id"], e["name"])] = (begin, e["ts"])
    assert not open_
    return out


@pytest.mark.parametrize("kind,name", [
    ("forward_backward", "trainer pass"), ("forward", "trainer pass"), ("optim_step", "optimizer step"),
    ("save_weights_for_sampler", "export"), ("save_weights", "export"), ("sample", "sampling"),
    ("create_model", "create_model"),
])
def test_work_names(kind, name):
    assert work_name(kind) == name


def test_each_request_is_a_wait_then_its_work_inside_its_own_slice():
    rows = [row(0, "create_model"), row(1, "forward_backward", wait=0.25, run=2.0), row(2, "optim_step"),
            row(3, "save_weights_for_sampler"), row(4, "sample", model="s1", wait=0.0, run=0.5)]
    trace = json.loads(json.dumps(build_trace("sess", rows, truncated=False, now=T0 + timedelta(hours=1))))
    got = slices(trace)
    assert got[("r1", "queue wait")] == (1_000_000, 1_250_000)
    assert got[("r1", "trainer pass")] == (1_250_000, 3_250_000)
    assert got[("r1", "forward_backward r1")] == (1_000_000, 3_250_000)
    assert ("r3", "export") in got and got[("r4", "sampling")] == (4_000_000, 4_500_000)
    # The generation pool records no start: a done sample is one slice from admission to its end.
    unstarted = slices(build_trace("s", [row(0, "sample", started=False, run=0.75)], truncated=False, now=T0))
    assert unstarted == {("r0", "sample r0"): (0, 750_000), ("r0", "sampling"): (0, 750_000)}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"session sess", "model m1", "sampler s1"}
    assert [e["args"]["request_id"] for e in trace["traceEvents"] if e["name"] == "admitted"] == [f"r{i}" for i in range(5)]
    assert trace["otherData"]["truncated"] is False and trace["otherData"]["requests"] == 5
    assert trace["otherData"]["start"] == T0.isoformat()


def test_a_request_never_taken_waits_until_it_failed_and_one_running_ends_at_now():
    now = T0 + timedelta(seconds=30)
    rows = [row(0, "forward_backward", started=False, run=3.0, status="failed"),
            row(1, "forward_backward", run=None, status="running"),
            row(2, "sample", started=False, run=None, status="queued")]
    got = slices(build_trace("s", rows, truncated=False, now=now))
    assert got[("r0", "queue wait")] == (0, 3_000_000) and ("r0", "trainer pass") not in got
    assert got[("r1", "trainer pass")] == (1_500_000, 30_000_000)
    assert got[("r2", "queue wait")] == (2_000_000, 30_000_000)


def test_a_truncated_trace_says_so_and_an_empty_one_is_valid():
    trace = build_trace("s", [row(0, "sample")], truncated=True, now=T0, limit=1)
    assert trace["otherData"] | {} == {**trace["otherData"], "truncated": True, "shown": 1, "limit": 1}
    assert any(e["name"] == "trace truncated" for e in trace["traceEvents"])
    empty = build_trace("s", [], truncated=False, now=T0)
    assert slices(empty) == {} and empty["otherData"]["requests"] == 0
    assert MAX_TRACE_REQUESTS == 10_000  # the documented limit (docs/sdk)


def test_the_trace_size_is_bounded_by_the_request_cap():
    rows = [row(i, "forward_backward") for i in range(1000)]
    size = len(json.dumps(build_trace("s" * 40, rows, truncated=True, now=T0), separators=(",", ":")))
    assert size / 1000 * MAX_TRACE_REQUESTS < 16 * 2**20  # well under the documented ~13 MB at the cap
