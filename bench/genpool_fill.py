"""Does one shared multi-LoRA pool beat a statically partitioned one? Real vLLM, one run.

RL post-training alternates: sample a batch of rollouts, wait for the slowest, train, repeat. The
lengths have a long tail, so a tenant's slots idle at the end of every batch and during every
trainer step. A pool shared across tenants can give those slots to other tenants' rollouts.

1. The decode-step curve of the engine first: time per step and tokens/s against the number of
   running sequences. The comparison below is meaningful where the step time barely grows with the
   number of sequences (as on a GPU); an overhead-bound tiny model on CPU is chosen for that.
2. TENANTS tenants, each running ROUNDS synchronous batches (GROUPS sample(n) groups of lognormal
   lengths, a pause of 0.5-1.5x PAUSE standing in for the trainer step between batches, tenants
   starting staggered; --mix mixed makes them differ in pause, batch size and length), in three
   (four) modes on the same engine with the same seeded workload:
   (a) shared:      one admission queue (gen_pool.admission) across tenants, gap filling on;
   (b) partitioned: the same engine, each tenant capped at target / TENANTS running sequences;
   (c) serial:      one tenant's batch at a time, with the whole engine.
   (d) async (--async): the shared pool, but each tenant samples its next batch while its trainer
                    step runs, one version ahead at most (quilt.rl with max_staleness=1); the
                    staleness of every trained batch is measured and printed.
   Printed per mode: generated tokens/s, slot utilisation (busy sequence-seconds / target / wall),
   where the idle capacity comes from (time full; time with free slots and no work to run; time with
   free slots while work waits, i.e. held back by caps or admission latency), and each tenant's
   time-to-trainable-batch (submit -> last group done) p50/p95, and the CPU each process spent per
   token generated (this one: Quilt's scheduler and vLLM's front end; vLLM's engine core and its
   worker), with the time inside the scheduler's own step. Then the ratio split into its two
   factors (utilisation ratio x tokens/s per busy slot ratio, and the per-busy-slot ratio the step
   curve of part 1 predicts from each arm's running sequences) and what an ideal engine would give
   this workload: the same workload shape and admission function in bench/genpool_sim.py's
   flat-step model at the measured per-sequence rate; and the engine model: the same with the
   measured step curve of part 1, so the gap to the ideal engine splits into what admission loses
   and what the step's growth with the batch costs on this engine.
   Sequences are unseeded by default, as RL rollouts usually are (--seeded gives each a seed).
3. Publish-to-first-token: a new adapter version is written and sampled (1 token) while the pool
   is busy with other work; no restart.

    python bench/genpool_fill.py [--quick] [--target 32] [--rounds 5] ...

Ends with one JSON line: {"shared_over_partitioned_tps", "worst_tenant_p95_ttb_ratio",
"shared_over_ideal" (the measured ratio over the ideal engine's for this workload),
"shared_over_engine_model" (over the engine model's), the same three "..._all_active" (over the
first "all_active_window_s" of every arm, while every tenant in each still had batches to sample), "slot_util_shared",
..., with --async "async_over_partitioned_tps", "async_over_ideal", "async_staleness_mean/max"}. Target
("target_met"): the shared pool at least 0.97 of the ideal engine for the workload, at least 1.5x
partitioned tokens/s where tenants differ (--mix mixed), every tenant's p95 time-to-batch at most
1.1x its partitioned value.

--repeats R runs the arms R times interleaved (shared, partitioned, serial, async, then again) and
reports every figure as the median of the repetitions' own: on a shared host a slow spell then
lands in one repetition rather than in one arm.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from genpool_sim import Model, fixed_comparison, pct, tenant_shape

from core.settings import GenPoolSettings
from core.work import AdapterRef, SamplingSpec
from gen_pool.engine import GenEngine, SeqRequest
from gen_pool.scheduler import Group, Scheduler

# An overhead-bound model: so small that a decode step costs about the same for 1 or 32 sequences.
BENCH_SPEC = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
              "intermediate_size": 128}
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --------------------------------------------------------------------------- setup


def build(root: Path, tenants: int, spec: dict | None = None) -> tuple[str, list[str]]:
    """The base (BENCH_SPEC unless `spec` says otherwise) and tenants + 1 random rank-8 adapters
    (one spare: the "new version" of part 3), written from the base's shapes alone."""
    from gen_pool.adapters import header_adapter
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    base = build_tiny_model(root / "base", spec=TinyModelSpec(**(spec or BENCH_SPEC))).path
    paths = [header_adapter(base, root / f"adapter-{i}", rank=8, modules=tuple(MODULES), seed=i)
             for i in range(tenants + 1)]
    return base, paths


async def run_pool(sched: Scheduler, stop: asyncio.Event) -> float:
    """The generation worker's loop (gen_pool.worker); returns the seconds spent inside its steps."""
    spent = 0.0
    while not stop.is_set():
        began = time.perf_counter()
        sched.step()
        spent += time.perf_counter() - began
        await sched.wait(0.2)
    return spent


def submit(sched: Scheduler, futures: dict, group: Group) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    futures[group.request_id] = fut
    sched.add(group)
    sched.wake()
    return fut


def make_scheduler(engine: GenEngine, target: int, cap: int, done: list[Group]) -> tuple[Scheduler, dict]:
    futures: dict[str, asyncio.Future] = {}

    def on_finish(g: Group, outcome) -> None:
        done.append(g)
        fut = futures.pop(g.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    return Scheduler(engine, target=target, default_cap=cap, on_finish=on_finish), futures


# --------------------------------------------------------------------------- 1. the curve


async def step_curve(engine: GenEngine, refs: list[AdapterRef], target: int,
                     seeded: bool, reps: int = 3) -> list[tuple[int, float, float]]:
    """(running sequences, ms per decode step, tokens/s) at 1, 2, 4, ... 2 x target running: the
    median of `reps` runs of 48 tokens each (one run swings by 2x on this shared host)."""
    spec = SamplingSpec(max_tokens=48, eos_stops=False)
    rows = []
    k = 1
    while k <= 2 * target:
        times = []
        for rep in range(reps):
            reqs = [SeqRequest(f"curve-{k}-{rep}-{i}", (5, 6, 7, 8), spec, i if seeded else None, refs[i % len(refs)])
                    for i in range(k)]
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.generate(r) for r in reqs))
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        rows.append((k, 1000 * dt / 48, k * 48 / dt))
        k *= 2
    return rows


# --------------------------------------------------------------------------- 2. the modes


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (Quilt's scheduler and vLLM's front end: output
    processing, detokenising) and of vLLM's engine processes beside it (scheduling and the model's
    step), by role: the same engine's CPU per token in two arms tells its cost from the scheduler's."""
    out = {"front end": sum(psutil.Process().cpu_times()[:2])}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            name = child.name()
            role = "engine core" if "EngineCore" in name else "engine worker" if "Worker" in name else "other"
            out[role] = out.get(role, 0.0) + sum(child.cpu_times()[:2])
    return out


@dataclass
class Workload:
    tenants: int
    rounds: int
    groups: int
    n: int
    median_len: int
    sigma: float
    max_len: int
    pause_s: float
    seed: int
    seeded: bool  # per-request sampling seeds (vLLM then samples those rows one by one)
    mixed: bool = False  # tenants differ in pause, batch size and length (genpool_sim.MIXED)

    def groups_of(self, tenant: int) -> int:
        return max(1, round(self.groups * tenant_shape(tenant, self.mixed)["groups_x"]))

    def pause_of(self, tenant: int) -> float:
        return self.pause_s * tenant_shape(tenant, self.mixed)["pause_x"]

    def lengths(self, tenant: int, rnd: int, group: int) -> tuple[int, ...]:
        rng = random.Random(hash((self.seed, tenant, rnd, group)) & 0xFFFFFFFF)
        median = self.median_len * tenant_shape(tenant, self.mixed)["len_x"]
        return tuple(max(4, min(self.max_len, int(rng.lognormvariate(math.log(median), self.sigma))))
                     for _ in range(self.n))


@dataclass
class ModeResult:
    name: str
    wall_s: float  # the arm's length: until its last batch, or run_for
    target: int
    ttb: dict[int, list[float]] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)  # async: per trained batch, versions behind
    # (running, waiting) sampled every few ms: is idle capacity the admission's fault or no demand?
    occupancy: list[tuple[int, int]] = field(default_factory=list)
    # How long every tenant still had batches to sample (from the start until the first tenant
    # sampled its last): the drain after it, where the slowest tenant samples alone and no pool has
    # anything to fill with, is what the simulator's looping tenants never have.
    window_s: float = 0.0
    seqs: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end from the arm's start, tokens)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process role (cpu_seconds) over the arm
    step_s: float = 0.0  # time inside the scheduler's own step (admission, placing groups) over the arm

    def time_share(self, state: str) -> float:
        """Fraction of samples: `full` (running >= target), `no_demand` (free slots, nothing
        waiting that may run) or `held_back` (free slots while sequences wait: caps or latency)."""
        if not self.occupancy:
            return 0.0
        test = {"full": lambda r, w: r >= self.target, "no_demand": lambda r, w: r < self.target and w == 0,
                "held_back": lambda r, w: r < self.target and w > 0}[state]
        return sum(1 for r, w in self.occupancy if test(r, w)) / len(self.occupancy)

    @property
    def tps(self) -> float:
        return self.within(self.wall_s)[0]

    @property
    def util(self) -> float:
        return self.within(self.wall_s)[1]

    def within(self, window_s: float) -> tuple[float, float]:
        """(tokens/s, slot utilisation) over the arm's first `window_s` seconds, a sequence's tokens
        counted in proportion to its time inside."""
        tokens = busy = 0.0
        for began, ended, n in self.seqs:
            inside = max(0.0, min(ended, window_s) - began)
            busy += inside
            tokens += n * inside / (ended - began) if ended > began else 0.0
        return tokens / window_s, busy / (self.target * window_s)

    @property
    def per_slot_tps(self) -> float:
        """Tokens/s per busy slot: the engine's speed, apart from how full it was kept."""
        return self.tps / (self.util * self.target)

    def p(self, tenant: int, q: float) -> float:
        return pct(self.ttb[tenant], q)

    def per_slot_tps_from_curve(self, rate) -> float:
        """The tokens/s per busy slot the step curve predicts for this arm's running sequences:
        each sampled moment's `running` sequences weighted by the curve's per-sequence `rate` there."""
        busy = [r for r, _ in self.occupancy if r > 0]
        return sum(r * rate(r) for r in busy) / max(sum(busy), 1)

    @property
    def tokens(self) -> int:
        """Tokens generated in the arm (its whole length: a drained arm's tail included)."""
        return sum(n for _, _, n in self.seqs)

    def cpu_ms_per_100_tokens(self, role: str) -> float:
        """`role`'s CPU per token generated in the arm."""
        return 1e5 * self.cpu_s.get(role, 0.0) / max(self.tokens, 1)


async def run_mode(name: str, engine: GenEngine, refs: list[AdapterRef], w: Workload, target: int,
                   ahead: int = 1, run_for: float = 0.0) -> ModeResult:
    """One arm: `shared`, `partitioned` or `serial` tenants sample a batch, wait for it, train; in
    `async` (shared pool) each tenant's next batch samples while its trainer step runs, at most
    `ahead` versions ahead of the trainer (quilt.rl's max_staleness). Each tenant runs `w.rounds`
    batches, or with `run_for` starts batches until that many seconds have passed, and the arm's
    figures are those seconds' (no drain: the simulator's looping tenants)."""
    cap = target // w.tenants if name == "partitioned" else 0
    done: list[Group] = []
    sched, futures = make_scheduler(engine, target, cap, done)
    stop = asyncio.Event()
    cpu_before = cpu_seconds()
    pool = asyncio.create_task(run_pool(sched, stop))
    serial = asyncio.Lock()
    result = ModeResult(name, 0.0, target, {t: [] for t in range(w.tenants)})
    last_sampled: list[float] = []  # per tenant, when its last batch was sampled (the scheduler's clock)

    def more(rnd: int) -> bool:
        return sched.clock() - start < run_for if run_for else rnd < w.rounds

    async def sample_batch(t: int, rnd: int) -> None:
        futs = []
        for gi in range(w.groups_of(t)):
            lengths = w.lengths(t, rnd, gi)
            g = Group(request_id=f"{name}-{t}-{rnd}-{gi}", tenant_id=f"tenant-{t}", prompt=(5 + t, 6, 7, 8),
                      spec=SamplingSpec(max_tokens=max(lengths), eos_stops=False, seed=gi if w.seeded else None),
                      n=w.n, adapter=refs[t], model_id=f"m{t}", lengths=lengths)
            futs.append(submit(sched, futures, g))
        await asyncio.gather(*futs)

    async def tenant(t: int) -> None:
        # Tenants do not start in lockstep, and trainer steps vary (seeded: the same in every mode).
        rng = random.Random(w.seed * 1000 + t)
        await asyncio.sleep(w.pause_s * t / w.tenants)
        rnd, last = 0, sched.clock()
        while more(rnd):
            ready = time.perf_counter()
            async with (serial if name == "serial" else _nothing()):
                await sample_batch(t, rnd)
            result.ttb[t].append(time.perf_counter() - ready)
            rnd, last = rnd + 1, sched.clock()
            await asyncio.sleep(w.pause_of(t) * rng.uniform(0.5, 1.5))  # the trainer step
        last_sampled.append(last)

    async def async_tenant(t: int) -> None:
        rng = random.Random(w.seed * 1000 + t)
        await asyncio.sleep(w.pause_s * t / w.tenants)
        version = 0  # the trainer's steps done
        moved = asyncio.Condition()
        # The version each sampled batch was sampled at; None: the sampler is done.
        sampled: asyncio.Queue[int | None] = asyncio.Queue()

        async def sampler() -> None:
            rnd = 0
            while more(rnd):
                async with moved:
                    await moved.wait_for(lambda: rnd - version <= ahead)
                if not more(rnd):
                    break
                at = version
                await sample_batch(t, rnd)
                sampled.put_nowait(at)
                rnd += 1
            last_sampled.append(sched.clock())
            sampled.put_nowait(None)

        async def trainer() -> None:
            nonlocal version
            while True:
                idle = time.perf_counter()
                at = await sampled.get()
                if at is None:
                    return
                result.ttb[t].append(time.perf_counter() - idle)
                result.staleness.append(version - at)
                await asyncio.sleep(w.pause_of(t) * rng.uniform(0.5, 1.5))
                async with moved:
                    version += 1
                    moved.notify_all()

        await asyncio.gather(sampler(), trainer())

    async def watch() -> None:
        while not run_for or sched.clock() - start < run_for:
            result.occupancy.append((sched.running(), sched.waiting()))
            await asyncio.sleep(0.005)

    start = sched.clock()
    watcher = asyncio.create_task(watch())
    await asyncio.gather(*((async_tenant if name == "async" else tenant)(t) for t in range(w.tenants)))
    # On the scheduler's clock, as the sequences' times are: a whole run holds every sequence whole.
    result.wall_s = run_for or sched.clock() - start
    watcher.cancel()
    stop.set()
    sched.wake()
    result.step_s = await pool
    cpu_after = cpu_seconds()
    result.cpu_s = {role: cpu_after[role] - cpu_before.get(role, 0.0) for role in cpu_after}
    result.window_s = min(last_sampled) - start
    result.seqs = [(g.started_at[i] - start, g.finished_at[i] - start, len(r.tokens))
                   for g in done for i, r in enumerate(g.results) if r is not None]
    return result


class _nothing:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def ideal(w: Workload, target: int, slot_rate: float, step_s: float, seeds: int = 5, ahead: int = 0,
          curve: list[tuple[int, float, float]] | None = None) -> dict:
    """The same workload shape through the simulator's flat-step engine (every running sequence
    decodes `slot_rate` tokens/s however many run) and the same admission function: what sharing
    could give this workload if the engine were ideal (`ahead` 1: its tenants sample one version
    ahead, against synchronous partitions). With `curve` (step_curve's rows) the simulated step
    grows with the batch as this engine's measured one does instead (made non-decreasing: a step
    measured faster with more sequences is noise): what the same admission would give on this
    engine with no other loss (the engine model). Medians over a few seeds."""
    m = Model(slots=target, token_rate=slot_rate, prefill_s=step_s, groups=w.groups, n=w.n,
              median_len=float(w.median_len), sigma=w.sigma, max_len=w.max_len, drift=0.0, pause_s=w.pause_s,
              horizon_s=400.0, quantum_s=max(step_s, 0.02), ahead=ahead, step_ms=step_ms(curve or []))
    return fixed_comparison(m, w.tenants, w.mixed, seeds)


def step_ms(curve: list[tuple[int, float, float]]) -> tuple[tuple[int, float], ...]:
    """step_curve's rows as the simulator's step (made non-decreasing: a step measured faster with
    more sequences is noise)."""
    return tuple(zip((k for k, _, _ in curve), itertools.accumulate((ms for _, ms, _ in curve), max)))


# --------------------------------------------------------------------------- 3. publish latency


async def publish_latency(engine: GenEngine, refs: list[AdapterRef], spare: str, root: Path, trials: int) -> list[float]:
    done: list[Group] = []
    sched, futures = make_scheduler(engine, 32, 0, done)
    stop = asyncio.Event()
    pool = asyncio.create_task(run_pool(sched, stop))
    busy = [submit(sched, futures, Group(request_id=f"busy-{i}", tenant_id="busy", prompt=(5, 6, 7), n=4,
                                         spec=SamplingSpec(max_tokens=200, eos_stops=False), adapter=refs[i % len(refs)]))
            for i in range(4)]
    out = []
    for k in range(trials):
        version = root / f"published-v{k}"
        shutil.copytree(spare, version)  # what save_weights_for_sampler leaves: a new directory
        ref = AdapterRef(key=str(version), path=str(version), model_id="m-new", name="new")
        t0 = time.perf_counter()
        await submit(sched, futures, Group(request_id=f"pub-{k}", tenant_id="pub", prompt=(5, 6, 7), n=1,
                                           spec=SamplingSpec(max_tokens=1), adapter=ref, model_id="m-new"))
        out.append(time.perf_counter() - t0)
    await asyncio.gather(*busy)
    stop.set()
    sched.wake()
    await pool
    return out


# --------------------------------------------------------------------------- main


def ideals(w: Workload, curve: list, target: int, with_async: bool) -> dict:
    """The ideal engine's and the engine model's ratios for this workload (`ideal`), synchronous
    and, `with_async`, one version ahead: the same for every repetition, so simulated once."""
    at_target = next(row for row in curve if row[0] >= target)
    seq_rate = at_target[2] / at_target[0]  # tokens/s of one sequence with the engine at its target
    step_s = at_target[1] / 1000
    out = {"seq_rate": seq_rate, "flat": ideal(w, target, seq_rate, step_s),
           "grown": ideal(w, target, seq_rate, step_s, curve=curve)}
    if with_async:
        out["flat_async"] = ideal(w, target, seq_rate, step_s, ahead=1)
        out["grown_async"] = ideal(w, target, seq_rate, step_s, ahead=1, curve=curve)
    return out


def report(results: dict[str, ModeResult], w: Workload, curve: list, target: int, sims: dict) -> dict:
    """One repetition's table and figures: every arm side by side, the ratio split into its factors,
    and how far each reaches the ideal engine and engine model of `sims` (`ideals`); returns the
    headline figures."""
    print(f"\n{'':<22}" + "".join(f"{m:>14}" for m in results))
    print(f"{'tokens/s':<22}" + "".join(f"{r.tps:>14.0f}" for r in results.values()))
    print(f"{'slot utilisation':<22}" + "".join(f"{r.util:>14.2f}" for r in results.values()))
    print(f"{'tok/s per busy slot':<22}" + "".join(f"{r.per_slot_tps:>14.1f}" for r in results.values()))
    print(f"{'wall s':<22}" + "".join(f"{r.wall_s:>14.1f}" for r in results.values()))
    print(f"{'all tenants active, s':<22}" + "".join(f"{r.window_s:>14.1f}" for r in results.values()))
    # One window for every arm (the shortest): the same stretch of the same seeded workload.
    common = min(r.window_s for r in results.values())
    active = {m: r.within(common) for m, r in results.items()}
    print(f"{f'first {common:.0f} s: tokens/s':<22}" + "".join(f"{a[0]:>14.0f}" for a in active.values()))
    print(f"{'  slot utilisation':<22}" + "".join(f"{a[1]:>14.2f}" for a in active.values()))
    for state, label in (("full", "time full"), ("no_demand", "time, no demand"),
                         ("held_back", "time, work held back")):
        print(f"{label:<22}" + "".join(f"{r.time_share(state):>14.2f}" for r in results.values()))
    for t in range(w.tenants):
        print(f"{f'tenant {t} ttb p50/p95 s':<22}" +
              "".join(f"{f'{r.p(t, 0.5):.2f}/{r.p(t, 0.95):.2f}':>14}" for r in results.values()))
    for role in ("front end", "engine core", "engine worker"):
        print(f"{f'{role} CPU ms/100 tok':<22}" +
              "".join(f"{r.cpu_ms_per_100_tokens(role):>14.1f}" for r in results.values()))
    print(f"{'sched.step ms/100 tok':<22}" +
          "".join(f"{1e5 * r.step_s / max(r.tokens, 1):>14.2f}" for r in results.values()))
    print(f"{'staleness mean/max':<22}" + "".join(
        f"{f'{statistics.fmean(r.staleness):.2f}/{max(r.staleness)}' if r.staleness else '0/0':>14}"
        for r in results.values()))
    shared, part = results["shared"], results["partitioned"]
    ratios = [shared.p(t, 0.95) / part.p(t, 0.95) for t in range(w.tenants)]
    util_ratio, rate_ratio = shared.util / part.util, shared.per_slot_tps / part.per_slot_tps
    seq_rate, flat, grown = sims["seq_rate"], sims["flat"], sims["grown"]
    curve_rate = Model(step_ms=step_ms(curve)).rate
    from_curve = shared.per_slot_tps_from_curve(curve_rate) / part.per_slot_tps_from_curve(curve_rate)
    print(f"\nshared / partitioned tokens/s {shared.tps / part.tps:.2f} = utilisation ratio {util_ratio:.2f} "
          f"x per-busy-slot rate ratio {rate_ratio:.2f} (the step curve at each arm's running sequences "
          f"predicts {from_curve:.2f})")
    print(f"ideal engine (simulated: flat decode step at the measured {seq_rate:.0f} tok/s per "
          f"sequence, same workload shape and admission): {flat['ratio']:.2f}x, utilisation "
          f"{flat['util_shared']:.2f} vs {flat['util_partitioned']:.2f}; shared reaches "
          f"{shared.tps / part.tps / flat['ratio']:.2f} of it")
    print(f"engine model (simulated: this engine's measured step curve, same workload and admission): "
          f"{grown['ratio']:.2f}x; shared reaches {shared.tps / part.tps / grown['ratio']:.2f} of it "
          f"(the rest of the ideal engine's gap is the step growing with the batch)")
    early = active["shared"][0] / active["partitioned"][0]
    print(f"over the first {common:.0f} s of every arm, while every tenant still had batches to sample (no drain "
          f"where the slowest tenant samples alone, which the simulator's looping tenants never have): shared / "
          f"partitioned {early:.2f}, {early / flat['ratio']:.2f} of the ideal engine, "
          f"{early / grown['ratio']:.2f} of the engine model")
    extra = {}
    if "async" in results:
        ahead = results["async"]
        flat_async, grown_async = sims["flat_async"], sims["grown_async"]
        early_async = active["async"][0] / active["partitioned"][0]
        print(f"async (one version ahead) / partitioned tokens/s {ahead.tps / part.tps:.2f}, "
              f"{ahead.tps / shared.tps:.2f}x synchronous shared; ideal engine {flat_async['ratio']:.2f}x "
              f"(reached {ahead.tps / part.tps / flat_async['ratio']:.2f}); trained data "
              f"{statistics.fmean(ahead.staleness):.2f} versions behind on average, at most {max(ahead.staleness)}; "
              f"engine model {grown_async['ratio']:.2f}x (reached {ahead.tps / part.tps / grown_async['ratio']:.2f}); "
              f"first {common:.0f} s: {early_async:.2f}x partitioned, "
              f"{early_async / flat_async['ratio']:.2f} of the ideal engine")
        extra = {"async_over_partitioned_tps": round(ahead.tps / part.tps, 3),
                 "async_over_shared_tps": round(ahead.tps / shared.tps, 3),
                 "async_over_ideal": round(ahead.tps / part.tps / flat_async["ratio"], 3),
                 "ideal_flat_step_async_over_partitioned_tps": round(flat_async["ratio"], 3),
                 "async_over_engine_model": round(ahead.tps / part.tps / grown_async["ratio"], 3),
                 "async_over_partitioned_tps_all_active": round(early_async, 3),
                 "async_over_ideal_all_active": round(early_async / flat_async["ratio"], 3),
                 "async_worst_tenant_p95_ttb_ratio": round(max(ahead.p(t, 0.95) / part.p(t, 0.95)
                                                               for t in range(w.tenants)), 3),
                 "async_staleness_mean": round(statistics.fmean(ahead.staleness), 3),
                 "async_staleness_max": max(ahead.staleness)}
    summary = {
        "shared_over_partitioned_tps": round(shared.tps / part.tps, 3),
        "worst_tenant_p95_ttb_ratio": round(max(ratios), 3),
        "slot_util_shared": round(shared.util, 3),
        "slot_util_partitioned": round(part.util, 3),
        "slot_util_serial": round(results["serial"].util, 3),
        "per_slot_rate_ratio": round(rate_ratio, 3),
        "per_slot_rate_ratio_from_curve": round(from_curve, 3),
        "ideal_flat_step_shared_over_partitioned_tps": round(flat["ratio"], 3),
        "shared_over_ideal": round(shared.tps / part.tps / flat["ratio"], 3),
        "engine_model_shared_over_partitioned_tps": round(grown["ratio"], 3),
        "shared_over_engine_model": round(shared.tps / part.tps / grown["ratio"], 3),
        "all_active_window_s": round(common, 1),
        "shared_over_partitioned_tps_all_active": round(early, 3),
        "shared_over_ideal_all_active": round(early / flat["ratio"], 3),
        "shared_over_engine_model_all_active": round(early / grown["ratio"], 3),
        **extra,
        "cpu_ms_per_100_tokens": {m: {role: round(r.cpu_ms_per_100_tokens(role), 2) for role in r.cpu_s}
                                  for m, r in results.items()},
        "shared_time_no_demand": round(shared.time_share("no_demand"), 3),
        "shared_time_held_back": round(shared.time_share("held_back"), 3),
        "tps": {m: round(r.tps, 1) for m, r in results.items()},
        "step_ms_1_vs_target": [round(curve[0][1], 1), round(next(ms for k, ms, _ in curve if k >= target), 1)],
    }
    return summary


HEADLINE = ("shared_over_partitioned_tps", "shared_over_ideal", "shared_over_engine_model",
            "worst_tenant_p95_ttb_ratio", "per_slot_rate_ratio", "per_slot_rate_ratio_from_curve",
            "async_over_partitioned_tps", "async_over_ideal", "async_over_engine_model")


def _median_of(shape: dict, dicts: list[dict]) -> dict:
    """Key by key, the median of the repetitions' values (nested dicts alike)."""
    return {k: _median_of(v, [d[k] for d in dicts]) if isinstance(v, dict)
            else round(statistics.median(d.get(k, 0.0) for d in dicts), 2) for k, v in shape.items()}


def over_repeats(reps: list[dict]) -> dict:
    """The figures over interleaved repetitions: each the median of the repetitions' own (every arm
    of a repetition ran within minutes of the others, so a slow spell of the host lands in one
    repetition, not in one arm). One repetition: its figures as they are."""
    if len(reps) == 1:
        return reps[0]
    out: dict = {}
    for key, value in reps[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = round(statistics.median(r[key] for r in reps), 3)
        elif isinstance(value, dict):
            out[key] = _median_of(value, [r[key] for r in reps])
        else:
            out[key] = value
    print(f"\nover {len(reps)} interleaved repetitions (each the median of the repetitions' own):")
    shown = [k for k in HEADLINE if k in out]
    print(f"{'':<34}" + "".join(f"{i + 1:>8}" for i in range(len(reps))) + f"{'median':>9}")
    for key in shown:
        print(f"{key:<34}" + "".join(f"{r[key]:>8.2f}" for r in reps) + f"{out[key]:>9.2f}")
    out["repeats"] = {key: [r[key] for r in reps] for key in shown}
    return out


async def main_async(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="genpool-fill-"))
    try:
        base, paths = build(root, args.tenants)
        settings = GenPoolSettings(max_loras=args.tenants + 2, max_cpu_loras=4 * args.tenants + 8, max_lora_rank=8,
                                   concurrency_target=2 * args.target, kv_cache_gib=1)
        t0 = time.perf_counter()
        engine = await GenEngine.start(base, settings, root / "work")
        print(f"engine start: {time.perf_counter() - t0:.1f} s (model {BENCH_SPEC})", flush=True)
        refs = [AdapterRef(key=p, path=p, model_id=f"m{i}", name=f"t{i}") for i, p in enumerate(paths[:-1])]
        for r in refs:
            await engine.load(r)
        await step_curve(engine, refs, 4, args.seeded)  # warm-up

        print(f"\n1. decode-step curve (mixed adapters, 48 tokens each, {'seeded' if args.seeded else 'unseeded'})")
        print(f"{'running':>8} {'ms/step':>9} {'tokens/s':>9}")
        curve = await step_curve(engine, refs, args.target, args.seeded)
        for k, ms, tps in curve:
            print(f"{k:>8} {ms:>9.1f} {tps:>9.0f}")
        w = Workload(args.tenants, args.rounds, args.groups, args.n, args.median_len, args.sigma, args.max_len,
                     args.pause, args.seed, args.seeded, args.mix == "mixed")
        mean_len = statistics.mean(x for t in range(w.tenants) for r in range(w.rounds) for gi in range(w.groups_of(t))
                                   for x in w.lengths(t, r, gi))
        batches = f"{args.run_for:.0f} s of batches" if args.run_for else f"{w.rounds} rounds"
        print(f"\n2. {w.tenants} tenants x {batches} x {w.groups} groups x n={w.n}; lengths lognormal "
              f"(median {w.median_len}, sigma {w.sigma}, cap {w.max_len}, mean {mean_len:.0f}); pause {w.pause_s} s; "
              f"target {args.target} running sequences; tenants {args.mix}", flush=True)
        if w.mixed:
            for t in range(w.tenants):
                print(f"   tenant {t}: {w.groups_of(t)} groups, pause {w.pause_of(t):.2f} s, "
                      f"median length {w.median_len * tenant_shape(t, True)['len_x']:.0f}")
        sims = ideals(w, curve, args.target, args.async_arm)
        reps = []
        for rep in range(args.repeats):
            if args.repeats > 1:
                print(f"\n   repetition {rep + 1} of {args.repeats}", flush=True)
            results = {}
            for mode in ("shared", "partitioned", "serial", *(("async",) if args.async_arm else ())):
                results[mode] = await run_mode(mode, engine, refs, w, args.target, run_for=args.run_for)
                r = results[mode]
                print(f"   {mode:<12} done in {r.wall_s:6.1f} s", flush=True)
            reps.append(report(results, w, curve, args.target, sims))
        summary = over_repeats(reps)
        lat = await publish_latency(engine, refs, paths[-1], root, args.publish_trials)
        print(f"\n3. publish-to-first-token while busy: p50 {1000 * statistics.median(lat):.0f} ms, "
              f"max {1000 * max(lat):.0f} ms over {len(lat)} new versions")
        engine.shutdown()
        summary["publish_to_first_token_ms_p50"] = round(1000 * statistics.median(lat), 1)
        summary["workload"] = {"tenants": args.mix, "groups": w.groups, "n": w.n, "sigma": w.sigma,
                               "pause_s": w.pause_s, "run_for_s": args.run_for or None, "repeats": args.repeats}
        # The targets: the shared pool at least 0.97 of the ideal engine for this workload,
        # at least 1.5x partitioned where tenants differ, and no tenant's p95 past 1.1x its partition's.
        summary["target_met"] = (summary["shared_over_ideal"] >= 0.97 and summary["worst_tenant_p95_ttb_ratio"] <= 1.1
                                 and (not w.mixed or summary["shared_over_partitioned_tps"] >= 1.5))
        return summary
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--target", type=int, default=32, help="running sequences the engine is kept at")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--run-for", type=float, default=0.0,
                    help="instead of --rounds: every tenant starts batches for this many seconds, and each arm's "
                         "figures are those seconds' (no drain at the end, as in the simulator)")
    ap.add_argument("--groups", type=int, default=16, help="sample(n) groups per batch")
    ap.add_argument("--n", type=int, default=4, help="sequences per group")
    ap.add_argument("--median-len", type=int, default=32)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--pause", type=float, default=1.5, help="seconds of 'trainer step' between batches")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every arm this many times, interleaved (shared, partitioned, ... then again), and "
                         "report each figure as the median of the repetitions' own")
    ap.add_argument("--publish-trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="seeds the workload (lengths, pauses)")
    ap.add_argument("--mix", choices=("same", "mixed"), default="same",
                    help="identical tenants, or tenants that differ in pause, batch size and length")
    ap.add_argument("--async", dest="async_arm", action="store_true",
                    help="a fourth arm: the shared pool with every tenant sampling one version ahead of its trainer")
    ap.add_argument("--seeded", action="store_true",
                    help="give every sequence a sampling seed (RL rollouts usually do not; costs per row)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.publish_trials = 2, 2
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
