"""recipes/true_thinking_score through its two scripts, `run_small_experiment.main` (the recipe's own
three problems) and `analyze.cli_main` (CLIConfig), both over `tts.generate_cot_and_compute_tts`:
a greedy chain of thought sampled, cut into steps, and each step scored with four `compute_logprobs`
calls (step and context each intact or with their numbers shifted).

Replaced: the model (`run_small_experiment.MODEL_NAME`, Qwen3.5-4B) by the tiny base, whose renderer
the cookbook's model table is told (recipes.know_the_tiny_base); run_small_experiment's budget of 2,048
new tokens, fixed in code, by 48 (2,048 plus the prompt is past the tiny base's whole 2,048-token
context, which Quilt, like Tinker, answers with a 400); and analyze's hub MATH-500
(`load_dataset`) by rows of its shape. A random model's confidence in an answer is ~0, so every step
is "decorative": the tests check the protocol (every problem scored, no problem failed, the four
conditions of each step probabilities), not the paper's figures."""

from __future__ import annotations

import asyncio
import json

import pytest
from recipes import TINY, know_the_tiny_base

THINKING_RENDERER = "qwen3"
COT_MAX_TOKENS = 48


def _check_problem(summary: dict) -> None:
    assert "error" not in summary, summary
    assert summary["n_steps"] >= 1
    assert all(0.0 <= t <= 1.0 for t in summary["per_step_tts"])
    assert len(summary["per_step_tts"]) == summary["n_steps"]


@pytest.mark.extended
def test_run_small_experiment_scores_every_step(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes.true_thinking_score import run_small_experiment as script

    know_the_tiny_base(monkeypatch, THINKING_RENDERER)
    monkeypatch.setenv("TINKER_COOKBOOK_RUNS_DIR", str(tmp_path))
    monkeypatch.setattr(script, "MODEL_NAME", TINY)
    scored = script.generate_cot_and_compute_tts

    async def short_cot(**kwargs):
        assert kwargs["max_tokens"] == 2048
        return await scored(**{**kwargs, "max_tokens": COT_MAX_TOKENS})

    monkeypatch.setattr(script, "generate_cot_and_compute_tts", short_cot)
    asyncio.run(script.main())
    out = json.loads((tmp_path / "tts-experiment" / "tts_results.json").read_text())
    print(f"run_small_experiment: {out['aggregate']}")
    assert out["model"] == TINY and len(out["problems"]) == len(script.PROBLEMS)
    for summary in out["problems"]:
        _check_problem(summary)
    assert out["aggregate"]["n_steps"] == sum(p["n_steps"] for p in out["problems"])


@pytest.mark.extended
def test_analyze_scores_math_problems(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes.true_thinking_score import analyze as script

    rows = [{"problem": "What is 2 + 3? First add, then check.", "solution": "2 + 3 = \\boxed{5}"},
            {"problem": "What is 7 times 6?", "solution": "Multiply: \\boxed{42}"},
            {"problem": "Name a colour.", "solution": "no boxed answer here"}]

    def load_dataset(path, name=None, split=None, **kwargs):
        assert (path, name, split) == ("HuggingFaceH4/MATH-500", "default", "test")
        return rows

    monkeypatch.setattr(script, "load_dataset", load_dataset)
    config = script.CLIConfig(model_name=TINY, renderer_name=THINKING_RENDERER, dataset="math", n_problems=5,
                              max_tokens=COT_MAX_TOKENS, concurrency=2, log_path=str(tmp_path), seed=0)
    asyncio.run(script.cli_main(config))
    summary = json.loads((tmp_path / "tts_summary.json").read_text())
    per_problem = [json.loads(line) for line in (tmp_path / "tts_per_problem.jsonl").read_text().splitlines()]
    print(f"analyze: {summary}")
    # The third row has no \boxed answer: the loader drops it, as it drops MATH-500's.
    assert summary["n_problems"] == 2 and summary["n_problems_succeeded"] == 2
    assert sorted(p["answer"] for p in per_problem) == ["42", "5"]
    for problem in per_problem:
        _check_problem(problem)
    assert 0.0 <= summary["mean_tts"] <= 1.0
