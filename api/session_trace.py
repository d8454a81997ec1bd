"""A session's requests as a trace Perfetto (and chrome://tracing) opens: Chrome trace-event JSON,
built from the timestamps Quilt already keeps on each request row (`requests.created_at`,
`started_at`, `finished_at`), with no recording of its own.

One process per session; one track per training model or sampler of it (named by its id). Each
request is an async slice from its admission to its end, holding two slices in turn:

    queue wait   admitted (the row inserted, or paused in a queue state) until a worker took it
    <work>       taken until finished: `trainer pass` (forward, forward_backward), `optimizer step`,
                 `export` (save_weights, save_weights_for_sampler, save_weights_external), `sampling`,
                 or the kind's own name (create_model, load_weights)

and an instant `admitted` mark at its start. The generation pool records no start on its rows, so a
finished sample is one `sampling` slice from admission to its end (its wait in the pool inside it).
A request never taken (failed in the queue) has the wait only; one still running ends at the
trace's end. Times are microseconds from the session's first request; `otherData.start` gives that
instant in UTC.

Bounded: at most MAX_TRACE_REQUESTS requests, the latest ones; a trace holding fewer than the
session has says so in `otherData` (`truncated`, `shown`, `limit`) and with an instant event named
`trace truncated` at its start. `build_trace` is pure (rows in, JSON-ready dict out).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

MAX_TRACE_REQUESTS = 10_000  # each gives up to 5 events of ~250 bytes: a trace stays under ~13 MB

_WORK_NAMES = {"forward": "trainer pass", "forward_backward": "trainer pass", "optim_step": "optimizer step",
               "save_weights": "export", "save_weights_for_sampler": "export", "save_weights_external": "export",
               "sample": "sampling"}
_CATEGORY = {"trainer pass": "train", "optimizer step": "train", "export": "export", "sampling": "sample"}
PID = 1


def _us(at: datetime, origin: datetime) -> int:
    return int((at - origin).total_seconds() * 1_000_000)


def work_name(kind: str) -> str:
    """The slice a request's work is shown as."""
    return _WORK_NAMES.get(kind, kind)


def build_trace(session_id: str, rows: list[dict], *, truncated: bool, now: datetime,
                limit: int = MAX_TRACE_REQUESTS) -> dict[str, Any]:
    """The trace of `rows` (request rows of one session: id, kind, status, model_id, seq_id,
    n_tokens, queue_state, created_at, started_at, finished_at), oldest first by admission.
    `truncated`: the session has more requests than `rows`; `now` ends requests not finished."""
    rows = sorted(rows, key=lambda r: (r["created_at"], r["id"]))
    origin = rows[0]["created_at"] if rows else now
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "tid": 0, "name": "process_name", "args": {"name": f"session {session_id}"}}]
    tracks: dict[str, int] = {}
    for r in rows:
        track = r["model_id"] or "session"
        if track not in tracks:
            tracks[track] = len(tracks) + 1
            label = f"sampler {track}" if r["kind"] == "sample" else f"model {track}"
            events.append({"ph": "M", "pid": PID, "tid": tracks[track], "name": "thread_name", "args": {"name": label}})
        events.extend(_request_events(r, tracks[track], origin, now))
    if truncated:
        events.append({"ph": "i", "s": "p", "pid": PID, "tid": 0, "ts": 0, "name": "trace truncated",
                       "args": {"shown": len(rows), "limit": limit}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"session_id": session_id, "start": origin.astimezone(UTC).isoformat(),
                          "requests": len(rows), "truncated": truncated, "shown": len(rows), "limit": limit}}


def _request_events(r: dict, tid: int, origin: datetime, now: datetime) -> list[dict[str, Any]]:
    admitted, started, finished = r["created_at"], r["started_at"], r["finished_at"]
    end = finished or now
    work = work_name(r["kind"])
    common = {"pid": PID, "tid": tid, "cat": _CATEGORY.get(work, "admin"), "id": r["id"]}
    args = {"request_id": r["id"], "kind": r["kind"], "status": r["status"], "seq_id": r["seq_id"],
            "tokens": r["n_tokens"]}
    if r.get("queue_state"):
        args["queue_state"] = r["queue_state"]
    taken = started
    if taken is None and r["kind"] == "sample" and finished is not None and r["status"] == "done":
        taken = admitted  # the generation pool records no start: its slice holds its wait in the pool
    wait_end = taken or end

    def span(name: str, begin: datetime, stop: datetime, extra: dict | None = None) -> list[dict[str, Any]]:
        stop = max(stop, begin)
        return [{**common, "ph": "b", "name": name, "ts": _us(begin, origin), **({"args": extra} if extra else {})},
                {**common, "ph": "e", "name": name, "ts": _us(stop, origin)}]

    events = [{"ph": "i", "s": "t", "pid": PID, "tid": tid, "ts": _us(admitted, origin), "name": "admitted",
               "args": {"request_id": r["id"], "kind": r["kind"]}}]
    outer = span(f"{r['kind']} {r['id']}", admitted, end, args)
    events.append(outer[0])
    if started is not None or taken is None:
        events.extend(span("queue wait", admitted, wait_end))
    if taken is not None:
        events.extend(span(work, taken, end))
    events.append(outer[1])
    return events
