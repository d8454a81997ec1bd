"""The nouns of the training API: tensors, inputs, datums, optimizer settings and results.

Each type knows its own JSON wire form (``to_json`` / ``from_json``). Array-likes from numpy or
torch are accepted wherever a list is, through their ``.tolist()``, so the SDK never imports
those libraries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "TensorData",
    "EncodedTextChunk",
    "ModelInput",
    "Datum",
    "AdamParams",
    "ForwardBackwardOutput",
    "OptimStepResult",
    "TrainStepResult",
    "LOSS_FN_INPUT_DTYPES",
    "datum_for_next_token",
]

DTYPES = ("int64", "float32")

#: dtype used when a ``loss_fn_inputs`` value is given as a plain list.
LOSS_FN_INPUT_DTYPES: Mapping[str, str] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}


def _as_list(values: Any) -> Any:
    if hasattr(values, "tolist"):
        return values.tolist()
    return values


def _flatten(values: Any) -> tuple[list[Any], list[int]]:
    """Flatten nested sequences in C order; return (flat values, shape)."""
    values = _as_list(values)
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"expected a list or array of numbers, got {type(values).__name__}")
    if not values or not isinstance(_as_list(values[0]), (list, tuple)):
        return list(values), [len(values)]
    flat: list[Any] = []
    inner_shape: list[int] | None = None
    for row in values:
        row_flat, row_shape = _flatten(row)
        if inner_shape is None:
            inner_shape = row_shape
        elif row_shape != inner_shape:
            raise ValueError(f"ragged nested list: rows of shape {inner_shape} and {row_shape}")
        flat.extend(row_flat)
    return flat, [len(values), *(inner_shape or [])]


def _product(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


@dataclass(frozen=True)
class TensorData:
    """A dense tensor on the wire: flat C-order ``data``, a ``dtype`` and its ``shape``.

    ``data`` may be given nested (``[[1, 2], [3, 4]]``) or as an array-like with ``.tolist()``;
    it is stored flat, with ``shape`` inferred when not given. ``dtype`` is ``"int64"`` or
    ``"float32"``, and values are cast to int or float accordingly.
    """

    data: list[Any]
    dtype: str
    shape: list[int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        flat, inferred = _flatten(self.data)
        cast = int if self.dtype == "int64" else float
        shape = inferred if self.shape is None else [int(s) for s in self.shape]
        if _product(shape) != len(flat):
            raise ValueError(f"shape {shape} does not hold {len(flat)} values")
        object.__setattr__(self, "data", [cast(v) for v in flat])
        object.__setattr__(self, "shape", shape)

    @classmethod
    def from_list(cls, values: Any, dtype: str, shape: Sequence[int] | None = None) -> TensorData:
        """Build from a (possibly nested) list or an object with ``.tolist()``."""
        return cls(data=values, dtype=dtype, shape=list(shape) if shape is not None else None)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorData:
        """Parse the wire form ``{"data", "dtype", "shape"?}``."""
        return cls(data=obj["data"], dtype=obj.get("dtype", "float32"), shape=obj.get("shape"))

    def to_json(self) -> dict[str, Any]:
        """The wire form ``{"data", "dtype", "shape"}``."""
        return {"data": list(self.data), "dtype": self.dtype, "shape": list(self.shape or [])}

    def tolist(self) -> list[Any]:
        """The values nested according to ``shape`` (like ``numpy.ndarray.tolist``)."""
        values: list[Any] = list(self.data)
        for size in reversed((self.shape or [len(values)])[1:]):
            values = [values[i : i + size] for i in range(0, len(values), size)]
        return values


@dataclass(frozen=True)
class EncodedTextChunk:
    """A run of token ids inside a :class:`ModelInput`."""

    tokens: list[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", [int(t) for t in _as_list(self.tokens)])

    @property
    def length(self) -> int:
        """Number of tokens in this chunk."""
        return len(self.tokens)

    def to_json(self) -> dict[str, Any]:
        """The wire form ``{"type": "encoded_text", "tokens": [...]}``."""
        return {"type": "encoded_text", "tokens": list(self.tokens)}


@dataclass(frozen=True)
class ModelInput:
    """The tokens a model reads, as a list of chunks."""

    chunks: list[EncodedTextChunk]

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", list(self.chunks))

    @classmethod
    def from_ints(cls, tokens: Sequence[int] | Any) -> ModelInput:
        """One chunk holding ``tokens`` (a list of ints or an array-like)."""
        return cls(chunks=[EncodedTextChunk(tokens=_as_list(tokens))])

    def to_ints(self) -> list[int]:
        """All token ids, chunks concatenated."""
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        """Total number of tokens."""
        return sum(chunk.length for chunk in self.chunks)

    def to_json(self) -> dict[str, Any]:
        """The wire form ``{"chunks": [...]}``."""
        return {"chunks": [chunk.to_json() for chunk in self.chunks]}


def _loss_input(key: str, value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value
    dtype = LOSS_FN_INPUT_DTYPES.get(key)
    if dtype is None and hasattr(value, "dtype") and hasattr(value, "tolist"):
        # numpy / torch carry their own dtype; only plain lists need the key table.
        name = str(value.dtype)
        dtype = "int64" if ("int" in name or "bool" in name) else "float32"
    if dtype is None:
        raise ValueError(
            f"loss_fn_inputs[{key!r}] is a plain list, and {key!r} has no known dtype. "
            f"Wrap it: quilt.TensorData(data=..., dtype='float32' or 'int64'). "
            f"Known keys: {', '.join(LOSS_FN_INPUT_DTYPES)}."
        )
    return TensorData.from_list(value, dtype)


@dataclass(frozen=True)
class Datum:
    """One training example: the ``model_input`` tokens and the loss function's inputs.

    ``loss_fn_inputs`` maps names (``target_tokens``, ``weights``, ``advantages``, ...) to
    TensorData; lists and array-likes are converted using :data:`LOSS_FN_INPUT_DTYPES`.
    ``model_input`` may also be given as a plain list of token ids. ``policy_version`` names the
    policy version (optimizer steps) of the weights that sampled this datum's tokens; the server
    then reports its staleness and can drop it past ``loss_fn_config["max_staleness"]``.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)
    policy_version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            object.__setattr__(self, "model_input", ModelInput.from_ints(self.model_input))
        converted = {key: _loss_input(key, value) for key, value in self.loss_fn_inputs.items()}
        object.__setattr__(self, "loss_fn_inputs", converted)
        if self.policy_version is not None and (isinstance(self.policy_version, bool)
                                                or not isinstance(self.policy_version, int)
                                                or self.policy_version < 0):
            raise ValueError(f"policy_version must be an int >= 0, got {self.policy_version!r}")

    def to_json(self) -> dict[str, Any]:
        """The wire form ``{"model_input": {...}, "loss_fn_inputs": {name: TensorData}, "policy_version"?}``."""
        body: dict[str, Any] = {
            "model_input": self.model_input.to_json(),
            "loss_fn_inputs": {k: v.to_json() for k, v in self.loss_fn_inputs.items()},
        }
        if self.policy_version is not None:
            body["policy_version"] = self.policy_version
        return body


def datum_for_next_token(tokens: Sequence[int] | Any, weights: Sequence[float] | Any = None) -> Datum:
    """A next-token-prediction Datum: read ``tokens[:-1]``, predict ``tokens[1:]``.

    ``weights`` (one per target, i.e. ``len(tokens) - 1`` values) default to 1.0; a list with
    one weight per token of ``tokens`` is also accepted and shifted like the targets (its first
    value, for a token nobody predicts, is dropped).
    """
    ids = [int(t) for t in _as_list(tokens)]
    if len(ids) < 2:
        raise ValueError("datum_for_next_token needs at least 2 tokens (one input, one target)")
    targets = ids[1:]
    if weights is None:
        per_target = [1.0] * len(targets)
    else:
        given = [float(w) for w in _as_list(weights)]
        if len(given) == len(ids):
            given = given[1:]
        if len(given) != len(targets):
            raise ValueError(
                f"weights has {len(given)} values; expected {len(targets)} (one per target) "
                f"or {len(ids)} (one per token)"
            )
        per_target = given
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(targets, "int64"),
            "weights": TensorData(per_target, "float32"),
        },
    )


@dataclass(frozen=True)
class AdamParams:
    """AdamW settings for one ``optim_step``; they may change every step (LR schedules).

    Attributes:
        learning_rate: step size (>= 0).
        beta1, beta2: moment decay rates, in [0, 1).
        eps: denominator epsilon.
        weight_decay: decoupled (AdamW) weight decay; 0 disables it.
        grad_clip_norm: global gradient-norm clip; 0 disables clipping.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def to_json(self) -> dict[str, float]:
        """The wire form (the ``adam_params`` object)."""
        return {k: float(v) for k, v in asdict(self).items()}


def _metrics(obj: Any) -> dict[str, float]:
    return {str(k): v for k, v in (obj or {}).items()}


def _loss_sum(metrics: Mapping[str, float]) -> float:
    if "loss:sum" not in metrics:
        raise KeyError(f"no 'loss:sum' in metrics (got {sorted(metrics)})")
    return float(metrics["loss:sum"])


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Result of ``forward`` / ``forward_backward``.

    Attributes:
        loss_fn_output_type: name of the output layout reported by the server.
        loss_fn_outputs: one dict per datum, in order (``"logprobs"`` at least).
        metrics: reduced metrics, keyed ``name:reduction`` (``"loss:sum"`` always).
    """

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]

    @property
    def loss(self) -> float:
        """The summed loss, ``metrics["loss:sum"]``."""
        return _loss_sum(self.metrics)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ForwardBackwardOutput:
        """Parse the ``retrieve_future`` result."""
        outputs = [
            {name: TensorData.from_json(tensor) for name, tensor in per_datum.items()}
            for per_datum in obj.get("loss_fn_outputs") or []
        ]
        return cls(
            loss_fn_output_type=str(obj.get("loss_fn_output_type", "")),
            loss_fn_outputs=outputs,
            metrics=_metrics(obj.get("metrics")),
        )


@dataclass(frozen=True)
class OptimStepResult:
    """Result of ``optim_step``: free-form optimizer ``metrics`` (may be empty)."""

    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> OptimStepResult:
        """Parse the ``retrieve_future`` result."""
        return cls(metrics=_metrics(obj.get("metrics")))


@dataclass(frozen=True)
class TrainStepResult:
    """Result of ``train_step``: the forward_backward and optim_step results together."""

    forward_backward: ForwardBackwardOutput
    optim: OptimStepResult

    @property
    def loss(self) -> float:
        """The summed loss of the forward_backward pass, ``metrics["loss:sum"]``."""
        return self.forward_backward.loss

    @property
    def metrics(self) -> dict[str, float]:
        """forward_backward metrics merged with optimizer metrics (the latter win on clashes)."""
        return {**self.forward_backward.metrics, **self.optim.metrics}
