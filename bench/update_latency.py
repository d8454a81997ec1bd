"""One update end to end: a forward_backward and an optim_step, submitted together through the
official tinker SDK as its docs say (`fb = tc.forward_backward(...); opt = tc.optim_step(...);
fb.result(); opt.result()`), on the tiny base, at 1, 8 and 64 tenants updating at once.

    .venv/bin/python bench/update_latency.py [--tenants 1,8,64] [--updates 20] [--datums 2] [--tokens 16]

Each tenant is a thread with its own SDK client, doing `--updates` updates one after another
(after two unmeasured ones). Per update, the time from submitting the forward_backward to holding
both results is split by what the server records of its two requests:

- **compute**: while either request was in a trainer round (its row's `started_at` to
  `finished_at`: the fused pass of every tenant in that round, the optimizer step, writing the
  outcome);
- **wait for the round**: while a request sat in the trainer's stream and neither was in a round
  (its entry's arrival, read by a watcher of the stream, to `started_at`): other tenants' rounds
  ahead of it, and the trainer taking it up;
- **platform overhead**: the rest: the SDK and HTTP, authentication, admission and its Postgres
  write, the append to the stream, publishing the outcome, and the SDK's poll reading it.

Clocks: Postgres's `now()`, Redis's stream ids and this process's `time.time()` are one machine's
clock here. It prints p50, p95 and p99 of each per load, and which part dominates; of the
overhead, `submit` (submitting until the forward_backward's entry is in the stream) and `deliver`
(the last row finished until the client holds both results). Which regime
favours Quilt: small batches on a tiny base, where the compute is short and the overhead shows;
a real base's compute (hundreds of ms a round on a GPU) would dwarf it. What counts against it:
the SDK clients, the stores and the trainer share this machine's 2 cores, so at 64 tenants the
clients' own CPU is in every figure. The hosted service's published median for the same pair
(tinker 0.23, submitted together) is 5.08 s: docs/benchmarks/update_latency.md.

Ends with one JSON line: `<part>_p50_ms_<tenants>`, `<part>_p95_ms_<tenants>`,
`<part>_p99_ms_<tenants>` for part in total, compute, wait, overhead.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psycopg  # noqa: E402
import redis  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from core import queue  # noqa: E402
from core.work import WorkItem  # noqa: E402
from stack.ephemeral import TINY, RunningStack, ephemeral_stack, new_tenant  # noqa: E402

PARTS = ("total", "compute", "wait", "overhead")
# Two parts of the overhead: the forward_backward's submission until its entry is in the stream,
# and from the last request's row finished until the client holds both results.
OVERHEAD_PARTS = ("submit", "deliver")
WARMUP = 2


@dataclass
class Update:
    model_id: str
    index: int  # the tenant's n-th update, warm-ups included
    submitted: float  # time.time()
    done: float


class StreamWatcher:
    """Reads the trainer's stream as entries arrive (plain XREAD, beside the trainer's group), so
    each request's arrival time is known though the trainer deletes its entry once it is done."""

    def __init__(self, redis_url: str, stream: str):
        self._redis, self._stream = redis.Redis.from_url(redis_url), stream
        self.arrivals: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = "$"
        while not self._stop.is_set():
            for _stream, entries in self._redis.xread({self._stream: last}, block=200) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.arrivals[WorkItem.from_fields(fields).request_id] = queue.appended_at(entry_id)

    def __enter__(self) -> StreamWatcher:
        self._thread.start()
        time.sleep(0.3)  # its first read is blocked on the stream before any update is submitted
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _data(n: int, tokens: int, seed: int) -> list[types.Datum]:
    out = []
    for i in range(n):
        ids = [(seed * 7 + i * 13 + j * 3) % 200 + 10 for j in range(tokens + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * tokens}))
    return out


def _tenant(base_url: str, key: str, args: argparse.Namespace, seed: int, start: threading.Barrier,
            out: list[Update], errors: list[str]) -> None:
    try:
        with tinker.ServiceClient(base_url=base_url, api_key=key) as service:
            tc = service.create_lora_training_client(base_model=TINY, rank=4).result()
            model_id = tc.model_id
            data, adam = _data(args.datums, args.tokens, seed), types.AdamParams(learning_rate=1e-3)
            for index in range(WARMUP + args.updates):
                if index == WARMUP:
                    start.wait()  # the measured updates of every tenant start together
                submitted = time.time()
                fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
                fb.result()
                opt.result()
                out.append(Update(model_id, index, submitted, time.time()))
    except Exception as e:  # reported with the figures: a lost update is a finding, not a crash
        errors.append(f"{type(e).__name__}: {e}")
        start.abort()


def _rows(database_url: str, model_ids: list[str]) -> dict[str, list[dict]]:
    """Per model, its forward_backward and optim_step rows in seq_id order."""
    with psycopg.connect(database_url, row_factory=psycopg.rows.dict_row) as conn:
        rows = conn.execute(
            "SELECT id, model_id, kind, extract(epoch FROM created_at) AS created, extract(epoch FROM started_at) "
            "AS started, extract(epoch FROM finished_at) AS finished FROM requests WHERE model_id = ANY(%s) AND "
            "kind IN ('forward_backward', 'optim_step') ORDER BY model_id, seq_id", (model_ids,)).fetchall()
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["model_id"], []).append(row)
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def split(update: Update, fb: dict, opt: dict, arrivals: dict[str, float]) -> dict[str, float]:
    """One update's parts in seconds (see the module docstring)."""
    pair = (fb, opt)
    compute = _union([(float(r["started"]), float(r["finished"])) for r in pair])
    queued = _union([(arrivals.get(r["id"], float(r["created"])), float(r["started"])) for r in pair])
    total = update.done - update.submitted
    c = _length(compute)
    w = _length(queued) - _overlap(queued, compute)
    submit = min(arrivals.get(r["id"], float(r["created"])) for r in pair) - update.submitted
    deliver = update.done - max(float(r["finished"]) for r in pair)
    return {"total": total, "compute": c, "wait": w, "overhead": total - c - w,
            "submit": submit, "deliver": deliver}


def _pct(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def run_level(stack: RunningStack, n: int, args: argparse.Namespace) -> tuple[dict[str, list[float]], list[str]]:
    keys = [new_tenant(stack, f"upd-{n}-{i}", max_inflight_requests=10_000, tokens_per_minute=100_000_000)[1]
            for i in range(n)]
    updates: list[Update] = []
    errors: list[str] = []
    start = threading.Barrier(n)
    with StreamWatcher(stack.redis_url, queue.train_stream(TINY)) as watcher:
        threads = [threading.Thread(target=_tenant, args=(stack.base_url, key, args, i, start, updates, errors))
                   for i, key in enumerate(keys)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows = _rows(stack.database_url, sorted({u.model_id for u in updates}))
    parts: dict[str, list[float]] = {p: [] for p in (*PARTS, *OVERHEAD_PARTS)}
    for u in updates:
        if u.index < WARMUP:
            continue
        mine = rows.get(u.model_id, [])
        fbs = [r for r in mine if r["kind"] == "forward_backward"]
        opts = [r for r in mine if r["kind"] == "optim_step"]
        if u.index >= min(len(fbs), len(opts)):
            errors.append(f"model {u.model_id}: update {u.index} has no rows")
            continue
        for part, value in split(u, fbs[u.index], opts[u.index], watcher.arrivals).items():
            parts[part].append(value * 1000)
    return parts, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", default="1,8,64", help="the loads, tenants updating at once")
    parser.add_argument("--updates", type=int, default=20, help="measured updates per tenant")
    parser.add_argument("--datums", type=int, default=2, help="datums per forward_backward")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per datum")
    args = parser.parse_args()
    levels = [int(x) for x in args.tenants.split(",") if x]

    out: dict[str, object] = {"updates_per_tenant": args.updates, "datums": args.datums, "tokens": args.tokens}
    results = {}
    with ephemeral_stack(setup=[["models", "create-tiny", "--no-sample"]]) as stack:
        for n in levels:
            results[n] = run_level(stack, n, args)
    print(f"one update (forward_backward + optim_step submitted together, {args.datums} datums x {args.tokens} "
          f"tokens), tiny base, {args.updates} measured updates per tenant, ms")
    print(f"{'tenants':>8}{'part':>10}{'p50':>9}{'p95':>9}{'p99':>9}{'share of p50':>14}")
    for n, (parts, errors) in results.items():
        total_p50 = _pct(parts["total"], 0.5)
        for part in (*PARTS, *OVERHEAD_PARTS):
            p50, p95, p99 = (_pct(parts[part], q) for q in (0.5, 0.95, 0.99))
            label = part if part in PARTS else "  " + part
            print(f"{n:>8}{label:>10}{p50:>9.1f}{p95:>9.1f}{p99:>9.1f}{p50 / max(total_p50, 1e-9):>14.0%}")
            out.update({f"{part}_p50_ms_{n}": round(p50, 2), f"{part}_p95_ms_{n}": round(p95, 2),
                        f"{part}_p99_ms_{n}": round(p99, 2)})
        top = max(("compute", "wait", "overhead"), key=lambda p: _pct(parts[p], 0.5))
        print(f"{'':>8} at {n} tenants {top} dominates; {len(parts['total'])} updates measured, "
              f"{len(errors)} errors{': ' + errors[0] if errors else ''}")
        out[f"dominant_{n}"] = top
        out[f"errors_{n}"] = len(errors)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
