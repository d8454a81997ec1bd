"""Weights out, as the cookbook takes them: `weights.download` of a training checkpoint (an
age-encrypted external export, decrypted on the way down), then `build_hf_model` (the adapter merged
into the base) and `build_lora_adapter` (a PEFT adapter). The merged model must say what Quilt's own
sampler says, and the PEFT adapter what the merged model says."""

from __future__ import annotations

import tinker
import torch
from recipes import CHAT, RENDERER, TINY
from tinker_cookbook import renderers, weights
from tinker_cookbook.tokenizer_utils import get_tokenizer
from transformers import AutoModelForCausalLM


def _next_token_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_downloaded_weights_merge_and_convert_to_what_quilt_samples(cookbook, sft_run, tiny_path, tmp_path):
    adapter = weights.download(tinker_path=sft_run.final_state, output_dir=str(tmp_path / "adapter"))
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) >= ["adapter_config.json",
                                                                       "adapter_model.safetensors"]
    weights.build_hf_model(base_model=tiny_path, adapter_path=adapter, output_path=str(tmp_path / "merged"),
                           dtype="float32")
    weights.build_lora_adapter(base_model=tiny_path, adapter_path=adapter, output_path=str(tmp_path / "peft"))

    tokenizer = get_tokenizer(TINY)
    prompt = renderers.get_renderer(RENDERER, tokenizer).build_generation_prompt(CHAT[0][:1]).to_ints()
    tokens = prompt + tokenizer.encode(CHAT[0][1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]

    with tinker.ServiceClient(base_url=cookbook) as service:
        sampler = service.create_sampling_client(model_path=sft_run.final_sampler)
        quilt = torch.tensor(sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()[1:])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    merged_lp = _next_token_logprobs(merged, tokens)

    from peft import PeftModel

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                                     tmp_path / "peft")
    peft_lp = _next_token_logprobs(peft, tokens)
    with peft.disable_adapter():
        base_lp = _next_token_logprobs(peft, tokens)

    gap_sampler = (merged_lp - quilt).abs().max().item()
    gap_peft = (peft_lp - merged_lp).abs().max().item()
    print(f"weights: merged vs Quilt's sampler {gap_sampler:.2e}, PEFT adapter vs merged {gap_peft:.2e} "
          f"(max |logprob| difference over {len(tokens) - 1} tokens)")
    assert gap_sampler < 1e-3 and gap_peft < 1e-4
    # The trained weights, not the base: the lesson is far likelier than under the base.
    answer = slice(len(prompt) - 1, None)
    assert merged_lp[answer].mean() > base_lp[answer].mean() + 2
