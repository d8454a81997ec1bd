"""Client configuration: arguments, environment variables, key checks."""

import httpx
import pytest
import quilt


def _recorder(seen):
    def handler(request):
        seen.append(request)
        return httpx.Response(200, json={"status": "ok"})

    return httpx.MockTransport(handler)


def test_env_vars_are_used_when_arguments_are_absent(monkeypatch):
    monkeypatch.setenv("QUILT_API_KEY", "tml-from-env")
    monkeypatch.setenv("QUILT_BASE_URL", "http://env.example:9/")
    seen = []
    with quilt.Client(transport=_recorder(seen)) as client:
        client.healthz()
    assert str(seen[0].url) == "http://env.example:9/api/v1/healthz"
    assert seen[0].headers["X-API-Key"] == "tml-from-env"


def test_arguments_win_over_env_vars(monkeypatch):
    monkeypatch.setenv("QUILT_API_KEY", "tml-from-env")
    monkeypatch.setenv("QUILT_BASE_URL", "http://env.example:9")
    seen = []
    with quilt.Client("tml-arg", "http://arg.example//", transport=_recorder(seen)) as client:
        client.healthz()
    assert str(seen[0].url) == "http://arg.example/api/v1/healthz"
    assert seen[0].headers["X-API-Key"] == "tml-arg"


def test_default_base_url(monkeypatch):
    monkeypatch.delenv("QUILT_BASE_URL", raising=False)
    with quilt.Client("tml-x", transport=_recorder([])) as client:
        assert client.base_url == "http://127.0.0.1:8000"


def test_missing_key_says_to_set_env_var(monkeypatch):
    monkeypatch.delenv("QUILT_API_KEY", raising=False)
    with pytest.raises(quilt.AuthenticationError, match="QUILT_API_KEY"):
        quilt.Client()


def test_key_without_tml_prefix_is_refused():
    with pytest.raises(quilt.ConfigurationError, match="tml-") as info:
        quilt.Client(api_key="sk-abc")
    assert isinstance(info.value, ValueError)
    assert "sk-abc" not in str(info.value)


def test_key_is_not_in_repr(monkeypatch):
    client = quilt.Client("tml-secret", transport=_recorder([]))
    try:
        assert "tml-secret" not in repr(client) + repr(client._config)
    finally:
        client.close()
