"""Custom losses without services: the graph checks (`core.custom_loss.parse`) as a table of
hostile graphs, the engine's rebuild against the SDK's own traced module, and a fused pass on the
tiny model where one tenant's custom loss equals the SDK's client-side path and leaves the other
tenants' results as they were."""

from __future__ import annotations

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from batcher.engine import custom_losses
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core import custom_loss
from core.errors import InvalidInput, UserError
from core.loss_spec import LossConfig
from core.work import Datum, LoraShape, PassWork, WorkItem, WorkKind
from stack.tiny_model import build_tiny_model


def ppo_like(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/kl:mean": (old - logprobs).mean(), "custom/ratio:sum": ratio.sum()}


def shaped(logprobs, scale):
    n = logprobs.shape[0]
    w = torch.where(logprobs > -3.0, torch.ones_like(logprobs), torch.zeros_like(logprobs) + 0.5)
    x = torch.nn.functional.logsigmoid(logprobs[..., None][:, 0]).sum() / n
    y = torch.stack([logprobs.abs().max(), torch.logsumexp(logprobs, dim=0)]).sum()
    return -(logprobs * w).sum() * scale + 0.1 * x + 0.01 * y, {"custom/n:sum": logprobs.new_ones(()) * n}


def top_k(logprobs, target):
    loss = -(torch.nn.functional.softmax(target, dim=-1) * logprobs).sum()
    return loss, {"custom/loss:sum": loss}


LOSSES = [
    (ppo_like, {"logprobs": 1, "advantages": 1, "old": 1}),
    (shaped, {"logprobs": 1, "scale": 0}),
    (top_k, {"logprobs": 2, "target": 2}),
]


def wire(fn, ranks) -> dict:
    """What the SDK sends to create_custom_loss."""
    handle = trace_loss(fn, ranks, "s")
    return {"name": handle.name, "inputs": [i.model_dump() for i in handle.inputs],
            "graph": encode_graph(handle).model_dump(mode="json")}


def parsed(fn, ranks) -> custom_loss.LossGraph:
    w = wire(fn, ranks)
    return custom_loss.parse(w["name"], w["inputs"], w["graph"])


# --------------------------------------------------------------------------- the allow-list


def test_the_engine_rebuilds_exactly_the_names_the_api_allows():
    assert set(custom_losses.FUNCTIONS) == custom_loss.FUNCTIONS
    assert all(callable(getattr(torch.Tensor, m)) and not m.endswith("_") for m in custom_loss.METHODS)


@pytest.mark.parametrize(("fn", "ranks"), LOSSES, ids=[f.__name__ for f, _ in LOSSES])
def test_a_rebuilt_graph_gives_the_traced_modules_loss_metrics_and_gradient(fn, ranks):
    handle = trace_loss(fn, ranks, "s")
    graph = custom_loss.LossGraph.from_json(parsed(fn, ranks).to_json())  # what the trainer reads
    torch.manual_seed(0)
    shapes = {0: (), 1: (7,), 2: (7, 3)}
    inputs = [torch.randn(shapes[r]) - (2.0 if name == "logprobs" else 0.0) for name, r in ranks.items()]
    lp_ours, lp_sdk = inputs[0].clone().requires_grad_(), inputs[0].clone().requires_grad_()
    loss, metrics = custom_losses.evaluate(graph, [lp_ours, *inputs[1:]])
    want_loss, want_metrics = handle.graph(lp_sdk, *inputs[1:])
    loss.backward()
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss)
    assert metrics.keys() == want_metrics.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(value, want_metrics[key].reshape(()).to(value.dtype))
    torch.testing.assert_close(lp_ours.grad, lp_sdk.grad)


def _with(fn, ranks, change) -> dict:
    """The SDK's encoding of `fn`, with one node changed by `change(nodes)`."""
    w = wire(fn, ranks)
    change(w["graph"]["nodes"])
    return w


def _target(i: int, target: str, op: str = "call_function"):
    def change(nodes):
        nodes[i].update(op=op, target=target)
    return change


def _args(i: int, args: list):
    def change(nodes):
        nodes[i]["args"] = args
    return change


def _nested(depth: int) -> dict:
    value: dict = {"ref": "logprobs"}
    for _ in range(depth):
        value = {"tuple": [value]}
    return value


def _many(count: int):
    def change(nodes):
        out = nodes.pop()
        nodes += [{"op": "call_function", "name": f"n{k}", "target": "operator.neg", "args": [{"ref": "logprobs"}],
                   "kwargs": {}} for k in range(count)]
        nodes.append(out)
    return change


PPO = (ppo_like, {"logprobs": 1, "advantages": 1, "old": 1})
# node 3 is the first operation (sub) after the three inputs
HOSTILE = [
    ("unknown function", _target(3, "builtins.eval"), "nodes[3] 'sub'", "not in Quilt's list"),
    ("os.system", _target(3, "os.system"), "nodes[3]", "not in Quilt's list"),
    ("torch.load", _target(3, "torch.load"), "nodes[3]", "not in Quilt's list"),
    ("a module", _target(3, "layer", "call_module"), "nodes[3]", "no modules"),
    ("a captured tensor", _target(3, "weight", "get_attr"), "nodes[3]", "no captured tensors"),
    ("in-place method", _target(3, "add_", "call_method"), "nodes[3]", "list of methods"),
    ("item()", _target(3, "item", "call_method"), "nodes[3]", "list of methods"),
    ("getattr of a dunder", lambda n: n[3].update(target="getattr", args=[{"ref": "logprobs"}, "__class__"]),
     "nodes[3]", "getattr reads only"),
    ("getattr of a module", lambda n: n[3].update(target="getattr", args=["torch", "load"]),
     "nodes[3]", "getattr reads only"),
    ("NaN constant", _args(3, [{"ref": "logprobs"}, {"float": "nan"}]), "nodes[3]", "not finite"),
    ("Inf constant", _args(3, [{"ref": "logprobs"}, {"float": "inf"}]), "nodes[3]", "not finite"),
    ("huge integer", _args(3, [{"ref": "logprobs"}, 10**30]), "nodes[3]", "beyond the limit"),
    ("nested 10,000 deep", _args(3, [_nested(10_000)]), "nodes[3]", "nest deeper"),
    ("oversized view", lambda n: n[3].update(op="call_method", target="view",
                                             args=[{"ref": "logprobs"}, 1 << 16, 1 << 16]), "nodes[3]", "size of more"),
    ("forward reference", _args(3, [{"ref": "mul"}, 1.0]), "nodes[3]", "no earlier node"),
    ("a device", _args(3, [{"ref": "logprobs"}, {"device": "cuda:0"}]), "nodes[3]", "device argument"),
    ("out=", lambda n: n[4].update(kwargs={"out": {"ref": "logprobs"}}), "nodes[4] 'exp'", "out="),
    ("a million nodes", _many(1_000_000), f"nodes[{custom_loss.MAX_NODES}]", "at most"),
    ("a bad metric key", lambda n: n[-1]["args"][0]["tuple"][1].update({"dict": {"loss": {"ref": "neg"}}}),
     "'output'", "custom/<name>:sum"),
]


@pytest.mark.parametrize(("change", "where", "why"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_graph_is_refused_naming_its_node(change, where, why):
    w = _with(*PPO, change)
    with pytest.raises(InvalidInput) as err:
        custom_loss.parse(w["name"], w["inputs"], w["graph"])
    assert where in err.value.message and why in err.value.message
    assert err.value.field is not None and err.value.field.startswith("graph.nodes[")


def test_the_checked_graph_survives_the_work_item():
    graph = parsed(*PPO)
    item = WorkItem("r", "t", "m", 1, WorkKind.FORWARD_BACKWARD, 4,
                    PassWork("custom", LossConfig(), (Datum((1, 2), {"target_tokens": (2, 3)}),), custom=graph))
    again = WorkItem.from_fields(item.to_fields())
    assert again.body == item.body


def test_a_graph_that_breaks_a_shape_bound_is_named_before_anything_is_allocated():
    def outer(logprobs):
        big = logprobs[:, None] * logprobs[None, :]  # [n, n]
        return big.sum(), {}

    graph = parsed(outer, {"logprobs": 1})
    n = 1 << 12  # n * n = 2**24 elements, past MAX_ELEMENTS
    why = custom_losses.check(custom_losses.CustomDatum(0, 0, n, 1, graph, ()))
    assert why is not None and "'mul'" in why and "limits are rank" in why
    assert custom_losses.check(custom_losses.CustomDatum(0, 0, 64, 1, graph, ())) is None


def test_python_arithmetic_is_bounded():
    w = wire(*PPO)
    nodes = w["graph"]["nodes"]
    nodes[3:3] = [{"op": "call_function", "name": "huge", "target": "operator.pow", "args": [2, 10**6], "kwargs": {}}]
    graph = custom_loss.parse(w["name"], w["inputs"], w["graph"])
    with pytest.raises(custom_losses.GraphError, match="'huge'.*power above 64"):
        custom_losses.evaluate(graph, [torch.zeros(3)] * 3)


# --------------------------------------------------------------------------- in the fused pass


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path


def _ppo_datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    adv = tuple(((-1.0) ** k) * (0.5 + k / n) for k in range(n))
    old = tuple(-3.0 - 0.1 * k for k in range(n))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "advantages": adv, "old": old})


def _ce(request_id: str, model_id: str, start: int) -> PassRequest:
    toks = tuple(range(start, start + 13))
    datum = Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * 12})
    return PassRequest(request_id, model_id, PassWork("cross_entropy", LossConfig(), (datum,)), False)


def _custom(request_id: str, model_id: str, graph, data) -> PassRequest:
    return PassRequest(request_id, model_id, PassWork("custom", LossConfig(), tuple(data), custom=graph), False)


def _backends(base_path, count: int) -> list[LoraBackend]:
    out = []
    for _ in range(count):
        be = LoraBackend(base_path, max_tokens_per_pass=40)  # several micro-batches
        be.create("c", LoraShape(rank=4, seed=3))
        be.create("o", LoraShape(rank=4, seed=4))
        out.append(be)
    return out


def test_a_custom_loss_in_the_pass_equals_the_sdks_client_side_path_and_leaves_others_alone(base_path):
    fused, client, alone = _backends(base_path, 3)
    handle = trace_loss(*PPO, "s")
    graph = parsed(*PPO)
    data = [_ppo_datum(5, 9), _ppo_datum(30, 17), _ppo_datum(60, 4)]

    fused_out = fused.run_pass([_ce("1", "o", 7), _custom("2", "c", graph, data), _ce("3", "o", 90)])
    # The SDK's fallback: a forward for the logprobs, the loss run client-side, then a backward
    # of cross_entropy with weights = -dC/dlogprobs.
    forward = client.run_pass([PassRequest("f", "c", PassWork("cross_entropy", LossConfig(), tuple(
        Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in data)), True)])[0]
    total, metrics, backward = 0.0, {}, []
    for d, out in zip(data, forward["loss_fn_outputs"], strict=True):
        lp = torch.tensor(out["logprobs"]["data"]).requires_grad_()
        loss, m = handle.graph(lp, torch.tensor(d.inputs["advantages"]), torch.tensor(d.inputs["old"]))
        loss.backward()
        total += float(loss.detach())
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v.detach())
        backward.append(Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"],
                                         "weights": tuple((-lp.grad).tolist())}))
    client.run_pass([PassRequest("b", "c", PassWork("cross_entropy", LossConfig(), tuple(backward)), False)])
    alone.run_pass([_ce("1", "o", 7), _ce("3", "o", 90)])

    got = fused_out[1]["metrics"]
    assert got["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert got["custom/ratio:sum"] == pytest.approx(metrics["custom/ratio:sum"], rel=1e-5)
    assert got["custom/kl:mean"] == pytest.approx(metrics["custom/kl:mean"] / len(data), rel=1e-5, abs=1e-6)
    trained = [fused.adapters["c"], fused.adapters["o"], client.adapters["c"], alone.adapters["o"]]
    assert all(p.grad is not None for a in trained for p in a.params)
    assert any(p.grad.any() for p in fused.adapters["c"].params)
    for p_fused, p_client in zip(fused.adapters["c"].params, client.adapters["c"].params, strict=True):
        torch.testing.assert_close(p_fused.grad, p_client.grad, rtol=1e-4, atol=1e-6)
    for p_fused, p_alone in zip(fused.adapters["o"].params, alone.adapters["o"].params, strict=True):
        torch.testing.assert_close(p_fused.grad, p_alone.grad, rtol=1e-5, atol=1e-7)


def test_a_custom_loss_that_fails_on_its_shapes_fails_only_its_request(base_path):
    fused, alone = _backends(base_path, 2)

    def wrong(logprobs, advantages):
        return (logprobs * advantages[:2]).sum(), {}  # [3] * [2]: the shapes disagree

    graph = parsed(wrong, {"logprobs": 1, "advantages": 1})
    data = [Datum((1, 2, 3), {"target_tokens": (2, 3, 4), "advantages": (1.0, 1.0, 1.0)})]
    outcomes = fused.run_pass([_ce("1", "o", 7), _custom("2", "c", graph, data)])
    expected = alone.run_pass([_ce("1", "o", 7)])[0]
    assert isinstance(outcomes[1], UserError)
    assert "data[0]" in outcomes[1].message and "node 'mul'" in outcomes[1].message
    assert outcomes[0]["metrics"] == expected["metrics"]
    assert all(p.grad is None or not p.grad.any() for p in fused.adapters["c"].params)


def test_indexing_by_a_tensor_is_refused_before_the_pass():
    def masked(logprobs):
        return logprobs[logprobs > -1.0].sum(), {}

    graph = parsed(masked, {"logprobs": 1})
    why = custom_losses.check(custom_losses.CustomDatum(0, 0, 5, 1, graph, ()))
    assert why is not None and "'getitem'" in why and "indexes by a tensor" in why
