"""The trainer's writes and reads of checkpoint rows: a save recorded (replacing the version it
supersedes, which retention deletes after a grace), and whether a live checkpoint of a name exists."""

from __future__ import annotations

from pathlib import Path

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from checkpoints import retention


def upsert_checkpoint(conn: psycopg.Connection[DictRow], *, tenant_id: str, model_id: str, kind: str, name: str,
                      storage_path: str, size_bytes: int, ttl_s: int | None = None, sliding: bool = False,
                      grace_s: int = 0, user_metadata: dict[str, str] | None = None) -> None:
    """Record a save as checkpoint `name` (a new version if the name exists, whose `user_metadata`
    replaces the old one's, none included). The version it replaces is queued for deletion
    `grace_s` from now; see checkpoints.retention."""
    with conn.transaction():
        old = conn.execute(
            "SELECT storage_path FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s FOR UPDATE",
            (model_id, kind, name),
        ).fetchone()
        conn.execute(
            "INSERT INTO checkpoints (tenant_id, model_id, kind, name, storage_path, size_bytes, expires_at, "
            "sliding_ttl_s, user_metadata) VALUES (%s, %s, %s, %s, %s, %s, now() + make_interval(secs => %s), %s, %s) "
            "ON CONFLICT (model_id, kind, name) DO UPDATE SET storage_path = EXCLUDED.storage_path, "
            "size_bytes = EXCLUDED.size_bytes, created_at = now(), expires_at = EXCLUDED.expires_at, "
            "sliding_ttl_s = EXCLUDED.sliding_ttl_s, user_metadata = EXCLUDED.user_metadata, "
            # An expired row the sweep has not reached yet is a new checkpoint, not a published one.
            "published_at = CASE WHEN checkpoints.expires_at <= now() THEN NULL ELSE checkpoints.published_at END",
            (tenant_id, model_id, kind, name, storage_path, size_bytes, ttl_s, ttl_s if sliding else None,
             None if user_metadata is None else Jsonb(user_metadata)),
        )
        # (A checkpoint saved before per-save directories holds its files in the name's directory,
        # which the new version now lives in: that one is not queued, or it would take the new one along.)
        if old is not None and old["storage_path"] != storage_path \
                and not Path(storage_path).is_relative_to(old["storage_path"]):
            conn.execute(
                "INSERT INTO storage_garbage (tenant_id, path, delete_after) "
                "VALUES (%s, %s, now() + make_interval(secs => %s))",
                (tenant_id, old["storage_path"], grace_s),
            )


def checkpoint_exists(conn: psycopg.Connection[DictRow], model_id: str, kind: str, name: str) -> bool:
    row = conn.execute(
        f"SELECT 1 FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s AND {retention.LIVE}",
        (model_id, kind, name),
    ).fetchone()
    return row is not None
