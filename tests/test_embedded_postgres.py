"""The embedded Postgres runs with the server settings Quilt gives it (core.embedded), kept in its
postgresql.auto.conf so a restart of the server (`embedded.restart_postgres`) keeps them too."""

from __future__ import annotations

import time

import psycopg
import pytest

from core import embedded

pytestmark = pytest.mark.stack


def _settings(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                                 (list(embedded._POSTGRES_SETTINGS),)).fetchall())


def test_the_embedded_postgres_makes_wal_segments_without_zero_filling_them(stack):
    deadline = time.monotonic() + 10  # a reload reaches new sessions a moment after it is asked
    while (seen := _settings(stack.database_url)) != embedded._POSTGRES_SETTINGS:
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)
    auto_conf = (stack.data_dir / "pg" / "postgresql.auto.conf").read_text()
    assert "wal_init_zero = 'off'" in auto_conf
