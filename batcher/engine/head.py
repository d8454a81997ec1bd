"""Target logprobs from the last hidden states, a chunk of tokens at a time, never a tokens x vocab
float32 tensor for the whole pass.

Each chunk computes its logits (the unembedding and its LoRA), the log-softmax's normaliser and the
targets' logits, and keeps none of them: under autograd a chunk is checkpointed, so its logits are
recomputed in the backward, one chunk at a time. Peak memory is one chunk's logits (`chunk_tokens`
from `chunk_tokens_for`) instead of the pass's; the price is one more unembedding matmul per chunk in
the backward, paid only when a pass has more than one chunk (a pass within one chunk's budget keeps
its logits, as before). The arithmetic is the one-shot computation's, chunk by chunk (exact on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bases.memory_plan import HEAD_CHUNK_BYTES

CHUNK_BYTES = HEAD_CHUNK_BYTES  # float32 logits per chunk: 256 MiB (about 440 tokens of a 152k vocabulary)


def chunk_tokens_for(vocab: int, *, align: int = 1, budget_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so one chunk's float32 logits fit `budget_bytes` (a multiple of `align`)."""
    tokens = max(align, budget_bytes // (4 * max(1, vocab)))
    return tokens // align * align


def _chunk(head: torch.nn.Module, softcap: float | None, use_routes: Callable[[int], None], index: int,
           hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    use_routes(index)
    logits: torch.Tensor = head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):  # log-softmax in at least float32
        logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if targets.shape[1] == 1:
        return -F.cross_entropy(logits, targets[:, 0], reduction="none").unsqueeze(1)
    # top-K targets: K logits per position, never a log-softmax over the chunk's vocabulary
    return logits.gather(-1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)


def target_logprobs(head: torch.nn.Module, hidden_N_H: torch.Tensor, targets_N_K: torch.Tensor,
                    ranges: Sequence[tuple[int, int]], use_routes: Callable[[int], None], *,
                    softcap: float | None = None) -> torch.Tensor:
    """(N, K) logprobs of the targets, chunk `i` covering tokens `ranges[i]`; `use_routes(i)` sets the
    head's multi-LoRA routes for chunk i (called again when the backward recomputes it)."""
    parts = []
    # One chunk is within the budget as it is: its logits may stay for the backward, no recompute.
    recompute = torch.is_grad_enabled() and len(ranges) > 1
    for i, (s, e) in enumerate(ranges):
        if recompute:
            # (nothing random in a chunk: no RNG state to keep, which would read the device's)
            parts.append(checkpoint(_chunk, head, softcap, use_routes, i, hidden_N_H[s:e], targets_N_K[s:e],
                                    use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_chunk(head, softcap, use_routes, i, hidden_N_H[s:e], targets_N_K[s:e]))
    return torch.cat(parts) if len(parts) > 1 else parts[0]
