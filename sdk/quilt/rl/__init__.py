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
"""

from .env import OUTCOMES, Env, GroupBuilder, Outcome, Prompt, StepResult
from .grpo import Episode, GroupPlan, Turn, episode_datums, group_advantages, plan_group
from .pipeline import (
    RLConfig,
    StepLog,
    may_start_group,
    run_grpo,
    summarize,
    train_grpo,
)
from .rollouts import EpisodeBudget, SampledGroup, rollout_group

__all__ = [
    "OUTCOMES",
    "Env",
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
