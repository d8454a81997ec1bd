"""The size limit on this machine's copies of a bucket's checkpoint versions
(checkpoints.cache): least recently used out, nothing used within the idle time."""

from __future__ import annotations

import os
import time

import pytest

from checkpoints.cache import Cached, SizeLimit, evictions, scan

NOW = 10_000.0


@pytest.mark.parametrize(("cached", "max_bytes", "expected"), [
    ([Cached("a", 10, 100), Cached("b", 10, 200), Cached("c", 10, 300)], 30, []),  # fits
    ([Cached("a", 10, 100), Cached("b", 10, 200), Cached("c", 10, 300)], 20, ["a"]),  # oldest use first
    ([Cached("b", 10, 200), Cached("a", 10, 100), Cached("c", 10, 300)], 5, ["a", "b", "c"]),
    ([Cached("big", 100, 300), Cached("small", 1, 100)], 50, ["small", "big"]),  # by use, not size
    ([Cached("a", 10, 100), Cached("fresh", 10, NOW - 5)], 0, ["a"]),  # used within the idle time: kept
    ([Cached("x", 10, 100), Cached("w", 10, 100)], 10, ["w"]),  # a tie goes by name
    ([], 0, []),
])
def test_evictions(cached, max_bytes, expected):
    assert evictions(cached, max_bytes=max_bytes, now=NOW, min_idle_s=60) == expected


def _version(root, key: str, size: int, used_at: float):
    directory = root / key
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(os.urandom(size))
    os.utime(directory, (used_at, used_at))
    return directory


def test_the_limit_removes_least_recently_used_copies_and_skips_work_in_progress(tmp_path):
    now = time.time()
    old = _version(tmp_path, "t/m/weights/a/0001", 4000, now - 3000)
    older = _version(tmp_path, "t/m/weights/b/0001", 4000, now - 4000)
    recent = _version(tmp_path, "t/m/weights/c/0001", 4000, now - 10)
    (tmp_path / "t/m/weights/c/.fetch-x").mkdir()  # a download in progress is not a version
    (tmp_path / "t/m/weights/c/.fetch-x/part").write_bytes(os.urandom(50_000))
    assert {c.key for c in scan(tmp_path, 5)} == {"t/m/weights/a/0001", "t/m/weights/b/0001", "t/m/weights/c/0001"}

    limit = SizeLimit(tmp_path, 5, max_bytes=9000, min_idle_s=600)
    assert limit.added(0) == 4000  # the first call scans: 12,000 bytes against 9,000
    assert not older.exists() and old.exists() and recent.exists()
    assert limit.added(100) == 0  # its estimate still fits: no scan
    assert not (tmp_path / "t/m/weights/b").exists()  # nothing half-removed left

    tight = SizeLimit(tmp_path, 5, max_bytes=0, min_idle_s=600)
    assert tight.added(0) == 4000 and not old.exists()
    assert recent.exists()  # used 10 s ago: kept though over the limit
