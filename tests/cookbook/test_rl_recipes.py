"""The cookbook's RL loop (`rl.train`) and the recipes built on it, unchanged, against the stack."""

from __future__ import annotations

import asyncio

import chz
import pytest
from recipes import RENDERER, TINY, BandDatasetBuilder, first_last, metrics, series
from tinker_cookbook.rl import train


def test_rl_train_learns_the_band_task(cookbook, tmp_path):
    config = train.Config(
        model_name=TINY, recipe_name="quilt_band", renderer_name=RENDERER, log_path=str(tmp_path),
        dataset_builder=BandDatasetBuilder(batches=14), learning_rate=1e-2, max_tokens=8, lora_rank=16,
        eval_every=0, save_every=0, base_url=cookbook)
    asyncio.run(train.main(config))
    rows = metrics(tmp_path)
    first, last = first_last(series(rows, "env/all/reward/total"))
    print(f"rl.train reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.2
    assert max(series(rows, "optim/kl_sample_train_v1")) < 1e-3


def _kl(rows: list[dict]) -> tuple[float, float]:
    v1, v2 = series(rows, "optim/kl_sample_train_v1"), series(rows, "optim/kl_sample_train_v2")
    assert v1 and v2
    return max(abs(v) for v in v1), max(v2)


@pytest.mark.extended
def test_multiplayer_guess_number_plays_multi_turn_episodes(cookbook, tmp_path):
    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as guess

    config = guess.build_config(guess.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, group_size=4, batch_size=2, learning_rate=1e-3, max_tokens=12,
        eval_every=0, save_every=0, log_path=str(tmp_path), max_steps=2))
    asyncio.run(train.main(chz.replace(config, base_url=cookbook)))
    rows = metrics(tmp_path)
    turns = series(rows, "env/all/turns_per_episode")
    v1, v2 = _kl(rows)
    print(f"multiplayer guess_number: {turns[0]:.1f} turns per episode, kl_sample_train v1 {v1:.1e} v2 {v2:.1e}")
    # The random model never answers "Guess: <n>": every turn is the env's format penalty and its
    # reprompt, to the env's turn cap. The trainer sees each episode's turns as one sequence.
    assert min(turns) > 5
    assert v1 < 1e-3 and v2 < 1e-3


def test_rl_numerics_check_on_local_text(cookbook, tmp_path, monkeypatch):
    """The recipe's counting environment on a local corpus in place of WikiText-103."""
    from tinker_cookbook.recipes.rl_numerics_check import env as counting
    from tinker_cookbook.recipes.rl_numerics_check import train as numerics

    words = "the river ran after the storm and the town waited until the water fell against the wall".split()
    corpus = "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(400))
    monkeypatch.setattr(counting, "load_wikitext_corpus", lambda max_chars=0: corpus)
    task = counting.CountingTaskConfig(num_pages_min=2, num_pages_max=3, page_chars=200,
                                       words=("after", "until", "against"))
    config = numerics.build_config(numerics.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, lora_rank=8, group_size=4, groups_per_batch=2, max_tokens=24,
        max_trajectory_tokens=1800, task=task, save_every=0, max_steps=2, log_path=str(tmp_path),
        base_url=cookbook))
    asyncio.run(train.main(config))
    v1, v2 = _kl(metrics(tmp_path))
    print(f"rl_numerics_check: kl_sample_train v1 {v1:.1e} v2 {v2:.1e}")
    assert v1 < 1e-3 and v2 < 1e-3
