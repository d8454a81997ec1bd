"""`retrieve_future`: the long-poll every future goes through; `retrieve_futures`: one long-poll for
all of a sampling session's requests (the tinker SDK's session poller)."""

from __future__ import annotations

import contextlib
import dataclasses

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api import long_polls, queue_states, tinker_proto
from api.deps import Pool, RedisDep, Settings, Who
from api.input_guard import GuardedRoute
from api.schemas import RetrieveFutureRequest, RetrieveFuturesRequest
from core import db, queue
from core.errors import UserError
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, tags=["futures"])

# Result kinds the tinker SDK reads only as protobuf, and their encoders.
_PROTO_RESULTS = {
    "forward": tinker_proto.encode_forward_backward_output,
    "forward_backward": tinker_proto.encode_forward_backward_output,
    "sample": tinker_proto.encode_sample_response,
}


class FutureExpired(UserError):
    status_code = 410


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, request: Request, who: Who, pool: Pool, redis: RedisDep,
                          settings: Settings):
    """Wait up to about 30 s for a future. Answers the result, a failure
    (`{"error", "category": "user"|"server", "request_id"}`), or `{"type": "try_again", ...}`.
    Forward/backward and sampling results come as protobuf when the client accepts
    `application/x-protobuf` (the tinker SDK does), as JSON otherwise. A call waiting in a queue
    state (api.queue_states) is answered within a few seconds: `try_again` with its `queue_state`
    (`paused_rate_limit`, `paused_capacity`) and `queue_state_reason`."""
    # A finished future names its tenant (core.queue.publish): yours is answered from Redis alone.
    outcome = await queue.ready(redis, body.request_id)
    if outcome is None or outcome.tenant_id != who.tenant_id:
        async with db.autocommit(pool) as conn:
            row = await scoped.get_request(conn, who, body.request_id)  # 404 unless it is yours
        if row["status"] == "paused":  # waiting in a queue state: answered soon, with why
            async with long_polls.held(who.tenant_id, settings.long_polls_per_tenant):
                row = await queue_states.hold(pool, redis, who, row, settings)
            if row["status"] == "paused":
                return queue_states.try_again(row)
        if outcome is None:
            async with long_polls.held(who.tenant_id, settings.long_polls_per_tenant):
                outcome = await queue.wait(redis, body.request_id, settings.long_poll_seconds)
        if outcome is None:
            return await _without_future(redis, body.request_id, row)
        outcome = dataclasses.replace(outcome, kind=row["kind"])
    if not outcome.ok:
        return JSONResponse(outcome.error)
    encode = _PROTO_RESULTS.get(outcome.kind)
    if encode is not None and tinker_proto.wants_protobuf(request.headers.get("accept")):
        return Response(encode(outcome.result), media_type=tinker_proto.PROTOBUF)
    return Response(outcome.body, media_type="application/json")  # stored as JSON: sent as it was stored


async def _without_future(redis, request_id: str, row: dict):
    """The answer for a request of yours whose future is not stored. Workers finish the row before
    publishing its future (core.consumer), so a finished row may be one whose worker died between
    the two: a failure is answered from the row; a success is still on its way while its append
    marker lives (the restarted worker runs it again and publishes it), expired after."""
    if row["status"] == "failed" and row["error"]:
        return JSONResponse(row["error"])
    if row["status"] == "failed" or (
            row["status"] == "done" and not queue.was_appended(await redis.get(queue.enqueued_key(request_id)))):
        raise FutureExpired(f"the result of {request_id!r} has expired", field="request_id")
    return {"type": "try_again", "request_id": request_id, "queue_state": "active",
            "queue_state_reason": f"request is {row['status']}"}


@router.post("/retrieve_futures")
async def retrieve_futures(body: RetrieveFuturesRequest, who: Who, pool: Pool, redis: RedisDep,
                           settings: Settings) -> dict:
    """Wait up to about 30 s (or `timeout` seconds; 0 answers at once) for requests of your sampling
    session's clone to finish, and name them: `{"completions": [{"state": "finished"|"failed",
    "request_id", ...}], "cursor"}`. Pass `cursor` back as `prev_cursor`: completions at or before
    it are not sent again. Each result is then read with `retrieve_future`; the results named in
    `retrieved_request_ids` have been read for good, and are deleted (a later `retrieve_future` of
    one answers 410)."""
    target = body.target
    async with db.autocommit(pool) as conn:
        await scoped.get_sampling_session(conn, who, target.sampling_session_id)  # 404 unless it is yours
    if body.retrieved_request_ids:  # read for good: their results need not wait out their lifetime
        await queue.forget_samples(redis, who.tenant_id, body.retrieved_request_ids)
    hold = settings.long_poll_seconds if body.timeout is None else min(body.timeout, settings.long_poll_seconds)
    waiting = long_polls.held(who.tenant_id, settings.long_polls_per_tenant) if hold > 0 else contextlib.nullcontext()
    async with waiting:
        completions, cursor = await queue.session_completions(redis, target.sampling_session_id,
                                                              target.cloned_sampler_id, body.prev_cursor, hold)
    return {"completions": completions, "cursor": cursor}
