"""The pool's execution core: groups in, sequences through the engine, finished groups out.

`Scheduler` owns the unfinished groups of one engine. Each `step()` builds a `PoolView`, asks the
pure admission policy for a plan, and carries it out: aborts fail their group, admits start one
engine task per sequence. When a group's last sequence finishes (or the group fails) the
`on_finish` callback gets a `SampleOutcome` or a `QuiltError`. No Redis and no Postgres here: the
worker (gen_pool.worker) wraps this with the queue and the records, and bench/genpool_fill.py
drives it directly, so both run exactly the same admission and execution.

Everything runs on one asyncio loop; state is only touched from it, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from billing.pricing import prompt_cache_hits
from checkpoints.layout import policy_version
from core import health
from core.errors import QuiltError, ServerError, UserError
from core.work import AdapterRef, ImageInput, SamplingSpec
from gen_pool import outputs, wire
from gen_pool.adapters import AdapterError
from gen_pool.admission import (
    GRACE_SEQUENCES,
    AdmissionPlan,
    BatchLedger,
    GroupView,
    PoolView,
    plan_admission,
)
from gen_pool.engine import GenEngine, ProbeRequest, SeqRequest, SeqResult
from gen_pool.episodes import EpisodeLedger, FeedbackLevels
from gen_pool.hf_engine import HFEngine

log = logging.getLogger("quilt.gen.scheduler")


class DeadlineExceeded(UserError):
    """A request was still unfinished at its deadline; its sequences were aborted."""


class Cancelled(UserError):
    """The caller cancelled the request (cancel_future); its sequences were aborted."""


@dataclass
class Group:
    """One sample(n) request: n sequences that finish together (a GRPO group)."""

    request_id: str
    tenant_id: str
    prompt: tuple[int, ...]
    spec: SamplingSpec
    n: int
    adapter: AdapterRef | None = None  # None = the base model
    model_id: str = ""  # tags the sequences (the base model's name for a base)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    prompt_topk: int = 0
    sample_topk: int = 0
    targets: outputs.PromptTargets | None = None  # ids to score at prompt positions (gen_pool.outputs)
    alt_k: int = 0  # draws at every prompt position
    record_stability: bool = False  # the worker keeps each sequence's record (gen_pool.stability)
    on_tokens: Any = None  # streamed: (sequence index, offset, new tokens) -> None, as they are sampled
    arrival: float = field(default_factory=time.time)
    deadline: float | None = None
    lengths: tuple[int, ...] | None = None  # per-sequence max_tokens (benchmarks); None = spec's
    episode: str | None = None  # the multi-turn episode it is a call of (gen_pool.episodes)
    episode_hint: str | None = None  # the client's "promote" / "demote" for that episode
    context: Any = None  # the caller's (the worker keeps its stream entry here)
    images: tuple[ImageInput, ...] = ()  # a vision base's prompt images (the trainer-side sampler's)
    # --- progress
    ready: bool = False
    held: bool = False  # the engine holds its adapter for it (loaded, not released yet)
    cancelled: bool = False
    n_admitted: int = 0
    n_finished: int = 0
    version: int = 0
    done: bool = False
    results: list[SeqResult | None] = field(default_factory=list)
    probes: dict[int, outputs.Probe] = field(default_factory=dict)  # prompt row -> what its probe found
    tasks: dict[int, asyncio.Task] = field(default_factory=dict)
    started_at: list[float] = field(default_factory=list)  # per sequence, when admitted
    finished_at: list[float] = field(default_factory=list)  # per sequence, when done

    def __post_init__(self) -> None:
        self.results = [None] * self.n
        self.started_at = [0.0] * self.n
        self.finished_at = [0.0] * self.n

    def view(self, level: int = 0) -> GroupView:
        return GroupView(self.request_id, self.tenant_id, self.arrival, self.n, self.n_admitted,
                         self.n_finished, self.deadline, self.ready, self.cancelled, level)


OnFinish = Callable[[Group, "wire.SampleOutcome | QuiltError"], None]


class Occupancy:
    """Integrates the engine's occupancy over time, so slot utilisation and gap filling can be read
    off cumulative counters (a reader takes differences between two beacons).

    ``slot_s``: running sequences x seconds; ``capacity_s``: concurrency target x seconds;
    ``active_s``: seconds with anything running; ``mixed_s``: seconds with two or more tenants'
    sequences running at once, the gap filling a shared pool exists for.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last = clock()
        self.slot_s = self.capacity_s = self.active_s = self.mixed_s = 0.0

    def tick(self, running_by_tenant: Counter[str], target: int) -> None:
        """Account the time since the last tick to the state that held until now."""
        now = self.clock()
        dt = max(now - self.last, 0.0)
        self.last = now
        running = sum(running_by_tenant.values())
        self.slot_s += min(running, target) * dt
        self.capacity_s += target * dt
        if running:
            self.active_s += dt
        if len(running_by_tenant) >= 2:
            self.mixed_s += dt

    def totals(self) -> dict[str, float]:
        return {"slot_s": round(self.slot_s, 3), "capacity_s": round(self.capacity_s, 3),
                "active_s": round(self.active_s, 3), "mixed_s": round(self.mixed_s, 3)}


class Scheduler:
    def __init__(self, engine: GenEngine | HFEngine, *, target: int, on_finish: OnFinish, default_cap: int = 0,
                 tenant_caps: dict[str, int] | None = None, levels: FeedbackLevels = FeedbackLevels(),  # noqa: B008
                 clock: Callable[[], float] = time.time):
        self.engine = engine
        self.target = target
        self.on_finish = on_finish
        self.default_cap = default_cap
        self.tenant_caps = dict(tenant_caps or {})
        self.ledger = BatchLedger()  # admission rule 3: what each tenant's pending batch has held
        self.episodes = EpisodeLedger(levels)  # admission rule 6: what each episode has consumed
        self.clock = clock
        self.groups: dict[str, Group] = {}
        self.wakeup = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self.stats = {"groups": 0, "sequences": 0, "tokens": 0, "aborted": 0}
        self.occupancy = Occupancy(clock)
        self.tenant_tokens: Counter[str] = Counter()
        self.group_latencies: deque[float] = deque(maxlen=256)  # arrival -> complete, recent groups
        self.sequence_seconds: deque[float] = deque(maxlen=256)  # admitted -> done, recent sequences
        self.queue_waits: deque[float] = deque(maxlen=health.WAITS_KEPT)  # arrival -> first admitted, recent groups

    # ------------------------------------------------------------------ intake

    def add(self, g: Group) -> None:
        """Take a group; its adapter is loaded (and checked) before any of it is admitted."""
        if g.request_id in self.groups:
            return
        self.groups[g.request_id] = g
        self.ledger.open(g.tenant_id, g.arrival)
        if g.episode is not None:
            self.episodes.hint(g.tenant_id, g.episode, g.episode_hint)
        self.stats["groups"] += 1
        self.spawn(self._prepare(g))

    def cancel(self, request_id: str) -> bool:
        g = self.groups.get(request_id)
        if g is None or g.done:
            return False
        g.cancelled = True
        self.wake()
        return True

    async def _prepare(self, g: Group) -> None:
        try:
            if g.adapter is not None:
                await self.engine.load(g.adapter)
                g.held = True
                if g.done:  # failed (a deadline, a cancel) while its adapter loaded
                    self._release(g)
                    return
                g.version = policy_version(g.adapter.path)
            g.ready = True
        except AdapterError as exc:
            self._fail(g, exc)
        except Exception as exc:
            log.exception("preparing %s failed", g.request_id)
            self._fail(g, ServerError(f"could not prepare the adapter: {type(exc).__name__}: {exc}"))
        self.wake()

    # ------------------------------------------------------------------ the step

    def view(self) -> PoolView:
        now = self.clock()
        live = [g for g in self.groups.values() if not g.done]
        running_s: Counter[str] = Counter()
        for g in live:
            running_s[g.tenant_id] += sum(now - g.started_at[i] for i in range(g.n_admitted) if g.results[i] is None)
        recent = self.sequence_seconds
        grace_s = GRACE_SEQUENCES * sum(recent) / len(recent) if recent else 0.0
        return PoolView(now=now, target=self.target, tenant_caps=self.tenant_caps, default_cap=self.default_cap,
                        grace_s=grace_s,
                        groups=[g.view(self.episodes.level(g.tenant_id, g.episode, now - g.arrival)) for g in live],
                        since=dict(self.ledger.since),
                        received=self.ledger.received(running_s))

    def step(self) -> AdmissionPlan:
        """Plan (pure) and carry out the plan."""
        plan = plan_admission(self.view())
        self.occupancy.tick(self._running_by_tenant(), self.target)
        for a in plan.aborts:
            g = self.groups.get(a.request_id)
            if g is not None and not g.done:
                self.stats["aborted"] += 1
                self._fail(g, self._abort_error(g, a.reason))
        for a in plan.admits:
            g = self.groups[a.request_id]
            if g.n_admitted == 0:  # the group's wait ends when its first sequence enters the engine
                self.queue_waits.append(self.clock() - g.arrival)
            for _ in range(a.count):
                index = g.n_admitted
                g.n_admitted += 1
                g.started_at[index] = self.clock()
                g.tasks[index] = asyncio.create_task(self._run_sequence(g, index), name=f"{g.request_id}:{index}")
        return plan

    def next_deadline(self) -> float | None:
        deadlines = [g.deadline for g in self.groups.values() if not g.done and g.deadline is not None]
        return min(deadlines) if deadlines else None

    async def wait(self, max_s: float) -> None:
        """Sleep until something changed (new work, a finished sequence) or the next deadline."""
        timeout = max_s
        deadline = self.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(deadline - self.clock(), 0.0))
        try:
            await asyncio.wait_for(self.wakeup.wait(), timeout=max(timeout, 0.002))
        except TimeoutError:
            pass
        self.wakeup.clear()

    def wake(self) -> None:
        self.wakeup.set()

    def _running_by_tenant(self) -> Counter[str]:
        running: Counter[str] = Counter()
        for g in self.groups.values():
            if not g.done and g.n_admitted > g.n_finished:
                running[g.tenant_id] += g.n_admitted - g.n_finished
        return running

    def report(self) -> dict[str, Any]:
        """Counters and gauges for the health beacon (dashboard, /metrics, examples)."""
        self.occupancy.tick(self._running_by_tenant(), self.target)
        latencies = sorted(self.group_latencies)
        return {
            **self.stats, **self.occupancy.totals(),
            "tenants_running": len(self._running_by_tenant()),
            "episodes_tracked": len(self.episodes),
            "group_latency_p50_s": round(statistics.median(latencies), 4) if latencies else None,
            "group_latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 4) if latencies else None,
            "tenant_tokens": dict(self.tenant_tokens),
            **health.wait_figures(self.queue_waits),
        }

    def running(self) -> int:
        return sum(g.n_admitted - g.n_finished for g in self.groups.values() if not g.done)

    def waiting(self) -> int:
        return sum(g.n - g.n_admitted for g in self.groups.values() if not g.done)

    # ------------------------------------------------------------------ sequences

    async def _run_sequence(self, g: Group, index: int) -> None:
        spec = g.spec if g.lengths is None else dataclasses.replace(g.spec, max_tokens=g.lengths[index])
        req = SeqRequest(engine_id=f"{g.request_id}:{index}", prompt=g.prompt, spec=spec,
                         seed=g.spec.sample_seed(index), adapter=g.adapter,
                         prompt_logprobs=(g.prompt_logprobs or g.prompt_topk > 0) and index == 0,
                         prompt_topk=g.prompt_topk, sample_topk=g.sample_topk, tenant_id=g.tenant_id, images=g.images,
                         on_tokens=None if g.on_tokens is None else _with_offsets(functools.partial(g.on_tokens,
                                                                                                     index)))
        try:
            result = await self.engine.generate(req)
            if index == 0 and (g.targets is not None or g.alt_k):
                g.probes = await self._probe(g)
        except asyncio.CancelledError:
            return
        except QuiltError as exc:
            self._fail(g, exc)
            return
        except Exception as exc:  # one sequence must not take the pool down silently
            log.exception("sequence %s failed", req.engine_id)
            self._fail(g, ServerError(f"sampling failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            self.wake()
        if g.done:
            return
        self.occupancy.tick(self._running_by_tenant(), self.target)
        g.results[index] = result
        g.finished_at[index] = self.clock()
        g.n_finished += 1
        self.ledger.add(g.tenant_id, g.finished_at[index] - g.started_at[index])
        self.sequence_seconds.append(g.finished_at[index] - g.started_at[index])
        if g.episode is not None:
            self.episodes.consume(g.tenant_id, g.episode, len(result.tokens))
        self.stats["sequences"] += 1
        self.stats["tokens"] += len(result.tokens)
        self.tenant_tokens[g.tenant_id] += len(result.tokens)
        if result.stop_reason == "abort":
            self._fail(g, ServerError(f"sequence {index} of {g.request_id} was aborted by the engine"))
        elif g.n_finished == g.n:
            self._complete(g)

    async def _probe(self, g: Group) -> dict[int, outputs.Probe]:
        """The group's target logprobs and prompt alternatives: one probe per prompt row that needs
        one (gen_pool.outputs), run inside the slot of the group's first sequence,
        QUILT_GEN_PROBES_AT_ONCE at a time so other groups' sequences keep most of the engine's batches."""
        rows = outputs.probe_rows(g.targets, len(g.prompt) - 1 if g.alt_k else 0)
        found: dict[int, outputs.Probe] = {}

        async def one(row: int, ids: tuple[int, ...]) -> None:
            seed = g.spec.sample_seed(g.n + row)  # past the group's own sequences' seeds
            scores, draws = await self.engine.probe(ProbeRequest(
                engine_id=f"{g.request_id}:probe:{row}", prompt=g.prompt[:row + 1], ids=ids, draws=g.alt_k,
                temperature=g.spec.temperature if g.alt_k else 0.0, seed=seed, adapter=g.adapter,
                tenant_id=g.tenant_id))
            found[row] = outputs.Probe(scores, draws)

        pending, at_once = list(rows.items()), self.engine.settings.probes_at_once
        while pending:
            batch, pending = pending[:at_once], pending[at_once:]
            await asyncio.gather(*(one(row, ids) for row, ids in batch))
        return found

    def _release(self, g: Group) -> None:
        if g.held and g.adapter is not None:
            g.held = False
            self.engine.release(g.adapter)

    def _done(self, g: Group) -> None:
        g.done = True
        self._release(g)
        self.groups.pop(g.request_id, None)
        if not any(x.tenant_id == g.tenant_id for x in self.groups.values()):
            self.ledger.close(g.tenant_id)

    def _complete(self, g: Group) -> None:
        self._done(g)
        self.group_latencies.append(self.clock() - g.arrival)
        seqs = tuple(wire.SampledSequence(r.tokens, r.logprobs, r.stop_reason, g.model_id, g.version,
                                          r.sample_topk if g.sample_topk else None)
                     for r in g.results)
        keep_from = 0 if g.prompt_logprobs_last_n is None else max(len(g.prompt) - g.prompt_logprobs_last_n, 0)

        def last_n(values):
            values = values or tuple([None] * len(g.prompt))
            return tuple(None if i < keep_from else x for i, x in enumerate(values))

        prompt_lps = last_n(g.results[0].prompt_logprobs) if g.prompt_logprobs else None
        topk = last_n(g.results[0].prompt_topk) if g.prompt_topk else None
        try:
            targets = None if g.targets is None else outputs.target_tensor(g.targets, g.probes)
            alts = outputs.alt_tensors(len(g.prompt) - 1, g.alt_k, g.probes) if g.alt_k else None
        except (KeyError, ValueError) as exc:  # a probe's answer missing what it asked for: the engine's fault
            self.on_finish(g, ServerError(f"sampling outputs of {g.request_id} are incomplete: {exc}"))
            return
        hits = prompt_cache_hits(len(g.prompt), tuple(r.cached_tokens for r in g.results if r is not None))
        self.on_finish(g, wire.SampleOutcome(seqs, prompt_lps, topk, targets, alts, prompt_cache_hit_tokens=hits))

    def _fail(self, g: Group, err: QuiltError) -> None:
        if g.done:
            return
        self.occupancy.tick(self._running_by_tenant(), self.target)
        self._done(g)
        current = asyncio.current_task()
        for t in g.tasks.values():
            if not t.done() and t is not current:
                t.cancel()  # the engine aborts a cancelled sequence
        log.info("request %s failed: %s", g.request_id, err.message)
        self.on_finish(g, err)

    def _abort_error(self, g: Group, reason: str) -> QuiltError:
        if reason == "cancelled":
            return Cancelled(f"request {g.request_id} was cancelled ({g.n_finished} of {g.n} sequences had finished)")
        waited = self.clock() - g.arrival
        return DeadlineExceeded(
            f"request {g.request_id} passed its deadline after {waited:.1f} s with {g.n_finished} of {g.n} "
            "sequences finished; it was aborted (raise deadline_s or lower max_tokens)", field="deadline_s")

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def shutdown(self) -> None:
        for g in list(self.groups.values()):
            for t in g.tasks.values():
                t.cancel()


def _with_offsets(emit: Callable[[int, tuple[int, ...]], None]) -> Callable[[tuple[int, ...]], None]:
    """One run of a sequence's streamed tokens, each step's with its position in the sequence. A
    sequence run again (aborted and re-admitted here, or re-run by another worker after this one
    died) starts again at 0, which tells the stream's reader what it already has."""
    sent = 0

    def call(tokens: tuple[int, ...]) -> None:
        nonlocal sent
        emit(sent, tokens)
        sent += len(tokens)
    return call
