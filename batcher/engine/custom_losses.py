"""Custom losses in the fused pass: a checked `core.custom_loss.LossGraph` rebuilt from this
module's own table of torch functions and run per datum on that datum's rows of the pass.

A graph names operations; `FUNCTIONS` maps each name `core.custom_loss.FUNCTIONS` allows to the
function it stands for (tests/test_custom_loss.py holds the two to the same keys), and a method is
looked up on `torch.Tensor` only, for a receiver that is a tensor, by a name in
`core.custom_loss.METHODS`. Python arithmetic on numbers that are not tensors is bounded, so no
node can build a giant integer or string.

A request's graph is first run on shape-only ("meta") tensors of each datum's shapes (`check`),
on the host while the pass is planned: a graph that fails there, or makes a tensor past
`MAX_RANK` or `MAX_ELEMENTS`, fails its own request before the pass, and the pass runs the others.
In the pass (`run`), each custom datum's loss is computed from its slice of the target logprobs
and added to the pass's per-datum losses, so the gradient gate, the non-finite check and the one
backward treat it as any other datum's; its metrics join the values read back at the end.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core import custom_loss as spec
from core.custom_loss import DType, LossGraph, Node, Ref, Slice

__all__ = ["FUNCTIONS", "CustomDatum", "GraphError", "check", "run", "run_batch"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
_NUMBER = (int, float, bool)


class GraphError(Exception):
    """A node of a custom loss failed or broke a bound; the message names it."""


def _plain(op: Callable[..., Any]) -> Callable[..., Any]:
    """A Python operator that refuses operands other than tensors and numbers (no string or list
    arithmetic), and integer powers past 64."""
    def call(*args: Any) -> Any:
        if not all(isinstance(a, (Tensor, *_NUMBER)) for a in args):
            raise GraphError(f"operands must be tensors or numbers, got {[type(a).__name__ for a in args]}")
        if op is operator.pow and all(isinstance(a, int) for a in args) and abs(args[1]) > 64:
            raise GraphError("an integer power above 64")
        return op(*args)
    return call


def _getitem(container: Any, index: Any) -> Any:
    """Indexing by numbers, slices, None and `...` only: a tensor index (its values decide what is
    read) could be out of range, a device assert on a GPU."""
    if not isinstance(container, (Tensor, tuple, torch.Size)):
        raise GraphError(f"indexes a {type(container).__name__}")
    if any(isinstance(i, Tensor) for i in (index if isinstance(index, tuple) else (index,))):
        raise GraphError("indexes by a tensor; use torch.where or masked_fill")
    return container[index]


def _getattr(value: Any, name: str) -> Any:
    if not isinstance(value, Tensor) or name not in spec.ATTRIBUTES:
        raise GraphError(f"reads {name!r} of a {type(value).__name__}")
    return getattr(value, name)


def _math(fn: Callable[[float], float]) -> Callable[[Any], float]:
    def call(x: Any) -> float:
        if not isinstance(x, _NUMBER):
            raise GraphError(f"math functions take numbers, got {type(x).__name__}")
        return fn(x)
    return call


_TORCH = ("abs", "add", "amax", "amin", "cat", "clamp", "clamp_max", "clamp_min", "clip", "cumsum", "div", "exp",
          "expm1", "full_like", "isfinite", "log", "log1p", "log_softmax", "logaddexp", "logsumexp",
          "maximum", "mean", "minimum", "mul", "nan_to_num", "neg", "ones_like", "pow", "relu", "rsqrt", "sigmoid",
          "sign", "softmax", "sqrt", "square", "stack", "sub", "sum", "tanh", "where", "zeros_like")
_OPERATORS = ("abs", "add", "and_", "eq", "floordiv", "ge", "gt", "invert", "le", "lt", "mul", "ne", "neg", "or_",
              "pos", "pow", "sub", "truediv")

FUNCTIONS: Mapping[str, Callable[..., Any]] = {
    **{f"torch.{name}": getattr(torch, name) for name in _TORCH},
    "torch.nn.functional.log_softmax": F.log_softmax, "torch.nn.functional.softmax": F.softmax,
    "torch.nn.functional.relu": F.relu, "torch._C._nn.log_sigmoid": F.logsigmoid, "torch._C._nn.softplus": F.softplus,
    **{f"operator.{name}": _plain(getattr(operator, name)) for name in _OPERATORS},
    "operator.getitem": _getitem,
    "math.exp": _math(math.exp), "math.log": _math(math.log), "math.sqrt": _math(math.sqrt),
    "getattr": _getattr,
}


def _value(arg: Any, env: Mapping[str, Any]) -> Any:
    """An argument with its references, slices and dtypes made values."""
    if isinstance(arg, Ref):
        return env[arg.name]
    if isinstance(arg, Slice):
        return slice(_value(arg.start, env), _value(arg.stop, env), _value(arg.step, env))
    if isinstance(arg, DType):
        return _DTYPES[arg.name]
    if isinstance(arg, tuple):
        return tuple(_value(a, env) for a in arg)
    if isinstance(arg, list):
        return [_value(a, env) for a in arg]
    if isinstance(arg, dict):
        return {k: _value(v, env) for k, v in arg.items()}
    return arg


def _bounded(value: Any) -> Any:
    """A node's result, refused past the bounds on tensors and integers."""
    for part in (value if isinstance(value, tuple) else (value,)):
        if isinstance(part, Tensor) and (part.dim() > spec.MAX_RANK or part.numel() > spec.MAX_ELEMENTS):
            raise GraphError(f"makes a tensor of shape {tuple(part.shape)}; the limits are rank {spec.MAX_RANK} "
                             f"and {spec.MAX_ELEMENTS} elements")
        if isinstance(part, int) and abs(part) > 1 << 62:
            raise GraphError("makes an integer beyond 2**62")
    return value


def _call(node: Node, env: Mapping[str, Any]) -> Any:
    args = [_value(a, env) for a in node.args]
    kwargs = {k: _value(v, env) for k, v in node.kwargs.items()}
    if node.op == "call_function":
        return FUNCTIONS[node.target](*args, **kwargs)
    receiver = args[0]
    if not isinstance(receiver, Tensor):
        raise GraphError(f"calls method {node.target!r} of a {type(receiver).__name__}")
    if node.target == "to" and not all(isinstance(a, (torch.dtype, Tensor)) for a in (*args[1:], *kwargs.values())):
        raise GraphError("to() takes a dtype only; the trainer decides where a loss runs")
    return getattr(Tensor, node.target)(*args, **kwargs)


def evaluate(graph: LossGraph, inputs: Sequence[Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """The graph on these inputs (logprobs first): (loss, metrics); GraphError naming the node that
    failed or broke a bound."""
    env: dict[str, Any] = dict(zip(graph.placeholders, inputs, strict=True))
    for node in graph.nodes:
        try:
            env[node.name] = _bounded(_call(node, env))
        except GraphError as exc:
            raise GraphError(f"node {node.name!r} ({node.target}): {exc}") from None
        except Exception as exc:  # torch's own errors: wrong shapes, dtypes, arguments
            raise GraphError(f"node {node.name!r} ({node.target}) failed: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None
    loss, metrics = env[graph.loss], {k: env[v] for k, v in graph.metrics.items()}
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        raise GraphError(f"the loss must be a floating-point scalar tensor, got {_shown(loss)}")
    for key, value in metrics.items():
        if not isinstance(value, Tensor) or value.numel() != 1:
            raise GraphError(f"metric {key!r} must be a tensor of one element, got {_shown(value)}")
    return loss.reshape(()), {k: v.reshape(()) for k, v in metrics.items()}


def _shown(value: Any) -> str:
    return f"shape {tuple(value.shape)} {value.dtype}" if isinstance(value, Tensor) else type(value).__name__


@dataclass(frozen=True)
class CustomDatum:
    """A custom-loss datum of a micro-batch: its index among the plan's datums, its first position,
    its positions and targets per position, its graph and its inputs (host tensors, the loss's order)."""

    datum: int
    start: int
    n: int
    width: int
    graph: LossGraph
    inputs: tuple[Tensor, ...]

    def logprobs(self, lp_M_K: Tensor) -> Tensor:
        """This datum's target logprobs, float32 as the client's fallback sees them: [n], or [n, K]."""
        rows = lp_M_K[self.start:self.start + self.n].float()
        return rows[:, :self.width] if self.graph.inputs[0][1] == 2 else rows[:, 0]


def input_tensors(graph: LossGraph, values: Mapping[str, Sequence[Any]], n: int) -> tuple[Tensor, ...]:
    """A datum's `loss_fn_inputs` as the loss takes them, by their declared ranks (float32, as the
    SDK's TensorData gives them)."""
    out = []
    for name, rank in graph.inputs[1:]:
        t = torch.tensor(values[name], dtype=torch.float32)
        out.append(t.reshape(()) if rank == 0 else t.view(n, -1) if rank == 2 else t)
    return tuple(out)


def check(datum: CustomDatum) -> str | None:
    """Why the datum's graph cannot run on its shapes (run on meta tensors, nothing allocated), or None."""
    shape = (datum.n, datum.width) if datum.graph.inputs[0][1] == 2 else (datum.n,)
    meta = [torch.empty(shape, device="meta"), *(t.to("meta") for t in datum.inputs)]
    try:
        evaluate(datum.graph, meta)
    except GraphError as exc:
        return f"custom loss {datum.graph.name!r}: {exc}"
    return None


def run(datum: CustomDatum, lp_M_K: Tensor, device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """One datum's loss and its metrics (in the graph's metric order), on the device."""
    loss, metrics = evaluate(datum.graph, [datum.logprobs(lp_M_K), *(t.to(device) for t in datum.inputs)])
    return loss, list(metrics.values())


def run_batch(custom: Sequence[CustomDatum], lp_M_K: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Every custom datum of a micro-batch: a (size,) tensor of their losses at their datums' places
    (zero elsewhere) and their metrics, flat, in datum order."""
    parts = [run(d, lp_M_K, lp_M_K.device) for d in custom]
    at = torch.tensor([d.datum for d in custom], device=lp_M_K.device)
    losses = lp_M_K.new_zeros(size, dtype=torch.float32).index_put((at,), torch.stack([loss.float() for loss, _ in parts]))
    metrics = [m.detach().double().reshape(1) for _, ms in parts for m in ms]
    return losses, torch.cat(metrics) if metrics else lp_M_K.new_zeros(0, dtype=torch.float64)
