"""Optimizers on the wire, through the official tinker SDK unchanged: a model's optimizer is chosen at
create_model and kept for its life (its steps, its checkpoints, what get_info and weights_info say);
an AdamW and a Dimuon model train side by side; the other family's or hostile hyperparameters are
a 400 naming the field."""

from __future__ import annotations

import json

import pytest

tinker = pytest.importorskip("tinker")
from stackutil import TINY, wait_future  # noqa: E402
from tinker import types  # noqa: E402
from tinker.types.optimizer import OptimParamsBase  # noqa: E402
from tinkerutil import ready, rest_client, sft_data  # noqa: E402

DIMUON = types.DimuonParams(learning_rate=0.05, beta1=0.9)
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _loss(tc) -> float:
    return tc.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]


def test_an_adamw_and_a_dimuon_model_train_side_by_side(stack):
    a, d = stack.create_tenant("adam"), stack.create_tenant("dimuon")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key) as sa, \
            tinker.ServiceClient(base_url=stack.base_url, api_key=d.key) as sd:
        adam_tc = ready(sa.create_lora_training_client(base_model=TINY, rank=8))
        dimuon_tc = ready(sd.create_lora_training_client(base_model=TINY, rank=8,
                                                         optimizer=types.DimuonOptimizerConfig()))
        assert dimuon_tc.get_info().optimizer_config.type == "dimuon"
        assert adam_tc.get_info().optimizer_config.type == "adamw"

        losses: dict[str, list[float]] = {"adam": [], "dimuon": []}
        for _ in range(5):
            # Both models' calls are in flight together, so their passes and steps share rounds.
            futures = {"adam": (adam_tc.forward_backward(sft_data(), "cross_entropy"), adam_tc.optim_step(ADAM)),
                       "dimuon": (dimuon_tc.forward_backward(sft_data(), "cross_entropy"),
                                  dimuon_tc.optim_step(DIMUON))}
            for name, (fb, opt) in futures.items():
                losses[name].append(fb.result().metrics["loss:sum"])
                assert opt.result().metrics["learning_rate:mean"] == pytest.approx(
                    DIMUON.learning_rate if name == "dimuon" else ADAM.learning_rate)
        for name, seen in losses.items():
            assert seen[-1] < 0.7 * seen[0], (name, seen)

        # The other family's parameters are refused by name, and change nothing.
        before = _loss(dimuon_tc)
        with pytest.raises(tinker.BadRequestError, match="adam_params"):
            dimuon_tc.optim_step(ADAM).result()
        with pytest.raises(tinker.BadRequestError, match="optimizer_params"):
            adam_tc.optim_step(DIMUON).result()
        assert _loss(dimuon_tc) == pytest.approx(before, rel=1e-6)


def test_dimuon_state_round_trips_through_save_and_load(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=8, optimizer=types.DimuonOptimizerConfig()))
        for _ in range(2):
            tc.forward_backward(sft_data(), "cross_entropy").result()
            tc.optim_step(DIMUON).result()
        path = tc.save_state("dimuon-1").result().path
        at_save = _loss(tc)

        def one_more_step(client) -> float:
            client.forward_backward(sft_data()[:2], "cross_entropy").result()
            client.optim_step(DIMUON).result()
            return _loss(client)

        without = one_more_step(tc)
        restored = ready(service.create_training_client_from_state_with_optimizer(path))
        assert restored.get_info().optimizer_config.type == "dimuon"
        assert one_more_step(restored) == pytest.approx(without, rel=1e-5)
        # Weights alone (momentum starting over) take another step: the state is what made them equal.
        weights_only = ready(service.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()))
        assert weights_only.get_info().optimizer_config.type == "dimuon"
        assert one_more_step(weights_only) != pytest.approx(without, rel=1e-3)

        info = rest_client(stack, tenant.key).get_weights_info_by_tinker_path(path).result()
        assert info.optimizer_config.type == "dimuon" and info.lora_rank == 8

        # An AdamW model takes the weights alone, never the Dimuon state.
        adam_tc = ready(service.create_lora_training_client(base_model=TINY, rank=8))
        with pytest.raises(tinker.BadRequestError, match="dimuon"):
            adam_tc.load_state_with_optimizer(path).result()
        adam_tc.load_state(path).result()
        assert _loss(adam_tc) == pytest.approx(at_save, rel=1e-5)

    # The SDK's full-state create names no optimizer; on the wire one that differs is refused by name.
    client = stack.http(tenant.key)
    r = client.post("/load_weights", json={"session_id": tc.model_id.split(":")[0], "model_seq_id": 99, "path": path,
                                           "optimizer": True, "optimizer_config": {"type": "adamw"}})
    _assert_400(r, "optimizer_config", "dimuon")


def _assert_400(r, field: str, *words: str):
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["category"] == "user" and body["field"] == field, body
    for w in words:
        assert w in body["detail"], body


def test_hostile_dimuon_hyperparameters_are_refused_by_name(stack, tenant):
    client = stack.http(tenant.key)
    session_id = client.post("/create_session", json={}).json()["session_id"]
    r = client.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": TINY,
                                           "lora_config": {"rank": 4}, "optimizer_config": {"type": "dimuon",
                                                                                            "version": 1}})
    model_id = wait_future(client, r.json()["request_id"])["model_id"]
    base = {"type": "dimuon", "learning_rate": 0.05}
    for extra, field, word in [({"learning_rate": float("nan")}, "optimizer_params.learning_rate", "finite"),
                               ({"learning_rate": float("inf")}, "optimizer_params.learning_rate", "finite"),
                               ({"learning_rate": -1.0}, "optimizer_params.learning_rate", "greater than"),
                               ({"beta1": 1.0}, "optimizer_params.beta1", "less than 1"),
                               ({"damping": -0.1}, "optimizer_params.damping", "greater than"),
                               ({"damping": 0.0}, "optimizer_params.damping", "greater than"),
                               ({"damping": float("nan")}, "optimizer_params.damping", "finite"),
                               ({"grad_clip_norm": float("-inf")}, "optimizer_params.grad_clip_norm", "finite"),
                               ({"rank_lr_correction_exponent": 1e308}, "optimizer_params.rank_lr_correction_exponent",
                                "less than"),
                               ({"rank_lr_correction_exponent": "huge"}, "optimizer_params.rank_lr_correction_exponent",
                                "number"),
                               ({"type": "lion"}, "optimizer_params.type", "dimuon")]:
        r = client.post("/optim_step", content=json.dumps({"model_id": model_id, "seq_id": 1,
                                                            "optimizer_params": {**base, **extra}}),
                        headers={"Content-Type": "application/json"})
        _assert_400(r, field, word)
    r = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1})
    _assert_400(r, "adam_params", "optimizer_params")
    r = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}})
    _assert_400(r, "adam_params", "Dimuon", "optimizer_params")
    for config, field in [({"type": "lion"}, "optimizer_config.type"), ({"type": "dimuon", "version": 2},
                                                                         "optimizer_config.version")]:
        r = client.post("/create_model", json={"session_id": session_id, "model_seq_id": 1, "base_model": TINY,
                                               "lora_config": {"rank": 4}, "optimizer_config": config})
        _assert_400(r, field)

    # The official SDK passes unknown fields of a non-Adam family on (OptimParamsBase allows extras):
    # the server is the one that refuses them, by name.
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4, optimizer=types.DimuonOptimizerConfig()))
        with pytest.raises(tinker.BadRequestError, match="optimizer_params.damping"):
            tc.optim_step(OptimParamsBase(type="dimuon", learning_rate=0.05, damping=-1.0)).result()
        tc.forward_backward(sft_data()[:1], "cross_entropy").result()
        step = tc.optim_step(OptimParamsBase(type="dimuon", learning_rate=0.05, damping=0.5,
                                                   rank_lr_correction_exponent=-0.5)).result()
        assert step.metrics["step:max"] == 1.0
