"""A grouped multi-LoRA layer: many adapters on one frozen base, each row of a batch routed to its
own adapter, in one forward and one backward.

Rows are ordered so each adapter's rows are contiguous (`Routing.segments`); a wrapped Linear then
computes `base(x)` once and, for all segments together, one shrink and one expand added into it
(`SegmentedLora`: batched matmuls with one weight per segment when segments are the same size, per-row
gathered weights otherwise), so the cost of a pass barely grows with the number of adapters in it.
Every adapter gets exactly the gradient of a separate pass (summed in another order). It replaced
one pair of matmuls per adapter per layer, which made each extra adapter cost its own small
kernels: on this CPU that path ran at 0.87 of the one-adapter ceiling at 8 tenants and 0.72 at 16
(bench/trainer_fusion.py measures the fused pass against that ceiling; now 0.98 and 0.98).

Adapters are stored and exported in PEFT's format (`base_model.model.<module>.lora_A.weight`,
`adapter_config.json`), which is what vLLM loads and what `peft` reads back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Routing:
    """Which rows of the current batch belong to which adapter: (adapter, start, end), contiguous
    and covering the whole batch in order."""

    segments: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class LoraWeights:
    A_r_in: nn.Parameter
    B_out_r: nn.Parameter
    scale: float


class MultiLoraLinear(nn.Module):
    """Wraps a frozen Linear; holds any number of adapters' A/B for it."""

    def __init__(self, base: nn.Linear, routing: Routing):
        super().__init__()
        self.base = base
        self.routing = routing
        self.adapters: dict[str, LoraWeights] = {}  # not registered: the base's parameters stay the base's

    def add(self, name: str, rank: int, alpha: float, generator: torch.Generator) -> list[nn.Parameter]:
        w = self.base.weight
        # Adapters are at least float32 whatever the base's dtype (bf16 on GPU): their updates are
        # small against their values, and AdamW's moments follow the parameters' dtype.
        dtype = torch.promote_types(w.dtype, torch.float32)
        A = torch.empty(rank, self.base.in_features, dtype=dtype)
        # PEFT's default initialisation: Kaiming-uniform A, zero B, so a new adapter changes nothing.
        bound = math.sqrt(6.0 / ((1 + 5) * self.base.in_features))
        A.uniform_(-bound, bound, generator=generator)
        weights = LoraWeights(nn.Parameter(A.to(w.device)),
                              nn.Parameter(torch.zeros(self.base.out_features, rank, dtype=dtype, device=w.device)),
                              alpha / rank)
        self.adapters[name] = weights
        return [weights.A_r_in, weights.B_out_r]

    def forward(self, x_B_T_in: torch.Tensor) -> torch.Tensor:
        y = self.base(x_B_T_in)
        segments = self.routing.segments
        present = [self.adapters.get(name) for name, _, _ in segments]
        if not any(present):
            return y
        # One shrink and one expand for the whole batch, however many adapters it holds, added
        # into the base's output in place (SegmentedLora): one adapter takes the same path, so the
        # fused pass and a lone adapter's differ only by what routing costs.
        some = next(w for w in present if w is not None)
        params: list[torch.Tensor | None] = []
        for w in present:
            params += [w.A_r_in, w.B_out_r] if w is not None else [None, None]
        routed = _Segments.of(segments, present, self.base)
        return SegmentedLora.apply(y, x_B_T_in.to(some.A_r_in.dtype), routed, *params)


@dataclass(frozen=True)
class _Segments:
    """What SegmentedLora needs to know of a pass's segments besides the weights themselves."""

    rows: tuple[int, ...]           # rows per segment, in batch order
    ranks: tuple[int, ...]          # each segment's adapter rank (0: no adapter on this layer)
    scales: tuple[float, ...]       # each segment's alpha / rank (0.0: no adapter)
    in_features: int
    out_features: int

    @classmethod
    def of(cls, segments, present: list[LoraWeights | None], base: nn.Linear) -> _Segments:
        ranks = tuple(w.A_r_in.shape[0] if w is not None else 0 for w in present)
        return cls(tuple(e - s for _, s, e in segments), ranks,
                   tuple(w.scale if w is not None else 0.0 for w in present), base.in_features, base.out_features)

    @property
    def rank(self) -> int:
        """The largest rank: the stacked weights are zero-padded to it."""
        return max(self.ranks)

    @property
    def equal(self) -> bool:
        """Every segment has as many rows: the batch is a (segments, rows x tokens, in) stack as it is."""
        return len(set(self.rows)) == 1


class SegmentedLora(torch.autograd.Function):
    """`y[b] += x[b] @ A[a(b)].T @ B[a(b)].T * scale[a(b)]` for every row b, with a(b) its adapter,
    in one shrink and one expand for the whole batch, into the base's output `y` in place.

    The adapters' A and B are stacked once per layer and pass (zero-padded to the largest rank:
    zero rows and columns add exactly nothing), inside this function, so autograd sees one node per
    layer whatever the number of adapters, and each adapter's gradient comes back as a slice of the
    stacked one. When every segment has as many rows (the usual fused step: one small batch per
    tenant) the batch already is a stack of segments, and the shrink and expand are batched matmuls
    with one weight per segment (Punica's SGMV shape, nothing gathered). Otherwise each row's
    weights are gathered from the stack (BGMV's shape) and gradients summed per adapter with
    index_add. Each adapter gets exactly the gradient of a separate pass, summed in another order.

    The expand accumulates into `y` (baddbmm) rather than into a tensor of its own: at the
    vocabulary-wide lm_head a fresh output the size of the logits, and the pass to add it, cost
    more than the matmul (the base's backward never reads `y`, so changing it is safe)."""

    @staticmethod
    def forward(ctx, y_B_T_out, x_B_T_in, routed: _Segments, *params):
        R = routed.rank
        A_S_R_in = torch.stack([_padded(a, R, 0, (R, routed.in_features), x_B_T_in) for a in params[0::2]])
        B_S_out_R = torch.stack([_padded(b, R, 1, (routed.out_features, R), x_B_T_in) for b in params[1::2]])
        scale_S = torch.tensor(routed.scales, dtype=x_B_T_in.dtype, device=x_B_T_in.device)
        B, T, _ = x_B_T_in.shape
        S = len(routed.rows)
        if routed.equal:
            row_adapter_B = None
            xa = torch.bmm(x_B_T_in.reshape(S, -1, routed.in_features), A_S_R_in.transpose(1, 2))
            xa.mul_(scale_S.view(S, 1, 1))
            B_x_out_R = B_S_out_R
        else:
            row_adapter_B = torch.repeat_interleave(
                torch.arange(S, device=x_B_T_in.device), torch.tensor(routed.rows, device=x_B_T_in.device))
            xa = torch.bmm(x_B_T_in, A_S_R_in.index_select(0, row_adapter_B).transpose(1, 2))
            xa.mul_(scale_S.index_select(0, row_adapter_B).view(B, 1, 1))
            B_x_out_R = B_S_out_R.index_select(0, row_adapter_B)
        if y_B_T_out.dtype == xa.dtype and y_B_T_out.is_contiguous():
            y_B_T_out.view(xa.shape[0], -1, routed.out_features).baddbmm_(xa, B_x_out_R.transpose(1, 2))
        else:  # a bf16 base: the adapters' product is computed in their float32 and rounded once
            y_B_T_out.add_(torch.bmm(xa, B_x_out_R.transpose(1, 2)).view(B, T, -1).to(y_B_T_out.dtype))
        ctx.mark_dirty(y_B_T_out)
        ctx.routed = routed
        ctx.save_for_backward(x_B_T_in, A_S_R_in, B_S_out_R, scale_S, xa, row_adapter_B)
        return y_B_T_out

    @staticmethod
    def backward(ctx, grad_B_T_out):
        x_B_T_in, A_S_R_in, B_S_out_R, scale_S, xa, row_adapter_B = ctx.saved_tensors
        routed: _Segments = ctx.routed
        S = len(routed.rows)
        B, T, _ = x_B_T_in.shape
        grad = grad_B_T_out.to(xa.dtype)
        want_x = ctx.needs_input_grad[1]
        want_w = any(ctx.needs_input_grad[3:])
        grad_x = grad_A = grad_B = None
        if row_adapter_B is None:  # equal segments: one weight per segment, nothing to gather
            g_S_N_out = grad.reshape(S, -1, routed.out_features)
            grad_xa = torch.bmm(g_S_N_out, B_S_out_R).mul_(scale_S.view(S, 1, 1))
            if want_x:
                grad_x = torch.bmm(grad_xa, A_S_R_in).view(B, T, routed.in_features)
            if want_w:
                grad_A = torch.bmm(grad_xa.transpose(1, 2), x_B_T_in.reshape(S, -1, routed.in_features))
                grad_B = _outer(g_S_N_out, xa)
        else:
            grad_xa = torch.bmm(grad, B_S_out_R.index_select(0, row_adapter_B))
            grad_xa.mul_(scale_S.index_select(0, row_adapter_B).view(B, 1, 1))
            if want_x:
                grad_x = torch.bmm(grad_xa, A_S_R_in.index_select(0, row_adapter_B))
            if want_w:
                grad_A = torch.zeros_like(A_S_R_in).index_add_(
                    0, row_adapter_B, torch.bmm(grad_xa.transpose(1, 2), x_B_T_in))
                grad_B = torch.zeros_like(B_S_out_R).index_add_(
                    0, row_adapter_B, _outer(grad, xa))
        grads: list[torch.Tensor | None] = []
        for s, r in enumerate(routed.ranks):
            wanted = want_w and r and ctx.needs_input_grad[3 + 2 * s]
            grads += [grad_A[s, :r] if wanted else None, grad_B[s, :, :r] if wanted else None]
        return (grad_B_T_out, grad_x, None, *grads)


def _outer(grad_X_N_out: torch.Tensor, xa_X_N_R: torch.Tensor) -> torch.Tensor:
    """B's gradient, `grad.T @ xa` per batch entry, as `(xa.T @ grad).T`: the output-wide operand is
    then read in its own layout. Handed transposed, a single-entry bmm copied it first: 60 against
    23 ms at the lm_head of a 4,096-token pass here."""
    return torch.bmm(xa_X_N_R.transpose(1, 2), grad_X_N_out).transpose(1, 2)


def _padded(w: torch.Tensor | None, rank: int, dim: int, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """An adapter's A (dim 0) or B (dim 1) zero-padded to `rank` along its rank dimension; zeros of
    `shape` for a segment without an adapter on this layer."""
    if w is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    pad = rank - w.shape[dim]
    if not pad:
        return w
    return torch.nn.functional.pad(w, (0, 0, 0, pad) if dim == 0 else (0, pad))


class MultiLoraModel:
    """A causal LM whose target Linears are wrapped for routed multi-LoRA."""

    def __init__(self, model: nn.Module, target_names: tuple[str, ...]):
        self.model = model
        self.routing = Routing()
        self.layers: dict[str, MultiLoraLinear] = {}
        for path, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in target_names:
                parent_path, _, attr = path.rpartition(".")
                parent = model.get_submodule(parent_path) if parent_path else model
                wrapped = MultiLoraLinear(module, self.routing)
                setattr(parent, attr, wrapped)
                self.layers[path] = wrapped

    def add_adapter(self, name: str, *, rank: int, alpha: float, targets: list[str], seed: int) -> list[nn.Parameter]:
        g = torch.Generator().manual_seed(seed)
        params: list[nn.Parameter] = []
        for path, layer in self.layers.items():
            if path.rsplit(".", 1)[-1] in targets:
                params += layer.add(name, rank, alpha, g)
        return params

    def remove_adapter(self, name: str) -> None:
        for layer in self.layers.values():
            layer.adapters.pop(name, None)

    def forward(self, input_ids_B_T: torch.Tensor, segments: list[tuple[str, int, int]]) -> torch.Tensor:
        if sum(e - s for _, s, e in segments) != input_ids_B_T.shape[0]:
            raise ValueError("segments must cover every row of the batch, in order")
        self.routing.segments = segments
        try:
            return self.model(input_ids=input_ids_B_T).logits
        finally:
            self.routing.segments = []

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """One adapter's tensors under PEFT's saved key names."""
        out = {}
        for path, layer in self.layers.items():
            w = layer.adapters.get(name)
            if w is not None:
                out[f"base_model.model.{path}.lora_A.weight"] = w.A_r_in
                out[f"base_model.model.{path}.lora_B.weight"] = w.B_out_r
        return out

    def load_state_dict(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Copy PEFT-format tensors into an existing adapter of the same shape (KeyError/ValueError otherwise)."""
        ours = self.state_dict(name)
        if ours.keys() != state.keys():
            missing, extra = sorted(ours.keys() - state.keys()), sorted(state.keys() - ours.keys())
            raise ValueError(f"checkpoint tensors do not match the model: missing {missing[:2]}, extra {extra[:2]}")
        with torch.no_grad():
            for key, param in ours.items():
                if param.shape != state[key].shape:
                    raise ValueError(f"{key}: checkpoint shape {tuple(state[key].shape)} != {tuple(param.shape)}")
                param.copy_(state[key])
