"""Validate and normalise training data. One function for every encoding (JSON, and protobuf for
the tinker SDK): each decoder produces `RawDatum`s, this module checks them and the loss config
against the limits and the base model's vocabulary and builds the `PassWork` the trainer receives.
Nothing is checked again behind this point.

Each error names the field (`data[3].loss_fn_inputs.weights`) and the limit it broke.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.provenance import Provenance
from core import numbers
from core.custom_loss import LossGraph
from core.errors import InvalidInput
from core.loss_spec import CUSTOM, INT_INPUTS, MAX_TARGET_WIDTH, WIDE_INPUTS, LossConfig, LossSpec, parse_loss_config
from core.work import Datum, ImageInput, PassWork

# Per-token clip thresholds: the range their config counterparts must lie in.
_THRESHOLD_RANGES = {"clip_low_threshold": (0.0, 1.0), "clip_high_threshold": (1.0, math.inf)}


@dataclass(frozen=True)
class RawTensor:
    data: list
    dtype: str
    shape: list[int] | None


@dataclass(frozen=True)
class RawDatum:
    tokens: Sequence[int | float]  # as sent: `normalise` checks that they are token ids
    inputs: dict[str, RawTensor]
    policy_version: int | None = None  # the sampler's policy version, for staleness accounting
    # Images as sent, at their place among `tokens` (api.images.expand turns them into image tokens
    # and ImageInputs), then the checked ones.
    raw_images: tuple[RawImage, ...] = ()
    images: tuple[ImageInput, ...] = ()
    provenance: Provenance | None = None  # which sampled sequence each token came from (api.provenance)


@dataclass(frozen=True)
class RawImage:
    """An image chunk as sent: where it lies among the datum's text tokens, its bytes (or a
    pointer's location), its format and the tokens the client expects it to take."""

    at: int
    format: str
    data: bytes | None
    location: str | None = None
    expected_tokens: int | None = None


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context_length: int
    max_datums: int
    max_tokens: int


def _token_error(field: str, token: object, vocab: int) -> InvalidInput:
    return InvalidInput(f"{field}: token id {token!r} is outside the vocabulary [0, {vocab})", field=field)


def _check_tokens(field: str, tokens: Sequence[int | float], vocab: int) -> list[int]:
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            # JSON may carry 3.0 for 3; accept exact integers only.
            if isinstance(t, float) and t.is_integer() and 0 <= t < vocab:
                continue
            raise _token_error(field, t, vocab)
    return [int(t) for t in tokens]


def _width(field: str, key: str, tensor: RawTensor, n_tokens: int, loss_fn: str) -> int:
    """The values per position the tensor's shape declares: 1 for `[n]` (or no shape), K for
    `[n, K]` (top-K targets of cross_entropy only)."""
    shape = tensor.shape
    if shape is None or len(shape) == 1:
        if shape is not None and shape[0] != len(tensor.data):
            raise InvalidInput(f"{field}: shape {shape} does not match {len(tensor.data)} values", field=field)
        return 1
    if len(shape) != 2 or key not in WIDE_INPUTS or loss_fn != "cross_entropy":
        wide = " or [n, K] (target_tokens and weights of cross_entropy)" if loss_fn == "cross_entropy" else ""
        raise InvalidInput(f"{field}: shape {shape} is not accepted; expected [{n_tokens}]{wide}", field=field)
    rows, width = shape
    if rows != n_tokens:
        raise InvalidInput(f"{field}: shape {shape} has {rows} rows but model_input has {n_tokens} tokens; "
                           "they must be equal", field=field)
    if not isinstance(width, int) or not 1 <= width <= MAX_TARGET_WIDTH:
        raise InvalidInput(f"{field}: {width!r} targets per position; the limit is {MAX_TARGET_WIDTH}", field=field)
    if rows * width != len(tensor.data):
        raise InvalidInput(f"{field}: shape {shape} does not match {len(tensor.data)} values", field=field)
    return width


def _flat_values(field: str, tensor: RawTensor, n_tokens: int, width: int) -> list:
    if len(tensor.data) != n_tokens * width:
        raise InvalidInput(
            f"{field}: has {len(tensor.data)} values but model_input has {n_tokens} tokens; they must be equal",
            field=field,
        )
    return tensor.data


def _common_width(where: str, widths: dict[str, int]) -> int:
    """One datum's targets per position: `target_tokens` and `weights` agree, and top-K targets
    come with their weights."""
    width = widths.get("target_tokens", 1)
    if widths.get("weights", width) != width:
        raise InvalidInput(f"{where}.loss_fn_inputs.weights: has {widths['weights']} values per position but "
                           f"target_tokens has {width}; they must have the same shape",
                           field=f"{where}.loss_fn_inputs.weights")
    if width > 1 and "weights" not in widths:
        raise InvalidInput(f"{where}.loss_fn_inputs.weights: top-K target_tokens (shape [n, {width}]) need weights "
                           "of the same shape", field=f"{where}.loss_fn_inputs.weights")
    if width > 1 and "logprobs" in widths:
        raise InvalidInput(f"{where}.loss_fn_inputs.logprobs: sampler logprobs are per sampled token and do not go "
                           f"with top-K target_tokens (shape [n, {width}])", field=f"{where}.loss_fn_inputs.logprobs")
    return width


def _check_floats(field: str, key: str, values: list) -> tuple[float, ...]:
    # The trainer computes in float32: 1e300 is a float here but infinite there.
    floats = []
    for pos, v in enumerate(values):
        as_float = numbers.real(v, numbers.FLOAT32_MAX)
        if as_float is None:
            raise InvalidInput(f"{field}: values must be numbers {numbers.describe(numbers.FLOAT32_MAX)} (float32); "
                               f"position {pos} is {_short(v)}", field=field)
        floats.append(as_float)
    if key in _THRESHOLD_RANGES:
        low, high = _THRESHOLD_RANGES[key]
        for pos, v in enumerate(floats):
            if not low <= v <= high:
                bound = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
                raise InvalidInput(f"{field}: must be {bound}; position {pos} is {v:.6g}", field=field)
    return tuple(floats)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def pass_work(spec: LossSpec, loss_fn_config: dict[str, Any] | None, data: list[RawDatum],
              limits: Limits) -> tuple[PassWork, int]:
    """A forward/forward_backward request, checked whole: (the trainer's work, model-input tokens).
    `spec` is the request's loss, looked up once by the caller (`core.loss_spec.spec_of`)."""
    config = parse_loss_config(spec, loss_fn_config)
    datums, n_tokens = normalise(data, spec, limits)
    return PassWork(spec.name, config, datums), n_tokens


def custom_pass_work(graph: LossGraph, data: list[RawDatum], limits: Limits) -> tuple[PassWork, int]:
    """A request with a custom loss (`core.custom_loss`), checked whole: every datum has
    `target_tokens` and each input the graph reads, at its declared rank (0: one value; 1: `[n]`;
    2: `[n, K]`, K at most MAX_TARGET_WIDTH), `n` the datum's tokens; `target_tokens` has the rank of
    `logprobs`. Keys the graph does not read are dropped, as the SDK's client-side path ignores them."""
    ranks = {"target_tokens": graph.inputs[0][1], **dict(graph.inputs[1:])}
    _check_count(data, limits)
    out: list[Datum] = []
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        tokens = _datum_tokens(where, datum, limits)
        missing = ranks.keys() - datum.inputs.keys()
        if missing:
            raise InvalidInput(f"{where}.loss_fn_inputs: custom loss {graph.name!r} reads {sorted(missing)} "
                               f"(has {sorted(datum.inputs)})", field=f"{where}.loss_fn_inputs")
        inputs: dict[str, tuple] = {}
        for key, rank in ranks.items():
            field, tensor = f"{where}.loss_fn_inputs.{key}", datum.inputs[key]
            _declared_rank(field, tensor, rank, len(tokens))
            inputs[key] = (tuple(_check_tokens(field, tensor.data, limits.vocab_size)) if key == "target_tokens"
                           else _check_floats(field, key, tensor.data))
        width = len(inputs["target_tokens"]) // len(tokens)
        if out and width != out[0].width:
            field = f"{where}.loss_fn_inputs.target_tokens"
            raise InvalidInput(f"{field}: {width} targets per position, but data[0] has {out[0].width}; every datum "
                               "of a request must have the same", field=field)
        out.append(Datum(tuple(tokens), inputs, datum.policy_version, width, datum.images))
    return PassWork(CUSTOM, LossConfig(), tuple(out), custom=graph), _check_total(data, limits)


def _declared_rank(field: str, tensor: RawTensor, rank: int, n: int) -> None:
    """A custom loss's input against its declared rank (the protobuf drops an empty shape: a scalar
    may come without one)."""
    shape = tensor.shape if tensor.shape is not None else ([] if rank == 0 else [len(tensor.data)])
    if len(shape) != rank:
        raise InvalidInput(f"{field}: shape {shape} has rank {len(shape)}; the custom loss declared rank {rank}",
                           field=field)
    if rank and shape[0] != n:
        raise InvalidInput(f"{field}: shape {shape} has {shape[0]} rows but model_input has {n} tokens; they must be "
                           "equal", field=field)
    width = shape[1] if rank == 2 else 1
    if not isinstance(width, int) or not 1 <= width <= MAX_TARGET_WIDTH:
        raise InvalidInput(f"{field}: {width!r} values per position; the limit is {MAX_TARGET_WIDTH}", field=field)
    if math.prod(shape) != len(tensor.data):
        raise InvalidInput(f"{field}: shape {shape} does not match {len(tensor.data)} values", field=field)


def input_tokens(data: list[RawDatum]) -> int:
    """A request's model-input tokens, what it is metered and rate-limited by (before any check)."""
    return sum(len(datum.tokens) for datum in data)


def normalise(data: list[RawDatum], spec: LossSpec, limits: Limits) -> tuple[tuple[Datum, ...], int]:
    """Check a request's datums against its loss's inputs; returns (the datums, total model-input tokens)."""
    loss_fn = spec.name
    _check_count(data, limits)
    out: list[Datum] = []
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        n = len(datum.tokens)
        tokens = _datum_tokens(where, datum, limits)
        missing = spec.required_inputs - datum.inputs.keys()
        if missing:
            raise InvalidInput(
                f"{where}.loss_fn_inputs: {loss_fn} needs {sorted(missing)} (has {sorted(datum.inputs)})",
                field=f"{where}.loss_fn_inputs",
            )
        unknown = datum.inputs.keys() - spec.allowed_inputs
        if unknown:
            raise InvalidInput(
                f"{where}.loss_fn_inputs: {sorted(unknown)} not accepted by {loss_fn}; allowed: {sorted(spec.allowed_inputs)}",
                field=f"{where}.loss_fn_inputs",
            )
        widths = {key: _width(f"{where}.loss_fn_inputs.{key}", key, tensor, n, loss_fn)
                  for key, tensor in datum.inputs.items()}
        width = _common_width(where, widths)
        if out and width != out[0].width:
            field = f"{where}.loss_fn_inputs.target_tokens"
            raise InvalidInput(f"{field}: {width} targets per position, but data[0] has {out[0].width}; every datum "
                               "of a request must have the same", field=field)
        inputs: dict[str, tuple] = {}
        for key, tensor in datum.inputs.items():
            field = f"{where}.loss_fn_inputs.{key}"
            values = _flat_values(field, tensor, n, widths[key])
            if key in INT_INPUTS:
                inputs[key] = tuple(_check_tokens(field, values, limits.vocab_size))
            else:
                inputs[key] = _check_floats(field, key, values)
        out.append(Datum(tuple(tokens), inputs, datum.policy_version, width, datum.images))
    return tuple(out), _check_total(data, limits)


def _check_count(data: list[RawDatum], limits: Limits) -> None:
    if not data:
        raise InvalidInput("data: must hold at least one datum", field="data")
    if len(data) > limits.max_datums:
        raise InvalidInput(f"data: {len(data)} datums exceed the limit of {limits.max_datums} per request", field="data")


def _datum_tokens(where: str, datum: RawDatum, limits: Limits) -> list[int]:
    n = len(datum.tokens)
    if n == 0:
        raise InvalidInput(f"{where}.model_input: must hold at least one token", field=f"{where}.model_input")
    if n > limits.max_context_length:
        raise InvalidInput(
            f"{where}.model_input: {n} tokens exceed the model's context length {limits.max_context_length}",
            field=f"{where}.model_input",
        )
    return _check_tokens(f"{where}.model_input", datum.tokens, limits.vocab_size)


def _check_total(data: list[RawDatum], limits: Limits) -> int:
    total = input_tokens(data)
    if total > limits.max_tokens:
        raise InvalidInput(
            f"data: {total} model-input tokens exceed the limit of {limits.max_tokens} per request; split it",
            field="data",
        )
    return total
