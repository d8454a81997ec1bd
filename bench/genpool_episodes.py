"""Multi-turn episodes through the pool's admission: feedback levels against today's order.

An agentic RL episode is a chain of sampling calls with tool calls between them, and its number
of turns has a long tail. The pool's admission (gen_pool.admission, imported, not copied) can put
each call on its episode's feedback level (gen_pool.episodes: demoted by the tokens the episode
has consumed, raised by waiting), or, as before, serve calls in arrival order within a tenant. This
drives both with one seeded workload on a flat-step engine model (a running sequence decodes
TOKEN_RATE tokens/s however many run; slots freed at the end of each quantum), in two regimes:

  sync:   each tenant starts EPISODES episodes, waits for all of them (its batch), trains for a
          PAUSE, repeats. Time-to-batch = the batch's makespan.
  stream: each tenant keeps EPISODES episodes in flight (a finished one is replaced at once) and its
          trainer takes the next BATCH finished episodes after each PAUSE (quilt.rl with
          max_staleness >= 1). Time-to-batch = how long the trainer waited for its batch.

Turn counts are lognormal (median TURNS_MEDIAN, sigma TURNS_SIGMA, capped), turn lengths lognormal
(median LEN_MEDIAN tokens), tool calls take TOOL_S (uniform 0.5x-1.5x). Printed per regime and
policy: generated tokens/s, time-to-batch p50/p95, episode latency (first call to last token)
p50/p95, and the p95 of the longest tenth of episodes (what demotion costs them).

    python bench/genpool_episodes.py [--quick] [--slots 32] [--tenants 4] ...

Ends with one JSON line: per regime, feedback/today ratios of tokens/s, time-to-batch p50/p95 and
episode latency p50/p95.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import heapq
import json
import math
import random
from dataclasses import dataclass, field

from flags import add_flags, from_flags
from genpool_sim import pct

from gen_pool.admission import BatchLedger, GroupView, PoolView, plan_admission
from gen_pool.episodes import EpisodeLedger, FeedbackLevels


@dataclass(frozen=True)
class Workload:
    slots: int = 32
    token_rate: float = 40.0
    prefill_s: float = 0.02
    tenants: int = 4
    episodes: int = 24
    batch: int = 24  # stream: finished episodes per trainer step
    turns_median: float = 2.0
    turns_sigma: float = 1.0
    max_turns: int = 40
    len_median: float = 48.0
    len_sigma: float = 0.8
    max_len: int = 512
    tool_s: float = 0.3
    pause_s: float = 2.0
    horizon_s: float = 600.0
    quantum_s: float = 0.05


@dataclass
class Episode:
    eid: str
    tenant: int
    turns: list[int]  # each turn's sampled length
    started: float
    done_turns: int = 0


@dataclass
class Tenant:
    index: int
    rng: random.Random
    live: int = 0  # episodes in flight
    finished: list[float] = field(default_factory=list)  # stream: finish times of episodes not yet trained
    batch_started: float = 0.0
    trainer_ready: float = 0.0  # stream: when the trainer next wants a batch
    next_batch: float = 0.0  # sync: when the next batch starts
    ttb: list[float] = field(default_factory=list)


def simulate(w: Workload, regime: str, feedback: bool, seed: int) -> dict:
    levels = FeedbackLevels() if feedback else FeedbackLevels(levels=1)
    episodes_ledger, batches = EpisodeLedger(levels), BatchLedger()
    tenants = [Tenant(i, random.Random(seed * 1000 + i)) for i in range(w.tenants)]
    episodes: dict[str, Episode] = {}
    queued: dict[str, tuple[Episode, float]] = {}  # call id -> (episode, arrival)
    arriving: list[tuple[float, str]] = []  # (time, episode id): a turn's call after its tool call
    finishing: list[tuple[float, str, str, int]] = []  # (end, call id, episode id, tokens)
    running = [0] * w.tenants
    unfinished = [0] * w.tenants  # calls queued or running, per tenant (rule 3's batch)
    tokens, latencies, longest = 0.0, [], []
    count = 0

    def start_episode(t: Tenant, now: float) -> None:
        nonlocal count
        k = max(1, min(w.max_turns, round(t.rng.lognormvariate(math.log(w.turns_median), w.turns_sigma))))
        lengths = [max(1, min(w.max_len, int(t.rng.lognormvariate(math.log(w.len_median), w.len_sigma))))
                   for _ in range(k)]
        e = Episode(f"e{count}", t.index, lengths, now)
        count += 1
        episodes[e.eid] = e
        t.live += 1
        heapq.heappush(arriving, (now, e.eid))

    def start_batch(t: Tenant, now: float) -> None:
        t.batch_started = now
        for _ in range(w.episodes):
            start_episode(t, now)

    for t in tenants:
        if regime == "sync":
            t.next_batch = w.pause_s * t.index / w.tenants
        else:
            for _ in range(w.episodes):
                start_episode(t, w.pause_s * t.index / w.tenants)
            t.trainer_ready = w.pause_s * (1 + t.index / w.tenants)
    now = 0.0
    while now < w.horizon_s:
        now += w.quantum_s
        for i, r in enumerate(running):
            batches.add(str(i), r * w.quantum_s)
        while finishing and finishing[0][0] <= now:
            _end, cid, eid, length = heapq.heappop(finishing)
            e = episodes[eid]
            t = tenants[e.tenant]
            running[e.tenant] -= 1
            unfinished[e.tenant] -= 1
            if unfinished[e.tenant] == 0:
                batches.close(str(e.tenant))
            episodes_ledger.consume(str(e.tenant), eid, length)
            e.done_turns += 1
            if e.done_turns < len(e.turns):
                heapq.heappush(arriving, (now + w.tool_s * t.rng.uniform(0.5, 1.5), eid))
                continue
            del episodes[eid]
            t.live -= 1
            latencies.append((now - e.started, sum(e.turns)))
            if regime == "stream":
                t.finished.append(now)
                start_episode(t, now)
            elif t.live == 0:
                t.ttb.append(now - t.batch_started)
                t.next_batch = now + w.pause_s * t.rng.uniform(0.5, 1.5)
        for t in tenants:
            if regime == "sync" and t.live == 0 and now >= t.next_batch:
                start_batch(t, now)
            elif regime == "stream" and now >= t.trainer_ready and len(t.finished) >= w.batch:
                t.ttb.append(max(0.0, t.finished[w.batch - 1] - t.trainer_ready))
                t.finished = t.finished[w.batch:]
                t.trainer_ready = now + w.pause_s * t.rng.uniform(0.5, 1.5)
        while arriving and arriving[0][0] <= now:
            at, eid = heapq.heappop(arriving)
            e = episodes[eid]
            cid = f"{eid}/{e.done_turns}"
            queued[cid] = (e, at)
            unfinished[e.tenant] += 1
            batches.open(str(e.tenant), at)
        views = [GroupView(cid, str(e.tenant), at, 1,
                           level=episodes_ledger.level(str(e.tenant), e.eid, now - at)) for cid, (e, at) in queued.items()]
        views += [GroupView(f"{i}/running", str(i), 0.0, r, r, 0) for i, r in enumerate(running) if r]
        plan = plan_admission(PoolView(now=now, target=w.slots, groups=views, since=dict(batches.since),
                                       received=batches.received({})))
        for a in plan.admits:
            e, _at = queued.pop(a.request_id)
            length = e.turns[e.done_turns]
            end = now + w.prefill_s + length / w.token_rate
            heapq.heappush(finishing, (end, a.request_id, e.eid, length))
            running[e.tenant] += 1
            tokens += length
    ttb = sorted(x for t in tenants for x in t.ttb)
    lat = sorted(x for x, _ in latencies)
    cut = pct([n for _, n in latencies], 0.9)
    longest = sorted(x for x, n in latencies if n >= cut)
    return {"tps": tokens / w.horizon_s, "ttb_p50": pct(ttb, 0.5), "ttb_p95": pct(ttb, 0.95), "batches": len(ttb),
            "lat_p50": pct(lat, 0.5), "lat_p95": pct(lat, 0.95), "long_p95": pct(longest, 0.95),
            "episodes": len(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short horizon (a smoke run)")
    ap.add_argument("--seeds", type=int, default=3)
    add_flags(ap, Workload)
    args = ap.parse_args()
    w = from_flags(args, Workload)
    if args.quick:
        w, args.seeds = Workload(**{**w.__dict__, "horizon_s": 120.0}), 1
    print(f"workload: {w}\nfeedback levels: {FeedbackLevels()}\n")
    keys = ("tps", "ttb_p50", "ttb_p95", "lat_p50", "lat_p95", "long_p95")
    print(f"{'regime':<8}{'policy':<10}{'tokens/s':>10}{'ttb p50 s':>11}{'ttb p95 s':>11}{'episode p50 s':>15}"
          f"{'episode p95 s':>15}{'longest 10% p95':>17}{'batches':>9}")
    summary = {}
    for regime in ("sync", "stream"):
        out = {}
        for name, feedback in (("today", False), ("feedback", True)):
            runs = [simulate(w, regime, feedback, seed) for seed in range(args.seeds)]
            out[name] = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in (*keys, "batches")}
            r = out[name]
            print(f"{regime:<8}{name:<10}{r['tps']:>10.0f}{r['ttb_p50']:>11.2f}{r['ttb_p95']:>11.2f}"
                  f"{r['lat_p50']:>15.2f}{r['lat_p95']:>15.2f}{r['long_p95']:>17.2f}{r['batches']:>9}")
        summary[regime] = {f"{k}_feedback_over_today": round(out["feedback"][k] / out["today"][k], 3) for k in keys}
    print("\n(medians over seeds; ratios below 1 mean feedback levels are faster, except tokens/s)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
