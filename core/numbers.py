"""The ranges numbers must fit before they reach their consumer, checked without overflowing.

`math.isfinite(10**400)` raises OverflowError, and 1e300 is finite as a Python float but infinite
as the float32 the trainer computes in: every number a client sends goes through `real` against the
range of what holds it, so an out-of-range value is a 400 naming its field, never a 500.
"""

from __future__ import annotations

import math

# The largest float32: per-token inputs (weights, advantages, logprobs) become float32 tensors.
FLOAT32_MAX = 3.4028234663852886e38
# The largest finite float64: metrics and config values are stored and computed as float64.
FLOAT64_MAX = 1.7976931348623157e308
# Postgres integer (int4) and bigint (int8) columns.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def real(value: object, limit: float = FLOAT64_MAX) -> float | None:
    """`value` as a float when it is a number (not a bool) of magnitude at most `limit`; else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        as_float = float(value)
    except OverflowError:  # an int past float64
        return None
    if not math.isfinite(as_float) or abs(as_float) > limit:
        return None
    return as_float


def describe(limit: float) -> str:
    """How an error names the range: 'finite, of magnitude at most 3.4e+38'."""
    return f"finite, of magnitude at most {limit:.2g}"
