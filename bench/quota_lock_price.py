"""The price of the per-tenant quota lock: bench/api_load.py's clients against the API as it is, as
it was when the lock came (54e4d77) and as it was before, in one run.

    .venv/bin/python bench/quota_lock_price.py [--seconds 60] [--slices 6] [--clients 64] [--tenants 8]

One embedded stack, three API processes on its Postgres and Redis (bench/_quota_lock_arms.py):
`locked`, the stack's own, which takes the lock in its statement's round trip on the fast paths
(records.locked_statement); `session_lock`, the lock as 54e4d77 took it there: a session lock,
the statement, its release; `unlocked`, the code before the lock. api_load's 64 clients over 8
tenants make the cheap calls (`get_info`, `create_session`, `retrieve_future` of a finished
future) with a `forward_backward` submission every `--submit-every` calls; `create_session` and
`forward_backward` count and insert under the lock. Two phases, each in `--slices` turns that
go through the arms (in reverse every other turn), so a slow spell of this shared host falls on
each:

1. **Capacity**: every client sends its next call as soon as the last one answers; calls per
   second of the arm's own API CPU time (read from /proc, the API pinned to a core of its own with
   `--pin`) is the cost per call that a host running at another speed leaves in place as a ratio.
2. **Paced**: Poisson arrivals at `--paced-share` of the slowest arm's capacity: the p99 a service
   running below saturation sees.

Regimes: the lock's cost is per locked call, so a mix richer in submissions and session creations
than this one (a third of the cheap calls, and 1 in 20 submissions) pays more; the one-tenant-
per-client case, where the lock is never contended, pays its round trips but never waits on it. On
this 2-core machine Postgres shares a core with the clients, which makes each round trip dearer
than on a deployment whose database has a machine of its own, so the figure here is an upper bound.

Ends with one JSON line: `per_cpu_s_<arm>` (calls per API CPU-second), `cpu_cost_pct_<arm>` (how
much more API CPU a call takes than unlocked), and p99s per arm, for the cheap calls and the
locked ones.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
from api_load import CALLS, _api_processes, _pct, _pin, _run_clients, _stores, merge_parts, prepare_tenants

from stack.ephemeral import RunningStack, ephemeral_stack, free_port, healthy

LOCKED_CALLS = ("create_session", "forward_backward")
# Both arms' API settings. The clients open thousands of sessions a minute and never finish one:
# past the live-session bound, create_session would measure the 429 instead of the insert.
API_ENV = {"QUILT_WORKERS": "1", "QUILT_MAX_LIVE_SESSIONS_PER_TENANT": "1000000"}


def _start_arm(stack: RunningStack, factory: str) -> tuple[subprocess.Popen, str]:
    """Another API process on the stack's stores, made by `factory` of bench/_quota_lock_arms.py;
    (its process, its URL)."""
    port = free_port()
    env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
           "QUILT_DATA_DIR": str(stack.data_dir), "HF_HUB_OFFLINE": "1", **API_ENV,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    log_path = stack.log_dir / f"api-{factory}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the process holds it until it ends
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", f"_quota_lock_arms:{factory}", "--host",
                             "127.0.0.1", "--port", str(port), "--no-proxy-headers", "--no-access-log"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {factory} API did not start: see {log_path}")
        time.sleep(0.3)
    return proc, url


def _alternate(arms: dict[str, tuple[str, list[psutil.Process]]], clients: list, args, rate: float,
               other_cpus: set[int] | None, seconds: float) -> dict[str, tuple[dict[str, list], float, float]]:
    """`seconds` of the clients on each arm, in `--slices` alternating turns; per arm (samples per
    call, wall s, the arm's API CPU s)."""
    out: dict[str, tuple[dict[str, list], float, float]] = {name: ({}, 0.0, 0.0) for name in arms}
    names = list(arms)
    for i in range(args.slices):
        for name in names if i % 2 == 0 else reversed(names):
            url, procs = arms[name]
            parts, wall, cpu = _run_clients(url, clients, args, rate, other_cpus, procs, seconds / args.slices, 7 + i)
            samples, wall0, cpu0 = out[name]
            for call, values in merge_parts(parts, clients, args.procs).items():
                samples.setdefault(call, []).extend(values)
            out[name] = (samples, wall0 + wall, cpu0 + cpu)
    return out


def _summary(samples: dict[str, list], wall: float, cpu: float) -> dict:
    ok = {call: [v[0] * 1000 for v in values if v[0] >= 0] for call, values in samples.items()}
    cheap = [x for call in CALLS for x in ok.get(call, [])]
    locked = [x for call in LOCKED_CALLS for x in ok.get(call, [])]
    calls = sum(len(v) for v in ok.values())
    return {"calls": calls, "per_s": round(calls / wall, 1), "per_cpu_s": round(calls / max(cpu, 1e-9), 1),
            "cheap_p50_ms": round(_pct(cheap, 0.5), 2), "cheap_p99_ms": round(_pct(cheap, 0.99), 2),
            "locked_p50_ms": round(_pct(locked, 0.5), 2), "locked_p99_ms": round(_pct(locked, 0.99), 2),
            "errors": sum(1 for values in samples.values() for v in values if v[0] < 0),
            "error_statuses": dict(Counter(f"{call} {-int(v[0])}" for call, values in samples.items()
                                           for v in values if v[0] < 0))}


def _print(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"{'arm':<14}{'calls':>8}{'per s':>8}{'per CPU-s':>11}{'cheap p50':>11}{'cheap p99':>11}"
          f"{'locked p50':>12}{'locked p99':>12}{'errors':>8}")
    for name, r in rows.items():
        print(f"{name:<14}{r['calls']:>8}{r['per_s']:>8.0f}{r['per_cpu_s']:>11.0f}{r['cheap_p50_ms']:>11.2f}"
              f"{r['cheap_p99_ms']:>11.2f}{r['locked_p50_ms']:>12.2f}{r['locked_p99_ms']:>12.2f}{r['errors']:>8}"
              f"  {r['error_statuses'] or ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each arm's time in each phase")
    parser.add_argument("--slices", type=int, default=6, help="turns per phase, alternating the arms")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--procs", type=int, default=1, help="load-generator processes")
    parser.add_argument("--submit-every", type=int, default=20, help="every Nth call submits a forward_backward")
    parser.add_argument("--paced-share", type=float, default=0.5, help="phase 2's rate, a share of the slowest arm's")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2)
    args = parser.parse_args()

    with ephemeral_stack(API_ENV, setup=[["models", "create-tiny", "--no-sample"]]) as stack, \
            contextlib.ExitStack() as started:
        arms = {"locked": stack.base_url}
        for name, factory in (("session_lock", "session_lock_app"), ("unlocked", "unlocked_app")):
            proc, arms[name] = _start_arm(stack, factory)
            started.callback(proc.wait, timeout=30)
            started.callback(proc.terminate)
        tenants = prepare_tenants(stack, args.tenants)
        processes = {name: (url, _api_processes(url)) for name, url in arms.items()}
        cpus = sorted(os.sched_getaffinity(0))
        other = None
        if args.pin:
            other = set(cpus[1:])
            _pin([p for _url, procs in processes.values() for p in procs], _stores(stack), {cpus[0]}, other)
        per_tenant = max(1, args.clients // args.tenants)
        clients = [(tenants[c % args.tenants], [2 + c // args.tenants], per_tenant) for c in range(args.clients)]
        full = {name: _summary(*v) for name, v in _alternate(processes, clients, args, 0.0, other, args.seconds).items()}
        rate = args.paced_share * min(r["per_s"] for r in full.values()) / args.clients
        paced = {name: _summary(*v) for name, v in _alternate(processes, clients, args, rate, other, args.seconds).items()}

    print(f"{args.clients} clients, {args.tenants} tenants, {args.seconds:g} s per arm per phase in {args.slices} "
          f"slices, pinned: {bool(args.pin)}; locked calls: {', '.join(LOCKED_CALLS)}")
    _print("1. capacity", full)
    _print(f"2. paced at {args.paced_share:.0%} of the slowest arm's capacity ({rate * args.clients:.0f} requests/s)",
           paced)
    base = full["unlocked"]["per_cpu_s"]
    cost = {name: base / max(full[name]["per_cpu_s"], 1e-9) - 1 for name in ("locked", "session_lock")}
    print(f"\nmore API CPU per call than without a lock, in this mix: {cost['locked']:.1%} with the lock in the "
          f"statement's round trip (today), {cost['session_lock']:.1%} with a session lock around it")
    out = {**{f"per_cpu_s_{name}": row["per_cpu_s"] for name, row in full.items()},
           **{f"cpu_cost_pct_{name}": round(c * 100, 2) for name, c in cost.items()},
           **{f"{phase}_{k}_{arm}": rows[arm][k] for phase, rows in (("capacity", full), ("paced", paced))
              for arm in rows for k in ("cheap_p99_ms", "locked_p99_ms", "errors")},
           "paced_rate": round(rate * args.clients, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
