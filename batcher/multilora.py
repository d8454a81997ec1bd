"""A grouped multi-LoRA layer: many adapters on one frozen base, each row of a batch routed to its
own adapter, in one forward and one backward.

Rows are ordered so each adapter's rows are contiguous (`Routing.segments`); a wrapped Linear then
computes `base(x)` once and, for all segments together, one gathered shrink and one gathered expand
(`GatheredLora`: batched matmuls over per-row weights taken from the adapters stacked once per
layer), so the cost of a pass barely grows with the number of adapters in it. Every adapter gets
exactly the gradient of a separate pass (summed in another order). It replaced one pair of
matmuls per adapter per layer, which made each extra adapter cost its own small kernels: on this
CPU that path ran at 0.87 of the one-adapter ceiling at 8 tenants and 0.72 at 16
(bench/trainer_fusion.py measures the fused pass against that ceiling).

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
        if len(segments) == 1:  # one adapter: two plain matmuls, nothing to route
            w = present[0]
            return y + ((x_B_T_in.to(w.A_r_in.dtype) @ w.A_r_in.T) @ (w.B_out_r.T * w.scale)).to(y.dtype)
        # Many adapters: stack them once (rank-padded, scale folded into B) and run one gathered
        # shrink and one gathered expand for the whole batch (GatheredLora), so a pass costs about the
        # same however many adapters it holds.
        A_S_R_in, B_S_out_R = _stacked(present, self.base)
        rows = torch.tensor([e - s for _, s, e in segments], device=x_B_T_in.device)
        row_adapter_B = torch.repeat_interleave(torch.arange(len(segments), device=x_B_T_in.device), rows)
        x = x_B_T_in.to(A_S_R_in.dtype)
        return y + GatheredLora.apply(x, A_S_R_in, B_S_out_R, row_adapter_B).to(y.dtype)


def _stacked(present: list[LoraWeights | None], base: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, R, in) A's and (S, out, R) scaled B's of the batch's segments, zero-padded to the largest
    rank R (zero rows and columns add exactly nothing); a segment without an adapter here is zeros."""
    some = next(w for w in present if w is not None)
    rank = max(w.A_r_in.shape[0] for w in present if w is not None)
    dtype, device = some.A_r_in.dtype, some.A_r_in.device
    As, Bs = [], []
    for w in present:
        if w is None:
            As.append(torch.zeros(rank, base.in_features, dtype=dtype, device=device))
            Bs.append(torch.zeros(base.out_features, rank, dtype=dtype, device=device))
            continue
        pad = rank - w.A_r_in.shape[0]
        A, B = w.A_r_in, w.B_out_r * w.scale
        if pad:
            A, B = torch.nn.functional.pad(A, (0, 0, 0, pad)), torch.nn.functional.pad(B, (0, pad))
        As.append(A)
        Bs.append(B)
    return torch.stack(As), torch.stack(Bs)


class GatheredLora(torch.autograd.Function):
    """`x[b] @ A[a(b)].T @ B[a(b)].T` for every row b, with a(b) its adapter: batched matmuls over
    per-row gathered weights (the shape of Punica's BGMV kernels), in one shrink and one expand.

    The gathered per-row weights are transient: forward saves only x, the small stacked weights and
    the rank-wide intermediate, and backward gathers again, so memory does not grow with rows x
    weights. Gradients of the stacked weights are summed per adapter with index_add (each adapter's
    rows contribute exactly what a separate pass would, up to summation order)."""

    @staticmethod
    def forward(ctx, x_B_T_in, A_S_R_in, B_S_out_R, row_adapter_B):
        A_B_R_in = A_S_R_in.index_select(0, row_adapter_B)
        xa_B_T_R = torch.bmm(x_B_T_in, A_B_R_in.transpose(1, 2))
        out = torch.bmm(xa_B_T_R, B_S_out_R.index_select(0, row_adapter_B).transpose(1, 2))
        ctx.save_for_backward(x_B_T_in, A_S_R_in, B_S_out_R, row_adapter_B, xa_B_T_R)
        return out

    @staticmethod
    def backward(ctx, grad_B_T_out):
        x_B_T_in, A_S_R_in, B_S_out_R, row_adapter_B, xa_B_T_R = ctx.saved_tensors
        B_B_out_R = B_S_out_R.index_select(0, row_adapter_B)
        grad_xa_B_T_R = torch.bmm(grad_B_T_out, B_B_out_R)
        grad_x = grad_A = grad_B = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.bmm(grad_xa_B_T_R, A_S_R_in.index_select(0, row_adapter_B))
        if ctx.needs_input_grad[1]:
            grad_A = torch.zeros_like(A_S_R_in).index_add_(
                0, row_adapter_B, torch.bmm(grad_xa_B_T_R.transpose(1, 2), x_B_T_in))
        if ctx.needs_input_grad[2]:
            grad_B = torch.zeros_like(B_S_out_R).index_add_(
                0, row_adapter_B, torch.bmm(grad_B_T_out.transpose(1, 2), xa_B_T_R))
        return grad_x, grad_A, grad_B, None


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
