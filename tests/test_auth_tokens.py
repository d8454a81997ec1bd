"""SDK auth tokens (tenancy.tokens) as tables: minted and verified, across key rotation, past
expiry, and against forged, altered and hostile tokens, each refused as InvalidToken."""

from __future__ import annotations

import base64
import json

import jwt
import pytest

from core.errors import InvalidToken, Unauthenticated
from core.signing_keys import SigningKeys
from tenancy import tokens
from tenancy.auth import Principal

NOW = 1_800_000_000
TTL = 900
RAW = SigningKeys(1, {1: b"\x01" * 32})  # a generation's key, as core.signing_keys derives it
KEYS = RAW.for_purpose(tokens.PURPOSE)
WHO = Principal(tenant_id="ten-a", tenant_name="acme", role="customer", key_id="key-00000000000000ab",
                plan_weight=1.0, max_models=4, max_inflight_requests=8, tokens_per_minute=100,
                key_prefix="tml-abcdefgh", member_role="member")


def _token(**overrides) -> str:
    return tokens.mint(overrides.pop("keys", KEYS), overrides.pop("who", WHO), ttl_s=TTL, now=NOW)


def _b64(obj) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def _claims(**changes) -> dict:
    claims = jwt.decode(_token(), options={"verify_signature": False})
    claims.update(changes)
    return {k: v for k, v in claims.items() if v is not None}


def _signed(claims: dict, key: bytes = KEYS.keys[1], alg: str = "HS256", kid: str | None = "1") -> str:
    return jwt.encode(claims, key, algorithm=alg, headers={"kid": kid} if kid is not None else {})


def test_a_minted_token_is_a_standard_jwt_of_its_key():
    token = _token()
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "HS256" and header["kid"] == "1" and header["typ"] == "JWT"
    claims = tokens.verify(KEYS, token, now=NOW + 1)
    assert claims == tokens.TokenClaims("key-00000000000000ab", "ten-a", "member", NOW, NOW + TTL, claims.token_id, 1)
    body = jwt.decode(token, options={"verify_signature": False})
    # What the tinker SDK's whoami reads, and its refresh timer's exp - iat.
    assert body["sub"] == "quilt:apikey:key-00000000000000ab" and body["org_id"] == "ten-a"
    assert body["exp"] - body["iat"] == TTL
    assert tokens.is_token(token) and not tokens.is_token("tml-abc")


def test_every_token_is_told_apart():
    assert tokens.verify(KEYS, _token(), NOW).token_id != tokens.verify(KEYS, _token(), NOW).token_id


def test_a_dashboard_session_gets_no_token():
    with pytest.raises(ValueError):
        tokens.mint(KEYS, Principal(**{**WHO.__dict__, "key_id": ""}), ttl_s=TTL, now=NOW)


@pytest.mark.parametrize("holder,ok", [
    (SigningKeys(1, {1: RAW.keys[1]}), True),                                   # the same generation
    (SigningKeys(2, {2: b"\x02" * 32, 1: RAW.keys[1]}), True),                  # rotated once: still valid
    (SigningKeys(3, {3: b"\x03" * 32, 2: b"\x02" * 32}), False),                # rotated twice: out
    (SigningKeys(3, {3: b"\x03" * 32}), False),                                 # retired (rotate-key --retire)
    (SigningKeys(1, {1: b"\x09" * 32}), False),                                 # same kid, another server's key
])
def test_rotation(holder, ok):
    token = _token()
    keys = holder.for_purpose(tokens.PURPOSE)
    if ok:
        assert tokens.verify(keys, token, now=NOW).key_id == WHO.key_id
    else:
        with pytest.raises(InvalidToken):
            tokens.verify(keys, token, now=NOW)


def test_a_new_generation_signs_and_the_old_one_verifies():
    rotated = SigningKeys(2, {2: b"\x02" * 32, 1: RAW.keys[1]}).for_purpose(tokens.PURPOSE)
    fresh = tokens.mint(rotated, WHO, ttl_s=TTL, now=NOW)
    assert jwt.get_unverified_header(fresh)["kid"] == "2"
    assert tokens.verify(rotated, fresh, NOW).key_id == WHO.key_id
    with pytest.raises(InvalidToken, match="rotated out"):
        tokens.verify(KEYS, fresh, NOW)


@pytest.mark.parametrize("now,why", [
    (NOW - tokens.LEEWAY_S + 1, None),
    (NOW + TTL - 1, None),
    (NOW + TTL + tokens.LEEWAY_S, "expired"),
    (NOW + 10 * TTL, "expired"),
    (NOW - 10 * tokens.LEEWAY_S, "not valid yet"),   # minted in this verifier's future
])
def test_times(now, why):
    if why is None:
        assert tokens.verify(KEYS, _token(), now=now)
    else:
        with pytest.raises(InvalidToken, match=why):
            tokens.verify(KEYS, _token(), now=now)


def _alg_none() -> str:
    return f"{_b64({'alg': 'none', 'kid': '1', 'typ': 'JWT'})}.{_b64(_claims())}."


def _alg_none_signed() -> str:
    return f"{_b64({'alg': 'none', 'kid': '1', 'typ': 'JWT'})}.{_b64(_claims())}.AAAA"


def _raised_role() -> str:
    head, _, sig = _token().split(".")
    return f"{head}.{_b64(_claims(role='owner'))}.{sig}"


def _other_tenant() -> str:
    head, _, sig = _token().split(".")
    return f"{head}.{_b64(_claims(org_id='ten-b'))}.{sig}"


FORGED = {
    "another key": lambda: _signed(_claims(), key=b"\x07" * 32),
    "the download-link key itself": lambda: _signed(_claims(), key=RAW.keys[1]),
    "alg none": _alg_none,
    "alg none with a signature": _alg_none_signed,
    "HS512 with the right key": lambda: _signed(_claims(), alg="HS512"),
    "role raised, old signature": _raised_role,
    "tenant changed, old signature": _other_tenant,
    "no kid": lambda: _signed(_claims(), kid=None),
    "kid not a number": lambda: _signed(_claims(), kid="../../etc/passwd"),
    "kid unknown": lambda: _signed(_claims(), kid="99"),
    "kid huge": lambda: _signed(_claims(), kid="9" * 40),
    "wrong audience": lambda: _signed(_claims(aud="someone-else")),
    "wrong issuer": lambda: _signed(_claims(iss="someone-else")),
    "no exp": lambda: _signed(_claims(exp=None)),
    "no iat": lambda: _signed(_claims(iat=None)),
    "no sub": lambda: _signed(_claims(sub=None)),
    "sub not a key": lambda: _signed(_claims(sub="admin")),
    "unknown role": lambda: _signed(_claims(role="operator")),
    "exp a string": lambda: _signed(_claims(exp=str(NOW + TTL))),
    "exp a bool": lambda: _signed(_claims(iat=True)),
    "exp before iat": lambda: _signed(_claims(exp=NOW - 1, iat=NOW)),
    "empty": lambda: "",
    "eyJ alone": lambda: "eyJ",
    "two segments": lambda: ".".join(_token().split(".")[:2]),
    "four segments": lambda: _token() + ".AAAA",
    "not base64": lambda: "eyJ!!!.eyJ!!!.sig",
    "header not JSON": lambda: f"{base64.urlsafe_b64encode(b'{not json').decode().rstrip('=')}.e30.AAAA",
    "header a list": lambda: f"{_b64([1, 2])}.{_b64(_claims())}.AAAA",
    "NUL byte": lambda: _token()[:20] + "\x00" + _token()[20:],
    "lone surrogate": lambda: _token()[:20] + "\ud800" + _token()[21:],
    "huge": lambda: "eyJ" + "A" * 10_000_000 + ".e30.AAAA",
    "whitespace": lambda: " " + _token(),
}


@pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")  # the HS512 forgery's own key
@pytest.mark.parametrize("name", FORGED)
def test_forged_altered_and_hostile_tokens_are_invalid_tokens(name):
    with pytest.raises(InvalidToken) as caught:
        tokens.verify(KEYS, FORGED[name](), now=NOW)
    assert isinstance(caught.value, Unauthenticated) and caught.value.status_code == 401
    assert caught.value.www_authenticate == 'Bearer error="invalid_token"'
    assert "exchange your API key" in caught.value.message


@pytest.mark.parametrize("key_role,token_role,acts_as", [
    ("owner", "owner", "owner"),
    ("member", "owner", "member"),        # lowered since minting: the lower role
    ("read_only", "member", "read_only"),
    ("owner", "member", "member"),        # raised since minting: the token keeps its own
    ("owner", "read_only", "read_only"),
])
def test_a_token_never_holds_more_than_its_key(key_role, token_role, acts_as):
    claims = tokens.TokenClaims(WHO.key_id, WHO.tenant_id, token_role, NOW, NOW + TTL, "j")
    key_now = Principal(**{**WHO.__dict__, "member_role": key_role})
    assert tokens.acting_as(key_now, claims).member_role == acts_as


def test_a_token_whose_key_is_in_another_tenant_is_refused():
    claims = tokens.TokenClaims(WHO.key_id, "ten-b", "member", NOW, NOW + TTL, "j")
    with pytest.raises(InvalidToken):
        tokens.acting_as(WHO, claims)


def test_token_keys_are_their_own():
    assert KEYS.keys[1] != RAW.keys[1] and KEYS.current == RAW.current
    assert RAW.for_purpose(b"other").keys[1] != KEYS.keys[1]


def test_a_process_checks_a_tokens_signature_once_and_its_times_and_key_always(monkeypatch):
    seen = tokens.VerifiedTokens(max_entries=2)
    token = _token()
    first = seen.verify(KEYS, token, NOW)
    calls = []
    monkeypatch.setattr(tokens, "verify", lambda *a: calls.append(a) or tokens.TokenClaims(*"abc", 0, 0, "", 0))
    assert seen.verify(KEYS, token, NOW + 1) is first and calls == []  # remembered: no second check
    monkeypatch.undo()
    with pytest.raises(InvalidToken, match="expired"):
        seen.verify(KEYS, token, NOW + TTL + tokens.LEEWAY_S)
    seen.verify(KEYS, token, NOW)
    retired = SigningKeys(2, {2: b"\x02" * 32}).for_purpose(tokens.PURPOSE)
    with pytest.raises(InvalidToken, match="rotated out"):
        seen.verify(retired, token, NOW)
    for _ in range(5):  # bounded: starts over rather than grow
        seen.verify(KEYS, _token(), NOW)
    assert len(seen._claims) <= 2


def test_a_bad_token_is_never_remembered():
    seen = tokens.VerifiedTokens()
    for _ in range(2):
        with pytest.raises(InvalidToken):
            seen.verify(KEYS, FORGED["another key"](), NOW)
    assert seen._claims == {}
