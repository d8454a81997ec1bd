"""What one API process may conclude from a refusal of the tokens-per-minute bucket
(tenancy.rate_limit.certain_wait): a call that cannot fit even the highest level the bucket can
have refilled to is refused without a row; anything that might fit goes to the bucket."""

from __future__ import annotations

import pytest

from tenancy import rate_limit
from tenancy.auth import Principal
from tenancy.rate_limit import Shortfall, certain_wait

# Refused at t=0 with 100 tokens in a bucket of 600 per minute (10 per second).
SEEN = Shortfall(per_minute=600, level=100.0, at=0.0)


@pytest.mark.parametrize(("shortfall", "per_minute", "cost", "now", "wait"), [
    (None, 600, 500, 0.0, None),  # nothing seen: ask the bucket
    (SEEN, 600, 150, 0.0, 5.0),  # 50 short at 10 per second
    (SEEN, 600, 150, 3.0, 2.0),  # refilled to at most 130
    (SEEN, 600, 150, 5.0, None),  # may fit now
    (SEEN, 600, 100, 0.0, None),  # fits the level seen
    (SEEN, 600, 600, 100.0, None),  # refilled to at most a full bucket
    (SEEN, 1200, 150, 0.0, None),  # the rate changed since: the refusal says nothing
    (Shortfall(600, 100.0, 10.0), 600, 150, 4.0, 5.0),  # a clock read before the refusal counts no refill
])
def test_certain_wait(shortfall, per_minute, cost, now, wait):
    got = certain_wait(shortfall, per_minute, cost, now)
    assert got == (None if wait is None else pytest.approx(wait))


def _who(tenant: str, per_minute: int = 600) -> Principal:
    return Principal(tenant, tenant, "tenant", "key", 1.0, 8, 8, per_minute)


def test_a_refusal_is_remembered_per_tenant_and_per_rate():
    memo = rate_limit.Shortfalls()
    a, b = _who("ten-a"), _who("ten-b")
    memo.refused(a, 150, 5.0)  # 150 asked, 5 s to wait: the bucket held 100
    assert memo.certain_wait(a, 150) == pytest.approx(5.0, abs=0.1)
    assert memo.certain_wait(a, 90) is None
    assert memo.certain_wait(a, 0) is None
    assert memo.certain_wait(b, 150) is None  # another tenant's bucket
    assert memo.certain_wait(_who("ten-a", per_minute=6000), 150) is None  # its rate was raised
