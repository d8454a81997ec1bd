"""Queue states: a training call over its tenant's limits waits instead of being refused.

A call on an existing model that the in-flight limit (`max_inflight_requests`), the
tokens-per-minute bucket or a base at capacity (its trainer's beacon reports
`QUILT_CAPACITY_QUEUE_DEPTH` requests queued) would have refused with 429 is accepted
(api.admission_rule.decide says `Pause`): its row is written `paused` with a queue state
(`paused_rate_limit` or `paused_capacity`) and a reason, its work item is kept in Redis
(`admission.park`), and its seq_id holds its place in the model's order. Later calls of the tenant
wait behind it, so a tenant's calls still run in the order they came.

Nothing appends a paused call but `promote`, run by the polls of the tenant's paused futures
(`retrieve_future` on a paused row holds `QUILT_PAUSED_POLL_SECONDS`, counted as a long-poll, and
promotes as places free, at most twice a second per tenant and API process):
under the tenant's quota lock it counts the requests in flight, asks `admission_rule.promotable`
which paused calls go now, and for each sets its row queued (committed) and appends its entry,
taking its tokens then, once (the append marker). A call the bucket still cannot hold goes back to
waiting, with the wait the bucket named. A call still waiting `QUILT_QUEUE_WAIT_DEADLINE_S` after
it came fails in its seq_id's place (a placeholder entry, api.seq_gaps' kind), billed nothing; so
does one whose kept item Redis lost. Until then the future answers
`{"type": "try_again", "queue_state", "queue_state_reason"}`, which the tinker SDK hands to its
`on_queue_state_change` observers.
"""

from __future__ import annotations

import asyncio
import logging
import time

from psycopg import AsyncConnection
from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from api import admission, records
from api import admission_rule as rule
from core import db, queue, result_bytes
from core.settings import ApiSettings, get_api_settings
from core.work import Rejected, WorkItem, WorkKind
from tenancy import scoped
from tenancy.auth import Principal

log = logging.getLogger("quilt.api.queue_states")

# Paused calls one promotion looks at: more than any tenant's in-flight limit frees at once.
_LOOK_AHEAD = 256


def try_again(row: dict) -> dict:
    """A paused request's answer to `retrieve_future`: the SDK polls again and tells its observers
    why it waits."""
    return {"type": "try_again", "request_id": row["id"], "queue_state": row["queue_state"] or rule.RATE,
            "queue_state_reason": row["queue_reason"] or "waiting for your limits"}


async def hold(pool: AsyncConnectionPool[AsyncConnection[DictRow]], redis: Redis, who: Principal, row: dict,
               settings: ApiSettings) -> dict:
    """Wait on a paused request `row` of `who` for up to `settings.paused_poll_seconds`, promoting
    the tenant's paused calls as places free; returns the row as it stands then (no longer paused:
    appended, or failed at its deadline)."""
    until = time.monotonic() + settings.paused_poll_seconds
    while True:
        async with db.autocommit(pool) as conn:
            if _due(who.tenant_id):
                await promote(conn, redis, who)
            row = await scoped.get_request(conn, who, row["id"])
        left = until - time.monotonic()
        if row["status"] != "paused" or left <= 0:
            return row
        await asyncio.sleep(min(_PROMOTE_EVERY_S, left))


_PROMOTE_EVERY_S = 0.5
_promoted_at: dict[str, float] = {}  # tenant -> when this process last promoted its line (monotonic)


def _due(tenant_id: str) -> bool:
    """Whether this process should promote the tenant's line now: at most every _PROMOTE_EVERY_S,
    however many of its futures wait (each poll would otherwise take the quota lock and read the
    line). Tenants not seen for a minute are forgotten."""
    now = time.monotonic()
    if now - _promoted_at.get(tenant_id, -1e9) < _PROMOTE_EVERY_S:
        return False
    if len(_promoted_at) > 10_000:
        for tenant, at in list(_promoted_at.items()):
            if now - at > 60:
                del _promoted_at[tenant]
    _promoted_at[tenant_id] = now
    return True


async def promote(conn: AsyncConnection[DictRow], redis: Redis, who: Principal) -> list[str]:
    """Append the paused calls of `who`'s tenant that may go now, and fail those past their
    deadline (see the module docstring); returns the ids appended. `conn` autocommits."""
    api = get_api_settings()
    appended: list[str] = []
    async with records.quota_lock(conn, who.tenant_id):
        rows = {r["id"]: r for r in await records.paused_requests(conn, who.tenant_id, _LOOK_AHEAD)}
        if not rows:
            return appended
        waiting = [rule.Waiting(r["id"], r["model_id"], r["seq_id"], r["n_tokens"], r["wait_s"], r["age_s"],
                                await _at_capacity(redis, r)) for r in rows.values()]
        for request_id in rule.expired(waiting, api.queue_wait_deadline_s):
            row = rows[request_id]
            await _fail(conn, redis, who, row, f"waited {row['age_s']:.0f} s in queue state {row['queue_state']} "
                                               f"({row['queue_reason']}), past the deadline of "
                                               f"{api.queue_wait_deadline_s:.0f} s (QUILT_QUEUE_WAIT_DEADLINE_S)")
        live = [w for w in waiting if w.age_s < api.queue_wait_deadline_s]
        inflight, _budgeted, _paused = await scoped.inflight_and_budgeted(conn, who)
        for request_id in rule.promotable(live, inflight, who.max_inflight_requests):
            item = await _parked(redis, request_id)
            if item is None:  # Redis lost it: the call cannot run, but must not hold up its model's line
                await _fail(conn, redis, who, rows[request_id], "this call's work was lost while it waited in a queue "
                                                                "state (the store restarted); send it again")
            elif not await _append(conn, redis, who, rows[request_id], item):
                break  # the bucket is short again: the rest of the line waits behind it
            else:
                appended.append(request_id)
    return appended


async def _parked(redis: Redis, request_id: str) -> WorkItem | None:
    fields = await redis.hgetall(admission.parked_key(request_id))
    if not fields:
        return None
    return WorkItem.from_fields(fields)


async def _at_capacity(redis: Redis, row: dict) -> bool:
    """Whether the trainer of a paused call's model holds QUILT_CAPACITY_QUEUE_DEPTH requests."""
    queued = await admission.trainer_queued(redis, row["base_model"], row["trainer_shard"])
    return rule.at_capacity(queued, get_api_settings().capacity_queue_depth)


async def _append(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, row: dict, item: WorkItem) -> bool:
    """Queue the paused call `item` (its row `row`) and append its entry, taking its tokens; False
    (and waiting again) when the bucket cannot hold them yet."""
    if not await records.unpause(conn, item.request_id):
        return True  # another API process promoted or failed it
    slot = admission.SeqSlot(item.model_id, item.seq_id, shard=row["trainer_shard"])
    ticket = admission.Ticket(item, row["base_model"], slot)
    try:
        wait_s = await admission.append(conn, redis, who, ticket, item)
    except queue.ResultBytesFull as full:  # waits until the tenant's stored results age out
        await admission.pause(conn, redis, item, rule.Pause(rule.RATE, full.message), result_bytes.OVER_FLAG_S)
        return False
    if wait_s is None:
        await redis.delete(admission.parked_key(item.request_id))
        return True
    await admission.pause(conn, redis, item, rule.Pause(rule.RATE, rule.rate_reason(who, ticket.tokens, wait_s)), wait_s)
    return False


async def _fail(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, row: dict, message: str) -> None:
    """Fail a paused call in its seq_id's place: queued again, with a placeholder entry the trainer
    fails in order with `message`, billing nothing (as api.seq_gaps' refusals)."""
    if not await records.unpause(conn, row["id"]):
        return
    item = WorkItem(row["id"], who.tenant_id, row["model_id"], row["seq_id"], WorkKind.REJECTED, 0,
                    Rejected(message, "queue_state"))
    slot = admission.SeqSlot(row["model_id"], row["seq_id"], shard=row["trainer_shard"])
    try:
        await admission.append(conn, redis, who, admission.Ticket(item, row["base_model"], slot, check_quota=False), item)
    except queue.ResultBytesFull:  # nothing new enters the stream for now: failed by a later poll
        await records.pause(conn, row["id"], row["queue_state"], row["queue_reason"], result_bytes.OVER_FLAG_S)
        return
    await redis.delete(admission.parked_key(row["id"]))
    log.info("paused request %s failed: %s", row["id"], message)
