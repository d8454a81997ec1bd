"""The multiplayer RL recipes text_arena and twenty_questions, each through its own `train.py`
(`CLIConfig` -> `build_config` -> `rl.train.main`), against the stack. guess_number is in
test_rl_recipes.py.

Learning means nothing here: the random tiny model never names a legal square nor guesses a word, so
these tests run the protocol to the end (every step done, multi-turn episodes logged, the sampler
and the trainer agreeing on the sampled tokens: kl_sample_train small)."""

from __future__ import annotations

import asyncio

import chz
import pytest
from recipes import RENDERER, TINY, know_the_tiny_base, metrics, series
from tinker_cookbook.rl import train


def _kl(rows: list[dict]) -> float:
    v1 = series(rows, "optim/kl_sample_train_v1")
    assert v1, rows
    return max(abs(v) for v in v1)


@pytest.mark.extended
def test_text_arena_tictactoe_self_play(cookbook, tmp_path):
    """TextArena's TicTacToe-v0 (the `textarena` package, local), in self-play; the evaluation
    opponent (`test_opponent="base_model"`) is the tiny base. Nothing is replaced."""
    from tinker_cookbook.recipes.multiplayer_rl.text_arena import train as arena

    config = arena.build_config(arena.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, batch_size=4, num_train_datapoints=8, num_test_datapoints=2,
        learning_rate=1e-3, max_tokens=12, eval_every=0, save_every=0, log_path=str(tmp_path), max_steps=2))
    asyncio.run(train.main(chz.replace(config, base_url=cookbook)))
    rows = metrics(tmp_path)
    rewards = series(rows, "env/all/reward/total")
    kl = _kl(rows)
    print(f"text_arena tictactoe: {len(rows)} steps, reward {rewards}, kl_sample_train_v1 {kl:.1e}")
    assert len(rewards) == 2
    assert kl < 1e-3


@pytest.mark.extended
def test_twenty_questions_with_the_tiny_base_as_answerer(cookbook, tmp_path, monkeypatch):
    """The hosted answerer (Qwen3.5-9B) is the tiny base, with RENDERER named for it in the
    cookbook's model registry (recipes.know_the_tiny_base). The word list is the recipe's own."""
    from tinker_cookbook.recipes.multiplayer_rl.twenty_questions import train as twenty

    know_the_tiny_base(monkeypatch)
    config = twenty.build_config(twenty.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, group_size=2, batch_size=1, num_epochs=1, learning_rate=1e-3,
        max_tokens=8, eval_every=0, save_every=0, log_path=str(tmp_path), max_steps=2))
    builder = chz.replace(config.dataset_builder, answerer_base_model=TINY, base_url=cookbook)
    asyncio.run(train.main(chz.replace(config, base_url=cookbook, dataset_builder=builder)))
    rows = metrics(tmp_path)
    turns = series(rows, "env/all/turns_per_episode")
    kl = _kl(rows)
    print(f"twenty_questions: {len(rows)} steps, {turns} turns per episode, kl_sample_train_v1 {kl:.1e}")
    assert len(turns) == 2
    # The player never guesses the word: every episode runs to the recipe's 20-question cap.
    assert min(turns) == 20
    assert kl < 1e-3
