"""Stability records (tinker's `record_stability_info`): what the sampler saw of each sequence, kept
for the training requests that name it by `sequence_id`.

What is recorded is what a trainer needs to judge how far its own policy has moved from the one that
sampled: per sequence, the weights that sampled it (`model_id`, `policy_version`), where its tokens
sit (`prompt_length`), its tokens and the sampler's raw logprob of each, and, when the request asked
for them, the sampler's top-k at each position. A record lives in Redis under the tenant's name
(`key`), so another tenant's lookup of the same id finds nothing, and expires
QUILT_GEN_STABILITY_TTL_S after it was last written or read (api.routes.sampling's reader slides it).
"""

from __future__ import annotations

import json
import math
from typing import Any

from gen_pool.wire import SampleOutcome


def key(tenant_id: str, sequence_id: str) -> str:
    return f"quilt:stability:{tenant_id}:{sequence_id}"


def sequence_id(request_id: str, index: int) -> str:
    """The id the asample future promised for sequence `index` (api.routes.sampling._future)."""
    return f"{request_id}:{index}"


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def records(request_id: str, outcome: SampleOutcome, prompt_length: int) -> dict[str, str]:
    """sequence id -> its record as JSON (no NaN: a missing logprob is null)."""
    out = {}
    for i, s in enumerate(outcome.sequences):
        body: dict[str, Any] = {
            "sequence_id": sequence_id(request_id, i), "model_id": s.model_id, "policy_version": s.policy_version,
            "prompt_length": prompt_length, "tokens": list(s.tokens),
            "logprobs": [_num(x) for x in s.logprobs], "stop_reason": s.stop_reason}
        if s.topk_logprobs is not None:
            body["topk_logprobs"] = [None if row is None else [[t, _num(lp)] for t, lp in row]
                                     for row in s.topk_logprobs]
        out[body["sequence_id"]] = json.dumps(body, allow_nan=False)
    return out
