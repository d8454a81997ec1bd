"""Custom losses as data: the tinker SDK's traced `torch.fx` graph (`create_custom_loss`), checked
against Quilt's own allow-list and held as a frozen `LossGraph` that crosses from the API to the
trainer inside the work item (`core.work.PassWork.custom`).

Torch-free, so the API refuses a graph without importing torch. Nothing here is executable: the
graph names its operations by wire name (`torch.exp`, `operator.mul`, a tensor method `sum`), and
the trainer (`batcher.engine.custom_losses`) looks each name up in its own table of functions; a
name outside `FUNCTIONS`, `METHODS` or `ATTRIBUTES` never gets that far. There is no eval, no
import and no attribute read by a name the graph chooses.

Static bounds (each refusal is an `InvalidInput` naming the node, `graph.nodes[i] 'name'`):
`MAX_NODES` nodes, arguments nested `MAX_ARG_DEPTH` containers deep, every constant finite, every
integer within `MAX_INT`, every size given to a shaping method within `MAX_ELEMENTS`, no `out=`
and no in-place method. The trainer adds the bounds that depend on a datum's shapes (rank
`MAX_RANK`, `MAX_ELEMENTS` per intermediate) by running the graph on shape-only tensors first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput

MAX_NODES = 1024
MAX_ARG_DEPTH = 4  # containers inside one argument: an output's (loss, {metric: x}) takes 2
MAX_INPUTS = 16  # logprobs included (the SDK's bound)
MAX_RANK = 4  # of any tensor the loss makes
MAX_ELEMENTS = 1 << 22  # of any tensor the loss makes, and of any size it asks for
MAX_INT = 1 << 31
MAX_TEXT = 64  # a string constant, a node's name

# torch functions and Python operators a loss may call, by the name the SDK sends.
FUNCTIONS = frozenset({
    *(f"torch.{name}" for name in (
        "abs", "add", "amax", "amin", "cat", "clamp", "clamp_max", "clamp_min", "clip", "cumsum", "div",
        "exp", "expm1", "full_like", "isfinite", "log", "log1p", "log_softmax", "logaddexp",
        "logsumexp", "maximum", "mean", "minimum", "mul", "nan_to_num", "neg", "ones_like", "pow", "relu",
        "rsqrt", "sigmoid", "sign", "softmax", "sqrt", "square", "stack", "sub", "sum", "tanh", "where",
        "zeros_like")),
    "torch.nn.functional.log_softmax", "torch.nn.functional.softmax", "torch.nn.functional.relu",
    "torch._C._nn.log_sigmoid", "torch._C._nn.softplus",
    *(f"operator.{name}" for name in (
        "abs", "add", "and_", "eq", "floordiv", "ge", "getitem", "gt", "invert", "le", "lt", "mul", "ne",
        "neg", "or_", "pos", "pow", "sub", "truediv")),
    "math.exp", "math.log", "math.sqrt",
    "getattr",  # only of a tensor, only the attributes in ATTRIBUTES
})

# Tensor methods a loss may call: none in place, none that leaves torch (item, tolist, numpy). Nothing
# indexes by a tensor's values (gather, integer tensor indices): an index out of range is a device
# assert on a GPU, which would end the pass every tenant shares.
METHODS = frozenset({
    "abs", "add", "amax", "amin", "clamp", "clamp_max", "clamp_min", "clip", "cumsum", "detach", "dim", "div",
    "double", "eq", "exp", "expand", "expm1", "flatten", "float", "ge", "gt", "isfinite", "le", "log",
    "log1p", "log_softmax", "logsumexp", "lt", "masked_fill", "max", "maximum", "mean", "min", "minimum",
    "mul", "ne", "neg", "new_full", "new_ones", "new_zeros", "numel", "pow", "relu", "reshape", "rsqrt",
    "sigmoid", "sign", "size", "softmax", "sqrt", "square", "squeeze", "sub", "sum", "t", "tanh", "to",
    "transpose", "type_as", "unsqueeze", "view",
})

# The tensor attributes `getattr` may read.
ATTRIBUTES = frozenset({"shape", "ndim", "dtype"})

# Methods whose integer arguments are a size: their product is bounded like a tensor's elements.
SIZE_METHODS = frozenset({"expand", "new_full", "new_ones", "new_zeros", "reshape", "view"})

DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_INPUT = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_WIRE_KEYS = ("ref", "tuple", "dict", "slice", "ellipsis", "float", "dtype", "device", "layout", "memory_format")


@dataclass(frozen=True)
class Ref:
    """An earlier node's value."""

    name: str


@dataclass(frozen=True)
class Slice:
    start: Any
    stop: Any
    step: Any


@dataclass(frozen=True)
class DType:
    name: str


@dataclass(frozen=True)
class Node:
    """One operation: `op` is `call_function` (target in FUNCTIONS) or `call_method` (in METHODS);
    args and kwargs hold constants, `Ref`s, `Slice`s, `DType`s, `...`, and lists, tuples and dicts of them."""

    op: str
    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class LossGraph:
    """A checked custom loss: its inputs (logprobs first) with their ranks, its operations in order,
    and what it returns: the loss node and each metric's node."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    placeholders: tuple[str, ...]  # each input's node name (torch.fx may rename a parameter)
    nodes: tuple[Node, ...]
    loss: str
    metrics: Mapping[str, str]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The `loss_fn_inputs` keys the loss reads (logprobs is the datum's target logprobs)."""
        return tuple(name for name, _ in self.inputs[1:])

    def to_json(self) -> dict[str, Any]:
        """The graph in the SDK's wire form (what `parse` reads back)."""
        nodes: list[dict[str, Any]] = [{"op": "placeholder", "name": node, "target": name, "args": [], "kwargs": {}}
                                       for (name, _), node in zip(self.inputs, self.placeholders, strict=True)]
        nodes += [{"op": n.op, "name": n.name, "target": n.target, "args": [_encode(a) for a in n.args],
                   "kwargs": {k: _encode(v) for k, v in n.kwargs.items()}} for n in self.nodes]
        out = {"tuple": [{"ref": self.loss}, {"dict": {k: {"ref": v} for k, v in self.metrics.items()}}]}
        nodes.append({"op": "output", "name": "output", "target": "output", "args": [out], "kwargs": {}})
        return {"name": self.name, "inputs": [{"name": n, "rank": r} for n, r in self.inputs],
                "graph": {"format": 1, "nodes": nodes}}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LossGraph:
        return parse(obj["name"], obj["inputs"], obj["graph"])


def _encode(value: Any) -> Any:
    if isinstance(value, Ref):
        return {"ref": value.name}
    if isinstance(value, Slice):
        return {"slice": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if isinstance(value, DType):
        return {"dtype": value.name}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    return value


class _Where:
    """Names the node being read in every refusal."""

    def __init__(self, index: int, name: object):
        self.index = index
        self.name = name

    def refuse(self, message: str) -> InvalidInput:
        shown = repr(self.name)[:MAX_TEXT + 2]
        return InvalidInput(f"graph.nodes[{self.index}] {shown}: {message}", field=f"graph.nodes[{self.index}]")


def _number(where: _Where, value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise where.refuse(f"integer constant {value} is beyond the limit of {MAX_INT}")
        return value
    if not math.isfinite(value):
        raise where.refuse(f"constant {value!r} is not finite; a custom loss's constants must be")
    return value


def _arg(where: _Where, raw: Any, known: set[str], depth: int) -> Any:
    """One encoded argument, decoded; refused unless every part of it is allowed."""
    if raw is None or isinstance(raw, (bool, int, float)):
        return _number(where, raw)
    if isinstance(raw, str):
        if len(raw) > MAX_TEXT:
            raise where.refuse(f"a string constant is longer than {MAX_TEXT} characters")
        return raw
    if depth >= MAX_ARG_DEPTH:
        raise where.refuse(f"arguments nest deeper than {MAX_ARG_DEPTH} containers")
    if isinstance(raw, list):
        return [_arg(where, a, known, depth + 1) for a in raw]
    if not isinstance(raw, dict) or len(raw) != 1:
        raise where.refuse(f"an argument must be a constant, a list or a one-key object, got {type(raw).__name__}")
    [(kind, value)] = raw.items()
    if kind == "ref":
        if not isinstance(value, str) or value not in known:
            raise where.refuse(f"refers to {str(value)[:MAX_TEXT]!r}, which is no earlier node")
        return Ref(value)
    if kind == "tuple" and isinstance(value, list):
        return tuple(_arg(where, a, known, depth + 1) for a in value)
    if kind == "dict" and isinstance(value, dict):
        return {_text(where, k): _arg(where, a, known, depth + 1) for k, a in value.items()}
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        return Slice(*(_arg(where, a, known, depth + 1) for a in value))
    if kind == "ellipsis" and value is True:
        return Ellipsis
    if kind == "dtype" and value in DTYPES:
        return DType(value)
    if kind == "float":
        raise where.refuse(f"constant {str(value)[:MAX_TEXT]!r} is not finite; a custom loss's constants must be")
    if kind in _WIRE_KEYS:
        raise where.refuse(f"a {kind} argument {str(value)[:MAX_TEXT]!r} is not accepted (dtypes: {sorted(DTYPES)}); "
                           "the trainer decides where a loss runs")
    raise where.refuse(f"unknown argument kind {str(kind)[:MAX_TEXT]!r}")


def _text(where: _Where, value: object) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise where.refuse(f"a key must be a string of at most {MAX_TEXT} characters")
    return value


def _size_product(args: Sequence[Any]) -> int:
    """The elements a shaping method's integer arguments ask for (a size may come as one tuple)."""
    product = 1
    for a in args:
        for v in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(v, int) and not isinstance(v, bool):
                product *= max(abs(v), 1)
    return product


def _operation(where: _Where, node: Mapping[str, Any], known: set[str]) -> Node:
    op, target = node.get("op"), node.get("target")
    if op == "call_function" and target not in FUNCTIONS:
        raise where.refuse(f"calls {str(target)[:MAX_TEXT * 2]!r}, which is not in Quilt's list of functions "
                           "(see the losses page of the docs)")
    if op == "call_method" and target not in METHODS:
        raise where.refuse(f"calls tensor method {str(target)[:MAX_TEXT]!r}, which is not in Quilt's list of methods")
    if op not in ("call_function", "call_method"):
        raise where.refuse(f"op {str(op)[:MAX_TEXT]!r} is not accepted here; a custom loss calls functions and "
                           "tensor methods only (no modules, no captured tensors)")
    raw_args, raw_kwargs = node.get("args", []), node.get("kwargs", {})
    if not isinstance(raw_args, list) or not isinstance(raw_kwargs, dict):
        raise where.refuse("args must be a list and kwargs an object")
    args = tuple(_arg(where, a, known, 0) for a in raw_args)
    kwargs = {_text(where, k): _arg(where, v, known, 0) for k, v in raw_kwargs.items()}
    if "out" in kwargs:
        raise where.refuse("passes out=; a custom loss writes into no tensor")
    if op == "call_method" and not (args and isinstance(args[0], Ref)):
        raise where.refuse("a method's first argument must be an earlier node")
    if target == "getattr" and not (len(args) == 2 and isinstance(args[0], Ref) and args[1] in ATTRIBUTES):
        raise where.refuse(f"getattr reads only {sorted(ATTRIBUTES)} of an earlier node")
    if op == "call_method" and target in SIZE_METHODS and _size_product(args[1:]) > MAX_ELEMENTS:
        raise where.refuse(f"asks for a size of more than {MAX_ELEMENTS} elements")
    return Node(op, str(node["name"]), str(target), args, kwargs)


def _inputs(raw_inputs: object) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw_inputs, list) or not 1 <= len(raw_inputs) <= MAX_INPUTS:
        raise InvalidInput(f"inputs: must list 1 to {MAX_INPUTS} inputs, logprobs first", field="inputs")
    out = []
    for i, item in enumerate(raw_inputs):
        name = item.get("name") if isinstance(item, dict) else None
        rank = item.get("rank") if isinstance(item, dict) else None
        if not isinstance(name, str) or not _INPUT.fullmatch(name) or isinstance(rank, bool) or rank not in (0, 1, 2):
            raise InvalidInput(f"inputs[{i}]: needs a lowercase name and a rank of 0, 1 or 2", field=f"inputs[{i}]")
        out.append((name, int(rank)))
    names = [n for n, _ in out]
    if names[0] != "logprobs" or out[0][1] == 0 or len(set(names)) != len(names) or "target_tokens" in names:
        raise InvalidInput("inputs: logprobs comes first, with rank 1 or 2, then distinct loss_fn_inputs keys "
                           "other than target_tokens", field="inputs")
    return tuple(out)


def _output(where: _Where, node: Mapping[str, Any], known: set[str]) -> tuple[str, dict[str, str]]:
    args = node.get("args")
    value = _arg(where, args[0], known, 0) if isinstance(args, list) and len(args) == 1 else None
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], Ref)
            and isinstance(value[1], dict)):
        raise where.refuse("a custom loss returns (loss, {metric: value}) with the loss an earlier node")
    metrics = {}
    for key, ref in value[1].items():
        if not METRIC_KEY.fullmatch(key) or not isinstance(ref, Ref):
            raise where.refuse(f"metric {key[:MAX_TEXT]!r} must be named custom/<name>:sum or custom/<name>:mean "
                               "and be an earlier node")
        metrics[key] = ref.name
    return value[0].name, metrics


def parse(name: object, raw_inputs: object, raw_graph: object) -> LossGraph:
    """A `create_custom_loss` request's name, inputs and graph, checked whole; InvalidInput naming
    the first node (or field) that breaks a rule."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_TEXT * 2:
        raise InvalidInput(f"name: must be 1 to {MAX_TEXT * 2} characters", field="name")
    inputs = _inputs(raw_inputs)
    nodes = raw_graph.get("nodes") if isinstance(raw_graph, dict) else None
    if not isinstance(raw_graph, dict) or raw_graph.get("format", 1) != 1 or not isinstance(nodes, list):
        raise InvalidInput("graph: must be {\"format\": 1, \"nodes\": [...]}", field="graph")
    if len(nodes) > MAX_NODES:
        raise _Where(MAX_NODES, nodes[MAX_NODES].get("name") if isinstance(nodes[MAX_NODES], dict) else None).refuse(
            f"the graph has {len(nodes)} nodes; a custom loss has at most {MAX_NODES}")
    known: set[str] = set()
    operations: list[Node] = []
    result: tuple[str, dict[str, str]] | None = None
    for i, node in enumerate(nodes):
        where = _Where(i, node.get("name") if isinstance(node, dict) else None)
        if not isinstance(node, dict) or not isinstance(where.name, str) or not _NAME.fullmatch(where.name):
            raise where.refuse("a node is an object whose name is a Python identifier of at most 64 characters")
        if where.name in known or result is not None or (where.name == "output" and node.get("op") != "output"):
            raise where.refuse("repeats a node's name, follows the output node, or takes the output's name")
        if i < len(inputs):
            if node.get("op") != "placeholder" or node.get("target") != inputs[i][0]:
                raise where.refuse(f"must be the placeholder of input {inputs[i][0]!r} (inputs come first, in order)")
        elif node.get("op") == "output":
            result = _output(where, node, known)
        else:
            operations.append(_operation(where, node, known))
        known.add(where.name)
    if result is None:
        raise InvalidInput("graph: has no output node after its inputs", field="graph.nodes")
    return LossGraph(name, inputs, tuple(str(n["name"]) for n in nodes[:len(inputs)]), tuple(operations), *result)
