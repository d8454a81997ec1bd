"""Routing across two real generation replicas: Quilt's affinity policy against round-robin and random.

One stack per policy (`quilt up --gen-replicas 2`, QUILT_GEN_ROUTING=<policy>), each replica a real
vLLM engine with few adapter slots (QUILT_GEN_MAX_LORAS, QUILT_GEN_MAX_CPU_LORAS), so that where a
group lands matters: an engine batches at most max_loras adapters at once, and one outside its
CPU cache is loaded again from the checkpoint store. TENANTS tenants, each with its own adapter,
run ROUNDS synchronous batches of GROUPS sample(n) groups through the API (the whole path: router,
replica streams, admission, engine), from one thread each, starting together.

Printed per policy: generated tokens/s over the run, the adapter hit rate (groups whose adapter was
in one of the replica's engine slots already, by the replica's own count: core of the LRU of its
last max_loras - 1 adapters; an estimate of what vLLM holds), and each tenant's time-to-batch
p50/p95; then affinity over each baseline.

Which regime favours affinity: more tenants than one replica's adapter slots, fewer than all
replicas' together (here 4 tenants, 2 slots per replica). With adapters fitting in one replica,
or one adapter for everyone, the policies tie and round-robin's perfect spread can win a little.
On this 2-core machine both engines share the cores, so tokens/s is what the pair gives, not 2x.

    python bench/genpool_replicas.py [--tenants 4 --rounds 12 --groups 4 --n 4 --tokens 48]

Ends with one JSON line: {"hit_rate": {policy: ...}, "tps": {...}, "affinity_over_round_robin_tps",
"affinity_over_random_tps", "worst_tenant_p95_vs_round_robin", "worst_tenant_p95_vs_random"}.
Targets (issue 17): hit rate >= 90%, tokens/s >= round-robin's, every tenant's p95 <= 1.1x.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import quilt
from genpool_sim import pct
from table import print_rows

from core import health, queue, redis_client
from stack.ephemeral import TINY, ephemeral_stack, new_tenant

POLICIES = ("affinity", "round_robin", "random")


def _counters(r) -> tuple[int, int]:
    hits = misses = 0
    for name in queue.replica_names(2):
        raw = r.get(health.gen_key(TINY, name))
        beacon = json.loads(raw) if raw else {}
        hits += beacon.get("adapter_hits", 0)
        misses += beacon.get("adapter_misses", 0)
    return hits, misses


def _settled(r, seconds: float = 2.5) -> tuple[int, int]:
    time.sleep(seconds)  # the beacons are a second old at most
    return _counters(r)


def run_policy(policy: str, args) -> dict:
    env = {"QUILT_GEN_ROUTING": policy, "QUILT_GEN_MAX_LORAS": str(args.max_loras),
           "QUILT_GEN_MAX_CPU_LORAS": str(args.max_cpu_loras),
           "QUILT_GEN_CONCURRENCY_TARGET": str(args.target)}
    with ephemeral_stack(env, gen_replicas=2) as s:
        r = redis_client.sync_client(s.redis_url)
        clients, samplers = [], []
        for i in range(args.tenants):
            _, key = new_tenant(s, f"route-{i}")
            client = quilt.Client(api_key=key, base_url=s.base_url)
            tc = client.create_training_client(TINY, rank=8, seed=i)
            clients.append(client)
            samplers.append(tc.save_weights_and_get_sampling_client(f"route-{i}"))
        base = clients[0].create_sampling_client(base_model=TINY)
        for _ in range(4):  # both engines warm, no adapter involved
            base.sample([1, 2, 3], 1, quilt.SamplingParams(max_tokens=4)).result(timeout=300)
        hits0, misses0 = _settled(r)
        ttb: list[list[float]] = [[] for _ in samplers]
        tokens = [0] * len(samplers)
        go = threading.Barrier(len(samplers) + 1)

        def tenant(i: int) -> None:
            params = quilt.SamplingParams(max_tokens=args.tokens, stop=[])
            go.wait()
            for k in range(args.rounds):
                started = time.monotonic()
                futures = [samplers[i].sample([7 + i, 8, 9, k, g], args.n, params) for g in range(args.groups)]
                outs = [f.result(timeout=600) for f in futures]
                ttb[i].append(time.monotonic() - started)
                tokens[i] += sum(len(seq.tokens) for o in outs for seq in o.sequences)

        threads = [threading.Thread(target=tenant, args=(i,)) for i in range(len(samplers))]
        for t in threads:
            t.start()
        go.wait()
        started = time.monotonic()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        hits, misses = _settled(r)
        for client in clients:
            client.close()
    hits, misses = hits - hits0, misses - misses0
    return {"tps": sum(tokens) / wall, "wall_s": wall, "hit_rate": hits / max(1, hits + misses),
            "groups": hits + misses, "p50": [statistics.median(x) for x in ttb], "p95": [pct(x, 0.95) for x in ttb],
            "rounds": ttb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--target", type=int, default=32)
    ap.add_argument("--max-loras", type=int, default=3, help="engine slots per replica, one the identity's")
    ap.add_argument("--max-cpu-loras", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, args)
        res = results[policy]
        print(f"\n{policy}")
        print_rows([("tokens/s", f"{res['tps']:.0f} (wall {res['wall_s']:.1f} s)"),
                    ("adapter hit rate", f"{res['hit_rate']:.1%} of {res['groups']} groups"),
                    ("time-to-batch p50 per tenant", " ".join(f"{x:.2f}" for x in res["p50"])),
                    ("time-to-batch p95 per tenant", " ".join(f"{x:.2f}" for x in res["p95"]))]
                   + [(f"  tenant {i}, batch by batch", " ".join(f"{x:.1f}" for x in xs))
                      for i, xs in enumerate(res["rounds"])], indent="  ")
    out = {"hit_rate": {p: round(v["hit_rate"], 4) for p, v in results.items()},
           "tps": {p: round(v["tps"], 1) for p, v in results.items()}}
    if "affinity" in results and len(results) > 1:
        aff = results["affinity"]
        print("\naffinity over")
        rows = []
        for other in (p for p in results if p != "affinity"):
            o = results[other]
            worst = max(a / b for a, b in zip(aff["p95"], o["p95"], strict=True))
            out[f"affinity_over_{other}_tps"] = round(aff["tps"] / o["tps"], 3)
            out[f"worst_tenant_p95_vs_{other}"] = round(worst, 3)
            rows.append((other, f"tokens/s {aff['tps'] / o['tps']:.2f}x, worst tenant p95 {worst:.2f}x"))
        print_rows(rows, indent="  ")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
