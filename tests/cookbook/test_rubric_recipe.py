"""recipes/rubric, its two steps as the README runs them: `generate_data` writes the addition
datapoints (to a temporary directory instead of the package's example_data/), then `train`'s
CLIConfig and cli_main run RL with each rollout graded by a grader model sampled through the same
server, against a rubric per datapoint.

Replaced: the hosted grader (Qwen3.6-35B-A3B) by the tiny base, named by the recipe's own
`grader_llm_name`; and the grader's budget of 2,048 new tokens, which `RubricGradedDatasetBuilder`
fixes in code, by 24 (2,048 plus any prompt is past the tiny base's whole 2,048-token context, which
Quilt, like Tinker, answers with a 400). It trains with the recipe's default loss,
`stable_reinforce`, on the stability records its samplers keep. A random grader never writes `<score>x</score>`, so every
rubric score is 0 and only the format term moves: the test runs the protocol to the end (policy
sampled, grader sampled per rollout, rewards logged, train and eval steps done), not a curve."""

from __future__ import annotations

import asyncio

import pytest
from recipes import RENDERER, TINY, metrics, series

GRADER_MAX_TOKENS = 24


@pytest.mark.extended
def test_rubric_recipe_generates_data_and_trains_against_a_grader(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes.rubric import env as rubric_env
    from tinker_cookbook.recipes.rubric import generate_data
    from tinker_cookbook.recipes.rubric import train as script

    graded: list[int] = []
    completer = rubric_env.TinkerMessageCompleter

    def small_grader(*, sampling_client, renderer, max_tokens):
        graded.append(max_tokens)
        return completer(sampling_client=sampling_client, renderer=renderer,
                         max_tokens=min(max_tokens, GRADER_MAX_TOKENS))

    monkeypatch.setattr(rubric_env, "TinkerMessageCompleter", small_grader)
    train_path, test_path = generate_data.generate_dataset(num_train=8, num_test=2, seed=0, write_dir=str(tmp_path))
    log = tmp_path / "run"
    cli = script.CLIConfig(model_name=TINY, renderer_name=RENDERER, grader_llm_name=TINY,
                           grader_renderer_name=RENDERER, train_jsonl_path=train_path, test_jsonl_path=test_path,
                           train_group_size=2, groups_per_batch=2, learning_rate=1e-3, max_tokens=8, lora_rank=8,
                           eval_every=2, save_every=0, log_path=str(log), base_url=cookbook, max_steps=2)
    asyncio.run(script.cli_main(cli))
    rows = metrics(log)
    rubric, fmt = series(rows, "env/all/rubric_score"), series(rows, "env/all/format")
    test_rubric = series(rows, "test/env/all/rubric_score")
    kl = series(rows, "optim/kl_sample_train_v1")
    print(f"rubric: {len(rubric)} train steps, rubric_score {rubric}, format {fmt}, test rubric_score {test_rubric}, "
          f"kl_sample_train_v1 max {max(map(abs, kl)):.1e}")
    assert graded == [2048, 2048]  # the recipe asked for its grader twice (train and test), at its own budget
    assert len(rubric) == 2 and len(fmt) == 2 and len(test_rubric) >= 1
    assert all(0.0 <= v <= 1.0 for v in rubric + fmt)
    assert max(map(abs, kl)) < 1e-3
