"""LoRA on a MoE base's experts: Quilt's fused pass against what a user would run instead.

A random-weight Qwen3-MoE shape made on the device (no weights file). For each (tenants N, tokens
T), every tenant brings one sequence of T tokens and trains LoRA of rank r on attention and every
expert; measured interleaved, one forward and backward each (cross-entropy):
  fused       one pass for all N adapters (batcher.engine.expert_lora: grouped over (slot, expert)),
  sequential  one Quilt pass per tenant, one after another,
  peft        PEFT's own MoE LoRA (`target_parameters` on the fused experts) on the same base, one
              tenant after another (what a single-tenant PEFT trainer on transformers 5 does),
  attention   the fused pass with LoRA on attention only (the price of the experts' LoRA).
Ratios are medians of each repetition's own ratio.

Which regime favours fusion: many tenants with short sequences (each expert then sees a few
tokens of each tenant, and one grouped GEMM covers them all); which does not: one tenant, where
the fused pass only adds sorting by (slot, expert). PEFT's adapter shares one A between gate and
up (vLLM's "3D" MoE format) and applies the LoRA by adding B @ A to each expert's weight in every
forward, which costs E x (2I + H) x H multiply-adds per layer whatever the tokens; Quilt's adds
work per routed token only. The two parametrisations differ slightly (PEFT: 2r(H + I) + rI per
expert for gate/up/down at rank r; Quilt, as vLLM's per-expert format: 3r(H + I)).

    python bench/expert_lora.py                                   (CPU: the tiny shape)
    python bench/expert_lora.py --device cuda --dtype bfloat16 --shape 30b-a3b-8l

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import json
import statistics
import tempfile
from pathlib import Path

import torch
from fused_step import datum, grid_parser, interleaved, run, sync, sync_check  # noqa: E402

from batcher.engine.backend import LoraBackend  # noqa: E402
from core.work import LoraShape  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, head dim, experts, experts per token, expert width, vocabulary
    "tiny": (512, 4, 8, 4, 64, 16, 4, 256, 4096),
    "30b-a3b-8l": (2048, 8, 32, 4, 128, 128, 8, 768, 151936),  # Qwen3-30B-A3B's layer shape, 8 of its 48 layers
}


def build(shape: str, device: torch.device, dtype: torch.dtype, directory: Path) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, layers, heads, kv, head_dim, experts, top_k, width, vocab = SHAPES[shape]
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv, head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k,
                            moe_intermediate_size=width, intermediate_size=4 * width, max_position_embeddings=8192,
                            tie_word_embeddings=False)
    config.save_pretrained(directory)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3MoeForCausalLM(config).to(dtype).eval()


def peft_model(directory: Path, device, dtype, rank: int):
    """The same random base under PEFT's MoE LoRA, one adapter (the single-tenant baseline)."""
    from peft import LoraConfig, get_peft_model

    base = build(directory.name, device, dtype, directory)  # (the directory is named after the shape)
    config = LoraConfig(r=rank, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(base, config)
    for name, p in model.named_parameters():  # B = 0 would let PEFT's merge skip nothing, but train as Quilt does
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=1e-3)
    return model


def peft_step(model, sequences: list[list[int]]) -> None:
    for toks in sequences:  # one tenant after another
        x = torch.tensor([toks], device=next(model.parameters()).device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
        loss.backward()
        model.zero_grad(set_to_none=True)


def main() -> None:
    args = grid_parser(__doc__, SHAPES, tenants="1,4,8", tokens="64,256", reps=3, rank=8).parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vocab = SHAPES[args.shape][-1]
    tenants = args.tenants
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / args.shape
        base = build(args.shape, device, dtype, directory)
        be = LoraBackend(directory, device=args.device, dtype=dtype, model=base)
        attention = LoraBackend(directory, device=args.device, dtype=dtype, model=build(args.shape, device, dtype,
                                                                                       Path(tmp) / "attention"))
        for i in range(max(tenants)):
            be.create(f"t{i}", LoraShape(rank=args.rank, seed=i, train_unembed=False))
            attention.create(f"t{i}", LoraShape(rank=args.rank, seed=i, train_mlp=False, train_unembed=False))
        peft = peft_model(Path(tmp) / args.shape, device, dtype, args.rank)
        for n in tenants:
            for tokens in args.tokens:
                work = [(f"t{i}", [datum(1000 * i + tokens, tokens, vocab)]) for i in range(n)]
                sequences = [list(d.tokens) + [d.inputs["target_tokens"][-1]] for _, ds in work for d in ds]
                modes = {"fused": lambda: run(be, work), "sequential": lambda: [run(be, [w]) for w in work],
                         "peft": lambda: peft_step(peft, sequences), "attention": lambda: run(attention, work)}
                times = interleaved(device, modes, args.reps)
                over = {k: statistics.median(t / f for f, t in zip(times["fused"], v))
                        for k, v in times.items() if k != "fused"}
                row = {"tenants": n, "tokens": tokens, "fused_s": statistics.median(times["fused"]),
                       **{f"{k}_over_fused": round(v, 3) for k, v in over.items()}}
                rows.append(row)
                print(f"N={n:3d} T={tokens:4d}  fused {row['fused_s'] * 1e3:8.1f} ms   sequential/fused "
                      f"{over['sequential']:.2f}   peft/fused {over['peft']:.2f}   attention-only/fused "
                      f"{over['attention']:.2f}", flush=True)
        synchronised = sync_check(be, device, vocab)
        print(f"host synchronisation in a fused pass with expert LoRA: {synchronised}")
        sync(device)
    widest = max(rows, key=lambda r: (r["tenants"], -r["tokens"]))
    single = min(rows, key=lambda r: (r["tenants"], r["tokens"]))
    print(json.dumps({"bench": "expert_lora", "shape": args.shape, "device": args.device, "dtype": args.dtype,
                      "rank": args.rank, "rows": rows, "sync": synchronised,
                      "headline": {"tenants": widest["tenants"], "tokens": widest["tokens"],
                                   "sequential_over_fused": widest["sequential_over_fused"],
                                   "peft_over_fused": widest["peft_over_fused"],
                                   "attention_only_over_fused": widest["attention_over_fused"],
                                   "one_tenant_peft_over_quilt": single["peft_over_fused"]}}))


if __name__ == "__main__":
    main()
