"""DeepSeek-V3 (and Kimi-K2, its layout): multi-head latent attention, shared experts, dense first
layers, routed experts (bases.architectures, batcher.engine.expert_lora), checked on a tiny random
model against transformers' own forward of the weights with the exported adapter merged in
(checkpoints.adapter_merge, the download path), in float64; and the published sizes of the real
models (bases.memory_plan sizes them for `quilt models plan`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bases import architectures, memory_plan, model_sources
from batcher.engine.backend import LoraBackend
from batcher.engine.expert_lora import route_in_float64
from batcher.engine.protocol import PassRequest
from checkpoints import adapter_merge
from core.errors import InvalidInput
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from stack.tiny_model import TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
ROWS = {"all": tuple(range(7, 40)), "attention": tuple(range(100, 121)), "mlp": tuple(range(300, 309))}

# The published configs' shapes (DeepSeek-V3.1 has V3's; Kimi-K2's config.json says model_type
# "kimi_k2" for this same layout).
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
               "tie_word_embeddings": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
KIMI_K2 = {**DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
           "n_routed_experts": 384, "first_k_dense_replace": 1, "max_position_embeddings": 131072}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    spec = TinyModelSpec(architecture="deepseek_v3", num_layers=3, first_k_dense_replace=1)
    return Path(build_tiny_model(tmp_path_factory.mktemp("dsv3") / "base", spec=spec).path)


def test_quilt_models_add_describes_the_directory(base):
    local, source = model_sources.locate(path=base)
    entry = model_sources.describe("acme/deepseek-mini", local, source, renderer="chatml")
    total, active = architectures.parameter_counts(entry.config)
    assert entry.architecture == "deepseek_v3"
    # counted from the config (latent attention, shared experts, the dense layer) as the weights hold them
    assert entry.num_parameters == total and entry.active_parameters == active < total


def test_the_tiny_bases_score_correction_bias_changes_which_experts_are_chosen(base):
    """The tiny build randomises each router's score-correction bias (transformers starts it at zero), so
    the tests here follow biased routing: for some tokens the biased top-k differs from the scores' own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64, experts_implementation="eager").eval()
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(routers) == 2 and all(r.e_score_correction_bias.abs().min() > 0 for r in routers)
    assert route_in_float64(model) == 2
    x = model.get_input_embeddings()(torch.arange(5, 200).unsqueeze(0))[0]
    for router in routers:
        _logits, _weights, chosen = router(x)
        unbiased = torch.nn.functional.linear(x, router.weight.double()).sigmoid().topk(router.top_k, dim=-1)[1]
        assert (chosen.sort(dim=-1)[0] != unbiased.sort(dim=-1)[0]).any(dim=-1).sum() > 0


def _datum(tokens: tuple[int, ...]) -> Datum:
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": (1.0,) * (len(tokens) - 1)})


def _pass(be: LoraBackend, model_ids, *, forward_only=False) -> list[dict]:
    out = be.run_pass([PassRequest(f"r{m}", m, PassWork("cross_entropy", LossConfig(), (_datum(ROWS[m]),)),
                                   forward_only) for m in model_ids])
    assert all(isinstance(o, dict) for o in out), out
    return out


def _reference(model, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


def test_trained_adapters_score_as_transformers_does_with_them_merged(base, tmp_path):
    from transformers import AutoModelForCausalLM

    be = LoraBackend(base, dtype=torch.float64)
    be.create("all", LoraShape(rank=4, seed=1, train_unembed=False))
    be.create("attention", LoraShape(rank=8, seed=2, train_mlp=False, train_unembed=False))
    be.create("mlp", LoraShape(rank=2, seed=3, train_attn=False, train_unembed=False))
    for _ in range(2):  # fused: three tenants' rows packed in one pass
        _pass(be, list(ROWS))
        for m in ROWS:
            be.optim_step(m, AdamParams(**ADAM))
    state = be.adapter_state("all")
    layers = {k.split(".")[-3] for k in state}
    assert layers == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("kv_b_proj" in k or "lm_head" in k for k in state)
    assert any(".mlp.shared_experts." in k for k in state) and any(".layers.0.mlp.gate_proj" in k for k in state)
    assert all(state[k].abs().sum() > 0 for k in state if "lora_B" in k)  # every one trained

    fused = _pass(be, list(ROWS), forward_only=True)
    reference = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64, experts_implementation="eager")
    # transformers routes in float32 on any dtype; the trainer's float64 base routes in float64
    # (batcher.engine.expert_lora.route_in_float64 says why), and so does the reference
    assert route_in_float64(reference.eval()) == 2
    for i, m in enumerate(ROWS):
        be.save(m, str(tmp_path / m), overwrite=False, with_optimizer=False)
        config = json.loads((tmp_path / m / "adapter_config.json").read_text())
        assert set(config["target_modules"]) <= set(architectures.MLA_MODULES + architectures.MLP_MODULES)
        merged = _merged(reference, tmp_path / m, config)
        with torch.nn.utils.stateless._reparametrize_module(reference, merged):
            logprobs = _reference(reference, ROWS[m])
        # the row's loss, summed in float64, and each token's logprob (reported in float32)
        assert fused[i]["metrics"]["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-9, abs=1e-9)
        ours = torch.tensor(fused[i]["loss_fn_outputs"][0]["logprobs"]["data"], dtype=torch.float64)
        torch.testing.assert_close(ours, logprobs.float().double(), rtol=0, atol=1e-6)
        # and the adapter moved them: the base scores otherwise
        assert (_reference(reference, ROWS[m]) - logprobs).abs().max() > 1e-3
        # the download path's merge (in the base's float32) scores the same, to float32's precision
        adapter_merge.write_merged(base, tmp_path / m, tmp_path / f"{m}-merged")
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{m}-merged"), dtype=torch.float64,
                                                     experts_implementation="eager").eval()
        route_in_float64(model)
        torch.testing.assert_close(_reference(model, ROWS[m]), logprobs, rtol=0, atol=1e-5)


def _merged(model, adapter: Path, config: dict) -> dict[str, torch.Tensor]:
    """The model's weights with the PEFT adapter added in float64 (W + alpha / r * B @ A), read from
    the exported files alone: each expert's LoRA into its rows of the fused experts' parameters."""
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    params = dict(model.named_parameters())
    merged: dict[str, torch.Tensor] = {}
    for key, A in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        delta = scale * tensors[key.replace("lora_A", "lora_B")].double() @ A.double()
        block, _, proj = module.rpartition(".")
        if ".mlp.experts." in module:  # <block>.experts.<e>.<proj>: rows of gate_up_proj or down_proj
            experts, _, e = block.rpartition(".")
            name = f"{experts}.down_proj" if proj == "down_proj" else f"{experts}.gate_up_proj"
            weight = merged.get(name, params[name]).clone()
            rows = slice(None) if proj == "down_proj" else \
                slice(0, delta.shape[0]) if proj == "gate_proj" else slice(delta.shape[0], None)
            weight[int(e)][rows] += delta
            merged[name] = weight
        else:
            merged[f"{module}.weight"] = params[f"{module}.weight"] + delta
    return merged


@pytest.mark.parametrize("change, field", [
    ({"q_lora_rank": None}, "config.q_lora_rank"),  # DeepSeek-V2-Lite's single q_proj
    ({"scoring_func": "softmax"}, "config.scoring_func"),  # vLLM would route otherwise than transformers
    ({"topk_method": None}, "config.scoring_func"),
])
def test_layouts_the_trainer_and_sampler_would_run_differently_are_refused_naming_the_field(change, field):
    with pytest.raises(InvalidInput) as exc:
        architectures.of_config({**DEEPSEEK_V3, **change})
    assert exc.value.field == field


def test_kimi_k2_s_own_model_type_is_refused_saying_what_to_do():
    with pytest.raises(InvalidInput, match='set model_type to "deepseek_v3"') as exc:
        architectures.of_config({**KIMI_K2, "model_type": "kimi_k2"})
    assert exc.value.field == "config.model_type"


@pytest.mark.parametrize("config, total, active", [
    (DEEPSEEK_V3, 671e9, 37e9),  # "671B total parameters, 37B activated for each token"
    (KIMI_K2, 1.0e12, 32e9),  # "32 billion activated parameters and 1 trillion total parameters"
])
def test_parameter_counts_match_the_published_sizes(config, total, active):
    counted, counted_active = architectures.parameter_counts(config)
    assert abs(counted - total) / total < 0.03 and abs(counted_active - active) / active < 0.03, (counted, counted_active)


def test_the_plan_sizes_deepseek_v3_and_its_latent_kv_cache():
    shape = architectures.Shape.of(DEEPSEEK_V3)
    assert shape.kv_width == 512 + 64 and shape.moe_layers == 58 and shape.shared_intermediate == 2048
    plan = memory_plan.plan_memory(DEEPSEEK_V3, memory_plan.PlanInputs(device_bytes=141 * memory_plan.GiB))
    assert plan.base_bytes == architectures.parameter_counts(DEEPSEEK_V3)[0] * 2
    assert plan.kv_bytes_per_token == 61 * 576 * 2  # the latent, not 128 heads' keys and values
    assert plan.problems  # 1.3 TB of bfloat16 weights on one 141 GiB GPU: refused, naming why
    # the latent is on every GPU of a tensor-parallel sampler: its KV per token does not shrink
    split = memory_plan.plan_memory(DEEPSEEK_V3, memory_plan.PlanInputs(device_bytes=141 * memory_plan.GiB,
                                                                        sampler_ranks=8))
    assert split.kv_bytes_per_token == plan.kv_bytes_per_token
    # one rank-32 adapter on every target: the latent projections, the dense and shared MLPs, each expert
    targets = list(architectures.of_config(DEEPSEEK_V3).targets(tied=False))
    latent = 61 * 32 * ((7168 + 1536) + (1536 + 128 * 192) + (7168 + 576) + (128 * 128 + 7168))
    dense = 3 * 32 * 3 * (7168 + 18432) + 58 * 32 * 3 * (7168 + 2048)
    experts = 58 * 256 * 32 * 3 * (7168 + 2048)
    assert architectures.lora_parameters(DEEPSEEK_V3, 32, targets) == latent + dense + experts
