"""Dimuon in the engine: its step against a reference written here (float64, matrix by matrix, plain
loops), AdamW and Dimuon models stepped in one round, its state through save and load, and the
family a model was created with holding for its life."""

from __future__ import annotations

import json
import math

import pytest
import torch

from batcher.engine import optimizers
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from checkpoints.layout import META_FILE, TrainerMeta
from core.errors import InvalidInput, QuiltError
from core.loss_spec import LossConfig
from core.work import (
    ADAMW,
    DIMUON,
    AdamParams,
    CreateModel,
    Datum,
    DimuonParams,
    LoraShape,
    OptimStep,
    PassWork,
    WorkItem,
    WorkKind,
    check_family,
    load_family,
    params_field,
)
from stack.tiny_model import build_tiny_model

ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path


def _datum(start: int, n: int = 12) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def _pass(be: LoraBackend, data: dict[str, list[Datum]]) -> list:
    return be.run_pass([PassRequest(m, m, PassWork("cross_entropy", LossConfig(), tuple(d)), False)
                        for m, d in data.items()])


# ------------------------------------------------------------------ the reference


def _ref_sign(p: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz as documented, on the matrix as it stands (a tall one from its right side)."""
    x = p / torch.linalg.norm(p)
    a, b, c = optimizers.NS_QUINTIC
    for _ in range(optimizers.NS_QUINTIC_STEPS):
        if x.shape[0] <= x.shape[1]:
            g = x @ x.T
            x = a * x + (b * g + c * g @ g) @ x
        else:
            g = x.T @ x
            x = a * x + x @ (b * g + c * g @ g)
    for _ in range(optimizers.NS_CUBIC_STEPS):
        x = 1.5 * x - 0.5 * (x @ x.T @ x)
    return x


def _ref_direction(m: torch.Tensor, damping: float, rank: int) -> torch.Tensor:
    rows, cols = m.shape
    mean_sq = sum(float(m[i, j]) ** 2 for i in range(rows) for j in range(cols)) / (rows * cols)
    if mean_sq == 0:  # (LoRA A's first gradient, while B is zero)
        return torch.zeros_like(m)
    r = [sum(float(m[i, j]) ** 2 for j in range(cols)) / cols / mean_sq for i in range(rows)]
    c = [sum(float(m[i, j]) ** 2 for i in range(rows)) / rows / mean_sq for j in range(cols)]
    s = torch.diag(torch.tensor([(v + damping) ** -0.25 for v in r], dtype=torch.float64))
    t = torch.diag(torch.tensor([(v + damping) ** -0.25 for v in c], dtype=torch.float64))
    u = s @ _ref_sign(s @ m @ t) @ t
    return math.sqrt(rank) * u / torch.linalg.norm(u)


class RefDimuon:
    """One model's Dimuon, from its weights and gradients as float64 copies."""

    def __init__(self, params: list[torch.Tensor], rank: int):
        self.params = [p.detach().double().clone() for p in params]
        self.momenta = [torch.zeros_like(p) for p in self.params]
        self.rank = rank

    def step(self, grads: list[torch.Tensor], hp: DimuonParams) -> None:
        grads = [g.double() for g in grads]
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        if hp.grad_clip_norm > 0:
            coef = min(1.0, hp.grad_clip_norm / (norm + 1e-6))
            grads = [g * coef for g in grads]
        lr = hp.learning_rate * (self.rank / 32) ** hp.rank_lr_correction_exponent
        for k, g in enumerate(grads):
            self.momenta[k] = hp.beta1 * self.momenta[k] + (1 - hp.beta1) * g
            self.params[k] = self.params[k] - lr * _ref_direction(self.momenta[k], hp.damping, self.rank)


def _grads(be: LoraBackend, model_id: str) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in be.adapters[model_id].params]


def test_the_step_matches_the_reference_beside_an_adamw_model_in_one_round(base_path):
    be = LoraBackend(base_path)
    be.create("d4", LoraShape(rank=4, seed=1), DIMUON)
    be.create("d8", LoraShape(rank=8, seed=2), DIMUON)
    be.create("a", LoraShape(rank=4, seed=3))
    refs = {m: RefDimuon(be.adapters[m].params, r) for m, r in (("d4", 4), ("d8", 8))}
    adam_ref = [p.detach().double().clone().requires_grad_() for p in be.adapters["a"].params]
    adam_opt = torch.optim.AdamW(adam_ref, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                 weight_decay=ADAM.weight_decay)
    hps = [{"d4": DimuonParams(learning_rate=0.02, beta1=0.9, damping=0.1),
            "d8": DimuonParams(learning_rate=0.01, beta1=0.5, grad_clip_norm=0.05, damping=3.0,
                               rank_lr_correction_exponent=-0.5)},
           {"d4": DimuonParams(learning_rate=0.03, beta1=0.0, damping=1e-3, rank_lr_correction_exponent=1.0),
            "d8": DimuonParams(learning_rate=0.01, beta1=0.95, grad_clip_norm=-1.0)}]
    for round_, hp in enumerate(hps):
        _pass(be, {"d4": [_datum(5 + round_)], "d8": [_datum(50), _datum(90 + round_)], "a": [_datum(200)]})
        grads = {m: _grads(be, m) for m in ("d4", "d8", "a")}
        steps = [("d4", hp["d4"]), ("a", ADAM), ("d8", hp["d8"])]
        outcomes = be.optim_steps(steps)
        assert not any(isinstance(o, QuiltError) for o in outcomes), outcomes
        for m in ("d4", "d8"):
            refs[m].step(grads[m], hp[m])
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads["a"]))
        for p, g in zip(adam_ref, grads["a"]):
            p.grad = g.double() * min(1.0, ADAM.grad_clip_norm / (float(norm) + 1e-6))
        adam_opt.step()
        for m, ref in refs.items():
            for k, (got, want) in enumerate(zip(be.adapters[m].params, ref.params)):
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-6, msg=f"{m} round {round_} #{k}")
        for got, want in zip(be.adapters["a"].params, adam_ref):
            torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-6)


def test_the_direction_is_near_the_polar_factor_at_norm_sqrt_rank():
    torch.manual_seed(0)
    # Damping far above the rows' and columns' spread: no preconditioning, the direction the polar
    # factor U V^T, whose Frobenius norm is sqrt(rank).
    m = torch.linalg.qr(torch.randn(64, 8)).Q.T.contiguous() * torch.linspace(1.0, 2.0, 8)[:, None]
    [d] = optimizers.dimuon_directions([m], [1e6], [8])
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    torch.testing.assert_close(d, u @ vh, atol=2e-2, rtol=0)
    assert float(torch.linalg.norm(d)) == pytest.approx(math.sqrt(8), rel=1e-5)
    # A zero momentum (LoRA A's first gradient, while B is zero) is a zero step, not NaN.
    [z] = optimizers.dimuon_directions([torch.zeros(4, 32)], [1e-6], [4])
    assert torch.equal(z, torch.zeros(4, 32))


def test_dimuon_state_survives_save_and_load_and_continues_identically(base_path, tmp_path):
    hp = DimuonParams(learning_rate=0.02, beta1=0.8)
    be = LoraBackend(base_path)
    be.create("m", LoraShape(rank=4, seed=0), DIMUON)
    for start in (5, 30):
        _pass(be, {"m": [_datum(start)]})
        be.optim_step("m", hp)
    be.save("m", str(tmp_path / "ck"), overwrite=False)
    # What a restarted trainer re-creates the model from (batcher.snapshots) names its family.
    assert TrainerMeta.read(tmp_path / "ck").optimizer == DIMUON
    _pass(be, {"m": [_datum(70)]})
    be.optim_step("m", hp)
    after = {k: v.clone() for k, v in be.adapter_state("m").items()}

    other = LoraBackend(base_path)
    other.create("n", LoraShape(rank=4, seed=9), DIMUON)
    other.load("n", str(tmp_path / "ck"), optimizer=True)
    assert other.adapters["n"].steps == 2
    assert all("momentum_buffer" in other.adapters["n"].optimizer.state[p] for p in other.adapters["n"].params)
    _pass(other, {"n": [_datum(70)]})
    other.optim_step("n", hp)
    for k, v in other.adapter_state("n").items():
        torch.testing.assert_close(v, after[k], rtol=1e-5, atol=1e-7, msg=k)

    # Another family's model takes the weights alone, never the state.
    other.create("adam", LoraShape(rank=4, seed=9), ADAMW)
    with pytest.raises(InvalidInput) as err:
        other.load("adam", str(tmp_path / "ck"), optimizer=True)
    assert err.value.field == "path" and "dimuon" in str(err.value)
    other.load("adam", str(tmp_path / "ck"), optimizer=False)
    assert isinstance(other.adapters["adam"].optimizer, torch.optim.AdamW)


def test_a_step_of_the_other_family_is_refused_naming_its_field(base_path):
    be = LoraBackend(base_path)
    be.create("d", LoraShape(rank=4, seed=0), DIMUON)
    be.create("a", LoraShape(rank=4, seed=0), ADAMW)
    _pass(be, {"d": [_datum(5)], "a": [_datum(5)]})
    before = {k: v.clone() for k, v in be.adapter_state("d").items()}
    wrong_d, wrong_a = be.optim_steps([("d", ADAM), ("a", DimuonParams(learning_rate=0.1))])
    assert isinstance(wrong_d, InvalidInput) and wrong_d.field == "adam_params"
    assert isinstance(wrong_a, InvalidInput) and wrong_a.field == "optimizer_params"
    assert all(torch.equal(v, before[k]) for k, v in be.adapter_state("d").items())
    with pytest.raises(InvalidInput) as err:
        be.create("x", LoraShape(rank=4), "lion")
    assert err.value.field == "optimizer_config"


@pytest.mark.parametrize(("optimizer", "asked", "saved", "model", "want"), [
    # A new model: the checkpoint's family with its state, else the one asked for (AdamW by default).
    (True, None, DIMUON, None, DIMUON),
    (True, DIMUON, DIMUON, None, DIMUON),
    (True, ADAMW, DIMUON, None, "optimizer_config"),
    (False, None, DIMUON, None, ADAMW),
    (False, DIMUON, ADAMW, None, DIMUON),
    # An existing model keeps its own, takes any checkpoint's weights, and only its own family's state.
    (False, None, DIMUON, ADAMW, ADAMW),
    (True, None, ADAMW, ADAMW, ADAMW),
    (True, None, DIMUON, ADAMW, "path"),
    (True, None, None, DIMUON, DIMUON),  # a deleted run's checkpoint: the trainer checks what it holds
    (False, ADAMW, ADAMW, DIMUON, "optimizer_config"),
])
def test_the_family_a_load_ends_in(optimizer, asked, saved, model, want):
    if want in (ADAMW, DIMUON):
        assert load_family(optimizer=optimizer, asked=asked, saved=saved, model=model) == want
    else:
        with pytest.raises(InvalidInput) as err:
            load_family(optimizer=optimizer, asked=asked, saved=saved, model=model)
        assert err.value.field == want


@pytest.mark.parametrize(("model", "params", "field"), [
    (ADAMW, ADAMW, None), (DIMUON, DIMUON, None), (ADAMW, DIMUON, "optimizer_params"), (DIMUON, ADAMW, "adam_params")])
def test_a_step_must_be_of_the_models_family(model, params, field):
    if field is None:
        check_family(model, params)
    else:
        with pytest.raises(InvalidInput) as err:
            check_family(model, params)
        assert err.value.field == field and params_field(model) in str(err.value)


@pytest.mark.parametrize("body", [
    OptimStep(DimuonParams(learning_rate=0.05, beta1=0.5, grad_clip_norm=-1.0, damping=2.0,
                           rank_lr_correction_exponent=-0.5)),
    OptimStep(ADAM),
    CreateModel(LoraShape(rank=4), optimizer=DIMUON),
])
def test_the_family_crosses_the_work_contract(body):
    kind = WorkKind.OPTIM_STEP if isinstance(body, OptimStep) else WorkKind.CREATE_MODEL
    item = WorkItem("r", "t", "m", 1, kind, 0, body)
    assert WorkItem.from_fields(item.to_fields()).body == body


def test_entries_written_before_the_families_read_as_adamw():
    # A replay log or a queue may hold what the API wrote before Dimuon: AdamW under "adam", no optimizer.
    assert OptimStep.from_json({"adam": AdamParams().to_json()}) == OptimStep(AdamParams())
    assert CreateModel.from_json({"lora": LoraShape(rank=4).to_json(), "load": None}).optimizer == ADAMW


def test_checkpoints_written_before_the_families_hold_adamw_state(tmp_path):
    (tmp_path / META_FILE).write_text(json.dumps({"lora_config": {"rank": 4}, "steps": 3}))
    assert TrainerMeta.read(tmp_path).optimizer == ADAMW
