"""The cookbook's top-level scripts, each through its own config and `main`: `recipes/sl_basic.py`
and `rl_basic.py` (a `chz` blueprint over `supervised.train` / `rl.train`), and `sl_loop.py` and
`rl_loop.py` (flat loops over the SDK: their own batching, sampling, advantages and checkpoints).

All four look their renderer up in the cookbook's model table by model name, which lists only
official ids: `know_the_tiny_base` gives the tiny base its entry. The hub datasets they read
(HuggingFaceH4/no_robots, openai/gsm8k) are JSONL files written here (`local_hub`)."""

from __future__ import annotations

import chz
import pytest
from recipes import CHAT, TINY, first_last, know_the_tiny_base, local_hub, metrics, series
from tinker_cookbook import checkpoint_utils
from tinker_cookbook.recipes import rl_basic, rl_loop, sl_basic, sl_loop
from tinker_cookbook.recipes.math_rl import math_env


def _no_robots(monkeypatch, root, copies: int) -> None:
    chats = [{"messages": m, "category": "repeat"} for m in CHAT]
    local_hub(monkeypatch, root, {"HuggingFaceH4/no_robots": {"train": chats * copies, "test": chats[:4]}})


def _gsm8k(monkeypatch, root) -> None:
    rows = [{"question": f"Ann has {a} apples and buys {b} more. How many apples does she have?",
             "answer": f"She has {a} + {b} = {a + b} apples.\n#### {a + b}"} for a, b in [(2, 3), (4, 1), (5, 5), (3, 6)] * 2]
    local_hub(monkeypatch, root, {"openai/gsm8k": {"train": rows, "test": rows[:2]}}, math_env)


@pytest.mark.extended
def test_sl_basic_lowers_the_nll(cookbook, tmp_path, monkeypatch):
    know_the_tiny_base(monkeypatch)
    _no_robots(monkeypatch, tmp_path, copies=2)
    config = sl_basic.build_config_blueprint(TINY).apply({
        "log_path": str(tmp_path / "run"), "base_url": cookbook, "learning_rate": 5e-3, "num_epochs": 3,
        "lora_rank": 16, "save_every": 0}).make()
    data = config.dataset_builder
    config = chz.replace(config, dataset_builder=chz.replace(
        data, common_config=chz.replace(data.common_config, batch_size=8, max_length=256)))
    sl_basic.main(config)
    nll = series(metrics(tmp_path / "run"), "train_mean_nll")
    first, last = first_last(nll, k=2)
    print(f"sl_basic: {len(nll)} steps, train nll {first:.3f} -> {last:.3f}")
    assert len(nll) == 6
    assert last < 0.7 * first


@pytest.mark.extended
def test_sl_loop_lowers_the_nll(cookbook, tmp_path, monkeypatch):
    know_the_tiny_base(monkeypatch)
    _no_robots(monkeypatch, tmp_path, copies=5)
    sl_loop.main(sl_loop.Config(base_url=cookbook, log_path=str(tmp_path / "run"), model_name=TINY, batch_size=8,
                                learning_rate=5e-3, max_length=256, lora_rank=16, save_every=0))
    nll = series(metrics(tmp_path / "run"), "train_mean_nll")
    first, last = first_last(nll, k=2)
    print(f"sl_loop: {len(nll)} steps, train nll {first:.3f} -> {last:.3f}")
    assert len(nll) == 5
    assert last < 0.8 * first
    final = checkpoint_utils.get_last_checkpoint(str(tmp_path / "run"))
    assert final is not None and final.state_path.startswith("tinker://")


@pytest.mark.extended
def test_rl_basic_runs_on_local_gsm8k(cookbook, tmp_path, monkeypatch):
    """Protocol: the random tiny model never writes \\boxed{}, so every reward is the same and
    nothing is learnt; the script's loop runs its steps to the end (rewards and kl_sample_train
    logged, kl small)."""
    know_the_tiny_base(monkeypatch)
    _gsm8k(monkeypatch, tmp_path)
    config = rl_basic.build_config_blueprint(TINY).apply({
        "log_path": str(tmp_path / "run"), "base_url": cookbook, "lora_rank": 8, "max_tokens": 8, "max_steps": 2,
        "save_every": 0}).make()
    config = chz.replace(config, dataset_builder=chz.replace(config.dataset_builder, batch_size=2, group_size=4))
    rl_basic.main(config)
    rows = metrics(tmp_path / "run")
    reward = series(rows, "env/all/reward/total")
    print(f"rl_basic: reward {reward}, kl_sample_train_v1 {series(rows, 'optim/kl_sample_train_v1')}")
    assert len(reward) == 2
    assert max(abs(v) for v in series(rows, "optim/kl_sample_train_v1")) < 1e-3


@pytest.mark.extended
def test_rl_loop_runs_on_local_gsm8k(cookbook, tmp_path, monkeypatch):
    """Protocol: the random tiny model never writes \\boxed{}, so each group's rewards are equal and
    the script skips its training step (its own rule); sampling with stability info, the rewards
    and the final checkpoint are what runs."""
    know_the_tiny_base(monkeypatch)
    _gsm8k(monkeypatch, tmp_path)
    rl_loop.main(rl_loop.Config(base_url=cookbook, log_path=str(tmp_path / "run"), model_name=TINY, batch_size=2,
                                group_size=4, learning_rate=1e-3, lora_rank=8, save_every=0, max_tokens=8, max_steps=2))
    reward = series(metrics(tmp_path / "run"), "reward/total")
    print(f"rl_loop: reward {reward}")
    assert len(reward) == 2
    final = checkpoint_utils.get_last_checkpoint(str(tmp_path / "run"))
    assert final is not None and final.sampler_path.startswith("tinker://")
