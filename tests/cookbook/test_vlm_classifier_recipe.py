"""The image classifier recipe (`recipes.vlm_classifier`), its own `train.run_experiment` unchanged
(its `ExperimentConfig`, its dataset builder, its sampling evaluator `eval.py`), against a tiny
Qwen3-VL built here and added by `quilt models add` on a stack of its own: images train through
`forward_backward` and are sampled by the trainer-side sampler (gen_pool.hf_engine). Replaced: only
the hub dataset load (`datasets.load_dataset`), by a synthetic one made here: shapes of three
colours with a white square or disc on them, the colour names the class. The base is named by its directory, so the cookbook's
`get_tokenizer` and `get_image_processor` read it from disk as they would a hub snapshot."""

from __future__ import annotations

import json
import random

import pytest
from PIL import Image, ImageDraw

from stack.ephemeral import ephemeral_stack, new_tenant
from stack.tiny_model import TINY_MODEL_NAME, TinyModelSpec, build_tiny_model

COLOURS = {"green": (20, 170, 40), "blue": (30, 40, 220), "black": (10, 10, 10)}  # one token each here
STEPS, EVAL_EVERY = 24, 23  # 24 images in batches of 8, 8 epochs; evaluated before the first and the last step


def _shapes(per_class: int, seed: int):
    """A split of `per_class` images a class: the class's colour behind a white square or disc."""
    import datasets

    rng = random.Random(seed)
    images, labels = [], []
    for label, colour in enumerate(COLOURS.values()):
        for _ in range(per_class):
            img = Image.new("RGB", (64, 64), colour)
            size, x, y = rng.randint(12, 28), rng.randint(4, 32), rng.randint(4, 32)
            draw = getattr(ImageDraw.Draw(img), rng.choice(["rectangle", "ellipse"]))
            draw((x, y, x + size, y + size), fill=(255, 255, 255))
            images.append(img)
            labels.append(label)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(COLOURS))})
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


@pytest.mark.extended
@pytest.mark.timeout(1200)  # its own stack starts first (minutes on a loaded machine)
def test_vlm_classifier_learns_shapes_colours(tmp_path_factory, monkeypatch):
    import datasets
    from tinker_cookbook.recipes.vlm_classifier import train

    path = build_tiny_model(tmp_path_factory.mktemp("vlm") / "m",
                            spec=TinyModelSpec(architecture="qwen3_vl", num_layers=2)).path
    synthetic = datasets.DatasetDict({"train": _shapes(8, 1), "test": _shapes(4, 2)})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: synthetic)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    setup = [["models", "add", path, "--path", path, "--renderer", "chatml"], ["models", "remove", TINY_MODEL_NAME]]
    with ephemeral_stack({"QUILT_TRAINER_SEQ_GAP_DEADLINE_S": "20"}, setup=setup) as stack:
        _, key = new_tenant(stack, "vlm")
        monkeypatch.setenv("TINKER_API_KEY", key)
        out = tmp_path_factory.mktemp("exp")
        train.run_experiment(train.ExperimentConfig(
            experiment_dir=str(out), model_name=path, renderer_name="qwen3_vl_instruct", base_url=stack.base_url,
            behavior_if_log_dir_exists="delete", learning_rate=1e-2, num_epochs=8, batch_size=8, lora_rank=16,
            save_every=0, eval_every=EVAL_EVERY, run_nll_evaluator=False, max_tokens=8, n_eval=9))
    rows = [json.loads(line) for f in out.rglob("metrics.jsonl") for line in f.read_text().splitlines()]
    accuracy = [(r["step"], r["accuracy"]) for r in rows if "accuracy" in r]  # eval.py's metric
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    print(f"vlm_classifier: accuracy {accuracy}; train NLL {nll[0]:.3f} -> {nll[-1]:.3f} in {len(nll)} steps")
    assert [s for s, _ in accuracy] == [0, EVAL_EVERY] and len(nll) == STEPS
    # chance among three classes is 1/3 (the untrained model names none of them)
    assert accuracy[-1][1] > 2 / 3 > accuracy[0][1], accuracy
