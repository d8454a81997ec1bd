"""Tinker's built-in loss functions, per datum, in pure torch (no I/O, no model).

The trainer runs the model, gathers for each datum `target_logprobs_T` (shape `(N,)`,
`log p_θ(target_tokens[t] | prefix)`, with grad) and calls `compute_loss` once per datum. Losses are
per token and summed over tokens and datums; nothing is ever divided by a token count (users scale
through `weights` / `advantages`, Tinker semantics).

Notation: `lp` = trainer logprobs (`target_logprobs_T`), `slp` = sampler logprobs (input
`logprobs`), `A` = input `advantages`, `ratio = exp(lp − slp)`, `sg` = stop-gradient.

| loss_fn               | per-token loss                                        |
|-----------------------|-------------------------------------------------------|
| `cross_entropy`       | `−lp·w` (`w` = input `weights`, default 1)            |
|                       | top-K targets: `lp`, `w` of shape `(N, K)`, summed    |
| `importance_sampling` | `−ratio·A`                                            |
| `ppo`                 | `−min(ratio·A, clip(ratio, lo, hi)·A)`                |
| `cispo`               | `−sg(clip(ratio, lo, hi))·lp·A`                       |
| `dro`                 | `−(lp·A − ½β(lp − slp)²)`                             |

Conventions chosen here (Tinker does not publish them):

* Truncated importance weights (`is_weight_cap = C`, TIS): wherever a loss uses `ratio`
  (`importance_sampling`, `ppo`, `cispo`) it uses `r̃ = min(ratio, C)` with value `min(ratio, C)`
  and gradient `min(ratio, C)·∇lp`, i.e. `r̃ = sg(min(ratio, C))·exp(lp − sg(lp))`. This equals
  `ratio·min(1, C/sg(ratio))` but never forms `inf·0` when the ratio overflows. For
  `importance_sampling` it is exactly TIS-REINFORCE: `∇L = −Σ min(ratio, C)·A·∇lp`.
* `weights` is accepted by every loss (Tinker's docs send it with RL datums) but only
  `cross_entropy` multiplies by it, as in Tinker's published formulas. All losses use it for the
  mismatch mask below.
* Mismatch mask: tokens where `weights ≠ 0` when `weights` is given, else tokens where
  `slp ≠ 0 or A ≠ 0` (the cookbook pads prompt positions with `logprobs = 0, advantages = 0`).
* k3 direction: tokens were sampled from the sampler q, so the estimator is of `KL(q‖p)`:
  with `r = p/q = exp(lp − slp)`, `k3 = (r − 1) − log r = expm1(Δ) − Δ`, `Δ = lp − slp`;
  `E_q[k3] = KL(q‖p)` and every term is ≥ 0.
* Staleness: `lag = config.current_policy_version − policy_version` (both needed). When
  `max_staleness` is set and `lag > max_staleness` the datum contributes a zero loss (gradient zero,
  still connected to the graph), `logprobs` are still returned and `dropped_stale:sum` counts it.
* `beta` (DRO) defaults to 1.0: per token, the DRO objective is maximal at `lp − slp = A/β`, so β
  sets how far (in nats) a token may move per unit of advantage. With advantages of order 1,
  β = 1 keeps the optimum within about a nat of the sampler (ratio ≲ e) while its gradient `β·Δ`
  is negligible on-policy (Δ ≈ 0); small values like 0.05 allow ~20 nats, i.e. no constraint.
* Metrics (every key has exactly one ':'): `loss:sum` always; with sampler logprobs
  `mismatch_kl:mean`, `logprob_diff_abs:mean` (token-weighted over masked tokens); with versions
  `staleness:mean` (datum-weighted), `staleness:max`; with `max_staleness` also `dropped_stale:sum`.

Inputs are checked once, at the API (`api.datums.normalise`, `core.loss_spec.parse_loss_config`):
this module trusts them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from core.loss_spec import LossConfig, spec_of

__all__ = ["DatumLoss", "compute_loss", "reduce_metrics"]


@dataclass
class DatumLoss:
    """One datum's loss. `metric_weights[key]` is the weight of a ':mean' metric in reductions."""

    loss: Tensor  # scalar, differentiable w.r.t. target_logprobs_T
    outputs: dict[str, Tensor]  # "logprobs" (detached target logprobs), "elementwise_loss"
    metrics: dict[str, float]
    metric_weights: dict[str, float] = field(default_factory=dict)


def _truncated_ratio_T(lp_T: Tensor, slp_T: Tensor, cap: float | None) -> Tensor:
    """`exp(lp − slp)`, or with a cap: value `min(ratio, cap)`, gradient `min(ratio, cap)·∇lp`."""
    if cap is None:
        return torch.exp(lp_T - slp_T)
    weight_T = torch.clamp(torch.exp(lp_T.detach() - slp_T), max=cap)
    return weight_T * torch.exp(lp_T - lp_T.detach())


def _thresholds_T(x: Mapping[str, Tensor], config: LossConfig, like_T: Tensor) -> tuple[Tensor, Tensor]:
    lo_T = x.get("clip_low_threshold")
    hi_T = x.get("clip_high_threshold")
    if lo_T is None:
        lo_T = torch.full_like(like_T, config.clip_low_threshold)
    if hi_T is None:
        hi_T = torch.full_like(like_T, config.clip_high_threshold)
    return lo_T, hi_T


def _cross_entropy_T(lp_T: Tensor, x: Mapping[str, Tensor], config: LossConfig) -> Tensor:
    weights_T = x.get("weights")
    return -lp_T if weights_T is None else -lp_T * weights_T


def _importance_sampling_T(lp_T: Tensor, x: Mapping[str, Tensor], config: LossConfig) -> Tensor:
    ratio_T = _truncated_ratio_T(lp_T, x["logprobs"], config.is_weight_cap)
    return -ratio_T * x["advantages"]


def _ppo_T(lp_T: Tensor, x: Mapping[str, Tensor], config: LossConfig) -> Tensor:
    ratio_T = _truncated_ratio_T(lp_T, x["logprobs"], config.is_weight_cap)
    lo_T, hi_T = _thresholds_T(x, config, ratio_T)
    advantages_T = x["advantages"]
    unclipped_T = ratio_T * advantages_T
    clipped_T = torch.clamp(ratio_T, min=lo_T, max=hi_T) * advantages_T
    return -torch.minimum(unclipped_T, clipped_T)


def _cispo_T(lp_T: Tensor, x: Mapping[str, Tensor], config: LossConfig) -> Tensor:
    ratio_T = _truncated_ratio_T(lp_T.detach(), x["logprobs"], config.is_weight_cap)
    lo_T, hi_T = _thresholds_T(x, config, ratio_T)
    coefficient_T = torch.clamp(ratio_T, min=lo_T, max=hi_T)  # detached: sg(clip(ratio))
    return -coefficient_T * lp_T * x["advantages"]


def _dro_T(lp_T: Tensor, x: Mapping[str, Tensor], config: LossConfig) -> Tensor:
    penalty_T = 0.5 * config.beta * (lp_T - x["logprobs"]) ** 2
    return -(lp_T * x["advantages"] - penalty_T)


_ELEMENTWISE: Mapping[str, Callable[[Tensor, Mapping[str, Tensor], LossConfig], Tensor]] = {
    "cross_entropy": _cross_entropy_T,
    "importance_sampling": _importance_sampling_T,
    "ppo": _ppo_T,
    "cispo": _cispo_T,
    "dro": _dro_T,
}


def _mismatch_mask_T(x: Mapping[str, Tensor]) -> Tensor:
    weights_T = x.get("weights")
    if weights_T is not None:
        return weights_T != 0
    mask_T = x["logprobs"] != 0
    advantages_T = x.get("advantages")
    return mask_T if advantages_T is None else mask_T | (advantages_T != 0)


def _mismatch_metrics(
    lp_T: Tensor, x: Mapping[str, Tensor]
) -> tuple[dict[str, float], dict[str, float]]:
    mask_T = _mismatch_mask_T(x)
    n_tokens = int(mask_T.sum())
    if n_tokens == 0:
        return {}, {}
    diff_M = (lp_T.detach().double() - x["logprobs"].double())[mask_T]
    k3_M = torch.expm1(diff_M) - diff_M  # r − 1 − log r, r = p/q: estimates KL(q‖p)
    metrics = {
        "mismatch_kl:mean": float(k3_M.mean()),
        "logprob_diff_abs:mean": float(diff_M.abs().mean()),
    }
    return metrics, {key: float(n_tokens) for key in metrics}


def compute_loss(
    loss_fn: str,
    target_logprobs_T: Tensor,
    inputs: Mapping[str, Any],
    config: LossConfig,
    *,
    policy_version: int | None = None,
) -> DatumLoss:
    """One datum's loss, outputs and metrics. `inputs` must have passed `api.datums.normalise`.

    `policy_version` is the policy version the datum was sampled with (None = unknown).
    """
    spec_of(loss_fn)
    # (N, K) only for top-K targets of cross_entropy, whose inputs are then (N, K) too.
    if target_logprobs_T.dim() != 1 and not (target_logprobs_T.dim() == 2 and loss_fn == "cross_entropy"):
        raise ValueError(f"target_logprobs_T must be 1-D, got shape {tuple(target_logprobs_T.shape)}")
    dtype = torch.promote_types(target_logprobs_T.dtype, torch.float32)
    lp_T = target_logprobs_T.to(dtype)
    x = {
        key: torch.as_tensor(value).to(device=lp_T.device, dtype=dtype)
        for key, value in inputs.items()
        if key != "target_tokens"
    }

    metrics: dict[str, float] = {}
    metric_weights: dict[str, float] = {}
    dropped = False
    if policy_version is not None and config.current_policy_version is not None:
        lag = config.current_policy_version - policy_version
        metrics["staleness:mean"] = float(lag)
        metric_weights["staleness:mean"] = 1.0
        metrics["staleness:max"] = float(lag)
        if config.max_staleness is not None:
            dropped = lag > config.max_staleness
            metrics["dropped_stale:sum"] = 1.0 if dropped else 0.0

    if dropped:
        elementwise_loss_T = torch.zeros_like(lp_T)
        loss = lp_T[:0].sum()  # zero, and still part of the graph (gradient zero)
    else:
        elementwise_loss_T = _ELEMENTWISE[loss_fn](lp_T, x, config)
        loss = elementwise_loss_T.sum()
    metrics["loss:sum"] = float(loss.detach())

    if "logprobs" in x:
        mismatch, weights = _mismatch_metrics(lp_T, x)
        metrics.update(mismatch)
        metric_weights.update(weights)

    outputs = {
        "logprobs": target_logprobs_T.detach(),
        "elementwise_loss": elementwise_loss_T.detach(),
    }
    return DatumLoss(loss=loss, outputs=outputs, metrics=metrics, metric_weights=metric_weights)


def reduce_metrics(per_datum: list[DatumLoss]) -> dict[str, float]:
    """Request-level metrics: ':sum' summed, ':max' maxed, ':min' minned, ':mean' weighted.

    A ':mean' is weighted by each datum's `metric_weights[key]` (default 1 = datum-weighted):
    the mismatch means are token-weighted (pooled over all masked tokens of the request),
    `staleness:mean` is datum-weighted. A key is reduced over the datums that report it;
    `loss:sum` is always present.
    """
    sums: dict[str, float] = {"loss:sum": 0.0}
    extremes: dict[str, float] = {}
    weighted: dict[str, list[float]] = {}  # key -> [Σ value·weight, Σ weight]
    for datum in per_datum:
        for key, value in datum.metrics.items():
            _, reduction = key.split(":")
            if reduction == "sum":
                sums[key] = sums.get(key, 0.0) + value
            elif reduction == "max":
                extremes[key] = max(extremes.get(key, value), value)
            elif reduction == "min":
                extremes[key] = min(extremes.get(key, value), value)
            elif reduction == "mean":
                weight = datum.metric_weights.get(key, 1.0)
                acc = weighted.setdefault(key, [0.0, 0.0])
                acc[0] += value * weight
                acc[1] += weight
            else:
                raise ValueError(f"metric {key!r} has unknown reduction {reduction!r}")
    means = {key: total / weight for key, (total, weight) in weighted.items() if weight > 0}
    return {**sums, **extremes, **means}
