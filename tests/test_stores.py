"""Waiting out a store that cannot be reached (core.stores)."""

from __future__ import annotations

import psycopg
import pytest
import redis

from core import stores


def test_until_reachable_retries_store_errors_and_passes_others_through():
    calls, pauses = [], []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise redis.exceptions.ConnectionError("redis restarting")
        if len(calls) == 2:
            raise psycopg.OperationalError("postgres restarting")
        return "done"

    assert stores.until_reachable(flaky, "test", sleep=pauses.append) == "done"
    assert len(calls) == 3 and pauses == [stores.FIRST_DELAY_S, 2 * stores.FIRST_DELAY_S]

    def broken():
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        stores.until_reachable(broken, "test", sleep=pauses.append)


def test_the_pause_grows_to_a_ceiling():
    pauses = []
    left = [12]

    def down_a_while():
        left[0] -= 1
        if left[0]:
            raise redis.exceptions.TimeoutError("slow")

    stores.until_reachable(down_a_while, "test", sleep=pauses.append)
    assert max(pauses) == stores.MAX_DELAY_S and pauses == sorted(pauses)
