"""The generation pool's admission policy at scale: a discrete-event model of 8 to 1,000 GPUs.

Drives the real policy (`gen_pool.admission.plan_admission`, imported, not copied) with a model of
a multi-tenant RL pool, and compares, at each scale and on the same seeded workload:

  shared:      one admission queue over every slot of the pool (gap filling on);
  partitioned: each tenant capped at an equal share of the pool's slots among the tenants present
               (whether or not they are sampling right now): a static split that follows arrivals.

The model (all numbers are flags):
  * GPUS accelerators x SLOTS sequences each; a running sequence decodes TOKEN_RATE tokens/s no
    matter how many run (the regime where a GPU decode step barely grows with batch size) after a
    PREFILL_S start-up; the pool is one set of GPUS x SLOTS slots. (`Model.step_ms`, not a flag,
    replaces the flat rate by a measured decode-step curve: bench/genpool_fill.py's engine model.)
  * Tenants arrive (Poisson) and leave (after a lognormal lifetime) within a HORIZON; about
    TENANTS_PER_GPU x GPUS are present at a time. Each loops: sample a batch of GROUPS groups of N
    sequences, wait for all, train for a PAUSE (uniform 0.5x-1.5x), repeat.
  * Lengths are lognormal (sigma SIGMA, capped), and their median drifts up over a tenant's training
    (x (1 + DRIFT) by its end), as RL responses do.
Time advances in quanta of QUANTUM_S; finished sequences free their slots at the end of a quantum
and the policy is asked once per quantum.

Printed per scale: generated tokens/s, slot utilisation, time-to-trainable-batch p50/p95 over all
batches, shared vs partitioned; then one JSON line per scale:
{"gpus", "shared_over_partitioned_tps", "worst_tenant_p95_ttb_ratio", "slot_util_shared", ...}.

    python bench/genpool_sim.py [--quick] [--gpus 8,64,256,1000]
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import dataclasses
import heapq
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from flags import add_flags, from_flags

from gen_pool.admission import (
    GRACE_SEQUENCES,
    BatchLedger,
    GroupView,
    PoolView,
    plan_admission,
)


@dataclass(frozen=True)
class Model:
    slots: int = 64
    token_rate: float = 40.0  # tokens/s per running sequence
    prefill_s: float = 0.05
    tenants_per_gpu: float = 0.5
    groups: int = 64
    n: int = 8
    median_len: float = 120.0
    sigma: float = 0.8
    max_len: int = 1024
    drift: float = 1.0
    pause_s: float = 10.0
    lifetime_s: float = 450.0
    horizon_s: float = 900.0
    quantum_s: float = 0.5
    ahead: int = 0  # batches a tenant may sample ahead of its trainer (quilt.rl's max_staleness); 0 = synchronous
    # A measured decode step, ((running sequences, ms per step), ...) ascending: every running
    # sequence then decodes 1000 / ms(k) tokens/s while k run (interpolated, held flat past the
    # ends), a CPU engine's step growing with its batch. Empty: the flat TOKEN_RATE.
    step_ms: tuple[tuple[int, float], ...] = ()

    def rate(self, running: int) -> float:
        """Tokens/s of one sequence while `running` sequences run on its accelerator."""
        curve = self.step_ms
        if not curve:
            return self.token_rate
        if running <= curve[0][0]:
            return 1000.0 / curve[0][1]
        for (k0, ms0), (k1, ms1) in zip(curve, curve[1:]):
            if running <= k1:
                return 1000.0 / (ms0 + (ms1 - ms0) * (running - k0) / (k1 - k0))
        return 1000.0 / curve[-1][1]


@dataclass(frozen=True)
class TenantPlan:
    tid: str
    arrive: float
    leave: float
    seed: int
    # How this tenant differs from the Model's tenant: multipliers of its pause, groups per batch
    # and median length (bench/genpool_sweep.py mixes tenants this way).
    pause_x: float = 1.0
    groups_x: float = 1.0
    len_x: float = 1.0


def tenant_schedule(gpus: int, m: Model, seed: int) -> list[TenantPlan]:
    """Who is present when: about tenants_per_gpu x gpus at once, Poisson arrivals, lognormal stays."""
    rng = random.Random(seed)
    target = max(2, round(m.tenants_per_gpu * gpus))
    plans = []
    for i in range(target):  # present from the start, leaving at random
        plans.append(TenantPlan(f"t{i}", 0.0, rng.lognormvariate(math.log(m.lifetime_s), 0.5), rng.randrange(2**31)))
    t, i = 0.0, target
    rate = target / m.lifetime_s  # arrivals keep the population about steady
    while True:
        t += rng.expovariate(rate)
        if t >= m.horizon_s:
            return plans
        plans.append(TenantPlan(f"t{i}", t, t + rng.lognormvariate(math.log(m.lifetime_s), 0.5), rng.randrange(2**31)))
        i += 1


# A mixed population (bench/genpool_fill.py --mix, bench/genpool_sweep.py): tenant i differs from the
# model's tenant by MIXED[i % 4]: one trains long on small batches, one briefly on large ones, one
# samples longer answers, one shorter ones. Batch sizes average the model's; pauses a quarter more.
MIXED = ({"pause_x": 2.0, "groups_x": 0.5}, {"pause_x": 0.5, "groups_x": 1.5},
         {"groups_x": 0.75, "len_x": 1.5}, {"pause_x": 1.5, "groups_x": 1.25, "len_x": 0.6})


def tenant_shape(i: int, mixed: bool) -> dict[str, float]:
    """Tenant i's multipliers (pause_x, groups_x, len_x): all 1 unless the population is mixed."""
    return {"pause_x": 1.0, "groups_x": 1.0, "len_x": 1.0, **(MIXED[i % len(MIXED)] if mixed else {})}


def fixed_tenants(count: int, m: Model, seed: int, mixed: bool = False) -> list[TenantPlan]:
    """`count` tenants present for the whole horizon, starting staggered over one pause (the shape
    of bench/genpool_fill.py's workload); `mixed` gives them different shapes (MIXED)."""
    rng = random.Random(seed)
    return [TenantPlan(f"t{i}", m.pause_s * i / count, math.inf, rng.randrange(2**31), **tenant_shape(i, mixed))
            for i in range(count)]


@dataclass
class SimGroup:
    gid: str
    tenant: str
    arrival: float
    lengths: list[int]
    admitted: int = 0
    finished: int = 0
    _view: GroupView | None = None  # rebuilt only when the counts change

    def view(self) -> GroupView:
        if self._view is None or (self._view.n_admitted, self._view.n_finished) != (self.admitted, self.finished):
            self._view = GroupView(self.gid, self.tenant, self.arrival, len(self.lengths), self.admitted, self.finished)
        return self._view


@dataclass
class SimTenant:
    plan: TenantPlan
    rng: random.Random
    step: int = 0  # batches submitted
    pending: int = 0  # groups of the current batch not done
    next_submit: float = 0.0  # its first batch: when it arrives
    # The tenant's trainer: steps done (its policy version), sampled batches waiting for it (the
    # version each was sampled at), and whether it is training until when, or idle since when.
    trained: int = 0
    sampling_at: int = 0  # the version the batch being sampled started from
    ready: list[int] = field(default_factory=list)
    train_until: float | None = None
    idle_since: float | None = None
    ttb: list[float] = field(default_factory=list)  # how long the trainer waited for each batch
    staleness: list[int] = field(default_factory=list)  # per trained batch: versions behind
    gone: bool = False


@dataclass
class Result:
    tokens: float
    busy: float
    capacity: int
    horizon: float
    ttb: dict[str, list[float]]
    plan_calls: int
    plan_s: float
    staleness: list[int] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return self.tokens / self.horizon

    @property
    def util(self) -> float:
        return self.busy / (self.capacity * self.horizon)

    def all_ttb(self) -> list[float]:
        return sorted(x for xs in self.ttb.values() for x in xs)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else float("nan")


def compact_views(queued: dict, running_full: dict[str, int]) -> list[GroupView]:
    """The policy's view, compacted: a group with nothing left to start only contributes its running
    sequences, so all of a tenant's such groups are summed into one view that waits for nothing
    (`running_full`, kept up to date as sequences start and finish). The plan is the same as with
    one view per group, at a fraction of the cost when 10^4 groups are in flight."""
    views = [g.view() for g in queued.values()]
    views += [GroupView(f"{t}/running", t, 0.0, r, r, 0) for t, r in running_full.items() if r > 0]
    return views


def simulate(gpus: int, m: Model, mode: str, seed: int, plans: list[TenantPlan] | None = None) -> Result:
    """One mode over the horizon; `plans` fixes who is present (default: arrivals and departures)."""
    capacity = gpus * m.slots
    tenants = {p.tid: SimTenant(p, random.Random(p.seed), next_submit=p.arrive)
               for p in (plans if plans is not None else tenant_schedule(gpus, m, seed))}
    groups: dict[str, SimGroup] = {}
    queued: dict[str, SimGroup] = {}  # groups with sequences not yet started
    running_full: dict[str, int] = {}  # per tenant: running sequences of fully started groups
    running: dict[str, int] = {}  # per tenant: all its running sequences
    ledger = BatchLedger()  # admission rule 3
    held_s, sequences = 0.0, 0  # every admitted sequence's slot time: rule 3's grace
    finishing: list[tuple[float, str, int]] = []  # (finish time, group, length) heap
    tokens = busy = 0.0
    plan_calls, plan_s = 0, 0.0
    now = 0.0
    # The work clock: what a sequence decoding since 0 has done, in seconds at TOKEN_RATE. Flat,
    # it is the time itself; with a step curve it runs slower while more sequences run, and every
    # running sequence's end (a point on this clock) comes later alike.
    flat, work = not m.step_ms, 0.0
    while now < m.horizon_s:
        now += m.quantum_s
        if flat:
            work += m.quantum_s
        else:
            held = sum(running.values())
            rate = m.rate(math.ceil(held / gpus))
            work += m.quantum_s * rate / m.token_rate
            busy += held * m.quantum_s
        # Slots are held in whole quanta (freed at a quantum's end), so this is what each held.
        for tid, r in running.items():
            ledger.add(tid, r * m.quantum_s)
        # 1. Sequences that finished in this quantum free their slots.
        while finishing and finishing[0][0] <= work:
            _t, gid, length = heapq.heappop(finishing)
            if not flat:
                tokens += length  # (flat: counted at admission)
            g = groups[gid]
            g.finished += 1
            running[g.tenant] -= 1
            if gid not in queued:
                running_full[g.tenant] -= 1
            if g.finished == len(g.lengths):
                del groups[gid]
                t = tenants[g.tenant]
                t.pending -= 1
                if t.pending == 0:
                    ledger.close(g.tenant)
                    t.ready.append(t.sampling_at)
        # 2. Trainers take sampled batches; tenants whose bound allows submit their next batch; others leave.
        present = 0
        for t in tenants.values():
            if t.gone or t.plan.arrive > now:
                continue
            if now >= t.plan.leave and t.pending == 0:
                t.gone = True
                continue
            present += 1
            if t.train_until is not None and now >= t.train_until:
                t.trained, t.train_until, t.idle_since = t.trained + 1, None, now
            if t.train_until is None and t.ready:
                t.staleness.append(t.trained - t.ready.pop(0))
                t.ttb.append(now - t.idle_since)
                t.train_until = now + m.pause_s * t.plan.pause_x * t.rng.uniform(0.5, 1.5)
            # Batch `step` may be sampled once the trainer is at most `ahead` versions behind it.
            if t.pending == 0 and now >= t.next_submit and t.step - t.trained <= m.ahead:
                if t.idle_since is None:
                    t.idle_since = now
                progress = min(1.0, (now - t.plan.arrive) / max(t.plan.leave - t.plan.arrive, 1.0))
                median = m.median_len * t.plan.len_x * (1 + m.drift * progress)
                batch = max(1, round(m.groups * t.plan.groups_x))
                for k in range(batch):
                    lengths = [max(1, min(m.max_len, int(t.rng.lognormvariate(math.log(median), m.sigma))))
                               for _ in range(m.n)]
                    gid = f"{t.plan.tid}/{t.step}/{k}"
                    groups[gid] = queued[gid] = SimGroup(gid, t.plan.tid, now, lengths)
                t.pending, t.step, t.sampling_at = batch, t.step + 1, t.trained
                ledger.open(t.plan.tid, now)
        # 3. The policy decides who starts.
        caps = {}
        if mode == "partitioned" and present:
            share = max(1, capacity // present)
            caps = {tid: share for tid, t in tenants.items() if not t.gone}
        view = PoolView(now=now, target=capacity, groups=compact_views(queued, running_full),
                        tenant_caps=caps, since=dict(ledger.since), received=ledger.received({}),
                        grace_s=GRACE_SEQUENCES * held_s / sequences if sequences else 0.0)
        t0 = time.perf_counter()
        plan = plan_admission(view)
        plan_s += time.perf_counter() - t0
        plan_calls += 1
        for a in plan.admits:
            g = groups[a.request_id]
            if g.admitted + a.count == len(g.lengths):  # fully started: summed per tenant from now on
                del queued[g.gid]
                running_full[g.tenant] = running_full.get(g.tenant, 0) + (g.admitted - g.finished) + a.count
            running[g.tenant] = running.get(g.tenant, 0) + a.count
            for _ in range(a.count):
                length = g.lengths[g.admitted]
                g.admitted += 1
                end = work + m.prefill_s + length / m.token_rate
                held_s, sequences = held_s + end - work, sequences + 1
                heapq.heappush(finishing, (end, g.gid, length))
                if not flat:
                    continue  # counted as it finishes, or below at the horizon
                # Count only what falls inside the horizon.
                inside = max(0.0, min(end, m.horizon_s) - now)
                busy += inside
                decode = max(0.0, min(end, m.horizon_s) - now - m.prefill_s)
                tokens += min(length, decode * m.token_rate)
    if not flat:  # what the sequences still running decoded: each decodes up to its end on the work clock
        tokens += sum(min(length, max(0.0, (work - end) * m.token_rate + length)) for end, _g, length in finishing)
    return Result(tokens, busy, capacity, m.horizon_s, {tid: t.ttb for tid, t in tenants.items()}, plan_calls, plan_s,
                  [x for t in tenants.values() for x in t.staleness])


def fixed_comparison(m: Model, tenants: int, mixed: bool, seeds: int) -> dict:
    """Shared (its tenants `m.ahead` versions ahead) vs a synchronous partition for `tenants`
    tenants present throughout (fixed_tenants), medians over seeds: tokens/s ratio, the worst
    tenant's p95 time-to-batch ratio, and both utilisations."""
    ratios, p95s, utils = [], [], []
    for seed in range(seeds):
        plans = fixed_tenants(tenants, m, seed, mixed)
        shared = simulate(1, m, "shared", seed, plans)
        part = simulate(1, dataclasses.replace(m, ahead=0), "partitioned", seed, plans)
        ratios.append(shared.tps / part.tps)
        p95s.append(max(pct(shared.ttb[t], 0.95) / pct(part.ttb[t], 0.95) for t in shared.ttb if part.ttb[t]))
        utils.append((shared.util, part.util))
    return {"ratio": statistics.median(ratios), "p95": statistics.median(p95s),
            "util_shared": statistics.median(u for u, _ in utils),
            "util_partitioned": statistics.median(p for _, p in utils)}


def compare(gpus: int, m: Model, seed: int) -> dict:
    t0 = time.perf_counter()
    shared = simulate(gpus, m, "shared", seed)
    part = simulate(gpus, m, "partitioned", seed)
    ratios = []
    for tid, xs in shared.ttb.items():
        ys = part.ttb.get(tid, [])
        if len(xs) >= 3 and len(ys) >= 3:
            ratios.append(pct(xs, 0.95) / pct(ys, 0.95))
    s_all, p_all = shared.all_ttb(), part.all_ttb()
    tenants = len(shared.ttb)
    print(f"\n{gpus} GPUs x {m.slots} slots = {shared.capacity} slots; {tenants} tenants over {m.horizon_s:.0f} s "
          f"({time.perf_counter() - t0:.1f} s to simulate; policy {1000 * shared.plan_s / shared.plan_calls:.2f} ms/call)")
    print(f"{'':<26}{'shared':>12}{'partitioned':>14}")
    print(f"{'tokens/s':<26}{shared.tps:>12.0f}{part.tps:>14.0f}")
    print(f"{'slot utilisation':<26}{shared.util:>12.2f}{part.util:>14.2f}")
    print(f"{'batches done':<26}{len(s_all):>12}{len(p_all):>14}")
    print(f"{'time-to-batch p50 s':<26}{pct(s_all, 0.5):>12.1f}{pct(p_all, 0.5):>14.1f}")
    print(f"{'time-to-batch p95 s':<26}{pct(s_all, 0.95):>12.1f}{pct(p_all, 0.95):>14.1f}")
    if ratios:
        print(f"{'per-tenant p95 ratio':<26}{'median':>12}{statistics.median(ratios):>14.2f}  worst {max(ratios):.2f} "
              f"({sum(r <= 1.1 for r in ratios)}/{len(ratios)} tenants <= 1.1)")
    return {
        "gpus": gpus,
        "shared_over_partitioned_tps": round(shared.tps / part.tps, 3),
        "worst_tenant_p95_ttb_ratio": round(max(ratios), 3) if ratios else None,
        "median_tenant_p95_ttb_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "slot_util_shared": round(shared.util, 3),
        "slot_util_partitioned": round(part.util, 3),
        "ttb_p95_shared_s": round(pct(s_all, 0.95), 2),
        "ttb_p95_partitioned_s": round(pct(p_all, 0.95), 2),
        "tenants": tenants,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small scales and a short horizon (a smoke run)")
    ap.add_argument("--gpus", default="8,64,256,1000", help="comma-separated pool sizes")
    ap.add_argument("--seed", type=int, default=0)
    add_flags(ap, Model, skip=("step_ms",))
    args = ap.parse_args()
    m = from_flags(args, Model, skip=("step_ms",))
    scales = [int(x) for x in args.gpus.split(",")]
    if args.quick:
        scales = [s for s in scales if s <= 64] or [8]
        m = Model(**{**m.__dict__, "horizon_s": 300.0, "lifetime_s": 150.0})
    print(f"model: {m}")
    lines = [compare(g, m, args.seed) for g in scales]
    print()
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
