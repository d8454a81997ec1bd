"""Reinforcement learning from scratch on the tiny random-weight model, through quilt.rl (GRPO).

The task, designed for a model that knows nothing: two "bands" of 96 token ids each, and each prompt
is an instruction naming one of them (a fixed, arbitrary token sequence per band). The reward is the
fraction of the 8 sampled tokens that fall inside the instructed band, so it lies in [0, 1]; the
random model scores about 0.1. The model must learn to read the instruction: a policy that always
answers in one band averages at most 0.5. Only the reward teaches it (no supervised data); it
reaches about 1.0 in some 20 steps, under two minutes on a 2-core CPU. No tokenizer is needed: the
task is defined on token ids, so it runs against any server and base model.

    QUILT_API_KEY=tml-... QUILT_BASE_URL=http://127.0.0.1:8000 python examples/rl_tiny.py

Prints one line per step and ends with one JSON line:
{"reward_first": ..., "reward_last": ..., "steps": ..., "seconds": ...} (first and last: means over
three steps).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

import quilt
from quilt import rl

BASE_MODEL = "quilt/tiny-qwen3"
BAND_WIDTH = 96


@dataclass(frozen=True)
class BandTask:
    """Disjoint bands of token ids (inside the first 1024 ids, so any base model has them), and for
    each an instruction: a fixed, arbitrary prompt that names it. ``variant`` shifts both, so several
    tenants can each learn their own version of the task."""

    variant: int = 0
    n_bands: int = 2  # with four bands it learns too, more slowly

    def band(self, k: int) -> tuple[int, int]:
        start = 256 + k * (768 // self.n_bands) + 24 * self.variant
        return start, start + BAND_WIDTH

    def instruction(self, k: int) -> list[int]:
        return [11 + self.variant, 87, 140 + 9 * k, 201 + self.variant, 33 + k]


class BandEnv(rl.Env):
    """One episode: read the instruction for band ``k``, answer with tokens from that band."""

    def __init__(self, task: BandTask, band: int, answer_tokens: int) -> None:
        self.task, self.band, self.answer_tokens = task, band, answer_tokens

    async def reset(self) -> list[int]:
        return self.task.instruction(self.band)

    async def step(self, tokens: list[int]) -> rl.StepResult:
        low, high = self.task.band(self.band)
        inside = sum(1 for t in tokens if low <= t < high)
        # Divided by the full answer length: stopping early earns nothing.
        reward = inside / self.answer_tokens
        return rl.StepResult(reward=reward, outcome="success" if reward >= 0.5 else "model_failure",
                             metrics={"in_band": float(inside)})


def group_builder(task: BandTask, seed: int, answer_tokens: int):
    """``make_group(index, n)``: n episodes of one instruction.

    Instructions take turns (from a seeded random start) rather than being drawn at random: a batch
    that happens to hold mostly one instruction pushes the policy towards answering in that band for
    every prompt, and once the other band's probability is near zero its groups are all-zero
    (zero advantage) and GRPO can no longer pull it back.
    """
    offset = random.Random(seed).randrange(task.n_bands)

    def make_group(index: int, n: int) -> list[BandEnv]:
        band = (offset + index) % task.n_bands
        return [BandEnv(task, band, answer_tokens) for _ in range(n)]
    return make_group


def rl_config(args: argparse.Namespace) -> rl.RLConfig:
    return rl.RLConfig(
        group_size=args.group_size, groups_per_batch=args.groups, max_staleness=args.max_staleness,
        # stop=[]: always sample answer_tokens tokens, so every answer has the same length.
        sampling=quilt.SamplingParams(max_tokens=args.answer_tokens, temperature=1.0, stop=[]),
        loss_fn="importance_sampling", loss_fn_config={"is_weight_cap": 2.0},
        adam=quilt.AdamParams(learning_rate=args.lr),
    )


def add_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="groups per training step")
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, steps=24)
    args = parser.parse_args()

    started = time.monotonic()
    with quilt.Client() as client:
        tc = client.create_training_client(BASE_MODEL, rank=args.rank, seed=args.seed)
        print(f"RL on {tc.model_id}: {args.steps} steps x {args.groups} groups x {args.group_size} samples, "
              f"max_staleness {args.max_staleness}")
        logs = rl.train_grpo(tc, group_builder(BandTask(), args.seed, args.answer_tokens), rl_config(args),
                             args.steps, on_step=lambda entry: print(entry.line(), flush=True))
    seconds = time.monotonic() - started
    summary = rl.summarize(logs)
    print(f"mean reward: first {summary['reward_first']:.3f} -> last {summary['reward_last']:.3f} "
          f"in {len(logs)} steps, {seconds:.0f} s")
    print(json.dumps({"reward_first": round(summary["reward_first"], 4), "reward_last": round(summary["reward_last"], 4),
                      "steps": len(logs), "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
