"""The cookbook's supervised loop (`supervised.train`) and DPO (`preference.train_dpo`), unchanged,
on conversations and comparisons written here as JSONL files (in place of hub datasets)."""

from __future__ import annotations

import math

from recipes import RENDERER, TINY, WORDS, common, first_last, metrics, series, write_jsonl
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl


def test_supervised_train_lowers_the_loss(sft_run):
    first, last = first_last(series(metrics(sft_run.log_path), "train_mean_nll"))
    print(f"supervised.train nll {first:.3f} -> {last:.3f}")
    assert last < 0.5 * first
    assert sft_run.final_sampler.startswith("tinker://") and sft_run.early_state.startswith("tinker://")


def test_dpo_prefers_the_chosen_answers(cookbook, tmp_path):
    rows = []
    for w in WORDS * 3:
        comparison = {"prompt_conversation": [{"role": "user", "content": f"Describe {w}."}],
                      "completion_A": [{"role": "assistant", "content": f"{w} is calm and bright."}],
                      "completion_B": [{"role": "assistant", "content": f"{w} is loud and dull."}]}
        rows.append({"comparison": comparison, "label": "A"})
    data = DPODatasetBuilderFromComparisons(
        comparison_builder=ComparisonBuilderFromJsonl(train_path=write_jsonl(tmp_path / "pairs.jsonl", rows)),
        common_config=common(8))
    config = train_dpo.Config(log_path=str(tmp_path / "run"), model_name=TINY, recipe_name="quilt_dpo",
                              renderer_name=RENDERER, dataset_builder=data, learning_rate=5e-4, num_epochs=3,
                              dpo_beta=0.1, lora_rank=16, save_every=0, eval_every=0, base_url=cookbook)
    train_dpo.main(config)
    rows = metrics(tmp_path / "run")
    losses, accuracy = series(rows, "dpo_loss"), series(rows, "accuracy")
    print(f"preference.train_dpo loss {losses[0]:.4f} -> {losses[-1]:.4f}, accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}")
    # Before the first step the policy is the reference (the sampler's logprobs of the same base):
    # every log-ratio is 0 and the loss is ln 2.
    assert abs(losses[0] - math.log(2)) < 1e-3
    assert losses[-1] < 0.3 and accuracy[-1] == 1.0
