"""Admission's refusals, written once: one pure function from plain data to a decision.

`decide(facts)` judges, in this order, and the first that applies wins:

1. the model's state: a model that failed to be created or was lost takes no call (400);
2. the seq_id's holder: a retry of the same call resumes its request; a holder of another kind is
   a client bug (400, not 409: the tinker SDK retries 409 for minutes);
3. for calls that hold new work (`check_quota`), what refuses whatever the database holds: a
   suspended tenant (billable calls only: 402 for payment, 403 by an operator), tokens its
   tokens-per-minute bucket can never hold (400: split the call), tokens this process knows the
   bucket cannot hold yet (429, tenancy.rate_limit.Shortfalls);
4. the live-models quota (a new model, 403), the checkpoint-bytes quota (a save, 403) and the
   in-flight quota (429);
5. the monthly budgets (billable calls, 402, billing.budgets).

A call that `waits` (a training call on an existing model: its client polls a future, and its
seq_id holds its place in the model's order) is not refused by the rate and in-flight limits nor
by a base at capacity: it is admitted as `Pause(queue_state, reason)`, and api.queue_states runs
it once it can (`promotable` below). It also waits while earlier calls of its tenant wait, so a
tenant's paused calls run in the order they came. Past `max_paused` waiting calls it is refused
(429) as before. Every final refusal (3-5) is judged first: a call that will never run never waits.

A fact not read yet (None) that a rule needs comes back as `Read(what)`: the caller reads it and
asks again, so a call reads only what can refuse it. `api.admission` does the reads and the
writes; `api.records.insert_call`'s SQL is the atomic guard of the common case, and inserts a
call's row exactly when `decide` on the row it reads says `Admit` (tests/test_admission_rule.py
runs both over one table).
"""

from __future__ import annotations

from dataclasses import dataclass

from billing import budgets
from billing.budgets import BudgetState
from core.errors import Forbidden, InvalidInput, QuiltError, QuotaExceeded
from tenancy import accounts
from tenancy.auth import Principal

# Model statuses that take no call, and why.
UNUSABLE = {"failed": "failed to be created",
            "lost": "was lost when its trainer restarted; load a checkpoint into a new model",
            "copy": "holds copied weights (copy_weights) and takes no training call; load its checkpoint into a "
                    "new model (create_training_client_from_state) to train on it"}


@dataclass(frozen=True)
class Holder:
    """The request already holding a call's identity: its id, its kind (None: not checked, a
    sampling call's Redis slot) and its status (None: not recorded yet)."""

    request_id: str
    kind: str | None = None
    status: str | None = None


@dataclass(frozen=True)
class Facts:
    """Everything admission judges, as plain data. None: not read (yet)."""

    who: Principal
    kind: str  # the request row's kind
    tokens: int = 0  # what the call takes from the tokens-per-minute bucket
    billable: bool = False  # meters tokens or creates a model: budgets and suspensions apply
    stores: bool = False  # saves a checkpoint: suspensions apply (budgets do not: paid-for work may be kept)
    check_quota: bool = True  # False for placeholders of refused calls: they hold no new work
    known_wait_s: float | None = None  # a wait this process already knows the bucket needs
    model_id: str | None = None
    seq_id: int | None = None
    model_status: str | None = None  # None: no existing model is involved (a new one, sampling)
    holder: Holder | None = None
    new_model: bool = False
    live_models: int | None = None  # the tenant's live models (read for a new model)
    stored_bytes: int | None = None  # the bytes of the tenant's live checkpoints (read for a save)
    inflight: int | None = None  # the tenant's requests in flight
    budgeted: bool | None = None  # whether a monthly budget bounds the tenant or the key
    budgets: tuple[BudgetState, ...] | None = None  # their states, read when `budgeted`
    month: str = ""  # the budgets' month label ('2026-07')
    waits: bool = False  # over a limit, wait in a queue state instead of a 429 (see the module docstring)
    paused: int | None = None  # the tenant's calls waiting in a queue state (read with `inflight`)
    max_paused: int = 1000  # how many may wait at once (QUILT_MAX_PAUSED_REQUESTS)


@dataclass(frozen=True)
class Admit:
    """Write the call's row and append its entry."""


@dataclass(frozen=True)
class Resume:
    """A retry: the request `request_id` (in `status`) already holds the call's identity."""

    request_id: str
    status: str | None


@dataclass(frozen=True)
class Pause:
    """Write the call's row as paused in `queue_state` ('paused_rate_limit' or 'paused_capacity'),
    saying why in `reason`; its entry is appended when api.queue_states promotes it."""

    queue_state: str
    reason: str


@dataclass(frozen=True)
class Refuse:
    error: QuiltError


@dataclass(frozen=True)
class Read:
    """A fact a rule needs is not read yet: 'live_models', 'stored_bytes', 'quota' (inflight and
    budgeted) or 'budgets'."""

    what: str


Decision = Admit | Resume | Pause | Refuse | Read

RATE = "paused_rate_limit"
CAPACITY = "paused_capacity"


def decide(f: Facts) -> Decision:
    """The decision on one call (see the module docstring)."""
    refusal = model_refusal(f.model_id, f.model_status)
    if refusal is not None:
        return Refuse(refusal)
    if f.holder is not None:
        if f.holder.kind is not None and f.holder.kind != f.kind:
            # 400, not 409: the tinker SDK retries 409 for minutes, and this is a client bug, not a race.
            return Refuse(InvalidInput(f"seq_id {f.seq_id} of model {f.model_id!r} was already used by a "
                                       f"{f.holder.kind} request", field="seq_id"))
        return Resume(f.holder.request_id, f.holder.status)
    if not f.check_quota:
        # A placeholder (api.seq_gaps) holds no new work, yet must not overtake a paused call of its
        # model: a trainer gives up on a seq_id missing ahead of one it holds (QUILT_TRAINER_SEQ_GAP_DEADLINE_S).
        return Pause(RATE, f"{f.paused} earlier calls of yours wait ahead of this one") if f.paused else Admit()
    refusal = before_reads(f)
    if refusal is not None:
        return Refuse(refusal)
    who = f.who
    if f.new_model:
        if f.live_models is None:
            return Read("live_models")
        if f.live_models >= who.max_models:
            return Refuse(Forbidden(f"{f.live_models} live models reach your limit of {who.max_models}; finish "
                                    "sessions you no longer use or ask an operator to raise max_models",
                                    field="max_models"))
    if f.stores:
        if f.stored_bytes is None:
            return Read("stored_bytes")
        if f.stored_bytes >= who.max_checkpoint_bytes:
            return Refuse(Forbidden(f"your live checkpoints hold {f.stored_bytes:,} bytes, your limit of "
                                    f"{who.max_checkpoint_bytes:,}; delete checkpoints you no longer need (or "
                                    "give them a TTL) or ask an operator to raise max_checkpoint_bytes",
                                    field="max_checkpoint_bytes"))
    if f.inflight is None or f.budgeted is None or (f.waits and f.paused is None):
        return Read("quota")
    if not f.waits and f.inflight >= who.max_inflight_requests:
        return Refuse(QuotaExceeded(f"{f.inflight} requests in flight reach your limit of "
                                    f"{who.max_inflight_requests}; wait for some futures to finish",
                                    field="max_inflight_requests"))
    pause = pause_for(f)
    if pause is not None and (f.paused or 0) >= f.max_paused:
        return Refuse(QuotaExceeded(f"{f.paused} calls of yours already wait in a queue state, the most that may "
                                    f"({pause.reason}); wait for some futures to finish", field="max_paused_requests"))
    if f.billable and f.budgeted:
        if f.budgets is None:
            return Read("budgets")
        spent = budgets.first_exhausted(list(f.budgets))
        if spent is not None:
            return Refuse(budgets.refusal(spent, who.tenant_name, f.month))
    return pause or Admit()


def pause_for(f: Facts) -> Pause | None:
    """Why a call that may otherwise run must wait, if it must: the in-flight limit, a wait the
    tokens-per-minute bucket is known to need, earlier calls of the tenant still waiting, a base at
    capacity. Only a call that `waits` is paused."""
    who = f.who
    if not f.waits:
        return None
    if f.inflight is not None and f.inflight >= who.max_inflight_requests:
        return Pause(RATE, f"{f.inflight} requests in flight reach your limit of {who.max_inflight_requests} "
                           "(max_inflight_requests)")
    if f.known_wait_s is not None:
        return Pause(RATE, rate_reason(who, f.tokens, f.known_wait_s))
    if f.paused:
        return Pause(RATE, f"{f.paused} earlier calls of yours wait ahead of this one")
    return None


def capacity_pause(queued: int) -> Pause:
    """Why a call waits on a base at capacity: its trainer holds `queued` requests already
    (QUILT_CAPACITY_QUEUE_DEPTH or more). Judged as the call is appended (api.admission)."""
    return Pause(CAPACITY, f"the base model's trainer is at capacity ({queued} requests queued); "
                           "your call runs as the queue drains")


def at_capacity(queued: int | None, depth: int) -> bool:
    """Whether a trainer holding `queued` requests (None: no beacon, so not known) is at capacity
    for the limit `depth` (0: no limit)."""
    return depth > 0 and queued is not None and queued >= depth


def fast_admissible(f: Facts) -> bool:
    """What `records.insert_call`'s SQL may take as judged before it reads the model's row: nothing
    known without the row refuses or pauses the call (the SQL checks the row's part itself)."""
    return before_reads(f) is None and not f.stores and f.known_wait_s is None


@dataclass(frozen=True)
class Waiting:
    """A paused call, as api.queue_states reads it: its model, seq_id, tokens, when it may next
    try the tokens-per-minute bucket (seconds from now; 0: now)."""

    request_id: str
    model_id: str | None
    seq_id: int | None
    tokens: int
    wait_s: float = 0.0
    age_s: float = 0.0  # since the call came
    at_capacity: bool = False  # its base's trainer is at capacity now


def promotable(waiting: list[Waiting], inflight: int, max_inflight: int) -> list[str]:
    """Which of a tenant's paused calls (`waiting`, in the order they came, none expired) are
    appended now, in order: the free places under `max_inflight`, each to the first call in line; a
    call whose bucket wait is not over, or whose base is at capacity, stops the line, so a tenant's
    calls run in the order they came and a model's in seq_id order."""
    out: list[str] = []
    free = max_inflight - inflight
    for w in in_line(waiting):
        if free <= 0 or w.wait_s > 0 or w.at_capacity:
            break
        out.append(w.request_id)
        free -= 1
    return out


def expired(waiting: list[Waiting], deadline_s: float) -> list[str]:
    """The paused calls that have waited `deadline_s` or longer (QUILT_QUEUE_WAIT_DEADLINE_S): they
    fail, each in its seq_id's place."""
    return [w.request_id for w in waiting if w.age_s >= deadline_s]


def in_line(waiting: list[Waiting]) -> list[Waiting]:
    """`waiting` (in the order the calls came) with each model's calls put in seq_id order within
    the places that model holds: concurrent HTTP calls may record a model's later seq_id first, and a
    trainer runs a model's calls in seq_id order only."""
    by_model: dict[str | None, list[Waiting]] = {}
    for w in waiting:
        by_model.setdefault(w.model_id, []).append(w)
    ordered = {m: iter(sorted(ws, key=lambda w: w.seq_id or 0)) for m, ws in by_model.items()}
    return [next(ordered[w.model_id]) for w in waiting]


def model_refusal(model_id: str | None, status: str | None) -> QuiltError | None:
    """Rule 1: a model in `status` takes no call."""
    if status in UNUSABLE:
        return InvalidInput(f"model {model_id!r} {UNUSABLE[status]}", field="model_id")
    return None


def before_reads(f: Facts) -> QuiltError | None:
    """What refuses a call whatever the database holds (rule 3): a suspension (billable calls
    only), tokens its bucket can never hold, or tokens this process knows it cannot hold yet."""
    who = f.who
    if f.billable or f.stores:
        refusal = suspension_refusal(who)
        if refusal is not None:
            return refusal
    if f.tokens > who.tokens_per_minute:
        return InvalidInput(f"this call needs {f.tokens} tokens, more than your tokens_per_minute limit of "
                            f"{who.tokens_per_minute} allows at once; split it into smaller calls",
                            field="tokens_per_minute")
    return None if f.known_wait_s is None or f.waits else rate_refusal(who, f.tokens, f.known_wait_s)


def suspension_refusal(who: Principal) -> QuiltError | None:
    """What refuses a suspended tenant's new work and new stored things (sessions, models,
    checkpoints); reads, downloads and deletes are never refused for it."""
    if not who.suspended_kind:
        return None
    return accounts.suspension_refusal(who.suspended_kind, who.suspended_reason or "", who.tenant_name)


def rate_refusal(who: Principal, tokens: int, wait_s: float) -> QuotaExceeded:
    """The 429 of a call whose tokens the bucket cannot hold for `wait_s` more seconds."""
    return QuotaExceeded(f"this call's {tokens} tokens exceed what is left of your tokens_per_minute limit "
                         f"of {who.tokens_per_minute}; retry in {wait_s:.1f} s", field="tokens_per_minute",
                         retry_after_s=wait_s)


def rate_reason(who: Principal, tokens: int, wait_s: float) -> str:
    """Why a call waits for the tokens-per-minute bucket, and for about how long."""
    return (f"this call's {tokens} tokens exceed what is left of your tokens_per_minute limit of "
            f"{who.tokens_per_minute} for about {wait_s:.1f} s more")
