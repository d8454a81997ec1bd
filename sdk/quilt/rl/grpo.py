"""GRPO's arithmetic as pure functions: group-relative advantages, which groups and episodes are
trained on, and the datums that carry them to the trainer.

Nothing here does I/O, so the rules are tested (and reasoned about) on plain numbers:

* Advantages are group-relative: ``A_i = r_i - mean(r)`` over the group's trainable episodes,
  optionally divided by their standard deviation. A group whose rewards are all equal teaches
  nothing (every advantage is zero) and is filtered out, and counted.
* ``infra_failure`` episodes are excluded before the mean is taken (their reward says nothing about
  the policy); a group left with fewer than two trainable episodes cannot be compared and is
  dropped, and counted.
* Each turn of an episode becomes one datum: the prompt and sampled tokens as input, the sampler's
  logprobs of the sampled tokens, the episode's advantage on every sampled token and zero on the
  prompt, and the policy version that sampled it (the trainer measures staleness from it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..types import Datum, ModelInput, TensorData

__all__ = ["Episode", "GroupPlan", "Turn", "episode_datums", "group_advantages", "plan_group"]


@dataclass(frozen=True)
class Turn:
    """One sampled turn: the prompt the model read and what it sampled."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    policy_version: int | None
    stop_reason: str = "stop"


@dataclass(frozen=True)
class Episode:
    """One finished episode: its turns, total reward and how it ended."""

    turns: list[Turn]
    reward: float
    outcome: str
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    cause: str | None = None  # why it ended early (quilt.rl.bounds.CAUSES), None when it finished

    @property
    def sampled_tokens(self) -> int:
        """Tokens sampled over all turns."""
        return sum(len(t.tokens) for t in self.turns)

    @property
    def policy_version(self) -> int | None:
        """The oldest policy version any of its turns was sampled with (its staleness counts from it)."""
        versions = [t.policy_version for t in self.turns if t.policy_version is not None]
        return min(versions) if versions else None


@dataclass(frozen=True)
class GroupPlan:
    """What to do with one group: ``status`` is ``train``, ``zero_advantage`` or ``too_few``;
    ``advantages`` has one value per episode (0.0 for excluded ones)."""

    status: str
    advantages: list[float]
    trainable: list[bool]


def group_advantages(rewards: Sequence[float], *, normalize: bool = False, eps: float = 1e-6) -> list[float]:
    """``r_i - mean(r)``, divided by ``std(r) + eps`` when ``normalize`` (population std)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def plan_group(episodes: Sequence[Episode], *, normalize: bool = False, tolerance: float = 1e-9) -> GroupPlan:
    """Decide how a finished group is trained on (see the module docstring for the rules)."""
    trainable = [e.outcome != "infra_failure" and bool(e.turns) for e in episodes]
    rewards = [e.reward for e, ok in zip(episodes, trainable) if ok]
    zeros = [0.0] * len(episodes)
    if len(rewards) < 2:
        return GroupPlan("too_few", zeros, trainable)
    if max(rewards) - min(rewards) <= tolerance:
        return GroupPlan("zero_advantage", zeros, trainable)
    values = iter(group_advantages(rewards, normalize=normalize))
    advantages = [next(values) if ok else 0.0 for ok in trainable]
    return GroupPlan("train", advantages, trainable)


def episode_datums(episode: Episode, advantage: float) -> list[Datum]:
    """One datum per turn of ``episode``, every sampled token carrying ``advantage``."""
    out = []
    for turn in episode.turns:
        if not turn.tokens:
            continue
        if len(turn.logprobs) != len(turn.tokens) or any(lp is None for lp in turn.logprobs):
            raise ValueError("every sampled token needs its sampler logprob to build an RL datum")
        full = list(turn.prompt) + list(turn.tokens)
        n_prompt_targets = len(turn.prompt) - 1  # targets 1..len(prompt)-1 are prompt tokens
        mask = [0.0] * n_prompt_targets + [1.0] * len(turn.tokens)
        out.append(Datum(
            model_input=ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData(full[1:], "int64"),
                "logprobs": TensorData([0.0] * n_prompt_targets + [float(x) for x in turn.logprobs], "float32"),
                "advantages": TensorData([0.0] * n_prompt_targets + [float(advantage)] * len(turn.tokens), "float32"),
                "weights": TensorData(mask, "float32"),
            },
            policy_version=turn.policy_version,
        ))
    return out
