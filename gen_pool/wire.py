"""Sampling results as plain data, and their JSON encoding (Tinker's SampleResponse shape).

Logic builds `SampleOutcome`s; only `to_json` knows the wire. A protobuf encoding (what the tinker
SDK requires) can be added beside it without touching the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SampledSequence:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: str  # "stop" | "length"
    model_id: str  # the training model whose weights sampled it (the base model's name for the base)
    policy_version: int  # optimizer steps of those weights (0 for the base)
    # Per sampled token, the k most likely (token, logprob), most likely first (topk_sample_logprobs).
    topk_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None


@dataclass(frozen=True)
class SampleOutcome:
    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: tuple[float | None, ...] | None = None  # None at position 0
    # Per prompt position: the k most likely (token, logprob), most likely first; None at position 0.
    topk_prompt_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    # tinker TensorData as JSON (gen_pool.outputs): logprobs in the request's layout, and the draws.
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens: dict[str, Any] | None = None  # {"tokens": TensorData, "logprobs": TensorData}
    # Prompt tokens billed as prefix-cache hits: the engine's own count, summed over the sequences.
    prompt_cache_hit_tokens: int = 0


def _num(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


def _topk(rows) -> list:
    return [None if row is None else [[t, _num(lp)] for t, lp in row] for row in rows]


def _sequence(s: SampledSequence) -> dict[str, Any]:
    out = {"tokens": list(s.tokens), "logprobs": [_num(x) for x in s.logprobs], "stop_reason": s.stop_reason,
           "model_id": s.model_id, "policy_version": s.policy_version}
    if s.topk_logprobs is not None:
        out["topk_logprobs"] = _topk(s.topk_logprobs)
    return out


def to_json(outcome: SampleOutcome) -> dict[str, Any]:
    """`{"type": "sample", "sequences": [{..., "topk_logprobs"?}], "prompt_logprobs"?: [null, ...],
    "topk_prompt_logprobs"?: [null, [[token, logprob], ...], ...], "target_prompt_logprobs"?: TensorData,
    "prompt_alt_tokens"?: {"tokens", "logprobs"}, "prompt_cache_hit_tokens"}`; NaN becomes null."""
    body: dict[str, Any] = {"type": "sample", "sequences": [_sequence(s) for s in outcome.sequences],
                            "prompt_cache_hit_tokens": outcome.prompt_cache_hit_tokens}
    if outcome.prompt_logprobs is not None:
        body["prompt_logprobs"] = [_num(x) for x in outcome.prompt_logprobs]
    if outcome.topk_prompt_logprobs is not None:
        body["topk_prompt_logprobs"] = _topk(outcome.topk_prompt_logprobs)
    if outcome.target_prompt_logprobs is not None:
        body["target_prompt_logprobs"] = outcome.target_prompt_logprobs
    if outcome.prompt_alt_tokens is not None:
        body["prompt_alt_tokens"] = outcome.prompt_alt_tokens
    return body
