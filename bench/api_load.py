"""Load on one API process: 64 clients across 8 tenants making cheap calls in bounded loops.

    PYTHONPATH=. .venv/bin/python bench/api_load.py [--seconds 300] [--clients 64] [--tenants 8]

Starts its own embedded stack (`quilt up` in a temporary data directory), gives each tenant a
model with one finished forward_backward, then runs the clients for `--seconds`, spread over
`--procs` load-generator processes (asyncio, one connection per client, loopback only). Each
client cycles through the calls the issue names as cheap: `get_info`, `create_session` and
`retrieve_future` of a finished future (the API's result-ready-to-response path), plus a
`forward_backward` submission every `--submit-every` calls (the submit-to-enqueue path; the
trainer runs them). It prints, per call: count, errors other than intended 429s, p50/p99 latency
as the client sees it; and in all: requests per second. Ends with one JSON line.

Client-side latency on one machine: the load generators share the 2 cores with the API process
(and an idle trainer and generation worker), so requests per second here is a floor of what one
API process does on a machine of its own; per-call latency at low load is its own overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time

import httpx

from stack.ephemeral import TINY, RunningStack, ephemeral_stack, new_tenant


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
        out.append({"key": key, "model_id": model_id, "finished": finished, "next_seq": 2})
    return out


CALLS = ("get_info", "create_session", "retrieve_future")


async def _client(base_url: str, tenant: dict, seq_start: int, seq_stride: int, stop_at: float,
                  submit_every: int) -> dict[str, list]:
    """One client's bounded loop; returns {call: [latency_s or -status]}."""
    seen: dict[str, list] = {name: [] for name in (*CALLS, "forward_backward")}
    bodies = {"get_info": {"model_id": tenant["model_id"]}, "create_session": {},
              "retrieve_future": {"request_id": tenant["finished"]}}
    seq = seq_start
    async with httpx.AsyncClient(base_url=base_url + "/api/v1", headers={"X-API-Key": tenant["key"]},
                                 timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        i = 0
        while time.monotonic() < stop_at:
            if submit_every and i % submit_every == submit_every - 1:
                name, body = "forward_backward", {"model_id": tenant["model_id"], "seq_id": seq,
                                                  "forward_backward_input": {"data": [_datum([5, 6, 7, 8])],
                                                                             "loss_fn": "cross_entropy"}}
                seq += seq_stride
            else:
                name = CALLS[i % len(CALLS)]
                body = bodies[name]
            i += 1
            started = time.perf_counter()
            try:
                r = await c.post(f"/{name}", json=body)
                status = r.status_code
            except httpx.HTTPError:
                status = 0
            elapsed = time.perf_counter() - started
            seen[name].append(elapsed if status == 200 else -status)
    return seen


def _generator(args: tuple) -> dict[str, list]:
    base_url, clients, stop_at, submit_every = args

    async def run() -> list:
        return await asyncio.gather(*(_client(base_url, t, s, stride, stop_at, submit_every)
                                      for t, s, stride in clients))

    merged: dict[str, list] = {}
    for seen in asyncio.run(run()):
        for name, values in seen.items():
            merged.setdefault(name, []).extend(values)
    return merged


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1] if len(values) > 1 else (
        values[0] if values else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--procs", type=int, default=4, help="load-generator processes")
    parser.add_argument("--submit-every", type=int, default=20, help="every Nth call submits a forward_backward")
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (QUILT_API_WORKERS)")
    args = parser.parse_args()

    with ephemeral_stack({"QUILT_API_WORKERS": str(args.api_workers)}) as stack:
        tenants = prepare_tenants(stack, args.tenants)
        # Client k of a tenant submits seq_ids start, start + stride, ...: the tenant's clients never collide.
        per_tenant = max(1, args.clients // args.tenants)
        clients = [(tenants[c % args.tenants], 2 + c // args.tenants, per_tenant) for c in range(args.clients)]
        stop_at = time.monotonic() + args.seconds
        shares = [(stack.base_url, clients[p::args.procs], stop_at, args.submit_every) for p in range(args.procs)]
        started = time.monotonic()
        with multiprocessing.get_context("spawn").Pool(args.procs) as pool:
            parts = pool.map(_generator, shares)
        wall = time.monotonic() - started

    merged: dict[str, list] = {}
    for part in parts:
        for name, values in part.items():
            merged.setdefault(name, []).extend(values)
    print(f"{args.clients} clients, {args.tenants} tenants, {args.seconds:.0f} s, {args.procs} generator processes, "
          f"{args.api_workers} API process(es)")
    print(f"{'call':<18}{'count':>8}{'429':>7}{'errors':>8}{'p50 ms':>9}{'p99 ms':>9}")
    total = errors = 0
    summary = {}
    for name, values in merged.items():
        ok = [v for v in values if v >= 0]
        limited = sum(1 for v in values if v == -429)
        bad = len(values) - len(ok) - limited
        total += len(values)
        errors += bad
        p50, p99 = _pct(ok, 0.5) * 1000, _pct(ok, 0.99) * 1000
        summary[name] = {"count": len(values), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2)}
        print(f"{name:<18}{len(values):>8}{limited:>7}{bad:>8}{p50:>9.2f}{p99:>9.2f}")
    cheap = [v for name in CALLS for v in merged[name] if v >= 0]
    rps = total / wall
    print(f"\n{rps:.0f} requests/s in all; cheap calls p50 {_pct(cheap, 0.5) * 1000:.2f} ms, "
          f"p99 {_pct(cheap, 0.99) * 1000:.2f} ms; {errors} errors other than 429")
    print(json.dumps({"clients": args.clients, "seconds": args.seconds, "api_workers": args.api_workers,
                      "requests_per_s": round(rps, 1),
                      "cheap_p50_ms": round(_pct(cheap, 0.5) * 1000, 2),
                      "cheap_p99_ms": round(_pct(cheap, 0.99) * 1000, 2), "errors": errors, "calls": summary}))


if __name__ == "__main__":
    main()
