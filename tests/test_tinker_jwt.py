"""The tinker SDK's JWT mode against Quilt (QUILT_SDK_JWT_AUTH on an API of its own beside the
session stack's): the key exchanged for a token at `/auth/token`, the core flow on that token,
`whoami` read from its claims, `auth/apikey/me` described and revoked; and every token the server
will not honour a clean 401 the SDK re-exchanges on."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import jwt
import pytest
from stackutil import mint_token, second_api

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.cli.auth_api import TinkerAuthApi  # noqa: E402

TINY = "quilt/tiny-qwen3"
INVALID_TOKEN = 'Bearer error="invalid_token"'


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def jwt_api(stack, tmp_path_factory):
    with second_api(stack, tmp_path_factory.mktemp("jwt-api"), QUILT_SDK_JWT_AUTH="true") as url:
        yield url


def _http(base_url: str, credential: str | None) -> httpx.Client:
    headers = {"X-API-Key": credential} if credential is not None else {}
    return httpx.Client(base_url=base_url + "/api/v1", headers=headers, timeout=60)


def _exchange(base_url: str, key: str) -> str:
    r = _http(base_url, key).post("/auth/token", json={})
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


# The service's own REST client, deprecated or not, is the one that shares the holder the core
# flow ran on: its whoami is what shows that holder exchanged the key.
@pytest.mark.filterwarnings("ignore:DEPRECATED. ServiceClient.create_rest_client:FutureWarning")
def test_the_core_flow_runs_on_tokens_through_the_official_sdk(stack, jwt_api):
    tenant = stack.create_tenant("jwt")
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(s, s + 16))),
                        loss_fn_inputs={"target_tokens": list(range(s + 1, s + 17)), "weights": [1.0] * 16})
            for s in (40, 80)]
    with tinker.ServiceClient(base_url=jwt_api, api_key=tenant.key) as service:
        tc = service.create_lora_training_client(base_model=TINY, rank=4).result()
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        path = tc.save_weights_for_sampler("jwt-s1").result().path
        sampler = service.create_sampling_client(model_path=path).result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1, stop=[])
        out = sampler.sample(types.ModelInput.from_ints([40, 41, 42]), 2, params).result()
        assert [len(s.tokens) for s in out.sequences] == [4, 4]

        # whoami answers only in JWT mode, from the token this client holds: so it held one.
        me = service.create_rest_client().whoami().result()
    key_id = _key_id(stack, tenant.key)
    assert me.user_urn == f"quilt:apikey:{key_id}"
    assert me.org_urn == f"tml:organization:{tenant.tenant_id}"
    assert me.email is None
    assert tinker.RestClient(base_url=jwt_api, api_key=tenant.key).whoami().result() == me


def _key_id(stack, key: str) -> str:
    from core import db
    from tenancy.keys import hash_key

    with db.connect(stack.database_url) as conn:
        return conn.execute("SELECT id FROM api_keys WHERE key_hash = %s", (hash_key(key),)).fetchone()["id"]


def test_the_exchange_and_its_token(stack, jwt_api):
    tenant = stack.create_tenant("jwt")
    assert _http(jwt_api, tenant.key).post("/client/config", json={}).json()["pjwt_auth_enabled"] is True
    token = _exchange(jwt_api, tenant.key)
    header, claims = jwt.get_unverified_header(token), jwt.decode(token, options={"verify_signature": False})
    assert header["alg"] == "HS256" and header["kid"].isdigit()
    assert claims["org_id"] == tenant.tenant_id and claims["role"] == "owner"
    assert claims["exp"] - claims["iat"] == 900 and abs(claims["iat"] - time.time()) < 60

    by_token = _http(jwt_api, token)
    assert by_token.get("/training_runs").status_code == 200
    # Every API process checks tokens with the same keys: the session stack's API too.
    assert _http(stack.base_url, token).get("/training_runs").status_code == 200
    r = by_token.post("/auth/token", json={})
    assert r.status_code == 403 and "API key itself" in r.json()["error"]


def test_without_credentials_the_exchange_is_a_plain_401(jwt_api):
    r = _http(jwt_api, None).post("/auth/token", content=b"{not json")
    assert r.status_code == 401 and "missing API key" in r.json()["error"]
    assert "WWW-Authenticate" not in r.headers


def test_the_exchange_is_off_unless_turned_on(stack, tenant):
    client = _http(stack.base_url, tenant.key)
    assert client.post("/client/config", json={}).json()["pjwt_auth_enabled"] is False
    r = client.post("/auth/token", json={})
    assert r.status_code == 404 and "QUILT_SDK_JWT_AUTH" in r.json()["error"]


def _forged(token: str) -> dict[str, str]:
    head, body, sig = token.split(".")
    claims = jwt.decode(token, options={"verify_signature": False})

    def b64(obj) -> str:
        import base64
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    kid = jwt.get_unverified_header(token)["kid"]
    return {
        "alg none": f"{b64({'alg': 'none', 'typ': 'JWT', 'kid': kid})}.{body}.",
        "another key": jwt.encode(claims, b"\x07" * 32, algorithm="HS256", headers={"kid": kid}),
        "wrong kid": jwt.encode(claims, b"\x07" * 32, algorithm="HS256", headers={"kid": str(int(kid) + 7)}),
        "role raised": f"{head}.{b64({**claims, 'role': 'owner', 'org_id': 'ten-other'})}.{sig}",
        "expired": jwt.encode({**claims, "iat": 1, "exp": 2}, b"\x07" * 32, algorithm="HS256", headers={"kid": kid}),
        "truncated": token[:-5],
        "long": "eyJ" + "A" * 8000 + ".e30.AAAA",
    }


def test_tokens_the_server_will_not_honour_are_a_401_the_sdk_re_exchanges_on(stack, jwt_api):
    tenant = stack.create_tenant("jwt")
    for name, bad in _forged(_exchange(jwt_api, tenant.key)).items():
        r = _http(jwt_api, bad).get("/training_runs")
        assert r.status_code == 401, (name, r.text)
        assert r.headers["WWW-Authenticate"] == INVALID_TOKEN, name
        assert "exchange your API key" in r.json()["error"], name


def _raw_status(base_url: str, credential: bytes) -> int:
    """The status of a GET whose X-API-Key holds bytes no HTTP client library would send."""
    where = urlsplit(base_url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        s.sendall(b"GET /api/v1/training_runs HTTP/1.1\r\nHost: " + where.netloc.encode() +
                  b"\r\nX-API-Key: " + credential + b"\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize("credential", [
    b"eyJhbGciOiJIUzI1NiJ9.\xed\xa0\x80.AAAA",            # a lone surrogate, UTF-8 encoded
    b"eyJ\x00.e30.AAAA",                                    # a NUL byte
    b"eyJ" + b"\xff" * 100 + b".e30.AAAA",                 # not even text
    b"eyJ" + b"A" * 200_000,                                # past the server's header limit
])
def test_hostile_tokens_are_refused_cleanly(jwt_api, credential):
    assert _raw_status(jwt_api, credential) in (400, 401, 431)


def test_a_revoked_keys_tokens_stop_at_once(stack, jwt_api):
    tenant = stack.create_tenant("jwt")
    other_key = _second_key(stack, tenant.tenant_id)
    token = _exchange(jwt_api, other_key)
    api = TinkerAuthApi(httpx.Client(timeout=60), base_url=jwt_api)

    described = api.get_self_api_key(other_key)  # the tinker CLI's own parsing of the answer
    assert described.note.startswith("tml-") and described.details.org_details.name == tenant.name
    raw = _http(jwt_api, token).get("/auth/apikey/me").json()
    assert raw["prefix"] == other_key[:12] and raw["tenant_id"] == tenant.tenant_id and "key_hash" not in raw
    assert other_key not in json.dumps(raw)

    # `tinker auth logout` revokes the key it holds, here through a token of it: the key and every
    # token it minted are refused from the next call, on both API processes.
    assert _http(jwt_api, token).delete("/auth/apikey/me").json()["revoked"] is True
    for base in (jwt_api, stack.base_url):
        r = _http(base, token).get("/training_runs")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == INVALID_TOKEN
        assert _http(base, other_key).get("/training_runs").status_code == 401
    assert _http(jwt_api, other_key).post("/auth/token", json={}).status_code == 401
    # The tenant's first key is untouched, and the audit log names the revocation.
    assert _http(jwt_api, tenant.key).get("/training_runs").status_code == 200
    audit = _http(jwt_api, tenant.key).get("/quilt/audit").json()
    assert any(e["action"] == "key.revoked" and e["detail"]["prefix"] == other_key[:12]
               for e in audit["entries"])


def _second_key(stack, tenant_id: str, role: str = "owner") -> str:
    from core import db
    from tenancy.keys import create_key

    with db.connect(stack.database_url) as conn:
        return create_key(conn, tenant_id, "second", role=role)[0]


def test_a_read_only_keys_token_reads_and_changes_nothing(stack, jwt_api):
    tenant = stack.create_tenant("jwt")
    token = _exchange(jwt_api, _second_key(stack, tenant.tenant_id, role="read_only"))
    assert jwt.decode(token, options={"verify_signature": False})["role"] == "read_only"
    client = _http(jwt_api, token)
    assert client.get("/training_runs").status_code == 200
    r = client.post("/create_session", json={})
    assert r.status_code == 403 and "read_only" in r.json()["error"]


def test_a_token_minted_for_one_tenant_reads_nothing_of_another(stack, jwt_api):
    a, b = stack.create_tenant("ja"), stack.create_tenant("jb")
    session = _http(jwt_api, a.key).post("/create_session", json={}).json()["session_id"]
    by_b = _http(jwt_api, mint_token(stack, b.key))
    assert by_b.post("/session_heartbeat", json={"session_id": session}).status_code == 404
    assert by_b.get("/training_runs").json()["training_runs"] == []
