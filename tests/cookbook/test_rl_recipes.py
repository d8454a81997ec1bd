"""The cookbook's RL loop (`rl.train`) and the recipes built on it, unchanged, against the stack."""

from __future__ import annotations

import asyncio

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
