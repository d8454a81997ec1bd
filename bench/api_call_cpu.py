"""The API's CPU per cheap call, in process, side by side across versions of the code.

    .venv/bin/python bench/api_call_cpu.py [--revs HEAD~1,.] [--rounds 3] [--calls 3000]

`bench/api_load.py` measures the API as a client sees it, through sockets and HTTP parsing, on a
host whose speed moves by half from hour to hour, so two runs of it cannot resolve a change of a
tenth in a call's CPU. This one takes everything but the app away: it starts one embedded stack,
gives two tenants a model and a finished forward_backward (`api_load.prepare_tenants`), and then,
in turns (`--rounds` times each), runs a child process per revision (`.` is the working tree;
others are checked out with `git worktree` for the run). A child imports that revision's
`api.app`, runs the app's lifespan against the shared stack (its pool, Redis client and caller
cache), and calls the ASGI app directly, `--calls` times for each of `get_info`,
`create_session` and `retrieve_future` of a finished future, timing its own CPU. The stores' work
is not in that time (they are other processes); the store clients' is. With at least 2 CPUs the
children run on the first and the stack on the others. Prints the median per call and revision
and each revision's ratio to the first; ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def _call(app, path: str, body: dict, key: str) -> None:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/api/v1" + path, "raw_path": ("/api/v1" + path).encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {},
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"), (b"x-api-key", key.encode()),
                         (b"content-length", str(len(raw)).encode())]}
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if delivered:  # the app asks again only to watch for a disconnect
            await asyncio.Event().wait()
        delivered = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"{path} answered {sent[0]['status']}: {sent[1:]}")


async def _child(calls: int) -> dict[str, float]:
    from api.app import create_app  # the revision's, by PYTHONPATH

    # [(key, {call: body})], one per tenant, made by the parent: a child imports nothing from bench/,
    # which an older revision's tree may not match.
    callers = json.loads(os.environ["BENCH_CALLERS"])
    app = create_app()
    async with app.router.lifespan_context(app):
        for _ in range(200):  # until the caller cache listens, as it does in a serving process
            if app.state.callers.live:
                break
            await asyncio.sleep(0.05)
        out = {}
        for name in callers[0][1]:
            for i in range(200):  # warm: caches, prepared statements, pooled connections
                key, bodies = callers[i % len(callers)]
                await _call(app, f"/{name}", bodies[name], key)
            started = time.process_time()
            for i in range(calls):
                key, bodies = callers[i % len(callers)]
                await _call(app, f"/{name}", bodies[name], key)
            out[name] = 1e6 * (time.process_time() - started) / calls
    return out


@contextlib.contextmanager
def _checkouts(revs: list[str]):
    """Each revision's tree: `.` as it is, others checked out for the run."""
    with tempfile.TemporaryDirectory(prefix="api-call-cpu-") as tmp:
        trees, made = {}, []
        for rev in revs:
            if rev == ".":
                trees[rev] = ROOT
                continue
            tree = Path(tmp) / f"rev{len(made)}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
            made.append(tree)
            trees[rev] = tree
        try:
            yield trees
        finally:
            for tree in made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revs", default=".", help="comma-separated git revisions; '.' is the working tree")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each revision")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls of each kind per turn")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args.calls))))
        return

    import api_load  # bench/ is this script's folder, first on sys.path

    from stack.ephemeral import ephemeral_stack

    revs = [r for r in args.revs.split(",") if r]
    cpus = sorted(os.sched_getaffinity(0))
    with _checkouts(revs) as trees, ephemeral_stack({}, parent=Path("/dev/shm")) as stack:
        tenants = api_load.prepare_tenants(stack, 2)
        if len(cpus) >= 2:
            api_load._pin([], api_load._stores(stack), {cpus[0]}, set(cpus[1:]))
        env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
               "QUILT_DATA_DIR": str(stack.data_dir), "QUILT_LOOP_LAG_PROBE_S": "0",
               "BENCH_CALLERS": json.dumps([(t["key"], api_load.cheap_bodies(t)) for t in tenants])}
        taskset = ["taskset", "-c", str(cpus[0])] if len(cpus) >= 2 else []
        turns: dict[str, list[dict]] = {rev: [] for rev in revs}
        for _ in range(args.rounds):
            for rev in revs:
                done = subprocess.run([*taskset, sys.executable, str(Path(__file__).resolve()), "--child",
                                       "--calls", str(args.calls)], cwd=trees[rev],
                                      env={**env, "PYTHONPATH": str(trees[rev])}, capture_output=True, text=True,
                                      timeout=1800)
                if done.returncode != 0:
                    raise SystemExit(f"{rev}: {done.stderr[-3000:]}")
                turns[rev].append(json.loads(done.stdout.strip().splitlines()[-1]))

    median = {rev: {c: statistics.median(t[c] for t in turns[rev]) for c in api_load.CALLS} for rev in revs}
    first = revs[0]
    print(f"API CPU per call, in process (median of {args.rounds} turns of {args.calls} calls), µs")
    print(f"{'revision':<24}" + "".join(f"{c:>18}" for c in api_load.CALLS) + f"{'vs ' + first:>16}")
    out = {"calls": args.calls, "rounds": args.rounds, "revs": revs, "cpu_us": {}, "ratio_to_first": {}}
    for rev in revs:
        ratio = statistics.mean(median[rev][c] / median[first][c] for c in api_load.CALLS)
        print(f"{rev:<24}" + "".join(f"{median[rev][c]:>18.1f}" for c in api_load.CALLS) + f"{ratio:>15.2f}x")
        out["cpu_us"][rev] = {c: round(median[rev][c], 1) for c in api_load.CALLS}
        out["ratio_to_first"][rev] = round(ratio, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
