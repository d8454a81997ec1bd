"""`quilt models add` validation (bases.model_sources), the memory plan (bases.memory_plan) and
size-based prices, without services: every refusal names its field and the fix."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from bases import architectures, memory_plan, model_sources
from billing.pricing import size_rates
from core.errors import InvalidInput
from stack.tiny_model import TinyModelSpec, build_tiny_model

# Qwen3-8B's published config (the shape, not the weights).
QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {a: build_tiny_model(root / a, spec=TinyModelSpec(architecture=a)).path
            for a in ("qwen3", "llama", "qwen3_5_text", "qwen3_vl")}


def _copy(src: str, dest) -> str:
    shutil.copytree(src, dest)
    return str(dest)


def _describe(path: str, **kw):
    local, source = model_sources.locate(path=path)
    return model_sources.describe("m", local, source, **kw)


def test_a_valid_directory_is_described_from_its_files(built):
    base = _describe(built["llama"], renderer="chatml", dtype="bfloat16", max_context=1024)
    assert (base.architecture, base.dtype, base.max_context_length, base.source) == ("llama", "bfloat16", 1024, "path")
    assert base.tokenizer_id == base.path == built["llama"]
    assert base.num_parameters == base.active_parameters == architectures.parameter_counts(base.config)[0]
    with pytest.raises(InvalidInput) as exc:  # a dense base has no experts to keep LoRA off
        _describe(built["llama"], renderer="chatml", serving={"expert_lora": False})
    assert exc.value.field == "expert_lora" and "no experts" in exc.value.message


@pytest.mark.parametrize("mutate, field, words", [
    (lambda d: (d / "config.json").unlink(), "config", "no config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "config", "not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config", "not a JSON object"),
    (lambda d: _edit(d, model_type="gpt2"), "config.model_type", "'gpt2' is not supported"),
    (lambda d: _edit(d, model_type="qwen3\x00"), "config.model_type", "not supported"),
    (lambda d: _edit(d, hidden_size=-4), "config.hidden_size", "positive integer"),
    (lambda d: _edit(d, num_hidden_layers=2**80), "config.num_hidden_layers", "positive integer up to"),
    (lambda d: _edit(d, vocab_size=True), "config.vocab_size", "positive integer"),
    (lambda d: _edit(d, num_hidden_layers=3), "config", "transformers cannot load"),  # 4 layer_types
    (lambda d: (d / "model.safetensors").unlink(), "weights", "no .safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 16), "weights", "not a readable safetensors"),
    (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer", "cannot be loaded"),
    (lambda d: _edit(d, vocab_size=300), "tokenizer", "vocab_size is 300"),
])
def test_bad_directories_are_refused_naming_the_problem(built, tmp_path, mutate, field, words):
    d = tmp_path / "m"
    _copy(built["qwen3"], d)
    mutate(d)
    with pytest.raises(InvalidInput) as exc:
        _describe(str(d), renderer="chatml")
    assert exc.value.field == field and words in str(exc.value), exc.value


def _edit(d, **changes):
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))


def test_arguments_are_checked(built):
    with pytest.raises(InvalidInput, match="chat template") as exc:
        _describe(built["qwen3"])  # the tiny tokenizer has no chat template
    assert exc.value.field == "renderer"
    for kw, field in (({"renderer": "jinja2"}, "renderer"), ({"renderer": "chatml", "dtype": "float8"}, "dtype"),
                      ({"renderer": "chatml", "max_context": 10**9}, "max_context"),
                      ({"renderer": "chatml", "max_context": 0}, "max_context")):
        with pytest.raises(InvalidInput) as exc:
            _describe(built["qwen3"], **kw)
        assert exc.value.field == field, (kw, exc.value)
    local, source = model_sources.locate(path=built["qwen3"])
    for name in ("", "a b", "x" * 129, "nul\x00", "\ud800"):
        with pytest.raises(InvalidInput) as exc:
            model_sources.describe(name, local, source, renderer="chatml")
        assert exc.value.field == "name"
    for serving, field in (({"gen_memory_share": 1.5}, "gen_memory_share"), ({"max_lora_rank": 7}, "max_lora_rank"),
                           ({"max_loras": 1}, "max_loras"), ({"device": "cuda:0; rm -rf /"}, "device"),
                           ({"gen_device": ""}, "gen_device")):
        with pytest.raises(InvalidInput) as exc:
            _describe(built["qwen3"], renderer="chatml", serving=serving)
        assert exc.value.field == field, (serving, exc.value)
    with pytest.raises(InvalidInput, match="exactly one"):
        model_sources.locate(path=built["qwen3"], hub="Qwen/Qwen3-8B")
    with pytest.raises(InvalidInput) as exc:
        model_sources.locate(path="/nonexistent/model")
    assert exc.value.field == "path"


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_vl"])
def test_a_base_vllm_cannot_import_here_is_still_added_sampleable(built, arch):
    # The trainer-side sampler serves what vLLM cannot (bases.architectures.sampler_engine).
    assert _describe(built[arch], renderer="chatml").sampleable
    assert not _describe(built[arch], renderer="chatml", sampleable=False).sampleable


# (family, vision, linear attention), vLLM's vision models importable, QUILT_GEN_ENGINE -> engine or refusal
ENGINE_TABLE = [
    ("qwen3", False, False, False, "auto", "vllm"),
    ("qwen3", False, False, True, "auto", "vllm"),
    ("qwen3", False, False, False, "transformers", "transformers"),
    ("qwen3_5_text", False, True, False, "auto", "transformers"),
    ("qwen3_5_text", False, True, True, "auto", "vllm"),
    ("qwen3_5_text", False, True, False, "vllm", "vllm"),  # the operator's word: the worker then fails to start
    ("qwen3_vl", True, False, False, "auto", "transformers"),
    ("qwen3_vl", True, False, True, "auto", "transformers"),  # images reach only the trainer-side sampler
    ("qwen3_vl", True, False, True, "transformers", "transformers"),
    ("qwen3_vl", True, False, True, "vllm", "images"),
    ("qwen3", False, False, True, "sglang", "auto, vllm or transformers"),
]


@pytest.mark.parametrize(("family", "vision", "linear", "imports", "choice", "expected"), ENGINE_TABLE)
def test_which_engine_samples_a_base(family, vision, linear, imports, choice, expected):
    arch = architectures.Architecture(family, family, vision=vision, linear_attention=linear)
    if expected in ("vllm", "transformers"):
        assert architectures.sampler_engine(arch, vllm_vision_imports=imports, choice=choice) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            architectures.sampler_engine(arch, vllm_vision_imports=imports, choice=choice)


@pytest.mark.parametrize(("arch", "ranks", "refused"), [
    ("qwen3_vl", 2, True), ("qwen3_vl", 1, False), ("qwen3_5_text", 2, False), ("qwen3", 4, False),
])
def test_a_vision_base_is_refused_a_trainer_gang(built, arch, ranks, refused):
    # a gang loads the causal LM without its vision tower (batcher.engine.gang.check_shape says so too)
    kw = {"renderer": "chatml", "sampleable": False, "serving": {"trainer_ranks": ranks}}
    if refused:
        with pytest.raises(InvalidInput, match="--trainer-ranks") as exc:
            _describe(built[arch], **kw)
        assert exc.value.field == "trainer_ranks"
    else:
        assert _describe(built[arch], **kw).serving["trainer_ranks"] == ranks


def test_hub_models_come_from_the_hub_cache_offline(built, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InvalidInput, match="HF_HUB_OFFLINE") as exc:
        model_sources.locate(hub="quilt-test/tiny-llama")
    assert exc.value.field == "hub"
    # The cache's own layout: refs/<branch> names a snapshot directory of that commit.
    commit = "0" * 40
    repo = cache / "models--quilt-test--tiny-llama"
    _copy(built["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    local, source = model_sources.locate(hub="quilt-test/tiny-llama")
    assert local == str(repo / "snapshots" / commit)
    base = model_sources.describe("tiny-llama", local, source, renderer="chatml")
    assert (base.source, base.hub_id, base.tokenizer_id, base.architecture) == \
        ("hub", "quilt-test/tiny-llama", "quilt-test/tiny-llama", "llama")
    with pytest.raises(InvalidInput, match="not in the hub cache"):
        model_sources.locate(hub="quilt-test/tiny-llama", revision="v2")
    with pytest.raises(InvalidInput) as exc:
        model_sources.locate(hub="not a/valid//id")
    assert exc.value.field == "hub"


def test_parameter_counts_match_published_sizes():
    total, active = architectures.parameter_counts(QWEN3_8B)
    assert abs(total - 8_190_735_360) / 8_190_735_360 < 1e-3 and active == total
    total, active = architectures.parameter_counts(QWEN3_30B_A3B)
    assert abs(total - 30_532_122_624) / 30_532_122_624 < 1e-3  # Qwen3-30B-A3B: 30.5 B total
    assert 3.0e9 < active < 3.5e9  # 3.3 B active


# Qwen3-VL-8B's published config: Qwen3-8B's decoder under text_config beside its vision tower
QWEN3_VL_8B = {"model_type": "qwen3_vl", "tie_word_embeddings": False,
               "text_config": {**QWEN3_8B, "model_type": "qwen3_vl_text", "max_position_embeddings": 262144},
               "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                                 "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
                                 "temporal_patch_size": 2, "num_position_embeddings": 2304, "in_channels": 3,
                                 "deepstack_visual_indexes": [8, 16, 24]}}


def test_a_vision_bases_count_and_plan_hold_its_vision_tower():
    total, active = architectures.parameter_counts(QWEN3_VL_8B)
    assert abs(total - 8.77e9) / 8.77e9 < 1e-3 and active == total  # published: 8.77 B
    assert 0.55e9 < total - architectures.parameter_counts(QWEN3_8B)[0] < 0.6e9  # the vision tower: about 0.58 B
    plan = memory_plan.plan_memory(QWEN3_VL_8B, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB))
    assert plan.base_bytes == plan.sampler_base_bytes == total * 2


@pytest.mark.parametrize(("config", "ranks", "gib", "trainer_gpus"), [
    (QWEN3_VL_8B, 2, 80, 1),
    (QWEN3_VL_8B, 1, 16, None),  # a trainer gang would fit it, but a vision base trains in one process
    (QWEN3_8B, 1, 16, 2),
])
def test_a_vision_bases_plan_refuses_a_trainer_gang(config, ranks, gib, trainer_gpus):
    inputs = memory_plan.PlanInputs(device_bytes=gib * memory_plan.GiB, shared_device=False)
    gang = memory_plan.plan_memory(config, dataclasses.replace(inputs, trainer_ranks=2))
    refused = [p for p in gang.trainer_problems if p.startswith("trainer_ranks:")]
    assert bool(refused) is ("vision_config" in config), gang.trainer_problems
    assert memory_plan.fewest_ranks(config, dataclasses.replace(inputs, trainer_ranks=ranks))[0] == trainer_gpus


def test_memory_plan_fits_an_8b_on_80_gib_and_refuses_it_on_16():
    plan = memory_plan.plan_memory(QWEN3_8B, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB))
    assert not plan.problems, plan.problems
    assert plan.base_bytes == architectures.parameter_counts(QWEN3_8B)[0] * 2
    # No activation checkpointing: about 7.8 MiB per token, so the derived budget is modest.
    assert plan.resident_adapters >= 4 and plan.token_budget >= 1024 and plan.max_sequences >= 4, plan.rows()
    small = memory_plan.plan_memory(QWEN3_8B, memory_plan.PlanInputs(device_bytes=16 * memory_plan.GiB))
    assert small.problems and "base weights" in small.problems[0]
    with pytest.raises(InvalidInput) as exc:
        small.check()
    assert exc.value.field == "device"
    # A token budget past what is left names the setting to lower.
    big = memory_plan.plan_memory(QWEN3_8B, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB,
                                                                   token_budget=2_000_000))
    assert big.problems and big.problems[0].startswith("token_budget") and "QUILT_TRAINER_TOKEN_BUDGET" in big.problems[0]
    # Too small a sampler share leaves no KV cache.
    starved = memory_plan.plan_memory(QWEN3_8B, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB,
                                                                       gen_memory_share=0.2))
    assert any(p.startswith("gen_memory_share") for p in starved.problems), starved.problems


# Published shapes of two bases no single GPU trains.
LLAMA_70B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": False}
QWEN3_235B_A22B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                   "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                   "tie_word_embeddings": False}


@pytest.mark.parametrize("config,gib,extra,trainer,sampler", [
    (QWEN3_8B, 80, {}, 1, 1),
    (LLAMA_70B, 141, {}, 2, 2),
    (LLAMA_70B, 80, {}, 4, 4),
    # LoRA of rank 32 on all 128 experts of 94 layers is 6.5 B parameters (117 GB with its gradient
    # and AdamW state): over 4 ranks it does not fit beside the base; at rank 4 it does. Eight
    # ranks would split its 4 KV heads in halves. (Rank 8 fitted until the plan counted what
    # bench/gpu_dryrun.py measured on the meta device: the slabs' zero row, and each adapter's expert
    # rows gathered twice in bfloat16 by a pass, 2.4 GiB more per rank-8 adapter, 3.9 GiB for the row.)
    (QWEN3_235B_A22B, 141, {}, None, 8),
    (QWEN3_235B_A22B, 141, {"adapter_rank": 8}, None, 8),
    (QWEN3_235B_A22B, 141, {"adapter_rank": 4}, 4, 8),
    (QWEN3_235B_A22B, 141, {"expert_lora": False}, 4, 4),
    (QWEN3_235B_A22B, 80, {"expert_lora": False}, None, 8),
    # An expert-parallel gang keeps attention whole on every rank and dispatches the tokens to the
    # experts (batcher.engine.dispatch): its 4 KV heads no longer bound it, and rank-32 expert LoRA
    # fits on 8 GPUs of 141 GB (16 of 80 GB), and not on half as many.
    (QWEN3_235B_A22B, 141, {"trainer_parallel": "ep"}, 8, 8),
    (QWEN3_235B_A22B, 80, {"trainer_parallel": "ep"}, 16, 16),
])
def test_the_plan_says_how_many_gpus_a_base_needs(config, gib, extra, trainer, sampler):
    inputs = memory_plan.PlanInputs(device_bytes=gib * memory_plan.GiB, **extra)
    assert memory_plan.fewest_ranks(config, inputs) == (trainer, sampler)
    if trainer:
        plan = memory_plan.plan_memory(config, dataclasses.replace(inputs, shared_device=False, trainer_ranks=trainer,
                                                                   sampler_ranks=sampler))
        assert not plan.problems, plan.problems
        # one rank fewer does not fit (unless one is all it takes)
        if trainer > 1:
            fewer = memory_plan.plan_memory(config, dataclasses.replace(inputs, shared_device=False,
                                                                        trainer_ranks=trainer // 2))
            assert fewer.trainer_problems


def test_a_gang_rank_holds_its_share_of_the_layers_and_all_of_the_embeddings():
    """A tensor-parallel rank: its share of the layers and of the unembedding (its plan,
    "colwise_gather_output", splits the vocabulary), the input embeddings whole. An FSDP rank: its
    shard of the decoder, embeddings included, two layers gathered, the unembedding whole. (Until
    bench/gpu_dryrun.py built a rank's shard, the plan kept both embeddings whole on every rank.)"""
    def base(**kw) -> int:
        return memory_plan.plan_memory(LLAMA_70B, memory_plan.PlanInputs(device_bytes=141 * memory_plan.GiB,
                                                                         **kw)).base_bytes

    one = base()
    embedding = 128256 * 8192 * 2
    layers = one - 2 * embedding
    assert base(trainer_ranks=2) == layers // 2 + embedding + embedding // 2
    assert base(trainer_ranks=8, trainer_parallel="fsdp") == (one - embedding) // 8 + 2 * (layers // 80) + embedding


def test_an_expert_parallel_rank_holds_its_share_of_the_experts_and_all_of_attention():
    """An "ep" rank (batcher.engine.gang): 1/N of the routed experts and of the unembedding, all the rest."""
    def base(**kw) -> int:
        return memory_plan.plan_memory(QWEN3_235B_A22B, memory_plan.PlanInputs(device_bytes=141 * memory_plan.GiB,
                                                                               **kw)).base_bytes

    experts = 94 * 128 * 3 * 4096 * 1536 * 2
    head = 151936 * 4096 * 2
    assert architectures.routed_expert_parameters(QWEN3_235B_A22B) * 2 == experts
    assert base(trainer_ranks=8, trainer_parallel="ep") == base() - experts + experts // 8 - head + head // 8


def test_sizes_parse_and_nonsense_is_refused():
    assert memory_plan.parse_bytes("80GiB") == 80 * 2**30
    assert memory_plan.parse_bytes("24 GB") == 24 * 10**9
    assert memory_plan.parse_bytes("512MiB") == 512 * 2**20
    for bad in ("", "GiB", "-1GiB", "nanGiB", "1e400", "80 parsecs"):
        with pytest.raises(InvalidInput):
            memory_plan.parse_bytes(bad)


def test_prices_follow_size():
    assert size_rates(8_190_735_360, 8_190_735_360) == {"prefill": 195_000, "sample": 600_000, "train": 440_000}
    moe = size_rates(30_532_122_624, 3_300_000_000)
    dense_30b = size_rates(30_532_122_624, 30_532_122_624)
    assert moe["sample"] < dense_30b["sample"] / 3
    assert size_rates(3_000_000, 3_000_000) == {"prefill": 1000, "sample": 1000, "train": 1000}
    with pytest.raises(ValueError):
        size_rates(10, 20)


def test_the_sampler_refuses_a_kv_cache_too_small_for_one_sequence():
    kw = {"accelerator": False, "dtype": "auto", "gen_memory_share": 0.5, "max_loras": 8, "max_lora_rank": 64}
    # Qwen3-8B in float32 on CPU: 288 KiB of KV per token.
    assert not memory_plan.sampler_problems(QWEN3_8B, kv_cache_bytes=4 * memory_plan.GiB, max_context=8192, **kw)
    (problem,) = memory_plan.sampler_problems(QWEN3_8B, kv_cache_bytes=memory_plan.GiB, max_context=40960, **kw)
    assert problem.startswith("kv_cache_gib") and "QUILT_GEN_KV_CACHE_GIB" in problem
    on_gpu = {**kw, "accelerator": True, "gen_memory_share": 0.2}
    (problem,) = memory_plan.sampler_problems(QWEN3_8B, kv_cache_bytes=0, max_context=8192,
                                              device_memory=80 * memory_plan.GiB, **on_gpu)
    assert problem.startswith("gen_memory_share")


def test_per_base_settings_reach_that_bases_workers():
    from bases.catalog import BaseModel
    from stack.launcher import serving_env

    base = BaseModel("b", "/m", 10, 10, dtype="bfloat16",
                     serving={"device": "cuda:1", "gen_device": "2", "gen_memory_share": 0.4, "max_lora_rank": 32,
                              "max_loras": 4})
    trainer, gen = serving_env(base, {"QUILT_TRAINER_DEVICE": "cpu", "KEEP": "1"})
    assert trainer["QUILT_TRAINER_DEVICE"] == "cuda:1" and trainer["QUILT_TRAINER_MAX_RANK"] == "32"
    assert trainer["QUILT_TRAINER_DTYPE"] == gen["QUILT_GEN_DTYPE"] == "bfloat16"
    assert (gen["CUDA_VISIBLE_DEVICES"], gen["QUILT_GEN_GPU_MEMORY_SHARE"], gen["QUILT_GEN_MAX_LORAS"],
            gen["QUILT_GEN_MAX_LORA_RANK"]) == ("2", "0.4", "4", "32")
    assert trainer["KEEP"] == gen["KEEP"] == "1" and "QUILT_GEN_MAX_LORAS" not in trainer


def test_a_bases_gang_and_vllm_parallelism_reach_its_workers_and_its_trainer_command():
    from bases.catalog import BaseModel
    from stack.launcher import serving_env, trainer_command

    base = BaseModel("b", "/m", 10, 10, serving={"trainer_ranks": 4, "trainer_parallel": "ep", "tensor_parallel": 4,
                                                 "pipeline_parallel": 2, "expert_parallel": True,
                                                 "fully_sharded_loras": True, "expert_lora": False})
    trainer, gen = serving_env(base, {"QUILT_TRAINER_RANKS": "1"})
    assert trainer["QUILT_TRAINER_EXPERT_LORA"] == gen["QUILT_GEN_EXPERT_LORA"] == "False"
    from core.settings import GenPoolSettings, TrainerSettings

    assert not TrainerSettings(expert_lora=trainer["QUILT_TRAINER_EXPERT_LORA"]).expert_lora
    assert not GenPoolSettings(expert_lora=gen["QUILT_GEN_EXPERT_LORA"]).expert_lora
    assert (trainer["QUILT_TRAINER_RANKS"], trainer["QUILT_TRAINER_PARALLEL"]) == ("4", "ep")
    assert (gen["QUILT_GEN_TENSOR_PARALLEL"], gen["QUILT_GEN_PIPELINE_PARALLEL"], gen["QUILT_GEN_EXPERT_PARALLEL"],
            gen["QUILT_GEN_FULLY_SHARDED_LORAS"]) == ("4", "2", "True", "True")
    assert trainer_command("py", 1) == ["py", "-m", "batcher.main"]
    gang = trainer_command("py", int(trainer["QUILT_TRAINER_RANKS"]))
    assert gang[:3] == ["py", "-m", "torch.distributed.run"] and gang[gang.index("--nproc-per-node") + 1] == "4"
    assert gang[-2:] == ["-m", "batcher.main"]
    with pytest.raises(InvalidInput) as exc:
        model_sources._check_serving({"tensor_parallel": 0})
    assert exc.value.field == "tensor_parallel" and "[1, 64]" in exc.value.message


def test_expert_lora_is_planned_on_every_expert_and_split_over_the_ranks():
    targets = list(architectures.of_config(QWEN3_235B_A22B).targets(tied=False))
    dense = [t for t in targets if t not in architectures.EXPERT_MODULES]
    experts = architectures.lora_parameters(QWEN3_235B_A22B, 32, targets) - \
        architectures.lora_parameters(QWEN3_235B_A22B, 32, dense)
    assert experts == 94 * 128 * 3 * 32 * (4096 + 1536)  # gate, up and down of each expert
    # fp32 state, a bf16 compute copy, and what a pass gathers in bf16: every LoRA row once, the
    # experts' twice (measured by bench/gpu_dryrun.py)
    per_parameter = 4 * memory_plan.ADAPTER_STATE_COPIES + 2 + 2 * 2

    def adapter(**kw) -> int:
        return memory_plan.plan_memory(QWEN3_235B_A22B, memory_plan.PlanInputs(
            device_bytes=141 * memory_plan.GiB, **kw)).adapter_bytes

    without = adapter(expert_lora=False)
    assert adapter() - without == experts * per_parameter
    # (over a gang the dense LoRA splits too: compared with the same gang's)
    assert adapter(trainer_ranks=4) - adapter(trainer_ranks=4, expert_lora=False) == experts // 4 * per_parameter
