"""Queue states: a training call over its tenant's limits waits instead of being refused.

A call on an existing model that the in-flight limit (`max_inflight_requests`), the
tokens-per-minute bucket or a base at capacity (its trainer's beacon reports
`QUILT_CAPACITY_QUEUE_DEPTH` requests queued) would have refused with 429 is accepted
(api.admission_rule.decide says `Pause`): its row is written `paused` with a queue state
(`paused_rate_limit` or `paused_capacity`) and a reason, its work item is kept in Redis
(`admission.park`), and its seq_id holds its place in the model's order. Later calls of the tenant
wait behind it, so a tenant's calls still run in the order they came.

Nothing appends a paused call but `promote`, run by the polls of the tenant's paused futures
(`retrieve_future` on a paused row holds `QUILT_PAUSED_POLL_SECONDS`, promoting as places free):
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
from core import db
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
            await promote(conn, redis, who)
            row = await scoped.get_request(conn, who, row["id"])
        left = until - time.monotonic()
        if row["status"] != "paused" or left <= 0:
            return row
        await asyncio.sleep(min(0.25, left))


async def promote(conn: AsyncConnection[DictRow], redis: Redis, who: Principal) -> list[str]:
    """Append the paused calls of `who`'s tenant that may go now, and fail those past their
    deadline (see the module docstring); returns the ids appended. `conn` autocommits."""
    api = get_api_settings()
    appended: list[str] = []
    async with records.quota_lock(conn, who.tenant_id):
        rows = await records.paused_requests(conn, who.tenant_id, _LOOK_AHEAD)
        if not rows:
            return appended
        items = {r["id"]: await _parked(redis, r["id"]) for r in rows}
        waiting = [rule.Waiting(r["id"], r["model_id"], r["seq_id"], r["n_tokens"], r["wait_s"], r["age_s"])
                   for r in rows]
        for request_id in rule.expired(waiting, api.queue_wait_deadline_s):
            row = next(r for r in rows if r["id"] == request_id)
            await _fail(conn, redis, who, row, items[request_id],
                        f"waited {row['age_s']:.0f} s in queue state {row['queue_state']} ({row['queue_reason']}), "
                        f"past the deadline of {api.queue_wait_deadline_s:.0f} s (QUILT_QUEUE_WAIT_DEADLINE_S)")
        for request_id, parked in items.items():
            row = next(r for r in rows if r["id"] == request_id)
            if parked is None and row["age_s"] < api.queue_wait_deadline_s:
                await _fail(conn, redis, who, row, None, "this call's work was lost while it waited in a queue state "
                                                         "(the store restarted); send it again with a new seq_id")
        live = [w for w in waiting if items[w.request_id] is not None and w.age_s < api.queue_wait_deadline_s]
        live = [await _with_capacity(redis, w, items[w.request_id]) for w in live]
        inflight, _budgeted, _paused = await scoped.inflight_and_budgeted(conn, who)
        for request_id in rule.promotable(live, inflight, who.max_inflight_requests):
            parked = items[request_id]
            assert parked is not None  # `live` holds only kept items
            base_model, item = parked
            if not await _append(conn, redis, who, base_model, item):
                break  # the bucket is short again: the rest of the line waits behind it
            appended.append(request_id)
    return appended


async def _parked(redis: Redis, request_id: str) -> tuple[str, WorkItem] | None:
    fields = await redis.hgetall(admission.parked_key(request_id))
    if not fields:
        return None
    base = fields.pop(b"_base", b"")
    return base.decode() if isinstance(base, bytes) else str(base), WorkItem.from_fields(fields)


async def _with_capacity(redis: Redis, w: rule.Waiting, parked: tuple[str, WorkItem] | None) -> rule.Waiting:
    """`w`, marked at capacity while its base's trainer holds QUILT_CAPACITY_QUEUE_DEPTH requests."""
    if parked is None:
        return w
    queued = await admission.trainer_queued(redis, parked[0], None)
    if not rule.at_capacity(queued, get_api_settings().capacity_queue_depth):
        return w
    return rule.Waiting(w.request_id, w.model_id, w.seq_id, w.tokens, w.wait_s, w.age_s, at_capacity=True)


async def _append(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, base_model: str, item: WorkItem) -> bool:
    """Queue the paused call `item` and append its entry, taking its tokens; False (and waiting
    again) when the bucket cannot hold them yet."""
    if not await records.unpause(conn, item.request_id):
        return True  # another API process promoted or failed it
    ticket = admission.Ticket(item, base_model, admission.SeqSlot(item.model_id, item.seq_id))
    wait_s = await admission.append(conn, redis, who, ticket, item)
    if wait_s is None:
        await redis.delete(admission.parked_key(item.request_id))
        return True
    await admission.pause(conn, redis, base_model, item,
                          rule.Pause(rule.RATE, rule.rate_reason(who, ticket.tokens, wait_s)), wait_s)
    return False


async def _fail(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, row: dict,
                parked: tuple[str, WorkItem] | None, message: str) -> None:
    """Fail a paused call in its seq_id's place: queued again, with a placeholder entry the trainer
    fails in order with `message`, billing nothing (as api.seq_gaps' refusals)."""
    if not await records.unpause(conn, row["id"]):
        return
    base_model = parked[0] if parked else await _base_of(conn, who, row["model_id"])
    item = WorkItem(row["id"], who.tenant_id, row["model_id"] or "", row["seq_id"] or 0, WorkKind.REJECTED, 0,
                    Rejected(message, "queue_state"))
    ticket = admission.Ticket(item, base_model, admission.SeqSlot(item.model_id, item.seq_id), check_quota=False)
    await admission.append(conn, redis, who, ticket, item)
    await redis.delete(admission.parked_key(row["id"]))
    log.info("paused request %s failed: %s", row["id"], message)


async def _base_of(conn: AsyncConnection[DictRow], who: Principal, model_id: str | None) -> str:
    model = await scoped.get_model(conn, who, model_id or "")
    return str(model["base_model"])
