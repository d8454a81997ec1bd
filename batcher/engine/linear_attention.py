"""Linear-attention layers over packed streams: every row's recurrence starts from a zero state.

Qwen3.5's gated-delta-rule blocks carry state along the sequence twice: a short causal convolution
over the mixed q/k/v channels (the last `kernel - 1` tokens) and the delta rule's recurrent state
(a [heads, k, v] matrix per head). transformers' torch paths for both run over a whole stream; on a
packed stream the second row would start from the first one's state. Its projections, gates and
norms are per token, so the multi-LoRA routes over flat tokens stay as they are; only these two
sequence kernels are swapped, in the transformers modules that call them, for ones that run each
row of the packed pass (`packed_attention.Rows.spans`) on its own, exactly as that row alone runs
(the same kernel on a batch of one), and give padding positions zeros (nothing reads them).

Outside a packed pass the swapped-in functions call the originals unchanged. A packed pass's rows
are host spans, so a pass captured once and replayed (`batcher.engine.graphs`) cannot follow them:
a base with linear attention runs without CUDA graphs (`uses_row_state`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from batcher.engine import packed_attention

# transformers modules whose gated-delta-rule blocks call these kernels by their module-level names
MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
CONV = "causal_conv1d_fn"  # x [B, channels, L] -> [B, channels, L]
RULE = "torch_chunk_gated_delta_rule"  # q, k, v [B, L, heads, d], g, beta [B, L, heads] -> ([B, L, heads, dv], state)


def uses_row_state(config: Mapping[str, Any]) -> bool:
    """Whether a base's config.json (or its text_config) has linear-attention layers."""
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or ())


def _per_row(fn: Callable[..., Any], seq_dim: int, x: torch.Tensor, *args: torch.Tensor) -> Any:
    """`fn` on each packed row of `x` and of `args` alone (the batch first, the sequence along
    `seq_dim`), the outputs put back in the rows' places with zeros between (nothing reads those)."""
    rows = packed_attention.current()
    assert rows is not None
    L = x.shape[seq_dim]
    streams: list[list[torch.Tensor]] = [[] for _ in range(x.shape[0])]
    ends = [0] * x.shape[0]
    out: torch.Tensor | None = None
    for b, s, e in sorted(rows.spans):
        got = fn(*(t[b:b + 1, :, s:e] if seq_dim == 2 else t[b:b + 1, s:e] for t in (x, *args)))
        # the rule returns (output, final state); a training pass asks for no state
        out = got[0] if isinstance(got, tuple) else got
        if s > ends[b]:
            streams[b].append(_zeros(out, s - ends[b], seq_dim))
        streams[b].append(out)
        ends[b] = e
    assert out is not None, "a packed pass with no rows"
    whole = torch.cat([torch.cat(parts + ([_zeros(out, L - end, seq_dim)] if end < L else []), dim=seq_dim)
                       for parts, end in zip(streams, ends)])
    return (whole, None) if seq_dim == 1 else whole


def _zeros(like: torch.Tensor, n: int, seq_dim: int) -> torch.Tensor:
    shape = list(like.shape)
    shape[0], shape[seq_dim] = 1, n
    return like.new_zeros(shape)


def _conv(original: Callable[..., Any], hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if packed_attention.current() is None:
        return original(hidden_states, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("cu_seq")}
    return _per_row(lambda x: original(x, *args, **kwargs), 2, hidden_states)


def _rule(original: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          **kwargs: Any) -> Any:
    if packed_attention.current() is None:
        return original(query, key, value, **kwargs)
    if kwargs.get("initial_state") is not None:
        raise RuntimeError("a packed pass has no recurrent state to carry in")
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("cu_seq")}
    g, beta = kwargs.pop("g"), kwargs.pop("beta")
    return _per_row(lambda q, k, v, gg, bb: original(q, k, v, g=gg, beta=bb, **kwargs), 1, query, key, value, g, beta)


@functools.cache
def register() -> None:
    """Swap the per-row kernels into every transformers module that has them (once per process)."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an older transformers without this architecture
            continue
        for attr, wrapper in ((CONV, _conv), (RULE, _rule)):
            setattr(module, attr, functools.partial(wrapper, getattr(module, attr)))
