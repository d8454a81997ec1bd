"""Built-in losses against literal per-token recomputations (values and gradients)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from batcher.engine.losses import DatumLoss, compute_loss, reduce_metrics
from core.errors import InvalidInput
from core.loss_spec import LOSS_FUNCTIONS, LossConfig, parse_loss_config, spec_of

N = 24


def _rl_datum(seed: int = 0, n: int = N) -> tuple[list[float], list[float], list[float]]:
    """Trainer logprobs, sampler logprobs and advantages; ratios spread across 0.8/1.2."""
    gen = torch.Generator().manual_seed(seed)
    lp = (-3 * torch.rand(n, generator=gen, dtype=torch.float64)).tolist()
    slp = [v + 0.4 * float(e) for v, e in zip(lp, torch.randn(n, generator=gen, dtype=torch.float64))]
    adv = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
    return lp, slp, adv


def _run(loss_fn: str, lp: list[float], inputs: dict, config: LossConfig | None = None, **kw):
    lp_T = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    result = compute_loss(loss_fn, lp_T, inputs, config or LossConfig(), **kw)
    result.loss.backward()
    return result, lp_T.grad.tolist()


def _rl_inputs(slp: list[float], adv: list[float], **extra) -> dict:
    return {
        "target_tokens": torch.arange(len(slp)),
        "logprobs": torch.tensor(slp, dtype=torch.float64),
        "advantages": torch.tensor(adv, dtype=torch.float64),
        **extra,
    }


def _assert_close(actual, expected) -> None:
    if isinstance(expected, list):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert a == pytest.approx(e, rel=1e-9, abs=1e-12)
    else:
        assert actual == pytest.approx(expected, rel=1e-9, abs=1e-12)


# --- values and gradients, one loss per test --------------------------------------------------


def test_cross_entropy_matches_literal_sum():
    lp, _, _ = _rl_datum(1)
    weights = [0.0] * 5 + [1.0] * 10 + [0.5, -2.0] + [1.0] * (N - 17)
    inputs = {"target_tokens": torch.arange(N), "weights": torch.tensor(weights)}
    result, grad = _run("cross_entropy", lp, inputs)

    loss, expected_grad = 0.0, []
    for t in range(N):
        loss += -lp[t] * weights[t]
        expected_grad.append(-weights[t])
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)
    assert result.metrics["loss:sum"] == pytest.approx(loss)


def test_cross_entropy_without_weights_is_plain_sum():
    lp, _, _ = _rl_datum(2)
    result, grad = _run("cross_entropy", lp, {"target_tokens": torch.arange(N)})
    _assert_close(result.loss.item(), -sum(lp))
    _assert_close(grad, [-1.0] * N)


def test_importance_sampling_matches_literal():
    lp, slp, adv = _rl_datum(3)
    result, grad = _run("importance_sampling", lp, _rl_inputs(slp, adv))

    loss, expected_grad = 0.0, []
    for t in range(N):
        ratio = math.exp(lp[t] - slp[t])
        loss += -ratio * adv[t]
        expected_grad.append(-ratio * adv[t])  # d ratio / d lp = ratio
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def test_importance_sampling_cap_truncates_value_and_gradient():
    lp, slp, adv = _rl_datum(4)
    cap = 1.1
    result, grad = _run("importance_sampling", lp, _rl_inputs(slp, adv), LossConfig(is_weight_cap=cap))

    loss, expected_grad, n_capped = 0.0, [], 0
    for t in range(N):
        ratio = math.exp(lp[t] - slp[t])
        weight = min(ratio, cap)
        n_capped += ratio > cap
        loss += -weight * adv[t]
        expected_grad.append(-weight * adv[t])  # sg(min(r, C)) · ∇lp
    assert 0 < n_capped < N
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def _literal_stable_reinforce(lp, slp, adv, cap):
    loss, grad, kept = 0.0, [], 0
    for t in range(len(lp)):
        ratio = math.exp(min(lp[t] - slp[t], 700.0))  # past e^700 is past any band
        weight = ratio if 1 / cap <= ratio <= cap else 0.0
        kept += weight > 0
        loss += -weight * adv[t]
        grad.append(-weight * adv[t])  # sg(m · ratio) · ∇lp
    return loss, grad, kept


@pytest.mark.parametrize("cap", [None, 1.3])
def test_stable_reinforce_keeps_the_ratio_inside_its_band(cap):
    lp, slp, adv = _rl_datum(5)
    slp[0], slp[1] = lp[0] - 800.0, lp[1] + 800.0  # ratios that overflow and underflow: outside, no NaN
    result, grad = _run("stable_reinforce", lp, _rl_inputs(slp, adv), LossConfig(is_weight_cap=cap))
    loss, expected_grad, kept = _literal_stable_reinforce(lp, slp, adv, cap or 2.0)
    assert 0 < kept < N - 2
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)
    assert grad[0] == grad[1] == 0.0


def test_stable_reinforce_band_must_hold_one():
    with pytest.raises(InvalidInput) as err:
        parse_loss_config(spec_of("stable_reinforce"), {"is_weight_cap": 0.5})
    assert err.value.field == "loss_fn_config.is_weight_cap" and ">= 1" in str(err.value)
    assert parse_loss_config(spec_of("stable_reinforce"), {"is_weight_cap": 1.0}).is_weight_cap == 1.0
    assert parse_loss_config(spec_of("importance_sampling"), {"is_weight_cap": 0.5}).is_weight_cap == 0.5


def test_gspo_matches_the_documented_token_variant():
    lp, slp, adv = _rl_datum(6)
    mask = [0.0] * 4 + [1.0] * (N - 4)  # the first four positions are the prompt's: outside the ratio
    slp[:4] = [-50.0] * 4  # and their log-ratios would dominate the mean if counted
    lo, hi = 0.97, 1.05
    result, grad = _run("gspo", lp, _rl_inputs(slp, adv, sequence_ratio_mask=torch.tensor(mask)),
                        LossConfig(clip_low_threshold=lo, clip_high_threshold=hi))
    masked = [lp[t] - slp[t] for t in range(N) if mask[t]]
    s = math.exp(sum(masked) / len(masked))
    loss, expected_grad = 0.0, []
    for t in range(N):
        unclipped, clipped = s * adv[t], min(max(s, lo), hi) * adv[t]
        loss += -min(unclipped, clipped)
        # d s_t / d lp_t = s (the token's own gradient); the clipped branch is flat outside [lo, hi]
        expected_grad.append(-s * adv[t] if unclipped <= clipped or lo < s < hi else 0.0)
    assert not lo < s < hi  # the case where clipping decides
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def test_gspo_sequences_of_one_pass_keep_their_own_ratio():
    from batcher.engine.losses import DatumSpec, LossPlan, pass_losses

    specs, lps, expected = [], [], []
    for seed in (7, 8):
        lp, slp, adv = _rl_datum(seed, n=6)
        x = {"logprobs": torch.tensor(slp, dtype=torch.float64), "advantages": torch.tensor(adv, dtype=torch.float64),
             "sequence_ratio_mask": torch.ones(6)}
        specs.append(DatumSpec("gspo", x, 6, 1, LossConfig(clip_low_threshold=0.0, clip_high_threshold=1e9)))
        lps += lp
        s = math.exp(sum(a - b for a, b in zip(lp, slp)) / 6)
        expected.append(-s * sum(adv))
    plan = LossPlan.build(specs)
    out = pass_losses(torch.tensor(lps, dtype=torch.float64).view(-1, 1), plan, plan.tensors)
    _assert_close(out.loss.tolist(), expected)


def test_a_datum_with_nothing_in_its_sequence_ratio_has_ratio_one():
    lp, slp, adv = _rl_datum(9)
    result, _ = _run("gspo", lp, _rl_inputs(slp, adv, sequence_ratio_mask=torch.zeros(N)),
                     LossConfig(clip_low_threshold=0.0, clip_high_threshold=1e9))
    _assert_close(result.loss.item(), -sum(adv))


def _literal_ppo(lp, slp, adv, lo, hi):
    loss, grad, n_clipped = 0.0, [], 0
    for t in range(len(lp)):
        ratio = math.exp(lp[t] - slp[t])
        clipped = min(max(ratio, lo[t]), hi[t])
        unclipped_obj, clipped_obj = ratio * adv[t], clipped * adv[t]
        loss += -min(unclipped_obj, clipped_obj)
        if unclipped_obj <= clipped_obj:
            grad.append(-ratio * adv[t])
        else:  # the clipped branch is chosen; it moves only inside [lo, hi]
            n_clipped += 1
            grad.append(-ratio * adv[t] if lo[t] < ratio < hi[t] else 0.0)
    return loss, grad, n_clipped


def test_ppo_matches_literal_with_config_thresholds():
    lp, slp, adv = _rl_datum(5)
    config = parse_loss_config(spec_of("ppo"), {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    result, grad = _run("ppo", lp, _rl_inputs(slp, adv), config)

    loss, expected_grad, n_clipped = _literal_ppo(lp, slp, adv, [0.7] * N, [1.3] * N)
    assert 0 < n_clipped < N
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def test_ppo_default_thresholds_are_0_8_and_1_2():
    lp, slp, adv = _rl_datum(6)
    result, grad = _run("ppo", lp, _rl_inputs(slp, adv))
    loss, expected_grad, _ = _literal_ppo(lp, slp, adv, [0.8] * N, [1.2] * N)
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def test_ppo_thresholds_from_inputs_override_config():
    lp, slp, adv = _rl_datum(7)
    lo = [0.5 if t % 2 else 0.95 for t in range(N)]
    hi = [1.05 if t % 3 else 2.0 for t in range(N)]
    inputs = _rl_inputs(
        slp,
        adv,
        clip_low_threshold=torch.tensor(lo, dtype=torch.float64),
        clip_high_threshold=torch.tensor(hi, dtype=torch.float64),
    )
    config = LossConfig(clip_low_threshold=0.8, clip_high_threshold=1.2)
    result, grad = _run("ppo", lp, inputs, config)

    loss, expected_grad, n_clipped = _literal_ppo(lp, slp, adv, lo, hi)
    assert 0 < n_clipped < N
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)
    config_only, _, _ = _literal_ppo(lp, slp, adv, [0.8] * N, [1.2] * N)
    assert loss != pytest.approx(config_only)


def test_cispo_matches_literal_and_stops_gradient_through_ratio():
    lp, slp, adv = _rl_datum(8)
    result, grad = _run("cispo", lp, _rl_inputs(slp, adv))

    loss, expected_grad, n_clipped = 0.0, [], 0
    for t in range(N):
        ratio = math.exp(lp[t] - slp[t])
        coefficient = min(max(ratio, 0.8), 1.2)
        n_clipped += coefficient != ratio
        loss += -coefficient * lp[t] * adv[t]
        expected_grad.append(-coefficient * adv[t])  # no d ratio / d lp term
    assert 0 < n_clipped < N
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def test_dro_matches_literal():
    lp, slp, adv = _rl_datum(9)
    beta = 0.3
    result, grad = _run("dro", lp, _rl_inputs(slp, adv), parse_loss_config(spec_of("dro"), {"beta": beta}))

    loss, expected_grad = 0.0, []
    for t in range(N):
        loss += -(lp[t] * adv[t] - 0.5 * beta * (lp[t] - slp[t]) ** 2)
        expected_grad.append(-(adv[t] - beta * (lp[t] - slp[t])))
    _assert_close(result.loss.item(), loss)
    _assert_close(grad, expected_grad)


def test_elementwise_loss_sums_to_loss_and_logprobs_are_returned_detached():
    lp, slp, adv = _rl_datum(10)
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        result, _ = _run(loss_fn, lp, _rl_inputs(slp, adv))
        assert result.outputs["elementwise_loss"].shape == (N,)
        _assert_close(result.outputs["elementwise_loss"].sum().item(), result.loss.item())
        assert not result.outputs["logprobs"].requires_grad
        _assert_close(result.outputs["logprobs"].tolist(), lp)


def test_float32_logprobs_work_with_list_inputs():
    lp_T = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    inputs = {"target_tokens": [1, 2, 3], "logprobs": [-1.1, -0.4, -2.0], "advantages": [1.0, -1.0, 0.5]}
    result = compute_loss("ppo", lp_T, inputs, LossConfig())
    result.loss.backward()
    assert result.loss.dtype == torch.float32
    assert lp_T.grad is not None and torch.isfinite(lp_T.grad).all()


# --- staleness ---------------------------------------------------------------------------------


def test_stale_datum_is_masked_and_counted():
    lp, slp, adv = _rl_datum(11)
    config = LossConfig(max_staleness=2, current_policy_version=10)
    stale, stale_grad = _run("importance_sampling", lp, _rl_inputs(slp, adv), config, policy_version=7)
    fresh, fresh_grad = _run("importance_sampling", lp, _rl_inputs(slp, adv), config, policy_version=8)

    assert stale.loss.item() == 0.0
    assert stale_grad == [0.0] * N
    assert stale.metrics["dropped_stale:sum"] == 1.0
    assert stale.metrics["staleness:max"] == 3.0
    _assert_close(stale.outputs["logprobs"].tolist(), lp)
    assert stale.outputs["elementwise_loss"].tolist() == [0.0] * N

    assert fresh.loss.item() != 0.0
    assert any(g != 0.0 for g in fresh_grad)
    assert fresh.metrics["dropped_stale:sum"] == 0.0
    assert fresh.metrics["staleness:mean"] == 2.0

    request = reduce_metrics([stale, fresh])
    assert request["dropped_stale:sum"] == 1.0
    assert request["staleness:mean"] == 2.5
    assert request["staleness:max"] == 3.0
    _assert_close(request["loss:sum"], fresh.loss.item())


def test_staleness_needs_both_versions_and_max_staleness_to_drop():
    lp, slp, adv = _rl_datum(12)
    no_version, _ = _run("dro", lp, _rl_inputs(slp, adv), LossConfig(max_staleness=0, current_policy_version=5))
    assert "staleness:mean" not in no_version.metrics and "dropped_stale:sum" not in no_version.metrics
    no_limit, _ = _run("dro", lp, _rl_inputs(slp, adv), LossConfig(current_policy_version=50), policy_version=1)
    assert no_limit.metrics["staleness:max"] == 49.0
    assert "dropped_stale:sum" not in no_limit.metrics
    assert no_limit.loss.item() != 0.0


def test_all_datums_dropped_still_backpropagates():
    lp_T = torch.tensor([-1.0, -2.0], requires_grad=True)
    inputs = {"target_tokens": [0, 1], "logprobs": [-1.0, -2.0], "advantages": [1.0, 1.0]}
    config = LossConfig(max_staleness=0, current_policy_version=3)
    result = compute_loss("ppo", lp_T, inputs, config, policy_version=1)
    result.loss.backward()
    assert lp_T.grad.tolist() == [0.0, 0.0]


# --- mismatch metrics --------------------------------------------------------------------------


def test_mismatch_metrics_on_hand_computed_example():
    # Position 0 is a padded prompt token (logprob 0, advantage 0): excluded.
    lp = [-0.3, -1.0, -2.0, -0.5]
    inputs = {
        "target_tokens": [0, 1, 2, 3],
        "logprobs": [0.0, -1.5, -2.0, -0.25],
        "advantages": [0.0, 1.0, 1.0, 1.0],
    }
    result, _ = _run("importance_sampling", lp, inputs)
    # d = lp - slp = 0.5, 0.0, -0.25; k3 = (r - 1) - log r with r = exp(d)
    k3 = [math.exp(0.5) - 1 - 0.5, 0.0, math.exp(-0.25) - 1 + 0.25]
    _assert_close(result.metrics["mismatch_kl:mean"], sum(k3) / 3)
    _assert_close(result.metrics["logprob_diff_abs:mean"], (0.5 + 0.0 + 0.25) / 3)
    assert result.metric_weights["mismatch_kl:mean"] == 3.0


def test_mismatch_mask_uses_weights_when_given():
    lp = [-0.3, -1.0, -2.0]
    inputs = {"target_tokens": [0, 1, 2], "weights": [0.0, 1.0, 0.0], "logprobs": [-0.1, -1.5, -1.0]}
    result, _ = _run("cross_entropy", lp, inputs)
    _assert_close(result.metrics["logprob_diff_abs:mean"], 0.5)
    _assert_close(result.metrics["mismatch_kl:mean"], math.exp(0.5) - 1 - 0.5)
    _assert_close(result.loss.item(), 1.0)


def test_no_mismatch_metrics_without_sampler_logprobs():
    result, _ = _run("cross_entropy", [-1.0, -2.0], {"target_tokens": [0, 1]})
    assert set(result.metrics) == {"loss:sum"}


def test_reduce_metrics_weights_mismatch_by_tokens():
    def datum(loss: float, kl: float, n_tokens: int) -> DatumLoss:
        return DatumLoss(
            loss=torch.tensor(loss),
            outputs={},
            metrics={"loss:sum": loss, "mismatch_kl:mean": kl},
            metric_weights={"mismatch_kl:mean": float(n_tokens)},
        )

    request = reduce_metrics([datum(1.5, 0.1, 1), datum(2.0, 0.4, 3)])
    assert request["loss:sum"] == 3.5
    _assert_close(request["mismatch_kl:mean"], (0.1 * 1 + 0.4 * 3) / 4)
    assert reduce_metrics([]) == {"loss:sum": 0.0}


def test_every_metric_key_has_exactly_one_colon():
    lp, slp, adv = _rl_datum(13)
    config = LossConfig(max_staleness=1, current_policy_version=4, is_weight_cap=2.0)
    results = []
    for loss_fn in LOSS_FUNCTIONS:
        inputs = _rl_inputs(slp, adv) if loss_fn != "cross_entropy" else {
            "target_tokens": torch.arange(N), "logprobs": torch.tensor(slp)}
        for version in (4, 1):
            result, _ = _run(loss_fn, lp, inputs, config, policy_version=version)
            results.append(result)
    keys = set(reduce_metrics(results))
    for result in results:
        keys |= set(result.metrics)
    assert {"loss:sum", "mismatch_kl:mean", "logprob_diff_abs:mean", "staleness:mean",
            "staleness:max", "dropped_stale:sum"} <= keys
    for key in keys:
        assert key.count(":") == 1, key


# --- user errors -------------------------------------------------------------------------------


def test_unknown_loss_fn_is_named():
    with pytest.raises(InvalidInput, match="'nope'.*must be one of.*cross_entropy") as info:
        spec_of("nope")
    assert info.value.field == "loss_fn"
    with pytest.raises(InvalidInput, match="nope"):
        compute_loss("nope", torch.zeros(1), {}, LossConfig())


def test_unknown_config_key_names_key_and_allowed_keys():
    with pytest.raises(InvalidInput, match="'clip_ratio'.*allowed keys: clip_low_threshold") as info:
        parse_loss_config(spec_of("ppo"), {"clip_ratio": 0.2})
    assert info.value.field == "loss_fn_config.clip_ratio"


def test_server_only_config_key_is_rejected():
    with pytest.raises(InvalidInput, match="set by the server") as info:
        parse_loss_config(spec_of("ppo"), {"current_policy_version": 3})
    assert info.value.field == "loss_fn_config.current_policy_version"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"clip_low_threshold": 1.3, "clip_high_threshold": 1.2}, "clip_low_threshold"),
        ({"clip_high_threshold": 0.9}, "clip_high_threshold"),
        ({"clip_low_threshold": float("nan")}, "clip_low_threshold"),
        ({"beta": float("inf")}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"is_weight_cap": -1.0}, "is_weight_cap"),
        ({"is_weight_cap": 0.0}, "is_weight_cap"),
        ({"max_staleness": 1.5}, "max_staleness"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"beta": "0.1"}, "beta"),
        ({"beta": True}, "beta"),
    ],
)
def test_bad_config_values_name_the_key(raw, field):
    with pytest.raises(InvalidInput) as info:
        parse_loss_config(spec_of("dro"), raw)
    assert info.value.field == f"loss_fn_config.{field}"
    assert field in str(info.value)


def test_config_parses_proto_doubles_and_nulls():
    config = parse_loss_config(
        spec_of("importance_sampling"), {"max_staleness": 2.0, "is_weight_cap": None, "beta": 1}
    )
    assert config.max_staleness == 2 and isinstance(config.max_staleness, int)
    assert config.is_weight_cap is None
    assert parse_loss_config(spec_of("ppo"), None) == LossConfig()
    assert LossConfig.from_json(config.to_json()) == config


def test_config_errors_pickle():
    with pytest.raises(InvalidInput) as info:
        parse_loss_config(spec_of("ppo"), {"beta": -1})
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, InvalidInput) and copy.field == "loss_fn_config.beta"
    assert str(copy) == str(info.value) and copy.category == "user"
