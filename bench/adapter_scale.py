"""Many adapters on one trainer, and what publishing sampler weights every step costs it.

1. 1,024 training models on one trainer (bench model: the fusion bench's 33.6 M random Qwen3,
   rank 8 on every projection): idle ones parked on the offload device with their AdamW state,
   64 of them in one fused pass. Printed: the bookkeeping (resident / parked), bytes per resident
   and per parked adapter (weights, gradients, AdamW moments), the time of the 64-model pass with
   its adapters parked before it against the same pass with them resident, and the time to bring
   one parked adapter back.
2. Publication: 4 tenants, each step = one fused forward_backward + an optim_step and a
   save_weights_for_sampler per tenant (rank 32), as quilt.rl and the cookbook do, the trainer at
   most two steps ahead of the sampler (async RL). Side by side: the files written in the
   trainer's loop (as before batcher.exports) and off it (as batcher.worker does now). Printed:
   the share of the trainer's busy time spent exporting (in the loop: the writes; off it: taking
   the tensors, and any wait of an optim_step for its model's write), the trainer's step time, and
   publish-to-first-token p50/p95: from the start of the export to the first token sampled with
   the new version by the real engine (gen_pool.engine) while it is busy with four long rollouts.
   Which regime favours writing off the loop: many tenants per pass (each pass no longer waits for
   every tenant's files); which does not: one tenant that samples right after each save, which
   waits for its files either way.

On a CPU-only machine the offload device is the host too, so parking moves nothing (only the
bookkeeping); the bytes a GPU would copy are printed instead. Which regime favours this design:
many tenants with small steps (RL), where one pass serves many adapters; which does not: a tenant
whose own batch fills the device, which gains nothing from sharing it.

    python bench/adapter_scale.py [--quick]

Ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import asyncio
import collections
import concurrent.futures
import itertools
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from batcher.engine.backend import LoraBackend  # noqa: E402
from batcher.engine.protocol import PassRequest  # noqa: E402
from batcher.exports import Exports  # noqa: E402
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


def train_once(be: LoraBackend, model_ids: list[str], seed: int, before_step=None) -> None:
    """One fused forward_backward over these models, then an optim_step each (AdamW state exists),
    each step after `before_step(model_id)` when given."""
    outs = be.run_pass([PassRequest(f"r{m}", m, PassWork("cross_entropy", LossConfig(), (datum(seed + i),)), False)
                        for i, m in enumerate(model_ids)])
    assert all(isinstance(o, dict) for o in outs), outs
    for m in model_ids:
        if before_step is not None:
            before_step(m)
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


def _trainer(be: LoraBackend, tenants: list[str], steps: int, root: Path, tag: str, background: bool,
             publish, gate: threading.Semaphore) -> dict:
    """The trainer's side of the RL loop (a thread): per step one fused forward_backward, an
    optim_step and a save_weights_for_sampler per tenant, as batcher.worker runs them: inline, or
    with the files written by batcher.exports while the loop goes on (an optim_step waits for its
    model's export). `gate` keeps it at most two steps ahead of the sampler (async RL)."""
    exports = Exports() if background else None
    busy_s = export_s = 0.0

    def wait_for_export(model_id: str) -> None:
        nonlocal export_s
        w0 = time.perf_counter()
        exports.wait_for(model_id)
        export_s += time.perf_counter() - w0

    for step in range(steps):
        gate.acquire()
        t0 = time.perf_counter()
        train_once(be, tenants, 100 * step, wait_for_export if exports is not None else None)
        if exports is not None:
            exports.finished()  # the worker answers these saves here; the sampler side waits on their futures
        for m in tenants:
            e0 = time.perf_counter()
            path = root / f"{tag}-{m}-v{step}"
            if exports is not None:
                written = exports.start(m, be.export(m, str(path), overwrite=False, with_optimizer=False), None).future
            else:
                be.save(m, str(path), overwrite=False, with_optimizer=False)
                written = concurrent.futures.Future()
                written.set_result(0)
            export_s += time.perf_counter() - e0
            publish((m, path, e0, written))
        busy_s += time.perf_counter() - t0
    if exports is not None:
        exports.close()
    return {"busy_s": busy_s, "export_s": export_s}


async def publication(be: LoraBackend, engine, tenants: list[str], root: Path, steps: int, *, background: bool,
                      tag: str) -> dict:
    """Run the trainer thread against the real engine, which is kept busy with four long rollouts;
    each published version is loaded once written and timed from the export's start to its first
    sampled token."""
    from gen_pool.engine import SeqRequest

    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()
    gate = threading.Semaphore(2)
    trainer = loop.run_in_executor(None, _trainer, be, tenants, steps, root, tag, background,
                                   lambda item: loop.call_soon_threadsafe(arrived.put_nowait, item), gate)
    busy_spec = SamplingSpec(max_tokens=400, eos_stops=False)

    async def keep_busy(k: int) -> None:
        for n in itertools.count():
            await engine.generate(SeqRequest(f"bg-{tag}-{k}-{n}", (5, 6, 7), busy_spec, k))

    background_work = [asyncio.create_task(keep_busy(k)) for k in range(4)]
    first_token: list[float] = []
    answered = collections.Counter()

    async def first_token_of(n: int, m: str, path: Path, e0: float, written, step: int) -> None:
        # Each tenant samples on its own: the versions of one step are loaded side by side.
        await asyncio.wrap_future(written)
        ref = AdapterRef(key=str(path), path=str(path), model_id=m, name=m)
        await engine.load(ref)
        await engine.generate(SeqRequest(f"p-{tag}-{n}", (5, 6, 7), SamplingSpec(max_tokens=1), None, ref))
        first_token.append(time.perf_counter() - e0)
        answered[step] += 1
        if answered[step] == len(tenants):
            gate.release()

    measuring = []
    try:
        for n in range(steps * len(tenants)):
            got = asyncio.ensure_future(arrived.get())
            await asyncio.wait([got, trainer], return_when=asyncio.FIRST_COMPLETED)
            if not got.done():  # the trainer stopped early: say why
                got.cancel()
                await trainer
                raise RuntimeError("the trainer thread ended before publishing every version")
            m, path, e0, written = got.result()
            measuring.append(asyncio.create_task(first_token_of(n, m, path, e0, written, n // len(tenants))))
        times = await trainer
        await asyncio.gather(*measuring)
    finally:
        for task in background_work:
            task.cancel()
        await asyncio.gather(*background_work, return_exceptions=True)
    first_token.sort()
    return {"steps": steps, "export_share_of_busy": times["export_s"] / times["busy_s"],
            "export_ms_per_publish": 1000 * times["export_s"] / (steps * len(tenants)),
            "step_ms": 1000 * times["busy_s"] / steps,
            "publish_to_first_token_ms_p50": 1000 * statistics.median(first_token),
            "publish_to_first_token_ms_p95": 1000 * first_token[max(0, int(0.95 * len(first_token)) - 1)]}


async def publications(tmp: str, root: Path, steps: int) -> dict[str, dict]:
    """Both ways, side by side on one engine: the files written in the loop, and off it."""
    from core.settings import GenPoolSettings
    from gen_pool.engine import GenEngine

    be = LoraBackend(tmp, max_tokens_per_pass=1 << 20)
    tenants = [f"t{i}" for i in range(4)]
    for i, t in enumerate(tenants):
        be.create(t, LoraShape(rank=32, seed=i))
    engine = await GenEngine.start(tmp, GenPoolSettings(max_loras=6, max_cpu_loras=64, max_lora_rank=32,
                                                        concurrency_target=16, max_model_len=512), root / "work")
    try:
        await publication(be, engine, tenants, root, 2, background=True, tag="warm")  # first loads, first passes
        return {"inline": await publication(be, engine, tenants, root, steps, background=False, tag="inline"),
                "background": await publication(be, engine, tenants, root, steps, background=True, tag="bg")}
    finally:
        engine.shutdown()


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
        pubs = asyncio.run(publications(base, root, steps))
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
    pub = pubs["background"]
    print(f"\n2. publication: 4 tenants x {pub['steps']} steps, each forward_backward + optim_step + "
          "save_weights_for_sampler (rank 32); files written in the trainer's loop / off it (batcher.exports)")
    print(f"  {'':<42}{'in the loop':>14}{'off the loop':>14}")
    for label, key, fmt in (("export share of trainer busy time", "export_share_of_busy", "{:.1%}"),
                            ("trainer time exporting, per publish (ms)", "export_ms_per_publish", "{:.1f}"),
                            ("trainer step, 4 tenants (ms)", "step_ms", "{:.0f}"),
                            ("publish-to-first-token p50 (ms)", "publish_to_first_token_ms_p50", "{:.0f}"),
                            ("publish-to-first-token p95 (ms)", "publish_to_first_token_ms_p95", "{:.0f}")):
        print(f"  {label:<42}{fmt.format(pubs['inline'][key]):>14}{fmt.format(pub[key]):>14}")
    print(json.dumps({"models": many["models"], "in_pass": many["in_pass"], "bytes_per_adapter": many["bytes_resident"],
                      "pass_parked_over_resident": round(many["pass_parked_s"] / many["pass_resident_s"], 3),
                      "bring_back_us": round(1e6 * many["bring_back_s"], 1),
                      "export_share_of_busy": round(pub["export_share_of_busy"], 4),
                      "export_share_of_busy_inline": round(pubs["inline"]["export_share_of_busy"], 4),
                      "step_ms_over_inline": round(pub["step_ms"] / pubs["inline"]["step_ms"], 3),
                      "publish_to_first_token_ms_p95": round(pub["publish_to_first_token_ms_p95"], 1),
                      "publish_to_first_token_ms_p95_inline": round(pubs["inline"]["publish_to_first_token_ms_p95"], 1)}))


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
