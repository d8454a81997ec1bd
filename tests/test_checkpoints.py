"""save_weights then load_weights restores the adapter (and optimizer) exactly."""

from __future__ import annotations

from stackutil import ADAM, datum, new_model, wait_future

TOKENS = list(range(50, 90))


def test_load_restores_the_saved_model(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    seq = iter(range(1, 100))

    def call(path, body):
        body = {"model_id": model_id, "seq_id": next(seq), **body}
        return wait_future(client, client.post(path, json=body).json()["request_id"])

    def forward():
        return call("/forward", {"forward_input": {"data": [datum(TOKENS)], "loss_fn": "cross_entropy"}})

    call("/forward_backward", {"forward_backward_input": {"data": [datum(TOKENS)], "loss_fn": "cross_entropy"}})
    call("/optim_step", {"adam_params": ADAM})
    saved = call("/save_weights", {"path": "after-one-step"})
    assert saved["path"] == f"tinker://{model_id}/weights/after-one-step"
    at_save = forward()

    for _ in range(2):  # move away from the checkpoint
        call("/forward_backward", {"forward_backward_input": {"data": [datum(TOKENS)], "loss_fn": "cross_entropy"}})
        call("/optim_step", {"adam_params": ADAM})
    assert forward()["metrics"]["loss:sum"] != at_save["metrics"]["loss:sum"]

    loaded = call("/load_weights", {"path": saved["path"], "optimizer": True})
    assert loaded["path"] == saved["path"]
    assert forward() == at_save


def test_checkpoint_is_in_peft_format(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    r = client.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "fmt"}).json()
    wait_future(client, r["request_id"])
    name_dir = stack.data_dir / "checkpoints" / tenant.tenant_id / model_id / "weights" / "fmt"
    (ckpt,) = name_dir.iterdir()  # one directory per save (checkpoints.retention)
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= names


def test_saving_an_existing_name_fails_the_future_unless_overwrite(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    first = client.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "dup"}).json()
    assert "path" in wait_future(client, first["request_id"])
    again = client.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "dup"}).json()
    failed = wait_future(client, again["request_id"])
    assert failed["category"] == "user" and "already exists" in failed["error"]
    over = client.post("/save_weights", json={"model_id": model_id, "seq_id": 3, "path": "dup", "overwrite": True}).json()
    assert "path" in wait_future(client, over["request_id"])


def test_user_metadata_is_listed_with_the_checkpoint_and_replaced_with_it(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    seq = iter(range(1, 100))

    def save(route: str, body: dict) -> dict:
        r = client.post(route, json={"model_id": model_id, "seq_id": next(seq), **body})
        assert r.status_code == 200, r.text
        return wait_future(client, r.json()["request_id"])

    def listed() -> dict:
        rows = client.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
        return {c["checkpoint_id"]: c.get("user_metadata") for c in rows}

    save("/save_weights", {"path": "tagged", "user_metadata": {"eval": "0.81", "step": "100"}})
    save("/save_weights_for_sampler", {"path": "served", "user_metadata": {"policy": "v3"}})
    save("/save_weights", {"path": "plain"})
    assert listed() == {"weights/tagged": {"eval": "0.81", "step": "100"},
                        "sampler_weights/served": {"policy": "v3"}, "weights/plain": None}
    # Overwriting replaces the whole mapping; without one, the old one is gone (tinker's rule).
    save("/save_weights", {"path": "tagged", "overwrite": True, "user_metadata": {"eval": "0.9"}})
    save("/save_weights_for_sampler", {"path": "served"})
    assert listed()["weights/tagged"] == {"eval": "0.9"} and listed()["sampler_weights/served"] is None

    for metadata in ({"k": "v" * 1025}, {"k" * 129: "v"}, {f"k{i}": "v" for i in range(65)}, {"k": 1},
                     {"k": "nul\u0000"}, ["k", "v"]):
        r = client.post("/save_weights", json={"model_id": model_id, "seq_id": next(seq), "path": "bad",
                                               "user_metadata": metadata})
        assert r.status_code == 400 and r.json()["field"].startswith("user_metadata"), (metadata, r.text)


def test_load_options_it_cannot_honour_are_refused_by_name(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    saved = wait_future(client, client.post("/save_weights", json={"model_id": model_id, "seq_id": 1,
                                                                  "path": "src"}).json()["request_id"])
    session_id = model_id.split(":")[0]
    for extra, field in [({"optimizer_config": {"type": "lion"}}, "optimizer_config.type"),
                         ({"optimizer": True, "optimizer_config": {"type": "dimuon"}}, "optimizer_config"),
                         ({"weights_access_token": "t" * 257}, "weights_access_token"),
                         ({"base_model": "quilt/some-other-base"}, "base_model")]:
        r = client.post("/load_weights", json={"session_id": session_id, "model_seq_id": 7, "path": saved["path"],
                                               "optimizer": False} | extra)
        assert r.status_code == 400 and r.json()["field"] == field, (extra, r.text)
    r = client.post("/load_weights", json={"session_id": session_id, "model_seq_id": 7, "path": saved["path"],
                                           "optimizer": False, "base_model": "quilt/tiny-qwen3",
                                           "optimizer_config": {"type": "adamw"}})
    assert r.status_code == 200 and "path" in wait_future(client, r.json()["request_id"]), r.text
