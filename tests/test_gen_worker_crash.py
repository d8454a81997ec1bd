"""A generation worker killed with SIGKILL, or stopped with SIGTERM (which kills its engine without
a grace), while groups are in flight: healthz shows it within 3 s, the launcher restarts it, the
restarted worker re-runs its unacknowledged groups, and clients of both SDKs get their samples
(latency, not an error). Each group is billed once, and the engine's shared memory is unlinked.

(A live replica taking over a dead one's groups after QUILT_GEN_TAKEOVER_S is test_reclaim's.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import quilt
from billing_workload import wait_recorded
from stackutil import TINY

from core import db, queue, redis_client
from stack import leftovers

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.stack


def _gen_pending(r) -> int:
    summary = r.xpending(queue.sample_stream(TINY), queue.SAMPLE_GROUP)
    return sum(int(c["pending"]) for c in summary.get("consumers") or [] if c["name"] in (b"gen-0", "gen-0"))


def _gen_down_after(base_url: str, killed_at: float, timeout_s: float = 10) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gen = httpx.get(f"{base_url}/api/v1/healthz", timeout=5).json()["components"][f"gen:{TINY}"]
        if not gen["ok"]:
            return time.monotonic() - killed_at
        time.sleep(0.1)
    raise AssertionError("healthz still shows the killed generation worker")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_generation_worker_answers_its_groups_after_restart(stack, monkeypatch, sig):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a, b = stack.create_tenant("gencrash-a"), stack.create_tenant("gencrash-b")
    r = redis_client.sync_client(stack.redis_url)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key) as service, stack.sdk(b.key) as client:
        official = service.create_sampling_client(base_model=TINY).result()
        ours = client.create_sampling_client(base_model=TINY)
        # Still running when the worker dies (it is killed as soon as it holds both): 4 x 400 tokens each.
        f_official = official.sample(types.ModelInput.from_ints([40, 41, 42]), 4,
                                     types.SamplingParams(max_tokens=400, seed=1, stop=[]))
        f_ours = ours.sample([5, 6, 7], 4, quilt.SamplingParams(max_tokens=400, seed=2, stop=[]))
        deadline = time.monotonic() + 120
        while _gen_pending(r) < 2:
            assert time.monotonic() < deadline, "the generation worker never took both groups"
            time.sleep(0.01)
        gen_pid = leftovers.pid_of(stack.data_dir, f"gen:{TINY}")
        segments = leftovers.shared_memory_of(gen_pid)
        killed_at = time.monotonic()
        os.kill(gen_pid, sig)
        seen_down_s = _gen_down_after(stack.base_url, killed_at)

        out_official = f_official.result(timeout=600)
        answered_s = time.monotonic() - killed_at
        out_ours = f_ours.result(timeout=600)
    assert len(out_official.sequences) == 4 and len(out_ours.sequences) == 4
    assert all(len(s.tokens) == 400 for s in out_official.sequences)
    print(f"gen worker sent {sig.name}: healthz showed it after {seen_down_s:.2f} s; the re-run group was answered "
          f"{answered_s:.1f} s after the kill (engine restart included)")
    assert seen_down_s <= 3.5
    # The dead engine's shared memory went with it (its spared resource tracker, core.process_end), not
    # left for the reboot.
    assert segments, "the engine's shared memory was not found"
    assert not [name for name in segments if os.path.exists(name)]

    wait_recorded(stack.database_url, [a.tenant_id, b.tenant_id])  # answered a moment before the rows commit
    with db.connect(stack.database_url) as conn:
        rows = conn.execute(
            "SELECT r.status, (SELECT count(*) FROM usage_ledger u WHERE u.request_id = r.id) AS billed "
            "FROM requests r WHERE r.tenant_id = ANY(%s) AND r.kind = 'sample'",
            ([a.tenant_id, b.tenant_id],)).fetchall()
    assert sorted((row["status"], row["billed"]) for row in rows) == [("done", 1), ("done", 1)]
