"""The verifiers bridge (`recipes.verifiers_rl.train`): a verifiers environment written here
(quilt_vf_letters, in place of one from the Environments Hub) sampled through the recipe's
OpenAI-compatible client over Quilt's sampler, scored by its rubric, and trained by `rl.train`.

One shim, for a bug of tinker-cookbook 0.6.1 itself (it fails the same way against any server): the
recipe replaces `rollouts.do_group_rollout` with a function that does not take the `termination`
argument the rollout loop now passes. The test drops that argument when it is None, as it is
here (no termination policy for this model), and changes nothing else."""

from __future__ import annotations

import asyncio

import pytest
from recipes import RENDERER, TINY, first_last, metrics, series
from tinker_cookbook.recipes.verifiers_rl import train as vf_train
from tinker_cookbook.rl import rollouts


def _without_termination_argument(main):
    async def run(config):
        recipes_rollout = rollouts.do_group_rollout

        async def rollout(builder, policy, strategy=None, termination=None):
            assert termination is None, termination
            return await recipes_rollout(builder, policy, strategy=strategy)

        rollouts.do_group_rollout = rollout
        return await main(config)
    return run


@pytest.mark.extended
def test_verifiers_environment_trains_through_the_bridge(cookbook, tmp_path, monkeypatch):
    # The recipe swaps the rollout function module-wide; put it back for the other tests.
    monkeypatch.setattr(rollouts, "do_group_rollout", rollouts.do_group_rollout)
    monkeypatch.setattr(vf_train.train, "main", _without_termination_argument(vf_train.train.main))
    config = vf_train.CLIConfig(model_name=TINY, renderer_name=RENDERER, lora_rank=16, vf_env_id="quilt-vf-letters",
                                group_size=4, groups_per_batch=4, learning_rate=1e-2, max_tokens=8,
                                save_every=0, log_path=str(tmp_path), behavior_if_log_dir_exists="delete",
                                max_steps=16)
    asyncio.run(vf_train.cli_main(config, None))
    rows = metrics(tmp_path)
    first, last = first_last(series(rows, "env/all/reward/total"))
    v1 = max(abs(v) for v in series(rows, "optim/kl_sample_train_v1"))
    print(f"verifiers_rl reward (share of 'e') {first:.3f} -> {last:.3f}, kl_sample_train_v1 {v1:.1e}")
    # From about 0.08 (runs vary: each LoRA starts from a fresh random init) to 0.14-0.25.
    assert last > first + 0.04 and v1 < 1e-3
