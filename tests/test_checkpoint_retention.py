"""Checkpoint lifetimes: TTLs from the client, anonymous snapshots that expire after their last use,
replaced versions deleted after a grace period, and the sweep that removes the files.

The stack's own Celery beat sweeps every minute too; these tests call the same sweep directly after
moving times into the past in Postgres, and assert on what is left, not on who removed it.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import quilt
from stackutil import new_model, wait_future

from checkpoints import layout, retention, version_dirs
from checkpoints.storage import LocalStore
from core import db

TINY = "quilt/tiny-qwen3"
PROMPT = [5, 6, 7, 8]


# ------------------------------------------------------------------------------ pure parts


def test_lifetime_policy():
    assert retention.lifetime(anonymous=False, ttl_seconds=None, anon_ttl_s=600) == retention.Lifetime(None)
    assert retention.lifetime(anonymous=True, ttl_seconds=None, anon_ttl_s=600) == retention.Lifetime(600, True)
    # What the client asked for wins, and is not sliding.
    assert retention.lifetime(anonymous=True, ttl_seconds=7200, anon_ttl_s=600) == retention.Lifetime(7200)
    assert retention.lifetime(anonymous=False, ttl_seconds=7200, anon_ttl_s=600) == retention.Lifetime(7200)


def test_a_sliding_expiry_moves_at_most_once_a_minute():
    now = datetime(2026, 12, 1, tzinfo=UTC)
    assert retention.due_to_slide(now + timedelta(seconds=30), 7200, now)
    assert retention.due_to_slide(now + timedelta(seconds=7200 - 61), 7200, now)
    assert not retention.due_to_slide(now + timedelta(seconds=7200 - 59), 7200, now)
    assert not retention.due_to_slide(now + timedelta(seconds=30), None, now)  # fixed TTL: never moves
    assert not retention.due_to_slide(None, None, now)


@pytest.mark.parametrize(("by_owner", "slides"), [(True, True), (False, False)])
def test_only_the_owners_use_slides_a_published_snapshot(by_owner, slides):
    now = datetime(2026, 12, 1, tzinfo=UTC)
    assert retention.due_to_slide(now + timedelta(seconds=30), 7200, now, by_owner=by_owner) is slides


@pytest.mark.parametrize(("path", "pattern"), [
    ("/data/ck/t1/run/weights/a", "/data/ck/t1/run/weights/a/%"),
    ("/data/ck/t1/run/weights/a/", "/data/ck/t1/run/weights/a/%"),
    ("/d/my_run/50%", "/d/my\\_run/50\\%/%"),
    ("/d/back\\slash", "/d/back\\\\slash/%"),
])
def test_the_paths_inside_a_directory_escape_its_wildcards(path, pattern):
    assert retention.under_pattern(path) == pattern


def test_remove_dir_stays_inside_the_checkpoint_root(tmp_path):
    root, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    version = root / "t" / "m" / "sampler_weights" / "name" / "v1"
    version.mkdir(parents=True)
    outside.mkdir()
    assert not version_dirs.remove(root, str(outside))
    assert not version_dirs.remove(root, str(root / ".." / "elsewhere"))
    assert outside.exists()
    assert version_dirs.remove(root, str(version))
    assert not version.exists() and not version.parent.exists()  # the emptied name directory too
    assert (root / "t" / "m" / "sampler_weights").exists()


def test_new_version_dirs_never_repeat(tmp_path):
    dirs = {layout.new_version_dir(tmp_path, "t", "m", "weights", "n") for _ in range(100)}
    assert len(dirs) == 100 and all(Path(d).parent == tmp_path / "t" / "m" / "weights" / "n" for d in dirs)


def _aged(path: Path, seconds: float) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_orphan_dirs_are_unrecorded_old_versions(tmp_path):
    root = tmp_path / "checkpoints"
    name = root / "t" / "m" / "sampler_weights" / "policy"
    live, queued = _aged(name / "v-live", 7200), _aged(name / "v-queued", 7200)
    orphan, crashed = _aged(name / "v-orphan", 7200), _aged(name / ".tmp-abc", 7200)
    fresh = _aged(name / "v-being-saved", 5)
    legacy = _aged(root / "t" / "m" / "weights" / "old-style", 7200)  # files directly in the name dir
    (legacy / "adapter_model.safetensors").write_bytes(b"x")
    found = version_dirs.orphans(root, {live.resolve(), legacy.resolve()}, {queued.resolve()},
                                  older_than=time.time() - 3600)
    assert found == sorted([orphan.resolve(), crashed.resolve()])
    assert fresh.exists()


# ------------------------------------------------------------------------------ on the stack


def _sweep(stack) -> retention.SweepResult:
    with db.connect(stack.database_url) as conn:
        return retention.sweep(conn, LocalStore(stack.data_dir / "checkpoints"))


def _sql(stack, query: str, params: tuple = ()) -> list[dict]:
    with db.connect(stack.database_url) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def _checkpoint(stack, model_id: str, kind: str, name: str) -> dict | None:
    rows = _sql(stack, "SELECT * FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s",
                (model_id, kind, name))
    return rows[0] if rows else None


def _save_weights(stack, http, model_id: str, seq_id: int, name: str, **extra) -> Path:
    """save_weights through the API; the directory it wrote."""
    r = http.post("/save_weights", json={"model_id": model_id, "seq_id": seq_id, "path": name, **extra})
    assert "path" in wait_future(http, r.json()["request_id"]), r.text
    return Path(_checkpoint(stack, model_id, "weights", name)["storage_path"])


def _load_weights(http, model_id: str, seq_id: int, name: str) -> dict:
    r = http.post("/load_weights", json={"model_id": model_id, "seq_id": seq_id,
                                         "path": f"tinker://{model_id}/weights/{name}"})
    return wait_future(http, r.json()["request_id"])


def _listed(http, model_id: str) -> dict[str, dict]:
    r = http.get(f"/training_runs/{model_id}/checkpoints")
    assert r.status_code == 200, r.text
    return {c["checkpoint_id"]: c for c in r.json()["checkpoints"]}


def _expires_in(ckpt: dict) -> float:
    return (datetime.fromisoformat(ckpt["expires_at"]) - datetime.now(UTC)).total_seconds()


def test_republished_weights_keep_serving_and_the_old_version_goes_after_the_grace(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4, seed=0)
        path = tc.save_weights_for_sampler("policy").result()
        first = Path(_checkpoint(stack, tc.model_id, "sampler_weights", "policy")["storage_path"])
        tc.save_weights_for_sampler("policy").result()
        second = Path(_checkpoint(stack, tc.model_id, "sampler_weights", "policy")["storage_path"])
        assert first != second and first.parent == second.parent and first.exists() and second.exists()

        # The old version waits out the grace (queued requests may name it) ...
        garbage = _sql(stack, "SELECT delete_after - now() AS wait FROM storage_garbage WHERE path = %s", (str(first),))
        assert len(garbage) == 1 and garbage[0]["wait"] > timedelta(minutes=50)
        _sweep(stack)
        assert first.exists()
        # ... and is removed once it is over; the current one serves on.
        _sql(stack, "UPDATE storage_garbage SET delete_after = now() - interval '1 second' WHERE path = %s",
             (str(first),))
        _sweep(stack)
        assert not first.exists() and second.exists()
        assert _sql(stack, "SELECT 1 FROM storage_garbage WHERE path = %s", (str(first),)) == []
        sampler = client.create_sampling_client(model_path=path)
        assert len(sampler.sample(PROMPT, 2, quilt.SamplingParams(max_tokens=3)).result().sequences) == 2


def test_anonymous_snapshots_expire_after_their_last_use(stack, tenant):
    http = stack.http(tenant.key)
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4, seed=0)
        sampler = tc.save_weights_and_get_sampling_client()
        (cid, listed), = _listed(http, tc.model_id).items()
        name = cid.split("/", 1)[1]
        assert 7100 < _expires_in(listed) <= 7200  # QUILT_ANON_SAMPLER_TTL_S, 2 h by default
        row = _checkpoint(stack, tc.model_id, "sampler_weights", name)
        files = Path(row["storage_path"])

        # Using it moves the expiry back out.
        _sql(stack, "UPDATE checkpoints SET expires_at = now() + interval '30 seconds' WHERE id = %s", (row["id"],))
        sampler.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=2)).result()
        assert 7100 < _expires_in(_listed(http, tc.model_id)[cid]) <= 7200

        # Past its expiry it is gone at once for the client, and its files with the next sweep.
        _sql(stack, "UPDATE checkpoints SET expires_at = now() - interval '1 second' WHERE id = %s", (row["id"],))
        with pytest.raises(quilt.NotFoundError, match="expired"):
            sampler.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=2)).result()
        assert _listed(http, tc.model_id) == {}
        _sweep(stack)
        assert _checkpoint(stack, tc.model_id, "sampler_weights", name) is None and not files.exists()

        # A new snapshot works as before.
        fresh = tc.save_weights_and_get_sampling_client()
        assert len(fresh.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=2)).result().sequences) == 1


def test_ttl_seconds_on_save_and_set_later(stack, tenant):
    http = stack.http(tenant.key)
    model_id = new_model(http)
    _save_weights(stack, http, model_id, 1, "kept")
    _save_weights(stack, http, model_id, 2, "short", ttl_seconds=3600)
    listed = _listed(http, model_id)
    assert "expires_at" not in listed["weights/kept"]
    assert 3500 < _expires_in(listed["weights/short"]) <= 3600

    ttl_url = f"/training_runs/{model_id}/checkpoints/weights/short/ttl"
    assert http.put(ttl_url, json={"ttl_seconds": None}).status_code == 204
    assert "expires_at" not in _listed(http, model_id)["weights/short"]
    assert http.put(ttl_url, json={"ttl_seconds": 86400}).status_code == 204
    assert 86300 < _expires_in(_listed(http, model_id)["weights/short"]) <= 86400

    # Out of range: a 4xx naming the field and the limit, nothing saved.
    for bad in (0, 59, 10 * 366 * 24 * 3600, "soon"):
        r = http.post("/save_weights", json={"model_id": model_id, "seq_id": 50, "path": "bad", "ttl_seconds": bad})
        assert r.status_code == 400 and r.json()["field"] == "ttl_seconds", r.text
        r = http.put(ttl_url, json={"ttl_seconds": bad})
        assert r.status_code == 400 and r.json()["field"] == "ttl_seconds", r.text
    assert "3600" in http.put(ttl_url, json={"ttl_seconds": 5}).json()["detail"]

    # An expired training checkpoint can no longer be loaded, and its name is free again.
    _sql(stack, "UPDATE checkpoints SET expires_at = now() - interval '1 second' "
                "WHERE model_id = %s AND name = 'short'", (model_id,))
    r = http.post("/load_weights", json={"model_id": model_id, "seq_id": 3,
                                         "path": f"tinker://{model_id}/weights/short"})
    assert r.status_code == 404, r.text  # (it still uses up seq_id 3: api.seq_gaps)
    _save_weights(stack, http, model_id, 4, "short")
    assert "expires_at" not in _listed(http, model_id)["weights/short"]


def test_overwriting_a_training_checkpoint_writes_a_new_version(stack, tenant):
    http = stack.http(tenant.key)
    model_id = new_model(http)
    first = _save_weights(stack, http, model_id, 1, "w")
    current = _save_weights(stack, http, model_id, 2, "w", overwrite=True)
    assert current != first and current.exists()
    assert _sql(stack, "SELECT 1 FROM storage_garbage WHERE path = %s", (str(first),)) == [{"?column?": 1}]
    assert "path" in _load_weights(http, model_id, 3, "w")


def test_delete_and_ttl_are_per_tenant(stack, tenant):
    owner, other = stack.http(tenant.key), stack.http(stack.create_tenant("other").key)
    model_id = new_model(owner)
    files = _save_weights(stack, owner, model_id, 1, "mine")
    url = f"/training_runs/{model_id}/checkpoints/weights/mine"
    assert other.put(url + "/ttl", json={"ttl_seconds": 3600}).status_code == 404
    assert other.delete(url).status_code == 404
    assert "expires_at" not in _listed(owner, model_id)["weights/mine"]
    assert owner.delete(url).status_code == 204
    assert not files.exists() and not files.parent.exists()


def test_the_hourly_sweep_removes_what_a_crashed_save_left(stack, tenant):
    http = stack.http(tenant.key)
    model_id = new_model(http)
    kept = _aged(_save_weights(stack, http, model_id, 1, "kept"), 7200)  # old, but recorded
    name_dir = stack.data_dir / "checkpoints" / tenant.tenant_id / model_id / "weights" / "kept"
    orphan = _aged(name_dir / "0000000000000-deadbeef", 7200)
    crashed = _aged(name_dir / ".tmp-crashed", 7200)
    with db.connect(stack.database_url) as conn:
        assert retention.sweep_orphans(conn, LocalStore(stack.data_dir / "checkpoints")) >= 2
    assert not orphan.exists() and not crashed.exists() and kept.exists()
    assert "path" in _load_weights(http, model_id, 2, "kept")


def test_overwriting_a_checkpoint_from_before_per_save_directories_keeps_the_new_one(stack, tenant):
    http = stack.http(tenant.key)
    model_id = new_model(http)
    version = _save_weights(stack, http, model_id, 1, "old")
    legacy = version.parent  # the layout before migration 0005: files in the name's directory
    for f in version.iterdir():
        f.rename(legacy / f.name)
    version.rmdir()
    _sql(stack, "UPDATE checkpoints SET storage_path = %s WHERE model_id = %s AND name = 'old'", (str(legacy), model_id))
    current = _save_weights(stack, http, model_id, 2, "old", overwrite=True)
    assert current.parent == legacy
    assert _sql(stack, "SELECT 1 FROM storage_garbage WHERE path = %s", (str(legacy),)) == []
    _sweep(stack)
    assert current.exists()
    assert "path" in _load_weights(http, model_id, 3, "old")
