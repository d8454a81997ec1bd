"""Helpers for generation-pool tests: PEFT adapters with random weights, and the torch+PEFT
recomputation of logprobs that vLLM's answers are checked against."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_adapter(base_path: str, out_dir: Path, *, rank: int, seed: int, scale: float = 0.05,
                 steps: int | None = None) -> str:
    """A PEFT LoRA on every projection and lm_head, with random A and B (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_MODULES,
                                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(str(out_dir), save_embedding_layers=False)
    if steps is not None:
        (out_dir / "quilt_state.json").write_text(json.dumps({"steps": steps}))
    return str(out_dir)


class Reference:
    """torch + PEFT on the same base: logprobs of given continuations, per adapter."""

    def __init__(self, base_path: str):
        from transformers import AutoModelForCausalLM

        self.base_path = base_path
        self.base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
        self._peft: dict[str, object] = {}

    def model(self, adapter_path: str | None):
        if adapter_path is None:
            return self.base
        if adapter_path not in self._peft:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=torch.float32)
            self._peft[adapter_path] = PeftModel.from_pretrained(base, adapter_path).eval()
        return self._peft[adapter_path]

    @torch.no_grad()
    def token_logprobs(self, adapter_path: str | None, tokens: list[int]) -> list[float]:
        """logprob of tokens[i] given tokens[:i], for i >= 1."""
        ids = torch.tensor([tokens])
        logits = self.model(adapter_path)(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        return [lp[i - 1, tokens[i]].item() for i in range(1, len(tokens))]

    @torch.no_grad()
    def prompt_topk(self, adapter_path: str | None, tokens: list[int], k: int) -> list[list[tuple[int, float]]]:
        """At each position i >= 1: the k most likely tokens given tokens[:i], most likely first."""
        logits = self.model(adapter_path)(input_ids=torch.tensor([tokens])).logits[0].float()
        values, indices = torch.log_softmax(logits, dim=-1)[:-1].topk(k, dim=-1)
        return [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(indices, values, strict=True)]

    def continuation_logprobs(self, adapter_path: str | None, prompt: list[int], completion: list[int]) -> list[float]:
        return self.token_logprobs(adapter_path, list(prompt) + list(completion))[len(prompt) - 1:]


class Loop:
    """An asyncio loop on a thread, so sync tests can drive the async engine."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
