"""Tinker's built-in loss functions, per datum, in pure torch (no I/O, no model).

The trainer runs the model, gathers every datum's `target_logprobs` (`log p_θ(target_tokens[t] |
prefix)`, with grad) into one (tokens, K) tensor and computes every datum's loss in one vectorised
call (`LossPlan` on the host, `pass_losses` on the device): no per-datum loop, nothing read back
until the pass ends. `compute_loss` is the same computation for one datum. Losses are per token and
summed over tokens and datums; nothing is ever divided by a token count (users scale through
`weights` / `advantages`, Tinker semantics).

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
| `gspo`                | `−min(s_t·A, clip(s_t, lo, hi)·A)`, `s_t = exp(mean_M(sg(lp) − slp) + lp − sg(lp))` |
| `stable_reinforce`    | `−m·ratio·A`, `m = [1/C ≤ ratio ≤ C]` (C = `is_weight_cap`, 2 by default), gradient `−m·ratio·A·∇lp` |

Conventions chosen here (Tinker does not publish them):

* Truncated importance weights (`is_weight_cap = C`, TIS): wherever a loss uses `ratio`
  (`importance_sampling`, `ppo`, `cispo`) it uses `r̃ = min(ratio, C)` with value `min(ratio, C)`
  and gradient `min(ratio, C)·∇lp`, i.e. `r̃ = sg(min(ratio, C))·exp(lp − sg(lp))`. This equals
  `ratio·min(1, C/sg(ratio))` but never forms `inf·0` when the ratio overflows. For
  `importance_sampling` it is exactly TIS-REINFORCE: `∇L = −Σ min(ratio, C)·A·∇lp`.
* `gspo` is GSPO-token as Tinker documents it: `M` = the datum's positions where
  `sequence_ratio_mask ≠ 0`; every position carries the sequence ratio's value and its own
  logprob's gradient. A datum with no masked position has ratio 1 (log-ratio 0), not 0/0.
  Its thresholds are `clip_low_threshold`/`clip_high_threshold` (`1 − ε_low`, `1 + ε_high`).
* `stable_reinforce` is Tinker's name; Tinker does not publish the objective. Quilt's: REINFORCE
  with the importance ratio against the logprobs the sampler recorded (`api.provenance` puts them in
  `logprobs`, and zeroes `advantages` on every position no sampled span covers), kept where it lies
  inside `[1/C, C]` and zero outside. A token whose trainer and sampler disagree past the band
  (stale weights, another numeric precision, a kernel's bug) drops out of the gradient instead of
  scaling it; inside the band the estimator is unbiased importance-weighted REINFORCE. Its cap is
  the band, so `C` must be >= 1 (`core.loss_spec.parse_loss_config`).
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

A datum whose loss is not finite, or which is dropped, must not poison the gradient of its
neighbours: its logprobs pass through `GradGate`, whose backward lets through only the gradient of
datums that are kept (a select, so an infinite local derivative times zero never becomes NaN).

Inputs are checked once, at the API (`api.datums.normalise`, `core.loss_spec.parse_loss_config`):
this module trusts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from core.loss_spec import CUSTOM, LOSS_FUNCTIONS, STABLE_REINFORCE, STABLE_REINFORCE_CAP, LossConfig, spec_of

__all__ = ["DatumLoss", "GradGate", "LossInputs", "LossPlan", "LossTensors", "compute_loss", "pass_losses", "reduce_metrics"]


@dataclass
class DatumLoss:
    """One datum's loss. `metric_weights[key]` is the weight of a ':mean' metric in reductions."""

    loss: Tensor  # scalar, differentiable w.r.t. target_logprobs_T
    outputs: dict[str, Tensor]  # "logprobs" (detached target logprobs), "elementwise_loss"
    metrics: dict[str, float]
    metric_weights: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class DatumSpec:
    """One datum as the loss sees it on the host: its inputs as tensors ((n,), or (n, K) for top-K
    weights), `n` target positions of `width` targets each."""

    loss_fn: str
    inputs: Mapping[str, Tensor]
    n: int
    width: int
    config: LossConfig
    policy_version: int | None = None

    @property
    def lag(self) -> int | None:
        current = self.config.current_policy_version
        return None if self.policy_version is None or current is None else current - self.policy_version

    @property
    def dropped(self) -> bool:
        return self.lag is not None and self.config.max_staleness is not None and self.lag > self.config.max_staleness


@dataclass
class LossInputs:
    """Per target position (datums one after another): the loss functions' inputs. `weights` is
    (positions, K); the others are (positions,)."""

    weights: Tensor
    logprobs: Tensor  # the sampler's
    advantages: Tensor
    lo: Tensor  # clip thresholds
    hi: Tensor
    cap: Tensor  # the truncated importance weight's cap (inf: none)
    beta: Tensor  # DRO's
    seq_mask: Tensor  # GSPO's sequence_ratio_mask (1: in the sequence ratio)

    def select(self, at: Tensor) -> LossInputs:
        return LossInputs(*(t.index_select(0, at) for t in self._values()))

    def to(self, dtype: torch.dtype) -> LossInputs:
        return LossInputs(*(t.to(dtype) for t in self._values()))

    def _values(self) -> tuple[Tensor, ...]:
        return (self.weights, self.logprobs, self.advantages, self.lo, self.hi, self.cap, self.beta, self.seq_mask)


@dataclass
class LossTensors:
    """What `pass_losses` reads besides the logprobs: every position's inputs, datum, whether it is
    kept and whether it counts for the mismatch metrics, and each loss function's positions."""

    inputs: LossInputs
    datum: Tensor  # int64
    keep: Tensor  # bool
    mismatch: Tensor  # bool
    at: dict[str, Tensor]  # loss function name -> its positions (int64)

    def to(self, device: torch.device) -> LossTensors:
        return LossTensors(LossInputs(*(t.to(device) for t in self.inputs._values())), self.datum.to(device),
                           self.keep.to(device), self.mismatch.to(device),
                           {fn: t.to(device) for fn, t in self.at.items()})


# One record's tensors travel to the device flattened (batcher.engine.transfer): these are pytrees.
for _record in (LossInputs, LossTensors):
    pytree.register_dataclass(_record)


@dataclass
class _Columns:
    """`LossTensors` being built, one datum (or padding run) at a time."""

    width: int
    inputs: dict[str, list[Tensor]] = field(default_factory=lambda: {
        k: [] for k in ("weights", "logprobs", "advantages", "lo", "hi", "cap", "beta", "seq_mask")})
    datum: list[Tensor] = field(default_factory=list)
    keep: list[Tensor] = field(default_factory=list)
    mismatch: list[Tensor] = field(default_factory=list)
    fn: list[int] = field(default_factory=list)

    def add(self, index: int, d: DatumSpec) -> int:
        """One datum's positions; returns how many of them count for the mismatch metrics."""
        n, x, c = d.n, d.inputs, d.config
        weights = torch.zeros(n, self.width, dtype=torch.float64)
        if "weights" in x:
            weights[:, :d.width] = x["weights"].double().view(n, d.width)
        else:
            weights[:, 0] = 1.0
        zeros = torch.zeros(n, dtype=torch.float64)
        col = self.inputs
        col["weights"].append(weights)
        col["logprobs"].append(x["logprobs"].double() if "logprobs" in x else zeros)
        col["advantages"].append(x["advantages"].double() if "advantages" in x else zeros)
        for key, name, default in (("clip_low_threshold", "lo", c.clip_low_threshold),
                                   ("clip_high_threshold", "hi", c.clip_high_threshold)):
            col[name].append(x[key].double() if key in x else torch.full((n,), default, dtype=torch.float64))
        cap = c.is_weight_cap if c.is_weight_cap is not None else (
            STABLE_REINFORCE_CAP if d.loss_fn == STABLE_REINFORCE else float("inf"))
        col["cap"].append(torch.full((n,), cap, dtype=torch.float64))
        col["beta"].append(torch.full((n,), c.beta, dtype=torch.float64))
        col["seq_mask"].append((x["sequence_ratio_mask"] != 0).double() if "sequence_ratio_mask" in x else zeros)
        self.datum.append(torch.full((n,), index, dtype=torch.int64))
        self.keep.append(torch.full((n,), not d.dropped, dtype=torch.bool))
        self.fn += [LOSS_FUNCTIONS_INDEX.get(d.loss_fn, -1)] * n  # a custom loss: no built-in computes it
        # Mismatch mask: where weights are non-zero when given, else where the sampler's logprob
        # or the advantage is (the cookbook pads prompt positions with zeros).
        if "logprobs" not in x:
            mask = torch.zeros(n, dtype=torch.bool)
        elif "weights" in x:
            mask = x["weights"].view(n, d.width)[:, 0] != 0
        else:
            mask = (x["logprobs"] != 0) | (x["advantages"] != 0 if "advantages" in x else False)
        self.mismatch.append(mask)
        return int(mask.sum())

    def pad(self, extra: int, datum: int) -> None:
        """`extra` padding positions of the padding datum `datum`: they weigh nothing and are never kept."""
        self.inputs["weights"].append(torch.zeros(extra, self.width, dtype=torch.float64))
        for k in ("logprobs", "advantages", "lo", "hi", "beta", "seq_mask"):
            self.inputs[k].append(torch.zeros(extra, dtype=torch.float64))
        self.inputs["cap"].append(torch.full((extra,), float("inf"), dtype=torch.float64))
        self.datum.append(torch.full((extra,), datum, dtype=torch.int64))
        self.keep.append(torch.zeros(extra, dtype=torch.bool))
        self.mismatch.append(torch.zeros(extra, dtype=torch.bool))
        self.fn += [-1] * extra

    def tensors(self, fns: tuple[str, ...], positions: int | None) -> LossTensors:
        """The record; `positions`: a captured pass's fixed count, to which each function's position
        list is padded with the last padding position (computed, never kept)."""
        def cat(parts: list[Tensor], empty: Tensor) -> Tensor:
            return torch.cat(parts) if parts else empty

        f64 = torch.zeros(0, dtype=torch.float64)
        inputs = LossInputs(cat(self.inputs["weights"], torch.zeros(0, self.width, dtype=torch.float64)),
                            *(cat(self.inputs[k], f64)
                              for k in ("logprobs", "advantages", "lo", "hi", "cap", "beta", "seq_mask")))
        fn_of = torch.tensor(self.fn, dtype=torch.int64)
        at = {}
        for fn in fns:
            where = (fn_of == LOSS_FUNCTIONS_INDEX[fn]).nonzero().flatten()
            if positions is not None:
                where = torch.cat([where, torch.full((positions - where.shape[0],), positions - 1, dtype=torch.int64)])
            at[fn] = where
        return LossTensors(inputs, cat(self.datum, torch.zeros(0, dtype=torch.int64)),
                           cat(self.keep, torch.zeros(0, dtype=torch.bool)),
                           cat(self.mismatch, torch.zeros(0, dtype=torch.bool)), at)


@dataclass
class LossPlan:
    """Everything `pass_losses` needs besides the logprobs, built on the host: per target position
    (datums one after another) its datum, inputs, thresholds, cap and beta; per loss function the
    positions it computes. `tensors` go to the device in the pass's one transfer."""

    datums: list[DatumSpec]
    tensors: LossTensors
    fns: tuple[str, ...]
    width: int
    has_logprobs: list[bool]
    mismatch_tokens: list[int]
    size: int = 0  # datums the device computes: len(datums), or the padded count

    @classmethod
    def build(cls, datums: Sequence[DatumSpec], width: int | None = None,
              pad: tuple[int, int] | None = None) -> LossPlan:
        """`pad` = (positions, datums): a captured pass's fixed sizes (`batcher.engine.buckets`), more than
        the datums have. The padding positions belong to the last padding datum, weigh nothing,
        are never kept, and every loss function's position list is padded with the last of them."""
        width = width or max((d.width for d in datums), default=1)
        cols = _Columns(width)
        mismatch_tokens = [cols.add(i, d) for i, d in enumerate(datums)]
        size = len(datums)
        if pad is not None:
            positions, size = pad
            extra = positions - sum(d.n for d in datums)
            if extra < 1 or size <= len(datums):
                raise ValueError(f"padding to {pad} leaves no padding position or datum")
            cols.pad(extra, size - 1)
        fns = tuple(sorted({d.loss_fn for d in datums} - {CUSTOM}))  # custom ones: batcher.engine.custom_losses
        return cls(list(datums), cols.tensors(fns, pad[0] if pad is not None else None), fns, width,
                   ["logprobs" in d.inputs for d in datums], mismatch_tokens, size)

    def metrics(self, loss_D: Sequence[float], kl_D: Sequence[float], abs_D: Sequence[float]) -> list[DatumLoss]:
        """Per-datum metrics from the pass's per-datum sums (read back once, at the end)."""
        out = []
        for i, d in enumerate(self.datums):
            metrics: dict[str, float] = {}
            weights: dict[str, float] = {}
            if d.lag is not None:
                metrics["staleness:mean"] = float(d.lag)
                weights["staleness:mean"] = 1.0
                metrics["staleness:max"] = float(d.lag)
                if d.config.max_staleness is not None:
                    metrics["dropped_stale:sum"] = 1.0 if d.dropped else 0.0
            metrics["loss:sum"] = float(loss_D[i])
            n = self.mismatch_tokens[i]
            if self.has_logprobs[i] and n:
                metrics["mismatch_kl:mean"] = kl_D[i] / n
                metrics["logprob_diff_abs:mean"] = abs_D[i] / n
                weights["mismatch_kl:mean"] = weights["logprob_diff_abs:mean"] = float(n)
            out.append(DatumLoss(loss=torch.tensor(float(loss_D[i])), outputs={}, metrics=metrics,
                                 metric_weights=weights))
        return out


LOSS_FUNCTIONS_INDEX = {name: i for i, name in enumerate(LOSS_FUNCTIONS)}


def _truncated_ratio(lp: Tensor, slp: Tensor, cap: Tensor) -> Tensor:
    """Value `min(ratio, cap)`, gradient `min(ratio, cap)·∇lp` (cap = inf: the plain ratio, whose
    value and gradient this equals exactly)."""
    weight = torch.minimum(torch.exp(lp.detach() - slp), cap)
    return weight * torch.exp(lp - lp.detach())


def _cross_entropy(lp_K: Tensor, x: LossInputs) -> Tensor:
    return -lp_K * x.weights


def _importance_sampling(lp: Tensor, x: LossInputs) -> Tensor:
    return -_truncated_ratio(lp, x.logprobs, x.cap) * x.advantages


def _clipped_objective(ratio: Tensor, x: LossInputs) -> Tensor:
    """PPO's pessimistic objective, negated: `−min(ratio·A, clip(ratio, lo, hi)·A)` (ppo, gspo)."""
    clipped = torch.minimum(torch.maximum(ratio, x.lo), x.hi) * x.advantages
    return -torch.minimum(ratio * x.advantages, clipped)


def _ppo(lp: Tensor, x: LossInputs) -> Tensor:
    return _clipped_objective(_truncated_ratio(lp, x.logprobs, x.cap), x)


def _cispo(lp: Tensor, x: LossInputs) -> Tensor:
    ratio = _truncated_ratio(lp.detach(), x.logprobs, x.cap)
    coefficient = torch.minimum(torch.maximum(ratio, x.lo), x.hi)  # detached: sg(clip(ratio))
    return -coefficient * lp * x.advantages


def _dro(lp: Tensor, x: LossInputs) -> Tensor:
    penalty = 0.5 * x.beta * (lp - x.logprobs) ** 2
    return -(lp * x.advantages - penalty)


def _gspo(lp: Tensor, x: LossInputs, datum: Tensor, datums: int) -> Tensor:
    """`datum`: each position's datum (of `datums`), for the per-sequence mean of the log-ratio."""
    log_ratio = (lp.detach() - x.logprobs) * x.seq_mask
    total = lp.new_zeros(datums).index_add(0, datum, log_ratio)
    count = lp.new_zeros(datums).index_add(0, datum, x.seq_mask)
    sequence = (total / count.clamp_min(1.0)).index_select(0, datum)
    return _clipped_objective(torch.exp(sequence + lp - lp.detach()), x)


def _stable_reinforce(lp: Tensor, x: LossInputs) -> Tensor:
    ratio = torch.exp(lp.detach() - x.logprobs)
    kept = torch.where((ratio >= 1 / x.cap) & (ratio <= x.cap), ratio, 0.0)  # an overflowed ratio is outside
    return -kept * torch.exp(lp - lp.detach()) * x.advantages


_ELEMENTWISE = {"importance_sampling": _importance_sampling, "ppo": _ppo, "cispo": _cispo, "dro": _dro,
                STABLE_REINFORCE: _stable_reinforce}


@dataclass
class PassLosses:
    """Device tensors of one `pass_losses` call."""

    loss: Tensor  # (D,), differentiable
    elementwise: Tensor  # (M, K), detached
    kl: Tensor  # (D,) float64: Σ k3 over each datum's mismatch tokens
    abs_diff: Tensor  # (D,) float64: Σ |lp − slp| over the same tokens


def pass_losses(lp_M_K: Tensor, plan: LossPlan, t: LossTensors) -> PassLosses:
    """Every datum's loss at once. `lp_M_K`: the target logprobs of every datum's positions, datums
    one after another (K = the plan's width); `t`: the plan's tensors, on lp's device. Nothing here
    reads a value back to the host."""
    dtype = torch.promote_types(lp_M_K.dtype, torch.float32)
    lp_M_K = lp_M_K.to(dtype)
    x = t.inputs.to(dtype)
    elementwise = lp_M_K.new_zeros(lp_M_K.shape)
    for fn in plan.fns:
        at = t.at[fn]
        xs = x.select(at)
        lp = lp_M_K.index_select(0, at)
        if fn == "cross_entropy":
            part = _cross_entropy(lp, xs)
        elif fn == "gspo":
            gspo = _gspo(lp[:, 0], xs, t.datum.index_select(0, at), plan.size)
            part = torch.nn.functional.pad(gspo.unsqueeze(1), (0, lp.shape[1] - 1))
        else:
            part = torch.nn.functional.pad(_ELEMENTWISE[fn](lp[:, 0], xs).unsqueeze(1), (0, lp.shape[1] - 1))
        elementwise = elementwise.index_copy(0, at, part)
    elementwise = torch.where(t.keep.unsqueeze(1), elementwise, 0.0)
    D = plan.size
    loss = lp_M_K.new_zeros(D).index_add(0, t.datum, elementwise.sum(1))
    diff = lp_M_K[:, 0].detach().double() - t.inputs.logprobs.double()
    k3 = torch.where(t.mismatch, torch.expm1(diff) - diff, 0.0)
    kl = torch.zeros(D, dtype=torch.float64, device=lp_M_K.device).index_add(0, t.datum, k3)
    abs_diff = torch.zeros(D, dtype=torch.float64, device=lp_M_K.device).index_add(
        0, t.datum, torch.where(t.mismatch, diff.abs(), 0.0))
    return PassLosses(loss, elementwise.detach(), kl, abs_diff)


class GradGate(torch.autograd.Function):
    """Identity forward; backward passes the gradient only where `gate.keep` (a (M,) bool tensor set
    after the losses are known, before backward) is true, by selection."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: Any) -> torch.Tensor:
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        keep = ctx.gate.keep.view(-1, *([1] * (grad.dim() - 1)))
        return torch.where(keep, grad, 0.0), None


def compute_loss(
    loss_fn: str,
    target_logprobs_T: Tensor,
    inputs: Mapping[str, Any],
    config: LossConfig,
    *,
    policy_version: int | None = None,
) -> DatumLoss:
    """One datum's loss, outputs and metrics (the pass's computation, for one datum). `inputs` must
    have passed `api.datums.normalise`; `policy_version` is the version the datum was sampled with."""
    spec_of(loss_fn)
    # (N, K) only for top-K targets of cross_entropy, whose inputs are then (N, K) too.
    if target_logprobs_T.dim() != 1 and not (target_logprobs_T.dim() == 2 and loss_fn == "cross_entropy"):
        raise ValueError(f"target_logprobs_T must be 1-D, got shape {tuple(target_logprobs_T.shape)}")
    n = target_logprobs_T.shape[0]
    width = target_logprobs_T.shape[1] if target_logprobs_T.dim() == 2 else 1
    x = {k: torch.as_tensor(v) for k, v in inputs.items() if k != "target_tokens"}
    plan = LossPlan.build([DatumSpec(loss_fn, x, n, width, config, policy_version)])
    lp_M_K = target_logprobs_T.view(n, width)
    out = pass_losses(lp_M_K, plan, plan.tensors.to(lp_M_K.device))
    kl, abs_diff = out.kl.tolist(), out.abs_diff.tolist()
    [datum] = plan.metrics([float(out.loss[0].detach())], kl, abs_diff)
    elementwise = out.elementwise if width > 1 else out.elementwise[:, 0]
    outputs = {"logprobs": target_logprobs_T.detach(), "elementwise_loss": elementwise}
    return DatumLoss(loss=out.loss[0], outputs=outputs, metrics=datum.metrics, metric_weights=datum.metric_weights)


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
