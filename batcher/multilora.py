"""A grouped multi-LoRA layer: many adapters on one frozen base, each row of a batch routed to its
own adapter, in one forward and one backward.

Rows are ordered so each adapter's rows are contiguous (`Routing.segments`); a wrapped Linear then
computes `base(x)` once and, per segment, `x_seg @ A.T @ (B.T * scale)` on one split of the input,
joined with one concatenation. There is no gather or scatter per adapter, and autograd gives every
adapter exactly the gradient of a separate pass.

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
        if not any(name in self.adapters for name, _, _ in segments):
            return y
        # One split and one concatenation: their backward passes are one concatenation and one
        # split, where per-adapter slicing would allocate a full-size gradient per adapter.
        xs = x_B_T_in.split([e - s for _, s, e in segments], dim=0)
        pieces = []
        for (name, _, _), x in zip(segments, xs):
            w = self.adapters.get(name)
            if w is None:
                pieces.append(y.new_zeros((x.shape[0], *y.shape[1:])))
            else:  # the scale goes on the small B, not on the output; computed in the adapter's dtype
                pieces.append(((x.to(w.A_r_in.dtype) @ w.A_r_in.T) @ (w.B_out_r.T * w.scale)).to(y.dtype))
        return y + torch.cat(pieces, dim=0)


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
