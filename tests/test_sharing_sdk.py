"""Projects, session search, copies, weights access tokens and publishing (issue 62 items 4 and
5) through the official tinker SDK 0.38 against the embedded stack, with tenant B trying
everything tenant A has not shared, and the hostile inputs of the new routes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from stackutil import datum, fb_body

tinker = pytest.importorskip("tinker")
if not hasattr(tinker, "AdminClient"):
    pytest.skip("copy_weights, publishing and session search are tinker 0.38's", allow_module_level=True)
from tinker import types  # noqa: E402
from tinkerutil import ready, sft_row  # noqa: E402

from core import db  # noqa: E402

pytestmark = pytest.mark.stack

TINY = "quilt/tiny-qwen3"
PROMPT = types.ModelInput.from_ints([40, 41, 42])
PARAMS = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1, stop=[])


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TINKER_PROJECT_ID", raising=False)


def _default_project(http: httpx.Client) -> str:
    (default,) = [p for p in http.get("/quilt/projects").json()["projects"] if p["is_default"]]
    return default["project_id"]


def _download(http: httpx.Client, path: str) -> httpx.Response:
    run, kind, name = path.removeprefix("tinker://").split("/")
    return http.get(f"/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls")


def _bytes(stack, tenant_id: str) -> int:
    with db.connect(stack.database_url) as conn:
        return conn.execute("SELECT COALESCE(sum(size_bytes), 0) AS n FROM checkpoints WHERE tenant_id = %s",
                            (tenant_id,)).fetchone()["n"]


def _sql(stack, query: str, params: tuple = ()) -> list[dict]:
    with db.connect(stack.database_url) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def test_publish_copy_and_unpublish_through_the_sdk(stack):
    a, b = stack.create_tenant("pub"), stack.create_tenant("pub")
    http_a, http_b = stack.http(a.key), stack.http(b.key)
    rest_a = tinker.RestClient(base_url=stack.base_url, api_key=a.key)
    rest_b = tinker.RestClient(base_url=stack.base_url, api_key=b.key)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key) as service_a:
        tc = ready(service_a.create_lora_training_client(base_model=TINY, rank=4))
        weights = tc.save_weights_for_sampler("shared").result().path
    service_b = tinker.ServiceClient(base_url=stack.base_url, api_key=b.key, project_id=_default_project(http_b))

    # Unpublished: B can neither sample, copy nor download it, and it reads as missing.
    with pytest.raises(tinker.NotFoundError):
        ready(service_b.create_sampling_client(model_path=weights))
    with pytest.raises(tinker.NotFoundError):
        service_b.copy_weights(weights).result()
    assert _download(http_b, weights).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        rest_b.publish_checkpoint_from_tinker_path(weights).result()  # only the owner publishes

    stored = _bytes(stack, a.tenant_id)
    rest_a.publish_checkpoint_from_tinker_path(weights).result()
    rest_a.publish_checkpoint_from_tinker_path(weights).result()  # again: nothing changes
    assert [c.public for c in rest_a.list_checkpoints(tc.model_id).result().checkpoints] == [True]
    assert _bytes(stack, a.tenant_id) == stored > 0  # still the owner's storage

    # Published: B samples it, copies it (no bytes duplicated) and downloads it.
    sampler_b = ready(service_b.create_sampling_client(model_path=weights))
    assert len(sampler_b.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens) == 3
    copy = service_b.copy_weights(weights, ttl_seconds=7200).result()
    (copied,) = rest_b.list_checkpoints(copy.removeprefix("tinker://").split("/")[0]).result().checkpoints
    assert copied.public is False and copied.expires_at is not None and copied.size_bytes == stored
    link = next(iter(_download(http_b, weights).raise_for_status().json()["urls"].values()))
    assert httpx.get(link).status_code == 200
    # An operator suspending B stops the link B minted before; lifting it, it works again.
    _sql(stack, "UPDATE tenants SET suspended_at = now(), suspended_kind = 'operator', suspended_reason = 'abuse' "
                "WHERE id = %s", (b.tenant_id,))
    stopped = httpx.get(link)
    assert stopped.status_code == 403 and "your tenant is suspended" in stopped.text, stopped.text
    _sql(stack, "UPDATE tenants SET suspended_at = NULL, suspended_kind = NULL, suspended_reason = NULL WHERE id = %s",
         (b.tenant_id,))
    assert httpx.get(link).status_code == 200
    # B sampling A's published snapshot of a sliding lifetime leaves A's expiry where it is.
    _sql(stack, "UPDATE checkpoints SET sliding_ttl_s = 7200, expires_at = now() + interval '1 hour' "
                "WHERE tenant_id = %s AND name = 'shared'", (a.tenant_id,))
    before = _sql(stack, "SELECT expires_at FROM checkpoints WHERE tenant_id = %s AND name = 'shared'", (a.tenant_id,))
    assert len(sampler_b.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens) == 3
    assert _sql(stack, "SELECT expires_at FROM checkpoints WHERE tenant_id = %s AND name = 'shared'",
                (a.tenant_id,)) == before
    _sql(stack, "UPDATE checkpoints SET sliding_ttl_s = NULL, expires_at = NULL WHERE tenant_id = %s AND name = 'shared'",
         (a.tenant_id,))

    # Unpublishing stops all three at once, for B's existing sampler and link too; B's copy stays.
    rest_a.unpublish_checkpoint_from_tinker_path(weights).result()
    with pytest.raises(tinker.NotFoundError):
        sampler_b.sample(PROMPT, 1, PARAMS).result()
    with pytest.raises(tinker.NotFoundError):
        service_b.copy_weights(weights).result()
    assert _download(http_b, weights).status_code == 404 and httpx.get(link).status_code == 404
    rest_a.unpublish_checkpoint_from_tinker_path(weights).result()

    # The files are shared and counted by reference: A deleting its checkpoint leaves B's copy whole.
    rest_a.delete_checkpoint_from_tinker_path(weights).result()
    own = ready(service_b.create_sampling_client(model_path=copy))
    assert len(own.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens) == 3
    assert _download(http_b, copy).status_code == 200
    # A copy holds weights and takes no training call.
    run = copy.removeprefix("tinker://").split("/")[0]
    refused = http_b.post("/forward_backward", json=fb_body(run, 1, [datum([40, 41, 42])]))
    assert refused.status_code == 400 and "copy_weights" in refused.text, refused.text
    rest_b.delete_checkpoint_from_tinker_path(copy).result()
    audit = [e["action"] for e in http_a.get("/quilt/audit").json()["entries"]]
    assert (audit.count("checkpoint.published"), audit.count("checkpoint.unpublished")) == (1, 1)


def test_projects_search_and_access_tokens(stack):
    a, b = stack.create_tenant("prj"), stack.create_tenant("prj")
    http_a, http_b = stack.http(a.key), stack.http(b.key)
    rest_a = tinker.RestClient(base_url=stack.base_url, api_key=a.key)
    rest_b = tinker.RestClient(base_url=stack.base_url, api_key=b.key)
    research = http_a.post("/quilt/projects", json={"name": "research"}).raise_for_status().json()["project_id"]
    assert http_a.post("/quilt/projects", json={"name": "research"}).status_code == 409
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key, project_id=research,
                              display_name="nightly sweep", user_metadata={"team": "rl"}) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        state = tc.save_state("kept").result().path
    in_project = tc.model_id.split(":")[0]
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key) as plain:
        elsewhere = plain.holder.get_session_id()

    # Search: by project, words of the name, metadata and status, paged by cursor, newest first.
    def search(**kw) -> list[str]:
        return [s.session_id for s in rest_a.search_sessions(types.SessionSearchRequest(**kw)).result().sessions]

    assert search(project_ids=[research]) == [in_project]
    assert search(display_name="SWEEP nightly") == [in_project]
    assert search(user_metadata={"team": "rl"}) == [in_project] and search(user_metadata={"team": "x"}) == []
    assert search(session_id=elsewhere, display_name="sweep") == [elsewhere, in_project]
    page = rest_a.search_sessions(types.SessionSearchRequest(limit=1)).result()
    assert [s.session_id for s in page.sessions] == [elsewhere] and page.sessions[0].project_id != research
    rest_page = rest_a.search_sessions(types.SessionSearchRequest(limit=1, cursor=page.next_cursor)).result()
    assert [s.session_id for s in rest_page.sessions] == [in_project] and rest_page.sessions[0].checkpoints_count == 1
    rest_a.assign_session_project(elsewhere, research).result()
    assert set(search(project_ids=[research])) == {in_project, elsewhere}
    assert rest_a.list_sessions(access_scope="accessible").result().sessions[:2] == [elsewhere, in_project]

    # B sees none of A's projects or sessions, and cannot move its own into A's project.
    assert rest_b.search_sessions(types.SessionSearchRequest(owner=types.AccessibleSearchOwner())).result().sessions == []
    with pytest.raises(tinker.NotFoundError):
        rest_b.search_sessions(types.SessionSearchRequest(project_ids=[research])).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.assign_session_project(in_project, _default_project(http_b)).result()
    with tinker.ServiceClient(base_url=stack.base_url, api_key=b.key) as service_b:
        session_b = service_b.holder.get_session_id()
        with pytest.raises(tinker.NotFoundError):
            rest_b.assign_session_project(session_b, research).result()

        # A token lets B copy A's private checkpoint into B's session, until A revokes it.
        made = http_a.post("/quilt/weights_access_tokens", json={"tinker_path": state}).raise_for_status().json()
        with pytest.raises(tinker.NotFoundError):
            rest_b.copy_weights(state, _default_project(http_b), weights_access_token="qwt-wrong").result()
        copy = rest_b.copy_weights(state, _default_project(http_b), weights_access_token=made["token"]).result()
        assert copy.startswith("tinker://sess-") and rest_b.get_weights_info_by_tinker_path(copy).result().lora_rank == 4
        r = http_b.post("/copy_weights", json={"source_path": state, "session_id": session_b, "model_seq_id": 5},
                        headers={"X-Tinker-Weights-Access-Token": made["token"]})
        assert r.status_code == 200 and r.json()["tinker_path"] == f"tinker://{session_b}:train:5/weights/kept"
        # A taken slot is a 400 naming model_seq_id (a 409 the SDK would retry for minutes).
        taken = http_b.post("/copy_weights", json={"source_path": copy, "session_id": session_b, "model_seq_id": 5})
        assert taken.status_code == 400 and "model_seq_id" in taken.text, taken.text
        # B's storage report: two checkpoints, one stored directory (as billed).
        (line,) = tinker.AdminClient(base_url=stack.base_url, api_key=b.key).get_current_checkpoint_storage_usage() \
            .result().data
        assert line.checkpoint_count == 2 and line.size_bytes * 2 == _bytes(stack, b.tenant_id) > 0

        # The token grants the files it was made for: A saving a new version under the name is not granted.
        # (A save over a name keeps the row and replaces its storage_path: as here.)
        _sql(stack, "UPDATE checkpoints SET storage_path = storage_path || '-v2' WHERE model_id = %s AND name = 'kept'",
             (tc.model_id,))
        with pytest.raises(tinker.NotFoundError):
            rest_b.copy_weights(state, _default_project(http_b), weights_access_token=made["token"]).result()
        _sql(stack, "UPDATE checkpoints SET storage_path = left(storage_path, -3) WHERE model_id = %s AND name = 'kept'",
             (tc.model_id,))
        assert http_a.delete(f"/quilt/weights_access_tokens/{made['id']}").status_code == 204
        with pytest.raises(tinker.NotFoundError):
            rest_b.copy_weights(state, _default_project(http_b), weights_access_token=made["token"]).result()
    audit = [e["action"] for e in http_a.get("/quilt/audit").json()["entries"]]
    assert audit.count("checkpoint.token_used") == 2

    # A checkpoint of the old layout (files in the name's directory, newer versions under it):
    # deleting it leaves the live version inside that directory whole.
    (kept,) = _sql(stack, "SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = 'kept'", (tc.model_id,))
    _sql(stack, "INSERT INTO checkpoints (tenant_id, model_id, kind, name, storage_path, size_bytes) "
                "VALUES (%s, %s, 'weights', 'old', %s, 1)", (a.tenant_id, tc.model_id, str(Path(kept["storage_path"]).parent)))
    rest_a.delete_checkpoint_from_tinker_path(f"tinker://{tc.model_id}/weights/old").result()
    assert Path(kept["storage_path"]).is_dir() and any(Path(kept["storage_path"]).iterdir())
    assert {"project.created", "checkpoint.token_created", "checkpoint.token_revoked"} <= set(audit)


def test_an_access_token_lets_another_tenant_load_the_checkpoint_into_its_own_training_client(stack):
    """create_training_client_from_state(..., weights_access_token=) (the cookbook's cross-account
    copy_checkpoint): the token's holder trains from the owner's weights; without it, or with a
    wrong one, the checkpoint reads as missing; the owner's audit log records the use."""
    a, b = stack.create_tenant("load"), stack.create_tenant("load")
    http_a = stack.http(a.key)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key) as service_a:
        tc = ready(service_a.create_lora_training_client(base_model=TINY, rank=4))
        tc.forward_backward([sft_row(40)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        state = tc.save_state("granted").result().path
        owners = tc.save_weights_and_get_sampling_client("owners").compute_logprobs(PROMPT).result()
    made = http_a.post("/quilt/weights_access_tokens", json={"tinker_path": state}).raise_for_status().json()
    with tinker.ServiceClient(base_url=stack.base_url, api_key=b.key) as service_b:
        for token in (None, "qwt-wrong"):
            with pytest.raises(tinker.NotFoundError):
                service_b.create_training_client_from_state(state, weights_access_token=token).result()
        loaded = service_b.create_training_client_from_state(state, weights_access_token=made["token"]).result()
        info = loaded.get_info()
        assert info.model_data.model_name == TINY and info.lora_rank == 4
        mine = loaded.save_state("mine").result().path
        theirs = loaded.save_weights_and_get_sampling_client("theirs").compute_logprobs(PROMPT).result()
    assert mine.startswith(f"tinker://{loaded.model_id}/") and theirs == pytest.approx(owners, abs=1e-5)
    used = [e for e in http_a.get("/quilt/audit").json()["entries"] if e["action"] == "checkpoint.token_used"]
    assert [e["detail"]["tinker_path"] for e in used] == [state]
    # The owner revokes the token: it loads no more.
    assert http_a.delete(f"/quilt/weights_access_tokens/{made['id']}").status_code == 204
    with tinker.ServiceClient(base_url=stack.base_url, api_key=b.key) as service_b, pytest.raises(tinker.NotFoundError):
        service_b.create_training_client_from_state(state, weights_access_token=made["token"]).result()


def test_hostile_inputs_are_refused_naming_field_and_limit(stack, tenant):
    http = stack.http(tenant.key)

    def refused(r: httpx.Response, field: str, *words: str) -> None:
        assert r.status_code == 400, r.text
        assert field in r.text and all(w in r.text for w in words), r.text

    refused(http.post("/sessions/search", json={"limit": 10**6}), "limit", "200")
    refused(http.post("/sessions/search", json={"display_name": "a\u0000b"}), "display_name", "NUL")
    refused(http.post("/sessions/search", json={"owner": {"type": "user", "owner_urns": ["u"] * 11}}), "owner_urns", "10")
    refused(http.post("/sessions/search", json={"owner": {"type": "user", "owner_urns": ["user:1"]}}), "owner_urns")
    refused(http.post("/sessions/search", json={"user_metadata": {str(i): "v" for i in range(65)}}), "user_metadata", "64")
    refused(http.get("/sessions", params={"access_scope": "everyone"}), "access_scope", "accessible")
    refused(http.get("/sessions", params={"limit": 10**6}), "limit", "1000")
    for bad in ("weights/x", "tinker://a/b", "tinker://r/optimizer/x", "tinker://r/weights/x\u0000"):
        refused(http.post("/copy_weights", json={"source_path": bad, "destination_project_id": "p"}), "source_path")
    refused(http.post("/copy_weights", json={"source_path": "tinker://r/weights/x", "destination_project_id": "p",
                                             "ttl_seconds": 10**12}), "ttl_seconds")
    refused(http.post("/quilt/projects", json={"name": "a/../b"}), "name")
    refused(http.post("/quilt/weights_access_tokens", json={"tinker_path": "nope"}), "tinker_path")
    assert http.post("/copy_weights", json={"source_path": "tinker://r/weights/x",
                                            "destination_project_id": "proj-nothere"}).status_code == 404
    assert http.post("/training_runs/r/checkpoints/weights/x/publish").status_code == 404
