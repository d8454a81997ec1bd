"""What redis-py's reply parser costs the API per Redis call: hiredis (C) against the pure-Python one.

    .venv/bin/python bench/redis_parser.py [--calls 5000] [--repeats 3]

redis-py parses replies with hiredis when it is installed (a dependency of Quilt since 2026-12-03)
and in Python otherwise. The API's calls on Redis are small and many (a submission's append,
which takes its tokens per minute in the same script, the replicas' beacons read with one MGET, a
finished future's result), so the parser is a share of each request's CPU. This runs the same three
calls against the embedded Redis with each parser, alternating, in one process, and prints the
client's CPU time (`time.process_time`: this process only, not the server's) and wall time per round
of three. Loopback through a Unix socket, one connection: the regime where the client's own work is
most of a call (a remote Redis adds network time that the parser does not change). Ends with one JSON
line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.asyncio import Redis
from redis.utils import HIREDIS_AVAILABLE
from table import print_rows

from core import embedded, queue
from core.settings import CoreSettings
from core.work import Rejected, WorkItem, WorkKind

PARSERS = {"python": _AsyncRESP2Parser, "hiredis": _AsyncHiredisParser}
BEACON = json.dumps({"running": 12, "waiting": 3, "target": 64, "adapters": [f"m{i}" for i in range(16)], "at": 1.0})
RESULT = json.dumps({"type": "forward_backward", "metrics": {"loss:sum": 1.5},
                     "loss_fn_outputs": [{"logprobs": {"data": [-0.5] * 200}}]})


async def one_run(url: str, parser, calls: int) -> tuple[float, float]:
    """(client CPU us, wall us) per round: an append taking tokens, an MGET of 8 beacons, a GET of
    a result."""
    r = Redis.from_url(url, parser_class=parser)
    bucket = queue.Bucket("bench:bucket", 10**9, 1)

    async def append(i: int) -> None:
        item = WorkItem(f"{parser.__name__}-{time.monotonic_ns()}-{i}", "bench", "m", i, WorkKind.REJECTED, 0,
                        Rejected("bench"))
        await queue.enqueue(r, "bench", item, 60, "bench:stream", bucket)

    try:
        beacons = [f"bench:beacon:{i}" for i in range(8)]
        await r.mset({k: BEACON for k in beacons} | {"bench:result": RESULT})
        for i in range(200):  # warm: connection, script cache
            await append(i)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(calls):
            await append(i)
            await r.mget(beacons)
            await r.get("bench:result")
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return 1e6 * cpu / calls, 1e6 * wall / calls
    finally:
        await r.aclose()


async def main_async(args) -> dict:
    if not HIREDIS_AVAILABLE:
        raise SystemExit("hiredis is not installed: pip install -e . (it is a dependency)")
    with tempfile.TemporaryDirectory(prefix="redis-parser-") as d:
        url = embedded.redis_url(CoreSettings(data_dir=Path(d)))
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in PARSERS}
        for _ in range(args.repeats):  # alternating, so a slow spell of the host hits both
            for name, parser in PARSERS.items():
                runs[name].append(await one_run(url, parser, args.calls))
        embedded.shutdown()
    cpu = {name: statistics.median(c for c, _ in rs) for name, rs in runs.items()}
    wall = {name: statistics.median(w for _, w in rs) for name, rs in runs.items()}
    print(f"{args.calls} rounds x {args.repeats} (an append taking tokens + MGET of 8 beacons + GET of a result), medians:")
    print_rows([(name, f"client CPU {cpu[name]:6.1f} us per round, wall {wall[name]:6.1f} us   "
                       f"(runs: {', '.join(f'{c:.0f}' for c, _ in runs[name])})") for name in PARSERS], "  ")
    out = {"cpu_us_per_round": {k: round(v, 1) for k, v in cpu.items()},
           "wall_us_per_round": {k: round(v, 1) for k, v in wall.items()},
           "hiredis_cpu_over_python": round(cpu["hiredis"] / cpu["python"], 3)}
    print(f"hiredis / python client CPU: {out['hiredis_cpu_over_python']:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000, help="rounds of three calls per run")
    ap.add_argument("--repeats", type=int, default=3)
    print(json.dumps(asyncio.run(main_async(ap.parse_args()))))


if __name__ == "__main__":
    main()
