"""Running a GRPO group's episodes against a sampler: one ``sample(n)`` per shared prompt.

A group's ``n`` environments start from the same prompt, so their first turn is one request for
``n`` samples: the generation pool treats it as one group and completes it when its slowest member
finishes. Later turns of multi-turn tasks diverge; episodes that happen to share a prompt are still
sampled together.

Every environment call runs under ``step_timeout_s``. An environment that raises or times out ends
its episode as an ``infra_failure`` (kept out of training, counted); sampling that fails on the
server's side, or passes ``sample_deadline_s``, does the same for the episodes it was sampling. A user error from the server (bad
sampling parameters, say) is raised: it would fail every episode the same way. The episode budget
(``max_turns`` and ``max_episode_tokens``) ends an episode that will not finish as a
``model_failure`` with the reward earned so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import (
    APIConnectionError,
    InternalServerError,
    ServerRequestError,
    UserRequestError,
)
from ..sampling import SamplingClient, SamplingParams
from ..types import ModelInput
from .env import Env, Prompt, StepResult
from .grpo import Episode, Turn

__all__ = ["EpisodeBudget", "SampledGroup", "rollout_group"]

log = logging.getLogger("quilt.rl")

# Errors that say the platform, not the model or the caller, failed.
_INFRA_ERRORS = (ServerRequestError, APIConnectionError, InternalServerError)


@dataclass(frozen=True)
class EpisodeBudget:
    """Limits on one episode: each environment call, the number of turns, the sampled tokens."""

    step_timeout_s: float = 60.0
    max_turns: int = 1
    max_episode_tokens: int | None = None
    # Each sampling request is aborted by the pool if unfinished this long after submission; its
    # episodes end as infra_failure (a congested pool, not the model's doing). None: the server's default.
    sample_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.sample_deadline_s is not None and not self.sample_deadline_s > 0:
            raise ValueError(f"sample_deadline_s must be > 0, got {self.sample_deadline_s}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be >= 1, got {self.max_episode_tokens}")


@dataclass
class SampledGroup:
    """A finished group: its episodes, the sampler's policy version, and when it ran.

    ``env_s`` is the wall time the group waited on its environments (reset, step, reward: the
    slowest member's call each time), ``sample_s`` the wall time it waited on the pool.
    """

    index: int
    episodes: list[Episode]
    policy_version: int | None
    started_at: float
    finished_at: float
    env_s: float = 0.0
    sample_s: float = 0.0


@dataclass
class _Live:
    env: Env
    prompt: list[int] | None = None
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    finished: Episode | None = None
    hint: str | None = None  # the environment's word on its next turn (StepResult.episode_hint)

    def end(self, outcome: str, error: str | None = None) -> None:
        self.finished = Episode(turns=self.turns, reward=self.reward, outcome=outcome, error=error,
                                metrics=self.metrics)


def _ints(prompt: Prompt) -> list[int]:
    return prompt.to_ints() if isinstance(prompt, ModelInput) else [int(t) for t in prompt]


async def _env_call(coro, timeout_s: float, what: str):
    try:
        return await asyncio.wait_for(coro, timeout_s), None
    except asyncio.TimeoutError:
        return None, f"{what} timed out after {timeout_s:g}s"
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # an environment's own bug or its backend's failure: not the model's
        return None, f"{what} raised {type(exc).__name__}: {exc}"


async def rollout_group(index: int, sampler: SamplingClient, envs: Sequence[Env], params: SamplingParams,
                        budget: EpisodeBudget = EpisodeBudget(),  # noqa: B008 (frozen)
                        *, episode_priority: bool = False) -> SampledGroup:
    """Run one group's episodes to the end with ``sampler``; never raises for an episode's failure.

    With ``episode_priority`` every sampling call of the group carries one episode id (and the
    environments' hints), so the pool serves groups that have consumed less first
    (gen_pool.episodes) without predicting lengths.
    """
    started = time.monotonic()
    clock = _Clock()
    episode_id = f"rl-{uuid.uuid4().hex[:20]}/{index}" if episode_priority else None
    live = [_Live(env) for env in envs]
    with clock.timing("env"):
        resets = await asyncio.gather(*(_env_call(e.env.reset(), budget.step_timeout_s, "reset") for e in live))
    for episode, (prompt, error) in zip(live, resets):
        if error:
            episode.end("infra_failure", error)
        else:
            episode.prompt = _ints(prompt)
    versions: list[int] = []
    while True:
        active = [e for e in live if e.finished is None]
        if not active:
            break
        by_prompt: dict[tuple[int, ...], list[_Live]] = {}
        for e in active:
            by_prompt.setdefault(tuple(e.prompt or ()), []).append(e)
        await asyncio.gather(*(_sample_turn(sampler, list(prompt), members, params, budget, versions, clock,
                                            episode_id) for prompt, members in by_prompt.items()))
    return SampledGroup(index=index, episodes=[e.finished for e in live if e.finished is not None],
                        policy_version=min(versions) if versions else sampler.policy_version,
                        started_at=started, finished_at=time.monotonic(), env_s=clock.seconds["env"],
                        sample_s=clock.seconds["sample"])


class _Clock:
    """Wall time a group spends waiting on each kind of call. Turns that diverged wait side by
    side; an interval counts once however many calls of its kind overlap, so each total is at most
    the group's wall time (the two kinds overlap only where diverged turns wait on different ones)."""

    def __init__(self) -> None:
        self.seconds = {"env": 0.0, "sample": 0.0}
        self._open = {"env": 0, "sample": 0}
        self._since = {"env": 0.0, "sample": 0.0}

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


async def _sample_turn(sampler: SamplingClient, prompt: list[int], members: list[_Live], params: SamplingParams,
                       budget: EpisodeBudget, versions: list[int], clock: _Clock, episode_id: str | None) -> None:
    turn_params = params
    if budget.max_episode_tokens is not None:
        left = min(budget.max_episode_tokens - sum(len(t.tokens) for t in m.turns) for m in members)
        if left < 1:
            for m in members:
                m.end("model_failure", f"episode token budget {budget.max_episode_tokens} spent")
            return
        if params.max_tokens is None or params.max_tokens > left:
            turn_params = dataclasses.replace(params, max_tokens=left)
    hints = {m.hint for m in members} - {None}
    hint = None if episode_id is None else "promote" if "promote" in hints else "demote" if hints else None
    for m in members:
        m.hint = None
    try:
        with clock.timing("sample"):
            # Only with an episode: a sampler that duck-types the SDK's needs no episode arguments.
            episode = {} if episode_id is None else {"episode_id": episode_id, "episode_hint": hint}
            future = await sampler.sample_async(prompt, len(members), turn_params, deadline_s=budget.sample_deadline_s,
                                                **episode)
            try:
                response = await future
            except asyncio.CancelledError:
                # The run is over (or was stopped): free the pool's slots instead of finishing rollouts
                # nobody will train on.
                cancel = getattr(future, "cancel", None)
                if cancel is not None:
                    try:
                        cancel()
                    except Exception as exc:  # the SDK may already be closing; the server times it out
                        log.debug("could not cancel %s: %s", getattr(future, "request_id", "?"), exc)
                raise
    except _INFRA_ERRORS as exc:
        log.warning("sampling failed for %d episodes: %s", len(members), exc)
        for m in members:
            m.end("infra_failure", f"sampling failed: {exc}")
        return
    except UserRequestError as exc:
        if exc.field != "deadline_s":
            raise
        log.warning("sampling passed its deadline for %d episodes: %s", len(members), exc)
        for m in members:
            m.end("infra_failure", f"sampling passed its deadline: {exc.message}")
        return
    if len(response.sequences) != len(members):
        for m in members:
            m.end("infra_failure", f"asked for {len(members)} samples, got {len(response.sequences)}")
        return
    turns = []
    for m, seq in zip(members, response.sequences):
        turn = Turn(prompt=prompt, tokens=list(seq.tokens), logprobs=[float(x) for x in seq.logprobs],
                    policy_version=seq.policy_version, stop_reason=seq.stop_reason)
        if seq.policy_version is not None:
            versions.append(seq.policy_version)
        m.turns.append(turn)
        turns.append(turn)
    with clock.timing("env"):
        results = await asyncio.gather(*(_env_call(m.env.step(t.tokens), budget.step_timeout_s, "step")
                                         for m, t in zip(members, turns)))
    for m, (result, error) in zip(members, results):
        if error:
            m.end("infra_failure", error)
            continue
        if not isinstance(result, StepResult):
            m.end("infra_failure", f"step returned {type(result).__name__}, not a quilt.rl.StepResult")
            continue
        m.reward += float(result.reward)
        for key, value in result.metrics.items():
            m.metrics[key] = m.metrics.get(key, 0.0) + float(value)
        if result.done or result.outcome == "infra_failure":
            m.end(result.outcome)
        elif len(m.turns) >= budget.max_turns:
            m.end("model_failure", f"episode did not finish within {budget.max_turns} turns")
        else:
            m.prompt = _ints(result.next_prompt)
            m.hint = result.episode_hint
