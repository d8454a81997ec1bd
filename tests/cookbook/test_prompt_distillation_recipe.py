"""Prompt distillation (`recipes.prompt_distillation`), both steps unchanged: `create_data` has a
teacher answer the recipe's sentences under an instruction, and `train` teaches a student the
answers without it. Replaced here: the instruction (the recipe's is 2,386 tokens in the tiny base's
tokenizer, past its 2,048-token context) by a short one of the same form, the hosted teacher
(`setup_clients` names a hosted model) by a sampler of the tiny base taught the answer's form with
`supervised.train`, and the recipe's 2,100 sentences by 45 of them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import tinker
import tinker_cookbook
from recipes import RENDERER, TINY, common, first_last, metrics, series, write_jsonl
from tinker_cookbook import checkpoint_utils, renderers
from tinker_cookbook.recipes.prompt_distillation import create_data
from tinker_cookbook.recipes.prompt_distillation import train as pd_train
from tinker_cookbook.supervised import train as sft
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

INSTRUCTION = ('Name the language of the text. Reply "Final Answer: xx" with xx one of ar, de, el, en, es, fr, ot.'
               '\n\nText to classify:\n{text}')
# multilingual.txt holds each sentence in XNLI's 15 languages, in this order.
XNLI = ["ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur", "vi", "zh"]
LABELS = {"ar": "ar", "de": "de", "el": "el", "en": "en", "es": "es", "fr": "fr"}
SENTENCES = 45


def _sentences() -> list[tuple[str, str]]:
    path = Path(tinker_cookbook.__file__).parent / "example_data" / "multilingual.txt"
    lines = path.read_text().splitlines()[:SENTENCES]
    return [(line.strip(), LABELS.get(XNLI[i % len(XNLI)], "ot")) for i, line in enumerate(lines)]


@pytest.mark.extended
def test_prompt_distillation_student_answers_without_the_instruction(cookbook, tmp_path, monkeypatch):
    sentences = _sentences()
    # The teacher: the instruction in context, answers in the recipe's form.
    lessons = [{"messages": [{"role": "user", "content": INSTRUCTION.format(text=s)},
                             {"role": "assistant", "content": f"Final Answer: {label}"}]} for s, label in sentences]
    teach = sft.Config(log_path=str(tmp_path / "teacher"), model_name=TINY, recipe_name="quilt_pd_teacher",
                       renderer_name=RENDERER,
                       dataset_builder=FromConversationFileBuilder(
                           file_path=write_jsonl(tmp_path / "lessons.jsonl", lessons), common_config=common(9)),
                       learning_rate=1e-2, num_epochs=10, lora_rank=16, save_every=0, eval_every=0, base_url=cookbook)
    asyncio.run(sft.main(teach))
    teacher_path = checkpoint_utils.get_last_checkpoint(str(tmp_path / "teacher"), "sampler_path").sampler_path

    # create_data, unchanged but for the instruction and the file it reads (a path relative to the
    # working directory).
    monkeypatch.setattr(create_data, "LANGUAGE_CLASSIFICATION_PROMPT", INSTRUCTION)
    data_dir = tmp_path / "cwd" / "tinker_cookbook" / "example_data"
    data_dir.mkdir(parents=True)
    (data_dir / "multilingual.txt").write_text("".join(s + "\n" for s, _ in sentences))
    monkeypatch.chdir(tmp_path / "cwd")
    tokenizer = get_tokenizer(TINY)
    with tinker.ServiceClient(base_url=cookbook) as service:
        teacher = service.create_sampling_client(model_path=teacher_path)
        out = tmp_path / "distilled.jsonl"
        asyncio.run(create_data.create_data_async(create_data.Config(output_file=str(out)), teacher, tokenizer,
                                                  renderers.get_renderer(RENDERER, tokenizer)))
    distilled = [json.loads(line) for line in out.read_text().splitlines()]
    answered = {row["messages"][0]["content"]: row["messages"][1]["content"] for row in distilled}
    agree = sum(answered.get(s) == label for s, label in sentences) / len(sentences)

    # The student: the teacher's answers, no instruction.
    pd_train.cli_main(pd_train.CLIConfig(
        file_path=str(out), log_path=str(tmp_path / "student"), model_name=TINY, renderer_name=RENDERER,
        learning_rate=1e-2, num_epochs=4, lora_rank=16, batch_size=9, max_length=256, save_every=0, eval_every=0,
        base_url=cookbook, behavior_if_log_dir_exists="delete"))
    first, last = first_last(series(metrics(tmp_path / "student"), "train_mean_nll"))
    print(f"prompt_distillation: teacher answered {len(distilled)}/{len(sentences)} in form "
          f"({agree:.0%} the language's label); student nll {first:.3f} -> {last:.3f}")
    # The tiny teacher keeps the form on some sentences only (23 to 39 of 45 over runs: its LoRA
    # starts from a fresh random init each run); the student must learn whatever it said.
    assert len(distilled) >= len(sentences) // 3
    assert last < 0.5 * first
