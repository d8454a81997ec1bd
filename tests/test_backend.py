"""LoRA math on the tiny model, directly against the backend (no services)."""

from __future__ import annotations

import pytest
import torch

from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.errors import UserError
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork
from stack.tiny_model import build_tiny_model

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.01, "grad_clip_norm": 1.0}


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path


def _datum(start: int, n: int = 16, policy_version: int | None = None) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n}, policy_version)


def _req(request_id: str, model_id: str, data: list[Datum], *, config: LossConfig = LossConfig(),  # noqa: B008 - frozen
         forward_only: bool = False) -> PassRequest:
    return PassRequest(request_id, model_id, PassWork("cross_entropy", config, tuple(data)), forward_only)


def _step(be: LoraBackend, model_id: str, data: list[Datum]) -> dict:
    out = be.run_pass([_req("r", model_id, data)])[0]
    be.optim_step(model_id, AdamParams(**ADAM))
    return out


def test_save_then_load_restores_adapter_and_optimizer_exactly(base_path, tmp_path):
    be = LoraBackend(base_path)
    be.create("m", LoraShape(rank=8, seed=0))
    _step(be, "m", [_datum(5), _datum(40)])
    be.save("m", str(tmp_path / "ck"), overwrite=False)
    adapter_at_save = {k: v.clone() for k, v in be.adapter_state("m").items()}
    optim_at_save = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                     for i, s in be.adapters["m"].optimizer.state_dict()["state"].items()}

    _step(be, "m", [_datum(70)])
    be.load("m", str(tmp_path / "ck"), optimizer=True)

    for k, v in be.adapter_state("m").items():
        assert torch.equal(v, adapter_at_save[k]), k
    restored = be.adapters["m"].optimizer.state_dict()["state"]
    assert restored.keys() == optim_at_save.keys()
    for i, s in optim_at_save.items():
        for k, v in s.items():
            assert torch.equal(restored[i][k], v), (i, k)


def test_two_models_in_one_pass_get_the_gradients_of_separate_passes(base_path):
    fused, alone = LoraBackend(base_path), LoraBackend(base_path)
    for be in (fused, alone):
        be.create("a", LoraShape(rank=8, seed=1))
        be.create("b", LoraShape(rank=4, seed=2, train_mlp=False))
    fused.run_pass([_req("1", "a", [_datum(3)]),
                    _req("2", "b", [_datum(9, 10), _datum(30)])])
    alone.run_pass([_req("1", "a", [_datum(3)])])
    alone.run_pass([_req("2", "b", [_datum(9, 10), _datum(30)])])
    for model_id in ("a", "b"):
        for pf, pa in zip(fused.adapters[model_id].params, alone.adapters[model_id].params, strict=True):
            torch.testing.assert_close(pf.grad, pa.grad, rtol=1e-5, atol=1e-6)


def test_outputs_keep_each_requests_datum_order(base_path):
    be = LoraBackend(base_path, max_tokens_per_pass=32)  # forces several micro-batches
    be.create("m", LoraShape(rank=4, seed=0))
    data = [_datum(10, 20), _datum(50, 3), _datum(80, 9)]
    out = be.run_pass([_req("r", "m", data, forward_only=True)])[0]
    assert [len(o["logprobs"]["data"]) for o in out["loss_fn_outputs"]] == [20, 3, 9]


def test_optim_step_without_gradients_is_a_no_op(base_path):
    be = LoraBackend(base_path)
    be.create("m", LoraShape(rank=4, seed=0))
    before = {k: v.clone() for k, v in be.adapter_state("m").items()}
    assert be.optim_step("m", AdamParams(**ADAM))["metrics"]["skipped:sum"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in be.adapter_state("m").items())


def test_four_tenants_fused_match_training_alone(base_path):
    """Different data, ranks, target modules, learning rates and clipping: after 3 steps of fused
    rounds every adapter equals the one trained by itself."""
    specs = {
        "t1": ({"rank": 4, "seed": 11}, {**ADAM, "learning_rate": 1e-2, "grad_clip_norm": 0.0}, [_datum(3, 12)]),
        "t2": ({"rank": 8, "seed": 12, "train_mlp": False}, {**ADAM, "learning_rate": 3e-3}, [_datum(20, 7), _datum(90, 20)]),
        "t3": ({"rank": 16, "seed": 13, "train_unembed": False}, {**ADAM, "learning_rate": 2e-2, "grad_clip_norm": 0.5},
               [_datum(200, 16)]),
        "t4": ({"rank": 2, "seed": 14, "train_attn": False}, {**ADAM, "learning_rate": 5e-3, "weight_decay": 0.1},
               [_datum(400, 5), _datum(500, 9), _datum(600, 3)]),
    }
    # float64, so the comparison tests the routing and the per-model arithmetic, not float32
    # rounding (padding to the longest row changes matmul shapes, and Adam amplifies last-bit
    # differences in near-zero gradients).
    fused, alone = LoraBackend(base_path, dtype=torch.float64), LoraBackend(base_path, dtype=torch.float64)
    for be in (fused, alone):
        for model_id, (lora, _, _) in specs.items():
            be.create(model_id, LoraShape(**lora))
    for _ in range(3):
        outs = fused.run_pass([_req(m, m, data) for m, (_, _, data) in specs.items()])
        assert all(isinstance(o, dict) for o in outs)
        assert fused.last_pass.models == 4
        for model_id, (_, adam, data) in specs.items():
            fused.optim_step(model_id, AdamParams(**adam))
            alone.run_pass([_req(model_id, model_id, data)])
            alone.optim_step(model_id, AdamParams(**adam))
    for model_id in specs:
        a, b = fused.adapter_state(model_id), alone.adapter_state(model_id)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-10, msg=f"{model_id} {key}")


def test_sixty_four_models_live_on_one_worker_and_idle_ones_are_offloaded(base_path):
    be = LoraBackend(base_path)
    for i in range(64):
        be.create(f"m{i}", LoraShape(rank=4, seed=i))
    outs = be.run_pass([_req(f"r{i}", f"m{i}", [_datum(i, 6)]) for i in range(64)])
    assert all(isinstance(o, dict) for o in outs) and be.last_pass.models == 64
    for i in range(64):
        be.optim_step(f"m{i}", AdamParams(**ADAM))
    assert be.residency() == {"resident": 64, "offloaded": 0}
    assert be.offload_idle(0.0) == 64
    assert be.residency() == {"resident": 0, "offloaded": 64}
    # Using two of them brings exactly those back, with their optimizer state intact.
    steps = be.adapters["m3"].optimizer.state_dict()["state"][0]["step"].item()
    be.run_pass([_req("x", "m3", [_datum(1)]),
                 _req("y", "m7", [_datum(2)])])
    be.optim_step("m3", AdamParams(**ADAM))
    assert be.residency() == {"resident": 2, "offloaded": 62}
    assert be.adapters["m3"].optimizer.state_dict()["state"][0]["step"].item() == steps + 1


def test_staleness_is_reported_and_stale_datums_are_dropped(base_path):
    be = LoraBackend(base_path)
    be.create("m", LoraShape(rank=4, seed=0))
    for _ in range(3):  # policy version 3
        be.run_pass([_req("r", "m", [_datum(5)])])
        be.optim_step("m", AdamParams(**ADAM))
    fresh, stale = _datum(5, policy_version=3), _datum(9, policy_version=0)
    out = be.run_pass([_req("r", "m", [fresh, stale], config=LossConfig(max_staleness=1))])[0]
    assert out["metrics"]["staleness:max"] == 3.0
    assert out["metrics"]["dropped_stale:sum"] == 1.0


def _overflowing(start: int) -> Datum:
    # Within float32, but weight * logprob is not: the datum's loss is infinite.
    d = _datum(start, n=4)
    return Datum(d.tokens, {**d.inputs, "weights": (3e38,) * 4})


def test_a_request_whose_loss_overflows_fails_alone_and_keeps_no_gradient(base_path):
    be = LoraBackend(base_path)
    for m in ("bad", "good"):
        be.create(m, LoraShape(rank=4, seed=0))
    bad, good = be.run_pass([_req("r1", "bad", [_datum(5), _overflowing(9)]), _req("r2", "good", [_datum(5)])])
    assert isinstance(bad, UserError) and "data[1]" in bad.message and "no gradient" in bad.message
    assert all(p.grad is None or not p.grad.any() for p in be.adapters["bad"].params)
    assert "loss:sum" in good["metrics"]
    # The bystander's gradient is what it would be alone.
    alone = LoraBackend(base_path)
    alone.create("good", LoraShape(rank=4, seed=0))
    alone.run_pass([_req("r", "good", [_datum(5)])])
    for p, q in zip(be.adapters["good"].params, alone.adapters["good"].params):
        torch.testing.assert_close(p.grad, q.grad)


def test_an_overflow_in_a_later_micro_batch_discards_the_partial_gradient(base_path):
    be = LoraBackend(base_path, max_tokens_per_pass=4)  # one datum per micro-batch, the shorter first
    be.create("m", LoraShape(rank=4, seed=0))
    [out] = be.run_pass([_req("r", "m", [_datum(5, n=3), _overflowing(9)])])
    assert isinstance(out, UserError) and "discarded" in out.message
    assert all(p.grad is None for p in be.adapters["m"].params)


def test_an_optim_step_on_gradients_that_overflowed_is_refused_and_changes_nothing(base_path):
    be = LoraBackend(base_path)
    be.create("m", LoraShape(rank=4, seed=0))
    be.run_pass([_req("r", "m", [_datum(5)])])
    before = {k: v.clone() for k, v in be.adapter_state("m").items()}
    next(p for p in be.adapters["m"].params if p.grad is not None).grad.fill_(float("inf"))
    with pytest.raises(UserError, match="not finite"):
        be.optim_step("m", AdamParams(**ADAM))
    assert all(p.grad is None for p in be.adapters["m"].params)
    for k, v in be.adapter_state("m").items():
        torch.testing.assert_close(v, before[k])
    assert be.policy_version("m") == 0


def test_a_bfloat16_base_trains_float32_adapters_and_optimizer_state(base_path):
    be = LoraBackend(base_path, dtype=torch.bfloat16)
    be.create("m", LoraShape(rank=8, seed=0))
    out = _step(be, "m", [_datum(5), _datum(40)])
    assert next(be.base.parameters()).dtype == torch.bfloat16
    assert {p.dtype for p in be.adapters["m"].params} == {torch.float32}
    moments = [v for s in be.adapters["m"].optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert out["loss_fn_outputs"][0]["logprobs"]["dtype"] == "float32"
    # Untrained, the bfloat16 base's logprobs are the float32 base's to within bfloat16 rounding.
    ref = LoraBackend(base_path)
    for b in (be, ref):
        b.create("fresh", LoraShape(rank=8, seed=0))
    lp16, lp32 = (b.run_pass([_req("r", "fresh", [_datum(5)], forward_only=True)])[0]["loss_fn_outputs"][0]
                  ["logprobs"]["data"] for b in (be, ref))
    assert lp32 != lp16 and max(abs(a - b) for a, b in zip(lp32, lp16)) < 0.5


def test_at_most_max_resident_adapters_stay_on_the_device_least_recently_used_parked_first(base_path):
    be = LoraBackend(base_path, max_resident=3)
    for i in range(5):
        be.create(f"m{i}", LoraShape(rank=4, seed=i))
        be.run_pass([_req(f"r{i}", f"m{i}", [_datum(i, 6)])])  # m0 is the least recently used
    assert be.residency() == {"resident": 3, "offloaded": 2}
    assert not be.adapters["m0"].resident and not be.adapters["m1"].resident
    # A pass that needs more than the limit gets all it needs; everything else is parked.
    outs = be.run_pass([_req(f"s{i}", f"m{i}", [_datum(i, 6)]) for i in range(4)])
    assert all(isinstance(o, dict) for o in outs)
    assert [be.adapters[f"m{i}"].resident for i in range(5)] == [True, True, True, True, False]
    be.run_pass([_req("t", "m4", [_datum(9, 6)])])
    assert be.residency() == {"resident": 3, "offloaded": 2} and be.adapters["m4"].resident
