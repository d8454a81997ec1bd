"""What the base's dtype does to trainer-sampler agreement: the mismatch metrics clients see
(`mismatch_kl:mean`, `logprob_diff_abs:mean` of an importance-sampling forward over sampled tokens),
for every pairing of trainer and sampler dtype, measured in one run on the real engine.

An adapter is trained 3 steps (float32 adapter and AdamW state, as always), published, and sampled
by vLLM with the base in float32 and in bfloat16; the trainer, with its base in float32 and in
bfloat16, scores the same tokens. Numbers are for a random-weight tiny base on CPU (AVX-512 bf16);
a real bf16 model on GPU shows the same kind of gap. Which regime favours float32 everywhere:
this one (agreement to ~1e-6); bfloat16 halves memory and is what GPUs run, at a mismatch that
importance-sampling corrections must then absorb.

    python bench/precision.py [--architecture qwen3] [--samples 8] [--tokens 32]

Ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bases import architectures  # noqa: E402
from batcher.engine.backend import LoraBackend  # noqa: E402
from batcher.engine.protocol import PassRequest  # noqa: E402
from core.loss_spec import LossConfig  # noqa: E402
from core.work import AdamParams, AdapterRef, Datum, LoraShape, PassWork, SamplingSpec  # noqa: E402
from stack.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402

PROMPT = (5, 6, 7, 8, 9, 10)
DTYPES = ("float32", "bfloat16")
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=1.0)


def _sft(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--architecture", default="qwen3")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    import asyncio

    from core.settings import GenPoolSettings
    from gen_pool.engine import GenEngine, SeqRequest

    root = Path(tempfile.mkdtemp(prefix="precision-"))
    base = build_tiny_model(root / "base", spec=TinyModelSpec(architecture=args.architecture)).path
    trainer = LoraBackend(base)
    trainer.create("m", LoraShape(rank=8, seed=5, **architectures.supported_switches(trainer.config)))
    for step in range(3):
        trainer.run_pass([PassRequest("t", "m", PassWork("cross_entropy", LossConfig(),
                                                         (_sft(20 + 7 * step, 24), _sft(300, 16))), False)])
        trainer.optim_step("m", ADAM)
    adapter = root / "adapter"
    trainer.save("m", str(adapter), overwrite=False)
    ref = AdapterRef(key=str(adapter), path=str(adapter), model_id="m", name="m")

    sampled: dict[str, list] = {}
    for dtype in DTYPES:
        async def run(dtype=dtype):
            engine = await GenEngine.start(base, GenPoolSettings(max_loras=2, max_lora_rank=16, concurrency_target=16,
                                                                 max_model_len=256, dtype=dtype), root / f"w-{dtype}")
            try:
                await engine.load(ref)
                spec = SamplingSpec(max_tokens=args.tokens, temperature=1.0, eos_stops=False)
                return await asyncio.gather(*(engine.generate(SeqRequest(f"{dtype}-{i}", PROMPT, spec, i, ref))
                                              for i in range(args.samples)))
            finally:
                engine.shutdown()
        sampled[dtype] = asyncio.run(run())

    scorers = {"float32": trainer}
    bf16 = LoraBackend(base, dtype=torch.bfloat16)
    bf16.create("m", LoraShape.from_json(trainer.adapters["m"].lora_config))
    bf16.load("m", str(adapter), optimizer=True)
    scorers["bfloat16"] = bf16

    print(f"{args.architecture}: {args.samples} samples x {args.tokens} tokens; adapter float32 in every case\n")
    print(f"{'trainer':>9} {'sampler':>9} {'logprob_diff_abs:mean':>22} {'mismatch_kl:mean':>17}")
    table = {}
    for sampler_dtype, results in sampled.items():
        data = []
        for r in results:
            toks = PROMPT + r.tokens
            n = len(toks) - 1
            pad = len(PROMPT) - 1
            data.append(Datum(toks[:-1], {"target_tokens": toks[1:], "logprobs": (0.0,) * pad + r.logprobs,
                                          "advantages": (0.0,) * n, "weights": (0.0,) * pad + (1.0,) * len(r.tokens)}))
        for trainer_dtype, be in scorers.items():
            out = be.run_pass([PassRequest("s", "m", PassWork("importance_sampling", LossConfig(), tuple(data)), True)])[0]
            m = out["metrics"]
            table[f"{trainer_dtype}/{sampler_dtype}"] = {"logprob_diff_abs_mean": m["logprob_diff_abs:mean"],
                                                         "mismatch_kl_mean": m["mismatch_kl:mean"]}
            print(f"{trainer_dtype:>9} {sampler_dtype:>9} {m['logprob_diff_abs:mean']:>22.2e} {m['mismatch_kl:mean']:>17.2e}")
    print(json.dumps({"architecture": args.architecture, "trainer/sampler": table}))


if __name__ == "__main__":
    main()
