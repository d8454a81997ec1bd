"""Optimizer steps over a list of adapters: a round's steps taken together, AdamW and Dimuon alike.

Each model keeps its own optimizer family (chosen at creation), hyperparameters, clipping and
optimizer state, and gets exactly the step it would get alone. Taken together, a round's steps
cost one norm kernel over every gradient (both families clip alike), one read-back of the norms,
one zeroing of the gradients, and then per family: one AdamW call per set of hyperparameters (fused
on a GPU; `clip_grad_norm_` then `torch.optim.AdamW.step()` exactly), and for Dimuon one batched
matrix-sign iteration per LoRA matrix shape over every model's matrices of that shape
(`step_dimuon`). A further family is another `step_*` function here, chosen per adapter by its
`family`.
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
from core.work import (
    ADAMW,
    DIMUON,
    DIMUON_DAMPING,
    DimuonParams,
    OptimParams,
    check_family,
    family_of,
    params_field,
)

Outcome = dict[str, Any] | QuiltError

# Dimuon's internal constants (tinker documents them as such): the matrix-sign iteration, five
# quintic Newton-Schulz steps with Muon's coefficients (fast growth of small singular values) then
# two cubic ones (which converge to the sign: the quintic alone leaves them anywhere in ~[0.7, 1.2]).
# Normalisations divide by the norm or, for a zero matrix, by the dtype's smallest normal number
# (a zero matrix gives a zero step; no epsilon biases a small one).
NS_QUINTIC = (3.4445, -4.7750, 2.0315)
NS_QUINTIC_STEPS = 5
NS_CUBIC_STEPS = 2
RANK_REFERENCE = 32  # the rank at which rank_lr_correction_exponent changes nothing


class Dimuon(torch.optim.Optimizer):
    """A model's Dimuon state in torch's optimizer shape, so that checkpoints, loads and parking
    treat it as they treat AdamW's: one group with the last step's hyperparameters and the LoRA
    rank, one `momentum_buffer` per parameter. Its arithmetic is `step_dimuon`, many models at once."""

    def __init__(self, params: list[torch.Tensor], rank: int):
        super().__init__(params, {"lr": 0.0, "beta1": 0.9, "damping": DIMUON_DAMPING, "rank_exponent": 0.0,
                                  "rank": rank})


def new_adamw(params: list[torch.Tensor], device: torch.device) -> torch.optim.AdamW:
    """A model's AdamW: one fused kernel per step on a GPU; the same arithmetic as the for-loop form."""
    return torch.optim.AdamW(params, fused=True) if device.type == "cuda" else torch.optim.AdamW(params)


def new_optimizer(family: str, params: list[torch.Tensor], *, device: torch.device, rank: int) -> torch.optim.Optimizer:
    """A fresh optimizer of `family` (core.work.OPTIMIZERS) over a model's parameters."""
    return Dimuon(params, rank) if family == DIMUON else new_adamw(params, device)


def _configure(adapter: Adapter, params: OptimParams) -> None:
    """This step's hyperparameters into the adapter's optimizer group."""
    [group] = adapter.optimizer.param_groups
    if isinstance(params, DimuonParams):
        group.update(lr=params.learning_rate, beta1=params.beta1, damping=params.damping,
                     rank_exponent=params.rank_lr_correction_exponent)
    else:
        group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                     weight_decay=params.weight_decay)


def take_steps(lora: MultiLoraModel, steps: list[tuple[Adapter, OptimParams]]) -> list[Outcome]:
    """One optimizer step per adapter (distinct, resident), one result or one error each, in order:
    its metrics, `skipped:sum` without gradients, a user error (weights unchanged) where its
    gradients overflowed or its hyperparameters are of another family than its optimizer."""
    outcomes: list[Outcome | None] = [None] * len(steps)
    live = []
    for i, (adapter, params) in enumerate(steps):
        try:
            check_family(adapter.family, family_of(params))  # (the API refuses it first)
        except QuiltError as exc:
            outcomes[i] = exc
            continue
        if not any(p.grad is not None for p in adapter.params):
            outcomes[i] = {"metrics": {"skipped:sum": 1.0}}
            continue
        _configure(adapter, params)
        live.append(i)
    if not live:
        return cast(list[Outcome], outcomes)  # (every step has its outcome by now)
    norms = clip(lora, [steps[i][0] for i in live], [steps[i][1].grad_clip_norm for i in live])
    stepping = []
    for i, norm in zip(live, norms.tolist()):  # the steps' one read-back
        adapter, params = steps[i]
        if not math.isfinite(norm):
            # Finite losses can still give gradients past float32; a step would make the weights NaN.
            lora.clear_grads(adapter.name)
            outcomes[i] = UserError("the accumulated gradients are not finite (they overflowed float32): make "
                                    "the weights or advantages smaller; the gradients were discarded and the "
                                    "weights are unchanged", field=params_field(adapter.family))
            continue
        stepping.append(adapter)
        outcomes[i] = {"metrics": {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate,
                                   "step:max": float(adapter.steps + 1)}}
    step_adamw([a for a in stepping if a.family == ADAMW])
    step_dimuon([a for a in stepping if a.family == DIMUON])
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


def step_dimuon(adapters: list[Adapter]) -> None:
    """One Dimuon step of each of these models (gradients already clipped), per LoRA matrix X (each
    A and B; each expert's apart) with gradient G and momentum M:

        M <- beta1 M + (1 - beta1) G                         (an EMA; M starts at zero)
        r_i = mean_j M_ij^2 / mean M^2,  c_j = mean_i M_ij^2 / mean M^2
        S = diag(r + damping)^(-1/4),    T = diag(c + damping)^(-1/4)
        U = S sign(S M T) T                                  (sign: `matrix_sign`)
        X <- X - lr (rank / 32)^rank_lr_correction_exponent sqrt(rank) U / |U|_F

    i.e. steepest descent under the spectral norm weighted by the rows' and columns' RMS (damping
    relative to their mean: large damping is Muon, small equalises rows and columns), taken at
    Frobenius norm sqrt(rank), the norm of an exact sign of a rank-`rank` LoRA matrix."""
    if not adapters:
        return
    groups = [a.optimizer.param_groups[0] for a in adapters]
    params: list[torch.Tensor] = []
    momenta: list[torch.Tensor] = []
    owners: list[int] = []
    with torch.no_grad():
        for k, (adapter, group) in enumerate(zip(adapters, groups)):
            live = [p for p in adapter.params if p.grad is not None]
            held = [_momentum(adapter.optimizer, p) for p in live]
            torch._foreach_lerp_(held, [cast(torch.Tensor, p.grad) for p in live], 1.0 - group["beta1"])
            params += live
            momenta += held
            owners += [k] * len(live)
        directions = dimuon_directions(momenta, [groups[k]["damping"] for k in owners],
                                       [groups[k]["rank"] for k in owners])
        for k, group in enumerate(groups):
            mine = [i for i, owner in enumerate(owners) if owner == k]
            rate = group["lr"] * (group["rank"] / RANK_REFERENCE) ** group["rank_exponent"]
            torch._foreach_add_([params[i] for i in mine], [directions[i] for i in mine], alpha=-rate)


def _momentum(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    state = optimizer.state[p]
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return cast(torch.Tensor, state["momentum_buffer"])


def dimuon_directions(momenta: list[torch.Tensor], damping: list[float], rank: list[int]) -> list[torch.Tensor]:
    """Each momentum's step direction (`step_dimuon`), of Frobenius norm sqrt(rank) per matrix.
    Matrices of one shape, whichever models they are of, go through one batched iteration, taken
    wide (a tall matrix transposed: the same result, a smaller Gram matrix)."""
    out: list[torch.Tensor | None] = [None] * len(momenta)
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(momenta):
        buckets.setdefault((min(m.shape[-2:]), max(m.shape[-2:]), m.dtype, m.device), []).append(i)
    for members in buckets.values():
        wide = [_wide(momenta[i]) for i in members]
        counts = [w.shape[0] for w in wide]
        x = torch.cat(wide)
        per = torch.tensor([[damping[i], math.sqrt(rank[i])] for i, n in zip(members, counts) for _ in range(n)],
                           dtype=x.dtype).to(x.device)  # the host's side, in one transfer
        for i, part in zip(members, _direction(x, per[:, 0, None, None], per[:, 1, None, None]).split(counts)):
            like = momenta[i]
            out[i] = (part.mT if like.shape[-2] > like.shape[-1] else part).reshape(like.shape)
    return cast(list[torch.Tensor], out)


def _wide(m: torch.Tensor) -> torch.Tensor:
    x = m.reshape(-1, *m.shape[-2:])
    return x.mT if x.shape[-2] > x.shape[-1] else x


def _direction(x: torch.Tensor, damping: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`step_dimuon`'s direction of each matrix of the batch `x` [B, m, n]."""
    tiny = torch.finfo(x.dtype).tiny
    sq = x.square()
    mean = sq.mean((-2, -1), keepdim=True).clamp_min(tiny)
    s = (sq.mean(-1, keepdim=True) / mean + damping).pow(-0.25)
    t = (sq.mean(-2, keepdim=True) / mean + damping).pow(-0.25)
    # Scaled to at most 1 (the direction is normalised after): the same direction, never overflowing.
    s, t = s / s.amax(-2, keepdim=True), t / t.amax(-1, keepdim=True)
    u = s * matrix_sign(s * x * t) * t
    norm: torch.Tensor = torch.linalg.matrix_norm(u, keepdim=True)
    return u / norm.clamp_min(tiny) * scale


def matrix_sign(x: torch.Tensor) -> torch.Tensor:
    """The polar factor (matrix sign) of each matrix of `x` [B, m, n], m <= n, by Newton-Schulz:
    scaled to Frobenius norm 1 (every singular value in [0, 1]), then NS_QUINTIC_STEPS quintic
    steps and NS_CUBIC_STEPS cubic ones. A zero matrix stays zero."""
    norm: torch.Tensor = torch.linalg.matrix_norm(x, keepdim=True)
    x = x / norm.clamp_min(torch.finfo(x.dtype).tiny)
    a, b, c = NS_QUINTIC
    for _ in range(NS_QUINTIC_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    for _ in range(NS_CUBIC_STEPS):
        x = 1.5 * x - 0.5 * (x @ x.mT) @ x
    return x


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
