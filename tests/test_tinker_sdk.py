"""The official tinker SDK, unchanged, trains against a running embedded Quilt: the current
release (0.38.0) here, and the older one users pin in tests/test_tinker_sdk_pinned.py."""

from __future__ import annotations

import io
import os
import tarfile
import urllib.request

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinkerutil import RestClient, ready, rest_client, sft_data  # noqa: E402

TINY = "quilt/tiny-qwen3"


def test_the_expected_sdk_release_is_the_one_imported():
    expected = os.environ.get("QUILT_EXPECT_TINKER")
    assert tinker.__version__ == (expected or "0.38.0"), tinker.__file__


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _is_data(tc) -> list:
    toks = list(range(300, 313))
    fwd = tc.forward(sft_data()[:1], "cross_entropy").result()
    sampler_lp = fwd.loss_fn_outputs[0]["logprobs"].tolist()
    return [types.Datum(model_input=types.ModelInput.from_ints(list(range(40, 56))),
                        loss_fn_inputs={"target_tokens": list(range(41, 57)),
                                        "logprobs": sampler_lp, "advantages": [1.0] * 8 + [-0.5] * 8})], toks


def test_training_flow_through_the_official_sdk(stack, tenant):
    adam = types.AdamParams(learning_rate=1e-2)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        caps = service.get_server_capabilities()
        assert TINY in [m.model_name for m in caps.supported_models]

        tc = ready(service.create_lora_training_client(base_model=TINY, rank=8))
        assert tc.get_info().model_data.model_name == TINY
        tokenizer = tc.get_tokenizer()  # loaded offline from the path the server names
        assert tokenizer.decode(tokenizer.encode("alice has 3 apples")).strip() == "alice has 3 apples"

        losses = []
        for _ in range(5):
            fb = tc.forward_backward(sft_data(), "cross_entropy")
            opt = tc.optim_step(adam)
            out = fb.result()
            opt.result()
            assert len(out.loss_fn_outputs) == 4 and out.loss_fn_outputs[0]["logprobs"].shape == [16]
            losses.append(out.metrics["loss:sum"])
        assert losses[-1] < 0.7 * losses[0], losses

        data, _ = _is_data(tc)
        is_out = tc.forward_backward(data, "importance_sampling").result()
        assert "loss:sum" in is_out.metrics and "mismatch_kl:mean" in is_out.metrics
        ppo = tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
        assert "loss:sum" in ppo.metrics
        tc.optim_step(adam).result()

        saved = tc.save_state("ckpt-1").result()
        assert saved.path == f"tinker://{tc.model_id}/weights/ckpt-1"
        at_save = tc.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]

        restored = ready(service.create_training_client_from_state_with_optimizer(saved.path))
        assert restored.model_id != tc.model_id
        assert restored.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-6)

        rest = rest_client(stack, tenant.key)
        ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert [c.tinker_path for c in ckpts] == [saved.path]
        runs = rest.list_training_runs().result().training_runs
        assert {tc.model_id, restored.model_id} <= {r.training_run_id for r in runs}
        info = rest.get_weights_info_by_tinker_path(saved.path).result()
        assert info.base_model == TINY and info.lora_rank == 8
        rest.delete_checkpoint_from_tinker_path(saved.path).result()
        assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_checkpoint_ttls_through_the_official_sdk(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        saved = tc.save_state("short-lived", ttl_seconds=3600).result()
        rest = rest_client(stack, tenant.key)
        (ckpt,) = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert ckpt.expires_at is not None
        rest.set_checkpoint_ttl_from_tinker_path(saved.path, None).result()
        (ckpt,) = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert ckpt.expires_at is None
        rest.set_checkpoint_ttl_from_tinker_path(saved.path, 7200).result()
        (ckpt,) = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert ckpt.expires_at is not None


def test_a_refused_call_does_not_stall_the_official_sdk(stack, tenant):
    # The tinker SDK never reuses a seq_id: the server must not wait for the refused one.
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        with pytest.raises(tinker.NotFoundError):
            tc.load_state(f"tinker://{tc.model_id}/weights/never-saved").result()
        with pytest.raises(tinker.BadRequestError):
            tc.save_state("not a valid name!").result()
        out = tc.forward_backward(sft_data(), "cross_entropy").result(timeout=120)
        assert len(out.loss_fn_outputs) == 4


def test_custom_loss_runs_through_forward_and_cross_entropy(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))

        def loss_fn(data, logprobs_list):
            total = sum(-lp.sum() for lp in logprobs_list)
            return total, {"custom:sum": float(total.detach())}

        out = tc.forward_backward_custom(sft_data()[:2], loss_fn).result()
        assert "custom:sum" in out.metrics


def test_tenant_sees_only_its_own_runs(stack):
    a, b = stack.create_tenant("ta"), stack.create_tenant("tb")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=a.key) as service_a:
        tc = service_a.create_lora_training_client(base_model=TINY, rank=4)
        path = tc.save_state("mine").result().path
    with tinker.ServiceClient(base_url=stack.base_url, api_key=b.key) as service_b:
        rest = rest_client(stack, b.key)
        assert tc.model_id not in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
        with pytest.raises(tinker.NotFoundError):
            rest.list_checkpoints(tc.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            rest.get_weights_info_by_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            ready(service_b.create_training_client_from_state(path))


def test_sampling_through_the_official_sdk(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        tc.forward_backward(sft_data(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = ready(tc.save_weights_and_get_sampling_client())
        prompt = types.ModelInput.from_ints([40, 41, 42, 43])
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
        out = sampler.sample(prompt, 3, params).result()
        assert len(out.sequences) == 3
        for seq in out.sequences:
            assert len(seq.tokens) == 6 and seq.stop_reason == "length"
            assert seq.logprobs is not None and len(seq.logprobs) == 6
        logprobs = sampler.compute_logprobs(prompt).result()
        assert logprobs[0] is None and len(logprobs) == 4 and all(lp <= 0 for lp in logprobs[1:])

        # Top-k prompt logprobs come back through the SDK's protobuf decoding.
        scored = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
        topk = scored.topk_prompt_logprobs
        assert topk[0] is None and len(topk) == 4 and all(len(row) == 3 for row in topk[1:])
        assert all(row[0][1] >= row[1][1] >= row[2][1] for row in topk[1:])

        named = tc.save_weights_for_sampler("s1").result().path
        assert named == f"tinker://{tc.model_id}/sampler_weights/s1"
        from_path = ready(service.create_sampling_client(model_path=named))
        assert len(from_path.sample(prompt, 1, params).result().sequences) == 1
        base = ready(service.create_sampling_client(base_model=TINY))
        assert len(base.sample(prompt, 2, params).result().sequences) == 2


# The trainer (torch + PEFT) and the sampler (vLLM) agree on logprobs within this (tests/test_sampling_stack.py).
LOGPROB_TOL = 1e-3


def _trainer_scores(tc, tokens: list[int], ids):
    """The trainer's logprob of ids[i][j] after tokens[:i + 1] (top-K targets, [len(tokens), K]);
    a cell of -1 is scored as token 0 with weight 0 and not compared."""
    import torch

    ids = torch.as_tensor(ids, dtype=torch.int64)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(ids.clamp(min=0)),
        "weights": types.TensorData.from_torch((ids >= 0).float())})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()


def test_sampling_outputs_through_the_official_sdk(stack, tenant):
    """topk_sample_logprobs, target_prompt_logprobs (dense and sparse CSR), prompt_alt_tokens_k and
    record_stability_info through the SDK's own request and protobuf decoding, every number checked
    against the trainer's logprob of the same token in the same context."""
    import torch

    prompt = [40, 41, 42, 43, 44, 45, 46, 47]
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        tc.forward_backward(sft_data(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = ready(tc.save_weights_and_get_sampling_client(record_stability_info=True))
        plain = ready(tc.save_weights_and_get_sampling_client())  # the same weights, nothing recorded
        ids = torch.full((len(prompt) - 1, 3), -1, dtype=torch.int64)
        ids[0, 0], ids[3] = 7, torch.tensor([300, 44, 2])  # row i scores prompt position i + 1
        ids[6, 2] = 999
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11, stop=[])
        dense = sampler.sample(types.ModelInput.from_ints(prompt), 2, params, include_prompt_logprobs=True,
                               topk_sample_logprobs=3, target_prompt_logprobs=types.TensorData.from_torch(ids),
                               prompt_alt_tokens_k=4).result()
        sparse_in = types.TensorData.from_torch_sparse(ids, pad_value=-1)
        assert sparse_in.sparse_crow_indices is not None  # the SDK did send CSR
        sparse = plain.sample(types.ModelInput.from_ints(prompt), 1, params,
                              target_prompt_logprobs=sparse_in).result()

        trainer = _trainer_scores(tc, prompt[:-1], ids)
        got = dense.target_prompt_logprobs.to_torch()
        assert got.shape == ids.shape and bool((got[ids < 0] == 0).all())
        assert (got - trainer)[ids >= 0].abs().max().item() < LOGPROB_TOL
        # The prompt's own token, named as a target, is the same number as its prompt logprob.
        assert abs(got[3, 1].item() - dense.prompt_logprobs[4]) < 1e-5
        assert sparse.target_prompt_logprobs.sparse_crow_indices == sparse_in.sparse_crow_indices
        assert torch.allclose(sparse.target_prompt_logprobs.to_torch(), got, atol=1e-5)

        alt_tokens = dense.prompt_alt_tokens.tokens.to_torch()
        alt_lps = dense.prompt_alt_tokens.logprobs.to_torch()
        assert alt_tokens.shape == alt_lps.shape == (len(prompt) - 1, 4)
        assert (alt_lps - _trainer_scores(tc, prompt[:-1], alt_tokens)).abs().max().item() < LOGPROB_TOL
        assert len({tuple(r) for r in alt_tokens.tolist()}) > 1  # drawn, not one token repeated everywhere

        for seq in dense.sequences:
            topk = seq.topk_logprobs
            assert len(topk) == len(seq.tokens) == 5 and all(len(row) == 3 for row in topk)
            assert all(row[0][1] >= row[1][1] >= row[2][1] for row in topk)
            context = prompt + seq.tokens[:-1]
            ids_k = torch.full((len(context), 3), -1, dtype=torch.int64)
            ids_k[len(prompt) - 1:] = torch.tensor([[t for t, _ in row] for row in topk])
            trainer_k = _trainer_scores(tc, context, ids_k)[len(prompt) - 1:]
            assert (torch.tensor([[lp for _, lp in row] for row in topk]) - trainer_k).abs().max().item() < LOGPROB_TOL

            record = stack.http(tenant.key).get(f"/sampled_sequences/{seq.sequence_id}/stability")
            assert record.status_code == 200, record.text
            body = record.json()
            assert (body["tokens"], body["prompt_length"], body["policy_version"]) == (seq.tokens, len(prompt), 1)
            assert max(abs(a - b) for a, b in zip(body["logprobs"], seq.logprobs, strict=True)) < 1e-6
            assert [[t for t, _ in row] for row in body["topk_logprobs"]] == [[t for t, _ in row] for row in topk]
        other = stack.create_tenant("stability-other")
        seq_id = dense.sequences[0].sequence_id
        assert stack.http(other.key).get(f"/sampled_sequences/{seq_id}/stability").status_code == 404
        # Sampled by a client without record_stability_info: nothing recorded.
        assert stack.http(tenant.key).get(f"/sampled_sequences/{sparse.sequences[0].sequence_id}/stability"
                                          ).status_code == 404


@pytest.mark.skipif(not hasattr(RestClient, "get_checkpoint_archive_url"),
                    reason="tinker 0.38 has no get_checkpoint_archive_url (save_weights_external replaces it)")
def test_checkpoint_archive_through_the_official_sdk(stack, tenant, tmp_path):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        tc.forward_backward(sft_data(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_state("to-download").result().path
    rest = rest_client(stack, tenant.key)
    archive = rest.get_checkpoint_archive_url_from_tinker_path(path).result()
    assert tenant.key not in archive.url
    with urllib.request.urlopen(archive.url, timeout=60) as response:
        data = response.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = {m.name.split("/")[-1] for m in tar.getmembers()}
        tar.extractall(tmp_path, filter="data")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "optimizer.pt" not in names
    from peft import PeftConfig

    (top,) = tmp_path.iterdir()
    assert PeftConfig.from_pretrained(str(top)).r == 4
