"""Scale-out on one machine: a stack with two API replicas (`quilt up --api-replicas 2`) that
share nothing but Postgres and Redis, and checkpoints in an S3-compatible store.

The store (checkpoints.storage) runs against a real S3 server: moto in server mode, started by
the test as a process of its own and reached over HTTP by boto3, as an S3 deployment would be.
The stack trains, saves, samples, restores and serves downloads with its local copies wiped
between steps, so every read comes from the bucket; a deleted checkpoint leaves nothing there.
A client may talk to either API replica at any moment: futures, idempotent retries and key
revocation hold across them."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

boto3 = pytest.importorskip("boto3")
tinker = pytest.importorskip("tinker")
from stackutil import ADAM, datum, fb_body, new_model, wait_future  # noqa: E402
from tinker import types  # noqa: E402
from tinkerutil import ready  # noqa: E402

from checkpoints.storage import S3Store, key_of  # noqa: E402
from core import db  # noqa: E402
from core.errors import NotFound  # noqa: E402
from stack.ephemeral import ephemeral_stack, free_port, new_tenant  # noqa: E402
from tenancy.keys import PREFIX_LEN, revoke_key  # noqa: E402

pytestmark = pytest.mark.stack

BUCKET = "quilt-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "quilt-test", "AWS_SECRET_ACCESS_KEY": "quilt-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
TOKENS = list(range(40, 57))


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server on a free loopback port; yields its endpoint URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/moto-api/", timeout=2)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        _client(url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def _objects(endpoint: str, prefix: str = "") -> dict[str, bytes]:
    client = _client(endpoint)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


@pytest.fixture
def aws_env(monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


def _version(root: Path, name: str) -> Path:
    return root / "tenant-a" / "model-1" / "weights" / name / "0001-abcd"


def test_publish_fetch_remove_round_trip(s3_server, aws_env, tmp_path):
    writer = S3Store(tmp_path / "writer", bucket=BUCKET, prefix="unit", endpoint_url=s3_server, region=None)
    reader = S3Store(tmp_path / "reader", bucket=BUCKET, prefix="unit", endpoint_url=s3_server, region=None)
    path = _version(tmp_path / "writer", "ckpt")
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    writer.publish(str(path))
    assert set(_objects(s3_server, "unit/")) == {f"unit/{key_of(path)}/adapter_model.safetensors",
                                                 f"unit/{key_of(path)}/adapter_config.json"}

    # Another machine (its own cache root) fetches by key, once, and all at once: eight readers
    # racing for the same version each get the whole directory.
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(reader.fetch(str(path)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(got) == {tmp_path / "reader" / key_of(path)}
    for f in path.iterdir():
        assert (got[0] / f.name).read_bytes() == f.read_bytes()
    assert not [p for p in got[0].parent.iterdir() if p.name.startswith(".fetch-")]

    assert reader.remove(str(path))
    assert _objects(s3_server, "unit/") == {}
    assert not got[0].exists()
    with pytest.raises(NotFound):
        S3Store(tmp_path / "third", bucket=BUCKET, prefix="unit", endpoint_url=s3_server, region=None).fetch(str(path))


def test_a_readers_copies_stay_under_its_limit_and_come_back_from_the_bucket(s3_server, aws_env, tmp_path):
    """Copies fetched from the bucket are held under the size limit, least recently used out; a
    removed copy is fetched again on its next use, and the bucket never loses the version."""
    writer = S3Store(tmp_path / "writer", bucket=BUCKET, prefix="cache", endpoint_url=s3_server, region=None)
    reader = S3Store(tmp_path / "reader", bucket=BUCKET, prefix="cache", endpoint_url=s3_server, region=None,
                     cache_max_bytes=2 * 4096 + 100, cache_min_idle_s=0)
    paths = []
    for name in ("a", "b", "c"):
        path = _version(tmp_path / "writer", name)
        path.mkdir(parents=True)
        (path / "adapter_model.safetensors").write_bytes(os.urandom(4096))
        writer.publish(str(path))
        paths.append(str(path))
    a, b, c = paths
    reader.fetch(a)
    time.sleep(0.05)
    reader.fetch(b)
    time.sleep(0.05)
    reader.fetch(a)  # a use: b is now the least recently used
    time.sleep(0.05)
    reader.fetch(c)  # three copies do not fit two
    assert reader.local_dir(a).is_dir() and reader.local_dir(c).is_dir() and not reader.local_dir(b).exists()
    assert (reader.fetch(b) / "adapter_model.safetensors").read_bytes() == (
        Path(b) / "adapter_model.safetensors").read_bytes()  # back from the bucket
    assert len(_objects(s3_server, "cache/")) == 3


def test_image_assets_are_read_from_the_own_prefix_only_and_bounded(s3_server, aws_env):
    """An image pointer's object (checkpoints.assets) comes from the caller's own asset prefix, its
    size checked before it is read; another tenant's object of the same name is never reached."""
    from checkpoints.assets import AssetPlace, asset_name, read_asset
    from core.errors import InvalidInput

    client, place = _client(s3_server), AssetPlace("s3", bucket=BUCKET, prefix="assets")
    client.put_object(Bucket=BUCKET, Key="assets/ten-a/img/cat.png", Body=b"a" * 300)
    client.put_object(Bucket=BUCKET, Key="assets/ten-b/img/cat.png", Body=b"b" * 10)
    field = "data[0].model_input.images[0].location"
    name = asset_name(field, f"s3://{BUCKET}/assets/ten-a/img/cat.png", "ten-a", place)
    assert read_asset(field, place, "ten-a", name, 300, client=client) == b"a" * 300
    with pytest.raises(InvalidInput, match="holds 300 bytes, over the limit of 299 bytes") as exc:
        read_asset(field, place, "ten-a", name, 299, client=client)
    assert exc.value.field == field
    with pytest.raises(NotFound):
        read_asset(field, place, "ten-a", "img/absent.png", 300, client=client)
    with pytest.raises(InvalidInput, match="outside your asset prefix"):
        asset_name(field, f"s3://{BUCKET}/assets/ten-b/img/cat.png", "ten-a", place)


def test_the_orphan_sweep_finds_versions_in_the_bucket_that_no_row_names(s3_server, aws_env, tmp_path):
    """A trainer that uploaded a save and died before recording it leaves objects only the bucket
    holds (its machine is gone): the hourly sweep finds them by key and age, and removes them."""
    writer = S3Store(tmp_path / "writer", bucket=BUCKET, prefix="sweep", endpoint_url=s3_server, region=None)
    versions = {}
    for name in ("recorded", "queued", "crashed"):
        versions[name] = path = _version(tmp_path / "writer", name)
        path.mkdir(parents=True)
        (path / "adapter_model.safetensors").write_bytes(os.urandom(64))
        writer.publish(str(path))
    (tmp_path / "writer" / "tenant-a" / "stray.txt").write_text("not a version")
    sweeper = S3Store(tmp_path / "beat", bucket=BUCKET, prefix="sweep", endpoint_url=s3_server, region=None)
    named = {str(versions["recorded"]), str(versions["queued"]), "a/b"}  # "a/b": a row naming nothing
    assert sweeper.orphans(named, time.time() - 3600) == []  # younger than the age limit
    found = sweeper.orphans(named, time.time() + 1)
    assert found == [key_of(versions["crashed"])]
    for key in found:
        assert sweeper.remove(key)
    assert {k.split("/")[4] for k in _objects(s3_server, "sweep/")} == {"recorded", "queued"}


def test_a_trainers_snapshots_in_the_bucket_restore_on_another_machine(s3_server, aws_env, tmp_path):
    """QUILT_TRAINER_SNAPSHOTS_IN_STORE: each snapshot is uploaded as it is written and older ones
    leave the bucket too; a trainer with an empty disk finds the newest and restores the model's
    weights and AdamW state exactly; dropping the model removes its objects."""
    from durable_reference import ADAM, SEQS, _datum

    from batcher.engine.backend import LoraBackend
    from batcher.engine.protocol import PassRequest
    from batcher.snapshots import SnapshotStore
    from core.loss_spec import LossConfig
    from core.work import AdamParams, LoraShape, PassWork
    from stack.tiny_model import build_tiny_model

    base = build_tiny_model(tmp_path / "tiny").path

    def machine(name: str) -> SnapshotStore:
        root = tmp_path / name / "snapshots"
        return SnapshotStore(root, S3Store(root, bucket=BUCKET, prefix="snaps", endpoint_url=s3_server, region=None,
                                           key_parts=2))

    a, be = machine("a"), LoraBackend(base)
    be.create("ten:model-1", LoraShape(rank=8, seed=0))
    for seq, tokens in enumerate(SEQS, start=1):
        be.run_pass([PassRequest("r", "ten:model-1", PassWork("cross_entropy", LossConfig(), (_datum(tokens),)),
                                 False)])
        be.optim_step("ten:model-1", AdamParams(**ADAM))
        a.write(be, "ten:model-1", seq * 2)
    assert {k.split("/")[2] for k in _objects(s3_server, "snaps/")} == {f"{2 * len(SEQS):010d}"}

    b, restored = machine("b"), LoraBackend(base)
    assert b.latest("ten:model-1")[0] == 2 * len(SEQS)
    assert b.restore(restored, "ten:model-1") == 2 * len(SEQS)
    for key, value in be.adapter_state("ten:model-1").items():
        assert torch.equal(restored.adapter_state("ten:model-1")[key], value), key
    want, got = (x.adapters["ten:model-1"].optimizer.state_dict()["state"] for x in (be, restored))
    assert all(torch.equal(got[i]["exp_avg_sq"], want[i]["exp_avg_sq"]) for i in want)
    b.drop("ten:model-1")
    assert _objects(s3_server, "snaps/") == {} and b.latest("ten:model-1") is None


def test_keys_refuse_what_is_not_a_version_path(tmp_path):
    for bad in ("a/b", "t/m//n/v", "t/m/k/n/.."):
        with pytest.raises(ValueError):
            key_of(bad)
    assert key_of("/anywhere/root/t/m/weights/n/v1") == "t/m/weights/n/v1"


@pytest.fixture(scope="module")
def s3_stack(s3_server):
    env = {**CREDENTIALS, "QUILT_CHECKPOINT_STORE": "s3", "QUILT_S3_BUCKET": BUCKET,
           "QUILT_S3_PREFIX": "stack", "QUILT_S3_ENDPOINT_URL": s3_server,
           "QUILT_TRAINER_SNAPSHOTS_IN_STORE": "true", "QUILT_S3_SNAPSHOT_PREFIX": "stack-snapshots"}
    with ephemeral_stack(env, api_replicas=2) as s:
        yield s


def _wipe_local_copies(stack) -> None:
    for child in (stack.data_dir / "checkpoints").iterdir():
        shutil.rmtree(child)


def _datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 16})


def test_a_stack_keeps_its_checkpoints_in_the_bucket(s3_stack, s3_server, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, key = new_tenant(s3_stack, "s3")
    with tinker.ServiceClient(base_url=s3_stack.base_url, api_key=key) as service:
        tc = service.create_lora_training_client(base_model="quilt/tiny-qwen3", rank=4).result()
        for _ in range(2):
            tc.forward_backward([_datum()], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        expected = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        state = tc.save_state("s3-state").result().path
        sampler_path = tc.save_weights_for_sampler("s3-sampler").result().path
        model_id = tc.model_id

        stored = _objects(s3_server, "stack/")
        names = {k.rsplit("/", 1)[1] for k in stored if "/weights/s3-state/" in k}
        assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "quilt_state.json"} <= names
        assert any("/sampler_weights/s3-sampler/" in k for k in stored)
        # The trainer's snapshot of the model (after its last optimizer step) is in the bucket too.
        snapshots = {k.split("/")[2] for k in _objects(s3_server, "stack-snapshots/") if model_id.replace("/", "_") in k}
        assert len(snapshots) == 1, snapshots

        # Every read below comes from the bucket: this machine's copies are gone.
        _wipe_local_copies(s3_stack)
        sampler = ready(service.create_sampling_client(model_path=sampler_path))
        out = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1,
                             types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])).result()
        assert len(out.sequences[0].tokens) == 4

        _wipe_local_copies(s3_stack)
        restored = ready(service.create_training_client_from_state_with_optimizer(state))
        got = restored.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-6

        _wipe_local_copies(s3_stack)
        with httpx.Client(base_url=s3_stack.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60,
                          follow_redirects=True) as http:
            archive = http.get(f"/training_runs/{model_id}/checkpoints/weights/s3-state/archive")
            assert archive.status_code == 200, archive.text
            with tarfile.open(fileobj=io.BytesIO(archive.content), mode="r:gz") as tar:
                members = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read() for m in tar if m.isfile()}
            weights_key = next(k for k in stored if "/weights/s3-state/" in k and k.endswith("/adapter_model.safetensors"))
            assert members["adapter_model.safetensors"] == stored[weights_key]
            assert "optimizer.pt" not in members

            gone = http.delete(f"/training_runs/{model_id}/checkpoints/weights/s3-state")
            assert gone.status_code == 204, gone.text
        assert not [k for k in _objects(s3_server, "stack/") if "/weights/s3-state/" in k]


def _replicas(stack, key: str) -> list[httpx.Client]:
    assert len(stack.api_urls) == 2 and stack.api_urls[0] == stack.base_url
    return [httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": key}, timeout=60) for url in stack.api_urls]


def test_either_api_replica_answers_for_the_other(s3_stack):
    _, key = new_tenant(s3_stack, "replicas")
    a, b = _replicas(s3_stack, key)
    with a, b:
        made = a.post("/create_model", json={"session_id": a.post("/create_session", json={}).json()["session_id"],
                                             "model_seq_id": 0, "base_model": "quilt/tiny-qwen3",
                                             "lora_config": {"rank": 4, "seed": 1}})
        model_id = wait_future(b, made.json()["request_id"])["model_id"]  # made on A, answered by B
        tokens = list(range(30, 47))
        first = a.post("/forward_backward", json=fb_body(model_id, 1, [datum(tokens)]))
        # The SDK's retry of the same call, sent to the other replica, is the same future.
        retried = b.post("/forward_backward", json=fb_body(model_id, 1, [datum(tokens)]))
        assert first.status_code == retried.status_code == 200
        assert retried.json()["request_id"] == first.json()["request_id"]
        step = b.post("/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": ADAM})
        after = a.post("/forward_backward", json=fb_body(model_id, 3, [datum(tokens)]))
        results = [wait_future(b, first.json()["request_id"]), wait_future(a, step.json()["request_id"]),
                   wait_future(b, after.json()["request_id"])]
        assert all("error" not in r for r in results), results
        # In seq order across both replicas: the pass after the step sees the stepped weights.
        assert results[2]["metrics"]["loss:sum"] < results[0]["metrics"]["loss:sum"]
        assert a.post("/get_info", json={"model_id": model_id}).json() == b.post(
            "/get_info", json={"model_id": model_id}).json()


def test_a_revoked_key_is_refused_by_every_replica(s3_stack):
    _, key = new_tenant(s3_stack, "revoked")
    a, b = _replicas(s3_stack, key)
    with a, b:
        model_id = new_model(a, rank=4)
        for replica in (a, b):  # each replica now holds the key in its caller cache
            assert replica.post("/get_info", json={"model_id": model_id}).status_code == 200
        with db.connect(s3_stack.database_url) as conn:
            revoke_key(conn, key[:PREFIX_LEN])
        deadline = time.monotonic() + 10
        refused: set[int] = set()
        while len(refused) < 2 and time.monotonic() < deadline:
            for i, replica in enumerate((a, b)):
                if replica.post("/get_info", json={"model_id": model_id}).status_code == 401:
                    refused.add(i)
            time.sleep(0.05)
        assert refused == {0, 1}
