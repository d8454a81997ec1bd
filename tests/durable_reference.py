"""The uninterrupted run that a crashed-and-recovered one must equal (tests of durable training).

Three steps of one rank-8 adapter (seed 0) on fixed data, run in-process on the same base. A
saved checkpoint of the recovered run is compared with it per tensor, to RELATIVE. The tests make
the same run over HTTP: `calls_before` the crash, `calls_after` it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from stackutil import ADAM as BASE_ADAM
from stackutil import datum, fb_body

from batcher.engine.backend import LoraBackend
from checkpoints.layout import ADAPTER_WEIGHTS, OPTIMIZER_FILE
from core.work import AdamParams, Datum, LoraShape, PassWork

SEQS = ([5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 30, 40, 50, 60])
ADAM = {**BASE_ADAM, "learning_rate": 1e-4, "eps": 1e-8}  # a LoRA learning rate, AdamW's default eps
# How close "equal" is. Alone, the replayed run matches the reference to 1e-6. When other tests'
# models are replayed too, the replayed passes fuse with theirs, float32 sums over a different
# batch round differently, and Adam carries that into the zero-initialised lora_B tensors (nothing
# but updates): up to 1.5e-5 relative was measured. A lost or doubled step differs by 0.3 or more.
RELATIVE = 1e-4


def _datum(tokens: list[int]) -> Datum:
    return Datum(tuple(tokens[:-1]), {"target_tokens": tuple(tokens[1:]), "weights": (1.0,) * (len(tokens) - 1)})


def reference(base_path: str) -> tuple[dict, dict]:
    """(adapter weights, AdamW state dict) after the three steps, uninterrupted."""
    from batcher.engine.protocol import PassRequest
    from core.loss_spec import LossConfig

    be = LoraBackend(base_path)
    be.create("ref", LoraShape(rank=8, seed=0))
    for tokens in SEQS:
        be.run_pass([PassRequest("r", "ref", PassWork("cross_entropy", LossConfig(), (_datum(tokens),)), False)])
        be.optim_step("ref", AdamParams(**ADAM))
    return be.adapter_state("ref"), be.adapters["ref"].optimizer.state_dict()


def calls_before(model_id: str) -> list[tuple[str, dict]]:
    """(route, body) of the run's calls before the crash: seq 1 forward_backward, 2 optim_step, 3
    forward_backward, whose gradients then live only in the trainer's memory."""
    return [("/forward_backward", fb_body(model_id, 1, [datum(SEQS[0])])),
            ("/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": ADAM}),
            ("/forward_backward", fb_body(model_id, 3, [datum(SEQS[1])]))]


def calls_after(model_id: str, checkpoint: str) -> list[tuple[str, dict]]:
    """(route, body) of the calls after it: seq 4 optim_step, 5 forward_backward, 6 optim_step, 7
    save_weights named `checkpoint` (what `assert_recovered` reads)."""
    return [("/optim_step", {"model_id": model_id, "seq_id": 4, "adam_params": ADAM}),
            ("/forward_backward", fb_body(model_id, 5, [datum(SEQS[2])])),
            ("/optim_step", {"model_id": model_id, "seq_id": 6, "adam_params": ADAM}),
            ("/save_weights", {"model_id": model_id, "seq_id": 7, "path": checkpoint})]


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def assert_equals_reference(storage: str, base_path: str) -> None:
    """The training checkpoint in `storage` holds the reference's weights and AdamW state."""
    weights, optimizer = reference(base_path)
    saved = load_file(str(Path(storage) / ADAPTER_WEIGHTS))
    assert set(saved) == set(weights)
    for key, expected in weights.items():
        assert relative(saved[key], expected.detach().cpu()) <= RELATIVE, key
    saved_opt = torch.load(Path(storage) / OPTIMIZER_FILE, weights_only=True)
    for i, state in optimizer["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert relative(saved_opt["state"][i][name], state[name]) <= RELATIVE, (i, name)
        assert float(saved_opt["state"][i]["step"]) == float(state["step"]) == len(SEQS)


def assert_recovered(database_url: str, model_id: str, checkpoint: str) -> None:
    """After a crash and recovery of the run above (seq 1, 3, 5 forward_backward; 2, 4, 6 optim_step,
    then a save named `checkpoint`): every forward_backward billed exactly once, replayed or not, and
    the checkpoint equals the uninterrupted run."""
    from stackutil import TINY

    from bases import catalog
    from core import db

    with db.connect(database_url) as conn:
        base_path = catalog.get_model_sync(conn, TINY).path
        storage = conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = %s",
                               (model_id, checkpoint)).fetchone()["storage_path"]
        billed = conn.execute("SELECT r.seq_id, count(u.id) AS n FROM requests r LEFT JOIN usage_ledger u "
                              "ON u.request_id = r.id WHERE r.model_id = %s AND r.kind = 'forward_backward' "
                              "GROUP BY r.seq_id ORDER BY r.seq_id", (model_id,)).fetchall()
    assert [(b["seq_id"], b["n"]) for b in billed] == [(1, 1), (3, 1), (5, 1)]  # each once, replay or not
    assert_equals_reference(storage, base_path)
