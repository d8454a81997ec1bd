"""The operator's view of the pool's health, assembled from what the workers already publish.

Sources (nothing new is written for this page):
- Redis: the work streams (queue depth: entries are deleted when acknowledged, so a stream's length
  is its unfinished work), the trainer's and generation workers' beacons, and the trainer's recent
  fused-round records (`quilt:stats:trainer:<base>:rounds`);
- Postgres: the usage ledger (token rates, each tenant's share), sampling request rows (time from
  submission to a finished group: the time a tenant waits for a trainable batch) and the trainer's
  per-request `run_metrics` rows (data staleness), and the rows quilt.rl posts per step (the share
  of rollout and trainer time spent waiting on environments).

The shaping is done by pure functions over plain rows (`*_series`, `histogram`, `shares`), tested
without services; `snapshot` only fetches.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict

from redis.asyncio import Redis

from bases import catalog
from core import health, queue
from core.settings import get_core_settings, get_scaler_settings
from scaleout import capacity_plan, in_service

ROUNDS_READ = 1000  # newest round records read per trainer (the worker keeps QUILT_TRAINER_STATS_HISTORY)
FUSED_ROUNDS_SHOWN = 200
STALENESS_BUCKETS = 8  # 0..7 policy versions behind, then "8+"
MAX_TENANTS_SHOWN = 12


def bin_edges(now: float, window_s: float, bin_s: float) -> list[float]:
    """Start times of the bins covering the last `window_s` seconds, aligned to `bin_s`."""
    last = math.floor(now / bin_s) * bin_s
    n = max(1, int(window_s // bin_s))
    return [last - (n - 1 - i) * bin_s for i in range(n)]


def trainer_series(rounds: list[dict], *, now: float, window_s: float, bin_s: float, complete: bool,
                   workers: int = 1) -> dict:
    """Per time bin: the trainer's busy fraction (seconds computing / bin length) and waiting
    fraction (the rest), from round records (`at` = when the round ended, `compute_s`). A round
    computed during [at - compute_s, at], spread over the bins it overlaps; rounds run one after
    another, so their seconds add up. `complete` False means older records were trimmed: bins that
    end before the oldest record are unknown (None), not idle. With `workers` trainer shards writing
    records side by side, the fraction is their mean."""
    edges = bin_edges(now, window_s, bin_s)
    busy = [0.0] * len(edges)
    oldest = min((r["at"] - r.get("compute_s", 0.0) for r in rounds), default=now)
    for r in rounds:
        end = float(r["at"])
        start = end - float(r.get("compute_s", 0.0))
        first = max(0, int((start - edges[0]) // bin_s))
        last = min(len(edges) - 1, int((end - edges[0]) // bin_s))
        for i in range(first, last + 1):
            busy[i] += max(0.0, min(end, edges[i] + bin_s) - max(start, edges[i]))
    busy_f: list[float | None] = []
    for start, b in zip(edges, busy):
        known = complete or start + bin_s > oldest
        busy_f.append(round(min(1.0, b / (bin_s * workers)), 4) if known else None)
    return {"t": edges, "busy": busy_f, "waiting": [None if b is None else round(1.0 - b, 4) for b in busy_f]}


def fused_rounds(rounds: list[dict], *, since: float) -> dict:
    """The recent rounds that ran a fused pass, oldest first: tenants and models in the pass,
    model-input tokens and the padding fraction; plus their means."""
    fused = sorted((r for r in rounds if r.get("tokens", 0) > 0 and r["at"] >= since), key=lambda r: r["at"])
    fused = fused[-FUSED_ROUNDS_SHOWN:]
    cols = {k: [r.get(k, 0) for r in fused] for k in ("tenants", "models", "tokens", "padding_fraction")}
    means = {k: (round(sum(v) / len(v), 4) if v else None) for k, v in cols.items()}
    return {"t": [r["at"] for r in fused], **cols, "mean": means, "rounds": len(fused)}


def rate_series(rows: list[dict], *, now: float, window_s: float, bin_s: float) -> dict:
    """Tokens per second per bin from ledger rows `{"t": bin start, "sample", "train"}`: what the
    generation pool produced against what the trainer consumed."""
    edges = bin_edges(now, window_s, bin_s)
    index = {t: i for i, t in enumerate(edges)}
    sample, train = [0.0] * len(edges), [0.0] * len(edges)
    for r in rows:
        i = index.get(float(r["t"]))
        if i is not None:
            sample[i] += r["sample"] / bin_s
            train[i] += r["train"] / bin_s
    return {"t": edges, "generated_tokens_per_s": [round(x, 3) for x in sample],
            "trained_tokens_per_s": [round(x, 3) for x in train]}


def histogram(values: list[float], buckets: int = STALENESS_BUCKETS) -> dict:
    """Counts of values rounded to whole policy versions: 0, 1, ..., buckets-1, and `buckets`+."""
    counts = [0] * (buckets + 1)
    for v in values:
        counts[min(buckets, max(0, round(v)))] += 1
    labels = [str(i) for i in range(buckets)] + [f"{buckets}+"]
    return {"labels": labels, "counts": counts, "n": len(values)}


def shares(rows: list[dict]) -> dict:
    """Each tenant's share of the trainer's tokens, the generator's tokens and of cost (the price
    book's view of compute), biggest cost first; tenants past the first few are summed as 'others'."""
    totals = {k: sum(r[k] for r in rows) for k in ("train", "sample", "cost")}
    ordered = sorted(rows, key=lambda r: (-r["cost"], -r["train"] - r["sample"], r["tenant"]))
    head, tail = ordered[:MAX_TENANTS_SHOWN], ordered[MAX_TENANTS_SHOWN:]
    if tail:
        head.append({"tenant": f"{len(tail)} others", **{k: sum(r[k] for r in tail) for k in totals}})

    def frac(r: dict, k: str) -> float:
        return round(r[k] / totals[k], 4) if totals[k] else 0.0

    return {"tenants": [r["tenant"] for r in head],
            "trainer": [frac(r, "train") for r in head], "generator": [frac(r, "sample") for r in head],
            "cost": [frac(r, "cost") for r in head],
            "train_tokens": totals["train"], "sample_tokens": totals["sample"], "cost_micro_usd": totals["cost"]}


# quilt.rl's seconds per step, summed per tenant over the window (the operator page's bars):
# the page's name -> the metric quilt.rl logs.
ENV_SECONDS = {"start_s": "env_start_s", "step_s": "env_step_s", "reward_s": "reward_s", "sample_s": "sample_s",
               "train_s": "train_s", "lost_s": "env_wait_gpu_s"}


def env_waits(rows: list[dict]) -> dict:
    """Per tenant, the mean over its RL steps in the window of the share of rollout time spent
    waiting on environments and of the trainer's cycle spent so (quilt.rl's `env_wait_share`,
    `trainer_env_wait_share`), and the seconds its steps spent on environment starts, steps and
    rewards, sampling and training, and the trainer seconds lost waiting on environments
    (`env_wait_gpu_s`), summed; most waiting first."""
    ordered = sorted(rows, key=lambda r: (-(r["rollout"] or 0.0), r["tenant"]))[:MAX_TENANTS_SHOWN]
    out = {"tenants": [r["tenant"] for r in ordered],
           "rollout": [None if r["rollout"] is None else round(r["rollout"], 4) for r in ordered],
           "trainer": [None if r["trainer"] is None else round(r["trainer"], 4) for r in ordered],
           "steps": [int(r["steps"]) for r in ordered]}
    for key in ENV_SECONDS:
        out[key] = [None if r.get(key) is None else round(r[key], 3) for r in ordered]
    return out


def queue_health(base: dict, staleness_mean: float, devices: tuple[int, int]) -> capacity_plan.QueueHealth | None:
    """What the capacity planner reads for one base (scaleout.capacity_plan): generation busy is its slot
    utilisation since the worker started (its beacon's counters), trainer busy the window's mean
    busy fraction; None while either side has no reading."""
    gen = base.get("gen") or {}
    known = [b for b in base["busy"]["busy"] if b is not None]
    if not gen.get("capacity_s") or not known:
        return None
    return capacity_plan.QueueHealth(
        gen_devices=devices[0], train_devices=devices[1], gen_busy=gen["slot_s"] / gen["capacity_s"],
        trainer_busy=sum(known) / len(known), staleness_mean=staleness_mean)


def capacity(base: dict, staleness_mean: float, devices: tuple[int, int],
             record: in_service.InService = in_service.InService()) -> dict | None:  # noqa: B008
    """The capacity planner's answer for one base as the page shows it, with what a scaler last did
    (`record`); None while either side has no reading."""
    health_now = queue_health(base, staleness_mean, devices)
    if health_now is None:
        return None
    rec = capacity_plan.recommend(health_now)
    total = devices[0] + devices[1]
    out = {"gen_busy": round(health_now.gen_busy, 4), "trainer_busy": round(health_now.trainer_busy, 4),
           "now": list(devices), "recommended": [rec.gen_devices, rec.train_devices], "reason": rec.reason,
           "balanced_gen_share": round(rec.balanced_gen_devices / total, 4)}
    if record.at:  # a scaler acts on this base (stack.k8s_scaler)
        out["scaler"] = {"gen": record.gen, "trainer": record.trainer, "reason": record.reason, "at": record.at}
    return out


def devices_in_service(record: in_service.InService, configured: tuple[int, int]) -> tuple[int, int]:
    """The devices the planner counts: those of the workers a scaler keeps in service, else the
    configured ones (QUILT_CAPACITY_*_DEVICES)."""
    if record.gen is None or record.trainer is None:
        return configured
    s = get_scaler_settings()
    return record.gen * s.devices_per_gen_replica, record.trainer * s.devices_per_trainer_shard


# ---------------------------------------------------------------------------------------- fetching

_RATES = """
SELECT base_model, floor(extract(epoch FROM created_at) / %(bin)s) * %(bin)s AS t,
       sum(sample_tokens)::bigint AS sample, sum(train_tokens)::bigint AS train
FROM usage_ledger WHERE created_at >= now() - make_interval(secs => %(window)s)
GROUP BY 1, 2
"""

_SHARES = """
SELECT t.name AS tenant, sum(l.train_tokens)::bigint AS train, sum(l.sample_tokens)::bigint AS sample,
       sum(l.cost_micro_usd)::bigint AS cost
FROM usage_ledger l JOIN tenants t ON t.id = l.tenant_id
WHERE l.created_at >= now() - make_interval(secs => %(window)s)
GROUP BY t.name
"""

# One row per tenant plus the overall row (tenant NULL), through GROUPING SETS.
_TIME_TO_BATCH = """
SELECT t.name AS tenant, count(*) AS groups,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - r.created_at)) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - r.created_at)) AS p95
FROM requests r JOIN tenants t ON t.id = r.tenant_id
WHERE r.kind = 'sample' AND r.status = 'done' AND r.finished_at >= now() - make_interval(secs => %(window)s)
GROUP BY GROUPING SETS ((t.name), ())
"""

_STALENESS = """
SELECT (metrics->>'staleness:mean')::float8 AS lag FROM run_metrics
WHERE source = 'trainer' AND created_at >= now() - make_interval(secs => %(window)s) AND metrics ? 'staleness:mean'
  AND jsonb_typeof(metrics->'staleness:mean') = 'number'
"""


# jsonb_typeof guards the casts: a client may post any finite number under these names, or null.
_ENV_WAITS = """
SELECT t.name AS tenant, count(*) AS steps,
       avg((m.metrics->>'env_wait_share')::float8) AS rollout,
       avg((m.metrics->>'trainer_env_wait_share')::float8)
           FILTER (WHERE jsonb_typeof(m.metrics->'trainer_env_wait_share') = 'number') AS trainer,
       {seconds}
FROM run_metrics m JOIN tenants t ON t.id = m.tenant_id
WHERE m.source = 'client' AND m.created_at >= now() - make_interval(secs => %(window)s)
  AND jsonb_typeof(m.metrics->'env_wait_share') = 'number'
GROUP BY t.name
""".format(seconds=",\n       ".join(
    f"sum((m.metrics->>'{metric}')::float8) FILTER (WHERE jsonb_typeof(m.metrics->'{metric}') = 'number') AS {name}"
    for name, metric in ENV_SECONDS.items()))


def _json(raw) -> dict | None:
    return json.loads(raw) if raw else None


# Figures of generation replicas that add up to the pool's (counters and gauges of sequences).
_ADDITIVE = ("running", "waiting", "target", "slot_s", "capacity_s", "active_s", "mixed_s", "adapter_hits",
             "adapter_misses")


# Figures of trainer shards that add up to the base's (counters, and gauges of models and queues).
_TRAINER_ADDITIVE = ("rounds", "requests", "busy_s", "wait_s", "tokens", "padded_tokens", "models_fused",
                     "tenants_fused", "fused_rounds", "models", "queued", "recent_tokens", "resident", "parked")


def combined_trainer(beacons: dict[str, dict | None]) -> dict | None:
    """One base's trainers from their shards' beacons, as `combined_gen` does for replicas: each
    shard's models, queue and mean tenants per fused pass under "shards" (fusion and fair share
    happen within a shard)."""
    live = [b for b in beacons.values() if b is not None]
    if len(beacons) == 1 or not live:
        return live[0] if live else None
    out: dict = {k: sum(b.get(k, 0) for b in live) for k in _TRAINER_ADDITIVE}
    out["shards"] = {name: None if b is None else {
        "models": b.get("models"), "queued": b.get("queued"), "recent_tokens": b.get("recent_tokens"),
        "tenants_per_pass": round(b["tenants_fused"] / b["fused_rounds"], 2) if b.get("fused_rounds") else None}
        for name, b in beacons.items()}
    return out


def combined_gen(beacons: dict[str, dict | None]) -> dict | None:
    """One base's generation pool from its replicas' beacons: one replica's beacon as it is;
    several summed where sums mean something, with each replica's state under "replicas"; None
    while none is up."""
    live = [b for b in beacons.values() if b is not None]
    if len(beacons) == 1 or not live:
        return live[0] if live else None
    out: dict = {k: sum(b.get(k, 0) for b in live) for k in _ADDITIVE}
    out["replicas"] = {name: None if b is None else {k: b.get(k) for k in ("running", "waiting", "target",
                                                                         "adapter_hits", "adapter_misses")}
                       for name, b in beacons.items()}
    return out


async def _base_health(redis: Redis, base: catalog.BaseModel, *, now: float, window_s: float,
                       bin_s: float) -> tuple[dict, in_service.InService]:
    """The base's figures for the page, and the count in service a scaler keeps (scaleout.in_service)."""
    shards = get_core_settings().trainer_shards
    record = await in_service.read_async(redis, base.name)
    trainer = combined_trainer({name: _json(await redis.get(key))
                                for name, key in health.trainer_keys(base.name, shards).items()})
    replicas = get_core_settings().gen_replicas
    gen = None
    if base.sampleable:
        gen = combined_gen({name: _json(await redis.get(key))
                            for name, key in health.gen_keys(base.name, replicas).items()})
    rounds = [json.loads(r) for r in await redis.lrange(health.trainer_rounds_key(base.name), 0, ROUNDS_READ - 1)]
    busy_total = (trainer or {}).get("busy_s", 0.0) + (trainer or {}).get("wait_s", 0.0)
    return {
        "base_model": base.name,
        "queues": {"training": sum([await redis.xlen(st) for st in queue.train_streams(base.name, shards)]),
                   "sampling": sum([await redis.xlen(st) for st in queue.sample_streams(base.name, replicas)])
                   if base.sampleable else None},
        "trainer": {"up": trainer is not None, **(trainer or {}),
                    "busy_fraction_since_start": round(trainer["busy_s"] / busy_total, 4) if trainer and busy_total
                    else None},
        "gen": None if not base.sampleable else {
            "up": gen is not None, **(gen or {}),
            "slot_utilisation": round(gen["running"] / gen["target"], 4) if gen and gen.get("target") else None},
        # The busy fraction is the mean over the shards in service, not over every named one.
        "busy": trainer_series(rounds, now=now, window_s=window_s, bin_s=bin_s, complete=len(rounds) < ROUNDS_READ,
                               workers=min(record.trainer or shards, shards)),
        "fused": fused_rounds(rounds, since=now - window_s),
        "in_service": {"gen": record.gen, "trainer": record.trainer} if record.at else None,
    }, record


async def _staleness_lags(conn, params: dict) -> list[float]:
    return [r["lag"] for r in await (await conn.execute(_STALENESS, params)).fetchall()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


async def planner_health(conn, redis: Redis, base: catalog.BaseModel, *, window_s: float,
                         devices: tuple[int, int]) -> capacity_plan.QueueHealth | None:
    """What the capacity planner reads for one base over the last `window_s` seconds, as the page
    does, with `devices` the split running now (stack.k8s_scaler acts on its answer)."""
    bin_s = max(5, round(window_s / 60))
    item, _ = await _base_health(redis, base, now=time.time(), window_s=window_s, bin_s=bin_s)
    return queue_health(item, _mean(await _staleness_lags(conn, {"window": window_s, "bin": bin_s})), devices)


async def snapshot(conn, redis: Redis, *, window_s: float, devices: tuple[int, int] = (1, 1)) -> dict:
    """Everything the operator page draws, for the last `window_s` seconds."""
    now = time.time()
    bin_s = max(5, round(window_s / 60))  # whole seconds, so Postgres' bin starts equal ours exactly
    bases = await catalog.list_models(conn)
    params = {"window": window_s, "bin": bin_s}
    rates: dict[str, list[dict]] = defaultdict(list)
    for r in await (await conn.execute(_RATES, params)).fetchall():
        rates[r["base_model"]].append(r)
    per_base, records = [], []
    for base in bases:
        item, record = await _base_health(redis, base, now=now, window_s=window_s, bin_s=bin_s)
        records.append(record)
        item["rates"] = rate_series(rates.get(base.name, []), now=now, window_s=window_s, bin_s=bin_s)
        per_base.append(item)
    ttb = await (await conn.execute(_TIME_TO_BATCH, params)).fetchall()
    overall = next((r for r in ttb if r["tenant"] is None), None)
    tenants = sorted((r for r in ttb if r["tenant"] is not None), key=lambda r: -r["p95"])[:MAX_TENANTS_SHOWN]
    lags = await _staleness_lags(conn, params)
    for item, record in zip(per_base, records, strict=True):
        item["capacity"] = capacity(item, _mean(lags), devices_in_service(record, devices), record)
    share_rows = [{k: (int(v) if k != "tenant" else v) for k, v in r.items()}
                  for r in await (await conn.execute(_SHARES, params)).fetchall()]
    return {
        "at": now, "window_s": window_s, "bin_s": bin_s,
        "bases": per_base,
        "time_to_batch": {
            "groups": overall["groups"] if overall else 0,
            "p50_s": overall["p50"] if overall else None, "p95_s": overall["p95"] if overall else None,
            "tenants": [r["tenant"] for r in tenants], "p50": [r["p50"] for r in tenants],
            "p95": [r["p95"] for r in tenants],
        },
        "staleness": histogram(lags),
        "shares": shares(share_rows),
        "env_waits": env_waits(await (await conn.execute(_ENV_WAITS, params)).fetchall()),
    }
