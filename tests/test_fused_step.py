"""The fused step's device work: no host synchronisation inside a pass, per-module slabs, packed rows,
the chunked unembedding, grouped GEMM against the per-run loop (CPU; the GPU half runs in
bench/gpu_suite.sh)."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from batcher.engine import layout
from batcher.engine.backend import LoraBackend
from batcher.engine.device_pass import DevicePass
from batcher.engine.grouped import PassContext, Route
from batcher.engine.multilora import MultiLoraLinear, _new_slabs
from batcher.engine.plan import RouteTensors
from batcher.engine.protocol import PassRequest
from batcher.engine.transfer import Bundle
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from stack.tiny_model import build_tiny_model

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.01, "grad_clip_norm": 1.0}


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path


def _datum(start: int, n: int, policy_version: int | None = None) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n}, policy_version)


def _rl_datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "logprobs": tuple(-1.0 - 0.01 * i for i in range(n)),
                             "advantages": tuple((-1.0) ** i for i in range(n))}, 0)


def _req(model_id: str, data: list[Datum], loss_fn: str = "cross_entropy", forward_only: bool = False,
         config: LossConfig = LossConfig()) -> PassRequest:  # noqa: B008 - frozen
    return PassRequest(model_id, model_id, PassWork(loss_fn, config, tuple(data)), forward_only)


# Calls that read a device tensor back to the host (or build one from host values) inside a pass.
_SYNCS = {torch.Tensor: ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"),
          torch: ("tensor", "as_tensor")}


@contextlib.contextmanager
def counting_syncs():
    counts: collections.Counter = collections.Counter()
    saved = []
    for owner, names in _SYNCS.items():
        for name in names:
            original = getattr(owner, name)
            saved.append((owner, name, original))

            def counted(*args, _original=original, _name=name, **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(owner, name, counted)
    try:
        yield counts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def watch_device_work(monkeypatch) -> collections.Counter:
    """From now on, the calls that would synchronise inside any pass's device work, counted."""
    compute = DevicePass.compute
    seen: collections.Counter = collections.Counter()

    def watched(self, *args):
        with counting_syncs() as counts:
            out = compute(self, *args)
        seen.update(counts)
        return out

    monkeypatch.setattr(DevicePass, "compute", watched)
    return seen


def test_a_pass_reads_nothing_back_until_it_ends(base_path, monkeypatch):
    """Forward, losses, backward of 4 tenants (two loss functions, several micro-batches and head
    chunks) run without one call that would synchronise a device; the results come back after."""
    be = LoraBackend(base_path, max_tokens_per_pass=40, head_chunk_tokens=16)
    for i in range(4):
        be.create(f"m{i}", LoraShape(rank=4 * (1 + i % 2), seed=i))
    seen = watch_device_work(monkeypatch)
    outs = be.run_pass([_req("m0", [_datum(3, 12), _datum(40, 5)]), _req("m1", [_rl_datum(9, 20)], "ppo"),
                        _req("m2", [_datum(50, 30)], forward_only=True), _req("m3", [_rl_datum(7, 9)], "cispo")])
    assert all(isinstance(o, dict) for o in outs), outs
    assert be.last_pass.micro_batches > 1
    assert dict(seen) == {}, f"the pass synchronised: {dict(seen)}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_suite.sh runs it)")
def test_a_pass_on_a_gpu_never_synchronises(base_path):
    # the eager pass (a captured one: tests/test_cuda_graphs.py)
    be = LoraBackend(base_path, device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
    for i in range(4):
        be.create(f"m{i}", LoraShape(rank=8, seed=i))
    requests = [_req(f"m{i}", [_datum(10 * i, 24), _rl_datum(5 * i, 13)], "ppo") for i in range(4)]
    be.run_pass(requests)  # warm: first-call initialisation may synchronise
    device_work = be.planned_pass(requests)
    torch.cuda.set_sync_debug_mode("error")
    try:
        device_work()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- slabs -----------------------------------------------------------------------------------------


def test_adapters_are_rows_of_one_slab_per_module_and_rank(base_path):
    be = LoraBackend(base_path)
    for i in range(5):
        be.create(f"m{i}", LoraShape(rank=8 if i < 4 else 4, seed=i))
    layer = be.lora.layers["model.layers.0.self_attn.q_proj"]
    assert set(layer.slabs) == {8, 4}
    slab = layer.slabs[8]
    assert slab.A.shape == (4 + 1, 8, layer.base.in_features)  # four slots and the zero row
    for i in range(4):
        A, B = be.adapters[f"m{i}"].params[:2]
        assert A.untyped_storage().data_ptr() == slab.A.untyped_storage().data_ptr()
        assert not A.requires_grad and not B.requires_grad  # autograd sees only the slab's trigger
    assert not slab.A[-1].any() and not slab.B[-1].any()
    be.run_pass([_req(f"m{i}", [_datum(5 * i, 9)]) for i in range(5)])
    B = be.adapters["m2"].params[1]  # (A's first gradient is zero: B starts at zero)
    assert B.grad.untyped_storage().data_ptr() == slab.gB.untyped_storage().data_ptr() and B.grad.any()


def test_parking_moves_rows_out_and_back_without_changing_a_result(base_path):
    """Three models through a trainer that keeps one resident (each pass parks the others and
    restores into whatever slot is free) train exactly as through one that parks nothing."""
    tight, roomy = (LoraBackend(base_path, dtype=torch.float64, max_resident=n) for n in (1, 0))
    for be in (tight, roomy):
        for i in range(3):
            be.create(f"m{i}", LoraShape(rank=4, seed=i))
    for step in range(2):
        for i in (2, 0, 1):
            for be in (tight, roomy):
                be.run_pass([_req(f"m{i}", [_datum(7 * i + step, 11)])])
                be.optim_step(f"m{i}", AdamParams(**ADAM))
    assert tight.residency() == {"resident": 1, "offloaded": 2}
    assert len(tight.lora.classes[4].slot_of) == 1 and tight.lora.classes[4].capacity == 1  # capped by the plan
    tight.offload_idle(0.0)  # nothing of rank 4 resident: its slabs go
    assert tight.lora.classes[4].capacity == 0 and all(4 not in layer.slabs for layer in tight.lora.layers.values())
    for i in range(3):
        for key, value in roomy.adapter_state(f"m{i}").items():
            torch.testing.assert_close(tight.adapter_state(f"m{i}")[key], value, rtol=1e-12, atol=0)
        want, got = (b.adapters[f"m{i}"].optimizer.state_dict()["state"] for b in (roomy, tight))
        assert all(torch.equal(got[k]["exp_avg_sq"], want[k]["exp_avg_sq"]) for k in want)


def test_a_growing_slab_keeps_every_adapter_and_its_pending_gradient(base_path):
    be = LoraBackend(base_path, dtype=torch.float64)
    be.create("a", LoraShape(rank=4, seed=0))
    be.run_pass([_req("a", [_datum(3, 9)])])
    before = {k: v.clone() for k, v in be.adapter_state("a").items()}
    grads = [p.grad.clone() for p in be.adapters["a"].params]
    for i in range(3):  # capacity 1 -> 2 -> 4
        be.create(f"b{i}", LoraShape(rank=4, seed=i + 1))
    assert be.lora.classes[4].capacity == 4
    for key, value in be.adapter_state("a").items():
        assert torch.equal(value, before[key])
    assert all(torch.equal(p.grad, g) for p, g in zip(be.adapters["a"].params, grads))


# --- packed rows -----------------------------------------------------------------------------------


def test_packed_rows_leave_no_padding_and_compute_what_padded_rows_do(base_path, monkeypatch):
    data = {f"m{i}": [_datum(11 * i, 5 + 7 * i), _rl_datum(3 * i, 33 - 4 * i)] for i in range(6)}
    results = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(layout, "can_pack", lambda config, longest: False)
        be = LoraBackend(base_path, dtype=torch.float64)
        for i, m in enumerate(data):
            be.create(m, LoraShape(rank=4 + 4 * (i % 2), seed=i))
        outs = be.run_pass([_req(m, d, "importance_sampling") for m, d in data.items()])
        results[packed] = (outs, {m: [p.grad.clone() for p in be.adapters[m].params] for m in data}, be.last_pass)
    (packed_outs, packed_grads, packed_stats), (padded_outs, padded_grads, padded_stats) = results[True], results[False]
    assert packed_stats.padding_fraction == 0.0 < padded_stats.padding_fraction
    for a, b in zip(packed_outs, padded_outs):
        for da, db in zip(a["loss_fn_outputs"], b["loss_fn_outputs"]):
            assert da["logprobs"]["data"] == pytest.approx(db["logprobs"]["data"], rel=1e-6)
    for m in data:
        for ga, gb in zip(packed_grads[m], padded_grads[m]):
            torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("config, longest, ok", [
    ({"model_type": "llama"}, 100_000, True),
    ({"model_type": "qwen3", "sliding_window": 128, "use_sliding_window": False}, 4096, True),
    ({"model_type": "qwen2", "sliding_window": 128, "use_sliding_window": True}, 128, True),
    # rows longer than a sliding window pack: the packed attention applies each layer's window
    # (tests/test_gpt_oss.py checks a windowed base's packed rows against its own masks)
    ({"model_type": "qwen2", "sliding_window": 128, "use_sliding_window": True}, 129, True),
    ({"model_type": "mistral", "sliding_window": 4096}, 5000, True),
    ({"model_type": "mistral", "sliding_window": None}, 5000, True),
    ({"model_type": "gemma3_text", "sliding_window": 512}, 513, True),
    ({"model_type": "gpt_oss", "sliding_window": 128}, 4096, True),
])
def test_packing_is_used_only_where_the_attention_stays_exact(config, longest, ok):
    assert layout.can_pack(config, longest) is ok


def test_a_sliding_window_base_packs_rows_longer_than_its_window(tmp_path):
    """The packed attention applies the window within each row (tests/test_gpt_oss.py checks the
    values against the model's own masks), so a row longer than the window packs as any other."""
    from stack.tiny_model import TinyModelSpec

    path = build_tiny_model(tmp_path / "m", spec=TinyModelSpec(architecture="mistral")).path
    be = LoraBackend(path)
    be.config["sliding_window"] = 16
    be.create("m", LoraShape(rank=4, seed=0, train_unembed=False))
    be.run_pass([_req("m", [_datum(3, 9), _datum(40, 20)])])
    assert be.last_pass.padding_fraction == 0.0 and be.last_pass.padded_tokens == 29


@pytest.mark.parametrize("lengths, keys, budget, pack, width, expect", [
    # packed: by adapter, then length; streams of min(width, total) tokens
    ([3, 5, 2], ["b", "a", "a"], 100, True, 64, [((2, 1, 0), (0, 2, 7), 1, 10)]),
    ([3, 5, 2], ["b", "a", "a"], 100, True, 6, [((2, 1, 0), (0, 6, 12), 3, 6)]),
    ([3, 5, 2], ["b", "a", "a"], 7, True, 64, [((2, 1), (0, 2), 1, 7), ((0,), (0,), 1, 3)]),
    ([9], ["a"], 4, True, 64, [((0,), (0,), 1, 9)]),  # a row longer than the budget goes alone
    # padded: by length (like lengths share a micro-batch), then adapter; one row per stream
    ([3, 5, 2], ["b", "a", "a"], 100, False, 64, [((1, 2, 0), (0, 5, 10), 3, 5)]),
    ([3, 5, 2], ["b", "a", "a"], 9, False, 64, [((2, 0), (0, 3), 2, 3), ((1,), (0,), 1, 5)]),
])
def test_micro_batches_and_streams(lengths, keys, budget, pack, width, expect):
    got = layout.micro_batches(lengths, keys, budget=budget, pack=pack, pack_width=width)
    assert [(b.rows, b.starts, b.streams, b.width) for b in got] == expect
    assert all(b.packed is pack for b in got)


def test_runs_cover_the_grid_and_windows_renumber_them():
    lay = layout.micro_batches([3, 5, 2], ["b", "a", "a"], budget=100, pack=True, pack_width=6, align=4)[0]
    assert (lay.starts, lay.width, lay.streams) == ((0, 2, 8), 8, 2)  # width 6 rounded up to 8
    runs = layout.segments(lay, [3, 5, 2], ["b", "a", "a"])
    assert runs == [("a", 0, 7), (None, 7, 8), ("b", 8, 11), (None, 11, 16)]
    assert layout.window(runs, 6, 12) == [("a", 0, 1), (None, 1, 2), ("b", 2, 5), (None, 5, 6)]
    assert layout.chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]


# --- the unembedding in chunks ---------------------------------------------------------------------


def test_the_chunked_unembedding_computes_what_one_chunk_does(base_path):
    wide = Datum(tuple(range(5, 17)), {"target_tokens": tuple(range(24)), "weights": tuple(0.5 for _ in range(24))},
                 width=2)
    requests = [_req("a", [_datum(3, 17), _datum(30, 4)]), _req("b", [_rl_datum(9, 13)], "ppo"),
                _req("c", [wide])]
    results = []
    for chunk in (0, 5):
        be = LoraBackend(base_path, dtype=torch.float64, head_chunk_tokens=chunk)
        for i, m in enumerate("abc"):
            be.create(m, LoraShape(rank=4, seed=i))
        results.append((be.run_pass(requests), {m: [p.grad.clone() for p in be.adapters[m].params] for m in "abc"},
                        be))
    (one, one_grads, whole), (chunked, chunked_grads, _) = results
    assert whole.planner.head_chunk_tokens > 1000
    for a, b in zip(one, chunked):
        assert a["loss_fn_outputs"] == b["loss_fn_outputs"]
    for m in "abc":
        for ga, gb in zip(one_grads[m], chunked_grads[m]):
            torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


# --- the layer itself -------------------------------------------------------------------------------


@pytest.mark.parametrize("runs", [
    ((1, 0, 5), (3, 5, 5), (0, 5, 12), (3, 12, 16), (2, 16, 19), (1, 19, 20)),  # grouped GEMM / the loop
    ((1, 0, 5), (3, 5, 10), (0, 10, 15), (1, 15, 20)),  # equal runs: batched matmuls
])
def test_every_path_of_the_layer_agrees_with_a_per_token_reference(runs):
    """Runs of several slots (one empty, padding on slot 3, the zero row, one slot twice): float32
    (grouped GEMM, or batched matmuls for equal runs) and float64 (the loop, or batched matmuls)
    give each token its slot's product and each slot its gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=False)
    token_slot = [s for s, a, b in runs for _ in range(a, b)]
    ref = None
    for dtype in (torch.float64, torch.float32):
        context = PassContext()
        layer = MultiLoraLinear(lin.double() if dtype == torch.float64 else lin.float(), "q_proj", context)
        shrink, [slab] = _new_slabs(3, 4, [layer], dtype, dtype, 0.5)
        layer.slabs[4], layer.siblings.shrinks[4] = slab, shrink
        with torch.no_grad():
            slab.A[:3].copy_(torch.randn(3, 4, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
            slab.B[:3].copy_(torch.randn(3, 40, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
        route = Route(runs, torch.tensor([e for _, _, e in runs], dtype=torch.int32),
                      torch.tensor([s for s, _, _ in runs]))
        x = torch.randn(20, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(dtype)
        x.requires_grad_(True)
        context.routes = {("q_proj", 4): route}
        y = layer(x) - layer.base(x).detach()
        (y * torch.arange(40, dtype=dtype)).sum().backward()
        if ref is None:  # per token, in float64
            xs = x.detach()
            want = torch.stack([0.5 * xs[t] @ slab.A[s].T @ slab.B[s].T for t, s in enumerate(token_slot)])
            ref = (want, x.grad.clone(), slab.gA.clone(), slab.gB.clone())
            torch.testing.assert_close(y.detach(), want)
            continue
        for got, expected in zip((y.detach(), x.grad, slab.gA, slab.gB), ref):
            torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_one_bundle_carries_every_dtype_and_shape():
    routes = {("q_proj", 4): RouteTensors(torch.tensor([3, 7], dtype=torch.int32), torch.tensor([0, 2]))}
    record = (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([True, False, True]), routes,
              [torch.zeros(0, dtype=torch.float64), torch.tensor([0.5, -2.0])])
    bundle = Bundle(record)
    ids, mask, got_routes, (empty, weights) = bundle.to(torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3], [4, 5, 6]] and ids.dtype == torch.long
    route = got_routes[("q_proj", 4)]
    assert route.offsets.tolist() == [3, 7] and route.offsets.dtype == torch.int32 and route.members is None
    assert mask.tolist() == [True, False, True]
    assert empty.shape == (0,) and weights.tolist() == [0.5, -2.0] and weights.dtype == torch.float32
    assert all(t.data_ptr() % 16 == 0 for t in (ids, mask, route.offsets, route.slots, weights))
    # the same structure of other values lies alike: a captured pass's buffer takes it
    other = Bundle((ids + 1, mask, got_routes, [empty, weights * 2]))
    assert other.signature() == bundle.signature()
    buffer = bundle.buffer(torch.device("cpu"))
    other.copy_into(buffer)
    assert bundle.views(buffer)[0].tolist() == [[2, 3, 4], [5, 6, 7]]
    assert Bundle((ids, mask[:2], got_routes, [empty, weights])).signature() != bundle.signature()


# --- one tenant's overflow --------------------------------------------------------------------------


def test_an_overflowing_request_leaves_its_neighbours_gradients_exact(base_path):
    """A request whose importance ratio overflows shares the stream (and the adapter) with a good request:
    the good one's gradient is exactly what it is alone, with no NaN crossing over."""
    bad = Datum(tuple(range(5, 15)), {"target_tokens": tuple(range(6, 16)), "logprobs": (-3e38,) * 10,
                                      "advantages": (1.0,) * 10})
    be, alone = LoraBackend(base_path, dtype=torch.float64), LoraBackend(base_path, dtype=torch.float64)
    for b in (be, alone):
        b.create("m", LoraShape(rank=4, seed=0))
    bad_out, good_out = be.run_pass([_req("m", [bad], "importance_sampling"), _req("m", [_datum(3, 12)])])
    alone.run_pass([_req("m", [_datum(3, 12)])])
    assert "not finite" in bad_out.message and isinstance(good_out, dict)
    for p, q in zip(be.adapters["m"].params, alone.adapters["m"].params):
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_a_pass_that_fails_half_way_leaves_no_partial_gradient(base_path, monkeypatch):
    """The second micro-batch fails after the first has backpropagated: the requests get a server
    error, and the next pass's gradients are exactly a clean trainer's."""
    data = [_datum(3, 12), _datum(40, 20)]
    be, clean = (LoraBackend(base_path, dtype=torch.float64, max_tokens_per_pass=20) for _ in range(2))
    for b in (be, clean):
        b.create("m", LoraShape(rank=4, seed=0))
    batch = DevicePass._batch
    calls = []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return batch(self, *args)

    monkeypatch.setattr(DevicePass, "_batch", failing)
    [out] = be.run_pass([_req("m", data)])
    assert "out of memory" in out.message and len(calls) == 2
    assert all(p.grad is None for p in be.adapters["m"].params)
    monkeypatch.setattr(DevicePass, "_batch", batch)
    for b in (be, clean):
        b.run_pass([_req("m", data)])
    for p, q in zip(be.adapters["m"].params, clean.adapters["m"].params):
        assert torch.equal(p.grad, q.grad)


def test_a_half_precision_compute_copy_follows_every_step(base_path):
    """The bfloat16 copies a GPU base computes with (forced here on the CPU): refreshed from the
    float32 masters after each optimizer step, a load and a restore, and never trained themselves."""
    be = LoraBackend(base_path)
    be.lora.compute_dtype = torch.bfloat16
    be.create("m", LoraShape(rank=8, seed=0))
    slab = be.lora.layers["model.layers.1.mlp.up_proj"].slabs[8]
    assert slab.A_c.dtype == torch.bfloat16 and slab.A.dtype == torch.float32
    for step in range(2):
        out = be.run_pass([_req("m", [_datum(5 + step, 16)])])[0]
        assert isinstance(out, dict)
        assert be.adapters["m"].params[1].grad.dtype == torch.float32
        be.optim_step("m", AdamParams(**ADAM))
        assert be.lora.classes[8].dirty
        be.run_pass([_req("m", [_datum(9, 4)], forward_only=True)])
        assert torch.equal(slab.A_c, slab.A.to(torch.bfloat16)) and torch.equal(slab.B_c, slab.B.to(torch.bfloat16))
    assert slab.B.abs().sum() > 0


# --- a round's optimizer steps together ------------------------------------------------------------

STEPS = [  # each model its own hyperparameters: learning rate, betas, eps, weight decay, clipping (0: none)
    AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=1.0),
    AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0),
    AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=1e-3),
    AdamParams(learning_rate=5e-4, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=1e3),
]


def _reference_step(be: LoraBackend, model_id: str, adam: AdamParams) -> float:
    """What one model's step was before steps were taken together: torch's clip_grad_norm_ and the
    model's own AdamW."""
    adapter = be.adapters[model_id]
    for group in adapter.optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    norm = torch.nn.utils.clip_grad_norm_(adapter.params, adam.grad_clip_norm or float("inf"))
    adapter.optimizer.step()
    be.lora.clear_grads(adapter.name)
    be.lora.changed(adapter.name)
    adapter.steps += 1
    return float(norm)


def test_a_rounds_steps_together_equal_each_models_own_step(base_path, monkeypatch):
    """Four models with four sets of hyperparameters (two alike), three rounds: the weights and AdamW
    moments equal torch's clip_grad_norm_ and AdamW model by model; a model with no gradient is
    skipped, one whose gradient overflowed fails alone and keeps its weights; the norms come back
    in one read."""
    together, alone = (LoraBackend(base_path, dtype=torch.float64) for _ in range(2))
    for be in (together, alone):
        for i in range(5):
            be.create(f"m{i}", LoraShape(rank=4 * (1 + i % 2), seed=i))
    for round_ in range(3):
        for be in (together, alone):
            outs = be.run_pass([_req(f"m{i}", [_datum(7 * i + round_, 9 + 3 * i), _rl_datum(i, 6)], "ppo")
                                for i in range(4)])
            assert all(isinstance(o, dict) for o in outs), outs
        seen = collections.Counter()
        with counting_syncs() as counts:
            got = together.optim_steps([(f"m{i}", STEPS[i]) for i in range(4)] + [("m4", STEPS[0]), ("nope", STEPS[0])])
        seen.update(counts)
        assert seen["tolist"] == 1 and not seen["__float__"] and not seen["cpu"], dict(seen)
        assert got[4] == {"metrics": {"skipped:sum": 1.0}} and "not loaded" in got[5].message
        for i in range(4):
            norm = _reference_step(alone, f"m{i}", STEPS[i])
            assert got[i]["metrics"]["grad_norm:mean"] == pytest.approx(norm, rel=1e-12)
            assert got[i]["metrics"]["step:max"] == round_ + 1
    for i in range(4):
        a, b = together.adapters[f"m{i}"], alone.adapters[f"m{i}"]
        for p, q in zip(a.params, b.params):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(a.optimizer.state[p][key], b.optimizer.state[q][key], rtol=1e-12, atol=1e-18)
    # one model's gradients overflow: it alone fails, and its weights stay
    together.run_pass([_req("m0", [_datum(3, 5)]), _req("m1", [_datum(4, 6)])])
    together.adapters["m1"].params[0].grad.fill_(float("inf"))
    before = [p.clone() for p in together.adapters["m1"].params]
    ok, bad = together.optim_steps([("m0", STEPS[0]), ("m1", STEPS[1])])
    assert isinstance(ok, dict) and "not finite" in bad.message and bad.field == "adam_params"
    assert all(torch.equal(p, q) for p, q in zip(together.adapters["m1"].params, before))
    assert not together.lora.pending(together.adapters["m1"].name) and together.adapters["m1"].steps == 3
