"""What a request costs: pure functions over plain data, integer arithmetic only.

Money is integer micro-USD (1 USD = 1,000,000 micro-USD). Rates are micro-USD per million tokens,
so a rate of 195,000 is $0.195 per million tokens.

Rounding rule (the one place it is defined): for each token unit (prefill, cached, sample, train) of
one request,

    cost_unit = round_half_up(tokens_unit * rate_unit / 1,000,000)   micro-USD

and the request's cost is the sum of its unit costs. Cached prompt tokens (prefix-cache hits) have
their own rate, by default 20% of the base's prefill rate. Checkpoint storage is metered in
byte-hours and priced per GB-month (10^9 bytes for 720 hours):

    cost_storage = round_half_up(byte_hours * rate_per_gb_month / (10^9 * 720))   micro-USD

one ledger row per tenant, base model and hour. A training model with a longer context (chosen at
create_model) may pay a percent of every token rate (its price-book entry's context tiers,
`context_percent`; 100 unless a tier says more, so no tier means no change on the bill):

    cost_unit = round_half_up(tokens_unit * rate_unit * percent / (1,000,000 * 100))   micro-USD

Rounding per unit and per request keeps
every ledger row exact and self-contained (the ledger's own columns reproduce its cost); the
difference from unrounded arithmetic is at most 0.5 micro-USD per unit per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

MICRO_PER_USD = 1_000_000
TOKENS_PER_RATE = 1_000_000  # rates are per million tokens

UNITS = ("prefill", "cached", "sample", "train")  # the token units, each with a per-million rate
CACHED_PERCENT_OF_PREFILL = 20  # a cache hit's default rate, in percent of the base's prefill rate
BYTES_PER_GB = 10**9
HOURS_PER_MONTH = 720  # a GB-month is 720 GB-hours (the tinker SDK's storage unit)


@dataclass(frozen=True)
class Units:
    """Metered tokens of one request (or a sum of requests)."""

    prefill_tokens: int = 0  # prompt tokens computed (not served from the prefix cache)
    sample_tokens: int = 0
    train_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    storage_byte_hours: int = 0  # checkpoint bytes kept, times the hours they were kept

    def __post_init__(self) -> None:
        for name in _UNITS_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")

    def __add__(self, other: Units) -> Units:
        return Units(**{f: getattr(self, f) + getattr(other, f) for f in _UNITS_FIELDS})

    def times(self, n: int) -> Units:
        return Units(**{f: getattr(self, f) * n for f in _UNITS_FIELDS})

    def of(self, unit: str) -> int:
        return getattr(self, f"{unit}_tokens")

    @property
    def empty(self) -> bool:
        return not any(getattr(self, f) for f in _UNITS_FIELDS)


_UNITS_FIELDS = ("prefill_tokens", "sample_tokens", "train_tokens", "cached_tokens", "storage_byte_hours")


@dataclass(frozen=True)
class Price:
    """One price-book entry: a base model's rates from `effective_from` until the next entry."""

    base_model: str
    effective_from: datetime
    prefill_micro_usd_per_mtok: int
    sample_micro_usd_per_mtok: int
    train_micro_usd_per_mtok: int
    id: int | None = None
    note: str = ""
    cached_micro_usd_per_mtok: int | None = None  # None: CACHED_PERCENT_OF_PREFILL of the prefill rate
    storage_micro_usd_per_gb_month: int = 0
    # ((above_tokens, percent), ...) ascending: a model whose context is above a tier's tokens pays its
    # percent of every token rate (`context_percent`); () = 100 percent at any context.
    context_tiers: tuple[tuple[int, int], ...] = ()

    def rate(self, unit: str) -> int:
        if unit == "cached" and self.cached_micro_usd_per_mtok is None:
            return default_cached_rate(self.prefill_micro_usd_per_mtok)
        return getattr(self, f"{unit}_micro_usd_per_mtok")

    @property
    def max_rate(self) -> int:
        return max(self.rate(u) for u in UNITS)


def default_cached_rate(prefill_micro_usd_per_mtok: int) -> int:
    """A prefix-cache hit's rate when the price book names none: CACHED_PERCENT_OF_PREFILL of the
    prefill rate, rounded half up."""
    return div_round_half_up(prefill_micro_usd_per_mtok * CACHED_PERCENT_OF_PREFILL, 100)


@dataclass(frozen=True)
class Cost:
    """A cost split by unit, in micro-USD."""

    prefill_micro_usd: int = 0
    sample_micro_usd: int = 0
    train_micro_usd: int = 0
    cached_micro_usd: int = 0
    storage_micro_usd: int = 0

    @property
    def total_micro_usd(self) -> int:
        return (self.prefill_micro_usd + self.sample_micro_usd + self.train_micro_usd + self.cached_micro_usd
                + self.storage_micro_usd)

    def of(self, unit: str) -> int:
        return getattr(self, f"{unit}_micro_usd")


FREE = Cost()


def div_round_half_up(numerator: int, denominator: int) -> int:
    """numerator / denominator rounded half up, for non-negative integers."""
    if numerator < 0 or denominator <= 0:
        raise ValueError("div_round_half_up takes numerator >= 0 and denominator > 0")
    return (2 * numerator + denominator) // (2 * denominator)


def unit_cost(tokens: int, rate_micro_usd_per_mtok: int) -> int:
    """micro-USD for `tokens` at a per-million rate, rounded half up (the module's rule)."""
    return div_round_half_up(tokens * rate_micro_usd_per_mtok, TOKENS_PER_RATE)


def storage_cost(byte_hours: int, rate_micro_usd_per_gb_month: int) -> int:
    """micro-USD for `byte_hours` of checkpoint storage at a per-GB-month rate, rounded half up."""
    return div_round_half_up(byte_hours * rate_micro_usd_per_gb_month, BYTES_PER_GB * HOURS_PER_MONTH)


MAX_CONTEXT_PERCENT = 10_000  # a tier charges at most 100 times the base rates
MAX_CONTEXT_TIERS = 16


def check_context_tiers(tiers: object) -> tuple[tuple[int, int], ...]:
    """A price-book entry's context tiers, checked: a list of [above_tokens, percent] pairs with
    above_tokens rising (>= 1) and percent in [100, MAX_CONTEXT_PERCENT], not falling. ValueError
    naming what is wrong."""
    if not isinstance(tiers, list | tuple) or len(tiers) > MAX_CONTEXT_TIERS:
        raise ValueError(f"context tiers must be a list of at most {MAX_CONTEXT_TIERS} [above_tokens, percent] pairs")
    out: list[tuple[int, int]] = []
    for tier in tiers:
        if (not isinstance(tier, list | tuple) or len(tier) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in tier)):
            raise ValueError(f"context tier {tier!r} is not an [above_tokens, percent] pair of integers")
        above, percent = tier
        if above < 1 or not 100 <= percent <= MAX_CONTEXT_PERCENT:
            raise ValueError(f"context tier {list(tier)}: above_tokens must be >= 1 and percent in [100, "
                             f"{MAX_CONTEXT_PERCENT}]")
        if out and (above <= out[-1][0] or percent < out[-1][1]):
            raise ValueError(f"context tier {list(tier)}: tiers must rise in above_tokens and never fall in percent")
        out.append((above, percent))
    return tuple(out)


def context_percent(context_length: int | None, tiers: tuple[tuple[int, int], ...]) -> int:
    """The percent of the token rates a model of `context_length` pays: the highest tier it is above,
    100 with no tier (or no context: sampling, storage, a model made before contexts were chosen)."""
    if context_length is None:
        return 100
    return max((percent for above, percent in tiers if context_length > above), default=100)


def cost_of(units: Units, price: Price | None, percent: int = 100) -> Cost:
    """The cost of one ledger row, its token units at `percent` of their rates (`context_percent`).
    No price (an unpriced base model) costs nothing."""
    if price is None:
        return FREE
    return Cost(**{f"{u}_micro_usd": div_round_half_up(units.of(u) * price.rate(u) * percent, TOKENS_PER_RATE * 100)
                   for u in UNITS},
                storage_micro_usd=storage_cost(units.storage_byte_hours, price.storage_micro_usd_per_gb_month))


def prompt_cache_hits(prompt_tokens: int, cache_hits: tuple[int, ...]) -> int:
    """The prompt's prefix-cache hits, once per request (what the SDK's `prompt_cache_hit_tokens`
    means): the best of the engine's counts per sequence, at most the prompt. A request's n sequences
    start together, so vLLM reports no hits for the copies computed alongside the first."""
    return min(max((max(h, 0) for h in cache_hits), default=0), prompt_tokens)


def sampling_units(prompt_tokens: int, cache_hits: tuple[int, ...], sampled_tokens: int) -> Units:
    """Metered units of a finished sampling request of len(cache_hits) sequences, each of which read
    the prompt. The prompt is computed once per request (a GPU engine with prefix caching shares it
    among the sequences): its tokens not in the prefix cache (`prompt_cache_hits`) are prefill once,
    and every other prompt token read, the other sequences' whole prompts included, is cached."""
    if not cache_hits:
        return Units(sample_tokens=sampled_tokens)
    prefill = prompt_tokens - prompt_cache_hits(prompt_tokens, cache_hits)
    return Units(prefill_tokens=prefill, cached_tokens=prompt_tokens * len(cache_hits) - prefill,
                 sample_tokens=sampled_tokens)


def storage_units(size_bytes: int, hours: int = 1) -> Units:
    """Metered units of `size_bytes` of checkpoints kept for `hours`."""
    return Units(storage_byte_hours=size_bytes * hours)


def estimate(units_per_step: Units, steps: int, price: Price) -> Cost:
    """Expected cost of `steps` steps of `units_per_step` each, rounded once per unit over the run.

    The ledger rounds per request, so a run of many requests may be billed up to 0.5 micro-USD per
    unit per request away from this figure.
    """
    if steps < 0:
        raise ValueError("steps must be >= 0")
    return cost_of(units_per_step.times(steps), price)


def price_at(prices: list[Price], base_model: str, at: datetime) -> Price | None:
    """The entry in force for `base_model` at `at`: the latest one whose effective_from <= at."""
    best = None
    for p in prices:
        if p.base_model == base_model and p.effective_from <= at and (
                best is None or p.effective_from > best.effective_from):
            best = p
    return best


def training_units(kind: str, n_tokens: int) -> Units:
    """Metered units of a finished trainer request.

    `forward_backward` trains on its model-input tokens; `forward` only reads them (prefill).
    Every other trainer request (create_model, optim_step, save/load) is free.
    """
    if kind == "forward_backward":
        return Units(train_tokens=n_tokens)
    if kind == "forward":
        return Units(prefill_tokens=n_tokens)
    return Units()


def inflight_cost(kind: str, n_tokens: int, price: Price | None, fallback_rate: int, percent: int = 100) -> int:
    """Conservative estimate (micro-USD) of a queued or running request, for budget admission.

    Trainer kinds are priced as they will be billed. Any other kind with tokens (sampling,
    compute_logprobs, ...) is priced at the model's highest rate, so the estimate is an upper bound
    as long as `requests.n_tokens` holds an upper bound of its metered tokens (for sampling: prompt
    tokens x n + max_tokens x n). Without a price for the model, `fallback_rate` (the highest rate in
    the book) is used. `percent`: the model's context tier (`context_percent`).
    """
    if n_tokens <= 0:
        return 0
    if price is not None and kind in ("forward_backward", "forward"):
        return cost_of(training_units(kind, n_tokens), price, percent).total_micro_usd
    rate = price.max_rate if price is not None else fallback_rate
    return unit_cost(n_tokens, rate)


# ---------------------------------------------------------------------------------------- money text


def usd(micro_usd: int) -> str:
    """Exact decimal text of an amount: 1234567 -> '1.234567'."""
    sign = "-" if micro_usd < 0 else ""
    whole, frac = divmod(abs(micro_usd), MICRO_PER_USD)
    return f"{sign}{whole}.{frac:06d}"


def usd_short(micro_usd: int) -> str:
    """Human text for tables: '$1.23', or '$0.000123' for amounts under a cent."""
    if abs(micro_usd) >= 10_000:
        return "$" + str((Decimal(micro_usd) / MICRO_PER_USD).quantize(Decimal("0.01"), ROUND_HALF_UP))
    return "$" + usd(micro_usd)


def parse_usd(text: str | float | Decimal) -> int:
    """'12.50' (USD) -> 12500000 micro-USD; more than six decimals are rounded half up."""
    try:
        amount = Decimal(str(text))
    except InvalidOperation:
        raise ValueError(f"not an amount of USD: {text!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"an amount of USD must be finite and >= 0, got {text!r}")
    if amount > MAX_PARSED_USD:  # before quantize, which cannot hold 1e999 at six places
        raise ValueError(f"an amount of USD must be at most {MAX_PARSED_USD:,}, got {text!r}")
    return int((amount * MICRO_PER_USD).quantize(Decimal(1), ROUND_HALF_UP))


MAX_PARSED_USD = 10**12  # micro-USD of it still fit a Postgres bigint (9.2e18) with room to add


# Rates for a base with no price-book entry yet, from its size: the public Qwen3-8B anchor rates
# (8.19 B parameters, all active) scaled by a weighted size. Compute per token follows the active
# parameters; the memory a base holds while it is served follows all of them, so MoE bases with
# few active parameters cost less than dense ones of the same total, but not in proportion.
ANCHOR_PARAMETERS = 8_190_735_360
ANCHOR_RATES = {"prefill": 195_000, "sample": 600_000, "train": 440_000}
ACTIVE_WEIGHT = 0.85  # the rest weighs total parameters
MIN_RATE = 1_000  # micro-USD per million tokens: every base's usage shows on the bill


def size_rates(total_parameters: int, active_parameters: int) -> dict[str, int]:
    """{'prefill': ..., 'sample': ..., 'train': ...} in micro-USD per million tokens."""
    if total_parameters < 1 or not 0 < active_parameters <= total_parameters:
        raise ValueError("need 0 < active_parameters <= total_parameters")
    scale = (ACTIVE_WEIGHT * active_parameters + (1 - ACTIVE_WEIGHT) * total_parameters) / ANCHOR_PARAMETERS
    return {unit: max(MIN_RATE, round(rate * scale)) for unit, rate in ANCHOR_RATES.items()}
