"""Sessions: created lazily once, kept alive by heartbeats, finished on close."""

import threading

import pytest
import quilt


def test_no_request_until_first_training_client(server, client):
    assert server.requests == []


def test_session_created_once_for_many_models(server, client):
    client.create_training_client("tiny")
    client.create_training_client("tiny")
    assert server.routes_seen().count("create_session") == 1
    assert server.bodies("create_session")[0] == {
        "tags": [], "user_metadata": {}, "sdk_version": quilt.__version__, "type": "create_session",
    }


def test_create_model_body(server, client):
    tc = client.create_training_client("tiny", 8, seed=3, user_metadata={"run": "a"})
    assert tc.model_id == "sess-1:train:0"
    assert server.bodies("create_model")[0] == {
        "session_id": "sess-1", "model_seq_id": 0, "base_model": "tiny",
        "lora_config": {"rank": 8, "train_unembed": True, "train_mlp": True, "train_attn": True, "seed": 3},
        "optimizer_config": {"type": "adamw"}, "user_metadata": {"run": "a"}, "type": "create_model",
    }


def test_create_model_omits_unset_optionals(server, client):
    client.create_training_client("tiny")
    body = server.bodies("create_model")[0]
    assert "seed" not in body["lora_config"] and "user_metadata" not in body


def test_heartbeat_posts_while_session_exists(server, client):
    beat = threading.Event()
    server.routes["session_heartbeat"] = lambda body: beat.set() or {"type": "session_heartbeat"}
    client._heartbeat_interval_s = 0.01
    client.create_training_client("tiny")
    assert beat.wait(timeout=5)
    assert server.bodies("session_heartbeat")[0] == {"session_id": "sess-1", "type": "session_heartbeat"}


def test_close_finishes_session(server, client):
    client.create_training_client("tiny")
    client.close()
    assert server.requests[-1].route == "sessions/sess-1/finish"
    assert server.requests[-1].body == {"reason": {"type": "success"}, "detail": None}


def test_close_without_session_sends_nothing(server, client):
    client.close()
    assert server.requests == []


def test_context_manager_reports_errors(server, make_client):
    try:
        with make_client() as client:
            client.create_training_client("tiny")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    body = server.bodies("sessions/sess-1/finish")[0]
    assert body["reason"] == {"type": "errored"} and "boom" in body["detail"]


def test_closed_client_refuses_calls(client):
    client.close()
    with pytest.raises(quilt.QuiltError, match="closed"):
        client.healthz()


def test_reads(client):
    assert client.healthz() == {"status": "ok"}
    assert client.get_server_capabilities()["supported_models"][0]["model_name"] == "tiny"
