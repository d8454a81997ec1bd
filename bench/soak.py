"""A soak: the embedded stack driven for `--minutes` by 8 tenants doing what users do, with what
grows measured as a slope per hour.

    .venv/bin/python bench/soak.py [--minutes 30] [--warmup-minutes 3] [--every-s 15]

The tenants, each a thread with its own tinker SDK client (the role is the tenant's index mod 8):

0. RL: samples 4 completions of a prompt from its latest weights, trains on them, steps, and
   publishes new sampler weights every 5 steps;
1. SFT: forward_backward and optim_step on a fixed batch;
2. checkpoints: SFT steps with a `save_state` every 3 steps, each saved with a TTL; the soak moves
   each one's expiry to a minute after it was made (TTLs are at least an hour), so the retention
   sweep (every minute, Celery beat) has work all along;
3. downloads: saves its adapter for download every 4 steps and fetches every file of it through
   the signed URLs;
4. dashboard reads: the reads the dashboard's pages make (runs, checkpoints, usage, a model's
   metrics, the status page), one after another;
5. sessions opened and abandoned: a session and a model, two steps, then nothing more (no
   heartbeat, no finish), again and again, over plain HTTP as a client that dies leaves them;
6. a tenant over its budget: a budget of one micro-dollar, so after its first billed step its
   steps are refused (402); it keeps trying the same loop as 5, once a second (plain HTTP: the
   SDK would pause on a 402 by itself);
7. SFT again, from a second key.

Halfway through, the trainer is killed (SIGKILL, as the OOM killer would) and the launcher
restarts it; the tenants keep going. After `--warmup-minutes`, every `--every-s` seconds the soak
samples: each process's RSS and open file descriptors (the API, trainer, generation worker and its
engine, Celery; Postgres and Redis), Redis `used_memory`, its keys and the length of every stream,
Postgres's connections and the size and row count of its tables, and the checkpoint store's
bytes on disk. Each series gets a least-squares slope per hour with a 95% interval; a process's RSS
is fitted per pid (the restarted trainer is a new series, fitted after a warm-up of its own).

Counted per tenant: calls made, 5xx answers, and calls lost (a future never answered within 10
minutes). At the end, after two sweeps: expired checkpoints whose directory is still on disk.
Finished requests and abandoned sessions are kept `--retention-s` (300 s, not the default 30 days),
so the retention task (core.row_retention) has work within the run.

Growth is counted per 1,000 requests the server accepted (rows put in `requests`; a client's polls,
reads and refused calls write none), from the first look after the warm-up plus `--retention-s`
(when futures and finished requests kept for a while have reached their steady number) to the last.

Ends with one JSON line: `max_rss_slope_mib_per_h` (and whose), `redis_bytes_per_1k_requests`,
`postgres_bytes_per_1k_requests`, `http_5xx`, `lost`, `expired_on_disk`, `within_bounds` (and
`failed_bounds`: each bound of BOUNDS broken, with its value), and every slope.
Running it for a day, and why each bound is what it is: docs/operations/soak.md.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from billing import budgets  # noqa: E402
from checkpoints.storage import store_for  # noqa: E402
from core.settings import CoreSettings  # noqa: E402
from stack import leftovers  # noqa: E402
from stack.ephemeral import TINY, RunningStack, ephemeral_stack, new_tenant  # noqa: E402

ROLES = ("rl", "sft", "checkpoints", "downloads", "dashboard", "abandoned", "over_budget", "sft_second_key")
TABLES = ("requests", "usage_ledger", "usage_hourly", "usage_daily", "usage_hourly_sessions", "audit_log", "checkpoints",
          "storage_garbage", "sessions", "training_models", "sampling_sessions", "run_metrics")
LOST_AFTER_S = 600


@dataclass
class Tally:
    """One tenant's calls; threads add to their own."""

    calls: int = 0
    server_errors: int = 0
    refused: Counter = field(default_factory=Counter)  # 4xx by status: expected (the budget's 402s)
    lost: int = 0
    errors: list[str] = field(default_factory=list)


def _datums(seed: int, n: int = 2, tokens: int = 12) -> list[types.Datum]:
    out = []
    for i in range(n):
        ids = [(seed * 11 + i * 17 + j * 5) % 200 + 10 for j in range(tokens + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * tokens}))
    return out


class Tenant:
    """A tenant's loop: its role's step, again and again until `stop`, each call counted."""

    def __init__(self, stack: RunningStack, index: int, key: str, stop: threading.Event):
        self.stack, self.index, self.key, self.stop = stack, index, key, stop
        self.role = ROLES[index % len(ROLES)]
        self.tally = Tally()
        self.step = 0

    def call(self, make: Callable[[], object]) -> object | None:
        """One call (a future's `.result()` included); None when it was refused or failed."""
        self.tally.calls += 1
        try:
            out = make()
            result = getattr(out, "result", None)
            return result(timeout=LOST_AFTER_S) if callable(result) else out
        except TimeoutError:
            self.tally.lost += 1
        except tinker.APIStatusError as e:
            if e.status_code >= 500:
                self.tally.server_errors += 1
                self.tally.errors.append(f"{self.role}: {e.status_code} {str(e)[:200]}")
            else:
                self.tally.refused[e.status_code] += 1
        except httpx.HTTPStatusError as e:
            if e.response.status_code >= 500:
                self.tally.server_errors += 1
                self.tally.errors.append(f"{self.role}: {e.response.status_code} {e.response.text[:200]}")
            else:
                self.tally.refused[e.response.status_code] += 1
        except Exception as e:  # a transport error the SDK gave up on: reported, never hidden
            self.tally.errors.append(f"{self.role}: {type(e).__name__}: {str(e)[:200]}")
        return None

    def run(self) -> None:
        with tinker.ServiceClient(base_url=self.stack.base_url, api_key=self.key) as service:
            if self.role == "dashboard":
                with httpx.Client(base_url=self.stack.base_url, headers={"X-API-Key": self.key}, timeout=60) as http:
                    model_id = self._first_model(service)
                    while not self.stop.is_set():
                        self._dashboard_reads(http, model_id)
                return
            if self.role in ("abandoned", "over_budget"):
                with httpx.Client(base_url=self.stack.base_url + "/api/v1", headers={"X-API-Key": self.key},
                                  timeout=60) as http:
                    while not self.stop.is_set():
                        refused = sum(self.tally.refused.values())
                        self._raw_session(http)
                        if self.role == "over_budget" or sum(self.tally.refused.values()) > refused:
                            # A client retrying a refusal waits (a second, as Retry-After says), not in a
                            # tight loop: one that did made 390,000 refused calls in a 20-minute soak.
                            self.stop.wait(1.0)
                return
            tc = self.call(lambda: service.create_lora_training_client(base_model=TINY, rank=4))
            if tc is None:
                self.tally.errors.append(f"{self.role}: no training client")
                return
            rest = tinker.RestClient(base_url=self.stack.base_url, api_key=self.key)
            sampler = None
            while not self.stop.is_set():
                self.step += 1
                if self.role == "rl":
                    if sampler is None or self.step % 5 == 1:
                        sampler = self.call(lambda: tc.save_weights_and_get_sampling_client(name=f"rl-{self.step}"))
                    self._rl_step(tc, sampler)
                else:
                    self._sft_step(tc)
                if self.role == "checkpoints" and self.step % 3 == 0:
                    self.call(lambda: tc.save_state(f"ck-{self.step}", ttl_seconds=3600))
                if self.role == "downloads" and self.step % 4 == 0:
                    self._download(tc, rest)

    def _raw_session(self, http: httpx.Client) -> None:
        """Over HTTP, as a client that dies would leave it: a session and a model, two steps, and
        then nothing (no heartbeat, no finish). Over budget, the steps are refused (402) instead."""
        session = self.call(lambda: http.post("/create_session", json={}).raise_for_status())
        if session is None:
            return
        session_id = session.json()["session_id"]
        model = self._raw_future(http, "/create_model", {"session_id": session_id, "model_seq_id": 0,
                                                         "base_model": TINY, "lora_config": {"rank": 4}})
        if model is None:
            return
        for seq in (1, 2):
            ids = [(self.step * 7 + j) % 200 + 10 for j in range(13)]
            datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
                     "loss_fn_inputs": {"target_tokens": {"data": ids[1:], "dtype": "int64", "shape": [12]},
                                        "weights": {"data": [1.0] * 12, "dtype": "float32", "shape": [12]}}}
            self._raw_future(http, "/forward_backward", {"model_id": model["model_id"], "seq_id": seq,
                                                         "forward_backward_input": {"data": [datum],
                                                                                    "loss_fn": "cross_entropy"}})
        self.step += 1

    def _raw_future(self, http: httpx.Client, route: str, body: dict) -> dict | None:
        submitted = self.call(lambda: http.post(route, json=body).raise_for_status())
        if submitted is None:
            return None
        deadline = time.monotonic() + LOST_AFTER_S
        while time.monotonic() < deadline:
            got = self.call(lambda: http.post("/retrieve_future", json={"request_id": submitted.json()["request_id"]})
                            .raise_for_status())
            if got is None:
                return None
            answer = got.json()
            if answer.get("type") != "try_again":
                return answer if "error" not in answer else None
        self.tally.lost += 1
        return None

    def _first_model(self, service: tinker.ServiceClient) -> str | None:
        tc = self.call(lambda: service.create_lora_training_client(base_model=TINY, rank=4))
        if tc is None:
            return None
        self._sft_step(tc)
        return str(tc.model_id)

    def _sft_step(self, tc) -> None:
        fb = self.call(lambda: tc.forward_backward(_datums(self.index + self.step), "cross_entropy"))
        if fb is not None:
            self.call(lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3)))

    def _rl_step(self, tc, sampler) -> None:
        if sampler is None:
            return self._sft_step(tc)
        prompt = types.ModelInput.from_ints([11, 12, 13, 14])
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=self.step)
        got = self.call(lambda: sampler.sample(prompt, 4, params))
        if got is None:
            return None
        data = []
        for seq in got.sequences:
            ids = [11, 12, 13, 14, *seq.tokens]
            data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
        if self.call(lambda: tc.forward_backward(data, "cross_entropy")) is not None:
            self.call(lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3)))
        return None

    def _download(self, tc, rest) -> None:
        saved = self.call(lambda: tc.save_weights_external(f"dl-{self.step}"))
        if saved is None:
            return
        urls = self.call(lambda: rest.get_external_weights_urls(saved.path))
        for url in (getattr(urls, "urls", None) or {}).values():
            self.call(lambda url=url: httpx.get(url, timeout=60).raise_for_status())

    def _dashboard_reads(self, http: httpx.Client, model_id: str | None) -> None:
        paths = ["/api/v1/training_runs", "/api/v1/checkpoints", "/api/v1/quilt/usage", "/api/v1/status", "/status"]
        if model_id:
            paths.append(f"/api/v1/quilt/models/{model_id}/metrics")
        for path in paths:
            self.call(lambda path=path: http.get(path).raise_for_status())
        time.sleep(0.5)


# ---- what is sampled -------------------------------------------------------------------------

def _processes(stack: RunningStack) -> dict[str, psutil.Process]:
    """`role:pid` -> process, for every process of the stack and the stores."""
    out = {}
    for entry in leftovers.read(stack.data_dir):
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(entry.pid)
            for i, p in enumerate([root, *root.children(recursive=True)]):
                out[f"{entry.name}{'' if i == 0 else '/' + p.name()}:{p.pid}"] = p
    with psycopg.connect(stack.database_url) as conn:
        postmaster = psutil.Process(conn.execute("SELECT pg_backend_pid()").fetchone()[0]).parent()
    out[f"postgres:{postmaster.pid}"] = postmaster
    redis_pid = redis.Redis.from_url(stack.redis_url).info("server")["process_id"]
    out[f"redis:{redis_pid}"] = psutil.Process(redis_pid)
    return out


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def sample(stack: RunningStack, r: redis.Redis) -> dict[str, float]:
    """One look at everything that might grow: name -> value."""
    out: dict[str, float] = {}
    for name, p in _processes(stack).items():
        with contextlib.suppress(psutil.Error):
            mem = p.memory_info()
            out[f"rss_mib:{name}"] = mem.rss / 2**20
            # RSS less its shared and file-backed pages: the process's own heap, what a leak grows.
            # Postgres's shared buffers and mapped libraries count in RSS as they are first touched
            # and are bounded by their size (shared_buffers), not by the work done.
            out[f"anon_mib:{name}"] = (mem.rss - mem.shared) / 2**20
            out[f"fds:{name}"] = p.num_fds()
    info = r.info("memory")
    out["redis_used_memory"] = float(info["used_memory"])
    out["redis_keys"] = float(r.dbsize())
    out["redis_clients"] = float(r.info("clients")["connected_clients"])
    streams = 0
    for key in r.scan_iter(match="quilt:*", count=1000, _type="STREAM"):
        streams += r.xlen(key)
    out["redis_stream_entries"] = float(streams)
    out.update(redis_families(r))
    with psycopg.connect(stack.database_url) as conn:
        out["pg_connections"] = float(conn.execute("SELECT count(*) FROM pg_stat_activity").fetchone()[0])
        out["pg_database_bytes"] = float(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])
        # Requests the server accepted (every row ever put in `requests`, retention or not): what
        # growth is counted per. A client's polls, reads and refused calls write no row.
        row = conn.execute("SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'requests'").fetchone()
        out["pg_requests_inserted"] = float(row[0]) if row else 0.0
        for table in TABLES:
            row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
            if row[0]:
                out[f"pg_bytes:{table}"] = float(conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()[0])
                out[f"pg_rows:{table}"] = float(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # noqa: S608
    out["checkpoint_bytes"] = float(_dir_bytes(stack.data_dir / "checkpoints"))
    return out


_UUID = re.compile(r"[-:][0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def key_family(key: str) -> str:
    """A Redis key without its ids: its first two parts (`quilt:future:req-…` -> `quilt:future`),
    a trailing UUID dropped (Celery's `celery-task-meta-<id>`)."""
    return ":".join(_UUID.sub("", key).split(":")[:2])


def redis_families(r: redis.Redis) -> dict[str, float]:
    """Keys and bytes per key family (`redis_keys:quilt:future`, `redis_bytes:…`), so that growth
    names what grows."""
    keys = [k.decode(errors="replace") if isinstance(k, bytes) else k for k in r.scan_iter(count=1000)]
    with r.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.memory_usage(key, samples=0)
        sizes = pipe.execute()
    out: dict[str, float] = {}
    for key, size in zip(keys, sizes, strict=True):
        family = key_family(key)
        out[f"redis_keys:{family}"] = out.get(f"redis_keys:{family}", 0.0) + 1
        out[f"redis_bytes:{family}"] = out.get(f"redis_bytes:{family}", 0.0) + float(size or 0)
    return out


def slope_per_hour(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope of (seconds, value) per hour and its 95% half-interval; None under 4 points."""
    return slope([(t / 3600, v) for t, v in points])


def slope(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope of (x, y) and its 95% half-interval; None under 4 points or one x."""
    if len(points) < 4:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = [y - (my + b * (x - mx)) for x, y in zip(xs, ys)]
    se = math.sqrt(sum(e * e for e in resid) / (len(points) - 2) / sxx)
    return b, 1.96 * se


def _expire_soon(stack: RunningStack, tenant_ids: list[str], expired: set[str]) -> None:
    """The soak's clock: a state the checkpoints tenant saved with a TTL (`ck-*`) expires a minute
    after it was made; the paths that will expire are remembered, to look for them on disk at the
    end. Other checkpoints (the RL tenant's sampler snapshots among them) keep their lifetimes."""
    with psycopg.connect(stack.database_url) as conn:
        rows = conn.execute(
            "UPDATE checkpoints SET expires_at = created_at + interval '60 seconds' WHERE tenant_id = ANY(%s) "
            "AND kind = 'weights' AND name LIKE 'ck-%%' AND expires_at > created_at + interval '60 seconds' "
            "RETURNING storage_path", (tenant_ids,)).fetchall()
    expired.update(row[0] for row in rows)


def _tenants(stack: RunningStack, n: int) -> tuple[list[str], list[str]]:
    ids, keys = [], []
    for i in range(n):
        tenant_id, key = new_tenant(stack, f"soak-{ROLES[i % len(ROLES)]}", max_inflight_requests=1000,
                                    tokens_per_minute=100_000_000)
        ids.append(tenant_id)
        keys.append(key)
        if ROLES[i % len(ROLES)] == "over_budget":
            with psycopg.connect(stack.database_url, row_factory=psycopg.rows.dict_row) as conn:
                budgets.set_budget(conn, tenant_id, 1)
    return ids, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=3.0)
    parser.add_argument("--every-s", type=float, default=15.0, help="seconds between looks")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--no-restart", action="store_true", help="leave the trainer running throughout")
    parser.add_argument("--retention-s", type=int, default=300,
                        help="QUILT_RECORD_RETENTION_S and QUILT_FUTURE_TTL_SECONDS of the soaked stack: short, so "
                             "that finished requests and abandoned sessions leave within the run (30 days by default)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="after the tenants stop, wait this long (two retention sweeps) before looking on disk")
    parser.add_argument("--cpu-loras", type=int, default=8,
                        help="QUILT_GEN_MAX_CPU_LORAS of the soaked stack: the engine's host cache of adapter versions "
                             "(64 by default) full within the warm-up, so its filling up does not read as growth")
    args = parser.parse_args()
    os.environ["QUILT_RECORD_RETENTION_S"] = os.environ["QUILT_FUTURE_TTL_SECONDS"] = str(args.retention_s)
    os.environ["QUILT_GEN_MAX_CPU_LORAS"] = str(args.cpu_loras)

    series: dict[str, list[tuple[float, float]]] = {}
    expired: set[str] = set()
    with ephemeral_stack() as stack:
        tenant_ids, keys = _tenants(stack, args.tenants)
        stop = threading.Event()
        tenants = [Tenant(stack, i, key, stop) for i, key in enumerate(keys)]
        threads = [threading.Thread(target=t.run, daemon=True) for t in tenants]
        for t in threads:
            t.start()
        r = redis.Redis.from_url(stack.redis_url)
        started = time.monotonic()
        end, warm, restart_at = (started + args.minutes * 60, started + args.warmup_minutes * 60,
                                 started + args.minutes * 30)
        looks: list[tuple[float, dict[str, float], int]] = []  # (seconds in, the look, client calls so far)
        restarted = args.no_restart
        while time.monotonic() < end:
            _expire_soon(stack, tenant_ids, expired)
            if not restarted and time.monotonic() >= restart_at:
                leftovers.kill_hard(stack.data_dir, f"trainer:{TINY}")
                restarted = True
            if time.monotonic() >= warm:
                look = sample(stack, r)
                at = time.monotonic() - started
                for name, value in look.items():
                    series.setdefault(name, []).append((at, value))
                looks.append((at, look, sum(t.tally.calls for t in tenants)))
            time.sleep(args.every_s)
        stop.set()
        for t in threads:
            t.join(timeout=LOST_AFTER_S)
        _expire_soon(stack, tenant_ids, expired)
        # Past every request's time to live and two retention sweeps (every 60 s): what is left in
        # Redis now is what outlives its request.
        time.sleep(args.settle_s if args.settle_s is not None else args.retention_s + 150)
        after = sample(stack, r)
        store = store_for(CoreSettings(data_dir=stack.data_dir))
        with psycopg.connect(stack.database_url) as conn:
            live = {row[0] for row in conn.execute("SELECT storage_path FROM checkpoints").fetchall()}
        on_disk = [p for p in expired - live if store.local_dir(p).exists()]
    report(args, tenants, series, looks, on_disk, restarted, after)


def settled(series: dict[str, list[tuple[float, float]]], warmup_s: float) -> dict[str, list[tuple[float, float]]]:
    """Each series without its process's own warm-up: a process that appeared after the soak's
    warm-up (the restarted trainer, a new Postgres backend) is fitted from `warmup_s` after its
    first look; the others from the first look."""
    start = min((points[0][0] for points in series.values() if points), default=0.0)
    out = {}
    for name, points in series.items():
        born = points[0][0]
        out[name] = points if born <= start or ":" not in name else [p for p in points if p[0] >= born + warmup_s]
    return out


def judged_heaps(series: dict[str, list[tuple[float, float]]], ended_s: float, min_points: int = 8) -> set[str]:
    """The heap series the RSS bound judges (pure): each process still alive at the last look with
    at least `min_points` looks past its warm-up. The trainer the soak kills in the middle is left
    out: its series ends inside its own warm-up (it fills with each tenant's adapter and optimizer
    state as the tenants come), so its slope measures that filling, not a leak; the trainer
    that replaces it is judged, over its settled window."""
    return {n for n, points in series.items()
            if n.startswith("anon_mib:") and len(points) >= min_points and points[-1][0] >= ended_s}


# The bounds a run must keep (docs/operations/soak.md says why each is what it is). Growth is counted
# per 1,000 requests the server accepted. Postgres's over the window in which everything the stack
# keeps for a while (finished requests: `--retention-s`) has reached its steady population; Redis's
# as what is left once the load has stopped and every request's time to live has passed (the
# window's slope moves with the request rate, which the trainer's restart makes uneven).
BOUNDS = {"max_rss_slope_mib_per_h": 16.0, "redis_left_bytes_per_1k_requests": 256 * 1024.0,
          "postgres_bytes_per_1k_requests": 1280 * 1024.0}
MUST_BE_ZERO = ("http_5xx", "lost", "expired_on_disk")


def judge(figures: dict, bounds: dict[str, float] = BOUNDS) -> list[str]:
    """The bounds a soak's figures break, each as `key value > bound` (pure); empty when within.
    A figure that could not be measured (None) breaks its bound: a run too short to tell passes nothing."""
    failed = []
    for key, bound in bounds.items():
        value = figures.get(key)
        if value is None or value > bound:
            failed.append(f"{key} {value} > {bound:g}")
    failed += [f"{key} {figures.get(key)} > 0" for key in MUST_BE_ZERO if figures.get(key) != 0]
    return failed


def growth_window(looks: list[tuple[float, dict[str, float], int]], steady_from_s: float, min_span_s: float):
    """The looks growth is measured between (pure): from the first at or after `steady_from_s` (the
    warm-up plus the retention, when what is kept for a while has reached its steady population) to
    the last, if they are `min_span_s` apart; else from the first look (a short run: the figure then
    includes that filling up, and says so by its window)."""
    if not looks:
        return None
    last = looks[-1]
    steady = next((look for look in looks if look[0] >= steady_from_s), None)
    if steady is not None and last[0] - steady[0] >= min_span_s:
        return steady, last
    return looks[0], last


def left_behind(first: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What Redis holds once the load has stopped and every request's time to live has passed,
    beside the first look after the warm-up (pure): `redis_left_bytes`, its share per 1,000
    requests accepted in between, and the key families that hold more keys than then."""
    requests = after.get("pg_requests_inserted", 0.0) - first.get("pg_requests_inserted", 0.0)
    left = after.get("redis_used_memory", 0.0) - first.get("redis_used_memory", 0.0)
    out = {"redis_left_bytes": left,
           "redis_left_bytes_per_1k_requests": round(left / requests * 1000, 1) if requests > 0 else None}
    for key, value in after.items():
        if key.startswith("redis_keys:") and value > first.get(key, 0.0):
            out[f"left:{key.removeprefix('redis_keys:')}"] = value - first.get(key, 0.0)
    return out


def report(args, tenants: list[Tenant], series: dict[str, list[tuple[float, float]]],
           looks: list[tuple[float, dict[str, float], int]], on_disk: list[str], restarted: bool,
           after: dict[str, float] | None = None) -> None:
    series = settled(series, args.warmup_minutes * 60)
    slopes = {name: s for name, points in series.items() if (s := slope_per_hour(points)) is not None}
    print(f"soak: {args.minutes:g} min, {len(tenants)} tenants, looks every {args.every_s:g} s after "
          f"{args.warmup_minutes:g} min, trainer restarted: {restarted}")
    print(f"{'tenant':<16}{'calls':>8}{'5xx':>6}{'lost':>6}  refused (4xx)")
    for t in tenants:
        print(f"{t.role:<16}{t.tally.calls:>8}{t.tally.server_errors:>6}{t.tally.lost:>6}  {dict(t.tally.refused)}")
    for t in tenants:
        for error in t.tally.errors[:3]:
            print(f"  {error}")
    print(f"\n{'series':<60}{'slope / h':>14}{'± 95%':>12}{'last':>14}")
    for name in sorted(slopes):
        b, ci = slopes[name]
        print(f"{name:<60}{b:>14.2f}{ci:>12.2f}{series[name][-1][1]:>14.1f}")
    ended = looks[-1][0] if looks else 0.0
    rss = {n: s for n, s in slopes.items() if n in judged_heaps(series, ended)}
    worst = max(rss, key=lambda n: rss[n][0]) if rss else None
    killed = sorted(n for n in slopes if n.startswith("anon_mib:") and n not in rss and series[n][-1][0] < ended)
    window = growth_window(looks, (args.warmup_minutes * 60 + args.retention_s), min_span_s=240.0)
    per_1k: dict[str, float | None] = {"redis_used_memory": None, "pg_database_bytes": None}
    per_1k_ci: dict[str, float | None] = dict(per_1k)
    requests = calls = 0
    if window is not None:
        (t0, first, calls0), (t1, last, calls1) = window
        requests, calls = int(last.get("pg_requests_inserted", 0) - first.get("pg_requests_inserted", 0)), calls1 - calls0
        span = [look for look in looks if t0 <= look[0] <= t1]
        for key in per_1k:
            # Fitted against the requests accepted (not two looks' difference): Redis's memory swings
            # by hundreds of kB with the futures alive at one instant.
            fit = slope([(look[1].get("pg_requests_inserted", 0.0), look[1].get(key, 0.0)) for look in span])
            if fit is not None and requests > 0:
                per_1k[key], per_1k_ci[key] = round(fit[0] * 1000, 1), round(fit[1] * 1000, 1)
    out = {"minutes": args.minutes, "tenants": len(tenants), "calls": sum(t.tally.calls for t in tenants),
           "growth_window_s": [round(t0), round(t1)] if window is not None else None,
           "requests_in_window": requests, "calls_in_window": calls,
           "max_rss_slope_mib_per_h": round(rss[worst][0], 2) if worst else None,
           "not_judged_gone_before_the_end": killed,
           "max_rss_slope_ci_mib_per_h": round(rss[worst][1], 2) if worst else None, "max_rss_slope_of": worst,
           "redis_bytes_per_1k_requests": per_1k["redis_used_memory"],
           "redis_bytes_per_1k_requests_ci": per_1k_ci["redis_used_memory"],
           "postgres_bytes_per_1k_requests": per_1k["pg_database_bytes"],
           "postgres_bytes_per_1k_requests_ci": per_1k_ci["pg_database_bytes"],
           "http_5xx": sum(t.tally.server_errors for t in tenants), "lost": sum(t.tally.lost for t in tenants),
           "client_errors": sum(len(t.tally.errors) for t in tenants), "expired_on_disk": len(on_disk),
           "trainer_restarted": restarted,
           **(left_behind(looks[0][1], after) if looks and after is not None else {"redis_left_bytes_per_1k_requests": None}),
           "bounds": BOUNDS}
    failed = judge(out)
    out.update(within_bounds=not failed, failed_bounds=failed,
               slopes_per_h={n: [round(b, 3), round(ci, 3)] for n, (b, ci) in sorted(slopes.items())})
    print(f"\nbounds (docs/operations/soak.md): {'all kept' if not failed else 'BROKEN: ' + '; '.join(failed)}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
