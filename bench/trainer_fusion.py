"""Does fusing many tenants' small steps into one pass pay? Measured side by side, in one run.

1. Saturation curve: trained tokens/s of one adapter against tokens per pass (64-token rows).
2. N tenants (1, 2, 4, 8, 16, 32, 64), each submitting one small batch (the under-used regime of an RL step
   on a large accelerator), interleaved repetitions of:
   (a) fused:      one forward/backward over the base for all N adapters (Quilt's trainer),
   (b) sequential: the same work one adapter at a time (what a single-tenant PEFT loop does),
   (c) ceiling:    one adapter over all N tenants' rows (no routing: the best any fused
                   implementation can reach),
   (d) PEFT mixed: the same fused step through PEFT's mixed-adapter forward (`adapter_names=`),
                   the other known way to fuse; Quilt uses the grouped layer of batcher.engine.multilora
                   because this column loses to it.
   2b. The same with tenants bringing different numbers of sequences (1 and 3; 1, 1, 1 and 5),
       where a layer's runs differ in length and take the grouped GEMM instead of batched matmuls.
3. A grid over per-tenant batch sizes at 8 tenants: fusion pays where one tenant's batch leaves the
   hardware under-used and stops paying where one batch already saturates it.
4. A custom loss's cost: 8 tenants of PPO, one of them as an uploaded custom loss (the same PPO,
   `core.custom_loss`, run node by node per datum in its rows of the pass, and never from a
   captured graph), against all 8 on the built-in; interleaved, as a ratio of round times.
   `--only custom` runs this section alone.
5. `--only hybrid`: section 2's fused/sequential and fused/ceiling ratios on a random Qwen3.5 base
   (gated-delta-rule layers, three in four, beside full attention: each packed row's recurrence
   runs from a zero state, batcher.engine.linear_attention) and on the Qwen3 base of the same width
   and depth, side by side in one run.

Model FLOPs utilisation counts 4·P·T per trained token pass (forward 2PT + backward to the
activations 2PT; the base's weight gradients are never computed) against a float32 matmul peak
measured in the same run. Which regime favours fusion: small per-tenant batches (here 64 tokens);
which does not: per-tenant batches that already saturate the machine (512+ tokens here), where
fusion only adds routing overhead.

    python bench/trainer_fusion.py [--quick] [--device cuda --dtype bfloat16 --hidden 4096 --layers 8]

On a GPU (bench/gpu_suite.sh) the same columns are measured on the device; the matmul peak is then
the device's in the base's dtype, and every timing synchronises the device first.

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from batcher import heap  # noqa: E402
from batcher.engine.backend import LoraBackend  # noqa: E402
from batcher.engine.protocol import PassRequest  # noqa: E402
from core import custom_loss  # noqa: E402
from core.loss_spec import LossConfig  # noqa: E402
from core.work import Datum, LoraShape, PassWork  # noqa: E402

TENANTS = (1, 2, 4, 8, 16, 32, 64)
PEFT_UP_TO = 16  # PEFT's mixed batch runs a matmul pair per adapter per layer: 64 tenants take a minute a pass
ROW = 64  # tokens per sequence


def build_base(directory: Path, *, hidden: int, layers: int, vocab: int) -> int:
    """A random-weight Qwen3-architecture base (no tokenizer needed: the bench feeds token ids)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                         intermediate_size=3 * hidden, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def build_hybrid(directory: Path, *, hidden: int, layers: int, vocab: int) -> int:
    """A random-weight Qwen3.5 (text) base of the same width: every fourth layer full attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                               intermediate_size=3 * hidden, linear_num_key_heads=max(1, hidden // 128),
                               linear_num_value_heads=hidden // 64, linear_key_head_dim=64, linear_value_head_dim=64,
                               max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


DEVICE = torch.device("cpu")
DTYPE = torch.float32


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(seconds: float = 2.0) -> float:
    """FLOP/s of a large square matmul on the bench's device and dtype, now."""
    n = 1536 if DEVICE.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=DEVICE, dtype=DTYPE), torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    torch.mm(a, b)
    _sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
        _sync()
    return 2 * n**3 * count / (time.perf_counter() - start)


def datum(seed: int, n: int = ROW) -> Datum:
    g = torch.Generator().manual_seed(seed)
    toks = tuple(torch.randint(0, 4096, (n + 1,), generator=g).tolist())  # ids valid for both model sizes
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def run_pass(be: LoraBackend, work: list[tuple[str, list[Datum]]]) -> None:
    outs = be.run_pass([PassRequest(f"r{i}", m, PassWork("cross_entropy", LossConfig(), tuple(data)), False)
                        for i, (m, data) in enumerate(work)])
    assert all(isinstance(o, dict) for o in outs), outs
    for adapter in be.adapters.values():  # gradients would accumulate; the bench measures passes only
        be.lora.clear_grads(adapter.name)


def _call(name: str, target: str, *args: object, op: str = "call_function") -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


def ppo_graph() -> custom_loss.LossGraph:
    """PPO's clipped objective as the tinker SDK traces it (`create_custom_loss`), by hand: the bench
    needs no SDK."""
    ref = [{"ref": n} for n in ("logprobs", "advantages", "old", "sub", "exp", "clamp", "mul", "mul_1", "minimum",
                                "sum_1")]
    lp, adv, old, sub, exp, clamp, mul, mul_1, minimum, sum_1 = ref
    nodes = [{"op": "placeholder", "name": n, "target": n} for n in ("logprobs", "advantages", "old")] + [
        _call("sub", "operator.sub", lp, old), _call("exp", "torch.exp", sub),
        _call("clamp", "torch.clamp", exp, 0.8, 1.2), _call("mul", "operator.mul", exp, adv),
        _call("mul_1", "operator.mul", clamp, adv), _call("minimum", "torch.minimum", mul, mul_1),
        _call("sum_1", "sum", minimum, op="call_method"), _call("neg", "operator.neg", sum_1),
        {"op": "output", "name": "output", "target": "output",
         "args": [{"tuple": [{"ref": "neg"}, {"dict": {"custom/ratio:sum": {"ref": "sum_1"}}}]}]}]
    inputs = [{"name": n, "rank": 1} for n in ("logprobs", "advantages", "old")]
    return custom_loss.parse("ppo", inputs, {"format": 1, "nodes": nodes})


def ppo_datum(seed: int, custom: bool, n: int = ROW) -> Datum:
    d = datum(seed, n)
    adv = tuple(((-1.0) ** k) * 0.5 for k in range(n))
    old = tuple(-8.0 - 0.01 * k for k in range(n))
    extra = {"advantages": adv, "old": old} if custom else {"advantages": adv, "logprobs": old}
    return Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"], **extra})


def custom_over_builtin(be: LoraBackend, tenants: int, rows: int, reps: int) -> float:
    """Median over interleaved repetitions of (round with tenant 0 on a custom loss) / (all built-in)."""
    graph = ppo_graph()

    def round_of(custom: bool) -> None:
        requests = [PassRequest(f"r{i}", f"t{i}", PassWork(
            "custom" if custom and i == 0 else "ppo", LossConfig(),
            tuple(ppo_datum(1000 * i + j, custom and i == 0) for j in range(rows)),
            custom=graph if custom and i == 0 else None), False) for i in range(tenants)]
        outs = be.run_pass(requests)
        assert all(isinstance(o, dict) for o in outs), outs
        for adapter in be.adapters.values():
            be.lora.clear_grads(adapter.name)

    round_of(True)
    round_of(False)
    ratios = []
    for _ in range(reps):
        builtin = timed(lambda: round_of(False))
        ratios.append(timed(lambda: round_of(True)) / builtin)
    return statistics.median(ratios)


class PeftMixed:
    """PEFT's mixed-adapter batch over its own copy of the base: one forward with a per-row adapter
    name, summed cross-entropy, one backward (PEFT allows `adapter_names` only in eval mode, where
    autograd still gives each adapter its own gradient)."""

    def __init__(self, base_path: str, n: int, rank: int):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=DTYPE).requires_grad_(False).to(DEVICE)
        config = LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj", "lm_head"])
        self.model = get_peft_model(base, config, adapter_name="t0")
        for i in range(1, n):
            self.model.add_adapter(f"t{i}", config)
        self.model.eval()
        for name, p in self.model.named_parameters():
            p.requires_grad_("lora_" in name)

    def step(self, work: list[tuple[str, list[Datum]]]) -> None:
        rows = [(m, d) for m, data in work for d in data]
        T = max(len(d.tokens) for _, d in rows)
        ids = torch.zeros((len(rows), T), dtype=torch.long)
        tgt = torch.zeros((len(rows), T), dtype=torch.long)
        for b, (_, d) in enumerate(rows):
            ids[b, : len(d.tokens)] = torch.tensor(d.tokens)
            tgt[b, : len(d.tokens)] = torch.tensor(d.inputs["target_tokens"])
        logits = self.model(input_ids=ids.to(DEVICE), adapter_names=[m for m, _ in rows]).logits.float()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.to(DEVICE).flatten(), reduction="sum").backward()
        self.model.zero_grad(set_to_none=True)


def measure_modes(be: LoraBackend, sizes: list[int], reps: int,
                  peft: PeftMixed | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of each mode, and the median over repetitions of each mode's time over the
    fused pass's in the same repetition: the modes run interleaved, so a slow spell of this shared
    machine lands in one repetition's pair instead of in one mode's column. `sizes`: each tenant's
    number of sequences."""
    work = [(f"t{i}", [datum(1000 * i + j) for j in range(k)]) for i, k in enumerate(sizes)]
    all_rows = [d for _, data in work for d in data]
    modes = {
        "fused": lambda: run_pass(be, work),
        "sequential": lambda: [run_pass(be, [w]) for w in work],
        "ceiling": lambda: run_pass(be, [("t0", all_rows)]),
    }
    if peft is not None:
        modes["peft"] = lambda: peft.step(work)
    for fn in modes.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(reps):
        for name, fn in modes.items():
            times[name].append(timed(fn))
    over_fused = {k: statistics.median(t / f for t, f in zip(v, times["fused"])) for k, v in times.items()}
    return {k: statistics.median(v) for k, v in times.items()}, over_fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer repetitions (smoke run)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="torch device of the base (cuda on a GPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="base weights' dtype")
    parser.add_argument("--hidden", type=int, help="base width (default 512; --quick 256)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's allocator as it is instead of keeping freed memory in the heap, as the "
                             "trainer does (batcher.heap, QUILT_TRAINER_KEEP_FREED_MEMORY)")
    parser.add_argument("--layers", type=int, help="base depth (default 8; --quick 4)")
    parser.add_argument("--only", choices=["custom", "hybrid"],
                        help="run one section alone (4: a custom loss's cost; 5: a hybrid-attention base)")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = torch.device(args.device), getattr(torch, args.dtype)
    kept_heap = not args.system_malloc and heap.keep_freed_memory()
    hidden, layers, vocab = (256, 4, 4096) if args.quick else (512, 8, 8192)
    hidden, layers = args.hidden or hidden, args.layers or layers
    reps = 2 if args.quick else args.reps

    if args.only == "hybrid":
        print(json.dumps(hybrid_section(hidden, layers, vocab, reps, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        params = build_base(Path(tmp), hidden=hidden, layers=layers, vocab=vocab)
        be = LoraBackend(tmp, max_tokens_per_pass=1 << 20, device=args.device, dtype=DTYPE)
        for i in range(max(TENANTS)):
            be.create(f"t{i}", LoraShape(rank=args.rank, seed=i))
        if args.only == "custom":
            print(json.dumps(custom_section(be, reps, params, args)))
            return
        peak = matmul_peak()
        print(f"base: random Qwen3, {params / 1e6:.1f}M parameters, {torch.get_num_threads()} threads; "
              f"LoRA rank {args.rank} on attention, MLP and lm_head; freed memory kept in the heap: {kept_heap}")
        print(f"{args.dtype} matmul peak on {args.device} measured now: {peak / 1e9:.1f} GFLOP/s\n")

        def mfu(tokens: int, seconds: float) -> float:
            return 4 * params * tokens / seconds / peak

        # 1. saturation curve
        print("1. one adapter: trained tokens/s against tokens per pass")
        print(f"{'tokens/pass':>12} {'tokens/s':>10} {'of best':>8} {'MFU':>6}")
        curve = {}
        for rows in (1, 2, 4, 8, 16, 32):
            work = [("t0", [datum(j) for j in range(rows)])]
            run_pass(be, work)
            t = statistics.median(timed(lambda: run_pass(be, work)) for _ in range(reps))
            curve[rows * ROW] = (rows * ROW / t, t)
        best = max(v[0] for v in curve.values())
        for tokens, (tps, t) in curve.items():
            print(f"{tokens:>12} {tps:>10.0f} {tps / best:>8.0%} {mfu(tokens, t):>6.1%}")

        # 2. tenants
        print(f"\n2. N tenants x one {ROW}-token sequence each (trained tokens/s: median of {reps}, interleaved; "
              f"ratios: median of the {reps} repetitions' own ratios; PEFT mixed up to {PEFT_UP_TO} tenants)")
        print(f"{'tenants':>8} {'fused':>9} {'sequential':>11} {'ceiling':>9} {'PEFT mixed':>11} "
              f"{'fused/seq':>10} {'fused/ceil':>11} {'fused/PEFT':>11} {'MFU fused':>10}")
        headline = {}
        peft = PeftMixed(tmp, PEFT_UP_TO, args.rank)
        for n in TENANTS:
            t, over_fused = measure_modes(be, [1] * n, reps, peft if n <= PEFT_UP_TO else None)
            tokens = n * ROW
            tps = {k: tokens / v for k, v in t.items()}
            row = (over_fused["sequential"], over_fused["ceiling"], mfu(tokens, t["fused"]),
                   over_fused.get("peft", float("nan")))
            headline[n] = row
            print(f"{n:>8} {tps['fused']:>9.0f} {tps['sequential']:>11.0f} {tps['ceiling']:>9.0f} "
                  f"{tps.get('peft', float('nan')):>11.0f} "
                  f"{row[0]:>10.2f} {row[1]:>11.2f} {row[3]:>11.2f} {row[2]:>10.1%}")
        del peft

        # 2b. tenants bringing different row counts: the layer gathers per-row weights instead
        print(f"\n2b. tenants with different batch sizes ({ROW}-token sequences; the grouped path)")
        print(f"{'tenants':>8} {'sequences each':>24} {'fused/seq':>10} {'fused/ceil':>11}")
        mixed = {}
        for sizes in ([1, 3] * 4, [1, 1, 1, 5] * 4):
            _, over_fused = measure_modes(be, sizes, reps)
            mixed[len(sizes)] = (over_fused["sequential"], over_fused["ceiling"])
            print(f"{len(sizes):>8} {','.join(map(str, sizes[:4])) + ' ...':>24} {mixed[len(sizes)][0]:>10.2f} "
                  f"{mixed[len(sizes)][1]:>11.2f}")

        # 3. grid at 8 tenants
        print("\n3. 8 tenants, per-tenant batch size: where fusion pays")
        print(f"{'tokens/tenant':>14} {'fused/seq':>10} {'fused/ceil':>11} {'MFU fused':>10}")
        grid = {}
        for rows in (1, 2, 4, 8):
            t, over_fused = measure_modes(be, [rows] * 8, max(2, reps // 2))
            tokens = 8 * rows * ROW
            grid[rows * ROW] = (over_fused["sequential"], over_fused["ceiling"], mfu(tokens, t["fused"]))
            g = grid[rows * ROW]
            print(f"{rows * ROW:>14} {g[0]:>10.2f} {g[1]:>11.2f} {g[2]:>10.1%}")

        custom = custom_section(be, reps, params, args)

    print(json.dumps({
        **custom,
        "device": args.device, "dtype": args.dtype, "parameters": params, "kept_heap": kept_heap,
        "fused_over_sequential_8": round(headline[8][0], 3),
        "fused_over_ceiling_8": round(headline[8][1], 3),
        "fused_over_sequential_16": round(headline[16][0], 3),
        "fused_over_ceiling_16": round(headline[16][1], 3),
        "fused_over_ceiling_32": round(headline[32][1], 3),
        "fused_over_ceiling_64": round(headline[64][1], 3),
        "fused_over_sequential_64": round(headline[64][0], 3),
        "fused_over_ceiling_mixed_8": round(mixed[8][1], 3),
        "fused_over_ceiling_mixed_16": round(mixed[16][1], 3),
        "mfu_fused_8": round(headline[8][2], 4),
        "fused_over_peft_mixed_8": round(headline[8][3], 3),
        "tenant_tokens": ROW,
        "saturation_64_over_best": round(curve[ROW][0] / best, 3),
        "grid_fused_over_sequential": {str(k): round(v[0], 3) for k, v in grid.items()},
    }))


def custom_section(be: LoraBackend, reps: int, params: int, args: argparse.Namespace) -> dict:
    """4. one custom-loss tenant among 8, against all built-in."""
    print(f"\n4. 8 tenants of PPO ({ROW}-token sequences), one as an uploaded custom loss: round time over "
          f"all built-in (median of {reps} interleaved ratios)")
    print(f"{'sequences each':>15} {'custom/built-in':>16}")
    figures = {}
    for rows in (1, 4):
        figures[rows] = custom_over_builtin(be, 8, rows, reps)
        print(f"{rows:>15} {figures[rows]:>16.3f}")
    return {"custom_over_builtin_8": round(figures[1], 3), "custom_over_builtin_8x4": round(figures[4], 3),
            "device": args.device, "parameters": params}


def hybrid_section(hidden: int, layers: int, vocab: int, reps: int, args: argparse.Namespace) -> dict:
    """5. N tenants x one sequence on a hybrid-attention base and on a full-attention one."""
    sizes = (1, 2, 4, 8, 16)
    ratios: dict[str, dict[int, tuple[float, float]]] = {}
    params = {}
    for kind, build in (("qwen3", build_base), ("qwen3_5", build_hybrid)):
        with tempfile.TemporaryDirectory() as tmp:
            params[kind] = build(Path(tmp), hidden=hidden, layers=layers, vocab=vocab)
            be = LoraBackend(tmp, max_tokens_per_pass=1 << 20, device=args.device, dtype=DTYPE)
            for i in range(max(sizes)):
                be.create(f"t{i}", LoraShape(rank=args.rank, seed=i))
            ratios[kind] = {}
            for n in sizes:
                _, over_fused = measure_modes(be, [1] * n, reps)
                ratios[kind][n] = (over_fused["sequential"], over_fused["ceiling"])
    print(f"\n5. N tenants x one {ROW}-token sequence, fused against one tenant at a time: Qwen3 "
          f"({params['qwen3'] / 1e6:.1f}M) and Qwen3.5 hybrid attention ({params['qwen3_5'] / 1e6:.1f}M), "
          f"hidden {hidden}, {layers} layers (median of {reps} interleaved ratios)")
    print(f"{'tenants':>8} {'Qwen3 fused/seq':>16} {'Qwen3.5 fused/seq':>18} {'Qwen3 fused/ceil':>17} "
          f"{'Qwen3.5 fused/ceil':>19}")
    for n in sizes:
        a, b = ratios["qwen3"][n], ratios["qwen3_5"][n]
        print(f"{n:>8} {a[0]:>16.2f} {b[0]:>18.2f} {a[1]:>17.2f} {b[1]:>19.2f}")
    return {"section": "hybrid", "device": args.device, "dtype": args.dtype, "hidden": hidden, "layers": layers,
            "parameters": params, "tenant_tokens": ROW,
            "fused_over_sequential": {k: {str(n): round(v[0], 3) for n, v in r.items()} for k, r in ratios.items()},
            "fused_over_ceiling": {k: {str(n): round(v[1], 3) for n, v in r.items()} for k, r in ratios.items()}}


if __name__ == "__main__":
    main()
