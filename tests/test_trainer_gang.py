"""A trainer gang (batcher.engine.gang) against the single-process trainer: gangs on gloo, started by
torch.distributed.run as `quilt up --trainer-ranks N` starts them, train four tenants for three
steps in float64 and must match one process to 1e-9: every adapter, every AdamW moment, every
datum's loss outputs; a checkpoint it saves loads back exactly. Tensor parallel on all six tiny
architectures, FSDP and expert parallel on the tiny Qwen3-MoE with LoRA on its experts (which a
tensor-parallel gang, splitting each expert, refuses), expert parallel on four ranks of it (one expert
each: every MoE block's tokens dispatched to their experts' ranks, batcher.engine.dispatch) and on
the tiny gpt-oss (experts stored transposed, with biases). Rank 0 drives the other ranks through the
same protocol the trainer loop uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gang_scenario import overflow, run

from batcher.engine import gang
from batcher.engine.backend import LoraBackend
from core.work import LoraShape
from stack.tiny_model import TinyModelSpec, build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.stack  # several real processes


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gang")
    return {arch: build_tiny_model(root / arch, spec=TinyModelSpec(architecture=arch)).path
            for arch in ("qwen3", "qwen3_moe", "llama", "qwen2", "mistral", "gemma3_text", "gpt_oss")}


def _gang(base: Path, parallel: str, out: Path, ranks: int = 2) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "sdk"), str(ROOT / "tests")]),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                           str(ROOT / "tests" / "gang_scenario.py"), str(base), parallel, str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out, weights_only=False)


def test_a_gang_over_two_nodes_trains_as_one_process_does(bases, tmp_path):
    """Two torch.distributed.run agents, one rank each, meeting through the c10d rendezvous as two
    machines' agents would (here on one machine; deploy/k8s/overlays/gpu-gang-nodes on a cluster)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "gang").mkdir()
    out = tmp_path / "gang" / "result.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "sdk"), str(ROOT / "tests")]),
           "HF_HUB_OFFLINE": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                                "two-nodes", str(ROOT / "tests" / "gang_scenario.py"), str(bases["qwen3"]), "tp",
                                str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    logs = [a.communicate(timeout=600)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    got = torch.load(out, weights_only=False)
    expected = run(LoraBackend(bases["qwen3"], dtype=torch.float64), tmp_path)
    for model_id, state in expected["adapters"].items():
        for key, tensor in state.items():
            # to 1e-9 of the tensor's scale: AdamW divides by the root of tiny second moments, which
            # magnifies the gang's other order of summation (seen: 5e-12 on a weight of scale 9e-3)
            torch.testing.assert_close(got["adapters"][model_id][key], tensor, rtol=1e-9,
                                       atol=1e-9 * tensor.abs().max().item() + 1e-15, msg=f"{model_id} {key}")


@pytest.mark.parametrize("arch,parallel,ranks", [
    ("qwen3", "tp", 2), ("qwen3_moe", "ep", 2), ("gpt_oss", "ep", 2), ("qwen3_moe", "fsdp", 2), ("qwen3", "fsdp", 2),
    ("qwen3_moe", "tp", 2), ("llama", "tp", 2), ("qwen2", "tp", 2), ("mistral", "tp", 2), ("gemma3_text", "tp", 2),
    # four ranks of one expert each, wider than the tiny base's two KV heads would let a tensor-parallel gang be
    pytest.param("qwen3_moe", "ep", 4, marks=pytest.mark.extended)])
def test_a_gang_trains_as_one_process_does(bases, tmp_path, arch, parallel, ranks):
    (tmp_path / "gang").mkdir()
    got = _gang(bases[arch], parallel, tmp_path / "gang" / "result.pt", ranks)
    alone = LoraBackend(bases[arch], dtype=torch.float64)
    expected = run(alone, tmp_path, experts=not (arch == "qwen3_moe" and parallel == "tp"))

    # Each rank held only its part of the base; an expert-parallel gang sent its MoE blocks' tokens to
    # their experts' ranks (batcher.engine.dispatch), every pass and every layer.
    assert got["held"] < 0.75 * sum(p.numel() for p in alone.base.parameters()), got["held"]
    assert (got["dispatches"] > 0) == (parallel == "ep"), got["dispatches"]
    for model_id, state in expected["adapters"].items():
        assert got["adapters"][model_id].keys() == state.keys()
        for key, tensor in state.items():
            # to 1e-9 of the tensor's scale: AdamW divides by the root of tiny second moments, which
            # magnifies the gang's other order of summation (seen: 5e-12 on a weight of scale 9e-3)
            torch.testing.assert_close(got["adapters"][model_id][key], tensor, rtol=1e-9,
                                       atol=1e-9 * tensor.abs().max().item() + 1e-15, msg=f"{model_id} {key}")
    for model_id, moments in expected["moments"].items():
        for i, entry in moments.items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["moments"][model_id][i][key], entry[key], rtol=1e-9, atol=1e-15,
                                           msg=f"{model_id} {i} {key}")
            assert float(got["moments"][model_id][i]["step"]) == float(entry["step"]) >= 3
    # The saved and loaded copy is t1, and the restored snapshot t3, to the last bit, in the gang as alone.
    for copy, model_id in (("t1-copy", "t1"), ("t3-restored", "t3")):
        for key, tensor in got["adapters"][model_id].items():
            assert torch.equal(got["adapters"][copy][key], tensor), (copy, key)
    for i, entry in got["moments"]["t3"].items():
        assert all(torch.equal(got["moments"]["t3-restored"][i][k], entry[k]) for k in ("exp_avg", "exp_avg_sq"))
    # The gang's snapshot holds each rank's shares (torch.distributed.checkpoint); one process reads it whole.
    snapshot = tmp_path / "gang" / "t3-snapshot"
    assert (snapshot / ".metadata").is_file() and len(list(snapshot.glob("*.distcp"))) == ranks
    alone.create("from-gang", LoraShape.from_json(alone.adapters["t3"].lora_config))
    alone.load_snapshot("from-gang", str(snapshot))
    for key, tensor in got["adapters"]["t3"].items():
        assert torch.equal(alone.adapter_state("from-gang")[key], tensor), key
    assert alone.adapters["from-gang"].steps == 3
    for i, entry in got["moments"]["t3"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(alone.optimizer_state("from-gang")["state"][i][k], entry[k]), (i, k)
    # Every round's gradients after its backward, before its steps: rank 0's shares of the whole ones
    # (its columns or rows of a tensor-parallel layer's, its experts' under expert parallel).
    for round_got, round_expected in zip(got["grads"], expected["grads"], strict=True):
        for model_id, grads in round_expected.items():
            for i, ((g_got, axis, index, count), (g_expected, *_)) in enumerate(zip(round_got[model_id], grads,
                                                                                   strict=True)):
                if axis is not None:
                    size = g_expected.shape[axis] // count
                    g_expected = g_expected.narrow(axis, index * size, size)
                torch.testing.assert_close(g_got, g_expected, rtol=1e-9, atol=1e-9 * g_expected.abs().max().item() + 1e-15,
                                           msg=f"{model_id} gradient {i}")
    # A datum that overflows fails its request alone, in the gang as in one process.
    alone_overflow = overflow(alone)
    assert got["overflow"]["failed"] == alone_overflow["failed"] == ("UserError", "forward_backward_input.data")
    assert not got["overflow"]["t2_pending"] and not alone_overflow["t2_pending"]
    for datum_got, datum_expected in zip(got["overflow"]["answered"], alone_overflow["answered"], strict=True):
        torch.testing.assert_close(torch.tensor(datum_got["logprobs"]["data"]),
                                   torch.tensor(datum_expected["logprobs"]["data"]), rtol=1e-9, atol=1e-12)
    if alone_overflow["t3_grads"] is not None and got["overflow"]["t3_grads"] is not None:
        for g_got, g_expected in zip(got["overflow"]["t3_grads"], alone_overflow["t3_grads"], strict=True):
            torch.testing.assert_close(g_got, g_expected, rtol=1e-9, atol=1e-9 * g_expected.abs().max().item() + 1e-15)
    if parallel == "fsdp":
        # t2's good datum ran on rank 0, which kept its gradient before rank 1's overflowed: all of
        # t2's accumulated gradients go, and its error says so (one process, whose one micro-batch
        # held both, kept none of that request's)
        assert "were discarded" in got["overflow"]["message"], got["overflow"]["message"]
        assert "no gradient of this request was accumulated" in alone_overflow["message"], alone_overflow["message"]
        # Data parallel: FSDP's gradients are whole, and rank 0 computed only its share of each pass.
        assert all(axis is None for round_got in got["grads"] for grads in round_got.values() for _, axis, _, _ in grads)
        assert got["stats"][0].tokens == expected["stats"][0].tokens
        assert got["stats"][0].padded_tokens < 0.75 * expected["stats"][0].padded_tokens, (got["stats"][0],
                                                                                           expected["stats"][0])
    for step_got, step_expected in zip(got["outputs"], expected["outputs"], strict=True):
        for request_got, request_expected in zip(step_got, step_expected, strict=True):
            for datum_got, datum_expected in zip(request_got, request_expected, strict=True):
                for key, value in datum_expected.items():
                    torch.testing.assert_close(torch.tensor(datum_got[key]["data"]), torch.tensor(value["data"]),
                                               rtol=1e-9, atol=1e-12, msg=key)


@pytest.mark.parametrize("shape,config,problem", [
    (gang.GangShape(2, "tp"), {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 768}, None),
    (gang.GangShape(4, "tp"), {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 768},
     "num_key_value_heads=2 is not divisible by 4"),
    (gang.GangShape(2, "ep"), {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 768},
     "expert parallel needs a mixture-of-experts base"),
    (gang.GangShape(2, "ep"), {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 3},
     "3 experts are not divisible by 2"),
    (gang.GangShape(8, "fsdp"), {"num_attention_heads": 4, "num_key_value_heads": 2}, None),
    (gang.GangShape(2, "tp"), {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151655},
     "vocab_size=151655 is not divisible by 2"),
    # an expert-parallel gang keeps attention and each expert whole: Qwen3-235B-A22B's 4 KV heads on 8 ranks
    (gang.GangShape(8, "ep"), {"num_attention_heads": 64, "num_key_value_heads": 4, "num_experts": 128,
                               "moe_intermediate_size": 1536, "intermediate_size": 12288, "vocab_size": 151936}, None),
    (gang.GangShape(4, "ep"), {"num_attention_heads": 8, "num_key_value_heads": 4, "num_experts": 8,
                               "vocab_size": 151655}, "vocab_size=151655 is not divisible by 4"),
    (gang.GangShape(1, "tp"), {"num_attention_heads": 3}, None),
    # a gang loads the causal LM alone: a vision base's tower would be missing
    (gang.GangShape(2, "fsdp"), {"text_config": {"num_attention_heads": 4}, "vision_config": {"depth": 2}},
     "trainer_ranks=2: a vision base trains in one process"),
    (gang.GangShape(2, "tp"), {"text_config": {"num_attention_heads": 4, "num_key_value_heads": 2},
                               "vision_config": {"depth": 2}}, "a vision base"),
    (gang.GangShape(1, "tp"), {"text_config": {"num_attention_heads": 4}, "vision_config": {"depth": 2}}, None),
])
def test_which_bases_a_gang_shape_can_split(shape, config, problem):
    problems = gang.check_shape(shape, config)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("ranks,parallel", [(0, "tp"), (2, "pp")])
def test_a_gang_shape_refuses_what_it_cannot_be(ranks, parallel):
    with pytest.raises(ValueError):
        gang.GangShape(ranks, parallel)
