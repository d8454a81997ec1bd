"""Getting weights out: `save_weights_external` + `get_external_weights_urls` (tinker 0.34 and
0.38, and `tinker checkpoint download`) and the archive URL of 0.34, through the official
tinker SDK and plain HTTP. URLs are signed (no API key in them), bound to the tenant and to one
checkpoint, and expire; what they send is a PEFT adapter directory that HF PEFT loads and that
scores tokens exactly as the trainer does."""

from __future__ import annotations

import asyncio
import io
import json
import string
import tarfile
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
from genutil import Reference
from stackutil import TINY

from api import signed_urls
from bases import catalog
from core import db

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinkerutil import ready, rest_client  # noqa: E402

TOKENS = list(range(40, 57))


def _train(tc, steps: int = 2) -> None:
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 16})
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def _trainer_logprobs(tc) -> list[float]:
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 16})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def _base_path(stack) -> str:
    with db.connect(stack.database_url) as conn:
        return catalog.get_model_sync(conn, TINY).path


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:  # no API key: the URL is the permission
        return response.read()


def _assert_peft_matches_trainer(stack, adapter_dir: Path, expected: list[float]) -> None:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    got = Reference(_base_path(stack)).token_logprobs(str(adapter_dir), TOKENS)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4


@pytest.fixture(scope="module")
def exported(stack):
    """A tenant's trained model exported with save_weights_external, its URLs and the trainer's logprobs."""
    owner = stack.create_tenant("dl")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=owner.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=8))
        _train(tc)
        path = tc.save_weights_external("export").result().path
        tc.save_state("ck").result()
        expected = _trainer_logprobs(tc)
    rest = rest_client(stack, owner.key)
    return owner, tc.model_id, path, rest.get_external_weights_urls(path).result(), expected


def test_external_weights_download_loads_in_peft(stack, exported, tmp_path):
    owner, model_id, path, urls, expected = exported
    assert path == f"tinker://{model_id}/external_weights/export"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls.urls)
    assert "optimizer.pt" not in urls.urls
    assert all(owner.key not in u for u in urls.urls.values())
    assert urls.expires.timestamp() > time.time() + 60
    for name, url in urls.urls.items():
        (tmp_path / name).write_bytes(_fetch(url))
    _assert_peft_matches_trainer(stack, tmp_path, expected)
    # Listed like any checkpoint, of type "external".
    rest = rest_client(stack, owner.key)
    (ckpt,) = [c for c in rest.list_checkpoints(model_id).result().checkpoints if c.tinker_path == path]
    assert ckpt.checkpoint_type == "external"


def test_archive_url_is_a_redirect_to_a_peft_tar_gz(stack, exported, tmp_path):
    """The shape tinker 0.34 reads (its own run: tests/test_tinker_sdk_pinned.py): 302 to a signed
    URL, with Expires. A training checkpoint's archive leaves its optimizer state out."""
    owner, model_id, _, _, expected = exported
    http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": owner.key}, timeout=60)
    for checkpoint_id in ("external_weights/export", "weights/ck"):
        r = http.get(f"/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id}/archive")
        assert r.status_code == 302, r.text
        assert owner.key not in r.headers["location"] and r.headers["expires"]
        with tarfile.open(fileobj=io.BytesIO(_fetch(r.headers["location"])), mode="r:gz") as tar:
            tar.extractall(tmp_path / checkpoint_id, filter="data")
        (top,) = (tmp_path / checkpoint_id).iterdir()
        assert "optimizer.pt" not in {p.name for p in top.iterdir()}
        _assert_peft_matches_trainer(stack, top, expected)


def test_download_links_are_bound_to_tenant_checkpoint_and_time(stack, exported):
    owner, model_id, path, urls, _ = exported
    other = stack.create_tenant("dl-other")
    rest_b = rest_client(stack, other.key)
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_external_weights_urls(path).result()
    http_b = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": other.key}, timeout=60)
    assert http_b.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/export/archive").status_code == 404

    url = urls.urls["adapter_config.json"]
    token = url.split("/downloads/")[1].split("/")[0]
    generation, payload, sig = token.split(".")
    anyone = httpx.Client(timeout=60)
    assert anyone.get(url).status_code == 200
    # Altered: another file, another checkpoint, another tenant in the payload; a forged signature.
    with db.connect(stack.database_url) as conn:
        key = _keys(conn)
        ckpt_id = conn.execute("SELECT id FROM checkpoints WHERE model_id = %s AND kind = 'external_weights'",
                               (model_id,)).fetchone()["id"]
    grant = signed_urls.verify(key, token)
    assert (grant.tenant_id, grant.checkpoint_id) == (owner.tenant_id, ckpt_id)
    base = url.split("/downloads/")[0] + "/downloads/"
    forged = signed_urls.sign(signed_urls.SigningKeys(key.current, {key.current: b"not the key"}), grant)
    alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
    last = alphabet.index(sig[-1])
    altered = sig[:-1] + alphabet[(last + 4) % 64]  # another value in the last character's data bits
    respelled = sig[:-1] + alphabet[last ^ 1]  # the same bytes: only a spare bit differs
    for bad in (f"{generation}.{payload}.{altered}", f"{generation}.{payload}.{respelled}",
                forged, "garbage", f"{generation}.{payload}.", "a.b.c",
                "\u00e9.x", f"{payload}.{sig}", f"99.{payload}.{sig}", f"-1.{payload}.{sig}", "9" * 40 + ".a.b"):
        r = anyone.get(base + bad + "/adapter_config.json")
        assert r.status_code == 404 and r.json()["field"] == "token", (bad, r.text)
    other_file = signed_urls.Grant(grant.tenant_id, grant.checkpoint_id, "optimizer.pt", grant.expires)
    assert anyone.get(base + signed_urls.sign(key, other_file) + "/x").status_code == 404
    wrong_tenant = signed_urls.Grant(other.tenant_id, grant.checkpoint_id, grant.file, grant.expires)
    assert anyone.get(base + signed_urls.sign(key, wrong_tenant) + "/x").status_code == 404
    expired = signed_urls.Grant(grant.tenant_id, grant.checkpoint_id, grant.file, int(time.time()) - 1)
    r = anyone.get(base + signed_urls.sign(key, expired) + "/x")
    assert r.status_code == 404 and "expired" in r.json()["error"]


def _keys(conn) -> signed_urls.SigningKeys:
    rows = conn.execute("SELECT substr(name, 22)::int AS g, value FROM server_secrets "
                        "WHERE name LIKE 'download_signing_key:%' ORDER BY 1 DESC").fetchall()
    secret = b"embedded-insecure-secret"  # the test stack's QUILT_SECRET_KEY
    return signed_urls.SigningKeys(rows[0]["g"], {r["g"]: signed_urls.derive(secret, bytes(r["value"]))
                                                  for r in rows[:2]})


def test_signing_keys_verify_their_own_links_and_the_previous_generations():
    grant = signed_urls.Grant("t", 7, signed_urls.ARCHIVE, int(time.time()) + 60, "key-1")
    old = signed_urls.SigningKeys(1, {1: b"k1"})
    rotated = signed_urls.SigningKeys(2, {2: b"k2", 1: b"k1"})
    retired = signed_urls.SigningKeys(3, {3: b"k3"})
    token = signed_urls.sign(old, grant)
    assert signed_urls.verify(rotated, token) == grant
    assert signed_urls.verify(rotated, signed_urls.sign(rotated, grant)) == grant
    with pytest.raises(Exception, match="not valid"):
        signed_urls.verify(retired, token)
    operator = signed_urls.configured_keys("new", "old")
    assert signed_urls.verify(operator, signed_urls.sign(signed_urls.configured_keys("old", None), grant)) == grant
    with pytest.raises(Exception, match="not valid"):
        signed_urls.verify(signed_urls.configured_keys("new", None),
                           signed_urls.sign(signed_urls.configured_keys("old", None), grant))


def test_links_stop_with_their_key_an_operator_suspension_or_a_retired_signing_key(stack, tmp_path):
    """A link is bound to the API key that minted it (revoking the key stops it), stops while an
    operator suspends its tenant (a payment suspension keeps downloads working), and stops when
    its signing key is retired (`quilt downloads rotate-key --retire`)."""
    from stackutil import second_api

    from tenancy import accounts
    from tenancy.keys import create_key, revoke_key

    tenant = stack.create_tenant("dl-stops")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        path = tc.save_weights_external("kept").result().path
    with db.connect(stack.database_url) as conn:
        second, _ = create_key(conn, tenant.tenant_id, name="minter")
    url = rest_client(stack, second).get_external_weights_urls(path).result().urls["adapter_config.json"]
    kept = rest_client(stack, tenant.key).get_external_weights_urls(path).result().urls["adapter_config.json"]
    assert httpx.get(url, timeout=60).status_code == 200
    with db.connect(stack.database_url) as conn:
        revoke_key(conn, second[:12])
    r = httpx.get(url, timeout=60)
    assert r.status_code == 404 and "revoked" in r.json()["error"]

    for kind, status in (("payment", 200), ("operator", 403)):
        with db.connect(stack.database_url) as conn:
            accounts.suspend(conn, tenant.tenant_id, kind, "test", "test")
        assert httpx.get(kept, timeout=60).status_code == status, kind
        with db.connect(stack.database_url) as conn:
            accounts.restore(conn, tenant.tenant_id, "test")
    assert httpx.get(kept, timeout=60).status_code == 200

    env = {"QUILT_DOWNLOAD_URL_TTL_S": "900"}
    with second_api(stack, tmp_path, **env) as fresh:  # a process that reads the keys now
        assert httpx.get(kept.replace(stack.base_url, fresh), timeout=60).status_code == 200
    _rotate(stack, retire=False)
    with second_api(stack, tmp_path, **env) as fresh:  # the previous generation still verifies
        assert httpx.get(kept.replace(stack.base_url, fresh), timeout=60).status_code == 200
    _rotate(stack, retire=True)
    with second_api(stack, tmp_path, **env) as fresh:
        r = httpx.get(kept.replace(stack.base_url, fresh), timeout=60)
        assert r.status_code == 404 and "not valid" in r.json()["error"]
        new = httpx.get(f"{fresh}/api/v1/training_runs/{tc.model_id}/checkpoints/external_weights/kept/archive",
                        headers={"X-API-Key": tenant.key}, timeout=60, follow_redirects=True)
        assert new.status_code == 200


def _rotate(stack, *, retire: bool) -> None:
    """What `quilt downloads rotate-key [--retire]` does (api.signed_urls.rotate), on the session
    stack's Postgres."""
    import psycopg
    from psycopg.rows import dict_row

    async def rotate():
        async with await psycopg.AsyncConnection.connect(stack.database_url, row_factory=dict_row) as conn:
            await signed_urls.rotate(conn, retire=retire)

    asyncio.run(rotate())


def test_a_deleted_checkpoint_stops_its_links(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        path = tc.save_weights_external("gone").result().path
    rest = rest_client(stack, tenant.key)
    url = rest.get_external_weights_urls(path).result().urls["adapter_model.safetensors"]
    assert httpx.get(url, timeout=60).status_code == 200
    rest.delete_checkpoint_from_tinker_path(path).result()
    r = httpx.get(url, timeout=60)
    assert r.status_code == 404 and "deleted" in r.json()["error"]


def test_encrypted_exports_are_refused_by_name(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
            tc.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result()


def test_a_delete_racing_a_download_is_a_404(stack, tenant):
    """A download whose checkpoint row was read just before a delete removed its files (the
    fuzzer found the merged download answering 500 there): every way of fetching it answers 404,
    as if the delete had come first."""
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        tc.save_state("racing").result()
    route = f"/training_runs/{tc.model_id}/checkpoints/weights/racing"
    with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": tenant.key}, timeout=60) as http:
        links = [http.get(f"{route}/{what}").headers["location"] for what in ("archive", "merged")]
        links += list(http.get(f"{route}/external_weights_urls").json()["urls"].values())
        with db.connect(stack.database_url) as conn:
            storage = Path(conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = 'racing'",
                                        (tc.model_id,)).fetchone()["storage_path"])
        assert all(httpx.get(url, timeout=60).status_code == 200 for url in links)
        (storage / "adapter_model.safetensors").unlink()  # where shutil.rmtree has got to
        for url in links:
            r = httpx.get(url, timeout=60)
            assert r.status_code == 404 and r.json()["field"] == "checkpoint_id", (url, r.text)
        for what in ("archive", "merged", "external_weights_urls"):
            r = http.get(f"{route}/{what}")
            assert r.status_code == 404 and r.json()["field"] == "checkpoint_id", (what, r.text)


def test_an_archive_begun_before_a_delete_is_sent_whole(tmp_path):
    """Its files are opened when the response is made, so removing them meanwhile cuts nothing."""
    from api.dashboard import adapter_archive

    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4096)
    response = adapter_archive.adapter_response("m", "ck", tmp_path)
    for p in list(tmp_path.iterdir()):
        p.unlink()

    async def read() -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    body = asyncio.run(read())
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        got = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read() for m in tar if m.isfile()}
    assert got == {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": bytes(range(256)) * 4096}


def test_the_databases_values_alone_sign_no_link(stack, tenant):
    """A link's key is the stored value keyed with QUILT_SECRET_KEY: signing with the raw value
    from a copy of the database is refused."""
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        path = tc.save_weights_external("dumped").result().path
    url = rest_client(stack, tenant.key).get_external_weights_urls(path).result().urls["adapter_config.json"]
    token = url.split("/downloads/")[1].split("/")[0]
    payload = json.loads(signed_urls._unb64(token.split(".")[1]))
    grant = signed_urls.Grant(payload[0], payload[1], payload[2], payload[3], payload[4])
    with db.connect(stack.database_url) as conn:
        raw = {r["g"]: bytes(r["value"]) for r in conn.execute(
            "SELECT substr(name, 22)::int AS g, value FROM server_secrets WHERE name LIKE 'download_signing_key:%'")}
    base = url.split("/downloads/")[0] + "/downloads/"
    for generation, value in raw.items():
        forged = signed_urls.sign(signed_urls.SigningKeys(generation, {generation: value}), grant)
        assert httpx.get(base + forged + "/x", timeout=60).status_code == 404
    assert httpx.get(url, timeout=60).status_code == 200


def test_production_refuses_the_embedded_secret_key(monkeypatch):
    from pydantic import ValidationError

    from core.settings import SecuritySettings

    monkeypatch.setenv("QUILT_ENVIRONMENT", "production")
    monkeypatch.delenv("QUILT_SECRET_KEY", raising=False)
    with pytest.raises(ValidationError, match="QUILT_SECRET_KEY"):
        SecuritySettings()
    monkeypatch.setenv("QUILT_SECRET_KEY", "a" * 64)
    settings = SecuritySettings()
    assert "a" * 64 not in repr(settings)  # a SecretStr: never printed
