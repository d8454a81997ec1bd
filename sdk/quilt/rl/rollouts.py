"""Running a GRPO group's episodes against a sampler: one ``sample(n)`` per shared prompt.

A group's ``n`` environments start from the same prompt, so their first turn is one request for
``n`` samples: the generation pool treats it as one group and completes it when its slowest member
finishes. Later turns of multi-turn tasks diverge; episodes that happen to share a prompt are still
sampled together.

Every call is bounded (:mod:`quilt.rl.bounds` has the table of breaches, their outcomes and which
are retried): an environment that raises or times out ends its episode as an ``infra_failure``
(kept out of training, counted by cause); sampling that fails on the server's side is tried again,
then does the same for the episodes it was sampling. A user error from the server (bad sampling
parameters, say) is raised: it would fail every episode the same way. The turn, token and wall-time
budgets end an episode that will not finish. With a reward function, the group's finished episodes
are scored together at the end (:mod:`quilt.rl.rewards`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    APIConnectionError,
    InternalServerError,
    ServerRequestError,
    UserRequestError,
)
from ..sampling import SamplingClient, SamplingParams
from .bounds import EpisodeBudget, bounded_call, breach_outcome
from .env import Env, StepResult, prompt_ids, prompt_stop
from .grpo import Episode, Turn
from .rewards import RewardFn, RewardItem, parse_scores
from .starts import StartedGroup, release_group, start_envs

__all__ = ["EpisodeBudget", "SampledGroup", "rollout_group"]

log = logging.getLogger("quilt.rl")

# Errors that say the platform, not the model or the caller, failed.
_INFRA_ERRORS = (ServerRequestError, APIConnectionError, InternalServerError)

_KINDS = ("start", "step", "reward", "sample")


@dataclass
class SampledGroup:
    """A finished group: its episodes, the sampler's policy version, and when it ran.

    Where its time went, as wall time the group waited on each kind of call (the slowest member's
    each time): ``start_s`` on its environments' start (only what was left when a warm pool had
    begun it), ``step_s`` on their steps, ``reward_s`` on the reward function, ``sample_s`` on the
    pool. ``env_s`` is the first three together. ``cold``/``forks``/``warm`` say how it started;
    ``retries`` counts calls tried again per cause.
    """

    index: int
    episodes: list[Episode]
    policy_version: int | None
    started_at: float
    finished_at: float
    env_s: float = 0.0
    sample_s: float = 0.0
    start_s: float = 0.0
    step_s: float = 0.0
    reward_s: float = 0.0
    cold: int = 0
    forks: int = 0
    warm: bool = False
    retries: Counter = field(default_factory=Counter)


@dataclass
class _Live:
    env: Env | None
    prompt: list[int] | None = None
    first_prompt: list[int] | None = None
    stop: str | tuple | None = None  # this turn's stop condition, when the environment gave one
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    finished: Episode | None = None
    outcome: str | None = None  # how its last step said it ended (before scoring)
    hint: str | None = None  # the environment's word on its next turn (StepResult.episode_hint)

    def end(self, outcome: str, error: str | None = None, cause: str | None = None) -> None:
        self.finished = Episode(turns=self.turns, reward=self.reward, outcome=outcome, error=error,
                                metrics=self.metrics, cause=cause)


async def rollout_group(index: int, sampler: SamplingClient, envs: Sequence[Env] | StartedGroup, params: SamplingParams,
                        budget: EpisodeBudget = EpisodeBudget(),  # noqa: B008 (frozen)
                        *, episode_priority: bool = False, reward: RewardFn | None = None) -> SampledGroup:
    """Run one group's episodes to the end with ``sampler``; never raises for an episode's failure.

    ``envs`` are the group's environments (reset here, cold), or a group an executor or a warm
    pool has started (:mod:`quilt.rl.starts`); its environments are released at the end either way.
    With ``reward``, the finished episodes are scored together at the end. With
    ``episode_priority`` every sampling call of the group carries one episode id (and the
    environments' hints), so the pool serves groups that have consumed less first
    (gen_pool.episodes) without predicting lengths.
    """
    started = time.monotonic()
    clock = _Clock()
    group = envs if isinstance(envs, StartedGroup) else await start_envs(envs, budget, index)
    clock.seconds["start"] = group.start_s
    retries: Counter = Counter(group.retries)
    episode_id = f"rl-{uuid.uuid4().hex[:20]}/{index}" if episode_priority else None
    live = []
    for member in group.members:
        episode = _Live(member.env, member.prompt, member.prompt, member.stop)
        if member.env is None or member.prompt is None:
            episode.end("infra_failure", member.error, member.cause)
        live.append(episode)
    versions: list[int] = []
    deadline = None if budget.max_episode_s is None else time.monotonic() + budget.max_episode_s
    try:
        while True:
            active = [e for e in live if e.finished is None]
            if not active:
                break
            # Episodes reading the same prompt (to the same stop) share one sample(n) request.
            by_prompt: dict[tuple, list[_Live]] = {}
            for e in active:
                by_prompt.setdefault((tuple(e.prompt or ()), e.stop), []).append(e)
            turns = asyncio.gather(*(_sample_turn(sampler, list(prompt), members, params, budget, versions, clock,
                                                  episode_id, retries) for (prompt, _), members in by_prompt.items()))
            if deadline is None:
                await turns
                continue
            try:
                await asyncio.wait_for(turns, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                for e in live:
                    if e.finished is None:
                        e.end(breach_outcome("wall_time", budget),
                              f"episode passed its wall-time budget of {budget.max_episode_s:g}s", "wall_time")
        if reward is not None:
            await _score(reward, live, budget, clock, retries)
    finally:
        await release_group(group)
    return SampledGroup(index=index, episodes=[e.finished for e in live if e.finished is not None],
                        policy_version=min(versions) if versions else sampler.policy_version,
                        started_at=started, finished_at=time.monotonic(),
                        env_s=clock.seconds["start"] + clock.seconds["step"] + clock.seconds["reward"],
                        sample_s=clock.seconds["sample"], start_s=clock.seconds["start"],
                        step_s=clock.seconds["step"], reward_s=clock.seconds["reward"],
                        cold=group.cold, forks=group.forks, warm=group.warm, retries=retries)


async def _score(reward: RewardFn, live: list[_Live], budget: EpisodeBudget, clock: _Clock, retries: Counter) -> None:
    """Score the group's finished, non-infra episodes in one call (retried); rewrite their end."""
    scored = [e for e in live if e.finished is not None and e.finished.outcome != "infra_failure" and e.turns]
    if not scored:
        return
    items = [RewardItem(prompt=list(e.first_prompt or ()), turns=[list(t.tokens) for t in e.turns],
                        env_reward=e.reward, info=dict(e.info)) for e in scored]
    error = cause = None
    with clock.timing("reward"):
        for attempt in range(budget.max_infra_retries + 1):
            raw, error, cause = await bounded_call(reward.score(items), budget.reward_timeout_s, "reward")
            if error is None:
                try:
                    scores = parse_scores(raw, len(items))
                    break
                except ValueError as exc:
                    error, cause = f"reward answered badly: {exc}", "reward_error"
            if attempt < budget.max_infra_retries:
                retries[cause] += 1
    if error is not None:
        log.warning("reward failed for %d episodes: %s", len(scored), error)
        for e in scored:
            e.end("infra_failure", error, cause)
        return
    for e, score in zip(scored, scores):
        e.reward += score.reward
        done = e.finished
        e.end(score.outcome or done.outcome, done.error, done.cause)


class _Clock:
    """Wall time a group spends waiting on each kind of call. Turns that diverged wait side by
    side; an interval counts once however many calls of its kind overlap, so each total is at most
    the group's wall time (kinds overlap only where diverged turns wait on different ones)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(_KINDS, 0.0)
        self._open = dict.fromkeys(_KINDS, 0)
        self._since = dict.fromkeys(_KINDS, 0.0)

    @contextlib.contextmanager
    def timing(self, kind: str):
        if self._open[kind] == 0:
            self._since[kind] = time.monotonic()
        self._open[kind] += 1
        try:
            yield
        finally:
            self._open[kind] -= 1
            if self._open[kind] == 0:
                self.seconds[kind] += time.monotonic() - self._since[kind]


async def _sample(sampler: SamplingClient, prompt: list[int], n: int, params: SamplingParams, budget: EpisodeBudget,
                  episode: dict):
    future = await sampler.sample_async(prompt, n, params, deadline_s=budget.sample_deadline_s, **episode)
    try:
        return await future
    except asyncio.CancelledError:
        # The run is over, stopped, or past the episode's wall time: free the pool's slots instead
        # of finishing rollouts nobody will train on.
        cancel = getattr(future, "cancel", None)
        if cancel is not None:
            try:
                cancel()
            except Exception as exc:  # the SDK may already be closing; the server times it out
                log.debug("could not cancel %s: %s", getattr(future, "request_id", "?"), exc)
        raise


async def _sample_turn(sampler: SamplingClient, prompt: list[int], members: list[_Live], params: SamplingParams,
                       budget: EpisodeBudget, versions: list[int], clock: _Clock, episode_id: str | None,
                       retries: Counter) -> None:
    turn_params = params
    if members[0].stop is not None:
        stop = members[0].stop
        turn_params = dataclasses.replace(params, stop=stop if isinstance(stop, str) else list(stop))
    if budget.max_episode_tokens is not None:
        left = min(budget.max_episode_tokens - sum(len(t.tokens) for t in m.turns) for m in members)
        if left < 1:
            for m in members:
                m.end("model_failure", f"episode token budget {budget.max_episode_tokens} spent", "max_tokens")
            return
        if params.max_tokens is None or params.max_tokens > left:
            turn_params = dataclasses.replace(turn_params, max_tokens=left)
    hints = {m.hint for m in members} - {None}
    hint = None if episode_id is None else "promote" if "promote" in hints else "demote" if hints else None
    for m in members:
        m.hint = None
    # Only with an episode: a sampler that duck-types the SDK's needs no episode arguments.
    episode = {} if episode_id is None else {"episode_id": episode_id, "episode_hint": hint}
    for attempt in range(budget.max_infra_retries + 1):
        try:
            with clock.timing("sample"):
                response = await _sample(sampler, prompt, len(members), turn_params, budget, episode)
            break
        except _INFRA_ERRORS as exc:
            if attempt < budget.max_infra_retries:
                log.info("sampling failed for %d episodes (%s); trying again", len(members), exc)
                retries["sample_error"] += 1
                continue
            log.warning("sampling failed for %d episodes: %s", len(members), exc)
            for m in members:
                m.end("infra_failure", f"sampling failed: {exc}", "sample_error")
            return
        except UserRequestError as exc:
            if exc.field != "deadline_s":
                raise
            log.warning("sampling passed its deadline for %d episodes: %s", len(members), exc)
            for m in members:
                m.end("infra_failure", f"sampling passed its deadline: {exc.message}", "sample_deadline")
            return
    if len(response.sequences) != len(members):
        for m in members:
            m.end("infra_failure", f"asked for {len(members)} samples, got {len(response.sequences)}", "sample_error")
        return
    turns = []
    for m, seq in zip(members, response.sequences):
        turn = Turn(prompt=prompt, tokens=list(seq.tokens), logprobs=[float(x) for x in seq.logprobs],
                    policy_version=seq.policy_version, stop_reason=seq.stop_reason)
        if seq.policy_version is not None:
            versions.append(seq.policy_version)
        m.turns.append(turn)
        turns.append(turn)
    with clock.timing("step"):
        results = await asyncio.gather(*(bounded_call(m.env.step(t.tokens), budget.step_timeout_s, "step")
                                         for m, t in zip(members, turns)))
    for m, (result, error, cause) in zip(members, results):
        if error:
            m.end("infra_failure", error, cause)
            continue
        if not isinstance(result, StepResult):
            m.end("infra_failure", f"step returned {type(result).__name__}, not a quilt.rl.StepResult", "step_error")
            continue
        m.reward += float(result.reward)
        for key, value in result.metrics.items():
            m.metrics[key] = m.metrics.get(key, 0.0) + float(value)
        m.info.update(result.info)
        if result.outcome == "infra_failure":
            m.end("infra_failure", None, "env_reported")
        elif result.done:
            m.end(result.outcome)
        elif len(m.turns) >= budget.max_turns:
            m.end("model_failure", f"episode did not finish within {budget.max_turns} turns", "max_turns")
        else:
            try:
                m.prompt, m.stop = prompt_ids(result.next_prompt), prompt_stop(result.next_prompt)
            except (TypeError, ValueError) as exc:
                m.end("infra_failure", f"step's next_prompt is not token ids: {exc}", "step_error")
                continue
            m.hint = result.episode_hint
