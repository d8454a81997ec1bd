"""Qwen3.5's hybrid attention (gated-delta-rule layers beside full attention) in the fused pass.

The references share none of the trainer's code: transformers' own forward of each row alone (a
batch of one, no packing) over the weights with the exported PEFT adapter merged in
(checkpoints.adapter_merge), and PEFT's own LoraModel over the exported files. Float64 throughout;
the gated delta rule itself runs in float32 inside transformers' kernel on both sides, on the same
row's inputs, so the trainer matches it to float64 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bases import architectures
from batcher.engine import linear_attention, packed_attention
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from checkpoints import adapter_merge
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from stack.tiny_model import TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
# Rows of several lengths, one longer than the delta rule's 64-token chunk, so a row starts mid-chunk.
ROWS = (tuple(range(7, 20)), tuple(range(100, 181)), tuple(range(300, 309)))


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def hybrid(request, tmp_path_factory) -> Path:
    arch = request.param
    return Path(build_tiny_model(tmp_path_factory.mktemp(arch) / "base", spec=TinyModelSpec(architecture=arch)).path)


def _datum(tokens: tuple[int, ...]) -> Datum:
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": (1.0,) * (len(tokens) - 1)})


def _pass(be: LoraBackend, work: list[tuple[str, tuple[int, ...]]], *, forward_only=False) -> list[dict]:
    """One request per (model, row), all in one fused pass."""
    reqs = [PassRequest(f"r{i}", m, PassWork("cross_entropy", LossConfig(), (_datum(row),)), forward_only)
            for i, (m, row) in enumerate(work)]
    out = be.run_pass(reqs)
    assert all(isinstance(o, dict) for o in out), out
    return out


def _reference(model, row: tuple[int, ...]) -> torch.Tensor:
    """transformers' target logprobs of one row alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([row[:-1]])).logits[0]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(row[1:]).unsqueeze(1)).squeeze(1)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, experts_implementation="eager").eval()


def test_the_catalogue_targets_both_kinds_of_attention(hybrid):
    config = json.loads((hybrid / "config.json").read_text())
    assert linear_attention.uses_row_state(config)
    targets = architectures.lora_targets(config, {"train_mlp": False, "train_unembed": False})
    assert targets == list(architectures.ATTN_MODULES + architectures.LINEAR_ATTN_MODULES)
    # a multimodal checkpoint's config (its language model under text_config) says the same
    wrapped = {"model_type": config["model_type"].removesuffix("_text"), "text_config": config}
    assert architectures.lora_targets(wrapped, {}) == architectures.lora_targets(config, {})
    assert architectures.parameter_counts(wrapped) == architectures.parameter_counts(config)


def test_each_packed_row_starts_from_a_zero_state():
    """The two sequence kernels, swapped in, run each row of a packed stream as that row alone; the
    kernels as transformers has them, over the stream, carry the first row's state into the second."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    linear_attention.register()
    g = torch.Generator().manual_seed(0)
    L, spans = 40, ((0, 0, 11), (0, 11, 30), (1, 0, 25))  # stream 0: two rows and padding; stream 1: one
    x = torch.randn(2, 12, L, generator=g, dtype=torch.float64)
    weight = torch.randn(12, 4, generator=g, dtype=torch.float64)
    q, k = (torch.randn(2, L, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, L, 2, 16, generator=g, dtype=torch.float64)
    decay, beta = -torch.rand(2, L, 2, generator=g, dtype=torch.float64), torch.rand(2, L, 2, generator=g, dtype=torch.float64)
    # a packed pass's rows as the device pass sets them (the model here only holds a config)
    holder = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    with packed_attention.packed(holder, packed_attention.Rows(spans, L)):
        conv = m.causal_conv1d_fn(x, weight, None, activation="silu")
        rule, state = m.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    assert state is None
    original_conv, original_rule = m.causal_conv1d_fn.args[0], m.torch_chunk_gated_delta_rule.args[0]
    for b, s, e in spans:
        alone = original_conv(x[b:b + 1, :, s:e], weight, None, activation="silu")
        torch.testing.assert_close(conv[b:b + 1, :, s:e], alone, rtol=0, atol=0)
        alone_rule, _ = original_rule(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], g=decay[b:b + 1, s:e],
                                      beta=beta[b:b + 1, s:e], use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(rule[b:b + 1, s:e], alone_rule, rtol=0, atol=0)
    assert conv[0, :, 30:].abs().max() == 0 and rule[0, 30:].abs().max() == 0  # padding
    # outside a packed pass: transformers' own kernels, whose second row starts from the first's state
    whole_conv = m.causal_conv1d_fn(x, weight, None, activation="silu")
    whole_rule, _ = m.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(whole_conv[:, :, :11], conv[:, :, :11])
    assert (whole_conv[0, :, 11:14] - conv[0, :, 11:14]).abs().max() > 1e-3
    assert (whole_rule[0, 11:30] - rule[0, 11:30]).abs().max() > 1e-3


def test_the_trainer_scores_as_transformers_over_the_merged_weights(hybrid, tmp_path):
    """Three tenants trained together (all switches; attention only; MLP only), then scored in one
    fused pass whose rows pack into one stream: each row's logprobs are transformers' own forward of
    that row alone over the base with the adapter merged in, and PEFT's over the exported files."""
    be = LoraBackend(hybrid, dtype=torch.float64)
    be.create("all", LoraShape(rank=4, seed=1))
    be.create("attn", LoraShape(rank=8, seed=2, train_mlp=False, train_unembed=False))
    be.create("mlp", LoraShape(rank=2, seed=3, train_attn=False, train_unembed=False))
    for _ in range(2):
        _pass(be, [("all", ROWS[0]), ("attn", ROWS[1]), ("mlp", ROWS[2]), ("all", ROWS[1])])
        for m in ("all", "attn", "mlp"):
            be.optim_step(m, AdamParams(**ADAM))
    out = _pass(be, [("all", r) for r in ROWS] + [("attn", ROWS[0]), ("mlp", ROWS[1])], forward_only=True)
    assert be.last_pass is not None and be.last_pass.rows == 5 and be.last_pass.micro_batches == 1

    be.save("all", str(tmp_path / "adapter"), overwrite=False, with_optimizer=False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(architectures.LINEAR_ATTN_MODULES) <= set(config["target_modules"])
    exact, fresh = _load(_merged_float64(hybrid, tmp_path / "adapter", tmp_path / "exact")), _load(hybrid)
    adapter_merge.write_merged(hybrid, tmp_path / "adapter", tmp_path / "merged")  # the download's merge (float32)
    downloaded = _load(tmp_path / "merged")
    for i, row in enumerate(ROWS):
        reference = _reference(exact, row)
        # the loss is float64; the per-token outputs are float32 on the wire, as the download's weights are
        assert out[i]["metrics"]["loss:sum"] == pytest.approx(-float(reference.sum()), rel=1e-9, abs=1e-9), i
        ours = torch.tensor(out[i]["loss_fn_outputs"][0]["logprobs"]["data"], dtype=torch.float64)
        torch.testing.assert_close(ours, _reference(downloaded, row).float().double(), rtol=0, atol=1e-5)
        assert (_reference(fresh, row) - reference).abs().max() > 1e-3  # the adapter matters
    if "moe" not in hybrid.parent.name:  # (PEFT has no LoRA for fused experts)
        from peft import PeftModel

        peft = PeftModel.from_pretrained(_load(hybrid), str(tmp_path / "adapter")).eval()
        for i, row in enumerate(ROWS):
            assert out[i]["metrics"]["loss:sum"] == pytest.approx(-float(_reference(peft, row).sum()), rel=1e-9)


def _merged_float64(base: Path, adapter: Path, out: Path) -> Path:
    """The base with the exported adapter merged in, in float64 (W + scaling * B @ A from the files)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = {k: t.double() for k, t in load_file(str(base / "model.safetensors")).items()}
    factors = adapter_merge.lora_factors(adapter)
    for name, f in factors.items():
        assert f.a.dtype == torch.float64  # the trainer's float64 masters, exported as they are
        weights[name] = weights[name] + (f.b @ f.a) * f.scaling
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


# The language models of published Qwen3.5 checkpoints (their config.json's text_config)
QWEN3_5_27B = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
               "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
               "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "layer_types": _layer_types(64),
               "tie_word_embeddings": False}
QWEN3_5_35B_A3B = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
                   "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_conv_kernel_dim": 4, "layer_types": _layer_types(40), "num_experts": 256,
                   "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                   "tie_word_embeddings": False}


@pytest.mark.parametrize("config, total_b, active_b", [
    # published: 27 B and 35 B total, 3 B active, each with a vision tower of about 0.4 B beside the language model
    (QWEN3_5_27B, (26.5, 27.0), (26.5, 27.0)),
    (QWEN3_5_35B_A3B, (34.4, 35.0), (3.0, 3.6)),
    ({"model_type": "qwen3_5", "text_config": QWEN3_5_27B}, (26.5, 27.0), (26.5, 27.0)),
])
def test_parameter_counts_match_published_sizes(config, total_b, active_b):
    total, active = architectures.parameter_counts(config)
    assert total_b[0] * 1e9 < total < total_b[1] * 1e9 and active_b[0] * 1e9 < active < active_b[1] * 1e9


def test_counts_are_the_tiny_models_exactly(hybrid):
    """Base and adapter parameters from config.json alone equal what transformers and the trainer build."""
    from bases.model_sources import weights_parameters

    config = json.loads((hybrid / "config.json").read_text())
    assert architectures.parameter_counts(config)[0] == weights_parameters(hybrid)
    be = LoraBackend(hybrid)
    for switches in ({}, {"train_mlp": False}, {"train_attn": False, "train_unembed": False}):
        be.create("m", LoraShape(rank=4, seed=1, **switches))
        targets = architectures.lora_targets(config, switches)
        assert sum(t.numel() for t in be.adapter_state("m").values()) == architectures.lora_parameters(config, 4, targets)


def test_the_plan_sizes_the_kv_cache_of_the_full_attention_layers_only():
    from bases import memory_plan

    # the trainer and the sampler each on an 80 GiB GPU of their own
    plan = memory_plan.plan_memory(QWEN3_5_27B, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB,
                                                                       shared_device=False))
    assert not plan.problems, plan.problems
    assert plan.base_bytes == architectures.parameter_counts(QWEN3_5_27B)[0] * 2
    # 16 of the 64 layers keep keys and values: 16 x 2 x 4 heads x 256 x 2 bytes
    assert plan.kv_bytes_per_token == 16 * 2 * 4 * 256 * 2
    assert plan.max_sequences >= 4, plan.rows()
    small = memory_plan.plan_memory(QWEN3_5_27B, memory_plan.PlanInputs(device_bytes=48 * memory_plan.GiB,
                                                                        shared_device=False))
    assert small.problems and "base weights" in small.problems[0]


@pytest.mark.parametrize("config, graphed", [
    (QWEN3_5_27B, False),  # the trainer captures no graphs of a linear-attention base (batcher.engine.backend)
    (QWEN3_5_35B_A3B, False),
    ({"model_type": "qwen3_5", "text_config": QWEN3_5_27B}, False),
    ({**QWEN3_5_27B, "model_type": "qwen3", "layer_types": None}, True),  # the same sizes, full attention only
])
def test_the_plan_doubles_activations_for_cuda_graphs_only_where_the_trainer_captures_them(config, graphed):
    from bases import memory_plan

    eager, asked = (memory_plan.plan_memory(config, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB,
                                                                         shared_device=False, cuda_graphs=graphs))
                    for graphs in (False, True))
    assert asked.inputs.cuda_graphs is graphed
    tokens = asked.token_budget
    assert asked.activation_bytes(tokens) == eager.activation_bytes(tokens) * (2 if graphed else 1)
    assert (asked.token_budget < eager.token_budget) is graphed  # (budgets are rounded: not exactly half)
    worker = memory_plan.for_worker(config, device="cuda:0", dtype="bfloat16", configured_memory="80GiB",
                                    cuda_graphs=True)
    assert worker.inputs.cuda_graphs is graphed


def test_the_linear_attention_projections_share_one_shrink(hybrid):
    """in_proj_qkv, in_proj_z, in_proj_b and in_proj_a read one input (multilora.SHARED_INPUT): their A rows
    lie in one tensor and a pass shrinks it once per layer, scoring as a shrink per layer does."""
    from tests.test_shared_shrink import counting_shrinks

    config = json.loads((hybrid / "config.json").read_text())
    kinds = config["layer_types"]
    linear = kinds.index("linear_attention")
    trainers = [LoraBackend(hybrid, dtype=torch.float64, shared_shrinks=shared) for shared in (True, False)]
    counts, outs = [], []
    for be in trainers:
        be.create("m", LoraShape(rank=4, seed=1, train_mlp=False, train_unembed=False))
        with counting_shrinks() as calls:
            outs.append(_pass(be, [("m", ROWS[0]), ("m", ROWS[2])], forward_only=True))
        counts.append(len(calls))
    layers = trainers[0].lora.layers
    storages = {layers[f"model.layers.{linear}.linear_attn.{n}"].slabs[4].A.untyped_storage().data_ptr()
                for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    assert len(storages) == 1
    # shared: one shrink for the four in_proj and one for out_proj (q/k/v and o_proj on full attention); alone: five
    assert counts == [2 * len(kinds), 5 * kinds.count("linear_attention") + 4 * kinds.count("full_attention")]
    for a, b in zip(*outs):
        assert a["metrics"]["loss:sum"] == pytest.approx(b["metrics"]["loss:sum"], rel=1e-12)
        torch.testing.assert_close(torch.tensor(a["loss_fn_outputs"][0]["logprobs"]["data"]),
                                   torch.tensor(b["loss_fn_outputs"][0]["logprobs"]["data"]), rtol=0, atol=1e-12)
