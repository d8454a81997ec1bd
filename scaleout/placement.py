"""Which trainer shard holds a training model (QUILT_TRAINER_SHARDS above 1): the policy, as pure
functions over plain data, and the reads it needs.

    place(views)            the shard for a new model: the least loaded live shard not draining
    spread(models, views)   shards for several models at once (a dead or draining shard's), each
                            counted into the views before the next is placed, so they spread out

A shard's load is its share of the base's placed models (each holds an adapter and its AdamW
state, resident or parked) plus its share of the tokens its passes ran lately (what it computes):
two terms of the same scale, so neither a shard full of idle models nor one with a few busy ones
looks empty. Ties go to the lower shard name, so the choice is reproducible.

The placement itself lives in Postgres (training_models.trainer_shard, trainer_shards.draining);
liveness and recent tokens come from the shards' heartbeats in Redis (core.health).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from core import db, health, queue, records

# Statuses of a model that a shard holds (or is about to): counted as load, moved with the shard.
LIVE_STATUSES = ("creating", "ready", "recovering")


@dataclass(frozen=True)
class ShardView:
    name: str
    alive: bool = True
    draining: bool = False
    models: int = 0
    recent_tokens: float = 0.0

    @property
    def open(self) -> bool:
        """Whether new models may be placed here."""
        return self.alive and not self.draining


def _score(view: ShardView, total_models: int, total_tokens: float) -> float:
    return view.models / max(total_models, 1) + view.recent_tokens / max(total_tokens, 1.0)


def place(views: Sequence[ShardView]) -> str | None:
    """The shard for a new model, or None when no shard is open (all dead or draining)."""
    candidates = [v for v in views if v.open]
    if not candidates:
        return None
    total_models = sum(v.models for v in candidates)
    total_tokens = sum(v.recent_tokens for v in candidates)
    return min(candidates, key=lambda v: (_score(v, total_models, total_tokens), v.name)).name


def spread(models: Iterable[str], views: Sequence[ShardView]) -> dict[str, str]:
    """A shard for each model (those of a shard that died or is draining); {} when none is open."""
    views = list(views)
    out: dict[str, str] = {}
    for model_id in models:
        name = place(views)
        if name is None:
            return {}
        out[model_id] = name
        views = [dataclasses.replace(v, models=v.models + 1) if v.name == name else v for v in views]
    return out


def views_of(names: Sequence[str], counts: dict[str, int], draining: set[str],
             beacons: Sequence[bytes | str | None]) -> list[ShardView]:
    """Views from what Postgres says (models placed per shard, draining shards) and each shard's
    heartbeat (absent: not alive)."""
    out = []
    for name, raw in zip(names, beacons, strict=True):
        beacon = json.loads(raw) if raw else None
        out.append(ShardView(name, alive=beacon is not None, draining=name in draining,
                             models=counts.get(name, 0),
                             recent_tokens=float((beacon or {}).get("recent_tokens", 0.0))))
    return out


_COUNTS = ("SELECT trainer_shard, count(*) AS n FROM training_models WHERE base_model = %s "
           "AND trainer_shard IS NOT NULL AND status = ANY(%s) GROUP BY trainer_shard")
_DRAINING = "SELECT shard FROM trainer_shards WHERE base_model = %s AND draining"


def beacon_keys(base_model: str, shards: int) -> list[str]:
    return [health.trainer_key(base_model, name) for name in queue.shard_names(shards)]


def read_views(conn, redis, base_model: str, shards: int) -> list[ShardView]:
    """The shards of a base as they are now (synchronous clients: workers, the CLI)."""
    counts = {r["trainer_shard"]: r["n"] for r in conn.execute(_COUNTS, (base_model, list(LIVE_STATUSES)))}
    draining = {r["shard"] for r in conn.execute(_DRAINING, (base_model,))}
    return views_of(queue.shard_names(shards), counts, draining, redis.mget(beacon_keys(base_model, shards)))


async def read_views_async(conn, redis, base_model: str, shards: int) -> list[ShardView]:
    """The same, for the API."""
    counts = {r["trainer_shard"]: r["n"] for r in await (await conn.execute(
        _COUNTS, (base_model, list(LIVE_STATUSES)))).fetchall()}
    draining = {r["shard"] for r in await (await conn.execute(_DRAINING, (base_model,))).fetchall()}
    beacons = await redis.mget(beacon_keys(base_model, shards))
    return views_of(queue.shard_names(shards), counts, draining, beacons)


def lock_key(base_model: str) -> str:
    """The advisory lock (pg_advisory_xact_lock(hashtext(...))) that every change of a base's
    placement holds: re-placing a dead shard's models, a shard's start reading its own, a drain."""
    return f"quilt:placement:{base_model}"


def fence_key(base_model: str, shard: str) -> str:
    """Set when a shard's models were re-placed while it was silent: should it wake (a frozen
    process, a partitioned node), it must not go on with models now held elsewhere, so it restarts
    (batcher.shards), and its start restores only what is still placed on it."""
    return f"quilt:trainer:fenced:{base_model}@{shard}"


def _locked(conn, base_model: str) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (lock_key(base_model),))


def claim_own(conn, base_model: str, shard: str | None) -> list[str]:
    """At a trainer's start: the live models it holds (those placed on `shard`; every one of the
    base without shards), now 'recovering' (core.records.mark_models_recovering). A shard claims
    under the placement lock, so a peer re-placing them as it comes back either finishes first
    (and they are not returned) or sees the shard alive."""
    if shard is None:
        return records.mark_models_recovering(conn, base_model)
    with conn.transaction():
        _locked(conn, base_model)
        return records.mark_models_recovering(conn, base_model, shard=shard)


def replace_dead(conn, redis, base_model: str, dead: str, shards: int, still_dead) -> dict[str, str]:
    """Re-place the live models of shard `dead` on the open shards (`spread`) and fence it;
    returns model -> new shard ({} when `still_dead()`, asked under the lock, says it is back, or
    no shard is open). The new shard restores each from its snapshot when its entries arrive."""
    # First, as a frozen shard may hold this very placement lock too (a shard restarting at this
    # instant just restarts again).
    db.end_sessions(conn, db.session_name("trainer", dead, base_model))
    with conn.transaction():
        _locked(conn, base_model)
        if not still_dead():
            return {}
        models = [r["id"] for r in conn.execute(
            "SELECT id FROM training_models WHERE base_model = %s AND trainer_shard = %s AND status = ANY(%s) "
            "ORDER BY created_at", (base_model, dead, list(LIVE_STATUSES)))]
        views = [v if v.name != dead else dataclasses.replace(v, alive=False)
                 for v in read_views(conn, redis, base_model, shards)]
        moves = spread(models, views)
        _move_rows(conn, moves, f"re-placed from {dead}, which stopped")
        if moves:
            redis.set(fence_key(base_model, dead), b"1")
    return moves


def move_off(conn, redis, base_model: str, shard: str, models: list[str], shards: int) -> dict[str, str]:
    """Re-place `models` of a draining shard on the open others; {} when none is open."""
    with conn.transaction():
        _locked(conn, base_model)
        views = [v if v.name != shard else dataclasses.replace(v, draining=True)
                 for v in read_views(conn, redis, base_model, shards)]
        moves = spread(models, views)
        _move_rows(conn, moves, f"moved off {shard}, which is draining")
    return moves


def _move_rows(conn, moves: dict[str, str], why: str) -> None:
    for model_id, shard in moves.items():
        # 'creating' stays: its create request moves with the rest and makes it ready.
        conn.execute("UPDATE training_models SET trainer_shard = %s, status = CASE WHEN status = 'creating' "
                     "THEN status ELSE 'recovering' END, status_detail = %s WHERE id = %s",
                     (shard, why, model_id))


def owners(conn, model_ids: list[str]) -> dict[str, tuple[str | None, str]]:
    """model -> (its shard or None, its status), for the models that exist."""
    rows = conn.execute("SELECT id, trainer_shard, status FROM training_models WHERE id = ANY(%s)", (model_ids,))
    return {r["id"]: (r["trainer_shard"], r["status"]) for r in rows}


def place_unplaced(conn, redis, base_model: str, model_id: str, shards: int) -> str:
    """Place a model that has no shard yet (made before there were shards); returns its shard."""
    with conn.transaction():
        _locked(conn, base_model)
        chosen = place(read_views(conn, redis, base_model, shards)) or queue.shard_names(shards)[0]
        row = conn.execute("UPDATE training_models SET trainer_shard = COALESCE(trainer_shard, %s) WHERE id = %s "
                           "RETURNING trainer_shard", (chosen, model_id)).fetchone()
    return row["trainer_shard"] if row else chosen


def set_draining(conn, base_model: str, shard: str, draining: bool) -> None:
    conn.execute("INSERT INTO trainer_shards (base_model, shard, draining) VALUES (%s, %s, %s) "
                 "ON CONFLICT (base_model, shard) DO UPDATE SET draining = EXCLUDED.draining, changed_at = now()",
                 (base_model, shard, draining))


def is_draining(conn, base_model: str, shard: str) -> bool:
    row = conn.execute("SELECT draining FROM trainer_shards WHERE base_model = %s AND shard = %s",
                       (base_model, shard)).fetchone()
    return bool(row and row["draining"])


def stray_shards(conn, base_model: str, shards: int) -> list[str]:
    """Shards that hold live models but are no longer among the base's `shards` (their count was
    lowered; with 1, every shard): they are treated as dead, so their models move to the shards
    that run (or the one trainer)."""
    names = queue.shard_names(shards) if shards > 1 else []
    return [r["trainer_shard"] for r in conn.execute(
        "SELECT DISTINCT trainer_shard FROM training_models WHERE base_model = %s AND trainer_shard IS NOT NULL "
        "AND status = ANY(%s) AND NOT (trainer_shard = ANY(%s)) ORDER BY 1",
        (base_model, list(LIVE_STATUSES), names))]


def recovering_on(conn, base_model: str, shard: str) -> list[str]:
    """Models placed on `shard` that are being restored there (moved onto it, or at its start)."""
    return [r["id"] for r in conn.execute(
        "SELECT id FROM training_models WHERE base_model = %s AND trainer_shard = %s AND status = 'recovering'",
        (base_model, shard))]


def models_on(conn, base_model: str, shard: str) -> list[str]:
    return [r["id"] for r in conn.execute(
        "SELECT id FROM training_models WHERE base_model = %s AND trainer_shard = %s AND status = ANY(%s)",
        (base_model, shard, list(LIVE_STATUSES)))]


def last_answered_seq(conn, model_id: str) -> int | None:
    """The highest seq_id of a model whose request has its answer: a restored model is recovering
    until its replay passes it."""
    row = conn.execute("SELECT max(seq_id) AS s FROM requests WHERE model_id = %s AND status IN ('done', 'failed')",
                       (model_id,)).fetchone()
    return row["s"] if row else None
