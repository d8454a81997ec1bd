"""Reinforcement learning on Quilt: environments, GRPO groups and an asynchronous training loop.

A task is an :class:`Env` (async ``reset`` and ``step``); a group builder makes the ``n``
environments of one GRPO group; :func:`train_grpo` does the rest::

    import quilt
    from quilt import rl

    class Parity(rl.Env):
        async def reset(self):
            return prompt_tokens
        async def step(self, tokens):
            return rl.StepResult(reward=score(tokens))

    with quilt.Client() as client:
        tc = client.create_training_client("quilt/tiny-qwen3", rank=16)
        config = rl.RLConfig(group_size=8, groups_per_batch=8, max_staleness=1,
                             sampling=quilt.SamplingParams(max_tokens=8),
                             adam=quilt.AdamParams(learning_rate=3e-3))
        for entry in rl.train_grpo(tc, lambda i, n: [Parity() for _ in range(n)], config, steps=20):
            print(entry.line())

Groups are sampled with ``sample(n)`` (one generation-pool group each), advantages are
group-relative, zero-advantage groups and infrastructure failures are filtered and counted, and
sampling runs at most ``max_staleness`` policy versions ahead of training.

At scale: environments run in process, in a process pool or on Ray actors (``executor``), start
warm from a pool and by fork (``warm_groups``, :class:`Forkable`), are bounded per call and per
episode (:class:`EpisodeBudget`), may be scored by a remote reward function (``reward``), and
environments written for verifiers, OpenEnv, SkyRL-Gym, Gymnasium or tinker-cookbook run through
:mod:`quilt.rl.adapters` unchanged.
"""

from .bounds import CAUSES, EpisodeBudget, breach_outcome
from .env import (
    OUTCOMES,
    Env,
    Forkable,
    GroupBuilder,
    Observation,
    Outcome,
    Prompt,
    StepResult,
    can_fork,
    prompt_ids,
    prompt_stop,
)
from .executors import InProcess, ProcessPool, RayActors, make_executor
from .grpo import Episode, GroupPlan, Turn, episode_datums, group_advantages, plan_group
from .pipeline import (
    RLConfig,
    StepLog,
    may_start_group,
    run_grpo,
    summarize,
    train_grpo,
)
from .rewards import HTTPReward, LocalReward, RayReward, RewardFn, RewardItem
from .rollouts import SampledGroup, rollout_group
from .starts import StartedGroup, WarmPool, pool_target, start_group

__all__ = [
    "CAUSES",
    "OUTCOMES",
    "Env",
    "Forkable",
    "HTTPReward",
    "Observation",
    "InProcess",
    "LocalReward",
    "ProcessPool",
    "RayActors",
    "RayReward",
    "RewardFn",
    "RewardItem",
    "StartedGroup",
    "WarmPool",
    "breach_outcome",
    "can_fork",
    "make_executor",
    "pool_target",
    "prompt_ids",
    "prompt_stop",
    "start_group",
    "EpisodeBudget",
    "Episode",
    "GroupBuilder",
    "GroupPlan",
    "Outcome",
    "Prompt",
    "RLConfig",
    "SampledGroup",
    "StepLog",
    "StepResult",
    "Turn",
    "episode_datums",
    "group_advantages",
    "may_start_group",
    "plan_group",
    "rollout_group",
    "run_grpo",
    "summarize",
    "train_grpo",
]
