"""What training costs: cost estimates and usage reports.

Money arrives from the server as exact integers of micro-USD; these types expose it both ways
(``cost_micro_usd`` and ``cost_usd`` as a :class:`decimal.Decimal`), so sums never drift.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

__all__ = ["CostEstimate", "UsageReport"]

_MICRO = Decimal(1_000_000)


def _usd(micro: int | None) -> Decimal | None:
    return None if micro is None else Decimal(int(micro)) / _MICRO


@dataclass(frozen=True)
class CostEstimate:
    """The expected cost of a planned run, from ``Client.estimate_cost``.

    Attributes:
        base_model: the priced base model.
        steps: number of steps estimated.
        cost_micro_usd: expected cost in micro-USD (1 USD = 1,000,000).
        by_unit: ``{"prefill"|"cached"|"sample"|"train": micro-USD}`` (cached: prompt tokens served from the prefix cache).
        tokens: ``{"prefill"|"sample"|"train": tokens over the whole run}``.
        rates_usd_per_mtok: the prices used, USD per million tokens by unit.
        budget_remaining_micro_usd: what is left of your tightest monthly budget (None: no budget).
        fits_budget: whether the run fits in it (None: no budget).
        raw: the server's full answer.
    """

    base_model: str
    steps: int
    cost_micro_usd: int
    by_unit: dict[str, int]
    tokens: dict[str, int]
    rates_usd_per_mtok: dict[str, Decimal]
    budget_remaining_micro_usd: int | None
    fits_budget: bool | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def cost_usd(self) -> Decimal:
        """Expected cost in USD, exact."""
        return Decimal(self.cost_micro_usd) / _MICRO

    @property
    def per_step_usd(self) -> Decimal:
        """Expected cost of one step in USD."""
        return Decimal(self.raw.get("per_step_usd", "0"))

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CostEstimate:
        """Build from the ``POST /quilt/estimate`` answer."""
        units = body.get("by_unit", [])
        price = body.get("price", {})
        return cls(
            base_model=body["base_model"],
            steps=int(body["steps"]),
            cost_micro_usd=int(body["cost_micro_usd"]),
            by_unit={u["unit"]: int(u["cost_micro_usd"]) for u in units},
            tokens={u["unit"]: int(u["tokens"]) for u in units},
            rates_usd_per_mtok={u["unit"]: Decimal(price.get(f"{u['unit']}_usd_per_mtok", "0")) for u in units},
            budget_remaining_micro_usd=body.get("budget_remaining_micro_usd"),
            fits_budget=body.get("fits_budget"),
            raw=body,
        )


@dataclass(frozen=True)
class UsageReport:
    """Your tenant's spend over a period, from ``Client.usage``.

    Attributes:
        since, until: the period, UTC days (``until`` exclusive).
        total_micro_usd: spend over the period.
        month_to_date_micro_usd: spend this UTC month (what budgets count).
        by_day: ``[{"day", "cost_micro_usd", "requests", "<unit>_tokens", ...}]``.
        by_model: ``[{"base_model", "cost_micro_usd", ...}]``, most expensive first.
        by_unit: ``[{"unit", "tokens", "cost_micro_usd"}]``.
        budgets: ``[{"scope", "api_key_prefix", "monthly_limit_usd", "spent_usd", "remaining_usd", ...}]``.
        raw: the server's full answer.
    """

    since: dt.date
    until: dt.date
    total_micro_usd: int
    month_to_date_micro_usd: int
    by_day: list[dict[str, Any]]
    by_model: list[dict[str, Any]]
    by_unit: list[dict[str, Any]]
    budgets: list[dict[str, Any]]
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def total_usd(self) -> Decimal:
        """Spend over the period in USD, exact."""
        return Decimal(self.total_micro_usd) / _MICRO

    @property
    def month_to_date_usd(self) -> Decimal:
        """Spend this UTC month in USD, exact."""
        return Decimal(self.month_to_date_micro_usd) / _MICRO

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> UsageReport:
        """Build from the ``GET /quilt/usage`` answer."""
        return cls(
            since=dt.date.fromisoformat(body["since"]),
            until=dt.date.fromisoformat(body["until"]),
            total_micro_usd=int(body["total_micro_usd"]),
            month_to_date_micro_usd=int(body.get("month_to_date_micro_usd", 0)),
            by_day=list(body.get("by_day", [])),
            by_model=list(body.get("by_model", [])),
            by_unit=list(body.get("by_unit", [])),
            budgets=list(body.get("budgets", [])),
            raw=body,
        )


def estimate_body(base_model: str, steps: int, prefill_tokens: int, sample_tokens: int,
                  train_tokens: int) -> dict[str, Any]:
    if not base_model:
        raise ValueError("base_model is required; see client.get_server_capabilities() for names")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    tokens = {"prefill": prefill_tokens, "sample": sample_tokens, "train": train_tokens}
    for name, value in tokens.items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}_tokens must be a non-negative int, got {value!r}")
    return {"base_model": base_model, "steps": steps, "tokens_per_step": tokens}


def usage_path(since: dt.date | str | None, until: dt.date | str | None) -> str:
    params = [f"{k}={v.isoformat() if isinstance(v, dt.date) else v}" for k, v in (("since", since), ("until", until))
              if v is not None]
    return "quilt/usage" + ("?" + "&".join(params) if params else "")
