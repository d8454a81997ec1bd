"""Siblings fed one input share one shrink (batcher.engine.multilora.Siblings): q/k/v's A slabs lie side by
side in one tensor and one GEMM shrinks the input for all three (gate/up likewise); each adapter
still gets exactly its own product and gradient, whichever of the siblings it trains, and a model
that does not feed the siblings one tensor is still exact."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from batcher.engine import multilora
from batcher.engine.backend import LoraBackend
from batcher.engine.grouped import Route
from batcher.engine.multilora import MultiLoraModel
from core.work import AdamParams, LoraShape
from stack.tiny_model import build_tiny_model
from tests.test_fused_step import ADAM, _datum, _req

KINDS = ("q_proj", "k_proj", "v_proj")
OUT = {"q_proj": 40, "k_proj": 16, "v_proj": 16}
TARGETS = {"m0": ["q_proj", "k_proj", "v_proj"], "m1": ["q_proj", "v_proj"], "m2": ["k_proj"]}


class _Attention(nn.Module):
    """Three sibling Linears; `k_input` says what k_proj is fed (the shared input, or another)."""

    def __init__(self, k_input=lambda x: x):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(24, OUT[k], bias=False) for k in KINDS)
        self.k_input = k_input

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(self.k_input(x)), self.v_proj(x)], dim=-1)


@contextlib.contextmanager
def counting_shrinks():
    calls = []
    original = multilora.Shrink.forward

    def counted(ctx, *args):
        calls.append(args[2].A.shape[1])  # the rows it shrinks to: siblings x rank
        return original(ctx, *args)

    multilora.Shrink.forward = staticmethod(counted)
    try:
        yield calls
    finally:
        multilora.Shrink.forward = staticmethod(original)


def _model(dtype: torch.dtype, k_input=lambda x: x) -> tuple[_Attention, MultiLoraModel]:
    torch.manual_seed(0)
    model = _Attention(k_input).to(dtype).requires_grad_(False)
    lora = MultiLoraModel(model, KINDS)
    g = torch.Generator().manual_seed(1)
    for i, (name, targets) in enumerate(TARGETS.items()):
        params = lora.add_adapter(name, rank=4, alpha=2.0, targets=targets, seed=i)
        with torch.no_grad():  # B away from zero, so every product and gradient counts
            for p in params:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model, lora


def _device_routes(lora: MultiLoraModel, runs) -> dict:
    return {key: Route(r, torch.tensor([e for _, _, e in r], dtype=torch.int32), torch.tensor([s for s, _, _ in r]))
            for key, r in lora.routes(runs, KINDS).items()}


def _reference(model: _Attention, lora: MultiLoraModel, runs, x: torch.Tensor, w: torch.Tensor):
    """Per run, in float64: each kind's base output plus, where the run's adapter trains the kind,
    scale * x @ A.T @ B.T; gradients by autograd over independent copies."""
    x = x.detach().double().requires_grad_(True)
    params = {name: [p.detach().double().clone().requires_grad_(True) for p in lora.adapters[name].params]
              for name in TARGETS}
    outs = []
    for kind in KINDS:
        base = getattr(model, kind).base.weight.double()
        xk = model.k_input(x) if kind == "k_proj" else x
        y = xk @ base.T
        parts = []
        for name, s, e in runs:
            part = y[s:e]
            if name is not None and kind in TARGETS[name]:
                i = [layer.rsplit(".", 1)[-1] for layer in lora.adapters[name].layers].index(kind)
                A, B = params[name][2 * i], params[name][2 * i + 1]
                part = part + 0.5 * xk[s:e] @ A.T @ B.T
            parts.append(part)
        outs.append(torch.cat(parts))
    out = torch.cat(outs, dim=-1)
    (out * w).sum().backward()
    return out.detach(), x.grad, {name: [p.grad for p in ps] for name, ps in params.items()}


RUNS = [
    (("m0", 0, 5), (None, 5, 8), ("m1", 8, 14), ("m2", 14, 19), ("m0", 19, 20)),  # grouped GEMM / the loop
    (("m0", 0, 5), ("m1", 5, 10), (None, 10, 15), ("m2", 15, 20)),  # equal runs at the shrink
]


@pytest.mark.parametrize("runs", RUNS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_siblings_share_one_shrink_and_each_adapter_gets_its_own_result(runs, dtype):
    """Adapters training all three siblings, two of them and one: one shrink for the three (rows 3 x
    rank), and every output, the input's gradient and each adapter's gradients equal a per-run
    float64 reference (float64 exactly; float32 to its rounding)."""
    model, lora = _model(dtype)
    x = torch.randn(20, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(dtype)
    x.requires_grad_(True)
    w = torch.randn(20, sum(OUT.values()), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lora.context.routes = _device_routes(lora, runs)
    with counting_shrinks() as calls:
        y = model(x)
    assert calls == [3 * 4]
    (y * w.to(dtype)).sum().backward()
    lora.context.routes = None
    want, want_x, want_grads = _reference(model, lora, runs, x, w)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(y.detach().double(), want, **tol)
    torch.testing.assert_close(x.grad.double(), want_x, **tol)
    for name in TARGETS:
        lora.set_grads(name)
        for p, expected in zip(lora.adapters[name].params, want_grads[name]):
            torch.testing.assert_close(p.grad.double(), expected, **tol)


def test_a_sibling_fed_another_input_shrinks_by_itself():
    """k_proj fed another tensor than q and v: it shrinks its own input, v shrinks again (the shared
    shrink was replaced), and every result is still the reference's."""
    runs = RUNS[0]
    model, lora = _model(torch.float64, k_input=lambda x: 2 * x)
    x = torch.randn(20, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    w = torch.randn(20, sum(OUT.values()), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lora.context.routes = _device_routes(lora, runs)
    with counting_shrinks() as calls:
        y = model(x)
    assert len(calls) == 3
    (y * w).sum().backward()
    want, want_x, want_grads = _reference(model, lora, runs, x, w)
    torch.testing.assert_close(y.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, want_x, rtol=1e-12, atol=1e-12)
    for name in TARGETS:
        lora.set_grads(name)
        for p, expected in zip(lora.adapters[name].params, want_grads[name]):
            torch.testing.assert_close(p.grad, expected, rtol=1e-12, atol=1e-12)


def test_a_shrink_is_forgotten_once_its_siblings_read_it():
    """Without autograd nothing else holds a layer's input: the shared shrink (and the input it
    keeps) goes once the last sibling with a route has read it, and a new pass forgets any."""
    model, lora = _model(torch.float64)
    lora.context.routes = _device_routes(lora, RUNS[0])
    x = torch.randn(20, 24, dtype=torch.float64)
    with torch.no_grad():
        model.q_proj(x)
        assert len(lora.context.shrunk) == 1
        model.k_proj(x)
        model.v_proj(x)
        assert not lora.context.shrunk
        model.q_proj(x)
    lora.context.routes = None
    assert not lora.context.shrunk


def test_a_model_adapter_has_its_siblings_a_in_one_tensor(tmp_path):
    """On a decoder: each layer's q/k/v A rows are slices of one tensor and gate/up's of another, a
    pass takes one shrink per group (q/k/v, o, gate/up, down, the unembedding) rather than one per
    module, and parking and restoring keeps every value."""
    be = LoraBackend(build_tiny_model(tmp_path / "m").path, dtype=torch.float64)
    for i in range(3):
        be.create(f"m{i}", LoraShape(rank=8, seed=i))
    layers = be.lora.layers
    q, k, v = (layers[f"model.layers.0.self_attn.{n}"].slabs[8] for n in KINDS)
    assert q.A.untyped_storage().data_ptr() == k.A.untyped_storage().data_ptr() == v.A.untyped_storage().data_ptr()
    assert k.A.data_ptr() == q.A.data_ptr() + 8 * q.A.shape[2] * q.A.element_size()
    gate, up = (layers[f"model.layers.0.mlp.{n}"].slabs[8] for n in ("gate_proj", "up_proj"))
    assert gate.A.untyped_storage().data_ptr() == up.A.untyped_storage().data_ptr()
    o = layers["model.layers.0.self_attn.o_proj"].slabs[8]
    assert o.A.untyped_storage().data_ptr() != q.A.untyped_storage().data_ptr()
    A = be.adapters["m1"].params[2]  # k_proj's A of layer 0
    assert A.is_contiguous() and A.untyped_storage().data_ptr() == q.A.untyped_storage().data_ptr()
    n_layers = be.base.config.num_hidden_layers
    heads = sum(1 for layer in layers.values() if layer.kind == "lm_head")
    with counting_shrinks() as calls:
        be.run_pass([_req(f"m{i}", [_datum(5 * i, 9)]) for i in range(3)])
    assert len(calls) == 4 * n_layers + heads
    before = {name: [p.detach().clone() for p in be.adapters[name].params] for name in be.adapters}
    for m in ("m0", "m1"):
        be.lora.park(be.adapters[m].name, torch.device("cpu"))
    for m in ("m1", "m0"):
        be.lora.restore(be.adapters[m].name)
    for name, values in before.items():
        assert all(torch.equal(p, t) for p, t in zip(be.adapters[name].params, values))


def test_a_trainer_with_shared_shrinks_trains_as_one_with_a_shrink_per_layer(tmp_path):
    """Two trainers over one base, shrinks shared and a shrink per layer (the layer before it): adapters
    of two ranks, some on attention only, some on the MLP only, rows of unequal lengths (the grouped
    GEMM's and the loop's runs): every logprob and loss, every gradient row and every weight after two
    optimizer steps agree to float64 rounding, and only the shared trainer takes one shrink per group."""
    path = build_tiny_model(tmp_path / "m").path
    shapes = {"a": LoraShape(rank=8, seed=1), "b": LoraShape(rank=8, seed=2, train_mlp=False),
              "c": LoraShape(rank=4, seed=3, train_attn=False), "d": LoraShape(rank=8, seed=4, train_unembed=False)}
    trainers = [LoraBackend(path, dtype=torch.float64, shared_shrinks=shared) for shared in (True, False)]
    requests = [_req("a", [_datum(3, 11), _datum(40, 4)]), _req("b", [_datum(7, 6)]), _req("c", [_datum(20, 9)]),
                _req("d", [_datum(60, 5), _datum(1, 13)])]
    calls, outs = [], []
    for be in trainers:
        for model_id, shape in shapes.items():
            be.create(model_id, shape)
        results = []
        with counting_shrinks() as shrinks:
            results.append(be.run_pass(requests))
        calls.append(len(shrinks))
        for model_id in shapes:
            be.lora.set_grads(be.adapters[model_id].name)
        grads = {m: [p.grad.clone() for p in be.adapters[m].params] for m in shapes}
        be.optim_steps([(m, AdamParams(**ADAM)) for m in shapes])
        results.append(be.run_pass(requests))
        be.optim_steps([(m, AdamParams(**ADAM)) for m in shapes])
        outs.append((results, grads, {m: [p.detach().clone() for p in be.adapters[m].params] for m in shapes}))
    (shared, shared_grads, shared_weights), (alone, alone_grads, alone_weights) = outs
    for one, other in zip(shared, alone):
        for a, b in zip(one, other):
            assert isinstance(a, dict) and isinstance(b, dict), (a, b)
            for x, y in zip(a["loss_fn_outputs"], b["loss_fn_outputs"]):
                torch.testing.assert_close(torch.tensor(x["logprobs"]["data"]), torch.tensor(y["logprobs"]["data"]),
                                           rtol=0, atol=1e-12)
            assert a["metrics"].keys() == b["metrics"].keys()
            for key, value in a["metrics"].items():
                assert value == pytest.approx(b["metrics"][key], rel=1e-12, abs=1e-12), key
    for m in shapes:
        for got, want in zip(shared_grads[m] + shared_weights[m], alone_grads[m] + alone_weights[m]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # rank 8 trains every module: 4 shrinks a layer and the head's shared, 7 and the head's alone; rank 4
    # the MLP: gate/up and down shared, gate, up and down alone; and the head
    n = trainers[0].base.config.num_hidden_layers
    assert calls == [(4 * n + 1) + (2 * n + 1), (7 * n + 1) + (3 * n + 1)]
