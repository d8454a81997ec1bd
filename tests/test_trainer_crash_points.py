"""The trainer dies at every named point of a request's life (core.faults) and loses nothing.

A stack of its own runs with every trainer crash point armed: after entries are read, after a
fused pass is computed, after an optimizer step is applied, after a snapshot is written, after a
result is settled, after it is published, and while sampler weights are being written off the
loop (batcher.exports). Each fires once (the launcher restarts the trainer,
which goes on past it), while one model takes three steps. The saved state equals the
uninterrupted run, every request is answered once in the client's eyes, and billed once."""

from __future__ import annotations

from pathlib import Path

import pytest
from billing_workload import wait_recorded
from durable_reference import ADAM, SEQS, assert_equals_reference
from stackutil import TINY, datum, fb_body, new_model, wait_future

from bases import catalog
from core import db
from stack.ephemeral import ephemeral_stack, new_tenant

pytestmark = pytest.mark.stack

POINTS = ("trainer.after_read", "trainer.after_pass", "trainer.after_optim", "trainer.after_snapshot",
          "trainers.after_settle", "trainers.after_publish", "trainer.during_export")


@pytest.mark.extended  # minutes of killed and restarted processes: CI runs it with --extended
@pytest.mark.timeout(1200)
def test_a_trainer_killed_at_every_crash_point_loses_nothing():
    import httpx

    # after_read fires on the create, after_settle and after_publish on the create's and the
    # first pass's answers, after_pass, after_optim and after_snapshot on the first step: one by one.
    with ephemeral_stack({"QUILT_CRASH_AT": ",".join(POINTS)}) as stack:
        tenant_id, key = new_tenant(stack, "crashpoints")
        with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60) as c:
            model_id = new_model(c, rank=8, seed=0)
            seq = 1
            for tokens in SEQS:
                for route, body in (("/forward_backward", fb_body(model_id, seq, [datum(tokens)])),
                                    ("/optim_step", {"model_id": model_id, "seq_id": seq + 1, "adam_params": ADAM})):
                    r = c.post(route, json=body)
                    assert r.status_code == 200, r.text
                    result = wait_future(c, r.json()["request_id"], timeout_s=300)
                    assert "error" not in result, (route, result)
                seq += 2
            # Killed while the export thread writes the sampler weights: the save is answered after the
            # restart (replayed), with the version it was taken at, and its files are whole.
            r = c.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": seq, "path": "policy"})
            published = wait_future(c, r.json()["request_id"], timeout_s=300)
            assert published.get("policy_version") == len(SEQS), published
            seq += 1
            r = c.post("/save_weights", json={"model_id": model_id, "seq_id": seq, "path": "crash-points"})
            assert "error" not in wait_future(c, r.json()["request_id"], timeout_s=300)

        fired = sorted(p.name for p in (stack.data_dir / "crash-points").iterdir())
        restarts = (stack.data_dir / "up.out").read_text().count(f"trainer:{TINY} exited with 137")
        wait_recorded(stack.database_url, [tenant_id])
        with db.connect(stack.database_url) as conn:
            base_path = catalog.get_model_sync(conn, TINY).path
            sampler = conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = 'policy'",
                                   (model_id,)).fetchone()["storage_path"]
            storage = conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = 'crash-points'",
                                   (model_id,)).fetchone()["storage_path"]
            billed = conn.execute(
                "SELECT r.kind, r.status, count(u.id) AS n FROM requests r LEFT JOIN usage_ledger u "
                "ON u.request_id = r.id WHERE r.model_id = %s GROUP BY r.id, r.kind, r.status", (model_id,)).fetchall()
        assert fired == sorted(POINTS)  # every window was hit
        assert restarts == len(POINTS)
        assert {(b["status"], b["n"]) for b in billed} == {("done", 1)}, billed
        assert len(billed) == 1 + 2 * len(SEQS) + 2  # create, three passes and steps, the two saves
        assert_equals_reference(storage, base_path)
        assert {p.name for p in Path(sampler).iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
