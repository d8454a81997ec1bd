"""`recipes.preference`: DPO (`dpo/train.py`), the RLHF pipeline (`rlhf/rlhf_pipeline.py`: SFT, a
reward model, RL against it) and `shorter/train.py`, each through its own entry point."""

from __future__ import annotations

import math

import pytest
from recipes import CHAT, RENDERER, TINY, WORDS, first_last, know_the_tiny_base, local_hub, metrics, series
from tinker_cookbook.recipes.preference.dpo import train as dpo
from tinker_cookbook.recipes.preference.rlhf import rlhf_pipeline
from tinker_cookbook.recipes.preference.shorter import train as shorter


def _hh_rows(words: list[str]) -> list[dict]:
    """Rows in Anthropic/hh-rlhf's form: two transcripts that differ only in the last answer."""
    prompt = "\n\nHuman: Describe {w}.\n\nAssistant: "
    return [{"chosen": prompt.format(w=w) + f"{w} is calm and bright.",
             "rejected": prompt.format(w=w) + f"{w} is loud and dull."} for w in words]


@pytest.mark.extended
def test_dpo_recipe_prefers_the_chosen_answers(cookbook, tmp_path, monkeypatch):
    """Replaced: the hub's Anthropic/hh-rlhf by JSONL files of its columns written here; the recipe's
    own `HHHComparisonBuilder` parses the transcripts."""
    local_hub(monkeypatch, tmp_path, {"Anthropic/hh-rlhf": {"train": _hh_rows(WORDS * 5), "test": _hh_rows(WORDS[:4])}})
    dpo.cli_main(dpo.CLIConfig(model_name=TINY, renderer_name=RENDERER, dataset="hhh", learning_rate=5e-4,
                               batch_size=8, max_length=256, log_path=str(tmp_path / "run"), base_url=cookbook))
    rows = metrics(tmp_path / "run")
    losses, accuracy = series(rows, "dpo_loss"), series(rows, "accuracy")
    print(f"preference/dpo: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}")
    assert len(losses) == 5
    # Step 0's policy is its reference: every log-ratio is 0 and the loss is ln 2.
    assert abs(losses[0] - math.log(2)) < 1e-3
    assert losses[-1] < 0.5 * losses[0]
    assert first_last(accuracy, k=2)[1] > first_last(accuracy, k=2)[0]


@pytest.mark.extended
def test_rlhf_pipeline_runs_its_three_stages(cookbook, tmp_path, monkeypatch):
    """The pipeline's `cli_main`, all three stages at tiny sizes: SFT on NoRobots, a reward model
    trained through the API on HHH comparisons (supervised, on the preference token), and RL of the
    SFT policy against that reward model sampled through the API, with the recipe's comparison
    evaluator. Replaced: HuggingFaceH4/no_robots and Anthropic/hh-rlhf by JSONL files written here;
    the runs directory (TINKER_COOKBOOK_RUNS_DIR) is the test's; the cookbook's model table gets the
    tiny base's renderer (`know_the_tiny_base`). Learning is asserted where three steps mean
    something (the reward model's loss); the RL stage runs its protocol to the end."""
    know_the_tiny_base(monkeypatch)
    monkeypatch.setenv("TINKER_COOKBOOK_RUNS_DIR", str(tmp_path / "runs"))
    chats = [{"messages": m} for m in CHAT]
    local_hub(monkeypatch, tmp_path, {
        "HuggingFaceH4/no_robots": {"train": chats * 2, "test": chats[:2]},
        "Anthropic/hh-rlhf": {"train": _hh_rows(WORDS * 2), "test": _hh_rows(WORDS[:2])}})
    rlhf_pipeline.cli_main(rlhf_pipeline.CLIConfig(
        base_model=TINY, short_name="tiny", lora_rank=8, max_length=256, batch_size=4, sft_learning_rate=5e-3,
        rm_learning_rate=5e-3, rl_learning_rate=1e-3, rl_max_tokens=8, rl_group_size=2, save_every=100, eval_every=3,
        num_groups_to_log=1, max_steps=3))
    root = tmp_path / "runs" / "rlhf-tiny"
    sft, rm, rl = metrics(root / "sft"), metrics(root / "rm"), metrics(root / "rl")
    sft_nll, rm_nll = series(sft, "train_mean_nll"), series(rm, "train_mean_nll")
    versus = series(rl, "env/all/win_minus_loss")
    # the recipe's ComparisonEvaluator reports its win rate against the reference (eval_every and the last step)
    evals = {k: v for row in rl for k, v in row.items() if k.endswith("win_rate")}
    print(f"rlhf: sft nll {sft_nll}, rm nll {rm_nll}, rl win_minus_loss {versus}, "
          f"kl_sample_train_v1 {series(rl, 'optim/kl_sample_train_v1')}, evals {evals}")
    assert len(sft_nll) == 3 and len(rm_nll) == 3 and len(versus) == 3
    assert rm_nll[-1] < rm_nll[0]
    assert max(abs(v) for v in series(rl, "optim/kl_sample_train_v1")) < 1e-3
    assert evals


@pytest.mark.extended
def test_shorter_recipe_runs_its_preference_rl(cookbook, tmp_path):
    """The recipe's own env (a dummy prompt, a preference model that prefers the shorter answer):
    nothing needs the outside world, so nothing is replaced. On the random tiny model every answer
    runs to max_tokens without the stop sequence (the format penalty, the same for all), and which
    of two 12-token answers has fewer characters is noise, so a few steps teach nothing: the test
    runs the protocol to the end (steps done, the pairwise matchups scored, the post-step KL the
    recipe asks for logged, kl_sample_train small)."""
    shorter.cli_main(shorter.CLIConfig(model_name=TINY, renderer_name=RENDERER, batch_size=2, group_size=4,
                                       learning_rate=1e-3, max_tokens=12, eval_every=0, log_path=str(tmp_path / "run"),
                                       max_steps=3))
    rows = metrics(tmp_path / "run")
    versus = series(rows, "env/all/win_minus_loss")
    post_kl = [v for row in rows for k, v in row.items() if "kl_pre_post" in k]
    print(f"shorter: win_minus_loss {versus}, post-step kl {post_kl}, "
          f"kl_sample_train_v1 {series(rows, 'optim/kl_sample_train_v1')}")
    assert len(versus) == 3 and post_kl
    assert max(abs(v) for v in series(rows, "optim/kl_sample_train_v1")) < 1e-3
