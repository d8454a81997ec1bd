"""Optimizer steps over a list of adapters: a round's steps taken together.

Each model keeps its own hyperparameters, clipping and optimizer state, and gets exactly the step
it would get alone (`clip_grad_norm_` then `torch.optim.AdamW.step()`); taken together, a round's
steps cost one norm kernel over every gradient, one read-back of the norms, one AdamW call per set
of hyperparameters (fused on a GPU) and one zeroing of the gradients, rather than all of that per
model. A further optimizer family is another `step_*` function here beside `step_adamw`, chosen per
adapter by its optimizer.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch.optim.adamw import adamw

from batcher.engine.adapter import Adapter
from batcher.engine.multilora import MultiLoraModel
from batcher.engine.transfer import Bundle
from core.errors import QuiltError, UserError
from core.work import AdamParams

Outcome = dict[str, Any] | QuiltError


def new_adamw(params: list[torch.Tensor], device: torch.device) -> torch.optim.AdamW:
    """A model's AdamW: one fused kernel per step on a GPU; the same arithmetic as the for-loop form."""
    return torch.optim.AdamW(params, fused=True) if device.type == "cuda" else torch.optim.AdamW(params)


def take_steps(lora: MultiLoraModel, steps: list[tuple[Adapter, AdamParams]]) -> list[Outcome]:
    """One optimizer step per adapter (distinct, resident), one result or one error each, in order:
    its metrics, `skipped:sum` without gradients, a user error (weights unchanged) where its
    gradients overflowed."""
    outcomes: list[Outcome | None] = [None] * len(steps)
    live = []
    for i, (adapter, adam) in enumerate(steps):
        if not any(p.grad is not None for p in adapter.params):
            outcomes[i] = {"metrics": {"skipped:sum": 1.0}}
            continue
        for group in adapter.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        live.append(i)
    if not live:
        return cast(list[Outcome], outcomes)  # (every step has its outcome by now)
    norms = clip(lora, [steps[i][0] for i in live], [steps[i][1].grad_clip_norm for i in live])
    stepping = []
    for i, norm in zip(live, norms.tolist()):  # the steps' one read-back
        adapter, adam = steps[i]
        if not math.isfinite(norm):
            # Finite losses can still give gradients past float32; a step would make the weights NaN.
            lora.clear_grads(adapter.name)
            outcomes[i] = UserError("the accumulated gradients are not finite (they overflowed float32): make "
                                    "the weights or advantages smaller; the gradients were discarded and the "
                                    "weights are unchanged", field="adam_params")
            continue
        stepping.append(adapter)
        outcomes[i] = {"metrics": {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate,
                                   "step:max": float(adapter.steps + 1)}}
    step_adamw(stepping)
    for adapter in stepping:
        lora.clear_grads(adapter.name)
        lora.changed(adapter.name)
        adapter.steps += 1
    return cast(list[Outcome], outcomes)


def step_adamw(adapters: list[Adapter]) -> None:
    """One AdamW call per set of hyperparameters over these models' parameters, each with its own
    state: what each model's optimizer.step() does, the same arithmetic (on a GPU one fused
    kernel for all; on the CPU tensor by tensor, as torch's CPU AdamW goes, which keeps each small
    tensor in cache across its updates). A model's first step goes through its own optimizer,
    which makes its state."""
    groups: dict[tuple[Any, ...], list[Adapter]] = {}
    for adapter in adapters:
        if any(p.grad is not None and not adapter.optimizer.state.get(p) for p in adapter.params):
            adapter.optimizer.step()
            continue
        [group] = adapter.optimizer.param_groups
        key = (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["amsgrad"],
               group["maximize"], bool(group.get("fused")))
        groups.setdefault(key, []).append(adapter)
    for (lr, (beta1, beta2), eps, weight_decay, amsgrad, maximize, fused), members in groups.items():
        params, grads = [], []
        for p in (p for a in members for p in a.params):
            if p.grad is not None:
                params.append(p)
                grads.append(p.grad)
        states = [a.optimizer.state[p] for a in members for p in a.params if p.grad is not None]
        with torch.no_grad():
            adamw(params, grads, [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                  [s["step"] for s in states], foreach=False, fused=fused, amsgrad=amsgrad, beta1=beta1,
                  beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)


def clip(lora: MultiLoraModel, adapters: list[Adapter], clips: list[float]) -> torch.Tensor:
    """`clip_grad_norm_` of each adapter's whole gradient (a clip of 0: none), for all of them at
    once; returns their norms. Under a split base the squared norms of the shares are summed over
    the gang in one all-reduce (a whole tensor counts once)."""
    grads, owner, shared, split = [], [], [], None
    for k, adapter in enumerate(adapters):
        for p, (share, axis) in zip(adapter.params, lora.shares(adapter.name)):
            if p.grad is not None:
                grads.append(p.grad)
                owner.append(k)
                shared.append(axis is not None)
                split = split or (share if axis is not None else None)
    squares = torch.stack(torch._foreach_norm(grads)).pow(2)
    limits = [c if c > 0 else math.inf for c in clips]
    # the host's side of it, in one transfer
    t_owner, t_shared, t_limits = Bundle((torch.tensor(owner, dtype=torch.long), torch.tensor(shared),
                                          torch.tensor(limits, dtype=squares.dtype))).to(squares.device)
    if split is None:
        sq = squares.new_zeros(len(adapters)).index_add_(0, t_owner, squares)
    else:
        parts = squares.new_zeros(len(adapters)).index_add_(0, t_owner, torch.where(t_shared, squares, 0.0))
        split.all_reduce(parts)
        sq = parts.index_add_(0, t_owner, torch.where(t_shared, 0.0, squares))
    norms = sq.sqrt()
    # torch's own rule: scale by max_norm / (norm + 1e-6), never up
    coefs = torch.clamp(t_limits / (norms + 1e-6), max=1.0)
    for k, adapter in enumerate(adapters):
        torch._foreach_mul_([p.grad for p in adapter.params if p.grad is not None], coefs[k])
    return norms
