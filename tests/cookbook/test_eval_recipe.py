"""The cookbook's in-loop evaluations (`tinker_cookbook/eval`) against the stack: the benchmark bridge
(`benchmark_evaluator.BenchmarkEvaluator` over the `gsm8k` benchmark) and the toy
`custom_evaluators.CustomEvaluator` with its own QA set and grader, both run by `supervised.train`
as its `evaluator_builders`, before the first step and after the training.

Replaced: the hub's `openai/gsm8k` by four local word problems in its columns (`datasets.load_dataset`
answers them). The training data is those problems' answers in the benchmark's own prompt form
(its recommended system prompt, `\\boxed{}`) and the custom evaluator's capitals, so both scores
must rise: the evaluators measure what the loop taught.
"""

from __future__ import annotations

import asyncio

import datasets
import pytest
from recipes import RENDERER, TINY, common, metrics, write_jsonl

GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 6 pens. How many pens are in 2 boxes?", "answer": "6 * 2 = 12\n#### 12"},
    {"question": "Sara had 10 coins and gave away 5. How many are left?", "answer": "10 - 5 = 5\n#### 5"},
    {"question": "Each of 3 cats has 4 legs. How many legs in all?", "answer": "3 * 4 = 12\n#### 12"},
]


def _score(rows: list[dict], suffix: str) -> list[float]:
    return [value for row in rows for key, value in row.items() if key.endswith(suffix)]


@pytest.mark.extended
def test_benchmark_and_custom_evaluators_measure_what_the_loop_teaches(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook import renderers
    from tinker_cookbook.eval import custom_evaluators as custom
    from tinker_cookbook.eval.benchmark_evaluator import BenchmarkEvaluator
    from tinker_cookbook.eval.benchmarks import REGISTRY, gsm8k  # noqa: F401 (importing gsm8k registers it)
    from tinker_cookbook.eval.benchmarks._common import build_messages
    from tinker_cookbook.supervised import train as sft
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    real_load = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path == "openai/gsm8k":
            return datasets.Dataset.from_list(GSM8K)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    system = REGISTRY["gsm8k"].recommended_system_prompt
    lessons = [build_messages(row["question"], system) + [
        {"role": "assistant", "content": f"\\boxed{{{row['answer'].split('####')[-1].strip()}}}"}] for row in GSM8K]
    lessons += [[{"role": "user", "content": qa["input"]}, {"role": "assistant", "content": f"{qa['output']}."}]
                for qa in custom.QA_DATASET]
    builder = FromConversationFileBuilder(
        file_path=write_jsonl(tmp_path / "lessons.jsonl", [{"messages": m} for m in lessons * 4]),
        common_config=common(batch_size=7))
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(TINY))
    steps = 16
    config = sft.Config(
        log_path=str(tmp_path / "run"), model_name=TINY, recipe_name="quilt_eval", renderer_name=RENDERER,
        dataset_builder=builder, learning_rate=5e-3, num_epochs=4, lora_rank=16, save_every=0,
        eval_every=steps - 1, base_url=cookbook,
        evaluator_builders=[
            lambda: BenchmarkEvaluator("gsm8k", renderer, max_examples=4, max_tokens=16, temperature=0.6),
            lambda: custom.CustomEvaluator(dataset=custom.QA_DATASET, grader_fn=custom.grader_fn,
                                           model_name=TINY, renderer_name=RENDERER)])
    asyncio.run(sft.main(config))
    rows = metrics(tmp_path / "run")
    gsm, qa = _score(rows, "eval/gsm8k/score"), _score(rows, "accuracy")
    examples = _score(rows, "eval/gsm8k/num_examples")
    print(f"eval: gsm8k score {gsm} (of {examples} problems), custom QA accuracy {qa}, "
          f"{len(_score(rows, 'train_mean_nll'))} steps")
    assert len(gsm) == len(qa) == 2 and examples == [4.0, 4.0]
    assert gsm[-1] >= gsm[0] + 0.5 and qa[-1] >= qa[0] + 0.5
