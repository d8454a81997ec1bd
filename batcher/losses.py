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

Exceptions:

    ValueError
     └── LossInputError   user category: names the offending field (`.field`) and the limit
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from core.loss_spec import LOSS_FUNCTIONS, LossSpec

__all__ = [
    "CONFIG_KEYS",
    "DatumLoss",
    "LOSS_FUNCTIONS",
    "LossConfig",
    "LossInputError",
    "LossSpec",
    "compute_loss",
    "parse_loss_config",
    "reduce_metrics",
    "validate_datum_inputs",
]


class LossInputError(ValueError):
    """A user error in `loss_fn`, `loss_fn_config` or `loss_fn_inputs`; `.field` names the culprit."""

    category = "user"

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Celery / processes
        return (type(self), (self.args[0], self.field))


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class LossConfig:
    """`loss_fn_config`, parsed. Keys that do not apply to the chosen loss have no effect."""

    clip_low_threshold: float = 0.8  # ratio clip floor, 0 ≤ lo ≤ 1 (ppo, cispo)
    clip_high_threshold: float = 1.2  # ratio clip ceiling, hi ≥ 1 (ppo, cispo)
    beta: float = 1.0  # DRO quadratic-penalty coefficient, ≥ 0 (see module docstring)
    is_weight_cap: float | None = None  # TIS cap C > 0 on the importance ratio; None = no cap
    max_staleness: int | None = None  # datums with policy lag > this get zero loss; ≥ 0
    current_policy_version: int | None = None  # set by the trainer, never by the user
    policy_version: int | None = None  # version the request's data was sampled with (a datum's own wins)

    def __post_init__(self) -> None:
        _check_number("clip_low_threshold", self.clip_low_threshold, low=0.0, high=1.0)
        _check_number("clip_high_threshold", self.clip_high_threshold, low=1.0)
        _check_number("beta", self.beta, low=0.0)
        if self.is_weight_cap is not None:
            _check_number("is_weight_cap", self.is_weight_cap, low=0.0, low_open=True)
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, low=0)
        if self.current_policy_version is not None:
            _check_int("current_policy_version", self.current_policy_version, low=0)
        if self.policy_version is not None:
            _check_int("policy_version", self.policy_version, low=0)


CONFIG_KEYS: tuple[str, ...] = (
    "clip_low_threshold",
    "clip_high_threshold",
    "beta",
    "is_weight_cap",
    "max_staleness",
    "policy_version",
)
_OPTIONAL_CONFIG_KEYS = frozenset({"is_weight_cap", "max_staleness", "policy_version"})
_SERVER_CONFIG_KEYS = frozenset({"current_policy_version"})


def _check_number(
    name: str, value: object, *, low: float, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossInputError(f"loss_fn_config[{name!r}] must be a number, got {value!r}", name)
    if not math.isfinite(value):
        raise LossInputError(f"loss_fn_config[{name!r}] must be finite, got {value!r}", name)
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bound = f"> {low}" if low_open else f">= {low}"
        if high is not None:
            bound += f" and <= {high}"
        raise LossInputError(f"loss_fn_config[{name!r}] must be {bound}, got {value!r}", name)


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise LossInputError(
            f"loss_fn_config[{name!r}] must be an integer >= {low}, got {value!r}", name
        )


def parse_loss_config(loss_fn: str, raw: Mapping[str, Any] | None) -> LossConfig:
    """Parse the request's `loss_fn_config`; raise `LossInputError` naming a bad key or value.

    Proto maps carry every number as a double, so integral floats are accepted for
    `max_staleness`; JSON `null` unsets the optional keys.
    """
    _spec(loss_fn)
    if raw is None:
        return LossConfig()
    if not isinstance(raw, Mapping):
        raise LossInputError(f"loss_fn_config must be an object, got {type(raw).__name__}", "loss_fn_config")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SERVER_CONFIG_KEYS:
            raise LossInputError(
                f"loss_fn_config[{key!r}] is set by the server and cannot be sent", str(key)
            )
        if key not in CONFIG_KEYS:
            raise LossInputError(
                f"unknown loss_fn_config key {key!r} for loss_fn {loss_fn!r}; "
                f"allowed keys: {', '.join(CONFIG_KEYS)}",
                str(key),
            )
        if value is None and key in _OPTIONAL_CONFIG_KEYS:
            continue
        if key in ("max_staleness", "policy_version") and isinstance(value, float) and value.is_integer():
            value = int(value)
        values[key] = value
    return LossConfig(**values)


# ---------------------------------------------------------------------------------------------
# Input specifications and validation


# The table of losses and their inputs lives in core.loss_spec (the API validates with it too).


def _spec(loss_fn: str) -> LossSpec:
    spec = LOSS_FUNCTIONS.get(loss_fn) if isinstance(loss_fn, str) else None
    if spec is None:
        raise LossInputError(
            f"loss_fn {loss_fn!r} is not supported; it must be one of {', '.join(LOSS_FUNCTIONS)}",
            "loss_fn",
        )
    return spec


def _as_tensor(value: object, key: str, where: str) -> Tensor:
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise LossInputError(f"{where}[{key!r}] is not a numeric array: {exc}", key) from None


def validate_datum_inputs(
    loss_fn: str,
    inputs: Mapping[str, Any],
    n_tokens: int,
    datum_index: int,
    *,
    vocab_size: int | None = None,
) -> None:
    """Check one datum's `loss_fn_inputs` (tensors or lists) against `loss_fn`.

    `n_tokens` is the datum's model-input token count; every input must be 1-D of that length.
    Raises `LossInputError` whose `.field` is the offending key (or "loss_fn").
    """
    spec = _spec(loss_fn)
    where = f"datums[{datum_index}].loss_fn_inputs"
    missing = sorted(spec.required_inputs - inputs.keys())
    if missing:
        raise LossInputError(
            f"{where} is missing {missing[0]!r}, required by loss_fn {loss_fn!r} "
            f"(required: {', '.join(sorted(spec.required_inputs))})",
            missing[0],
        )
    extra = sorted(set(inputs) - spec.allowed_inputs)
    if extra:
        raise LossInputError(
            f"{where} has unknown key {extra[0]!r} for loss_fn {loss_fn!r}; "
            f"allowed keys: {', '.join(sorted(spec.allowed_inputs))}",
            str(extra[0]),
        )
    for key, value in inputs.items():
        tensor = _as_tensor(value, key, where)
        if tensor.dim() == 2 and key in ("target_tokens", "weights"):
            raise LossInputError(
                f"{where}[{key!r}] is 2-D {tuple(tensor.shape)}: top-K distillation targets "
                "(N, K) are not supported yet; send 1-D (N,) arrays",
                key,
            )
        if tensor.dim() != 1:
            raise LossInputError(
                f"{where}[{key!r}] must be 1-D of length {n_tokens}, got shape {tuple(tensor.shape)}",
                key,
            )
        if tensor.shape[0] != n_tokens:
            raise LossInputError(
                f"{where}[{key!r}] has length {tensor.shape[0]}, but the model input has "
                f"{n_tokens} tokens; every loss_fn_inputs array must have that length",
                key,
            )
        if key == "target_tokens":
            _check_target_tokens(tensor, where, vocab_size)
        else:
            _check_float_input(tensor, key, where)
    lo, hi = inputs.get("clip_low_threshold"), inputs.get("clip_high_threshold")
    if lo is not None:
        _check_threshold(torch.as_tensor(lo), "clip_low_threshold", where, 0.0, 1.0)
    if hi is not None:
        _check_threshold(torch.as_tensor(hi), "clip_high_threshold", where, 1.0, math.inf)


def _check_target_tokens(tokens: Tensor, where: str, vocab_size: int | None) -> None:
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise LossInputError(
            f"{where}['target_tokens'] must be integers (int64), got dtype {tokens.dtype}",
            "target_tokens",
        )
    if tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise LossInputError(
            f"{where}['target_tokens'] must be >= 0, got {low}", "target_tokens"
        )
    if vocab_size is not None and high >= vocab_size:
        raise LossInputError(
            f"{where}['target_tokens'] must be < the vocabulary size {vocab_size}, got {high}",
            "target_tokens",
        )


def _check_float_input(tensor: Tensor, key: str, where: str) -> None:
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise LossInputError(f"{where}[{key!r}] must be float32, got dtype {tensor.dtype}", key)
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).nonzero()[0, 0])
        raise LossInputError(
            f"{where}[{key!r}] must be finite; position {bad} is {float(tensor[bad]):.6g}", key
        )


def _check_threshold(tensor: Tensor, key: str, where: str, low: float, high: float) -> None:
    bad_T = (tensor < low) | (tensor > high)
    if bool(bad_T.any()):
        pos = int(bad_T.nonzero()[0, 0])
        bound = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise LossInputError(
            f"{where}[{key!r}] must be {bound}; position {pos} is {float(tensor[pos]):.6g}", key
        )


# ---------------------------------------------------------------------------------------------
# Loss computation


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
    """One datum's loss, outputs and metrics. `inputs` must have passed `validate_datum_inputs`.

    `policy_version` is the policy version the datum was sampled with (None = unknown).
    """
    _spec(loss_fn)
    if target_logprobs_T.dim() != 1:
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
