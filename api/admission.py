"""Admission: the one path by which work enters a worker's stream.

    async with db.autocommit(pool) as conn:       # a call on an existing model
        ... validate the body against the model's base (caller_cache.training_model) ...
        request_id = await admit_call(conn, redis, who, item)

    async with pool.connection() as conn:         # a call that writes more rows, or needs a read first
        model = await usable_model(conn, who, model_id, seq_id=seq_id)   # read once, 404 if not yours
        request_id = await admit(conn, redis, who, Ticket(item, base_model, SeqSlot.of(model, seq_id)))

A call on an existing model waits on two things: one statement that reads the model (404 if not
yours) and, when nothing in that row can refuse the call, writes its request row beside it
(`records.insert_call`: an autocommit connection, so no BEGIN and no COMMIT round trip), then the
append of its stream entry, which takes its tokens per minute in the same Lua script. When the
row can refuse it (a retry of a call admitted before, the in-flight quota, a suspension, a budget
to check, an unusable model), nothing is written and `admit` judges the row read, as for any
other call. A call that writes more rows (a new model with its first request, a sampler with its
publication) hands `admit` a transaction (`pool.connection()`), which it commits.

Quotas are counted and spent atomically: the count a quota reads (live models, requests in
flight) and the insert it allows run under the tenant's quota lock (`records.quota_lock`, an
advisory lock per tenant), so concurrent calls of one tenant take turns there and a burst cannot
all see the last free place (12 concurrent create_model with room for 2 admitted 3 before). Other
tenants never wait on it. The fast path's one statement takes it in its own round trip
(`records.locked_statement`: the lock and the statement in one message, one transaction); the
slow path, several statements, holds it around them (two short statements more).

`admit` judges the call by `api.admission_rule.decide`, the one statement of every refusal (the
model's state, the seq_id's holder: a retried call gets the existing future, whose entry is
appended now if it never was, since the API may have died between its commit and the append; a
suspension, the tokens-per-minute limit, the live-models and in-flight quotas, the monthly
budgets), reading only the facts it asks for; then it writes the request row (and a new model's
row, placed on a trainer shard where there are several: scaleout.placement), a commit, then the
stream entry (a sample group's generation replica's stream, gen_pool.router; a training call's
model's shard's) with the tokens taken from the bucket in the same step (tenancy.rate_limit).
The row is committed before the entry exists, so a worker never sees work the database does not
know. When the bucket cannot hold the tokens yet, the entry is not appended (and its marker says so,
so no retry appends it either): the row is deleted, freeing the seq_id, and the call answers 429
with Retry-After. A training call on an existing model (`Ticket.waits`) is not refused by the rate
or in-flight limits, nor by a base at capacity: its row waits `paused` in a queue state with its
item kept in Redis (`park`), leaving no refusal marker, and api.queue_states appends it later.
Tokens are thus taken once per request that reaches a worker, however often a call is retried, and a
refused call gives nothing back because it took nothing. If Redis refuses the entry (it went down
after the commit) the row stays queued and the slot held, exactly as when the API dies between its
commit and the append: the call answers 503, and the client's retry with the same ids (both SDKs
retry 503) appends the entry, once. (Marking the row failed instead made that retry resume a failed
request with no result: a 410 for work never run.)

The idempotency rule is a parameter: `SeqSlot` for training calls (unique `(model_id, seq_id)` in
Postgres; the slot's current holder comes with the model read), `RedisSlot` for sampling (the SDK's
sampling sequence ids exceed int32, so a Redis key held for the future's lifetime), or none.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass, replace

from psycopg import AsyncConnection
from psycopg.rows import DictRow
from redis.asyncio import Redis

from api import admission_rule as rule
from api import records
from billing import budgets
from core import faults, health, queue
from core.settings import get_api_settings, get_core_settings
from core.work import WorkItem, WorkKind
from gen_pool.router import Router
from gen_pool.routing import stable_hash
from scaleout import placement
from tenancy import rate_limit, scoped
from tenancy.auth import Principal

log = logging.getLogger("quilt.api.admission")


@dataclass(frozen=True)
class SeqSlot:
    """A training call's identity: `seq_id` of `model_id`, and the request holding it, if any;
    with it, the trainer shard the model's row named (None: one trainer per base, or not placed)
    and the model's status (None: a model this call creates)."""

    model_id: str
    seq_id: int
    holder_id: str | None = None
    holder_kind: str | None = None
    holder_status: str | None = None
    shard: str | None = None
    # The tenant's requests in flight, whether a budget bounds it and its calls waiting in a queue
    # state, as read with the model (None: not read with it, so admission reads them itself).
    quota: tuple[int, bool, int] | None = None
    model_status: str | None = None

    @classmethod
    def of(cls, model: dict, seq_id: int) -> SeqSlot:
        """From a row of `usable_model(..., seq_id=seq_id)` or of `records.insert_call`."""
        return cls(model["id"], seq_id, model.get("seq_holder_id"), model.get("seq_holder_kind"),
                   model.get("seq_holder_status"), model.get("trainer_shard"),
                   (model["inflight"], model["budgeted"], model["paused"]), model["status"])


@dataclass(frozen=True)
class RedisSlot:
    """A sampling call's identity: a Redis key, held (naming the request) for `ttl_s`."""

    key: str
    ttl_s: int


@dataclass(frozen=True)
class Ticket:
    item: WorkItem
    base_model: str
    slot: SeqSlot | RedisSlot | None
    row_kind: str | None = None  # the request row's kind, when it differs from the item's (a placeholder)
    check_quota: bool = True  # placeholders for refused calls hold no new work: no quota, no budget
    new_model: records.NewModel | None = None
    rate_tokens: int | None = None  # tokens taken from the tokens_per_minute bucket; default item.n_tokens

    @property
    def billable(self) -> bool:
        """Whether the budget is checked: calls that meter tokens, and new models (a tenant over
        budget may still step and save the work it paid for, but starts nothing new)."""
        return self.item.n_tokens > 0 or self.new_model is not None

    @property
    def stores(self) -> bool:
        """Whether the call saves a checkpoint (refused while the tenant is suspended)."""
        return self.item.kind in (WorkKind.SAVE_WEIGHTS, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER,
                                  WorkKind.SAVE_WEIGHTS_EXTERNAL)

    @property
    def waits(self) -> bool:
        """Whether the call waits in a queue state rather than being refused (429) by the rate and
        in-flight limits (api.queue_states): a call on an existing model, whose seq_id holds its
        place in the model's order and whose client polls its future."""
        return isinstance(self.slot, SeqSlot) and self.new_model is None and self.check_quota

    @property
    def tokens(self) -> int:
        """What the call takes from its tenant's tokens-per-minute bucket."""
        return self.item.n_tokens if self.rate_tokens is None else self.rate_tokens


async def usable_model(conn: AsyncConnection[DictRow], who: Principal, model_id: str, *, seq_id: int | None = None) -> dict:
    """The caller's model, if requests may still be queued on it (else 404 / 400); with `seq_id`,
    the row also names the request already holding that seq_id, and carries admission's own reads
    (tenancy.scoped.get_model). So the call's next wait is its insert."""
    return usable(await scoped.get_model(conn, who, model_id, seq_id=seq_id, admission=True))


def usable(model: dict) -> dict:
    """`model` (a training model's row), unless no request may be queued on it any more (400)."""
    refusal = rule.model_refusal(model["id"], model["status"])
    if refusal is not None:
        raise refusal
    return model


def facts(who: Principal, ticket: Ticket) -> rule.Facts:
    """What admission judges of `ticket`, from what the call has read so far."""
    item, slot = ticket.item, ticket.slot
    seq = slot if isinstance(slot, SeqSlot) else None
    holder = rule.Holder(seq.holder_id, seq.holder_kind, seq.holder_status) if seq and seq.holder_id else None
    quota = seq.quota if seq and seq.quota is not None else (None, None, None)
    return rule.Facts(
        who, ticket.row_kind or str(item.kind), tokens=ticket.tokens, billable=ticket.billable,
        stores=ticket.stores, check_quota=ticket.check_quota,
        known_wait_s=rate_limit.SHORTFALLS.certain_wait(who, ticket.tokens),
        model_id=item.model_id or None, seq_id=seq.seq_id if seq else None,
        model_status=seq.model_status if seq else None, holder=holder, new_model=ticket.new_model is not None,
        inflight=quota[0], budgeted=quota[1], paused=quota[2], waits=ticket.waits,
        max_paused=get_api_settings().max_paused_requests)


async def _judge(conn: AsyncConnection[DictRow], who: Principal, f: rule.Facts) -> rule.Admit | rule.Resume | rule.Pause:
    """`rule.decide`, reading what it asks for until it decides; a refusal is raised."""
    while True:
        decision = rule.decide(f)
        if isinstance(decision, rule.Refuse):
            raise decision.error
        if not isinstance(decision, rule.Read):
            return decision
        if decision.what == "live_models":
            f = replace(f, live_models=await scoped.count_live_models(conn, who))
        elif decision.what == "stored_bytes":
            f = replace(f, stored_bytes=await scoped.checkpoint_bytes(conn, who))
        elif decision.what == "quota":
            inflight, budgeted, paused = await scoped.inflight_and_budgeted(conn, who)
            f = replace(f, inflight=inflight, budgeted=budgeted, paused=paused)
        else:
            states, month = await budgets.budget_states(conn, who.tenant_id, who.key_id)
            f = replace(f, budgets=tuple(states), month=month)


async def admit_call(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, item: WorkItem) -> str:
    """Admit `item`, a call on an existing model (`item.model_id`, `item.seq_id`; see the module
    docstring): one statement reads the model and writes the call's row when nothing in the model's
    row can refuse it, else `admit` judges that row. Returns the request id, as `admit`."""
    ticket = Ticket(item, "", SeqSlot(item.model_id, item.seq_id))
    call = facts(who, ticket)
    model = await records.insert_call(  # its in-flight count and its insert, under the quota lock
        conn, who, item.request_id, model_id=item.model_id, seq_id=item.seq_id, kind=str(item.kind),
        n_tokens=item.n_tokens, billable=call.billable, unusable=list(rule.UNUSABLE),
        admissible=rule.fast_admissible(call))
    ticket = Ticket(item, model["base_model"], SeqSlot.of(model, item.seq_id))
    if not model["inserted"]:
        return await admit(conn, redis, who, ticket)
    await conn.commit()  # nothing to send on an autocommit connection
    faults.crash_point("api.after_commit")
    return await _append(conn, redis, who, ticket, item)


async def admit(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, ticket: Ticket) -> str:
    """Admit one call (see the module docstring); returns its request id, or the id of the request
    a retry of the same call already made. Commits `conn`."""
    item, slot = ticket.item, ticket.slot
    call = facts(who, ticket)
    took_slot = False  # only a slot this call took is given back when it fails
    if isinstance(slot, RedisSlot):
        took_slot = bool(await redis.set(slot.key, item.request_id, nx=True, ex=slot.ttl_s))
        existing = None if took_slot else await redis.get(slot.key)
        if existing:
            status = await records.request_status(conn, existing.decode())
            if status is not None:
                call = replace(call, holder=rule.Holder(existing.decode(), None, status))
            else:
                # The call that took the slot has not recorded its request: it died before its commit,
                # or is still on its way. Admit this one under that id; the row and the entry are each
                # written once whichever of the two gets there first.
                item = replace(item, request_id=existing.decode())
    try:
        # The quota reads and the insert they allow, under the tenant's quota lock: a burst of calls
        # cannot all see the last free place (a placeholder, held to no quota, takes no lock).
        async with records.quota_lock(conn, who.tenant_id) if call.check_quota else contextlib.nullcontext():
            decision = await _judge(conn, who, call)
            if isinstance(decision, rule.Resume):
                return await _resume(conn, redis, who, ticket, decision.request_id, decision.status)
            paused = None
            if isinstance(decision, rule.Pause):  # its item is kept before its row can be promoted
                await park(redis, item)
                paused = (decision.queue_state, decision.reason)
            if ticket.new_model is not None:
                shard = await _new_model_shard(conn, redis, ticket)
                if shard is not None:
                    ticket = replace(ticket, slot=replace(slot, shard=shard))
                await records.insert_training_model(conn, who, item.model_id, ticket.new_model, shard)
            inserted = await records.insert_request(
                conn, who, item.request_id, model_id=item.model_id or None,
                seq_id=item.seq_id if isinstance(slot, SeqSlot) else None, kind=call.kind, n_tokens=item.n_tokens,
                touch_model=isinstance(slot, SeqSlot) and ticket.new_model is None, paused=paused)
            if not inserted:  # a concurrent duplicate won the insert
                await conn.rollback()
                if isinstance(slot, SeqSlot):
                    holder_id, holder_kind = await records.seq_holder(conn, slot.model_id, slot.seq_id)
                    if holder_id is None:
                        return item.request_id
                    decision = await _judge(conn, who, replace(call, holder=rule.Holder(holder_id, holder_kind)))
                    return decision.request_id
                return await _resume(conn, redis, who, replace(ticket, item=item), item.request_id, "queued")
            await conn.commit()
            if paused is not None:
                return item.request_id
        faults.crash_point("api.after_commit")
    except BaseException:
        if took_slot:
            await redis.delete(slot.key)
        raise
    return await _append(conn, redis, who, ticket, item)


async def _resume(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, ticket: Ticket, request_id: str,
                  status: str | None) -> str:
    """A retried call: its request `request_id` exists. While that is still queued its entry is
    appended, unless it already was (`queue.enqueue` appends once per request id)."""
    if status == "queued":
        return await _append(conn, redis, who, ticket, replace(ticket.item, request_id=request_id))
    return request_id


async def _append(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, ticket: Ticket, item: WorkItem) -> str:
    """Append the entry of `item`, whose row is committed, taking its tokens per minute in the same
    step; when the bucket cannot hold them yet, delete the row (freeing its slot) and answer 429.
    A call that `waits` instead waits in a queue state (its base at capacity, or the bucket short)."""
    if ticket.waits:
        queued = await trainer_queued(redis, ticket.base_model, _shard(ticket))
        if rule.at_capacity(queued, get_api_settings().capacity_queue_depth):
            await pause(conn, redis, item, rule.capacity_pause(queued or 0))
            return item.request_id
    try:
        wait_s = await append(conn, redis, who, ticket, item)
    except queue.ResultBytesFull:  # the tenant's stored results are past their bound (core.result_bytes)
        await _unadmit(conn, redis, ticket, item)
        raise
    if wait_s is None:
        return item.request_id
    rate_limit.SHORTFALLS.refused(who, ticket.tokens, wait_s)
    if ticket.waits:
        await pause(conn, redis, item, rule.Pause(rule.RATE, rule.rate_reason(who, ticket.tokens, wait_s)), wait_s)
        return item.request_id
    await _unadmit(conn, redis, ticket, item)
    raise rule.rate_refusal(who, ticket.tokens, wait_s)


async def append(conn: AsyncConnection[DictRow], redis: Redis, who: Principal, ticket: Ticket, item: WorkItem) -> float | None:
    """`queue.enqueue` of `item` to its stream with its tokens taken from its tenant's bucket: None
    once the entry is in the stream, else the seconds until the bucket holds them (a call that
    `waits` leaves no refusal marker, so it may be appended later). ResultBytesFull when the
    tenant's stored results are past their bound: nothing is appended."""
    bucket = rate_limit.bucket(who, ticket.tokens) if ticket.check_quota else None
    try:
        return await queue.enqueue(redis, ticket.base_model, item, get_api_settings().future_ttl_seconds,
                                   await _stream(conn, redis, ticket, item), bucket, mark_refusal=not ticket.waits)
    except queue.ResultBytesFull:
        raise
    except Exception:
        log.exception("could not enqueue %s; it stays queued for the client's retry", item.request_id)
        raise


def parked_key(request_id: str) -> str:
    """Where a paused call's work item waits (a hash of its fields)."""
    return f"quilt:paused:{request_id}"


async def park(redis: Redis, item: WorkItem) -> None:
    """Keep `item` until its paused call is appended or fails (api.queue_states), for a while past
    the longest a call may wait."""
    key = parked_key(item.request_id)
    api = get_api_settings()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping=item.to_fields())
        pipe.expire(key, int(api.queue_wait_deadline_s) + api.future_ttl_seconds)
        await pipe.execute()


async def pause(conn: AsyncConnection[DictRow], redis: Redis, item: WorkItem, why: rule.Pause, wait_s: float = 0.0) -> None:
    """Set the queued call `item`, whose entry was not appended, waiting in a queue state. Should a
    retry of the same call have appended it meanwhile (its marker says so), it is queued again at
    once: a paused row's entry would never be run."""
    await park(redis, item)
    await records.pause(conn, item.request_id, why.queue_state, why.reason, wait_s)
    await conn.commit()
    if queue.was_appended(await redis.get(queue.enqueued_key(item.request_id))):
        await records.unpause(conn, item.request_id)
        await conn.commit()


def _shard(ticket: Ticket) -> str | None:
    return ticket.slot.shard if isinstance(ticket.slot, SeqSlot) else None


_QUEUED_SEEN: dict[str, tuple[float, int | None]] = {}  # beacon key -> (monotonic expiry, its `queued`)


async def trainer_queued(redis: Redis, base_model: str, shard: str | None) -> int | None:
    """How many requests the trainer of `base_model` (its shard `shard`) holds queued, as its beacon
    said within the last second (None: no beacon). Read at most once a second per process."""
    key = health.model_trainer_key(base_model, shard, get_core_settings().trainer_shards)
    now = time.monotonic()
    seen = _QUEUED_SEEN.get(key)
    if seen is None or seen[0] < now:
        raw = await redis.get(key)
        queued = json.loads(raw).get("queued") if raw else None
        seen = (now + 1.0, queued if isinstance(queued, int) else None)
        _QUEUED_SEEN[key] = seen
    return seen[1]


async def _unadmit(conn: AsyncConnection[DictRow], redis: Redis, ticket: Ticket, item: WorkItem) -> None:
    """Undo the admission of a call whose entry was refused: its row goes (freeing its seq_id) and
    its sampling slot too, so the client's retry is admitted afresh."""
    await records.delete_refused(conn, item.request_id)
    await conn.commit()
    if isinstance(ticket.slot, RedisSlot) and await redis.get(ticket.slot.key) == item.request_id.encode():
        await redis.delete(ticket.slot.key)


async def _stream(conn: AsyncConnection[DictRow], redis: Redis, ticket: Ticket, item: WorkItem) -> str | None:
    """Where an item goes when it is not the default stream of its kind: a sample group to its
    generation replica, a training call to its model's trainer shard (as the model's row read for
    this call said; read here only for a model placed before shards, which is placed now)."""
    base_model = ticket.base_model
    if item.kind is WorkKind.SAMPLE:
        return await _replica_stream(redis, base_model, item)
    shards = get_core_settings().trainer_shards
    if shards <= 1 or not item.model_id:
        return None
    known = ticket.slot.shard if isinstance(ticket.slot, SeqSlot) else None
    return queue.train_stream(base_model, known or await records.model_shard(
        conn, item.model_id, lambda: _place(conn, redis, base_model, item.model_id)))


async def _new_model_shard(conn: AsyncConnection[DictRow], redis: Redis, ticket: Ticket) -> str | None:
    """The trainer shard a new model is placed on (with QUILT_TRAINER_SHARDS above 1)."""
    if get_core_settings().trainer_shards <= 1:
        return None
    return await _place(conn, redis, ticket.base_model, ticket.item.model_id)


async def _place(conn: AsyncConnection[DictRow], redis: Redis, base_model: str, model_id: str) -> str:
    """The least loaded open shard (scaleout.placement); while none is (all restarting or draining),
    one fixed by the model id, whose calls wait in its stream for it, or are moved on."""
    shards = get_core_settings().trainer_shards
    chosen = placement.place(await placement.read_views_async(conn, redis, base_model, shards))
    return chosen or queue.shard_names(shards)[stable_hash(model_id) % shards]


@functools.cache
def _router() -> Router | None:
    core = get_core_settings()
    return Router(core.gen_replicas, core.gen_routing) if core.gen_replicas > 1 else None


async def _replica_stream(redis: Redis, base_model: str, item: WorkItem) -> str | None:
    """With several generation replicas, the one a sample group goes to (gen_pool.router)."""
    router = _router()
    if router is None or item.kind is not WorkKind.SAMPLE:
        return None
    return await router.stream_for(redis, base_model, item)


def future_response(request_id: str, model_id: str | None) -> dict:
    out = {"request_id": request_id}
    if model_id:
        out["model_id"] = model_id
    return out
