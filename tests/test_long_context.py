"""Long rows: each decoder layer checkpointed in a long micro-batch (batcher.engine.recompute), exact
against the pass that keeps every activation, and a 131,072-token row trained on the tiny base."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from bases import memory_plan
from batcher.engine import plan, recompute
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from stack.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path


def _datum(start: int, n: int) -> Datum:
    toks = tuple((start + i) % 1000 + 3 for i in range(n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": tuple(0.5 + 0.01 * i for i in range(n))})


def _rl_datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "logprobs": tuple(-1.0 - 0.01 * i for i in range(n)),
                             "advantages": tuple((-1.0) ** i for i in range(n))}, 0)


def _req(model_id: str, data: list[Datum], loss_fn: str = "cross_entropy") -> PassRequest:
    return PassRequest(model_id, model_id, PassWork(loss_fn, LossConfig(), tuple(data)), False)


@pytest.mark.parametrize("tokens, trains, threshold, expect", [
    (100, True, 0, False),  # 0: never
    (100, True, 101, False),
    (101, True, 101, True),
    (131072, True, 8192, True),
    (131072, False, 8192, False),  # forward only keeps no activations
    (1, True, 1, True),
])
def test_which_micro_batches_checkpoint(tokens, trains, threshold, expect):
    assert plan.checkpoints(tokens, trains, threshold) is expect


QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960, "tie_word_embeddings": False}
QWEN3_32B = {**QWEN3_8B, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64, "max_position_embeddings": 131072}


@pytest.mark.parametrize("config, tokens, gib, checkpoint_tokens, trainer_gpus", [
    (QWEN3_8B, 32768, 80, 8192, 1),
    (QWEN3_8B, 32768, 80, 0, None),  # 249 GiB of activations: no gang of the KV heads' 8 ranks holds them
    (QWEN3_8B, 131072, 80, 8192, 2),
    (QWEN3_8B, 131072, 141, 8192, 1),
    (QWEN3_8B, 262144, 141, 8192, 4),
    (QWEN3_32B, 32768, 80, 8192, 2),
    (QWEN3_32B, 131072, 80, 8192, None),  # every rank keeps every layer's input: 80 GiB of them alone
    (QWEN3_32B, 131072, 141, 8192, 8),
    (QWEN3_32B, 131072, 141, 0, None),
])
def test_the_plan_gives_the_gpus_a_long_row_needs(config, tokens, gib, checkpoint_tokens, trainer_gpus):
    inputs = memory_plan.PlanInputs(device_bytes=gib * memory_plan.GiB, shared_device=False, token_budget=tokens,
                                    resident_adapters=1, checkpoint_tokens=checkpoint_tokens)
    assert memory_plan.fewest_ranks(config, inputs)[0] == trainer_gpus
    plan = memory_plan.plan_memory(config, inputs)
    assert plan.checkpointed is (checkpoint_tokens > 0)
    assert plan.activation_bytes(2 * tokens) - plan.activation_bytes(tokens) == plan.activation_bytes_per_token * tokens


def test_a_derived_budget_counts_checkpointing_past_its_threshold():
    """Checkpointed passes keep about a fifteenth of the activations per token: where the budget they
    afford reaches the threshold, the derived budget is theirs, and the plan says so; a threshold
    past any budget (65,536 at most) changes nothing."""
    inputs = memory_plan.PlanInputs(device_bytes=141 * memory_plan.GiB, shared_device=False)
    plain = memory_plan.plan_memory(QWEN3_8B, inputs)
    low = memory_plan.plan_memory(QWEN3_8B, dataclasses.replace(inputs, checkpoint_tokens=65_537))
    assert (low.token_budget, low.checkpointed) == (plain.token_budget, False)
    ck = memory_plan.plan_memory(QWEN3_8B, dataclasses.replace(inputs, checkpoint_tokens=8192))
    assert ck.checkpointed and ck.token_budget > 4 * plain.token_budget
    assert not ck.problems
    assert ck.activation_bytes_per_token * 10 < plain.activation_bytes_per_token
    assert any("layers checkpointed" in v for _, v in ck.rows())


TENANTS = "abcdef"


def _pass(base_path, checkpoint_tokens: int, requests: list[PassRequest], *, emulate_graphs: bool = False):
    be = LoraBackend(base_path, dtype=torch.float64, checkpoint_tokens=checkpoint_tokens, head_chunk_tokens=16,
                     emulate_graphs=emulate_graphs)
    for i, m in enumerate(TENANTS):
        be.create(m, LoraShape(rank=4 + 4 * (i % 2), seed=i))
    out = be.run_pass(requests)
    grads = {m: [p.grad.clone() for p in be.adapters[m].params] for m in TENANTS}
    return out, grads, be


@pytest.mark.parametrize("emulate_graphs", [False, True])
def test_checkpointed_layers_give_the_same_gradients(base_path, emulate_graphs):
    """Six tenants (two ranks; every built-in loss: cross-entropy, PPO, top-K targets, importance
    sampling, CISPO, DRO) in one packed pass, float64, the head in chunks of 16 tokens: each layer
    checkpointed, the outputs and every adapter's gradient are the uncheckpointed pass's."""
    wide = Datum(tuple(range(5, 17)), {"target_tokens": tuple(range(24)), "weights": tuple(0.5 for _ in range(24))},
                 width=2)
    requests = [_req("a", [_datum(3, 40), _datum(30, 9)]), _req("b", [_rl_datum(9, 23)], "ppo"),
                _req("c", [wide]), _req("d", [_rl_datum(50, 31)], "importance_sampling"),
                _req("e", [_rl_datum(70, 12)], "cispo"), _req("f", [_rl_datum(90, 17)], "dro")]
    (out0, grads0, be0), (out1, grads1, be1) = (_pass(base_path, t, requests, emulate_graphs=emulate_graphs)
                                                for t in (0, 1))
    assert not be0.device_pass.decoder.layers[0].__dict__.get("forward")  # put back after the pass
    assert not be1.device_pass.decoder.layers[0].__dict__.get("forward")
    for a, b in zip(out0, out1):
        assert a["loss_fn_outputs"] == b["loss_fn_outputs"]
        assert a["metrics"] == b["metrics"]
    for m in TENANTS:
        assert any(g.abs().sum() > 0 for g in grads0[m])
        for ga, gb in zip(grads0[m], grads1[m]):
            torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


def test_checkpointed_layers_are_exact_on_a_moe_base_with_expert_lora(tmp_path):
    """The experts' routes and their LoRA replayed in the backward (batcher.engine.expert_lora):
    three tenants on a tiny Qwen3-MoE, float64, the same gradients either way."""
    from stack.tiny_model import TinyModelSpec

    spec = TinyModelSpec(architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2)
    path = build_tiny_model(tmp_path / "moe", spec=spec).path
    requests = [_req("a", [_datum(3, 30)]), _req("b", [_rl_datum(9, 21)], "ppo"), _req("c", [_datum(40, 17)])]
    grads = []
    for threshold in (0, 1):
        be = LoraBackend(path, dtype=torch.float64, checkpoint_tokens=threshold)
        for i, m in enumerate("abc"):
            be.create(m, LoraShape(rank=4, seed=i))
        be.run_pass(requests)
        grads.append({m: [p.grad.clone() for p in be.adapters[m].params] for m in "abc"})
    for m in "abc":
        for ga, gb in zip(grads[0][m], grads[1][m]):
            torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


LONG_ROW = 131_072


def _train_one_row(tmp_path, monkeypatch, tokens: int) -> None:
    """One row of `tokens` trained (a pass and an AdamW step) on the tiny base narrowed to one layer
    of one 32-wide head (the row's attention is a square in its length: minutes on two cores), each
    layer checkpointed as the trainer's default setting has it; the pass's memory stays linear."""
    import resource
    from pathlib import Path

    from core.settings import TrainerSettings
    from stack.tiny_model import TinyModelSpec

    spec = TinyModelSpec(num_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=32)
    path = build_tiny_model(tmp_path / "narrow", spec=spec).path
    default = TrainerSettings.model_fields["checkpoint_tokens"].default
    be = LoraBackend(path, max_tokens_per_pass=16384, pack_width=4096, head_chunk_tokens=4096,
                     checkpoint_tokens=default)
    be.create("a", LoraShape(rank=8, seed=0))
    replayable = []
    real = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: replayable.append(1) or real(*a, **k))
    ids = tuple((i * 7919) % 1000 + 3 for i in range(tokens + 1))
    datum = Datum(ids[:-1], {"target_tokens": ids[1:], "weights": (1.0,) * tokens})
    request = _req("a", [datum])
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

    # The process's own high-water mark (ru_maxrss) holds whatever earlier tests in it peaked at:
    # the pass's peak is watched while it runs instead.
    before, seen, done = rss(), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            seen[0] = max(seen[0], rss())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = be.run_pass([request])[0]
    finally:
        done.set()
        watcher.join()
    peak = max(seen[0], rss())
    assert len(replayable) == 1  # the row's one micro-batch, its one layer checkpointed
    assert out["loss_fn_outputs"][0]["logprobs"] is not None
    loss = out["metrics"]["loss:sum"]
    assert loss == loss and 0 < loss < float("inf")
    grads = [p.grad for p in be.adapters["a"].params]
    assert all(bool(torch.isfinite(g).all()) for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    # tens of KiB a token: the uncheckpointed tiny base keeps about 100 KiB a token per 4 layers
    assert peak - before < 96 * 1024 * tokens
    params = [p.detach().clone() for p in be.adapters["a"].params]
    (stepped,) = be.optim_steps([("a", AdamParams(learning_rate=1e-3, eps=1e-8, grad_clip_norm=1.0))])
    assert any(not torch.equal(a, p) for a, p in zip(params, be.adapters["a"].params))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the row's attention on two CPU cores: its forward took ten minutes here, the backward longer
def test_a_131072_token_row_trains_on_the_tiny_base(tmp_path, monkeypatch):
    _train_one_row(tmp_path, monkeypatch, LONG_ROW)


def test_a_row_past_the_threshold_trains_checkpointed(tmp_path, monkeypatch):
    """The long row's test at a length the fast tier affords."""
    _train_one_row(tmp_path, monkeypatch, 8192)


# The GPUs one row needs (docs/benchmarks/long_context.md's table): the fewest of a tensor-parallel
# gang on which the row trains beside one adapter, checkpointed past 8,192 tokens; None past any gang.
@pytest.mark.parametrize("config, gib, gpus", [
    (QWEN3_8B, 80, {32768: 1, 131072: 2, 262144: None}),
    (QWEN3_8B, 141, {32768: 1, 131072: 1, 262144: 4}),
    (QWEN3_32B, 80, {32768: 2, 131072: None, 262144: None}),
    (QWEN3_32B, 141, {32768: 1, 131072: 8, 262144: None}),
])
def test_the_gpus_each_context_needs(config, gib, gpus):
    inputs = memory_plan.PlanInputs(device_bytes=gib * memory_plan.GiB, shared_device=False, checkpoint_tokens=8192)
    assert {context: memory_plan.context_gpus(config, context, inputs) for context in gpus} == gpus


@pytest.mark.parametrize("config, gib, checkpoint_tokens", [
    (QWEN3_8B, 80, 8192), (QWEN3_8B, 80, 0), (QWEN3_8B, 141, 8192), (QWEN3_32B, 141, 8192), (QWEN3_32B, 141, 0),
])
def test_the_longest_row_is_the_last_that_fits(config, gib, checkpoint_tokens):
    inputs = memory_plan.PlanInputs(device_bytes=gib * memory_plan.GiB, shared_device=False,
                                    checkpoint_tokens=checkpoint_tokens)
    longest = memory_plan.longest_row(config, inputs)

    def fits(tokens):
        return not memory_plan.plan_memory(config, dataclasses.replace(inputs, token_budget=tokens,
                                                                       resident_adapters=1)).trainer_problems

    assert longest > 0 and fits(longest) and not fits(longest + 1), longest
    assert memory_plan.longest_row(QWEN3_32B, dataclasses.replace(inputs, device_bytes=80 * memory_plan.GiB)) == 0


@pytest.mark.parametrize("requested, base, standard, plan_longest, expect", [
    (None, 40960, 32768, None, 32768),  # not asked: the standard context
    (None, 4096, 32768, None, 4096),  # ... or the base's, if shorter
    (None, 40960, 0, None, 40960),  # standard 0: the base's own
    (None, 131072, 32768, 20000, 20000),  # never more than the plan trains
    (131072, 131072, 32768, None, 131072),  # asked: up to the base's
    (100000, 131072, 32768, 106828, 100000),
    (1, 4096, 32768, None, 1),
    (131073, 131072, 32768, None, "the base model's context length 131,072"),
    (120000, 131072, 32768, 106828, "longest row the trainer's memory plan can train on this base (106,828"),
    (10**9, 131072, 32768, 0, "limit of 1,"),
])
def test_a_models_context_is_bounded_by_the_base_and_the_plan(requested, base, standard, plan_longest, expect):
    from core.errors import InvalidInput

    def context():
        return memory_plan.model_context(requested, base_context=base, standard=standard, plan_longest=plan_longest)

    if isinstance(expect, int):
        assert context() == expect
        return
    with pytest.raises(InvalidInput) as exc:
        context()
    assert exc.value.field == "max_context_length"
    assert f"max_context_length: {requested:,} tokens exceed the limit of" in str(exc.value)
    assert expect in str(exc.value), str(exc.value)
