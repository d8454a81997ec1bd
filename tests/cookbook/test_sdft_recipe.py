"""recipes/sdft (self-distillation fine-tuning: the same model is its own teacher, shown the golden
answer in context, and the student matches the teacher's top-K prompt logprobs on its own samples)
through its three entry points: `train` (CLIConfig, cli_main), `run_continual_learning`
(ExperimentConfig: SFT vs SDFT, tool use then science, stage 2 from stage 1's checkpoint) and
`benchmark` (BenchmarkConfig, phase "all": base eval, SFT, SDFT, each evaluated with eval.py's
SciKnowEvalEvaluator).

Replaced: the SDFT paper's data (a clone of idanshen/Self-Distillation, `data_dir`) by Arrow
datasets of the same columns written in the test with `save_to_disk`, read by the recipe's own
`load_from_disk` paths. `run_continual_learning` takes no renderer name and asks the cookbook's model
table, which is told the tiny base's renderer (recipes.know_the_tiny_base). eval.py's science
evaluator is built by benchmark.py with a budget of 2,048 new tokens fixed in code, past the tiny
base's whole 2,048-token context (Quilt, like Tinker, answers that with a 400): the test caps it at
16. On a random tiny model the accuracies mean nothing; the tests check the protocol (steps done,
top-K targets built, checkpoints chained between stages, every phase evaluated)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import datasets
import pytest
from recipes import RENDERER, TINY, WORDS, know_the_tiny_base, metrics, series

EVAL_MAX_TOKENS = 16


def _tooluse(root: Path, n: int) -> Path:
    """The paper's tool-use layout: train_data (prompt, golden_response) and eval_data (prompt, golden_answer)."""
    train = [{"prompt": f"Use Echo on {w}.", "golden_response": ["Action: Echo", f'Action Input: {{"text": "{w}"}}']}
             for w in (WORDS * 2)[:n]]
    evals = [{"prompt": f"Use Echo on {w}.", "golden_answer": [{"Action": "Echo", "Action_Input": json.dumps({"text": w})}]}
             for w in WORDS[:2]]
    datasets.Dataset.from_list(train).save_to_disk(str(root / "tooluse_data" / "train_data"))
    datasets.Dataset.from_list(evals).save_to_disk(str(root / "tooluse_data" / "eval_data"))
    return root / "tooluse_data"


def _science(root: Path, n: int) -> Path:
    """The paper's science layout: train_data (messages, output_text) and eval_data (prompt, answer)."""
    system = {"role": "system", "content": "Pick A, B, C or D."}
    questions = [(f"Which is {w}? A: {w} B: x C: y D: z", "A") for w in WORDS]
    train = [{"messages": [system, {"role": "user", "content": q}],
              "output_text": f"<reasoning>\nIt is {a}.\n</reasoning>\n<answer>\n{a}\n</answer>"}
             for q, a in (questions * 2)[:n]]
    evals = [{"prompt": [system, {"role": "user", "content": q}], "answer": a} for q, a in questions[:2]]
    datasets.Dataset.from_list(train).save_to_disk(str(root / "science_data" / "train_data"))
    datasets.Dataset.from_list(evals).save_to_disk(str(root / "science_data" / "eval_data"))
    return root / "science_data"


@pytest.mark.extended
def test_sdft_train_distils_the_demonstration_conditioned_teacher(cookbook, tmp_path):
    from tinker_cookbook.recipes.sdft import train as script

    data = _tooluse(tmp_path / "data", n=10)
    log = tmp_path / "run"
    cli = script.CLIConfig(model_name=TINY, renderer_name=RENDERER, dataset="toolalpaca",
                           toolalpaca_data_path=str(data / "train_data"), group_size=2, groups_per_batch=2,
                           learning_rate=1e-3, max_tokens=12, topk=8, lora_rank=8, eval_every=0, save_every=0,
                           log_path=str(log), base_url=cookbook, max_steps=4)
    asyncio.run(script.cli_main(cli))
    rows = metrics(log)
    entropy = series(rows, "sdft/mean_teacher_entropy")
    print(f"sdft.train: {len(rows)} steps, topk {series(rows, 'sdft/topk')}, datums {series(rows, 'sdft/num_datums')}, "
          f"teacher entropy {entropy}, keys {sorted(k for k in rows[-1] if 'loss' in k)}")
    assert series(rows, "sdft/topk") == [8.0] * 4
    assert series(rows, "sdft/num_datums") == [4.0] * 4
    # The teacher's top-8 distribution, renormalised: at most ln 8 nats.
    assert len(entropy) == 4 and all(0 < v <= math.log(8) + 1e-6 for v in entropy)


@pytest.mark.extended
def test_sdft_continual_learning_chains_two_stages_for_sft_and_sdft(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes.sdft import run_continual_learning as script

    know_the_tiny_base(monkeypatch)
    _tooluse(tmp_path / "data", n=4)
    _science(tmp_path / "data", n=4)
    root = tmp_path / "runs"
    config = script.ExperimentConfig(model_name=TINY, data_dir=str(tmp_path / "data"), lora_rank=8, batch_size=2,
                                     max_tokens=64, methods="sft,sdft_topk", learning_rates="1e-3", stages="1,2",
                                     topk=8, log_root=str(root), base_url=cookbook)
    asyncio.run(script.cli_main(config))
    stage1 = json.loads((root / "stage1_checkpoints.json").read_text())
    results = {p.parent.name: json.loads(p.read_text()) for p in root.glob("*/run_result.json")}
    print(f"sdft continual learning: stage 1 checkpoints {stage1}; runs {sorted(results)}")
    assert sorted(results) == ["stage1_sdft_topk_lr1e-03", "stage1_sft_lr1e-03", "stage2_sdft_topk_lr1e-03",
                               "stage2_sft_lr1e-03"]
    assert all(path and path.startswith("tinker://") for path in stage1.values())
    for run_id, result in results.items():
        assert result["checkpoint_path"].startswith("tinker://"), run_id
        assert len(metrics(result["log_path"])) == 2, run_id  # four rows in batches of two


@pytest.mark.extended
def test_sdft_benchmark_runs_every_phase(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes.sdft import benchmark as script
    from tinker_cookbook.recipes.sdft import eval as sdft_eval

    evaluator = sdft_eval.SciKnowEvalEvaluator
    monkeypatch.setattr(sdft_eval, "SciKnowEvalEvaluator",
                        lambda prompts, answers, renderer, max_tokens=2048, **kw:
                        evaluator(prompts, answers, renderer, max_tokens=min(max_tokens, EVAL_MAX_TOKENS), **kw))
    _science(tmp_path / "data", n=4)
    root = tmp_path / "bench"
    config = script.BenchmarkConfig(model_name=TINY, renderer_name=RENDERER, lora_rank=8, dataset="science",
                                    data_dir=str(tmp_path / "data"), phase="all", learning_rate=1e-3,
                                    groups_per_batch=2, max_tokens=16, max_steps=2, eval_every=0, save_every=0,
                                    sft_learning_rate=1e-3, sft_batch_size=2, sft_max_steps=2, log_root=str(root),
                                    base_url=cookbook)
    asyncio.run(script.cli_main(config))
    summary = json.loads((root / "benchmark_summary_science.json").read_text())
    print(f"sdft benchmark: {summary}")
    assert sorted(summary) == ["base", "sdft", "sft"]
    for phase in summary.values():
        assert phase["sciknoweval/num_total"] == 2.0
        assert 0.0 <= phase["sciknoweval/accuracy"] <= 1.0
