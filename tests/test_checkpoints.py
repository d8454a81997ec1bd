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
        return call("/forward", {"forward_backward_input": {"data": [datum(TOKENS)], "loss_fn": "cross_entropy"}})

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
    (ckpt,) = name_dir.iterdir()  # one directory per save (core.retention)
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
