"""Admission: the one path by which work enters a worker's stream.

    async with db.autocommit(pool) as conn:       # the route's one checkout
        model = await usable_model(conn, who, model_id, seq_id=seq_id)   # read once, 404 if not yours
        ... validate the body against the model's base ...
        request_id = await admit(conn, redis, who, Ticket(item, base_model, SeqSlot.of(model, seq_id)))

A call on an existing model, or a sample group, writes one statement (the request row, with the
model's last use in the same statement), so its route hands `admit` an autocommit connection: no
BEGIN and no COMMIT round trip, two of a submission's eight waits (reads see a fresh snapshot per
statement either way, under READ COMMITTED); its in-flight count and budget flag come with the
model's read (`usable_model`), a third; and its tokens-per-minute take is sent beside that read
(`early_rate`), a fourth. A call that writes more rows (a new model with its
first request, a sampler with its publication) hands it a transaction (`pool.connection()`), which
`admit` commits.

`admit` runs, in order: the idempotency rule (a retried call gets the existing future, whose
entry is appended now if it never was: the API may have died between its commit and the append), the
tenant's in-flight quota (429), its suspension (402 or 403, tenancy.accounts) and monthly budgets
(402, billing.budgets; both skipped for calls that meter no tokens), its tokens per minute (429 with Retry-After, tenancy.rate_limit), the request row
(and a new model's row, placed on a trainer shard where there are several: core.placement), a
commit, then the stream entry (a sample group's generation replica's stream, gen_pool.router; a
training call's model's shard's). The row is committed before the entry
exists, so a worker never sees work the database does not know; if Redis refuses the entry (it
went down between the rate check and the append) the row stays queued and the slot held, exactly
as when the API dies between its commit and the append: the call answers 503, and the client's
retry with the same ids (both SDKs retry 503) appends the entry, once. (Marking the row failed
instead made that retry resume a failed request with no result: a 410 for work never run.)

The idempotency rule is a parameter: `SeqSlot` for training calls (unique `(model_id, seq_id)` in
Postgres; the slot's current holder comes with the model read), `RedisSlot` for sampling (the SDK's
sampling sequence ids exceed int32, so a Redis key held for the future's lifetime), or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import TypeVar

from psycopg import AsyncConnection
from redis.asyncio import Redis

from api import records
from billing import budgets
from core import faults, placement, queue
from core.errors import InvalidInput, QuotaExceeded
from core.settings import get_api_settings, get_core_settings
from core.work import WorkItem, WorkKind
from gen_pool.router import Router
from gen_pool.routing import stable_hash
from tenancy import accounts, rate_limit, scoped
from tenancy.auth import Principal

log = logging.getLogger("quilt.api.admission")

T = TypeVar("T")

_UNUSABLE = {"failed": "failed to be created", "lost": "was lost when its trainer restarted; load a checkpoint into a new model"}


@dataclass(frozen=True)
class SeqSlot:
    """A training call's identity: `seq_id` of `model_id`, and the request holding it, if any;
    with it, the trainer shard the model's row named (None: one trainer per base, or not placed)."""

    model_id: str
    seq_id: int
    holder_id: str | None = None
    holder_kind: str | None = None
    holder_status: str | None = None
    shard: str | None = None
    # The tenant's requests in flight and whether a budget bounds it, as read with the model (None:
    # not read with it, so admission reads them itself).
    quota: tuple[int, bool] | None = None

    @classmethod
    def of(cls, model: dict, seq_id: int) -> SeqSlot:
        """From a row of `usable_model(..., seq_id=seq_id)`."""
        return cls(model["id"], seq_id, model.get("seq_holder_id"), model.get("seq_holder_kind"),
                   model.get("seq_holder_status"), model.get("trainer_shard"), (model["inflight"], model["budgeted"]))


@dataclass(frozen=True)
class RedisSlot:
    """A sampling call's identity: a Redis key, held (naming the request) for `ttl_s`."""

    key: str
    ttl_s: int


class EarlyRate:
    """A call's tokens-per-minute take, sent beside its model's read (`usable_model(..., rate=)`)
    so the two are one wait. The take's decision is judged in `admit`, at its usual place after the
    quota and budget; tokens taken by a call that is then refused, or that is a retry of one
    already admitted, go back to the bucket when `early_rate` ends. Made by `early_rate`."""

    def __init__(self, redis: Redis, who: Principal, tokens: int):
        self.redis, self.who, self.tokens = redis, who, tokens
        self.decision: rate_limit.Decision | None = None  # None: not taken early (`_rate` judges the call)
        self.kept = False  # the call's row is committed: the tokens paid for it

    async def beside(self, read: Awaitable[T]) -> T:
        """`read`, with the take in flight meanwhile (when the call's tokens can fit the bucket)."""
        if not 0 < self.tokens <= self.who.tokens_per_minute:
            return await read
        take = asyncio.ensure_future(rate_limit.take(self.redis, self.who.tenant_id,
                                                     per_minute=self.who.tokens_per_minute, cost=self.tokens))
        try:
            return await read
        finally:  # waited for even when the read fails, so what it took is known and given back
            self.decision = await take

    async def give_back(self) -> None:
        if self.decision is None or not self.decision.admitted or self.kept:
            return
        self.decision = None
        try:
            await rate_limit.give_back(self.redis, self.who.tenant_id, per_minute=self.who.tokens_per_minute,
                                       cost=self.tokens)
        except Exception:  # the caller's own answer matters more than the bucket's accuracy
            log.exception("could not give back %d tokens to tenant %s", self.tokens, self.who.tenant_id)


@contextlib.asynccontextmanager
async def early_rate(redis: Redis, who: Principal, tokens: int) -> AsyncIterator[EarlyRate]:
    """A call on a model carrying `tokens` (see `EarlyRate`): pass it to `usable_model` and to the
    call's `Ticket`; unless `admit` committed the call, what was taken goes back on the way out."""
    rate = EarlyRate(redis, who, tokens)
    try:
        yield rate
    finally:
        await rate.give_back()


@dataclass(frozen=True)
class Ticket:
    item: WorkItem
    base_model: str
    slot: SeqSlot | RedisSlot | None
    row_kind: str | None = None  # the request row's kind, when it differs from the item's (a placeholder)
    check_quota: bool = True  # placeholders for refused calls hold no new work: no quota, no budget
    new_model: records.NewModel | None = None
    rate_tokens: int | None = None  # tokens taken from the tokens_per_minute bucket; default item.n_tokens
    rate: EarlyRate | None = None  # the take, if it was sent beside the model's read

    @property
    def billable(self) -> bool:
        """Whether the budget is checked: calls that meter tokens, and new models (a tenant over
        budget may still step and save the work it paid for, but starts nothing new)."""
        return self.item.n_tokens > 0 or self.new_model is not None


async def usable_model(conn: AsyncConnection, who: Principal, model_id: str, *, seq_id: int | None = None,
                       rate: EarlyRate | None = None) -> dict:
    """The caller's model, if requests may still be queued on it (else 404 / 400); with `seq_id`,
    the row also names the request already holding that seq_id, and carries admission's own reads
    (tenancy.scoped.get_model); with `rate`, the call's tokens are taken meanwhile. So the call's
    next wait is its insert."""
    read = scoped.get_model(conn, who, model_id, seq_id=seq_id, admission=True)
    model = await (rate.beside(read) if rate is not None else read)
    if model["status"] in _UNUSABLE:
        raise InvalidInput(f"model {model_id!r} {_UNUSABLE[model['status']]}", field="model_id")
    return model


def _holder(slot: SeqSlot, kind: str, holder_id: str | None, holder_kind: str | None) -> str | None:
    if holder_id is None:
        return None
    if holder_kind != kind:
        # 400, not 409: the tinker SDK retries 409 for minutes, and this is a client bug, not a race.
        raise InvalidInput(f"seq_id {slot.seq_id} of model {slot.model_id!r} was already used by a "
                           f"{holder_kind} request", field="seq_id")
    return holder_id


async def admit(conn: AsyncConnection, redis: Redis, who: Principal, ticket: Ticket) -> str:
    """Admit one call (see the module docstring); returns its request id, or the id of the request
    a retry of the same call already made. Commits `conn`."""
    item, slot = ticket.item, ticket.slot
    row_kind = ticket.row_kind or str(item.kind)
    if isinstance(slot, SeqSlot):
        existing = _holder(slot, row_kind, slot.holder_id, slot.holder_kind)
        if existing:
            return await _resume(conn, redis, ticket, existing, slot.holder_status)
    took_slot = False  # only a slot this call took is given back when it fails
    if isinstance(slot, RedisSlot):
        took_slot = bool(await redis.set(slot.key, item.request_id, nx=True, ex=slot.ttl_s))
        if not took_slot:
            existing = await redis.get(slot.key)
            if existing:
                status = await records.request_status(conn, existing.decode())
                if status is not None:
                    return await _resume(conn, redis, ticket, existing.decode(), status)
                # The call that took the slot has not recorded its request: it died before its commit,
                # or is still on its way. Admit this one under that id; the row and the entry are each
                # written once whichever of the two gets there first.
                item = replace(item, request_id=existing.decode())
    try:
        if ticket.check_quota:
            await _quota_and_budget(conn, who, billable=ticket.billable,
                                    read=slot.quota if isinstance(slot, SeqSlot) else None)
            await _rate(redis, who, item.n_tokens if ticket.rate_tokens is None else ticket.rate_tokens, ticket.rate)
        if ticket.new_model is not None:
            shard = await _new_model_shard(conn, redis, ticket)
            if shard is not None:
                ticket = replace(ticket, slot=replace(slot, shard=shard))
            await records.insert_training_model(conn, who, item.model_id, ticket.new_model, shard)
        inserted = await records.insert_request(
            conn, who, item.request_id, model_id=item.model_id or None,
            seq_id=item.seq_id if isinstance(slot, SeqSlot) else None, kind=row_kind, n_tokens=item.n_tokens,
            touch_model=isinstance(slot, SeqSlot) and ticket.new_model is None)
        if not inserted:  # a concurrent duplicate won the insert
            await conn.rollback()
            if isinstance(slot, SeqSlot):
                holder = await records.seq_holder(conn, slot.model_id, slot.seq_id)
                return _holder(slot, row_kind, *holder) or item.request_id
            return await _resume(conn, redis, replace(ticket, item=item), item.request_id, "queued")
        await conn.commit()
        if ticket.rate is not None:
            ticket.rate.kept = True
        faults.crash_point("api.after_commit")
    except BaseException:
        if took_slot:
            await redis.delete(slot.key)
        raise
    try:
        await queue.enqueue(redis, ticket.base_model, item, get_api_settings().future_ttl_seconds,
                            await _stream(conn, redis, ticket, item))
    except Exception:
        log.exception("could not enqueue %s; it stays queued for the client's retry", item.request_id)
        raise
    return item.request_id


async def _resume(conn: AsyncConnection, redis: Redis, ticket: Ticket, request_id: str, status: str | None) -> str:
    """A retried call: its request `request_id` exists. While that is still queued its entry is
    appended, unless it already was (`queue.enqueue` appends once per request id)."""
    if status == "queued":
        item = replace(ticket.item, request_id=request_id)
        await queue.enqueue(redis, ticket.base_model, item, get_api_settings().future_ttl_seconds,
                            await _stream(conn, redis, ticket, item))
    return request_id


async def _stream(conn: AsyncConnection, redis: Redis, ticket: Ticket, item: WorkItem) -> str | None:
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


async def _new_model_shard(conn: AsyncConnection, redis: Redis, ticket: Ticket) -> str | None:
    """The trainer shard a new model is placed on (with QUILT_TRAINER_SHARDS above 1)."""
    if get_core_settings().trainer_shards <= 1:
        return None
    return await _place(conn, redis, ticket.base_model, ticket.item.model_id)


async def _place(conn: AsyncConnection, redis: Redis, base_model: str, model_id: str) -> str:
    """The least loaded open shard (core.placement); while none is (all restarting or draining),
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


async def _quota_and_budget(conn: AsyncConnection, who: Principal, *, billable: bool,
                            read: tuple[int, bool] | None) -> None:
    """Suspension and budget (billable tickets only), and the in-flight quota; `read`: the in-flight
    count and budget flag already read with the model (else read here)."""
    if billable and who.suspended_kind:
        raise accounts.suspension_refusal(who.suspended_kind, who.suspended_reason or "", who.tenant_name)
    inflight, budgeted = read if read is not None else await scoped.inflight_and_budgeted(conn, who)
    if inflight >= who.max_inflight_requests:
        raise QuotaExceeded(
            f"{inflight} requests in flight reach your limit of {who.max_inflight_requests}; "
            "wait for some futures to finish",
            field="max_inflight_requests",
        )
    if billable and budgeted:
        await budgets.check(conn, tenant_id=who.tenant_id, tenant_name=who.tenant_name, key_id=who.key_id)


async def _rate(redis: Redis, who: Principal, tokens: int, early: EarlyRate | None = None) -> None:
    """The tenant's tokens-per-minute bucket (tenancy.rate_limit): 429 with the wait, or take them
    (or judge the take `early` already made of these tokens)."""
    if tokens <= 0:
        return
    limit = who.tokens_per_minute
    if tokens > limit:  # can never fit the bucket: a 400, not a 429 a client would retry in vain
        raise InvalidInput(f"this call needs {tokens} tokens, more than your tokens_per_minute limit of {limit} "
                           "allows at once; split it into smaller calls", field="tokens_per_minute")
    if early is not None and early.decision is not None and early.tokens == tokens:
        decision = early.decision
    else:
        if early is not None:  # taken early for another count: that take is not this call's
            await early.give_back()
        decision = await rate_limit.take(redis, who.tenant_id, per_minute=limit, cost=tokens)
    if not decision.admitted:
        raise QuotaExceeded(f"this call's {tokens} tokens exceed what is left of your tokens_per_minute limit "
                            f"of {limit}; retry in {decision.retry_after_s:.1f} s", field="tokens_per_minute",
                            retry_after_s=decision.retry_after_s)


def future_response(request_id: str, model_id: str | None) -> dict:
    out = {"request_id": request_id}
    if model_id:
        out["model_id"] = model_id
    return out
