"""bench/env_batch.py's sampler of fixed speed (the stand-in for a GPU pool) is what quilt.rl calls a
SamplingClient: a group of its Sandbox environments rolls out against it to the end, every
episode with the tokens, logprobs and policy version the trainer reads, and the timeline of
--trace records each call."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import quilt
from quilt import rl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import env_batch  # noqa: E402


def test_a_group_rolls_out_against_the_fixed_speed_sampler_through_the_timeline():
    timeline = env_batch.Timeline()
    sampler = timeline.wrap(env_batch.FixedSpeedSampler(3, first_s=0.001, per_token_s=0.001, seed=7))
    assert sampler.policy_version == 3
    saved = env_batch.Sandbox.start_s
    env_batch.Sandbox.start_s = 0.0  # no boot: the rollout is what is checked
    try:
        envs = env_batch.sandbox_group(turns=2, fork=True)(5, 4)
        group = asyncio.run(rl.rollout_group(5, sampler, envs, quilt.SamplingParams(max_tokens=3, temperature=1.0),
                                             rl.EpisodeBudget(max_turns=2)))
    finally:
        env_batch.Sandbox.start_s = saved
    assert [(e.outcome, e.cause) for e in group.episodes] == [("success", None)] * 4
    for episode in group.episodes:
        assert len(episode.turns) == 2
        for turn in episode.turns:
            assert len(turn.tokens) == 3 and all(0 <= t < 512 for t in turn.tokens)
            assert len(turn.logprobs) == 3 and turn.policy_version == 3
    assert group.policy_version == 3
    # one call for the shared first prompt, then one per episode (their second prompts differ)
    assert len(timeline.calls) == 5 and all(answered >= sent for sent, answered in timeline.calls)
