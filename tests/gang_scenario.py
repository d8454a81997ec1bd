"""Four tenants x three steps on one backend: the trainer gang tests run it on a single process and
on a gang (`python -m torch.distributed.run --nproc-per-node N tests/gang_scenario.py BASE PARALLEL OUT`),
whose rank 0 saves what it saw for the test to compare (and alone reads and writes checkpoints)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from bases import architectures
from batcher.engine import dispatch, gang
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.errors import InvalidInput, UserError
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.01, "grad_clip_norm": 1.0}


def _datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n}, None)


def _is_datum(start: int, n: int) -> Datum:
    toks = tuple(range(start, start + n + 1))
    return Datum(toks[:-1], {"target_tokens": toks[1:], "logprobs": tuple(-1.0 - 0.01 * i for i in range(n)),
                             "advantages": tuple(0.5 - 0.1 * (i % 7) for i in range(n))}, None)


def specs(config: dict, *, experts: bool = True) -> dict:
    """Different ranks, module groups, losses, learning rates and clipping, within what the base
    can carry (no lm_head LoRA where vLLM or tied embeddings refuse it; no MLP LoRA on a MoE base
    whose gang splits each expert, `experts=False`)."""
    can = {**architectures.supported_switches(config), **({} if experts else {"train_mlp": False})}
    mlp = {} if can["train_mlp"] else {"train_mlp": False}
    head = {} if can["train_unembed"] else {"train_unembed": False}
    return {
        "t1": ({"rank": 4, "seed": 11, **mlp, **head}, {**ADAM, "grad_clip_norm": 0.0}, "cross_entropy",
               [_datum(3, 12)]),
        "t2": ({"rank": 8, "seed": 12, "train_mlp": False, **head}, {**ADAM, "learning_rate": 3e-3},
               "importance_sampling", [_is_datum(20, 7), _is_datum(90, 20)]),
        "t3": ({"rank": 16, "seed": 13, "train_unembed": False, **mlp}, {**ADAM, "learning_rate": 2e-2,
                                                                        "grad_clip_norm": 0.5},
               "cross_entropy", [_datum(200, 16)]),
        "t4": ({"rank": 8, "seed": 14, "train_attn": False, "train_mlp": can["train_mlp"],
                "train_unembed": can["train_unembed"]}, {**ADAM, "weight_decay": 0.1},
               "cross_entropy", [_datum(400, 5), _datum(500, 9), _datum(600, 3)]),
    }


def run(backend, workdir: Path, *, experts: bool = True) -> dict:
    """The scenario: three fused rounds of four tenants, an AdamW step each, a round of t1's one row, then t1 saved and
    loaded into a new model "t1-copy", and t3 snapshotted and restored into "t3-restored". Returns
    every datum's loss outputs, each round's gradients before its steps (as this rank holds them:
    `_rank_grads`) and pass stats, then each
    adapter's whole weights and AdamW moments."""
    plan = specs(backend.config, experts=experts)
    for model_id, (lora, _, _, _) in plan.items():
        backend.create(model_id, LoraShape(**lora))
    outputs, grads, stats = [], [], []
    # Three rounds of all four tenants, then one of t1's single row (fewer rows than a gang's ranks).
    for round_plan in (plan, plan, plan, {"t1": plan["t1"]}):
        outs = backend.run_pass([PassRequest(m, m, PassWork(loss, LossConfig(), tuple(data)), False)
                                 for m, (_, _, loss, data) in round_plan.items()])
        assert all(isinstance(o, dict) for o in outs), outs
        outputs.append([o["loss_fn_outputs"] for o in outs])
        stats.append(backend.last_pass)
        grads.append({m: _rank_grads(backend, m) for m in round_plan})
        for model_id, (_, adam, _, _) in round_plan.items():
            backend.optim_step(model_id, AdamParams(**adam))
    backend.save("t1", str(workdir / "t1"), overwrite=True)
    backend.create("t1-copy", LoraShape(**plan["t1"][0]))
    backend.load("t1-copy", str(workdir / "t1"), optimizer=True)
    # A snapshot (a gang's: each rank's shares through torch.distributed.checkpoint), restored.
    backend.snapshot("t3", str(workdir / "t3-snapshot"))
    backend.create("t3-restored", LoraShape(**plan["t3"][0]))
    backend.load_snapshot("t3-restored", str(workdir / "t3-snapshot"))
    models = [*plan, "t1-copy", "t3-restored"]
    adapters = {m: backend.adapter_state(m) for m in models}
    moments = {m: backend.optimizer_state(m)["state"] for m in models}
    return {"outputs": outputs, "grads": grads, "stats": stats, "adapters": adapters, "moments": moments}


def overflow(backend) -> dict:
    """A pass where one of t2's two datums overflows (a float32 weight of 1e39) beside t3's good one:
    t2 fails naming its data and keeps no gradient, t3 is answered and keeps its own (a data-parallel
    pair computes t2's good datum on rank 0, its bad one and t3's on rank 1). Returns what a test compares."""
    bad = _datum(30, 6)
    bad = Datum(bad.tokens, {**bad.inputs, "weights": (1e39,) * 6}, None)
    outs = backend.run_pass([PassRequest("bad", "t2", PassWork("cross_entropy", LossConfig(), (_datum(50, 12), bad)), False),
                             PassRequest("good", "t3", PassWork("cross_entropy", LossConfig(), (_datum(70, 10),)), False)])
    failed, answered = outs
    assert isinstance(failed, UserError) and failed.field == "forward_backward_input.data", failed
    assert isinstance(answered, dict), answered
    return {"failed": (type(failed).__name__, failed.field), "message": str(failed), "answered": answered["loss_fn_outputs"],
            "t2_pending": backend.lora.pending(backend.adapters["t2"].name), "t3_grads": _whole_grads(backend, "t3")}


def _rank_grads(backend, model_id: str) -> list[tuple[torch.Tensor, int | None, int, int]]:
    """The model's accumulated gradients as this rank holds them: each with the axis its layer's split
    splits it along (None: whole), this rank's index in the split and the split's count."""
    name = backend.adapters[model_id].name
    return [(g.clone(), axis, split.index if axis is not None else 0, split.count if axis is not None else 1)
            for g, (split, axis) in zip(backend.lora.grad_rows(name), backend.lora.shares(name), strict=True)]


def _whole_grads(backend, model_id: str) -> list[torch.Tensor] | None:
    """The model's accumulated gradients, where every rank holds them whole (one process, FSDP);
    None where a tensor-parallel gang splits them."""
    name = backend.adapters[model_id].name
    if any(split is not None for split, _ in backend.lora.shares(name)):
        return None
    return [g.clone() for g in backend.lora.grad_rows(name)]


def main() -> None:
    base, parallel, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    member = gang.join(gang.GangShape(int(os.environ["WORLD_SIZE"]), parallel), "cpu")
    dispatches = [0]  # how many MoE blocks' tokens this rank dispatched to their experts' ranks (an "ep" gang's)
    dispatch_run = dispatch.run

    def counted(*args, **kwargs):
        dispatches[0] += 1
        return dispatch_run(*args, **kwargs)

    dispatch.run = counted
    backend = LoraBackend(base, dtype=torch.float64, member=member)
    if member.leader:
        leader = gang.lead(backend, member)
        if backend.experts_refused:  # a tensor-parallel gang on a MoE base: LoRA on its experts is refused
            try:
                backend.create("on-experts", LoraShape(rank=4, seed=1))
                raise AssertionError("a tensor-parallel gang created LoRA on split experts")
            except InvalidInput as exc:
                assert exc.field == "lora_config.train_mlp" and "expert-parallel" in str(exc), exc
        result = run(backend, out.parent, experts=not backend.experts_refused)
        result["overflow"] = overflow(backend)
        leader.close()
        # how much of the base this rank holds (a DTensor's local share, a plain tensor whole)
        result["dispatches"] = dispatches[0]
        result["held"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                             for p in backend.base.parameters())
        torch.save(result, out)
    else:
        gang.follow(backend, member)
    gang.leave()


if __name__ == "__main__":
    main()
