"""Validate and normalise training data. One function for every encoding (JSON now, protobuf for
the tinker SDK): each decoder produces `RawDatum`s, this module checks them against the limits and
the base model's vocabulary and builds the body the trainer receives.

Each error names the field (`data[3].loss_fn_inputs.weights`) and the limit it broke.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput
from core.loss_spec import INT_INPUTS, LOSS_FUNCTIONS


@dataclass(frozen=True)
class RawTensor:
    data: list
    dtype: str
    shape: list[int] | None


@dataclass(frozen=True)
class RawDatum:
    tokens: list[int]
    inputs: dict[str, RawTensor]
    policy_version: int | None = None  # the sampler's policy version, for staleness accounting


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context_length: int
    max_datums: int
    max_tokens: int


def check_loss_fn(loss_fn: str) -> None:
    if loss_fn not in LOSS_FUNCTIONS:
        raise InvalidInput(
            f"loss_fn {loss_fn!r} is not supported; choose one of {sorted(LOSS_FUNCTIONS)}", field="loss_fn"
        )


def check_loss_config(config: dict[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (config or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInput(f"loss_fn_config.{key} must be a finite number, got {value!r}", field=f"loss_fn_config.{key}")
        out[key] = float(value)
    return out


def _token_error(field: str, token: object, vocab: int) -> InvalidInput:
    return InvalidInput(f"{field}: token id {token!r} is outside the vocabulary [0, {vocab})", field=field)


def _check_tokens(field: str, tokens: list, vocab: int) -> list[int]:
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            # JSON may carry 3.0 for 3; accept exact integers only.
            if isinstance(t, float) and t.is_integer() and 0 <= t < vocab:
                continue
            raise _token_error(field, t, vocab)
    return [int(t) for t in tokens]


def _flat_values(field: str, tensor: RawTensor, n_tokens: int) -> list:
    if tensor.shape is not None:
        if len(tensor.shape) != 1:
            raise InvalidInput(
                f"{field}: only 1-D per-token tensors are supported (shape {tensor.shape}); "
                f"expected shape [{n_tokens}]",
                field=field,
            )
        if tensor.shape[0] != len(tensor.data):
            raise InvalidInput(f"{field}: shape {tensor.shape} does not match {len(tensor.data)} values", field=field)
    if len(tensor.data) != n_tokens:
        raise InvalidInput(
            f"{field}: has {len(tensor.data)} values but model_input has {n_tokens} tokens; they must be equal",
            field=field,
        )
    return tensor.data


def normalise(data: list[RawDatum], loss_fn: str, limits: Limits) -> tuple[list[dict], int]:
    """Check a request's datums; returns (trainer body `data`, total model-input tokens)."""
    check_loss_fn(loss_fn)
    spec = LOSS_FUNCTIONS[loss_fn]
    if not data:
        raise InvalidInput("data: must hold at least one datum", field="data")
    if len(data) > limits.max_datums:
        raise InvalidInput(f"data: {len(data)} datums exceed the limit of {limits.max_datums} per request", field="data")
    out: list[dict] = []
    total = 0
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        n = len(datum.tokens)
        if n == 0:
            raise InvalidInput(f"{where}.model_input: must hold at least one token", field=f"{where}.model_input")
        if n > limits.max_context_length:
            raise InvalidInput(
                f"{where}.model_input: {n} tokens exceed the model's context length {limits.max_context_length}",
                field=f"{where}.model_input",
            )
        tokens = _check_tokens(f"{where}.model_input", datum.tokens, limits.vocab_size)
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
        inputs: dict[str, list] = {}
        for key, tensor in datum.inputs.items():
            field = f"{where}.loss_fn_inputs.{key}"
            values = _flat_values(field, tensor, n)
            if key in INT_INPUTS:
                inputs[key] = _check_tokens(field, values, limits.vocab_size)
            else:
                for v in values:
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        raise InvalidInput(f"{field}: values must be finite numbers, found {v!r}", field=field)
                inputs[key] = [float(v) for v in values]
        total += n
        out.append({"tokens": tokens, "inputs": inputs}
                   | ({"policy_version": datum.policy_version} if datum.policy_version is not None else {}))
    if total > limits.max_tokens:
        raise InvalidInput(
            f"data: {total} model-input tokens exceed the limit of {limits.max_tokens} per request; split it",
            field="data",
        )
    return out, total
