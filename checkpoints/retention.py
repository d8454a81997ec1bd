"""How long checkpoints live, where their files go, and removing files nobody can name any more.

Every save writes a new directory (the layout is checkpoints.layout') and a path is never
reused, so deleting a directory can only ever remove files that no live checkpoint row points at,
whatever a concurrent save does. Files become garbage three ways:
  * a save replaces a checkpoint of the same name: the old version waits
    `superseded_version_grace_s`, since sampling requests queued before the replacement name it;
  * a checkpoint expires (`ttl_seconds` from the client, or the sliding default of anonymous
    sampler snapshots): hidden at once by every query, files removed by the next sweep;
  * a client deletes it (removed at once by the route);
Copies (copy_weights) name their source's directory: a directory is removed only once no checkpoint
row names it, whichever row goes last (the rows are the reference count).
  * nobody recorded it (a worker died between writing the files and recording them): found by
    `sweep_orphans` once an hour has passed (on this machine's disk, and in the bucket with S3).
`sweep` (Celery beat, every minute) expires rows and removes due directories; `sweep_orphans`
(hourly) walks the store. All of it is safe to repeat after a crash.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import psycopg
from psycopg.rows import DictRow

if TYPE_CHECKING:
    from checkpoints.storage import LocalStore

log = logging.getLogger("quilt.retention")

# The tinker SDK documents checkpoint TTLs as between one hour and ten years.
MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 24 * 3600
# Using an anonymous snapshot moves its expiry only when this much of it has been used up, so a
# busy sampler costs one UPDATE a minute, not one per request (`due_to_slide`).
SLIDE_SLACK_S = 60
# A directory nobody records is left alone this long: a save in progress records its directory
# seconds after writing it.
ORPHAN_MIN_AGE_S = 3600
# Live checkpoints are hidden once expired, before the sweep gets to them.
LIVE = "(expires_at IS NULL OR expires_at > now())"


# Whether a checkpoint row uses directory %(path)s: names it, or (a checkpoint saved before
# per-save directories holds its files in the name's directory, and its newer versions live under
# it) names a directory inside it, which removing it would take along. %(under)s is `under_pattern`.
USES_PATH = "(storage_path = %(path)s OR storage_path LIKE %(under)s ESCAPE '\\')"


def under_pattern(path: str) -> str:
    """The LIKE pattern of the paths strictly inside directory `path`, its own wildcards escaped."""
    escaped = path.rstrip("/").replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "/%"


@dataclass(frozen=True)
class Lifetime:
    ttl_s: int | None  # expires this long after the save; None: kept until deleted
    sliding: bool = False  # every use restarts the clock


def lifetime(*, anonymous: bool, ttl_seconds: int | None, anon_ttl_s: int) -> Lifetime:
    """A client's `ttl_seconds` is kept as asked (fixed from the save). Anonymous sampler snapshots
    (`save_weights_and_get_sampling_client`) that asked for nothing expire `anon_ttl_s` after their
    last use: an RL loop makes one per step and never looks back. Named ones are kept."""
    if ttl_seconds is not None:
        return Lifetime(ttl_seconds)
    if anonymous:
        return Lifetime(anon_ttl_s, sliding=True)
    return Lifetime(None)


def due_to_slide(expires_at: datetime | None, sliding_ttl_s: int | None, now: datetime, *, by_owner: bool = True) -> bool:
    """Whether a use at `now` should move a sliding expiry out (at most once a SLIDE_SLACK_S, so a
    busy sampler costs no write per request). Only the owner's uses count: another tenant sampling
    a published snapshot must not keep the owner's storage (and its bill) alive."""
    if not by_owner or not sliding_ttl_s or expires_at is None:
        return False
    return expires_at < now + timedelta(seconds=sliding_ttl_s - SLIDE_SLACK_S)


def sweep_orphans(conn: psycopg.Connection[DictRow], store: LocalStore, *, min_age_s: float = ORPHAN_MIN_AGE_S) -> int:
    """Delete the orphaned versions the store finds (hourly): `checkpoints.version_dirs.orphans` under this machine's
    checkpoint directory, and with S3 the bucket's versions no row names."""
    named = {r["storage_path"] for r in conn.execute("SELECT storage_path FROM checkpoints")}
    named |= {r["path"] for r in conn.execute("SELECT path FROM storage_garbage")}
    orphans = store.orphans(named, time.time() - min_age_s)
    for path in orphans:
        store.remove(path)
    if orphans:
        log.warning("removed %d checkpoint directories no checkpoint named (a save that crashed midway?)",
                    len(orphans))
    return len(orphans)


@dataclass(frozen=True)
class SweepResult:
    expired: int  # checkpoint rows that expired now
    removed: int  # directories deleted


def sweep(conn: psycopg.Connection[DictRow], store: LocalStore, *, batch: int = 500) -> SweepResult:
    """(`conn` with dict rows, as `core.db.connect` gives.) Expire checkpoints past `expires_at` (their
    directories become due at once), then delete up to `batch` due directories and forget them."""
    with conn.transaction():
        gone = conn.execute(
            "WITH gone AS (DELETE FROM checkpoints WHERE expires_at <= now() "
            "RETURNING tenant_id, storage_path) "
            "INSERT INTO storage_garbage (tenant_id, path, delete_after) "
            "SELECT tenant_id, storage_path, now() FROM gone RETURNING id"
        ).fetchall()
    # A path another checkpoint row still names (a copy: copy_weights shares its source's files) is
    # forgotten, not removed: the files go with the last row that names them.
    due = conn.execute(
        "SELECT g.id, g.path FROM storage_garbage g WHERE g.delete_after <= now() ORDER BY g.delete_after LIMIT %s",
        (batch,)
    ).fetchall()
    for row in due:
        if not path_in_use(conn, row["path"]):
            store.remove(row["path"])
    if due:
        with conn.transaction():
            conn.execute("DELETE FROM storage_garbage WHERE id = ANY(%s)", ([r["id"] for r in due],))
    if gone or due:
        log.info("checkpoint sweep: %d expired, %d directories removed", len(gone), len(due))
    return SweepResult(expired=len(gone), removed=len(due))



def path_in_use(conn: psycopg.Connection[DictRow], path: str) -> bool:
    """Whether any checkpoint row still uses directory `path` (`USES_PATH`)."""
    row = conn.execute(f"SELECT 1 FROM checkpoints WHERE {USES_PATH} LIMIT 1",
                       {"path": path, "under": under_pattern(path)}).fetchone()
    return row is not None
