"""quilt.rl against the real stack (trainer, vLLM generation pool, Postgres, Redis).

On-policy (max_staleness=0) the sampler and the trainer hold the same weights, so the trainer's
mismatch KL against the pool's logprobs is ~0 and every datum has staleness 0; with max_staleness=1
sampling overlaps training and no datum is ever more than one version old. Environment failures are
counted and never reach the trainer. The RL example learns (reward up by 0.3 or more).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import quilt
from quilt import rl

ROOT = Path(__file__).resolve().parents[1]
TINY = "quilt/tiny-qwen3"


class InBand(rl.Env):
    """Reward: fraction of sampled tokens in [256, 512); `fail` makes the grader crash."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def reset(self):
        return [11, 87, 140, 201]

    async def step(self, tokens):
        if self.fail:
            raise ConnectionError("grader unreachable")
        return rl.StepResult(reward=sum(256 <= t < 512 for t in tokens) / 6)


def run(stack, tenant, config: rl.RLConfig, steps: int, make_group=None):
    make_group = make_group or (lambda i, n: [InBand() for _ in range(n)])

    async def go():
        with stack.sdk(tenant.key) as client:
            tc = await client.create_training_client_async(TINY, rank=8, seed=1)
            logs = await rl.run_grpo(tc, make_group, config, steps)
            return tc, logs
    return asyncio.run(go())


def config(**kw) -> rl.RLConfig:
    base = dict(group_size=4, groups_per_batch=2, sampling=quilt.SamplingParams(max_tokens=6, stop=[]),
                adam=quilt.AdamParams(learning_rate=1e-2))
    return rl.RLConfig(**{**base, **kw})


def test_on_policy_rl_has_no_staleness_and_no_mismatch(stack, tenant):
    _, logs = run(stack, tenant, config(max_staleness=0), steps=3)
    assert [entry.step for entry in logs] == [0, 1, 2]
    trained = [entry for entry in logs if entry.trained]
    assert trained, "every step had zero advantage: the test's task gives no signal"
    for entry in trained:
        assert entry.staleness_max == 0 and entry.staleness_mean == 0
        assert entry.mismatch_kl is not None and entry.mismatch_kl < 1e-3, entry
        assert 0.0 <= entry.reward_mean <= 1.0
    versions = [entry.policy_version for entry in logs]
    assert versions == sorted(versions) and versions[-1] >= len(trained) - 1


def test_async_rl_overlaps_within_the_bound(stack, tenant):
    _, logs = run(stack, tenant, config(max_staleness=1), steps=4)
    lags = [entry.staleness_max for entry in logs if entry.trained]
    assert lags and max(lags) <= 1
    assert any(lag == 1 for lag in lags), "sampling never ran ahead of training"


def test_environment_failures_are_counted_and_not_trained(stack, tenant):
    # every other group's grader crashes: those groups are counted as infra failures, never trained
    def make_group(index, n):
        return [InBand(fail=index % 2 == 1) for _ in range(n)]

    _, logs = run(stack, tenant, config(max_staleness=0, groups_per_batch=2), steps=2, make_group=make_group)
    for entry in logs:
        assert entry.infra_failure_rate == pytest.approx(0.5)
        assert entry.outcomes["infra_failure"] == 4
        assert entry.datums <= 4  # only the healthy group's episodes can become datums


class SlowTool(rl.Env):
    """Two turns, each scored by a 'tool' that takes 50 ms."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self):
        return [11, 87, 140]

    async def step(self, tokens):
        self.turns += 1
        await asyncio.sleep(0.05)
        done = self.turns == 2
        return rl.StepResult(reward=sum(256 <= t < 512 for t in tokens) / 6, done=done,
                             next_prompt=None if done else [11, 87, 140, *tokens], episode_hint=None if done else "promote")


def test_time_waiting_on_environments_reaches_the_run_and_operator_pages(stack):
    from dashutil import login, operator_key

    tenant = stack.create_tenant("rl-envwait")
    tc, logs = run(stack, tenant, config(max_staleness=0, budget=rl.EpisodeBudget(max_turns=2), episode_priority=True),
                   steps=2,
                   make_group=lambda i, n: [SlowTool() for _ in range(n)])
    for entry in logs:
        assert entry.env_s >= 2 * 0.05 * entry.groups  # two tool calls per group, 50 ms each
        assert entry.env_step_s >= 2 * 0.05 * entry.groups and entry.env_start_s >= 0 and entry.reward_s == 0
        assert entry.env_s == pytest.approx(entry.env_start_s + entry.env_step_s + entry.reward_s)
        assert entry.sample_s > 0 and 0 < entry.env_wait_share < 1
        assert 0 < entry.trainer_env_wait_share < entry.env_wait_share
        assert entry.env_wait_gpu_s == pytest.approx(entry.time_to_batch_s * entry.env_wait_share)
    owner = stack.http(tenant.key)
    rows = owner.get(f"/quilt/models/{tc.model_id}/metrics").json()["metrics"]
    shares = [r["metrics"]["env_wait_share"] for r in rows if "env_wait_share" in r["metrics"]]
    assert len(shares) == 2 and all(0 < s < 1 for s in shares)
    steps = [r["metrics"] for r in rows if "env_step_s" in r["metrics"]]  # the run page's seconds plot
    assert len(steps) == 2 and all(m["env_step_s"] > 0 and m["train_s"] > 0 and "env_wait_gpu_s" in m for m in steps)
    operator = login(stack, operator_key(stack))
    ops = operator.get("/dashboard/data/ops", params={"minutes": 5}).json()
    waits = ops["env_waits"]
    i = waits["tenants"].index(tenant.name)
    assert waits["steps"][i] == 2 and 0 < waits["rollout"][i] < 1 and 0 < waits["trainer"][i] < 1
    assert waits["step_s"][i] == pytest.approx(sum(e.env_step_s for e in logs), abs=0.01)
    assert waits["train_s"][i] > 0 and waits["sample_s"][i] > 0 and waits["lost_s"][i] > 0
    # Every call carried its group's episode id: the pool tracks them (the beacon is 2 s behind).
    deadline = time.monotonic() + 10
    while (ops["bases"][0]["gen"].get("episodes_tracked") or 0) < 2 * 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        ops = operator.get("/dashboard/data/ops", params={"minutes": 5}).json()
    assert ops["bases"][0]["gen"]["episodes_tracked"] >= 2 * 2


class SlowStart(InBand):
    """Starts in 0.3 s (a sandbox booting) and forks in no time; module level, so process workers
    import it by name."""

    async def reset(self):
        await asyncio.sleep(0.3)
        return await super().reset()

    async def snapshot(self):
        return None

    async def fork(self, snapshot):
        return SlowStart()


def slow_start_group(index, n):
    return [SlowStart() for _ in range(n)]


def test_environments_on_process_workers_with_a_warm_pool_and_forks_train(stack):
    tenant = stack.create_tenant("rl-workers")
    pool = rl.ProcessPool(workers=2)
    try:
        _, logs = run(stack, tenant, config(max_staleness=0, executor=pool, warm_groups="auto"), steps=3,
                      make_group=slow_start_group)
    finally:
        asyncio.run(pool.aclose())
    assert all(entry.outcomes.get("infra_failure", 0) == 0 and entry.datums > 0 or entry.zero_advantage_fraction == 1
               for entry in logs)
    assert [entry.cold_starts for entry in logs] == [2, 2, 2] and [entry.forks for entry in logs] == [6, 6, 6]
    # The pool starts the next batch's groups while this one trains: after the first, they are ready.
    assert sum(entry.warm_groups for entry in logs[1:]) >= 2
    assert logs[-1].env_start_s < logs[0].env_start_s


def _letters_env():
    """A verifiers environment: any prompt, scored by its rubric on the share of the reply's letters
    that are "e" (the random tiny model's replies vary in it, so groups have advantages)."""
    import verifiers as vf
    from datasets import Dataset

    def share_of_e(completion, **kwargs) -> float:
        text = completion[-1]["content"] if completion else ""
        return text.count("e") / len(text) if text else 0.0

    rows = [{"question": q, "answer": ""} for q in ("Write a line.", "Say something.", "Reply.", "Speak.")]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[share_of_e], weights=[1.0]))


def test_a_verifiers_environment_trains_through_the_stack(stack):
    """The adapter's tokens are the base's own (its tokenizer, made on the worker), sampled by the pool
    and trained on by the trainer; the rubric's reward reaches the step log."""
    from quilt.rl import adapters

    from bases.catalog import get_model_sync
    from core import db

    with db.connect(stack.database_url) as conn:
        path = get_model_sync(conn, TINY).path

    def codec():
        from transformers import AutoTokenizer

        return adapters.ChatCodec(AutoTokenizer.from_pretrained(path))

    tenant = stack.create_tenant("rl-verifiers")
    pool = rl.ProcessPool(workers=1)
    try:
        _, logs = run(stack, tenant, config(max_staleness=0, sampling=quilt.SamplingParams(max_tokens=12),
                                            executor=pool), steps=2,
                      make_group=adapters.verifiers_group_builder(_letters_env, codec))
    finally:
        asyncio.run(pool.aclose())
    for entry in logs:
        assert entry.outcomes.get("infra_failure", 0) == 0 and entry.episodes == 8
        assert 0 < entry.reward_mean < 1 and "share_of_e" in entry.env_metrics
    assert sum(entry.datums for entry in logs) > 0


@pytest.mark.timeout(900)
def test_rl_example_reward_rises(stack):
    tenant = stack.create_tenant("rl-example")
    env = {**os.environ, "QUILT_API_KEY": tenant.key, "QUILT_BASE_URL": stack.base_url}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_tiny.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["reward_last"] - summary["reward_first"] >= 0.3, proc.stdout[-3000:]


@pytest.mark.timeout(900)
def test_multitenant_example_fuses_tenants_and_shares_the_pool(stack):
    keys = ",".join(stack.create_tenant(f"rl-mt{i}").key for i in range(4))
    env = {**os.environ, "QUILT_API_KEYS": keys, "QUILT_BASE_URL": stack.base_url}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_multitenant.py"), "--steps", "3",
                           "--groups", "2", "--group-size", "4"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(summary["tenants"]) == 4
    # the server's own counters: passes held several tenants, the engine ran several tenants at once
    assert summary["mean_tenants_per_fused_round"] > 1.2, proc.stdout[-3000:]
    assert summary["mixed_tenant_engine_fraction"] > 0.2, proc.stdout[-3000:]
