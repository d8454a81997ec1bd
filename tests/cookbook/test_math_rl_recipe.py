"""`recipes.math_rl` through its own entry point (`CLIConfig` -> `cli_main`), on its arithmetic
environment: local problems (x + y), no dataset."""

from __future__ import annotations

import asyncio
import random

import pytest
from recipes import RENDERER, TINY, common, first_last, metrics, series, write_jsonl
from tinker_cookbook import checkpoint_utils
from tinker_cookbook.recipes.math_rl import arithmetic_env
from tinker_cookbook.recipes.math_rl import train as math_rl
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train as sft
from tinker_cookbook.supervised.data import FromConversationFileBuilder


def _warmup_rows(count: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        x, y = rng.randint(0, 100), rng.randint(0, 100)
        question = {"role": "user", "content": f"What is {x} + {y}?"}
        rows.append({"messages": [*arithmetic_env.ArithmeticEnv.standard_fewshot_prefix(), question,
                                  {"role": "assistant", "content": str(x + y)}]})
    return rows


@pytest.mark.extended
def test_math_rl_arithmetic_reward_rises(cookbook, tmp_path):
    """Nothing is replaced: the arithmetic env makes its own problems. The random tiny model never
    ends an answer with the renderer's stop sequence, so every reward would be the format penalty
    (-0.1) and RL would have no signal; a short `supervised.train` warm-up on the env's own question
    form (the cookbook's JSONL conversation builder) teaches it to answer with a number and stop
    some of the time, and the recipe starts from that checkpoint (its `load_checkpoint_path`). The
    reward then rises as RL makes the stop (and the format reward) the rule."""
    data = FromConversationFileBuilder(
        file_path=write_jsonl(tmp_path / "sums.jsonl", _warmup_rows(16)),
        common_config=common(8, train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE))
    asyncio.run(sft.main(sft.Config(
        log_path=str(tmp_path / "sft"), model_name=TINY, recipe_name="quilt_math_warmup", renderer_name=RENDERER,
        dataset_builder=data, learning_rate=5e-3, num_epochs=1, lora_rank=16, save_every=0, eval_every=0,
        base_url=cookbook)))
    start = checkpoint_utils.get_last_checkpoint(str(tmp_path / "sft")).state_path

    asyncio.run(math_rl.cli_main(math_rl.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, lora_rank=16, load_checkpoint_path=start, env="arithmetic",
        group_size=4, groups_per_batch=4, learning_rate=1e-2, max_tokens=6, eval_every=0, save_every=0,
        log_path=str(tmp_path / "rl"), base_url=cookbook, max_steps=6)))
    rows = metrics(tmp_path / "rl")
    reward, fmt = series(rows, "env/all/reward/total"), series(rows, "env/all/format")
    first, last = first_last(reward, k=2)
    print(f"math_rl arithmetic: reward {first:.3f} -> {last:.3f} over {len(reward)} steps, "
          f"format {fmt[0]:.2f} -> {fmt[-1]:.2f}, correct {series(rows, 'env/all/correct')}")
    assert len(reward) == 6
    assert last > first
