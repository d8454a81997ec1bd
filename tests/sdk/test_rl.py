"""quilt.rl without a server: advantages, group filtering, outcome handling, datums, the staleness
rule, and the pipeline's bound under out-of-order group completion.

The pipeline tests drive `run_grpo` with an in-process trainer/sampler pair that keeps a policy
version like the real server does (every optimizer step +1, every published sampler tagged with
it) and finishes sample requests after random delays, so groups complete out of order as long-tail
rollouts do. The same pipeline runs against the real stack in tests/test_rl_stack.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import quilt
from quilt import rl
from quilt.rl.grpo import Episode, Turn
from rlfakes import FakeSampler, FakeTrainer


def ep(reward: float, outcome: str = "success", version: int | None = 3) -> Episode:
    return Episode(turns=[Turn(prompt=[1, 2, 3], tokens=[7, 8], logprobs=[-0.5, -1.5], policy_version=version)],
                   reward=reward, outcome=outcome)


# -- advantages and filtering -------------------------------------------------------------


def test_group_advantages_are_centred_and_optionally_normalised():
    assert rl.group_advantages([1.0, 0.0, 0.5, 0.5]) == [0.5, -0.5, 0.0, 0.0]
    normed = rl.group_advantages([1.0, 0.0], normalize=True)
    assert normed[0] == pytest.approx(1.0, abs=1e-5) and normed[1] == pytest.approx(-1.0, abs=1e-5)
    assert rl.group_advantages([]) == []


def test_zero_advantage_group_is_filtered():
    plan = rl.plan_group([ep(1.0), ep(1.0), ep(1.0)])
    assert plan.status == "zero_advantage" and plan.advantages == [0.0, 0.0, 0.0]
    assert rl.plan_group([ep(0.0), ep(0.0)]).status == "zero_advantage"


def test_infra_failures_are_excluded_before_the_mean():
    plan = rl.plan_group([ep(1.0), ep(0.0), ep(0.0, "infra_failure"), ep(0.5, "unknown")])
    assert plan.status == "train"
    assert plan.trainable == [True, True, False, True]
    # mean over the three trainable episodes is 0.5; the infra one gets no advantage
    assert plan.advantages == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_group_with_fewer_than_two_trainable_episodes_is_dropped():
    plan = rl.plan_group([ep(1.0), ep(0.0, "infra_failure"), ep(0.3, "infra_failure")])
    assert plan.status == "too_few"
    # model failures are trained on: a wrong answer is a real, low reward
    assert rl.plan_group([ep(1.0), ep(0.0, "model_failure")]).status == "train"


def test_episode_datums_carry_logprobs_advantages_and_version():
    (datum,) = rl.episode_datums(ep(1.0, version=4), 0.25)
    assert datum.model_input.to_ints() == [1, 2, 3, 7]
    inputs = {k: v.data for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [2, 3, 7, 8]
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -1.5]
    assert inputs["advantages"] == [0.0, 0.0, 0.25, 0.25]
    assert inputs["weights"] == [0.0, 0.0, 1.0, 1.0]
    assert datum.policy_version == 4 and datum.to_json()["policy_version"] == 4


def test_step_result_validates():
    with pytest.raises(ValueError, match="outcome"):
        rl.StepResult(reward=1.0, outcome="great")
    with pytest.raises(ValueError, match="finite"):
        rl.StepResult(reward=float("nan"))
    with pytest.raises(ValueError, match="next_prompt"):
        rl.StepResult(reward=0.0, done=False)


# -- the staleness rule -------------------------------------------------------------------


def gate(**kw):
    base = dict(consuming_step=5, queued=0, groups_per_batch=4, sampler_version=5, max_staleness=0,
                in_flight=0, concurrency=100, groups_needed=100)
    return rl.may_start_group(**{**base, **kw})


def test_on_policy_gate_fills_one_batch_then_waits_for_new_weights():
    assert gate(queued=3)
    assert not gate(queued=4)  # a fifth group would feed step 6 with version-5 weights
    assert not gate(consuming_step=6)  # batch taken, new weights not published yet


def test_staleness_one_allows_one_batch_ahead():
    assert gate(max_staleness=1, queued=7)
    assert not gate(max_staleness=1, queued=8)
    assert gate(max_staleness=1, consuming_step=6, queued=3)
    assert not gate(max_staleness=1, consuming_step=6, queued=4)


def test_gate_respects_concurrency_and_remaining_need():
    assert not gate(max_staleness=3, in_flight=4, concurrency=4)
    assert not gate(max_staleness=3, queued=8, groups_needed=8)


# -- outcome handling in rollouts ---------------------------------------------------------


class ScoreEnv(rl.Env):
    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour

    async def reset(self):
        return [1, 2]

    async def step(self, tokens):
        if self.behaviour == "raise":
            raise RuntimeError("grader crashed")
        if self.behaviour == "hang":
            await asyncio.sleep(10)
        if self.behaviour == "infra":
            return rl.StepResult(reward=0.0, outcome="infra_failure")
        return rl.StepResult(reward=sum(tokens) / 27, metrics={"total": float(sum(tokens))})


def test_rollout_maps_env_failures_to_infra_and_samples_the_group_once():
    sampler = FakeSampler(2, random.Random(0))
    envs = [ScoreEnv(), ScoreEnv("raise"), ScoreEnv("hang"), ScoreEnv("infra"), ScoreEnv()]
    group = asyncio.run(rl.rollout_group(0, sampler, envs, quilt.SamplingParams(max_tokens=3),
                                         rl.EpisodeBudget(step_timeout_s=0.2)))
    assert sampler.requests == 1  # one sample(n) for the shared prompt
    outcomes = [e.outcome for e in group.episodes]
    assert outcomes == ["success", "infra_failure", "infra_failure", "infra_failure", "success"]
    assert "grader crashed" in group.episodes[1].error and "timed out" in group.episodes[2].error
    assert group.policy_version == 2


def test_a_sampling_deadline_is_infra_and_other_user_errors_are_raised():
    passed = quilt.UserRequestError("request r passed its deadline after 5.0 s", "r", "user", "deadline_s")
    sampler = FakeSampler(0, random.Random(0), answer=passed)
    group = asyncio.run(rl.rollout_group(0, sampler, [ScoreEnv()] * 2, quilt.SamplingParams(max_tokens=3),
                                         rl.EpisodeBudget(sample_deadline_s=5.0)))
    assert [e.outcome for e in group.episodes] == ["infra_failure"] * 2
    assert "deadline" in group.episodes[0].error and sampler.deadlines == [5.0]
    bad = quilt.UserRequestError("top_p must be in (0, 1]", "r", "user", "sampling_params.top_p")
    with pytest.raises(quilt.UserRequestError, match="top_p"):
        asyncio.run(rl.rollout_group(0, FakeSampler(0, random.Random(0), answer=bad), [ScoreEnv()] * 2,
                                     quilt.SamplingParams(max_tokens=3)))
    with pytest.raises(ValueError, match="sample_deadline_s"):
        rl.EpisodeBudget(sample_deadline_s=0)


def test_sampling_failure_is_infra_and_budget_ends_multi_turn_episodes():
    group = asyncio.run(rl.rollout_group(0, FakeSampler(0, random.Random(0), fail=True), [ScoreEnv()] * 2,
                                         quilt.SamplingParams(max_tokens=3)))
    assert [e.outcome for e in group.episodes] == ["infra_failure"] * 2

    class Chatty(rl.Env):
        async def reset(self):
            return [5]

        async def step(self, tokens):
            return rl.StepResult(reward=0.1, done=False, next_prompt=[5, *tokens])

    group = asyncio.run(rl.rollout_group(0, FakeSampler(0, random.Random(1)), [Chatty(), Chatty()],
                                         quilt.SamplingParams(max_tokens=3), rl.EpisodeBudget(max_turns=3)))
    for episode in group.episodes:
        assert episode.outcome == "model_failure" and len(episode.turns) == 3
        assert episode.reward == pytest.approx(0.3)
        assert "3 turns" in episode.error


def test_every_call_of_a_group_carries_its_episode_id_and_the_env_hints():
    class Hinting(rl.Env):
        def __init__(self):
            self.turn = 0

        async def reset(self):
            return [5]

        async def step(self, tokens):
            self.turn += 1
            await asyncio.sleep(0.02)  # the environment's own time, counted as env_s
            hint = ("demote", "promote", None)[self.turn - 1]
            return rl.StepResult(reward=0.0, done=self.turn == 3, next_prompt=[5, self.turn], episode_hint=hint)

    sampler = FakeSampler(0, random.Random(1))
    first = asyncio.run(rl.rollout_group(0, sampler, [Hinting(), Hinting()], quilt.SamplingParams(max_tokens=3),
                                         rl.EpisodeBudget(max_turns=3), episode_priority=True))
    ids = {episode for episode, _ in sampler.episodes}
    assert len(ids) == 1 and None not in ids  # one id for the group's every call
    # Both members share each prompt, so each turn is one call; a hint applies to the next call only.
    assert [hint for _, hint in sampler.episodes] == [None, "demote", "promote"]
    assert first.env_s >= 3 * 0.02 and first.sample_s > 0
    assert first.env_s + first.sample_s <= first.finished_at - first.started_at + 1e-6
    other = FakeSampler(0, random.Random(1))
    asyncio.run(rl.rollout_group(1, other, [Hinting(), Hinting()], quilt.SamplingParams(max_tokens=3),
                                 rl.EpisodeBudget(max_turns=3), episode_priority=True))
    assert {e for e, _ in other.episodes}.isdisjoint(ids)  # another group, another episode
    plain = FakeSampler(0, random.Random(1))
    asyncio.run(rl.rollout_group(2, plain, [Hinting(), Hinting()], quilt.SamplingParams(max_tokens=3),
                                 rl.EpisodeBudget(max_turns=3)))
    assert set(plain.episodes) == {(None, None)}  # off by default: no id, no hints

    class OldSampler(FakeSampler):  # a duck-typed sampler from before episodes
        async def sample_async(self, prompt, n, params, deadline_s=None):
            return await super().sample_async(prompt, n, params, deadline_s)

    group = asyncio.run(rl.rollout_group(3, OldSampler(0, random.Random(1)), [Hinting(), Hinting()],
                                         quilt.SamplingParams(max_tokens=3), rl.EpisodeBudget(max_turns=3)))
    assert len(group.episodes) == 2
    with pytest.raises(ValueError, match="episode_hint"):
        rl.StepResult(reward=0.0, done=False, next_prompt=[1], episode_hint="sideways")


# -- the pipeline -------------------------------------------------------------------------


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_pipeline_never_trains_past_the_staleness_bound(max_staleness):
    trainer = FakeTrainer(random.Random(max_staleness))
    config = rl.RLConfig(group_size=4, groups_per_batch=3, max_staleness=max_staleness, log_to_server=False)
    logs = asyncio.run(rl.run_grpo(trainer, lambda i, n: [ScoreEnv() for _ in range(n)], config, steps=12))
    assert len(logs) == 12
    lags = [version - v for version, versions in trainer.trained for v in versions]
    assert lags and max(lags) <= max_staleness
    assert all(entry.staleness_max <= max_staleness for entry in logs)
    if max_staleness > 0:
        assert max(lags) >= 1, "the pipeline never overlapped sampling with training"
    if max_staleness == 0:  # synchronous: nothing can age, so nothing is dropped
        assert sum(entry.dropped_stale for entry in logs) == 0


def test_pipeline_counts_zero_advantage_and_infra_groups():
    trainer = FakeTrainer(random.Random(7))

    class Constant(rl.Env):
        async def reset(self):
            return [1]

        async def step(self, tokens):
            return rl.StepResult(reward=1.0)

    def make_group(index, n):
        kind = index % 3
        if kind == 0:
            return [Constant() for _ in range(n)]  # zero advantage
        if kind == 1:
            return [ScoreEnv("infra") for _ in range(n)]  # all infra: too few to compare
        return [ScoreEnv() for _ in range(n)]

    config = rl.RLConfig(group_size=4, groups_per_batch=3, max_staleness=0, log_to_server=False)
    logs = asyncio.run(rl.run_grpo(trainer, make_group, config, steps=4))
    for entry in logs:
        assert entry.groups == 3
        assert entry.zero_advantage_fraction == pytest.approx(1 / 3)
        assert entry.infra_failure_rate == pytest.approx(1 / 3)
        assert entry.outcomes["infra_failure"] == 4
        assert entry.groups_trained == 1 and entry.datums == 4  # infra episodes never become datums


def test_pipeline_raises_a_failing_group_builder():
    trainer = FakeTrainer(random.Random(0))

    def make_group(index, n):
        raise KeyError("no such task")

    with pytest.raises(KeyError, match="no such task"):
        asyncio.run(rl.run_grpo(trainer, make_group, rl.RLConfig(group_size=2, groups_per_batch=1,
                                                                 log_to_server=False), steps=2))
