"""gpt-oss on a tiny random-weight instance: attention sinks, alternating sliding-window and full
attention, biased router and experts, LoRA on the fused 3-D expert weights.

The references share none of the trainer's code: transformers' own forward (its eager attention with
sinks and its own sliding-window masks, its own experts) over weights with the adapter merged in by
`checkpoints.adapter_merge`, and PEFT loading the exported adapter onto the base. Float64, so the
comparisons test masks, sinks, routing and layout, not rounding. The tiny model's window (8 tokens)
is shorter than every row here, so its sliding layers' masks matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bases import architectures, memory_plan
from batcher.engine import layout
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from checkpoints import adapter_merge
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from stack.tiny_model import GPT_OSS_TINY_WINDOW, TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
ROWS = {"experts": (7, 40), "attention": (100, 30), "wide": (300, 21)}  # model -> (first token, length)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny gpt-oss, saved in float64 so that its merged weights are not rounded to float32."""
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(architecture="gpt_oss", num_experts=8, num_experts_per_tok=2)
    built = Path(build_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "base", spec=spec).path)
    wide = built.parent / "float64"
    AutoModelForCausalLM.from_pretrained(str(built), dtype=torch.float64).save_pretrained(wide)
    return wide


def _datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def _pass(be: LoraBackend, models, *, forward_only=False) -> list[dict]:
    out = be.run_pass([PassRequest(f"r{m}", m, PassWork("cross_entropy", LossConfig(), (_datum(*ROWS[m]),)),
                                   forward_only) for m in models])
    assert all(isinstance(o, dict) for o in out), out
    return out


def _trained(base: Path) -> LoraBackend:
    """Three tenants in one fused step (experts and attention; attention only; a wider rank), two
    AdamW steps, so every B, the experts' included, is no longer zero."""
    be = LoraBackend(base, dtype=torch.float64)
    be.create("experts", LoraShape(rank=4, seed=1, train_unembed=False))
    be.create("attention", LoraShape(rank=4, seed=2, train_mlp=False, train_unembed=False))
    be.create("wide", LoraShape(rank=8, seed=3, train_unembed=False))
    for _ in range(2):
        _pass(be, list(ROWS))
        for m in ROWS:
            be.optim_step(m, AdamParams(**ADAM))
    return be


def _reference_logprobs(model, start: int, n: int) -> torch.Tensor:
    toks = torch.arange(start, start + n + 1)
    with torch.no_grad():
        logits = model(input_ids=toks[:-1].unsqueeze(0)).logits[0]
    return torch.log_softmax(logits, dim=-1).gather(1, toks[1:].unsqueeze(1)).squeeze(1)


def test_the_trainer_scores_as_transformers_does_the_merged_weights_and_peft_the_export(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(path):  # transformers' own eager attention (sinks, masks) and experts
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager",
                                                    experts_implementation="eager").eval()

    be = _trained(base)
    state = be.adapter_state("experts")
    experts = [k for k in state if ".mlp.experts." in k]
    # PEFT's target_parameters names (gate_up nested inside down), the B of every layer's experts trained
    config = json.loads((base / "config.json").read_text())
    layers, E = config["num_hidden_layers"], config["num_local_experts"]
    assert sorted(experts) == sorted(f"base_model.model.model.layers.{i}.mlp.experts{w}.lora_{m}.weight"
                                     for i in range(layers) for w in (".base_layer", "") for m in "AB")
    gate_up_a = state["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"]
    assert tuple(gate_up_a.shape) == (E * 4, config["hidden_size"])
    assert all(state[k].abs().sum() > 0 for k in experts if "lora_B" in k)

    be.save("experts", str(tmp_path / "adapter"), overwrite=False, with_optimizer=False)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == sorted(architectures.ATTN_MODULES)
    assert saved["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    adapter_merge.write_merged(base, tmp_path / "adapter", tmp_path / "merged")
    merged = load(tmp_path / "merged")
    peft = PeftModel.from_pretrained(load(base), str(tmp_path / "adapter")).eval()
    out = _pass(be, list(ROWS), forward_only=True)[0]  # scored beside the other tenants, as in training
    ours = torch.tensor(out["loss_fn_outputs"][0]["logprobs"]["data"], dtype=torch.float64)
    for name, reference in (("peft", peft), ("merged", merged)):
        want = _reference_logprobs(reference, *ROWS["experts"])
        # float64 throughout: the loss (a float64 sum) to 1e-9; each token's logprob as the wire's float32
        assert abs(out["metrics"]["loss:sum"] + float(want.sum())) < 1e-9, (name, out["metrics"]["loss:sum"], -want.sum())
        torch.testing.assert_close(ours, want.float().double(), rtol=0, atol=1e-6, msg=name)
    # the adapter moved the logprobs by far more than the tolerance
    assert (ours - _reference_logprobs(load(base), *ROWS["experts"])).abs().max() > 1e-3


def test_packed_rows_of_several_tenants_equal_the_models_own_masks_row_by_row(base, monkeypatch):
    """Rows from three tenants packed into one stream (each longer than the window) score and train
    as right-padded rows under transformers' own sliding-window and causal masks: no row sees another."""
    results = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(layout, "can_pack", lambda config, longest: False)
        be = LoraBackend(base, dtype=torch.float64)
        for i, m in enumerate(ROWS):
            be.create(m, LoraShape(rank=4, seed=i, train_unembed=False))
        outs = _pass(be, list(ROWS))
        results[packed] = (outs, {m: [p.grad.clone() for p in be.adapters[m].params] for m in ROWS}, be.last_pass)
    (p_outs, p_grads, p_stats), (d_outs, d_grads, d_stats) = results[True], results[False]
    assert p_stats.padding_fraction == 0.0 < d_stats.padding_fraction
    assert min(n for _, n in ROWS.values()) > GPT_OSS_TINY_WINDOW
    for a, b in zip(p_outs, d_outs):
        torch.testing.assert_close(torch.tensor(a["loss_fn_outputs"][0]["logprobs"]["data"]),
                                   torch.tensor(b["loss_fn_outputs"][0]["logprobs"]["data"]), rtol=0, atol=1e-10)
    for m in ROWS:
        for ga, gb in zip(p_grads[m], d_grads[m]):
            torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-12)


# Published configs (the shapes, not the weights) and sizes: OpenAI's gpt-oss model card, table 1
# (total 20.91 B / 116.83 B; active per token 3.61 B / 5.13 B, the unembedding counted, the
# embedding not).
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
           "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 201088, "num_experts_per_tok": 4,
           "attention_bias": True, "tie_word_embeddings": False, "sliding_window": 128,
           "max_position_embeddings": 131072}
PUBLISHED = [  # (layers, experts, total, active, (trainer, sampler) 80 GiB GPUs in bfloat16)
    (24, 32, 20.91e9, 3.61e9, (1, 1)),
    (36, 128, 116.83e9, 5.13e9, (8, 4)),
]


@pytest.mark.parametrize("layers, experts, total, active, gpus", PUBLISHED)
def test_parameter_counts_match_the_published_gpt_oss_sizes(layers, experts, total, active, gpus):
    config = {**GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts}
    counted, counted_active = architectures.parameter_counts(config)
    assert abs(counted - total) / total < 1e-3, counted
    embedding = GPT_OSS["vocab_size"] * GPT_OSS["hidden_size"]
    assert abs(counted_active - embedding - active) / active < 1e-3, counted_active
    # `quilt models plan` sizes it: how many GPUs its trainer and its sampler need
    assert memory_plan.fewest_ranks(config, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB)) == gpus


def test_both_packed_attention_paths_equal_transformers_eager_attention_row_by_row():
    """The per-row path and the captured pass's masked path, over two streams of three rows (one
    longer than the window), equal gpt-oss's own eager attention (sinks, its sliding mask) run on
    each row alone."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from batcher.engine import packed_attention as pa

    g = torch.Generator().manual_seed(0)
    B, H, KV, L, D, window = 2, 4, 2, 16, 8, 5
    q, k, v = (torch.randn(B, n, L, D, generator=g, dtype=torch.float64) for n in (H, KV, KV))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    spans = ((0, 0, 9), (0, 9, 14), (1, 0, 16))  # (stream, start, end); stream 0 ends in 2 tokens of padding
    cu = pa.boundaries([0, 9, 16], [9, 5, 16], B, L)
    segments = torch.tensor(pa.segments_of(cu, B * L))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=H // KV, training=False)
    outs = {}
    for name, rows in (("rows", pa.Rows(spans, L)), ("masked", pa.Rows(spans, L, segments=segments))):
        pa._current = rows
        try:
            outs[name] = pa._attention(module, q, k, v, None, scaling=D ** -0.5, sliding_window=window, s_aux=sinks)[0]
        finally:
            pa._current = None
    for b, s, e in spans:
        n = e - s
        i = torch.arange(n)
        seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~seen, float("-inf"))
        want, _ = eager_attention_forward(module, q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                          mask, scaling=D ** -0.5)
        for name, got in outs.items():
            torch.testing.assert_close(got[b, s:e], want[0], rtol=0, atol=1e-12, msg=name)


def _sink_case(dtype=torch.float64):
    """Two streams of packed rows, shorter and longer than the window (5), GQA heads, random sinks."""
    from batcher.engine import packed_attention as pa

    g = torch.Generator().manual_seed(1)
    B, H, KV, L, D, window = 2, 4, 2, 16, 8, 5
    q, k, v = (torch.randn(B, n, L, D, generator=g, dtype=dtype).requires_grad_() for n in (H, KV, KV))
    sinks = torch.randn(H, generator=g, dtype=dtype).requires_grad_()
    spans = ((0, 0, 3), (0, 3, 12), (0, 12, 14), (1, 0, 16))  # lengths 3, 9, 2, 16; stream 0 ends in padding
    cu = pa.boundaries([0, 3, 12, 16], [3, 9, 2, 16], B, L)
    return q, k, v, sinks, spans, torch.tensor(pa.segments_of(cu, B * L)), window, D


@pytest.mark.parametrize("path", ["rows", "masked"])
def test_sink_attention_equals_transformers_eager_attention_in_output_and_every_gradient(path):
    """The log-sum-exp form of sinks (the CPU flash kernel's output scaled by sigmoid(lse - sink)),
    on the per-row and the captured pass's masked path, equals gpt-oss's own eager attention (sinks,
    its sliding mask) run on each row alone: outputs, and gradients w.r.t. queries, keys, values and
    sinks, in float64 to 1e-12, over rows shorter and longer than the window."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from batcher.engine import packed_attention as pa

    q, k, v, sinks, spans, segments, window, D = _sink_case()
    weights = torch.randn(q.shape[0], q.shape[2], q.shape[1], D, generator=torch.Generator().manual_seed(2),
                          dtype=q.dtype)  # an arbitrary loss over the read positions
    pa._current = pa.Rows(spans, q.shape[2], segments=segments if path == "masked" else None)
    try:
        got = pa._attention(SimpleNamespace(), q, k, v, None, scaling=D ** -0.5, sliding_window=window, s_aux=sinks)[0]
    finally:
        pa._current = None
    read = torch.zeros_like(got, dtype=torch.bool)
    for b, s, e in spans:
        read[b, s:e] = True
    got_grads = torch.autograd.grad((got * weights * read).sum(), (q, k, v, sinks))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    want_loss = 0
    for b, s, e in spans:
        i = torch.arange(e - s)
        seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        mask = torch.zeros(e - s, e - s, dtype=q.dtype).masked_fill(~seen, float("-inf"))
        want, _ = eager_attention_forward(module, q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                          mask, scaling=D ** -0.5)
        torch.testing.assert_close(got[b, s:e], want[0], rtol=0, atol=1e-12)
        want_loss = want_loss + (want[0] * weights[b, s:e]).sum()
    want_grads = torch.autograd.grad(want_loss, (q, k, v, sinks))
    for name, g_, w_ in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g_, w_, rtol=0, atol=1e-12, msg=name)
    torch.testing.assert_close(got_grads[3], want_grads[3], rtol=0, atol=1e-12, msg="sinks")


@pytest.mark.parametrize("path", ["rows", "masked"])
def test_sink_attention_keeps_no_score_matrix_for_the_backward(path):
    """What autograd keeps for the backward of a sink layer is per token (queries, keys, values,
    output, log-sum-exp, gate) plus one head-less mask: nothing of heads x L x L, which for a
    4,096-token row of gpt-oss-20b would be 2 GiB per layer."""
    from types import SimpleNamespace

    from batcher.engine import packed_attention as pa

    g = torch.Generator().manual_seed(3)
    H, KV, L, D, window = 4, 2, 64, 4, 5
    q, k, v = (torch.randn(1, n, L, D, generator=g, dtype=torch.float64).requires_grad_() for n in (H, KV, KV))
    sinks = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
    spans = ((0, 0, 40), (0, 40, 64))
    segments = torch.tensor(pa.segments_of(pa.boundaries([0, 40], [40, 24], 1, L), L))
    saved: list[int] = []
    pa._current = pa.Rows(spans, L, segments=segments if path == "masked" else None)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            pa._attention(SimpleNamespace(), q, k, v, None, scaling=D ** -0.5, sliding_window=window, s_aux=sinks)
    finally:
        pa._current = None
    # the longest row's scores alone would be H x 40 x 40 = 6,400 values; q is 1,024, the mask L x L = 4,096
    assert saved and max(saved) <= max(q.numel(), L * L) < H * 40 * 40, saved


@pytest.mark.parametrize("ranks, parallel, per_layer", [
    (1, "tp", 64 * 8),   # 64 heads, a float32 log-sum-exp and gate each
    (2, "tp", 32 * 8),   # a tensor-parallel rank holds half the heads
    (4, "ep", 64 * 8),   # an expert-parallel rank computes every head of every token (attention whole)
    (2, "fsdp", 64 * 8),  # an FSDP rank computes every head of its tokens
])
def test_the_plan_counts_the_sinks_per_token_and_head(ranks, parallel, per_layer, monkeypatch):
    """gpt-oss's sink layers keep two float32 values per token and head for the backward (and no
    score matrix): the plan's activations per token carry exactly that per layer."""
    config = {**GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32}  # gpt-oss-20b
    inputs = memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB, trainer_ranks=ranks, trainer_parallel=parallel)
    with_sinks = memory_plan.plan_memory(config, inputs).activation_bytes_per_token
    monkeypatch.setattr(memory_plan, "SINK_BYTES_PER_HEAD", 0)
    without = memory_plan.plan_memory(config, inputs).activation_bytes_per_token
    assert with_sinks - without == 24 * per_layer


@pytest.mark.parametrize("model_type", sorted(t for t, a in architectures.SUPPORTED.items() if a.moe and not a.vision))
def test_the_expert_parallel_plan_names_each_moe_architectures_modules(model_type, tmp_path):
    """The plan an expert-parallel gang loads with (batcher.engine.gang.expert_plan) names what the
    causal LM has (transformers refuses a plan key that matches nothing): its MoE blocks' experts,
    whose weights split by expert (every weight the architecture's own expert-parallel plan splits),
    and its attention's rules, kept whole; its routers are left as they are."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    from batcher.engine import gang
    from stack.tiny_model import _config

    config = _config(TinyModelSpec(architecture=model_type, num_layers=2), vocab_size=512, eos_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()))
    names = {replace_layer_number_by_wildcard(n) for n, _ in [*model.named_modules(), *model.named_parameters()]}
    config.save_pretrained(tmp_path)
    plan = gang.expert_plan(str(tmp_path))
    assert set(plan) <= names, sorted(set(plan) - names)
    experts = {k for k, v in plan.items() if v == "moe_tp_experts"}
    assert experts and all(hasattr(model.get_submodule(n), "gate_up_proj") for n, _ in model.named_modules()
                           if replace_layer_number_by_wildcard(n) in experts)
    assert {k for k, v in plan.items() if v == "grouped_gemm"} == {k for k, v in model.ep_plan.items() if v == "grouped_gemm"}
    assert {k for k, v in plan.items() if v == gang.REPLICATED} == {k for k in model.tp_plan if ".self_attn." in k}
    assert not any(".router" in k or k.endswith(".gate") for k in plan)


def _as_mxfp4(directory: Path) -> dict[str, torch.Tensor]:
    """Rewrite a tiny gpt-oss directory as OpenAI's checkpoints are: every expert weight as MXFP4
    blocks and scales (values from the FP4 table, scale 2^0 so they are exact), config.json's
    quantization_config saying so. Returns the experts' weights as transformers holds them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    tensors = load_file(directory / "model.safetensors")
    expected, gen = {}, torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, cols_out = tensors.pop(name).shape  # [E, in, out]
        idx = torch.randint(0, 16, (e, cols_out, rows_in), generator=gen, dtype=torch.uint8)  # stored [E, out, in]
        expected[name] = lut[idx.long()].transpose(1, 2).contiguous()
        packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).reshape(e, cols_out, rows_in // 32, 16)
        tensors[name + "_blocks"] = packed
        tensors[name + "_scales"] = torch.full((e, cols_out, rows_in // 32), 127, dtype=torch.uint8)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return expected


def test_an_mxfp4_checkpoint_is_counted_whole_and_trained_dequantized(tmp_path):
    """OpenAI's gpt-oss checkpoints store the experts in MXFP4. Its parameters count as the published
    ones (two values a byte; the scales are no parameters), the plan says what the trainer holds, and
    the trainer loads the experts dequantized (their exact FP4 values) as the plain parameters expert
    LoRA runs, and trains them."""
    from bases import model_sources

    spec = TinyModelSpec(architecture="gpt_oss", num_experts=4, num_experts_per_tok=2, num_layers=2)
    path = Path(build_tiny_model(tmp_path / "base", spec=spec).path)
    plain = model_sources.weights_parameters(path)
    expected = _as_mxfp4(path)
    config = json.loads((path / "config.json").read_text())
    assert model_sources.weights_parameters(path) == plain == architectures.parameter_counts(config)[0]
    assert architectures.checkpoint_quantization(config) == "mxfp4"
    assert "MXFP4 experts dequantized" in architectures.loaded_as(config, "bfloat16")
    assert architectures.loaded_as({"model_type": "gpt_oss"}, "bfloat16") == "bfloat16"

    be = LoraBackend(str(path), dtype=torch.float32)
    held = dict(be.base.named_parameters())
    for name, values in expected.items():
        torch.testing.assert_close(held[name], values, rtol=0, atol=0)
    be.create("m", LoraShape(rank=4, seed=1, train_unembed=False))
    out = be.run_pass([PassRequest("m", "m", PassWork("cross_entropy", LossConfig(), (_datum(7, 20),)), False)])
    assert isinstance(out[0], dict) and out[0]["metrics"]["loss:sum"] > 0, out
    assert any(".experts." in k for k in be.adapter_state("m"))
