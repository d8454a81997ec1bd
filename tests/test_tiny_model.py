"""The tiny base model: it must load offline through the Auto classes, be deterministic, be
buildable idempotently and safely, suit vLLM's CPU backend, and take LoRA on every projection."""

from __future__ import annotations

import json
import os

# Before anything imports transformers: no test may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

from stack import tiny_model
from stack.tiny_model import (
    REQUIRED_FILES,
    TINY_MODEL_NAME,
    VLLM_CPU_HEAD_DIMS,
    TinyModelInfo,
    TinyModelSpec,
    build_tiny_model,
    read_model_info,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> TinyModelInfo:
    # One build shared by the read-only tests keeps the module fast.
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def model(built):
    m = transformers.AutoModelForCausalLM.from_pretrained(built.path)
    m.eval()
    return m


@pytest.fixture(scope="module")
def tokenizer(built):
    return transformers.AutoTokenizer.from_pretrained(built.path)


def _config(info: TinyModelInfo) -> dict:
    with open(os.path.join(info.path, "config.json")) as f:
        return json.load(f)


def test_build_writes_a_complete_hf_directory(built):
    for name in REQUIRED_FILES:
        assert os.path.isfile(os.path.join(built.path, name)), name
    config = _config(built)
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert built.name == TINY_MODEL_NAME
    assert built.max_context_length == TinyModelSpec().max_position_embeddings
    # No temp directories are left beside the model.
    assert os.listdir(os.path.dirname(built.path)) == ["model"]


def test_loads_offline_with_auto_classes(model, tokenizer, built):
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == built.eos_token_id
    for special in ("<|im_start|>", "<|im_end|>"):
        # Special tokens are single tokens, never split into bytes.
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1


def test_tokenizer_round_trips(tokenizer):
    text = "Alice has 12 cats, and 12+7=19! The model will train the adapter.\n  héllo ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # Merges were learned: common words are far fewer tokens than bytes.
    assert len(tokenizer.encode("the answer is", add_special_tokens=False)) <= 4


def test_vocab_sizes_and_special_ids_agree(built, model, tokenizer):
    config = _config(built)
    assert len(tokenizer) == config["vocab_size"] == built.vocab_size == TinyModelSpec().vocab_size
    assert model.get_input_embeddings().weight.shape[0] == built.vocab_size
    assert model.lm_head.weight.shape[0] == built.vocab_size
    assert config["eos_token_id"] == config["pad_token_id"] == config["bos_token_id"]
    assert config["eos_token_id"] == tokenizer.eos_token_id
    with open(os.path.join(built.path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == tokenizer.eos_token_id


def test_head_dim_is_vllm_compatible(built):
    assert _config(built)["head_dim"] in VLLM_CPU_HEAD_DIMS


@pytest.mark.parametrize(
    "bad",
    [
        {"head_dim": 48},
        {"num_attention_heads": 4, "num_key_value_heads": 3},
        {"vocab_size": 100},
        {"hidden_size": 0},
        {"initializer_range": 0.0},
    ],
)
def test_invalid_spec_is_refused_before_building(tmp_path, bad):
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "m", spec=TinyModelSpec(**bad))
    assert not (tmp_path / "m").exists()


def test_forward_gives_logits_of_the_right_shape(model, tokenizer, built):
    ids = torch.tensor([tokenizer.encode("the cat ran to the river", add_special_tokens=False)] * 2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, ids.shape[1], built.vocab_size)
    assert torch.isfinite(logits).all()


def test_num_parameters_matches_the_weights(built, model):
    assert built.num_parameters == sum(p.numel() for p in model.parameters())
    assert read_model_info(built.path) == built


def test_same_seed_builds_identical_models(tmp_path, built):
    from safetensors.torch import load_file

    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    key = "model.layers.0.self_attn.q_proj.weight"
    w0 = load_file(os.path.join(built.path, "model.safetensors"))
    w_again = load_file(os.path.join(again.path, "model.safetensors"))
    w_other = load_file(os.path.join(other.path, "model.safetensors"))
    assert w0.keys() == w_again.keys()
    assert all(torch.equal(w0[k], w_again[k]) for k in w0)
    assert not torch.equal(w0[key], w_other[key])

    def tokenizer_json(info):
        with open(os.path.join(info.path, "tokenizer.json"), "rb") as f:
            return f.read()

    assert tokenizer_json(again) == tokenizer_json(built)
    # The tokenizer does not depend on the weight seed: ids mean the same across models.
    assert tokenizer_json(other) == tokenizer_json(built)


def test_building_does_not_disturb_the_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_second_build_reuses_the_existing_model(tmp_path, monkeypatch):
    out = tmp_path / "m"
    first = build_tiny_model(out, seed=0)
    mtimes = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}

    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt an already complete model")

    monkeypatch.setattr(tiny_model, "_build_into", must_not_build)
    second = build_tiny_model(out, seed=0)
    assert second == first
    assert {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)} == mtimes
    # Asking for a different model at the same path is an error, not a silent reuse.
    with pytest.raises(ValueError, match="built with"):
        build_tiny_model(out, seed=1)


def test_crash_during_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def half_build(dest, **kwargs):
        (dest / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(tiny_model, "_build_into", half_build)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_tiny_model(tmp_path / "m")
    assert os.listdir(tmp_path) == []


def test_refuses_to_overwrite_an_unrelated_directory(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model(out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_builds_into_an_existing_empty_directory(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    info = build_tiny_model(out)
    assert os.path.isfile(out / "model.safetensors")
    assert info.path == str(out)


def test_lora_attaches_to_every_projection_and_backprops(built, tokenizer):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    base = transformers.AutoModelForCausalLM.from_pretrained(built.path)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    lora_params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert lora_params and all("lora_" in n for n in lora_params)
    for target in targets:
        assert any(f"{target}.lora_A" in n for n in lora_params), target

    ids = torch.tensor([tokenizer.encode("12+7=19 and the dog ran", add_special_tokens=False)])
    # lora_B starts at zero, so the first step's gradient reaches lora_B of every module.
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in lora_params.items():
        if "lora_B" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
