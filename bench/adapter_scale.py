"""Many adapters on one trainer, and what publishing sampler weights every step costs it.

1. 1,024 training models on one trainer (bench model: the fusion bench's 33.6 M random Qwen3,
   rank 8 on every projection): idle ones parked on the offload device with their AdamW state,
   64 of them in one fused pass. Printed: the bookkeeping (resident / parked), bytes per resident
   and per parked adapter (weights, gradients, AdamW moments), the time of the 64-model pass with
   its adapters parked before it against the same pass with them resident, and the time to bring
   one parked adapter back.
2. Publication: 4 tenants, each step = one fused forward_backward + an optim_step and a
   save_weights_for_sampler per tenant (rank 32), as quilt.rl and the cookbook do. Printed: the
   share of the trainer's busy time spent exporting, and publish-to-first-token p50/p95: from the
   start of the export to the first token sampled with the new version by the real engine
   (gen_pool.engine) while it is busy with the other tenants' rollouts.

On a CPU-only machine the offload device is the host too, so parking moves nothing (only the
bookkeeping); the bytes a GPU would copy are printed instead. Which regime favours this design:
many tenants with small steps (RL), where one pass serves many adapters; which does not: a tenant
whose own batch fills the device, which gains nothing from sharing it.

    python bench/adapter_scale.py [--quick]

Ends with one JSON line.
"""

from __future__ import annotations

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

import torch  # noqa: E402

from batcher.backend import LoraBackend, PassRequest  # noqa: E402
from bench.table import print_rows  # noqa: E402
from bench.trainer_fusion import build_base, datum, run_pass  # noqa: E402
from core.loss_spec import LossConfig  # noqa: E402
from core.work import AdamParams, AdapterRef, LoraShape, PassWork, SamplingSpec  # noqa: E402

ADAM = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0)


def adapter_bytes(be: LoraBackend, model_id: str) -> dict[str, int]:
    a = be.adapters[model_id]
    weights = sum(p.numel() * p.element_size() for p in a.params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in a.params if p.grad is not None)
    moments = sum(v.numel() * v.element_size() for s in a.optimizer.state.values() for k, v in s.items()
                  if torch.is_tensor(v) and k != "step")
    return {"weights": weights, "grads": grads, "adam": moments}


def train_once(be: LoraBackend, model_ids: list[str], seed: int) -> None:
    """One fused forward_backward over these models, then an optim_step each (AdamW state exists)."""
    outs = be.run_pass([PassRequest(f"r{m}", m, PassWork("cross_entropy", LossConfig(), (datum(seed + i),)), False)
                        for i, m in enumerate(model_ids)])
    assert all(isinstance(o, dict) for o in outs), outs
    for m in model_ids:
        be.optim_step(m, ADAM)


def many_models(tmp: str, n_models: int, in_pass: int) -> dict:
    be = LoraBackend(tmp, max_tokens_per_pass=1 << 20)
    t0 = time.perf_counter()
    for i in range(n_models):
        be.create(f"m{i}", LoraShape(rank=8, seed=i))
    created_s = time.perf_counter() - t0
    ids = [f"m{i}" for i in range(n_models)]
    for start in range(0, n_models, in_pass):
        train_once(be, ids[start:start + in_pass], start)
    sizes = adapter_bytes(be, "m0")
    work = [(m, [datum(10_000 + i)]) for i, m in enumerate(ids[::n_models // in_pass][:in_pass])]
    run_pass(be, work)  # warm-up
    times: dict[str, list[float]] = {"parked": [], "resident": []}
    for _ in range(3):
        be.offload_idle(0.0)
        times["parked"].append(_timed(lambda: run_pass(be, work)))
        times["resident"].append(_timed(lambda: run_pass(be, work)))
    be.offload_idle(0.0)
    residency = be.residency()
    back = _timed(lambda: be.ensure_resident(["m5"]))
    return {"models": n_models, "in_pass": in_pass, "created_s": created_s, "residency": residency,
            "bytes_resident": sum(sizes.values()), "bytes_parked": sum(sizes.values()), "sizes": sizes,
            "pass_parked_s": statistics.median(times["parked"]), "pass_resident_s": statistics.median(times["resident"]),
            "bring_back_s": back}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def publication(tmp: str, root: Path, steps: int) -> dict:
    from gen_pool.engine import GenEngine, SeqRequest
    from gen_pool.settings import GenPoolSettings

    be = LoraBackend(tmp, max_tokens_per_pass=1 << 20)
    tenants = [f"t{i}" for i in range(4)]
    for i, t in enumerate(tenants):
        be.create(t, LoraShape(rank=32, seed=i))
    engine = await GenEngine.start(tmp, GenPoolSettings(max_loras=6, max_cpu_loras=64, max_lora_rank=32,
                                                        concurrency_target=16, max_model_len=512), root / "work")
    busy_spec = SamplingSpec(max_tokens=400, eos_stops=False)
    busy_s = export_s = 0.0
    first_token: list[float] = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            train_once(be, tenants, 100 * step)
            compute = time.perf_counter() - t0
            exports = []
            for t in tenants:
                e0 = time.perf_counter()
                path = root / f"{t}-v{step}"
                be.save(t, str(path), overwrite=False, with_optimizer=False)
                exports.append((t, path, e0, time.perf_counter() - e0))
            step_export = sum(x[3] for x in exports)
            busy_s += compute + step_export
            export_s += step_export
            # The sampler is busy with long rollouts of the previous versions while the new ones arrive.
            background = [asyncio.create_task(engine.generate(SeqRequest(f"bg-{step}-{k}", (5, 6, 7), busy_spec, k)))
                          for k in range(4)]
            for t, path, e0, _ in exports:
                ref = AdapterRef(key=str(path), path=str(path), model_id=t, name=t)
                await engine.load(ref)
                await engine.generate(SeqRequest(f"p-{step}-{t}", (5, 6, 7), SamplingSpec(max_tokens=1), None, ref))
                first_token.append(time.perf_counter() - e0)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    finally:
        engine.shutdown()
    first_token.sort()
    return {"steps": steps, "export_share_of_busy": export_s / busy_s, "export_ms_per_publish":
            1000 * export_s / (steps * len(tenants)), "publish_to_first_token_ms_p50": 1000 * statistics.median(first_token),
            "publish_to_first_token_ms_p95": 1000 * first_token[max(0, int(0.95 * len(first_token)) - 1)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 models, fewer steps (a smoke run)")
    args = ap.parse_args()
    n_models, steps = (256, 3) if args.quick else (1024, 10)
    root = Path(tempfile.mkdtemp(prefix="adapter-scale-"))
    try:
        params = build_base(root / "base", hidden=512, layers=8, vocab=8192)
        base = str(root / "base")
        _with_tokenizer(base)
        many = many_models(base, n_models, 64)
        pub = asyncio.run(publication(base, root, steps))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = 2**20
    print(f"base: random Qwen3, {params / 1e6:.1f} M parameters; rank-8 adapters on every projection\n")
    print(f"1. {many['models']:,} models on one trainer, {many['in_pass']} in one pass")
    rows = [("created", f"{many['created_s']:.1f} s"),
            ("resident / parked after offload", f"{many['residency']['resident']} / {many['residency']['offloaded']}"),
            ("bytes per adapter (weights / grads / AdamW)",
             " / ".join(f"{many['sizes'][k] / mib:.2f} MiB" for k in ("weights", "grads", "adam"))),
            ("bytes per resident adapter", f"{many['bytes_resident'] / mib:.2f} MiB"),
            ("bytes per parked adapter (on the offload device)", f"{many['bytes_parked'] / mib:.2f} MiB"),
            (f"{many['in_pass']}-model pass, adapters parked first", f"{1000 * many['pass_parked_s']:.0f} ms"),
            (f"{many['in_pass']}-model pass, adapters resident", f"{1000 * many['pass_resident_s']:.0f} ms"),
            ("bring one parked adapter back (this host)", f"{1e6 * many['bring_back_s']:.0f} us"),
            ("... on a GPU: host-to-device bytes at 25 GB/s", f"{many['bytes_parked'] / 25e9 * 1e3:.2f} ms")]
    print_rows(rows, indent="  ")
    print(f"\n2. publication: 4 tenants x {pub['steps']} steps, each forward_backward + optim_step + "
          "save_weights_for_sampler (rank 32)")
    rows = [("export share of trainer busy time", f"{pub['export_share_of_busy']:.1%}"),
            ("export per publish", f"{pub['export_ms_per_publish']:.1f} ms"),
            ("publish-to-first-token p50", f"{pub['publish_to_first_token_ms_p50']:.0f} ms"),
            ("publish-to-first-token p95", f"{pub['publish_to_first_token_ms_p95']:.0f} ms")]
    print_rows(rows, indent="  ")
    print(json.dumps({"models": many["models"], "in_pass": many["in_pass"], "bytes_per_adapter": many["bytes_resident"],
                      "pass_parked_over_resident": round(many["pass_parked_s"] / many["pass_resident_s"], 3),
                      "bring_back_us": round(1e6 * many["bring_back_s"], 1),
                      "export_share_of_busy": round(pub["export_share_of_busy"], 4),
                      "publish_to_first_token_ms_p95": round(pub["publish_to_first_token_ms_p95"], 1)}))


def _with_tokenizer(base: str) -> None:
    """vLLM needs a tokenizer beside the weights; the tiny model's (ids below its vocabulary) fits."""
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    tiny = Path(base).parent / "tokenizer-source"
    build_tiny_model(tiny, spec=TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=1,
                                              num_key_value_heads=1, head_dim=64, intermediate_size=64))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, Path(base) / name)
    if not (Path(base) / "generation_config.json").exists():
        shutil.copy(tiny / "generation_config.json", Path(base) / "generation_config.json")


if __name__ == "__main__":
    main()
