"""Schema migrations: numbered SQL files applied in order, each once, each in its own transaction.

Only this package changes the schema. A `schema_migrations` table records what has run; an advisory
lock keeps two processes from migrating at once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_LOCK_ID = 0x5175696C74  # "Quilt"


def pending(applied: set[str]) -> list[Path]:
    return [p for p in sorted(_HERE.glob("*.sql")) if p.stem not in applied]


def apply_all(url: str) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied now."""
    done: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            applied = {row[0] for row in conn.execute("SELECT name FROM schema_migrations")}
            for path in pending(applied):
                with conn.transaction():
                    conn.execute(path.read_text())
                    conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", (path.stem,))
                log.info("applied migration %s", path.stem)
                done.append(path.stem)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))
    return done
