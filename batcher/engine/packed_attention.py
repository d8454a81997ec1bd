"""Attention over packed streams: every row of a stream attends only to its own earlier tokens.

Registered with transformers as the attention implementation `quilt_packed` (set on the base for the
duration of a packed pass), so every supported architecture's attention layers call it with their
own queries, keys and values after RoPE and norms (values may be narrower than queries and keys, as in
DeepSeek-V3's latent attention: the output has the values' width). transformers builds no mask for an implementation
it has no mask function for, so nothing in mask building reads a tensor back to the host either.

On a GPU: one `torch.nn.attention.varlen.varlen_attn` call over the whole pass, the rows given by
cumulative offsets (padding runs are rows of their own, whose outputs nothing reads). On the CPU:
causal SDPA on exactly each row's tokens (rows of one length stacked into one call), so a row's
attention is the same whatever else shares its stream (the exactness the fused-equals-alone tests
hold the trainer to); padding positions get zeros. A captured pass (`batcher.engine.graphs`) reads no host
spans: varlen over its padded offsets with the stream's width as the longest row, or, where varlen
is not there, one SDPA call over every stream with a block-diagonal causal mask made on the device.

Sliding-window layers (gpt-oss alternates them with full attention; transformers passes the layer's
`sliding_window`) see only the last `sliding_window` tokens of their own row, the query included:
varlen takes the window as `window_size=(window - 1, 0)` (a torch whose varlen has no `window_size`
keeps varlen only while no row is longer than the window), SDPA a banded causal mask.
Attention sinks (gpt-oss: a learned logit per head, `s_aux`, that joins each query's softmax and
then is dropped) are exact without a score matrix: with the sink, attention is ordinary attention
scaled per query and head by sigmoid(lse - sink), lse the log-sum-exp of the query's allowed scores
(`SinkAttention`). The kernels that return the log-sum-exp run it: on a GPU varlen's flash kernel
(`return_aux`), on the CPU `aten._scaled_dot_product_flash_attention_for_cpu` (the formula is the same;
only the kernel differs). Both keep, per token, the output and the log-sum-exp, never the scores
(heads x L x L per layer). `_causal_reference` is the eager formula transformers uses, kept for tests;
a GPU whose varlen kernel failed also falls back to it (its score matrices one row group at a time).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

NAME = "quilt_packed"
log = logging.getLogger("quilt.trainer.attention")


@dataclass
class Rows:
    """A packed pass's rows: host spans (stream, start, end) in flat-token order, and for the GPU
    kernel the device copy of every row's (padding runs included) cumulative offsets."""

    spans: tuple[tuple[int, int, int], ...]
    width: int
    cu_seqlens: torch.Tensor | None = None
    max_len: int = 0
    # A captured pass (batcher.engine.graphs) reads no host spans: each flat token's run (its index in the
    # offsets; padding runs are runs) comes as a device tensor, and the GPU kernel's longest row is
    # the stream's width.
    segments: torch.Tensor | None = None


_current: Rows | None = None
_varlen = True  # until the build's kernel refuses a call (then every pass takes the per-row path)


def current() -> Rows | None:
    """The rows of the packed pass under way (None outside one): layers with state along the
    sequence (batcher.engine.linear_attention) split at them too."""
    return _current


def varlen_works() -> bool:
    """Whether packed passes on a GPU use the varlen kernel (until a call of it fails)."""
    return _varlen


def boundaries(starts: list[int], lengths: list[int], streams: int, width: int) -> list[int]:
    """Cumulative offsets of every run of a packed grid: rows, and padding between and after them."""
    points = {0, streams * width} | {b * width for b in range(streams)}
    for s, n in zip(starts, lengths):
        points |= {s, s + n}
    return sorted(points)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    rows = _current
    if rows is None:
        raise RuntimeError("quilt_packed attention outside a packed pass")
    B, H, L, _ = query.shape
    D = value.shape[-1]  # the output's head width (latent attention's values are narrower than its queries)
    gqa = key.shape[1] != H
    window: int | None = kwargs.get("sliding_window")
    sinks: torch.Tensor | None = kwargs.get("s_aux")
    global _varlen
    # varlen over every row, the window passed to the kernel (an older varlen without `window_size`
    # only while no row is longer than the window: the window then changes nothing)
    if query.is_cuda and rows.cu_seqlens is not None and _varlen \
            and (window is None or rows.max_len <= window or "window_size" in _varlen_keywords()):
        try:
            return _varlen_attention(query, key, value, rows, scaling, window, sinks), None
        except (ImportError, RuntimeError, TypeError, NotImplementedError) as exc:
            _varlen = False
            log.warning("varlen attention unavailable (%s: %s); packed rows take one SDPA call each",
                        type(exc).__name__, exc)
    if rows.segments is not None:
        return _masked_attention(query, key, value, rows.segments, scaling, gqa, window, sinks), None
    # Rows of one length share a call: stacked, they are a batch of equal causal rows.
    by_length: dict[int, list[int]] = {}
    for i, (_, s, e) in enumerate(rows.spans):
        by_length.setdefault(e - s, []).append(i)
    outputs: list[torch.Tensor | None] = [None] * len(rows.spans)
    for same in by_length.values():
        q, k, v = (torch.stack([t[rows.spans[i][0], :, rows.spans[i][1]:rows.spans[i][2]] for i in same])
                   for t in (query, key, value))
        out = _causal(q, k, v, scaling, gqa, window, sinks)
        for j, i in enumerate(same):
            outputs[i] = out[j].transpose(0, 1)
    pieces: list[torch.Tensor] = []
    at = 0
    for (b, s, e), row_out in zip(rows.spans, outputs):
        assert row_out is not None  # every span is in one group of by_length
        flat_start = b * L + s
        if flat_start > at:
            pieces.append(query.new_zeros(flat_start - at, H, D))
        pieces.append(row_out)
        at = b * L + e
    if at < B * L:
        pieces.append(query.new_zeros(B * L - at, H, D))
    return torch.cat(pieces).view(B, L, H, D), None


def _visible(L: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[L, L]: whether query i sees key j in one row (causal; within the last `window` tokens)."""
    i = torch.arange(L, device=device)
    seen = i.unsqueeze(0) <= i.unsqueeze(1)
    return seen & (i.unsqueeze(0) > i.unsqueeze(1) - window) if window else seen


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, gqa: bool,
            window: int | None, sinks: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over [n, H, L, D] rows (`mask`: also only these pairs), with the layer's
    sliding window and sinks where it has them."""
    if window is None and sinks is None and mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    allowed = _visible(q.shape[-2], window, q.device)
    if mask is not None:
        allowed = allowed & mask
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=gqa)
    if not q.is_cuda:
        if gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        if mask is None and (window is None or window >= q.shape[-2]):
            kernel = _CpuFlash(None, scale)  # causal: no mask at all
        elif mask is None:  # one banded mask per row length, shared by every layer of the pass
            kernel = _CpuFlash(_band(q.shape[-2], window, q.dtype, q.device), scale)
        else:
            kernel = _CpuFlash(torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf")),
                               scale)
        return sink_attention(q, k, v, sinks.view(1, -1, 1), kernel)
    return _causal_reference(q, k, v, scaling, gqa, allowed, sinks)


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, gqa: bool,
                      allowed: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The eager formula with sinks (transformers' own): the whole score matrix in memory and kept
    for the backward. For tests, and for a GPU whose varlen kernel failed."""
    n, H, L, D = q.shape
    if gqa:
        k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    logits = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else D ** -0.5)
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(logits.dtype).view(1, H, 1, 1).expand(n, H, L, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


class _Kernel:
    """An attention kernel that returns each query's log-sum-exp, and its backward from (dO, out, lse)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@functools.lru_cache(maxsize=4)
def _band(L: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask (0 or -inf) of one row of `L` tokens under a sliding window."""
    return torch.zeros(L, L, dtype=dtype, device=device).masked_fill(~_visible(L, window, device), float("-inf"))


@dataclass
class _CpuFlash(_Kernel):
    """The CPU flash kernel over [n, H, L, D] (equal heads): causal, or under `bias`, an additive mask
    (0 or -inf) that already holds causality."""

    bias: torch.Tensor | None
    scale: float

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, self.bias is None,
                                                                               attn_mask=self.bias,
                                                                               scale=self.scale)
        return out, lse

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, self.bias is None, attn_mask=self.bias, scale=self.scale)
        return dq, dk, dv


class SinkAttention(torch.autograd.Function):
    """Attention with a sink logit per head, exact, from a kernel's output o and log-sum-exp lse:
    y = o * sigmoid(lse - sink). Its backward is the kernel's own, given dO = sigmoid(lse - sink) * dy
    and out = y (then the kernel's rowsum dO.out is the sink softmax's), and d sink = -sum over queries
    of (1 - sigmoid) * (dy . y). Nothing quadratic in the row's length is kept."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor,
                kernel: _Kernel) -> torch.Tensor:
        out, lse = kernel.forward(q, k, v)
        dtype = torch.promote_types(lse.dtype, sink.dtype)
        gate = torch.sigmoid(lse.to(dtype) - sink.to(dtype))
        y = (out * gate.unsqueeze(-1).to(out.dtype)).to(out.dtype)
        ctx.save_for_backward(q, k, v, y, lse, gate)
        ctx.kernel, ctx.sink_shape, ctx.sink_dtype = kernel, sink.shape, sink.dtype
        return y

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dy = grads[0].contiguous()
        q, k, v, y, lse, gate = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward((dy * gate.unsqueeze(-1).to(dy.dtype)).contiguous(), q, k, v, y, lse)
        rowsum = (dy.to(gate.dtype) * y.to(gate.dtype)).sum(-1)
        dsink = (-(1 - gate) * rowsum).sum_to_size(ctx.sink_shape).to(ctx.sink_dtype)
        return dq, dk, dv, dsink, None


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, kernel: _Kernel) -> torch.Tensor:
    """`SinkAttention` (`sink` shaped to broadcast against the log-sum-exp: per head)."""
    return cast(torch.Tensor, SinkAttention.apply(q, k, v, sink, kernel))


def _masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor,
                      scaling: float | None, gqa: bool, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of every stream in one SDPA call, a token seeing the earlier tokens of its own run
    (a block-diagonal causal mask built on the device from `segments`: nothing from the host). Each
    token sees at least itself, so no softmax is empty."""
    B, H, L, D = query.shape
    seg = segments.view(B, 1, L)
    out = _causal(query, key, value, scaling, gqa, window, sinks, mask=seg.unsqueeze(-1) == seg.unsqueeze(-2))
    return out.transpose(1, 2)


def segments_of(cu: list[int], total: int) -> list[int]:
    """Each flat token's run index, from every run's cumulative offsets."""
    out = []
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        out += [i] * (e - s)
    return out[:total]


@functools.cache
def _varlen_keywords() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Rows,
                      scaling: float | None, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One varlen kernel over every row of the pass (its keyword names differ across torch releases:
    `window_size=(-1, 0)` or `is_causal=True` for causal; keys and values repeated where it has no
    `enable_gqa`); the layer's window as `window_size=(window - 1, 0)`; sinks by `SinkAttention`."""
    from torch.nn.attention.varlen import varlen_attn

    B, H, L, D = query.shape
    accepts = _varlen_keywords()
    if key.shape[1] != H and "enable_gqa" not in accepts:
        key, value = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (key, value))
    kw: dict[str, Any] = {"scale": scaling}
    if key.shape[1] != H:
        kw["enable_gqa"] = True
    if "window_size" in accepts:
        kw["window_size"] = (window - 1 if window is not None and window < rows.max_len else -1, 0)
    else:
        kw["is_causal"] = True
    # Latent attention's values are narrower than its queries: zero columns make them as wide for the
    # kernel (which takes one head width), and the output's extra columns, zero too, are dropped.
    Dv = value.shape[-1]
    if Dv != D:
        value = F.pad(value, (0, D - Dv))
    q, k, v = (t.transpose(1, 2).reshape(B * L, t.shape[1], D) for t in (query, key, value))
    assert rows.cu_seqlens is not None  # _attention takes this path only with the offsets on the device
    if sinks is not None:
        out = sink_attention(q, k, v, sinks.view(1, H), _Varlen(rows.cu_seqlens, rows.max_len, kw))
    else:
        out = cast(torch.Tensor, varlen_attn(q, k, v, rows.cu_seqlens, rows.cu_seqlens, rows.max_len, rows.max_len, **kw))
    return out.view(B, L, H, D)[..., :Dv]


@dataclass
class _Varlen(_Kernel):
    """The GPU varlen flash kernel over [T, H, D] with its log-sum-exp (`return_aux`), and its backward
    (`torch_attn._varlen_attn_backward`, the op varlen's own autograd calls; CUDA only, like the kernel)."""

    cu: torch.Tensor
    max_len: int
    kw: dict[str, Any]
    transposed: bool = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        out, lse = varlen_attn(q, k, v, self.cu, self.cu, self.max_len, self.max_len, return_aux=AuxRequest(lse=True),
                               **self.kw)
        # flash's varlen log-sum-exp is [H, T]: seen as [T, H] here, and given back to its backward as it came
        self.transposed = lse.shape == (q.shape[1], q.shape[0])
        return out, lse.t() if self.transposed else lse

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        window = list(self.kw.get("window_size", (-1, 0)))
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the forward's state is zeros too
        dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
            grad, q, k, v, out, lse.t() if self.transposed else lse, self.cu, self.cu,
            self.max_len, self.max_len, window == [-1, 0], rng, self.kw.get("scale"), window)
        return dq, dk, dv


@functools.cache
def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    # varlen_attn logs its backend at INFO on every call: once per layer and pass in a trainer's log
    logging.getLogger("torch.nn.attention.varlen").setLevel(logging.WARNING)


@contextlib.contextmanager
def packed(model: torch.nn.Module, rows: Rows) -> Iterator[None]:
    """Run `model`'s attention as packed rows for the duration (the forward, not the backward: the
    backward of SDPA and varlen needs nothing from here; a checkpointed layer's replay enters it again)."""
    global _current
    register()
    config: Any = model.config  # a transformers PretrainedConfig
    # Nested (a checkpointed layer re-enters its pass's rows, batcher.engine.recompute): the outer
    # pass's setting and rows come back after.
    previous, previous_rows = config._attn_implementation, _current
    config._attn_implementation = NAME
    _current = rows
    try:
        yield
    finally:
        config._attn_implementation = previous
        _current = previous_rows
