"""Publish-to-first-token on a real-size architecture: how long after a trainer publishes a new
adapter version does the generation pool answer with it, while busy with other tenants' work?

Builds a random-weight base of a preset shape (`qwen3-8b`: Qwen3-8B's published shape, bfloat16,
vocabulary padded to 151,936; `tiny`: the fill benchmark's model), starts the real engine
(gen_pool.engine), keeps it busy with four tenants' long rollouts, then writes TRIALS new adapter
versions (rank 32 on every projection, as a trainer's save_weights_for_sampler leaves them: a new
directory each) and times each from the write to its first sampled token. No restart in between.
The baseline a user would otherwise run is restarting the sampler on the new weights; its cost,
the engine start, is printed beside it.

    python bench/first_token.py [--preset qwen3-8b] [--trials 5]       (bench/gpu_suite.sh runs it)

Which regime favours this: large bases, where a restart costs a minute or more; which does not:
none measured, but with many new versions per second the LoRA slots churn and the figure grows.
Ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.genpool_fill import (  # noqa: E402
    BENCH_SPEC,
    MODULES,
    make_scheduler,
    publish_latency,
    run_pool,
    submit,
)
from bench.table import print_rows  # noqa: E402
from core.settings import GenPoolSettings  # noqa: E402
from core.work import AdapterRef, SamplingSpec  # noqa: E402
from gen_pool.adapters import header_adapter  # noqa: E402
from gen_pool.engine import GenEngine  # noqa: E402
from gen_pool.scheduler import Group  # noqa: E402
from stack.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402

PRESETS = {
    "tiny": BENCH_SPEC,
    "qwen3-8b": {"hidden_size": 4096, "num_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "max_position_embeddings": 8192,
                 "pad_vocab_to": 151936, "dtype": "bfloat16", "initializer_range": 0.02},
}
RANK = 32


async def first_token_cold(engine: GenEngine, ref: AdapterRef) -> float:
    done: list[Group] = []
    sched, futures = make_scheduler(engine, 8, 0, done)
    stop = asyncio.Event()
    pool = asyncio.create_task(run_pool(sched, stop))
    t0 = time.perf_counter()
    await submit(sched, futures, Group(request_id="cold", tenant_id="t", prompt=(5, 6, 7), n=1,
                                       spec=SamplingSpec(max_tokens=1), adapter=ref, model_id="m0"))
    elapsed = time.perf_counter() - t0
    stop.set()
    sched.wake()
    await pool
    return elapsed


async def main_async(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="first-token-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        info = build_tiny_model(root / "base", spec=TinyModelSpec(**PRESETS[args.preset]))
        built_s = time.perf_counter() - t0
        paths = [header_adapter(info.path, root / f"adapter-{i}", rank=RANK, modules=tuple(MODULES), seed=i,
                                scale=0.01) for i in range(5)]
        settings = GenPoolSettings(max_loras=8, max_cpu_loras=16, max_lora_rank=RANK, concurrency_target=32,
                                   max_model_len=2048)
        t0 = time.perf_counter()
        engine = await GenEngine.start(info.path, settings, root / "work")
        start_s = time.perf_counter() - t0
        refs = [AdapterRef(key=p, path=p, model_id=f"m{i}", name=f"t{i}") for i, p in enumerate(paths[:-1])]
        for r in refs:
            await engine.load(r)
        cold = await first_token_cold(engine, refs[0])
        lat = await publish_latency(engine, refs, paths[-1], root, args.trials)
        engine.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    p50 = statistics.median(lat)
    rows = [("base", f"{args.preset}: {info.num_parameters / 1e6:,.1f} M parameters, built in {built_s:.0f} s"),
            ("engine start (the restart baseline)", f"{start_s:.1f} s"),
            ("first token, loaded adapter, idle engine", f"{1000 * cold:.0f} ms"),
            (f"publish-to-first-token while busy, p50 of {len(lat)}", f"{1000 * p50:.0f} ms"),
            ("publish-to-first-token while busy, max", f"{1000 * max(lat):.0f} ms"),
            ("restart / publish", f"{start_s / p50:.0f}x")]
    print_rows(rows)
    return {"preset": args.preset, "parameters": info.num_parameters, "engine_start_s": round(start_s, 1),
            "publish_to_first_token_ms_p50": round(1000 * p50, 1), "publish_to_first_token_ms_max":
            round(1000 * max(lat), 1), "restart_over_publish": round(start_s / p50, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where the base is built (needs 17 GB for qwen3-8b)")
    print(json.dumps(asyncio.run(main_async(ap.parse_args()))))


if __name__ == "__main__":
    main()
