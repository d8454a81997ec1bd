"""This machine's copies of checkpoint versions kept in a bucket (checkpoints.storage.S3Store),
held under a size limit: least recently used first out.

A version is never rewritten, so a copy is never stale, but without a limit the copies of every
version any process here ever fetched or wrote would fill the disk. Use is the version directory's
modification time, which `S3Store.fetch` sets on every hit; a version used within `min_idle_s` is
never removed, since a reader may hold its path (vLLM re-reads an adapter's files when it drops
it from its host cache; the generation pool fetches it again first, `gen_pool.engine`). Removing
a copy only costs a download the next time; the bucket keeps the version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("quilt.checkpoint_cache")

RESCAN_EVERY_S = 60.0  # other processes on this machine fill the same directory


@dataclass(frozen=True)
class Cached:
    key: str  # the version's path under the cache root
    size: int  # bytes
    used_at: float  # epoch seconds


def evictions(cached: list[Cached], *, max_bytes: int, now: float, min_idle_s: float) -> list[str]:
    """The versions to remove so the rest fit in `max_bytes`: least recently used first, none used
    within `min_idle_s` (then the cache stays over its limit until they are idle)."""
    total = sum(c.size for c in cached)
    out = []
    for c in sorted(cached, key=lambda c: (c.used_at, c.key)):
        if total <= max_bytes or now - c.used_at < min_idle_s:
            break
        out.append(c.key)
        total -= c.size
    return out


def scan(root: Path, depth: int) -> list[Cached]:
    """The version directories `depth` levels under `root`, with their sizes and last use; names
    starting with a dot (a download or save in progress) are not versions."""
    out: list[Cached] = []

    def walk(directory: Path, level: int, key: str) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:  # removed meanwhile (retention, another process's eviction)
            return
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            name = f"{key}/{entry.name}" if key else entry.name
            if level + 1 < depth:
                walk(Path(entry.path), level + 1, name)
                continue
            try:
                size = sum(f.stat(follow_symlinks=False).st_size for f in os.scandir(entry.path)
                           if f.is_file(follow_symlinks=False))
                out.append(Cached(name, size, entry.stat(follow_symlinks=False).st_mtime))
            except OSError:
                continue

    walk(root, 0, "")
    return out


def evict(root: Path, keys: list[str], *, min_idle_s: float) -> list[str]:
    """Remove the copies `keys` names, each unless it was used since the scan (checked just before
    it goes, which leaves a reader a window of one rename); returns those removed."""
    removed = []
    for key in keys:
        directory = root / key
        try:
            if time.time() - directory.stat().st_mtime < min_idle_s:
                continue
            # One rename takes it out of every reader's sight; the deletion follows at leisure.
            doomed = directory.with_name(f".evict-{directory.name}-{os.getpid()}")
            os.rename(directory, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        with contextlib.suppress(OSError):
            directory.parent.rmdir()  # the checkpoint name's directory, if no other version is left
        removed.append(key)
    return removed


class SizeLimit:
    """One process's keeper of the limit: told of each version it adds, it scans the directory when
    its estimate passes the limit or RESCAN_EVERY_S has passed, and removes what `evictions` says."""

    def __init__(self, root: Path, depth: int, *, max_bytes: int, min_idle_s: float):
        self.root, self.depth, self.max_bytes, self.min_idle_s = root, depth, max_bytes, min_idle_s
        self._estimate: int | None = None  # bytes, as of the last scan plus what was added since
        self._scanned_at = 0.0

    def added(self, size: int) -> int:
        """A version of `size` bytes was just downloaded or written; returns the bytes freed."""
        if self._estimate is not None:
            self._estimate += size
            if self._estimate <= self.max_bytes and time.monotonic() - self._scanned_at < RESCAN_EVERY_S:
                return 0
        cached = scan(self.root, self.depth)
        self._scanned_at = time.monotonic()
        doomed = evictions(cached, max_bytes=self.max_bytes, now=time.time(), min_idle_s=self.min_idle_s)
        removed = set(evict(self.root, doomed, min_idle_s=self.min_idle_s)) if doomed else set()
        freed = sum(c.size for c in cached if c.key in removed)  # a version is never rewritten: sizes hold
        self._estimate = sum(c.size for c in cached) - freed
        if freed:
            log.info("checkpoint cache: %d versions (%.1f MiB) removed, least recently used first; %.1f MiB left "
                     "(limit %.1f MiB)", len(removed), freed / 2**20, self._estimate / 2**20, self.max_bytes / 2**20)
        elif self._estimate > self.max_bytes:
            log.warning("checkpoint cache over its limit (%.1f of %.1f MiB) with every version used in the last "
                        "%g s", self._estimate / 2**20, self.max_bytes / 2**20, self.min_idle_s)
        return freed
