"""Captured passes (batcher.engine.graphs, batcher.engine.buckets): micro-batches padded to buckets and replayed.

On the CPU the capture is emulated: the first micro-batch of a bucket binds the step, and a replay
runs that same step again over the static inputs refilled with another micro-batch's bundle. That is
what a CUDA graph does, less the kernels' addresses: a result that depended on anything of the first
micro-batch but its static inputs (a host-side run, a length, a loss size) would come out wrong here
as it would on the GPU. The GPU half (a real capture, no synchronisation, graph against eager) is
the CUDA test at the end and `bench/fused_step.py --graphs` in bench/gpu_suite.sh.
"""

from __future__ import annotations

import pytest
import torch

from batcher.engine import buckets, layout, losses, packed_attention
from batcher.engine.backend import LoraBackend
from core.loss_spec import LossConfig
from core.work import AdamParams, LoraShape
from stack.tiny_model import build_tiny_model
from tests.test_fused_step import ADAM, _datum, _req, _rl_datum, watch_device_work


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path


# --- the buckets, as tables -------------------------------------------------------------------------


@pytest.mark.parametrize("n, align, cap, expect", [
    (1, 1, 0, 64), (64, 1, 0, 64), (65, 1, 0, 96), (97, 1, 0, 128), (129, 1, 0, 192), (200, 1, 0, 256),
    (257, 1, 0, 384), (513, 1, 0, 768), (3000, 1, 0, 3072), (3073, 1, 0, 4096), (5000, 1, 0, 6144),
    (3500, 8, 4096, 4096),  # the ladder's 4096 is within the cap
    (5000, 1, 4096, 6144),  # a row longer than the budget goes alone, bucketed as ever
    (4000, 8, 4000, 4000),  # never past the budget where the stream is within it
    (4001, 8, 4001, 4008),  # aligned
])
def test_a_stream_pads_to_at_most_half_again_its_width(n, align, cap, expect):
    assert buckets.width(n, align=align, cap=cap) == expect
    assert expect >= n and (expect <= 1.5 * max(n, 64) or expect == buckets.round_up(n, align))


@pytest.mark.parametrize("fn, n, expect", [
    (buckets.runs, 1, 4), (buckets.runs, 5, 8), (buckets.runs, 9, 16),
    (buckets.datums, 7, 8), (buckets.datums, 8, 16),  # always one more than the pass has
    (buckets.requests, 1, 8), (buckets.requests, 9, 16), (buckets.boundaries, 17, 32),
])
def test_counts_go_up_by_powers_of_two(fn, n, expect):
    assert fn(n) == expect


def test_a_bucketed_layout_keeps_each_row_where_it_was_in_its_stream():
    lay = layout.micro_batches([30, 20, 25], ["a", "a", "b"], budget=1000, pack=True, pack_width=60)[0]
    assert (lay.starts, lay.streams, lay.width) == ((0, 20, 60), 2, 60)
    got = buckets.layout(lay, cap=1000)
    assert (got.starts, got.streams, got.width) == ((0, 20, 64), 2, 64)
    assert buckets.layout(lay, cap=100).streams == 2  # 2 streams of 64 > 100 tokens: no padding streams either
    three = layout.micro_batches([50, 50, 50], ["a", "b", "c"], budget=1000, pack=True, pack_width=50)[0]
    assert buckets.layout(three, cap=1000).streams == 4 and buckets.layout(three, cap=200).streams == 3
    padded = layout.micro_batches([3, 5], ["a", "b"], budget=100, pack=False, pack_width=64)[0]
    assert buckets.layout(padded) == padded


@pytest.mark.parametrize("kw, expect", [
    ({}, ""),
    ({"enabled": False}, "off"),
    ({"device": "cpu"}, "not a CUDA device"),
    ({"gang": 2}, "gang"),
    ({"packed": False}, "padded rows"),
    ({"experts": True}, "expert LoRA"),
    ({"grouped": False}, "grouped GEMM"),
    ({"varlen": False}, "variable-length attention"),
])
def test_which_passes_run_eagerly(kw, expect):
    args = {"device": "cuda", "enabled": True, "gang": 1, "packed": True, "experts": False, "grouped": True,
            "varlen": True, **kw}
    why = buckets.refusal(**args)
    assert (expect in why and why) if expect else why == ""


# --- the pieces that read no host data ---------------------------------------------------------------


def test_a_padded_loss_plan_computes_what_the_datums_alone_do():
    specs = [losses.DatumSpec("cross_entropy", {"weights": torch.tensor([1.0, 0.5, 2.0])}, 3, 1, LossConfig()),
             losses.DatumSpec("ppo", {"logprobs": torch.tensor([-1.0, -2.0]), "advantages": torch.tensor([1.0, -1.0])},
                              2, 1, LossConfig()),
             losses.DatumSpec("dro", {"logprobs": torch.tensor([-0.5]), "advantages": torch.tensor([2.0])}, 1, 1,
                              LossConfig())]
    lp = torch.tensor([[-0.3], [-1.2], [-2.0], [-0.9], [-2.5], [-0.4]], dtype=torch.float64)
    plain = losses.LossPlan.build(specs)
    padded = losses.LossPlan.build(specs, pad=(9, 8))
    assert padded.size == 8 and padded.tensors.inputs.weights.shape == (9, 1)
    assert all(padded.tensors.at[fn].shape == (9,) for fn in padded.fns)
    lp_padded = torch.cat([lp, torch.full((3, 1), -0.7, dtype=torch.float64)]).requires_grad_()
    lp = lp.clone().requires_grad_()
    a, b = losses.pass_losses(lp, plain, plain.tensors), losses.pass_losses(lp_padded, padded, padded.tensors)
    assert torch.equal(a.loss, b.loss[:3]) and torch.equal(b.loss[3:], torch.zeros(5, dtype=torch.float64))
    assert torch.equal(a.elementwise, b.elementwise[:6]) and torch.equal(a.kl, b.kl[:3])
    a.loss.sum().backward()
    b.loss.sum().backward()
    assert torch.equal(lp.grad, lp_padded.grad[:6]) and not lp_padded.grad[6:].any()
    with pytest.raises(ValueError, match="no padding position"):
        losses.LossPlan.build(specs, pad=(6, 8))


def test_masked_attention_over_segments_is_each_rows_own_causal_attention():
    torch.manual_seed(0)
    spans = ((0, 0, 5), (0, 5, 12), (1, 0, 9))  # (stream, start, end); the rest of each stream is padding
    L, H = 16, 4
    q, k, v = (torch.randn(2, H, L, 8, dtype=torch.float64) for _ in range(3))
    cu = packed_attention.boundaries([0, 5, 16], [5, 7, 9], 2, L)
    segments = torch.tensor(packed_attention.segments_of(cu, 2 * L))
    outs = []
    for rows in (packed_attention.Rows(spans, L), packed_attention.Rows(spans, L, segments=segments)):
        packed_attention._current = rows
        try:
            outs.append(packed_attention._attention(None, q, k, v, None)[0])
        finally:
            packed_attention._current = None
    per_row, masked = outs
    for b, s, e in spans:
        torch.testing.assert_close(masked[b, s:e], per_row[b, s:e], rtol=1e-12, atol=1e-12)


# --- the backend through its buckets -------------------------------------------------------------------


def _trainer(path, **kw) -> LoraBackend:
    be = LoraBackend(path, **kw)
    for i in range(4):
        be.create(f"m{i}", LoraShape(rank=8, seed=i, train_unembed=i != 3))
    return be


# Three passes of one bucket (a 64-token grid, 4 tenants, 2 loss functions, a forward-only request)
# whose rows, lengths and adapters all differ.
PASSES = [
    [_req("m0", [_datum(3, 12), _datum(40, 5)]), _req("m1", [_rl_datum(9, 20)], "ppo"),
     _req("m2", [_datum(50, 20)], forward_only=True), _req("m3", [_datum(70, 4)])],
    [_req("m2", [_datum(7, 30)]), _req("m1", [_rl_datum(5, 10), _rl_datum(15, 12)], "ppo"),
     _req("m3", [_datum(60, 9)], forward_only=True), _req("m0", [_datum(1, 2)])],
    [_req("m3", [_datum(1, 14), _datum(20, 14)]), _req("m0", [_rl_datum(2, 21)], "ppo"),
     _req("m1", [_datum(30, 6)], forward_only=True), _req("m2", [_datum(11, 3)])],
]


def _outcome(be: LoraBackend, requests) -> tuple[list, dict]:
    outs = be.run_pass(requests)
    assert all(isinstance(o, dict) for o in outs), outs
    grads = {m: [None if p.grad is None else p.grad.clone() for p in a.params] for m, a in be.adapters.items()}
    for a in be.adapters.values():
        be.lora.clear_grads(a.name)
    return outs, grads


def _logprobs(outs) -> list[list[float]]:
    return [d["logprobs"]["data"] for o in outs for d in o["loss_fn_outputs"]]


def test_a_replay_computes_its_own_micro_batch_and_nothing_of_the_first(base_path):
    """Passes 2 and 3 replay the step that pass 1 bound: each equals, bit for bit, a trainer whose
    first pass of the bucket was that very pass (so nothing of pass 1 leaked into them), and the
    eager trainer's result to float32 rounding (grouped GEMM and a masked attention over the bucket
    instead of batched matmuls and per-row attention over the rows)."""
    graphed, eager = _trainer(base_path, emulate_graphs=True), _trainer(base_path)
    results = [_outcome(graphed, p) for p in PASSES]
    assert graphed.graphs.counts["warm"] == 1 and graphed.graphs.counts["replayed"] == 2
    assert graphed.last_pass.padded_tokens == 64
    for i, requests in enumerate(PASSES):
        fresh = _trainer(base_path, emulate_graphs=True)
        outs, grads = _outcome(fresh, requests)
        assert fresh.graphs.counts["warm"] == 1
        assert _logprobs(outs) == _logprobs(results[i][0])
        assert [o["metrics"] for o in outs] == [o["metrics"] for o in results[i][0]]
        for m in grads:
            for g, h in zip(grads[m], results[i][1][m]):
                assert (g is None and h is None) or torch.equal(g, h)
        outs, grads = _outcome(eager, requests)
        for a, b in zip(_logprobs(outs), _logprobs(results[i][0])):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
        for m in grads:
            for g, h in zip(grads[m], results[i][1][m]):
                assert (g is None) == (h is None)
                if g is not None:
                    torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-4 * g.abs().max().item() + 1e-7)


def test_training_from_replays_follows_the_eager_trainer(base_path):
    """Three steps of 4 models on the same rows, several micro-batches a pass (the second and third
    steps replay them), optimizer steps between: the weights follow the eager trainer's."""
    graphed = _trainer(base_path, emulate_graphs=True, max_tokens_per_pass=40)
    eager = _trainer(base_path, max_tokens_per_pass=40)
    for _step in range(3):
        for be in (graphed, eager):
            outs = be.run_pass(PASSES[0])
            assert all(isinstance(o, dict) for o in outs), outs
            for m in ("m0", "m1", "m2", "m3"):
                be.optim_step(m, AdamParams(**ADAM))
        assert graphed.last_pass.micro_batches > 1
    assert graphed.graphs.counts["replayed"] == 2 * graphed.graphs.counts["warm"] > 0
    for m in graphed.adapters:
        for p, q in zip(graphed.adapters[m].params, eager.adapters[m].params):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_a_replay_reads_nothing_back(base_path, monkeypatch):
    be = _trainer(base_path, emulate_graphs=True)
    be.run_pass(PASSES[0])
    seen = watch_device_work(monkeypatch)
    be.run_pass(PASSES[1])
    assert be.graphs.counts["replayed"] == 1
    assert dict(seen) == {}, f"the replay synchronised: {dict(seen)}"


def test_an_overflowing_request_in_a_replay_leaves_its_neighbours_exact(base_path):
    from core.work import Datum

    bad = Datum(tuple(range(5, 15)), {"target_tokens": tuple(range(6, 16)), "logprobs": (-3e38,) * 10,
                                      "advantages": (1.0,) * 10})
    good = [_req("m0", [_datum(3, 12)]), _req("m1", [_datum(30, 9)])]
    graphed = _trainer(base_path, emulate_graphs=True)
    _outcome(graphed, good + [_req("m2", [_datum(50, 10)], "importance_sampling")])  # warms the bucket
    outs = graphed.run_pass(good + [_req("m2", [bad], "importance_sampling")])
    assert graphed.graphs.counts["replayed"] == 1
    assert "not finite" in outs[2].message and all(isinstance(o, dict) for o in outs[:2])
    assert all(p.grad is None for p in graphed.adapters["m2"].params)
    fresh = _trainer(base_path, emulate_graphs=True)
    fresh.run_pass(good + [_req("m2", [_datum(50, 10)], "importance_sampling")])
    for m in ("m0", "m1"):
        for p, q in zip(graphed.adapters[m].params, fresh.adapters[m].params):
            assert torch.isfinite(p.grad).all() and torch.equal(p.grad, q.grad)


def test_moving_slabs_drop_every_graph(base_path):
    """A slab that grows moves: the graphs captured over the old one are dropped, and the next pass
    warms a new one with the new adapter in it."""
    be = _trainer(base_path, emulate_graphs=True)
    _outcome(be, PASSES[0])
    _outcome(be, PASSES[1])
    assert be.graphs.counts["replayed"] == 1
    be.create("m4", LoraShape(rank=8, seed=9))  # a fifth slot: the rank-8 slabs double
    outs, _ = _outcome(be, PASSES[2][:3] + [_req("m4", [_datum(11, 3)])])
    assert be.graphs.counts["dropped"] == 1 and be.graphs.counts["warm"] == 2
    eager = _trainer(base_path)
    eager.create("m4", LoraShape(rank=8, seed=9))
    ref, _ = _outcome(eager, PASSES[2][:3] + [_req("m4", [_datum(11, 3)])])
    for a, b in zip(_logprobs(outs), _logprobs(ref)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def test_passes_that_cannot_be_captured_run_as_ever(base_path, tmp_path):
    f64 = _trainer(base_path, emulate_graphs=True, dtype=torch.float64)  # no grouped GEMM in float64
    f64.run_pass(PASSES[0])
    off = _trainer(base_path, emulate_graphs=True, cuda_graphs=False)
    off.run_pass(PASSES[0])
    assert f64.graphs.counts["warm"] == off.graphs.counts["warm"] == 0
    assert off.last_pass.padded_tokens == f64.last_pass.padded_tokens == off.last_pass.tokens  # no bucket


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_suite.sh runs it)")
def test_a_captured_pass_on_a_gpu_replays_what_the_eager_pass_computes(base_path):
    graphed = _trainer(base_path, device="cuda", dtype=torch.bfloat16)
    eager = _trainer(base_path, device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
    _outcome(graphed, PASSES[0])
    requests = PASSES[1]
    graphed.run_pass(requests)  # captured here
    device_work = graphed.planned_pass(requests)
    torch.cuda.set_sync_debug_mode("error")
    try:
        device_work()  # a replay
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for be in (graphed, eager):
        for a in be.adapters.values():
            be.lora.clear_grads(a.name)
    outs, _ = _outcome(graphed, requests)
    ref, _ = _outcome(eager, requests)
    assert graphed.graphs.counts["captured"] == 1 and graphed.graphs.counts["replayed"] >= 2
    for a, b in zip(_logprobs(outs), _logprobs(ref)):
        assert a == pytest.approx(b, abs=0.05)


def test_the_memory_plan_counts_the_graphs_pool_beside_the_eager_passes():
    """Captured passes keep a second copy of a pass's activations (the graphs' pool beside the eager
    allocator): the derived token budget halves, what adapters get stays, and a fixed budget whose
    two copies no longer fit is refused naming the setting."""
    from bases import memory_plan
    from tests.test_model_sources import QWEN3_8B

    inputs = memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB)
    eager = memory_plan.plan_memory(QWEN3_8B, inputs)
    graphed = memory_plan.plan_memory(QWEN3_8B, memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB,
                                                                       cuda_graphs=True))
    # (the head's one chunk of logits, a fixed size, is counted in each copy too)
    chunk_tokens = 3 * memory_plan.HEAD_CHUNK_BYTES / eager.activation_bytes_per_token
    assert not graphed.problems and abs(graphed.token_budget - (eager.token_budget - chunk_tokens) / 2) <= 1
    assert abs(graphed.resident_adapters - eager.resident_adapters) <= 1
    fixed = memory_plan.PlanInputs(device_bytes=80 * memory_plan.GiB, token_budget=eager.token_budget)
    assert not memory_plan.plan_memory(QWEN3_8B, fixed).problems
    tight = memory_plan.plan_memory(QWEN3_8B, memory_plan.PlanInputs(
        device_bytes=80 * memory_plan.GiB, token_budget=int(eager.token_budget * 1.9), cuda_graphs=True))
    assert any(p.startswith("token_budget") for p in tight.problems), tight.rows()
    assert memory_plan.for_worker(QWEN3_8B, device="cpu", dtype="float32", cuda_graphs=True).inputs.cuda_graphs is False
