"""Load on one API process: 64 clients across 8 tenants making cheap calls in bounded loops.

    .venv/bin/python bench/api_load.py [--seconds 150] [--clients 64] [--tenants 8]

Starts its own embedded stack (`quilt up` in a temporary data directory), gives each tenant a
model with one finished forward_backward, then runs two phases of `--seconds` each, 64 clients
(one connection each, loopback only) cycling through the calls the issue names as cheap:
`get_info`, `create_session` and `retrieve_future` of a finished future (the API's
result-ready-to-response path), plus a `forward_backward` submission every `--submit-every` calls
(the submit-to-enqueue path; the trainer runs them).

1. **Capacity**: every client sends its next call as soon as the last one answers. Requests per
   second here is what one API process does; since the clients, Postgres, Redis and the workers
   share this 2-core machine, it also prints requests per second of the API process's own CPU
   time (read from /proc), the capacity of one API process on a core of its own.
   Then, for `--floor-seconds`, the same clients against a FastAPI app that answers every call
   with a constant (bench/framework_floor.py) on the API's core: what the framework alone costs
   per call on this host at this hour. Quilt's requests per CPU-second over the floor's is a
   ratio a host running at half speed leaves in place.
2. **Paced**: the same clients send at `--paced-share` of the measured capacity in all, or at
   `--rate` requests/s (Poisson arrivals), the regime a service runs in. Per call it prints the
   client's latency and the API's own time (`Server-Timing: app;dur`, from the request reaching
   the app to its answer starting): the overhead per future the issue bounds (p99 at most 10 ms).
   Where the slowest 1% of each call spent that time comes beside it: waiting for a pooled
   connection, on Postgres, on Redis (the header's `pool`, `pg` and `redis`, core.waits), and the
   rest, the API's own CPU and its event loop's queue; how fast the stores answered a client
   of their own meanwhile (a Redis PING and a Postgres `SELECT 1` every 20 ms); and how late the
   API's event loop ran meanwhile (core.loop_lag's histogram, read from its beacons before and
   after each phase, so it also holds up to a second of the quieter time either side). A wait far
   longer than the stores' answers, beside a late loop, is the answer sitting unread while the
   API's event loop ran other calls: the API's own queue. With `--pg-waits`, each phase also
   prints the Postgres statements seen running for 5 ms or more and what they waited on
   (`PgWaitProbe`): how the zero-filled WAL segments behind the submissions' slowest calls were
   found (core/embedded.py).

With `--pin` (the default where there are at least 2 CPUs) the API process runs on CPU 0 and
everything else (clients, Postgres, Redis, workers) on the others, so nothing else runs on the
API's core. There the workers keep the low priority `quilt up` gives them (QUILT_WORKER_NICE,
stack.priority), so Postgres and Redis, woken by the API's statements, take the core from them at
once; the load generator keeps an ordinary weight (lowered, it fell behind its Poisson schedule and
sent its calls in bursts, which queued in the API). Postgres and Redis daemonize, so they are found
by asking each server its pid (`_stores`), not in this process's tree. Phase 2 runs in `--slices`
turns of each `--layouts` entry: `api` is that layout; `service` moves Postgres and Redis onto the
API's core, away from the 64 clients and the trainer but taking turns with the API: a backend that
a statement wakes runs there, in the API's place, until it answers. A deployment, whose stores
have machines of their own, has neither cost; the two layouts bracket it. `flat` is `api` with
every process at one CPU weight, as before the launcher set priorities. Alternating layouts in one
run puts a slow spell of this shared host on each. The clients use aiohttp: an httpx client in
this loop spent more CPU per call than the API did (about 1,100 calls/s from a whole core against
a trivial FastAPI app, aiohttp 6,000).
Ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import psutil
import psycopg
import redis

from core import loop_lag, waits
from core.settings import get_api_settings, get_core_settings
from stack import priority
from stack.ephemeral import TINY, RunningStack, ephemeral_stack, free_port, new_tenant


def _wait(c: httpx.Client, request_id: str) -> dict:
    while True:
        body = c.post("/retrieve_future", json={"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return body


def _datum(tokens: list[int]) -> dict:
    n = len(tokens) - 1
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
                               "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]}}}


def prepare_tenants(stack: RunningStack, n: int) -> list[dict]:
    """n tenants, each with a key, a session, a model and one finished forward_backward."""
    out = []
    for i in range(n):
        _tenant_id, key = new_tenant(stack, f"load-{i}", max_inflight_requests=10_000, tokens_per_minute=100_000_000)
        with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=120) as c:
            session_id = c.post("/create_session", json={}).json()["session_id"]
            r = c.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": TINY,
                                              "lora_config": {"rank": 4}})
            model_id = _wait(c, r.json()["request_id"])["model_id"]
            r = c.post("/forward_backward", json={"model_id": model_id, "seq_id": 1, "forward_backward_input": {
                "data": [_datum([1, 2, 3, 4])], "loss_fn": "cross_entropy"}})
            finished = r.json()["request_id"]
            _wait(c, finished)
        out.append({"key": key, "model_id": model_id, "finished": finished})
    return out


CALLS = ("get_info", "create_session", "retrieve_future")


def cheap_bodies(tenant: dict) -> dict[str, dict]:
    """The body of each of CALLS for a tenant of `prepare_tenants`."""
    return {"get_info": {"model_id": tenant["model_id"]}, "create_session": {},
            "retrieve_future": {"request_id": tenant["finished"]}}


async def _client(session: aiohttp.ClientSession, base_url: str, tenant: dict, seq: list[int], stride: int,
                  stop_at: float, submit_every: int, rate: float, rng: random.Random) -> dict[str, list]:
    """One client's bounded loop; returns {call: [(latency_s, app_s) or (-status, 0)]} and leaves
    its next seq_id in `seq`. With a rate, calls start at Poisson arrival times (a late call does
    not push the next one back)."""
    seen: dict[str, list] = {name: [] for name in (*CALLS, "forward_backward")}
    bodies = cheap_bodies(tenant)
    headers = {"X-API-Key": tenant["key"]}
    i = rng.randrange(len(CALLS))
    due = time.monotonic()
    while True:
        if rate:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        if time.monotonic() >= stop_at:
            return seen
        if submit_every and i % submit_every == submit_every - 1:
            name, body = "forward_backward", {"model_id": tenant["model_id"], "seq_id": seq[0],
                                              "forward_backward_input": {"data": [_datum([5, 6, 7, 8])],
                                                                         "loss_fn": "cross_entropy"}}
            seq[0] += stride
        else:
            name, body = CALLS[i % len(CALLS)], bodies[CALLS[i % len(CALLS)]]
        i += 1
        started = time.perf_counter()
        try:
            async with session.post(f"{base_url}/api/v1/{name}", json=body, headers=headers) as r:
                await r.read()
                status, timing = r.status, r.headers.get("server-timing", "")
        except aiohttp.ClientError:
            status, timing = 0, ""
        elapsed = time.perf_counter() - started
        seen[name].append((elapsed, *_server_timing(timing)) if status == 200 else (-status, *_NO_TIMING))


_WAITS = waits.NAMES  # the Server-Timing entries beside `app`
_NO_TIMING = (0.0,) * (1 + len(_WAITS))


def _server_timing(header: str) -> tuple[float, ...]:
    """(app, pool, pg, redis) seconds from `Server-Timing: app;dur=MS, pool;dur=MS, ...`."""
    durs = dict(entry.strip().partition(";dur=")[::2] for entry in header.split(",") if ";dur=" in entry)
    return tuple(float(durs.get(name) or 0) / 1000 for name in ("app", *_WAITS))


def _tail_split(ok: list[tuple]) -> dict[str, float]:
    """The slowest 1% of a call's app times, on average: the whole, each wait, and the rest (the
    API's own CPU and its event loop's queue: other calls ahead, a pause)."""
    if not ok:
        return {}
    cut = _pct([v[1] for v in ok], 0.99)
    tail = [v for v in ok if v[1] >= cut]
    out = {"app": statistics.fmean(v[1] for v in tail) * 1000}
    for i, name in enumerate(_WAITS, start=2):
        out[name] = statistics.fmean(v[i] for v in tail) * 1000
    out["own"] = out["app"] - sum(out[name] for name in _WAITS)
    return {k: round(v, 3) for k, v in out.items()}


def _generator(args: tuple) -> tuple[dict[str, list], list[int]]:
    base_url, clients, stop_at, submit_every, rate, cpus, seed = args
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def run() -> list:
        rng = random.Random(seed)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(_client(session, base_url, t, seq, stride, stop_at, submit_every, rate,
                                                  random.Random(rng.random())) for t, seq, stride in clients))

    merged: dict[str, list] = {}
    for seen in asyncio.run(run()):
        for name, values in seen.items():
            merged.setdefault(name, []).extend(values)
    return merged, [seq[0] for _t, seq, _stride in clients]


def _pct(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def _api_processes(base_url: str) -> list[psutil.Process]:
    """The uvicorn process serving `base_url`'s port, and its workers."""
    port = base_url.rsplit(":", 1)[1]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "uvicorn" in " ".join(cmd) and port in cmd:
            return [p, *p.children(recursive=True)]
    raise RuntimeError(f"no uvicorn process on port {port}")


WORKERS = ("batcher.main", "gen_pool.worker", "VLLM", "celery")


LAYOUTS = ("api", "service", "flat")


def _stores(stack: RunningStack) -> list[psutil.Process]:
    """Postgres (its postmaster and every backend) and Redis. Both daemonize, so they are not in
    this process's tree: they are found by asking each server its own pid."""
    with psycopg.connect(stack.database_url) as conn:  # asked while the backend lives: it ends with the connection
        postmaster = psutil.Process(conn.execute("SELECT pg_backend_pid()").fetchone()[0]).parent()
    redis_pid = redis.Redis.from_url(stack.redis_url).info("server")["process_id"]
    return [postmaster, *postmaster.children(recursive=True), psutil.Process(redis_pid)]


def _pin(api: list[psutil.Process], stores: list[psutil.Process], api_cpus: set[int], other_cpus: set[int],
         layout: str = "api") -> None:
    """Layout `api`: the API's threads on `api_cpus`; this process, the stores and the stack's
    others (the launcher and all it started: workers, the reaper) on `other_cpus`. Layout
    `service`: Postgres and Redis join the API on `api_cpus`, so what a call waits on runs beside
    it rather than beside the 64 clients and the trainer (a deployment gives its database no load
    generator to share with). A Postgres backend forked later inherits its postmaster's CPUs. The
    workers (the trainer running the submitted passes, the engine, Celery) keep the priority
    `quilt up` gave them (QUILT_WORKER_NICE, stack.priority), which layout `flat` takes away:
    everything at one weight, the stack as it ran before the launcher set priorities (lowering a
    nice value needs the privilege to; without it `flat` is `api`)."""
    front = {p.pid for p in api} | ({p.pid for p in stores} if layout == "service" else set())
    nice = 0 if layout == "flat" else get_core_settings().worker_nice
    os.sched_setaffinity(0, other_cpus)
    for p in {p.pid: p for p in [*psutil.Process().children(recursive=True), *stores]}.values():
        cpus = api_cpus if p.pid in front else other_cpus
        with contextlib.suppress(psutil.Error):
            # Per thread: a worker's threads (torch's pool among them) were started before this.
            for thread in p.threads():
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                    os.sched_setaffinity(thread.id, cpus)
            if any(w in " ".join(p.cmdline()) or w in p.name() for w in WORKERS):
                priority.set_nice(p.pid, nice, threads=True)


class _Probe:
    """A thread that measures something every 20 ms while a phase runs (`with probe:`)."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ticks(self) -> Iterator[None]:
        while not self._stop.wait(0.02):
            yield

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class FsyncProbe(_Probe):
    """Writes 8 KiB and fdatasyncs it every 20 ms in the stack's data directory while a phase runs:
    the latency Postgres's commits and Redis's AOF meet on that filesystem, measured beside the
    calls (on a shared VM's disk its tail, not the API, is what a write call's p99 waits for)."""

    def __init__(self, directory: Path):
        super().__init__()
        self.path, self.samples = directory / "fsync-probe", []

    def _run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in self._ticks():
                os.pwrite(fd, b"x" * 8192, 0)
                started = time.perf_counter()
                os.fdatasync(fd)
                self.samples.append((time.perf_counter() - started) * 1000)
        finally:
            os.close(fd)
            self.path.unlink(missing_ok=True)


class StoreProbe(_Probe):
    """Times a Redis PING and a Postgres `SELECT 1` every 20 ms while a phase runs, from a client
    of their own: how long the stores take to answer anyone. Set beside the waits an API request
    reports (Server-Timing's `redis` and `pg`), it separates a store's slowness from the time its
    answer sat unread while the API's event loop ran other calls."""

    def __init__(self, redis_url: str, database_url: str):
        super().__init__()
        self.samples: dict[str, list[float]] = {"redis": [], "pg": []}
        self._urls = redis_url, database_url

    def _run(self) -> None:
        r = redis.Redis.from_url(self._urls[0])
        with psycopg.connect(self._urls[1], autocommit=True) as pg:
            for _ in self._ticks():
                for name, ask in (("redis", r.ping), ("pg", lambda: pg.execute("SELECT 1").fetchone())):
                    started = time.perf_counter()
                    ask()
                    self.samples[name].append((time.perf_counter() - started) * 1000)
        r.close()


class PgWaitProbe(_Probe):
    """Reads `pg_stat_activity` every 20 ms while a phase runs (`--pg-waits`): each statement that
    has run for at least `LONG_MS`, with what it waits on (`wait_event_type:wait_event`, or `cpu`)
    and, when it waits on a lock, what the holder is doing; and whether an autovacuum worker or a
    checkpoint was running. Tells the Postgres part of a slow call's time apart: a lock held by
    a client busy elsewhere, a flush of the WAL, the server's housekeeping."""

    LONG_MS = 5.0
    _ACTIVITY = (
        "SELECT a.pid, a.backend_type, a.state, coalesce(a.wait_event_type || ':' || a.wait_event, 'cpu') AS wait, "
        "left(regexp_replace(a.query, '\\s+', ' ', 'g'), 70) AS query, "
        "extract(epoch FROM clock_timestamp() - a.query_start) * 1000 AS ms, "
        "(SELECT coalesce(b.state, b.backend_type) || ': ' || left(regexp_replace(b.query, '\\s+', ' ', 'g'), 50) "
        " FROM pg_stat_activity b WHERE b.pid = (pg_blocking_pids(a.pid))[1]) AS holder "
        "FROM pg_stat_activity a WHERE a.pid <> pg_backend_pid() AND "
        "(a.state = 'active' OR a.backend_type IN ('autovacuum worker', 'checkpointer'))")

    def __init__(self, database_url: str):
        super().__init__()
        self._url = database_url
        self.ticks = 0
        self.busy = {"autovacuum": 0, "checkpoint": 0}
        self.long: dict[tuple[str, str, str], list[float]] = {}  # (wait, query, lock holder) -> ms seen

    def _run(self) -> None:
        wal = ("SELECT pg_current_wal_lsn() AS lsn, clock_timestamp() AS at, wal_buffers_full, wal_fpi, wal_records "
               "FROM pg_stat_wal")
        with psycopg.connect(self._url, autocommit=True) as pg:
            start = pg.execute(wal).fetchone()
            for _ in self._ticks():
                self.ticks += 1
                rows = pg.execute(self._ACTIVITY).fetchall()
                if any(r[1] == "autovacuum worker" for r in rows):
                    self.busy["autovacuum"] += 1
                if any(r[1] == "checkpointer" and r[3] != "Activity:CheckpointerMain" for r in rows):
                    self.busy["checkpoint"] += 1
                for _pid, kind, state, wait, query, ms, holder in rows:
                    if kind == "client backend" and state == "active" and ms is not None and ms >= self.LONG_MS:
                        self.long.setdefault((wait, query, holder or ""), []).append(float(ms))
            end = pg.execute(wal).fetchone()
            written = pg.execute("SELECT pg_wal_lsn_diff(%s, %s)", (end[0], start[0])).fetchone()[0]
            self.wal_mb_per_s = float(written) / 2**20 / max((end[1] - start[1]).total_seconds(), 1e-9)
            self.wal_counts = {k: end[i] - start[i] for i, k in enumerate(("buffers_full", "fpi", "records"), 2)}

    def report(self) -> dict:
        rows = sorted(self.long.items(), key=lambda kv: -len(kv[1]))
        print(f"Postgres statements seen running for {self.LONG_MS:g} ms or more ({self.ticks} looks, every 20 ms; "
              f"an autovacuum worker ran in {self.busy['autovacuum']}, a checkpoint in {self.busy['checkpoint']}; "
              f"WAL written {self.wal_mb_per_s:.2f} MiB/s, {self.wal_counts['records']} records, "
              f"{self.wal_counts['fpi']} full pages, buffers full {self.wal_counts['buffers_full']} times):")
        print(f"  {'seen':>5} {'max ms':>7}  {'waiting on':<28} statement / lock holder")
        for (wait, query, holder), seen in rows[:12]:
            print(f"  {len(seen):>5} {max(seen):>7.1f}  {wait:<28} {query}")
            if holder:
                print(f"  {'':>5} {'':>7}  {'':<28} held by {holder}")
        return {"looks": self.ticks, "wal_mib_per_s": round(self.wal_mb_per_s, 3),
                **{f"wal_{k}": v for k, v in self.wal_counts.items()},
                **{f"{k}_looks": v for k, v in self.busy.items()},
                "long_statements": sum(len(v) for v in self.long.values()),
                "by_wait": {w: sum(len(v) for (w2, _q, _h), v in self.long.items() if w2 == w)
                            for w in {w for w, _q, _h in self.long}}}


def _latency_summary(samples: list[float]) -> dict:
    return {"count": len(samples), "p50_ms": round(_pct(samples, 0.5), 3),
            "p99_ms": round(_pct(samples, 0.99), 3), "max_ms": round(max(samples, default=0.0), 3)}


def _cpu_s(api: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in api)


def _loop_lag(redis_url: str) -> loop_lag.LagHistogram:
    """The API processes' event-loop lag histograms (core.loop_lag's beacons), summed."""
    r = redis.Redis.from_url(redis_url)
    try:
        names = loop_lag.instances(r.smembers(loop_lag.INDEX_KEY))
        hists, _gone = loop_lag.decode(names, r.mget([loop_lag.beacon_key(n) for n in names]) if names else [])
    finally:
        r.close()
    return functools.reduce(loop_lag.LagHistogram.plus, hists.values(), loop_lag.LagHistogram())


def _lag_summary(hist: loop_lag.LagHistogram) -> dict:
    return {"count": hist.count, "p50_ms": round(hist.quantile(0.5) * 1000, 3),
            "p99_ms": round(hist.quantile(0.99) * 1000, 3), "p999_ms": round(hist.quantile(0.999) * 1000, 3),
            "mean_ms": round(hist.sum_s / max(1, hist.count) * 1000, 3)}


def _run_clients(base_url: str, clients: list, args, rate: float, other_cpus: set[int] | None,
                 server: list[psutil.Process], seconds: float, seed: int) -> tuple[list, float, float]:
    """The clients, split over `--procs` generator processes, for `seconds` against `base_url`;
    returns (each generator's (samples, next seq_ids)), wall s, the `server` processes' CPU s)."""
    stop_at = time.monotonic() + seconds
    shares = [(base_url, clients[p::args.procs], stop_at, args.submit_every, rate, other_cpus, seed + p)
              for p in range(args.procs)]
    started, cpu0 = time.monotonic(), _cpu_s(server)
    with multiprocessing.get_context("spawn").Pool(args.procs) as pool:
        parts = pool.map(_generator, shares)
    return parts, time.monotonic() - started, _cpu_s(server) - cpu0


def merge_parts(parts: list, clients: list, procs: int) -> dict[str, list]:
    """The generators' samples of one run of `_run_clients`, per call; moves each client's next
    seq_id on, so the next run goes on where this one stopped: no gap to wait behind."""
    merged: dict[str, list] = {}
    for p, (part, next_seqs) in enumerate(parts):
        for name, values in part.items():
            merged.setdefault(name, []).extend(values)
        for (_tenant, seq, _stride), next_seq in zip(clients[p::procs], next_seqs):
            seq[0] = next_seq
    return merged


def _phase(stack: RunningStack, clients: list, args, rate: float, other_cpus: set[int] | None,
           api: list[psutil.Process], seconds: float) -> tuple[dict[str, list], float, float, dict[str, list]]:
    """Run the clients for `seconds`; returns (per-call samples, wall s, API CPU s, the probes'
    latencies meanwhile: the data directory's fsync, the stores' answers to another client, and the
    API's event-loop lag: its beacon's histogram from up to a beat before the phase to a beat after)."""
    lag0 = _loop_lag(stack.redis_url)
    waits_probe = PgWaitProbe(stack.database_url) if args.pg_waits else contextlib.nullcontext()
    with FsyncProbe(stack.data_dir) as fsync, StoreProbe(stack.redis_url, stack.database_url) as stores, \
            waits_probe:
        parts, wall, cpu = _run_clients(stack.base_url, clients, args, rate, other_cpus, api, seconds, 1000)
    if args.pg_waits:
        print(f"phase of {seconds:g} s at {rate * args.clients:g} requests/s (0: capacity)")
        out_waits = waits_probe.report()
    time.sleep(loop_lag.BEACON_EVERY_S + 0.1)  # the next beat carries the phase's last wake-ups
    lag = _loop_lag(stack.redis_url).minus(lag0)
    merged = merge_parts(parts, clients, args.procs)
    probes = {"fsync": fsync.samples, **stores.samples, "loop_lag": lag}
    if args.pg_waits:
        probes["pg_waits"] = [out_waits]
    return merged, wall, cpu, probes


def _floor(clients: list, args, api_cpus: set[int] | None, other_cpus: set[int] | None) -> tuple[int, float, float]:
    """Run the clients as fast as answers come for `--floor-seconds` against framework_floor's app
    (FastAPI answering each call with a constant) on the API's core; returns (calls, wall s, its CPU s)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "framework_floor:create_app", "--port",
                             str(port), "--no-access-log", "--log-level", "warning"], env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.post(base_url + "/api/v1/get_info", json={}, timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the framework floor's app did not start") from None
                time.sleep(0.2)
        server = psutil.Process(proc.pid)
        if api_cpus:
            for thread in server.threads():
                os.sched_setaffinity(thread.id, api_cpus)
        parts, wall, cpu = _run_clients(base_url, clients, args, 0.0, other_cpus, [server], args.floor_seconds, 2000)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    calls = sum(1 for part, _seqs in parts for values in part.values() for v in values if v[0] >= 0)
    return calls, wall, cpu


def _table(title: str, merged: dict[str, list]) -> tuple[dict, int, list, list]:
    print(f"\n{title}")
    print(f"{'call':<18}{'count':>8}{'429':>6}{'errors':>8}{'p50 ms':>9}{'p99 ms':>9}{'app p50':>9}{'app p99':>9}")
    summary, errors, cheap, cheap_app = {}, 0, [], []
    for name, values in merged.items():
        if not values:
            continue
        ok = [v for v in values if v[0] >= 0]
        limited = sum(1 for v in values if v[0] == -429)
        bad = len(values) - len(ok) - limited
        errors += bad
        lat, app = [v[0] * 1000 for v in ok], [v[1] * 1000 for v in ok]
        if name in CALLS:
            cheap += lat
            cheap_app += app
        summary[name] = {"count": len(values), "p50_ms": round(_pct(lat, 0.5), 2), "p99_ms": round(_pct(lat, 0.99), 2),
                         "app_p50_ms": round(_pct(app, 0.5), 3), "app_p99_ms": round(_pct(app, 0.99), 3),
                         "app_tail_ms": _tail_split(ok)}
        print(f"{name:<18}{len(values):>8}{limited:>6}{bad:>8}{_pct(lat, 0.5):>9.2f}{_pct(lat, 0.99):>9.2f}"
              f"{_pct(app, 0.5):>9.3f}{_pct(app, 0.99):>9.3f}")
    print(f"the slowest 1% of each call's app time, mean ms: {'app':>7}{'pool':>7}{'pg':>7}{'redis':>7}{'own':>7}")
    for name, row in summary.items():
        split = row["app_tail_ms"]
        print(f"{name:<48}" + "".join(f"{split.get(k, 0.0):>7.2f}" for k in ("app", *_WAITS, "own")))
    return summary, errors, cheap, cheap_app


def _print_lag(lag: dict) -> None:
    every_ms = get_api_settings().loop_lag_probe_s * 1000
    print(f"the API's event loop meanwhile, late by (a wake-up asked every {every_ms:g} ms, {lag['count']} of "
          f"them): p50 {lag['p50_ms']:.2f} / p99 {lag['p99_ms']:.2f} / p99.9 {lag['p999_ms']:.2f} ms, "
          f"mean {lag['mean_ms']:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="length of each of the two phases")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--procs", type=int, default=1, help="load-generator processes")
    parser.add_argument("--submit-every", type=int, default=20, help="every Nth call submits a forward_backward")
    parser.add_argument("--paced-share", type=float, default=0.5, help="phase 2's rate, a share of phase 1's")
    parser.add_argument("--rate", type=float, default=None,
                        help="phase 2's rate in requests/s instead (machines whose capacities differ compare at one "
                             "rate: the second core, shared by clients, Postgres and the trainer, sets the tail)")
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (QUILT_WORKERS)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2)
    parser.add_argument("--data-parent", type=Path, default=Path("/tmp"),
                        help="where the stack's data directory (Postgres, Redis AOF) is made; /dev/shm takes "
                             "the disk's fsync out of the measurement")
    parser.add_argument("--layouts", default="api,service",
                        help="phase 2's core layouts (with --pin), run in turns: api (the API alone on a core), "
                             "service (Postgres and Redis beside it), flat (as api, with the workers at the stores' "
                             "CPU weight)")
    parser.add_argument("--floor-seconds", type=float, default=20.0,
                        help="after phase 1, the same clients as fast as answers come against a FastAPI app that "
                             "answers with a constant (bench/framework_floor.py), for the framework's own CPU per "
                             "call on this host now; 0 skips it")
    parser.add_argument("--pg-waits", action="store_true",
                        help="read pg_stat_activity every 20 ms in each phase and print the statements seen running "
                             "for 5 ms or more, with what they waited on (PgWaitProbe)")
    parser.add_argument("--no-sampling", action="store_true",
                        help="serve the tiny base for training only: no generation worker, for a machine without "
                             "a generation engine (the calls measured never sample)")
    parser.add_argument("--slices", type=int, default=5,
                        help="phase 2 alternates its layouts this many times, so a slow spell of a shared host "
                             "falls on both")
    args = parser.parse_args()
    layouts = [x for x in args.layouts.split(",") if x] if args.pin else ["unpinned"]
    if not set(layouts) <= {*LAYOUTS, "unpinned"}:
        parser.error(f"--layouts: each of {', '.join(LAYOUTS)}")

    setup = [["models", "create-tiny", "--no-sample"]] if args.no_sampling else []
    with ephemeral_stack({"QUILT_WORKERS": str(args.api_workers)}, parent=args.data_parent, setup=setup) as stack:
        tenants = prepare_tenants(stack, args.tenants)
        api, stores = _api_processes(stack.base_url), _stores(stack)
        cpus = sorted(os.sched_getaffinity(0))
        other = None
        if args.pin:
            other = set(cpus[1:])
            _pin(api, stores, {cpus[0]}, other)
        # Client k of a tenant submits seq_ids start, start + stride, ...: the tenant's clients never
        # collide, and phase 2 goes on from where phase 1 stopped (_phase).
        per_tenant = max(1, args.clients // args.tenants)
        clients = [(tenants[c % args.tenants], [2 + c // args.tenants], per_tenant) for c in range(args.clients)]
        full, wall1, cpu1, fsync1 = _phase(stack, clients, args, 0.0, other, api, args.seconds)
        # Beside it in time: the framework alone (the clients' seq_ids move only in _phase).
        floor = _floor(clients, args, {cpus[0]} if args.pin else None, other) if args.floor_seconds else None
        capacity = sum(len(v) for v in full.values()) / wall1
        rate = (args.rate if args.rate else args.paced_share * capacity) / args.clients
        paced = {x: ({}, [0.0, 0.0], {}) for x in layouts}  # per layout: samples, [wall, API CPU], probes
        for _ in range(max(1, args.slices)):
            for layout in layouts:
                if args.pin:
                    _pin(api, _stores(stack), {cpus[0]}, other, layout)
                part, wall, cpu, probed = _phase(stack, clients, args, rate, other, api,
                                                 args.seconds / max(1, args.slices))
                samples, clock, probe = paced[layout]
                for name, values in part.items():
                    samples.setdefault(name, []).extend(values)
                clock[0], clock[1] = clock[0] + wall, clock[1] + cpu
                probe["loop_lag"] = probe.get("loop_lag", loop_lag.LagHistogram()).plus(probed.pop("loop_lag"))
                for name, values in probed.items():
                    probe.setdefault(name, []).extend(values)

    n1 = sum(len(v) for v in full.values())
    print(f"{args.clients} clients, {args.tenants} tenants, {args.seconds:.0f} s per phase, {args.procs} generator "
          f"process(es), {args.api_workers} API process(es), pinned: {bool(args.pin)}, data directory in "
          f"{args.data_parent}")
    s1, e1, cheap1, _ = _table(f"1. capacity: {n1 / wall1:.0f} requests/s, {n1 / max(cpu1, 1e-9):.0f} per API "
                               f"CPU-second (API used {cpu1 / wall1:.2f} of a core)", full)
    lag1 = _lag_summary(fsync1["loop_lag"])
    fsync1 = _latency_summary(fsync1["fsync"])
    print(f"fdatasync of 8 KiB in the data directory, every 20 ms beside the calls: p50 {fsync1['p50_ms']:.2f} ms, "
          f"p99 {fsync1['p99_ms']:.2f} ms, max {fsync1['max_ms']:.1f} ms")
    _print_lag(lag1)
    if floor:
        calls, wall, cpu = floor
        floor_per_cpu, api_per_cpu = calls / max(cpu, 1e-9), n1 / max(cpu1, 1e-9)
        print(f"framework floor (FastAPI answering the same calls with a constant, on the API's core, "
              f"{args.floor_seconds:g} s): {calls / wall:.0f} requests/s, {floor_per_cpu:.0f} per CPU-second; "
              f"Quilt's API did {api_per_cpu / floor_per_cpu:.2f}x of that per CPU-second")
    pace = f"at {args.rate:g} requests/s" if args.rate else f"at {args.paced_share:.0%} of that"
    out = {"clients": args.clients, "seconds_per_phase": args.seconds, "api_workers": args.api_workers,
           "pinned": bool(args.pin), "data_parent": str(args.data_parent), "requests_per_s": round(n1 / wall1, 1),
           "requests_per_api_cpu_s": round(n1 / max(cpu1, 1e-9), 1),
           "capacity_cheap_p99_ms": round(_pct(cheap1, 0.99), 2), "paced_rate_asked": args.rate,
           "fsync_capacity": fsync1, "loop_lag_capacity": lag1, "capacity": s1, "errors": e1}
    if floor:
        out["floor_requests_per_cpu_s"] = round(floor_per_cpu, 1)
        out["api_over_floor_per_cpu_s"] = round(api_per_cpu / floor_per_cpu, 3)
    for i, (layout, (samples, (wall2, cpu2), probe)) in enumerate(paced.items()):
        n2 = sum(len(v) for v in samples.values())
        s2, e2, cheap2, app2 = _table(f"2{'abcdef'[i]}. paced {pace}, layout {layout}, {args.slices} slices: "
                                      f"{n2 / wall2:.0f} requests/s, {n2 / max(cpu2, 1e-9):.0f} per API CPU-second",
                                      samples)
        fsync2, stores2 = _latency_summary(probe["fsync"]), {k: _latency_summary(probe[k]) for k in ("redis", "pg")}
        lag2 = _lag_summary(probe["loop_lag"])
        print(f"API's own time per cheap call: p50 {_pct(app2, 0.5):.2f} ms, p99 {_pct(app2, 0.99):.2f} ms "
              f"(client-side p99 {_pct(cheap2, 0.99):.2f} ms); fdatasync p99 {fsync2['p99_ms']:.2f} ms")
        print(f"the stores answering another client meanwhile (every 20 ms): Redis PING p50 "
              f"{stores2['redis']['p50_ms']:.2f} / p99 {stores2['redis']['p99_ms']:.2f} ms, Postgres SELECT 1 p50 "
              f"{stores2['pg']['p50_ms']:.2f} / p99 {stores2['pg']['p99_ms']:.2f} ms")
        _print_lag(lag2)
        # The first layout keeps the keys of the bench before layouts; the others are suffixed.
        tail = "" if i == 0 else f"_{layout}"
        out.update({f"paced_requests_per_s{tail}": round(n2 / wall2, 1),
                    f"paced_cheap_p50_ms{tail}": round(_pct(cheap2, 0.5), 2),
                    f"paced_cheap_p99_ms{tail}": round(_pct(cheap2, 0.99), 2),
                    f"paced_app_p50_ms{tail}": round(_pct(app2, 0.5), 3),
                    f"paced_app_p99_ms{tail}": round(_pct(app2, 0.99), 3),
                    f"paced_submit_app_p99_ms{tail}": s2.get("forward_backward", {}).get("app_p99_ms"),
                    f"paced_submit_app_tail_ms{tail}": s2.get("forward_backward", {}).get("app_tail_ms"),
                    f"fsync_paced{tail}": fsync2, f"stores_paced{tail}": stores2, f"loop_lag_paced{tail}": lag2,
                    f"paced{tail}": s2})
        if args.pg_waits:  # the slices' looks, added up
            looks = probe["pg_waits"]
            out[f"pg_waits_paced{tail}"] = {
                **{k: sum(x[k] for x in looks) for k in ("looks", "autovacuum_looks", "checkpoint_looks",
                                                          "long_statements")},
                "by_wait": {w: sum(x["by_wait"].get(w, 0) for x in looks) for x in looks for w in x["by_wait"]}}
        out["errors"] += e2
    print(f"\n{out['errors']} errors other than 429")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
