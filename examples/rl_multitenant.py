"""Four tenants running RL at once on one Quilt server, and what the server did for them.

Each tenant trains its own LoRA adapter on its own variant of the band task of examples/rl_tiny.py
(same loop, quilt.rl GRPO with bounded staleness), all four at the same time against one trainer and
one generation pool. Before and after, the example reads the server's own counters (the public
`GET /api/v1/healthz` aggregates of the trainer and generation-pool beacons) and reports:

* fused rounds: how many tenants' forward/backward requests the trainer ran in one pass, on average;
* gap filling: the fraction of the generation engine's busy time during which two or more tenants'
  rollouts were running in it together, and its slot utilisation;
* each tenant's reward, first and last steps.

    QUILT_API_KEYS=tml-a,tml-b,tml-c,tml-d QUILT_BASE_URL=http://127.0.0.1:8000 python examples/rl_multitenant.py

Without QUILT_API_KEYS it creates four tenants with `quilt tenants create` (embedded mode, on the
server's machine). Ends with one JSON line: each tenant's reward_first/reward_last, the mean tenants
per fused round, the mixed-tenant fraction of engine time and the seconds taken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time

import httpx
import quilt
from quilt import rl
from rl_tiny import BASE_MODEL, BandTask, add_arguments, group_builder, rl_config

TRAINER_FIELDS = ("rounds", "fused_rounds", "tenants_fused", "models_fused", "tokens")
GEN_FIELDS = ("slot_s", "capacity_s", "active_s", "mixed_s", "tokens", "groups")


def server_counters(base_url: str, key: str, wait_s: float = 15.0) -> dict[str, dict[str, float]]:
    """The trainer's and the generation pool's cumulative counters for the base model, as of now.

    Workers publish their figures every couple of seconds (each carries its own `at`), so this
    waits for figures stamped after the call: a short run read from older ones would miss its
    own last rounds."""
    asked = time.time()
    deadline = time.monotonic() + wait_s
    while True:
        # healthz shows the workers' counters to a keyed caller (anonymous: up or down only).
        health = httpx.get(f"{base_url}/api/v1/healthz", headers={"X-API-Key": key}, timeout=30).json()["components"]
        trainer = health.get(f"trainer:{BASE_MODEL}", {})
        gen = health.get(f"gen:{BASE_MODEL}", {})
        if min(float(trainer.get("at") or 0), float(gen.get("at") or 0)) >= asked or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return {"trainer": {k: float(trainer.get(k) or 0) for k in TRAINER_FIELDS},
            "gen": {k: float(gen.get(k) or 0) for k in GEN_FIELDS}}


def delta(after: dict, before: dict) -> dict[str, dict[str, float]]:
    return {part: {k: after[part][k] - before[part][k] for k in after[part]} for part in after}


def tenant_keys(n: int) -> list[str]:
    given = os.environ.get("QUILT_API_KEYS")
    if given:
        keys = [k.strip() for k in given.split(",") if k.strip()]
        if len(keys) < n:
            raise SystemExit(f"QUILT_API_KEYS holds {len(keys)} keys; {n} tenants need {n}")
        return keys[:n]
    stamp = int(time.time())
    return [subprocess.run(["quilt", "tenants", "create", f"rl-tenant-{i}-{stamp}"], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1] for i in range(n)]


async def run_tenant(index: int, key: str, base_url: str, args: argparse.Namespace) -> list[rl.StepLog]:
    with quilt.Client(api_key=key, base_url=base_url) as client:
        tc = await client.create_training_client_async(BASE_MODEL, rank=args.rank, seed=args.seed + index)
        task = BandTask(variant=index)

        def show(entry: rl.StepLog) -> None:
            print(f"tenant {index}: {entry.line()}", flush=True)

        return await rl.run_grpo(tc, group_builder(task, args.seed + index, args.answer_tokens), rl_config(args),
                                 args.steps, on_step=show)


async def run_all(keys: list[str], base_url: str, args: argparse.Namespace) -> list[list[rl.StepLog]]:
    return list(await asyncio.gather(*(run_tenant(i, key, base_url, args) for i, key in enumerate(keys))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, steps=20)
    parser.add_argument("--tenants", type=int, default=4)
    parser.set_defaults(groups=6)
    args = parser.parse_args()
    base_url = os.environ.get("QUILT_BASE_URL", "http://127.0.0.1:8000").rstrip("/")

    keys = tenant_keys(args.tenants)
    before = server_counters(base_url, keys[0])
    started = time.monotonic()
    logs = asyncio.run(run_all(keys, base_url, args))
    seconds = time.monotonic() - started
    used = delta(server_counters(base_url, keys[0]), before)

    trainer, gen = used["trainer"], used["gen"]
    tenants_per_round = trainer["tenants_fused"] / trainer["fused_rounds"] if trainer["fused_rounds"] else 0.0
    mixed = gen["mixed_s"] / gen["active_s"] if gen["active_s"] else 0.0
    utilisation = gen["slot_s"] / gen["capacity_s"] if gen["capacity_s"] else 0.0
    summaries = [rl.summarize(tenant_logs) for tenant_logs in logs]

    print()
    print(f"{'tenant':<8}{'reward first':>14}{'reward last':>13}{'steps':>7}")
    for i, s in enumerate(summaries):
        print(f"{i:<8}{s['reward_first']:>14.3f}{s['reward_last']:>13.3f}{len(logs[i]):>7d}")
    print()
    print(f"trainer: {trainer['fused_rounds']:.0f} fused rounds, {tenants_per_round:.2f} tenants and "
          f"{trainer['models_fused'] / max(trainer['fused_rounds'], 1):.2f} models per round on average")
    print(f"generation pool: {gen['groups']:.0f} groups, {gen['tokens']:.0f} tokens; two or more tenants sharing "
          f"the engine {100 * mixed:.0f}% of its busy time; slot utilisation {utilisation:.2f} "
          f"(of the concurrency target; four small RL loops cannot fill it)")
    print(f"{seconds:.0f} s in all")
    print(json.dumps({
        "tenants": [{"reward_first": round(s["reward_first"], 4), "reward_last": round(s["reward_last"], 4)}
                    for s in summaries],
        "mean_tenants_per_fused_round": round(tenants_per_round, 3),
        "mixed_tenant_engine_fraction": round(mixed, 3),
        "slot_utilisation": round(utilisation, 3),
        "seconds": round(seconds, 1),
    }))


if __name__ == "__main__":
    main()
